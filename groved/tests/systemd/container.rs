//! A throwaway container with a real systemd as PID 1: `systemd-nspawn -b` of the systemd root that
//! scripts/setup builds, on a volatile overlay (writes go to a tmpfs and vanish), with its own network
//! namespace, /dev/fuse, the freshly built binaries at /opt/grove-build and the base image root.
//! Dropping it powers the container off and removes what nspawn leaves on the host.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const SYSTEMD_ROOT: &str = "/var/lib/grove/images/systemd-bookworm";
pub const BASE_IMAGE: &str = "/var/lib/grove/images/debian12";
/// Where the build directory (groved, grove, grove-init) appears inside.
pub const BUILD: &str = "/opt/grove-build";

pub struct Container {
    pub name: String,
    nspawn: Child,
    /// Host pid of the container's systemd.
    pub pid1: i32,
    log: PathBuf,
}

impl Container {
    pub fn boot(build_dir: &Path, log: PathBuf) -> Container {
        assert!(
            Path::new(SYSTEMD_ROOT).join(".grove-complete").exists(),
            "{SYSTEMD_ROOT} is missing: run scripts/setup (it builds the systemd root once)"
        );
        let name = format!("grove-sd-{:x}", std::process::id());
        assert_ne!(name, cgroup_root());
        let out = std::fs::File::create(&log).unwrap();
        let nspawn = Command::new("systemd-nspawn")
            .args(["--quiet", "--directory", SYSTEMD_ROOT, "--volatile=overlay"])
            .args(["--register=no", "--keep-unit", "--private-network"])
            .arg(format!("--machine={name}"))
            .arg("--bind=/dev/fuse")
            .arg(format!("--bind-ro={}:{BUILD}", build_dir.display()))
            .arg(format!("--bind-ro={BASE_IMAGE}"))
            .arg("--boot")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("systemd-nspawn");
        let mut c = Container {
            name,
            pid1: 0,
            nspawn,
            log,
        };
        c.pid1 = c.wait_for_pid1();
        c.wait_until("systemd finished booting", Duration::from_secs(60), |c| {
            let s = c.sh("systemctl is-system-running");
            let s = String::from_utf8_lossy(&s.stdout);
            matches!(s.trim(), "running" | "degraded")
        });
        c.make_cgroups_writable();
        c
    }

    fn wait_for_pid1(&mut self) -> i32 {
        let pid = self.nspawn.id();
        let t = Instant::now();
        loop {
            if let Some(st) = self.nspawn.try_wait().unwrap() {
                panic!("systemd-nspawn exited ({st}): {}", self.log());
            }
            for c in grove_sys::proc::children(pid as i32) {
                let comm = std::fs::read_to_string(format!("/proc/{c}/comm")).unwrap_or_default();
                if comm.trim() == "systemd" {
                    return c;
                }
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "no container init: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// nspawn mounts the v1 controller hierarchies read-only in a container; groved makes its sandbox
    /// cgroups there, so they are made writable (from the host, which holds the capability).
    fn make_cgroups_writable(&self) {
        let dir = self.host_path("/sys/fs/cgroup");
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name == "unified" || name == "systemd" || !e.path().is_dir() {
                continue;
            }
            let st = Command::new("nsenter")
                .args(["-t", &self.pid1.to_string(), "-m", "--"])
                .args(["mount", "-o", "remount,bind,rw"])
                .arg(format!("/sys/fs/cgroup/{name}"))
                .status()
                .unwrap();
            assert!(st.success(), "remounting /sys/fs/cgroup/{name} rw");
        }
    }

    /// Runs a shell command inside (all of the container's namespaces).
    pub fn sh(&self, script: &str) -> Output {
        Command::new("nsenter")
            .args([
                "-t",
                &self.pid1.to_string(),
                "-a",
                "--",
                "/bin/sh",
                "-c",
                script,
            ])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// Like `sh`, asserting success; returns stdout, trimmed.
    pub fn ok(&self, script: &str) -> String {
        let o = self.sh(script);
        assert!(
            o.status.success(),
            "{script}: {}\n{}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    /// A unit property (`systemctl show -p P --value`).
    pub fn prop(&self, unit: &str, p: &str) -> String {
        self.ok(&format!("systemctl show -p {p} --value {unit}"))
    }

    /// A path inside, as the host reaches it.
    pub fn host_path(&self, p: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{p}", self.pid1))
    }

    pub fn write(&self, p: &str, text: &str) {
        let hp = self.host_path(p);
        std::fs::create_dir_all(hp.parent().unwrap()).unwrap();
        std::fs::write(&hp, text).unwrap_or_else(|e| panic!("writing {p} inside: {e}"));
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Polls `f` every 100 ms until it holds; panics with the unit's journal after `limit`.
    pub fn wait_until(&self, what: &str, limit: Duration, mut f: impl FnMut(&Container) -> bool) {
        let t = Instant::now();
        while !f(self) {
            if t.elapsed() > limit {
                let j = self.sh("journalctl -b --no-pager -n 60");
                panic!(
                    "timed out after {limit:?} waiting for {what}\njournal:\n{}",
                    String::from_utf8_lossy(&j.stdout)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn power_off(&mut self) {
        // SAFETY: kill(2) on our own child's pid, not yet reaped: nspawn turns SIGTERM into an orderly
        // shutdown of the container's systemd.
        unsafe { libc::kill(self.nspawn.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while self.nspawn.try_wait().unwrap().is_none() {
            if t.elapsed() > Duration::from_secs(30) {
                let _ = self.nspawn.kill();
                let _ = self.nspawn.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// What nspawn leaves on a host whose PID 1 is not systemd (its `payload`/`supervisor` cgroups and
    /// its /run/systemd/nspawn state), and the v1 cgroups of sandboxes the container's groved left running.
    fn remove_nspawn_leftovers(&self) {
        for h in ["systemd", "unified"] {
            for top in ["payload", "supervisor"] {
                rmdir_tree(&Path::new("/sys/fs/cgroup").join(h).join(top));
            }
        }
        if let Ok(hier) = std::fs::read_dir("/sys/fs/cgroup") {
            for h in hier.flatten() {
                rmdir_tree(&h.path().join(cgroup_root()));
            }
        }
        let _ = std::fs::remove_dir_all(format!("/run/systemd/nspawn/propagate/{}", self.name));
        for d in ["propagate", "locks", ""] {
            let _ = std::fs::remove_dir(Path::new("/run/systemd/nspawn").join(d));
        }
    }
}

/// The `cgroup_root` groved gets inside: the container shares the host's v1 hierarchies, so sandbox
/// cgroups a powered-off container leaves behind are found (and removed) by this name.
pub fn cgroup_root() -> String {
    format!("grove-sd{:x}", std::process::id())
}

/// Removes an (empty of processes) cgroup tree, leaves first.
fn rmdir_tree(dir: &Path) {
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                rmdir_tree(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

impl Drop for Container {
    fn drop(&mut self) {
        self.power_off();
        self.remove_nspawn_leftovers();
    }
}
