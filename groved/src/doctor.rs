//! `grove doctor`: host checks, each pass/fail with the fix for a fail.
//!
//! Checks probe the real thing where it is cheap (open /dev/fuse, create
//! namespaces, set up an io_uring, run `criu check`) rather than trusting
//! version numbers alone.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Whether a failing check stops Grove from working.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    Required,
    Optional,
}

/// The outcome of one host check.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: &'static str,
    pub need: Need,
    pub ok: bool,
    pub detail: String,
    pub fix: &'static str,
}

impl Check {
    fn new(
        name: &'static str,
        need: Need,
        fix: &'static str,
        result: Result<String, String>,
    ) -> Self {
        let (ok, detail) = match result {
            Ok(d) => (true, d),
            Err(d) => (false, d),
        };
        Self {
            name,
            need,
            ok,
            detail,
            fix,
        }
    }
}

/// Runs every check.
pub fn checks() -> Vec<Check> {
    use Need::*;
    vec![
        Check::new(
            "kernel",
            Required,
            "Grove needs Linux >= 5.15; FUSE passthrough needs >= 6.9",
            kernel(),
        ),
        Check::new(
            "/dev/fuse",
            Required,
            "modprobe fuse; create the node with mknod /dev/fuse c 10 229",
            dev_fuse(),
        ),
        Check::new(
            "fusermount3",
            Optional,
            "apt-get install fuse3 (scripts/setup does)",
            which("fusermount3"),
        ),
        Check::new(
            "fuse passthrough",
            Optional,
            "upgrade to kernel >= 6.9 built with CONFIG_FUSE_PASSTHROUGH",
            passthrough(),
        ),
        Check::new(
            "fuse over io_uring",
            Optional,
            "kernel >= 6.14 with CONFIG_FUSE_IO_URING, and Y in \
             /sys/module/fuse/parameters/enable_uring (the server sets it when it can)",
            fuse_uring(
                std::fs::read_to_string(ENABLE_URING).ok().as_deref(),
                nodefs::ServerOptions::from_env().uring,
            ),
        ),
        Check::new(
            "cgroups",
            Required,
            "mount cgroup v2 at /sys/fs/cgroup, or v1 hierarchies for cpu, memory, pids, freezer",
            cgroups(),
        ),
        Check::new(
            "cgroup moves",
            Optional,
            "groved turns favordynmods on at start (favor_cgroup_moves = true, the default); \
             without it each move of a task into a cgroup waits out an RCU grace period",
            cgroup_moves(),
        ),
        Check::new(
            "devices",
            Required,
            "sandboxes need a device allowlist: mount the cgroup v1 devices hierarchy at \
             /sys/fs/cgroup/devices, or (cgroup v2) a kernel with CONFIG_CGROUP_BPF",
            devices(Path::new("/sys/fs/cgroup"), |d| {
                grove_runtime::cgroup::attach_device_filter(d)
            }),
        ),
        Check::new(
            "namespaces",
            Required,
            "run as root on a kernel with user, pid, net, mount, uts and ipc namespaces",
            namespaces(),
        ),
        Check::new(
            "nftables",
            Required,
            "apt-get install nftables (scripts/setup does)",
            nftables(),
        ),
        Check::new(
            "criu",
            Required,
            "run scripts/setup (installs CRIU >= 4.1 into /var/lib/grove/criu)",
            criu(),
        ),
        Check::new(
            "io_uring",
            Optional,
            "enable io_uring (sysctl kernel.io_uring_disabled=0)",
            io_uring(),
        ),
        Check::new(
            "kvm",
            Optional,
            "only needed for a future microVM tier",
            kvm(),
        ),
    ]
}

/// Prints the table and returns the process exit code: non-zero when a
/// required check fails.
pub fn run() -> i32 {
    let checks = checks();
    print!("{}", render(&checks));
    i32::from(checks.iter().any(|c| !c.ok && c.need == Need::Required))
}

/// Renders checks as an aligned table, with the fix under each failure.
pub fn render(checks: &[Check]) -> String {
    let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    let mut out = String::new();
    for c in checks {
        let status = match (c.ok, c.need) {
            (true, _) => "ok  ",
            (false, Need::Required) => "FAIL",
            (false, Need::Optional) => "warn",
        };
        let _ = writeln!(out, "{status}  {:<width$}  {}", c.name, c.detail);
        if !c.ok {
            let _ = writeln!(out, "      {:<width$}  fix: {}", "", c.fix);
        }
    }
    out
}

fn kernel_version() -> Option<(u32, u32)> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    let mut parts = release.trim().split(['.', '-']);
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

fn kernel() -> Result<String, String> {
    match kernel_version() {
        Some(v) if v >= (5, 15) => Ok(format!("{}.{}", v.0, v.1)),
        Some(v) => Err(format!("{}.{} is too old", v.0, v.1)),
        None => Err("cannot read /proc/sys/kernel/osrelease".into()),
    }
}

fn dev_fuse() -> Result<String, String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map(|_| "opens read-write".to_string())
        .map_err(|e| format!("cannot open: {e}"))
}

fn passthrough() -> Result<String, String> {
    match kernel_version() {
        Some(v) if v >= (6, 9) => Ok(format!("kernel {}.{} supports FUSE_PASSTHROUGH", v.0, v.1)),
        Some(v) => Err(format!(
            "kernel {}.{} predates FUSE passthrough (6.9)",
            v.0, v.1
        )),
        None => Err("unknown kernel version".into()),
    }
}

/// The fuse module's switch for FUSE over io_uring.
const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// Which transport new nodefs mounts use, from the module switch's text (`None`: the kernel has
/// no such switch) and whether the daemons' environment leaves the ring on (on unless
/// `NODEFS_URING=0`: see `nodefs::ServerOptions::from_env`). A mount's own transport is in its
/// `MountInfo`.
fn fuse_uring(param: Option<&str>, wanted: bool) -> Result<String, String> {
    match param.map(str::trim) {
        None => Err("this kernel has no FUSE over io_uring: nodefs mounts read /dev/fuse".into()),
        Some(_) if !wanted => Ok("available, switched off: nodefs mounts read /dev/fuse \
             (NODEFS_URING=0 in the daemons' environment; unset it to use the ring)"
            .into()),
        Some("Y") => Ok("on: nodefs mounts take FUSE requests over io_uring".into()),
        Some(_) => {
            Err("off: nodefs mounts read /dev/fuse unless the server can switch it on".into())
        }
    }
}

fn which(bin: &str) -> Result<String, String> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(bin))
        .find(|p| p.is_file())
        .map(|p| p.display().to_string())
        .ok_or_else(|| format!("{bin} not on PATH"))
}

/// Whether moving a task into a cgroup skips an RCU grace period (runtime `cgroup::moves`).
fn cgroup_moves() -> Result<String, String> {
    use grove_runtime::cgroup::moves;
    let text = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| e.to_string())?;
    let state = moves::state(&text);
    match state {
        moves::Dynmods::On { .. } => Ok(moves::describe(&state)),
        _ => Err(moves::describe(&state)),
    }
}

fn cgroups() -> Result<String, String> {
    let root = Path::new("/sys/fs/cgroup");
    if let Ok(ctrls) = std::fs::read_to_string(root.join("cgroup.controllers")) {
        let missing: Vec<_> = ["cpu", "memory", "pids"]
            .into_iter()
            .filter(|c| !ctrls.split_whitespace().any(|x| x == *c))
            .collect();
        return if missing.is_empty() {
            Ok(format!("v2: {}", ctrls.trim()))
        } else {
            Err(format!("v2 without {}", missing.join(", ")))
        };
    }
    let wanted = ["cpu", "cpuacct", "memory", "pids", "freezer"];
    let missing: Vec<_> = wanted
        .iter()
        .filter(|c| !root.join(c).join("tasks").exists())
        .collect();
    if missing.is_empty() {
        let unified = root.join("unified/cgroup.procs").exists();
        Ok(format!(
            "v1: {}{}",
            wanted.join(", "),
            if unified {
                " (+ cgroup2 at unified/ for kill/freeze)"
            } else {
                ""
            }
        ))
    } else {
        Err(format!("v1 hierarchies missing: {missing:?}"))
    }
}

/// The device allowlist every sandbox gets: the v1 `devices` controller, or on pure cgroup v2 a
/// BPF device program, probed by attaching one (`attach`) to a scratch cgroup under `root`.
fn devices(root: &Path, attach: impl Fn(&Path) -> std::io::Result<()>) -> Result<String, String> {
    if !root.join("cgroup.controllers").exists() {
        let allow = root.join("devices").join("devices.allow");
        return if allow.exists() {
            Ok("v1 devices controller".into())
        } else {
            Err(format!(
                "no v1 devices hierarchy ({} missing)",
                allow.display()
            ))
        };
    }
    let scratch = root.join(format!("grove-doctor-{}", std::process::id()));
    std::fs::create_dir(&scratch).map_err(|e| format!("mkdir {}: {e}", scratch.display()))?;
    let res = attach(&scratch);
    let _ = std::fs::remove_dir(&scratch);
    res.map(|()| "v2: BPF device program attaches".into())
        .map_err(|e| format!("attaching a BPF device program: {e}"))
}

fn namespaces() -> Result<String, String> {
    let out = Command::new("unshare")
        .args([
            "--user", "--pid", "--net", "--mount", "--uts", "--ipc", "--fork", "true",
        ])
        .output()
        .map_err(|e| format!("cannot run unshare: {e}"))?;
    if out.status.success() {
        Ok("user, pid, net, mount, uts, ipc: created".into())
    } else {
        Err(format!(
            "unshare failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn nftables() -> Result<String, String> {
    let out = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .map_err(|e| format!("cannot run nft: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "nft list tables: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let version = Command::new("nft")
        .arg("--version")
        .output()
        .map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&version.stdout).trim().to_string())
}

/// Where Grove looks for CRIU: `$GROVE_CRIU`, the private prefix set-up
/// installs, then `criu` on PATH.
pub fn criu_candidates() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::env::var_os("GROVE_CRIU")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    v.push(PathBuf::from("/var/lib/grove/criu/criu"));
    if let Ok(p) = which("criu") {
        v.push(PathBuf::from(p));
    }
    v
}

fn criu() -> Result<String, String> {
    let mut tried = Vec::new();
    for bin in criu_candidates().into_iter().filter(|p| p.exists()) {
        let version = Command::new(&bin)
            .arg("--version")
            .output()
            .map_err(|e| e.to_string())?;
        let version = String::from_utf8_lossy(&version.stdout);
        let version = version.lines().next().unwrap_or("").trim().to_string();
        let check = Command::new(&bin)
            .arg("check")
            .output()
            .map_err(|e| e.to_string())?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
        if check.status.success() && text.contains("Looks good") {
            return Ok(format!("{} ({version}): criu check passes", bin.display()));
        }
        let last = text
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
            .trim()
            .to_string();
        tried.push(format!("{} ({version}): {last}", bin.display()));
    }
    if tried.is_empty() {
        Err("no criu found".into())
    } else {
        Err(tried.join("; "))
    }
}

fn io_uring() -> Result<String, String> {
    crate::sys::io_uring_probe().map_err(|e| format!("io_uring_setup: {e}"))?;
    Ok("available to the daemon (denied to sandboxes by seccomp)".into())
}

fn kvm() -> Result<String, String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map(|_| "/dev/kvm opens".to_string())
        .map_err(|e| format!("/dev/kvm: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_marks_failures_with_their_fix() {
        let checks = vec![
            Check::new("a", Need::Required, "fix-a", Ok("fine".into())),
            Check::new("b", Need::Required, "fix-b", Err("broken".into())),
            Check::new("c", Need::Optional, "fix-c", Err("meh".into())),
        ];
        let out = render(&checks);
        assert!(out.contains("ok    a  fine"), "{out}");
        assert!(out.contains("FAIL  b  broken"), "{out}");
        assert!(out.contains("fix: fix-b"), "{out}");
        assert!(out.contains("warn  c  meh"), "{out}");
        assert!(!out.contains("fix-a"), "{out}");
    }

    #[test]
    fn devices_needs_the_v1_controller_or_a_bpf_program() {
        let ok = |_: &Path| Ok(());
        let denied = |_: &Path| Err(std::io::Error::from_raw_os_error(libc::EPERM));
        // v1 without and with the devices hierarchy.
        let v1 = tempfile::tempdir().unwrap();
        assert!(devices(v1.path(), ok).is_err());
        std::fs::create_dir(v1.path().join("devices")).unwrap();
        std::fs::write(v1.path().join("devices/devices.allow"), "").unwrap();
        assert_eq!(devices(v1.path(), denied).unwrap(), "v1 devices controller");
        // v2: the probe decides, and its scratch cgroup is gone afterwards.
        let v2 = tempfile::tempdir().unwrap();
        std::fs::write(v2.path().join("cgroup.controllers"), "memory pids").unwrap();
        assert!(devices(v2.path(), ok).unwrap().contains("BPF"));
        let err = devices(v2.path(), denied).unwrap_err();
        assert!(err.contains("BPF device program"), "{err}");
        let left: Vec<_> = std::fs::read_dir(v2.path()).unwrap().flatten().collect();
        assert_eq!(left.len(), 1, "{left:?}");
        // This host, for real.
        let host = checks().into_iter().find(|c| c.name == "devices").unwrap();
        assert!(host.ok, "{}", host.detail);
    }

    #[test]
    fn fuse_uring_says_which_transport_mounts_use() {
        assert!(fuse_uring(Some("Y\n"), true)
            .unwrap()
            .starts_with("on: nodefs mounts take FUSE requests over io_uring"));
        assert!(fuse_uring(Some("N\n"), true)
            .unwrap_err()
            .contains("/dev/fuse"));
        assert!(fuse_uring(Some("Y\n"), false)
            .unwrap()
            .contains("NODEFS_URING=0"));
        assert!(fuse_uring(None, true)
            .unwrap_err()
            .contains("no FUSE over io_uring"));
    }

    #[test]
    fn host_checks_run_and_report() {
        // Every check must produce a detail line whether it passes or not.
        for c in checks() {
            assert!(!c.detail.is_empty(), "{} gave no detail", c.name);
        }
    }
}
