//! The peer runtimes Grove is measured against: an `unshare` floor, bubblewrap, crun and podman, each on the
//! same base image root. Each can run one `true` cycle and start/stop an idle `sleep infinity` sandbox.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{bail, Context, Result};

use crate::cleanup::Guard;
use crate::util;

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A fresh container name with the bench's pid in it, so residue checks can find it.
pub fn unique_name(kind: &str) -> String {
    format!(
        "grove-bench-{}-{kind}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// Which peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Unshare,
    Bwrap,
    Crun,
    Podman,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Unshare => "unshare (floor)",
            Kind::Bwrap => "bwrap",
            Kind::Crun => "crun",
            Kind::Podman => "podman",
        }
    }
    pub fn binary(self) -> &'static str {
        match self {
            Kind::Unshare => "unshare",
            Kind::Bwrap => "bwrap",
            Kind::Crun => "crun",
            Kind::Podman => "podman",
        }
    }
}

/// Everything the peers need, prepared once per run (bundles, podman config and image).
pub struct PeerEnv {
    pub root: PathBuf,
    /// OCI bundle running `true`.
    pub crun_true: PathBuf,
    /// OCI bundle running `sleep infinity`.
    pub crun_sleep: PathBuf,
    pub containers_conf: PathBuf,
    /// Set once the podman image exists (imported by this run or found).
    pub podman_image: Option<String>,
    pub podman_error: Option<String>,
    _podman_image_guard: std::sync::Mutex<Option<Guard>>,
}

pub const PODMAN_IMAGE: &str = "localhost/grove-bench-debian12:latest";
pub const PODMAN_LABEL: &str = "grove-bench";

impl PeerEnv {
    /// Writes the bundles and podman config under `work`; imports the podman image if `podman` is wanted.
    pub fn prepare(root: &Path, work: &Path, podman: bool) -> Result<Self> {
        let crun_true = work.join("bundle-true");
        let crun_sleep = work.join("bundle-sleep");
        for (dir, args) in [
            (&crun_true, vec!["true"]),
            (&crun_sleep, vec!["sleep", "infinity"]),
        ] {
            if let Err(e) = write_bundle(dir, root, &args) {
                eprintln!("grove-bench: crun bundle: {e:#}");
            }
        }
        let containers_conf = work.join("containers.conf");
        // No CAP_SYS_RESOURCE here: rlimits may only go down, so give podman explicit low ones; cgroupfs since
        // systemd is not pid 1.
        std::fs::write(
            &containers_conf,
            "[containers]\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]\nnetns = \"none\"\n\
             [engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\nruntime = \"crun\"\n",
        )?;
        let mut env = PeerEnv {
            root: root.into(),
            crun_true,
            crun_sleep,
            containers_conf,
            podman_image: None,
            podman_error: None,
            _podman_image_guard: std::sync::Mutex::new(None),
        };
        if podman {
            match env.import_podman_image() {
                Ok(()) => {}
                Err(e) => env.podman_error = Some(format!("{e:#}")),
            }
        }
        Ok(env)
    }

    pub fn podman(&self) -> Command {
        let mut c = Command::new("podman");
        c.env("CONTAINERS_CONF", &self.containers_conf);
        c
    }

    /// `podman import` of a tar of the base image root, once; removed at the end only if this run made it.
    fn import_podman_image(&mut self) -> Result<()> {
        util::which("podman").context("podman not installed")?;
        let exists = self
            .podman()
            .args(["image", "exists", PODMAN_IMAGE])
            .status()?
            .success();
        if !exists {
            crate::progress::step(0.0, "podman import of the base image (once per run)");
            let script = format!(
                "tar -C '{}' -cf - . | CONTAINERS_CONF='{}' podman import - {PODMAN_IMAGE}",
                self.root.display(),
                self.containers_conf.display()
            );
            util::sh(&script).context("podman import")?;
            let conf = self.containers_conf.clone();
            *self
                ._podman_image_guard
                .get_mut()
                .unwrap_or_else(|e| e.into_inner()) = Some(Guard::new("podman image", move || {
                let mut c = Command::new("podman");
                c.env("CONTAINERS_CONF", conf)
                    .args(["rmi", "-f", PODMAN_IMAGE]);
                util::run(&mut c).map(|_| ()).map_err(|e| format!("{e:#}"))
            }));
        }
        self.podman_image = Some(PODMAN_IMAGE.into());
        Ok(())
    }

    /// Why `kind` cannot run here, if it cannot.
    pub fn unavailable(&self, kind: Kind) -> Option<String> {
        if util::which(kind.binary()).is_none() {
            return Some(format!("{} not installed", kind.binary()));
        }
        match kind {
            Kind::Crun if !self.crun_true.join("config.json").is_file() => {
                Some("no OCI bundle (crun spec failed)".into())
            }
            Kind::Podman if self.podman_image.is_none() => Some(
                self.podman_error
                    .clone()
                    .unwrap_or_else(|| "podman image not imported".into()),
            ),
            _ => None,
        }
    }

    /// One create → `true` → destroy cycle.
    pub fn cycle(&self, kind: Kind) -> Result<()> {
        let root = &self.root;
        match kind {
            Kind::Unshare => {
                let mut c = Command::new("unshare");
                c.arg("-fmpn")
                    .arg(format!("--mount-proc={}/proc", root.display()));
                c.arg("chroot").arg(root).arg("true");
                util::run(&mut c)?;
            }
            Kind::Bwrap => {
                util::run(bwrap(root).arg("true"))?;
            }
            Kind::Crun => {
                let name = unique_name("crun");
                let mut c = Command::new("crun");
                c.arg("run").arg("--bundle").arg(&self.crun_true).arg(&name);
                let r = util::run(&mut c);
                if r.is_err() {
                    let _ = Command::new("crun").args(["delete", "-f", &name]).output();
                }
                r?;
            }
            Kind::Podman => {
                let mut c = self.podman();
                c.args(["run", "--rm", "--network", "none", "--runtime", "crun"]);
                c.args(["--label", PODMAN_LABEL, PODMAN_IMAGE, "true"]);
                util::run(&mut c)?;
            }
        }
        Ok(())
    }

    /// Starts an idle `sleep infinity` sandbox.
    pub fn start_idle(&self, kind: Kind) -> Result<Idle> {
        match kind {
            Kind::Bwrap => {
                let child = bwrap(&self.root)
                    .args(["sleep", "infinity"])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .context("spawn bwrap")?;
                Ok(Idle::Child(child))
            }
            Kind::Crun => {
                let name = unique_name("idle");
                // The detached container keeps inherited descriptors open: give it a log file, not a pipe
                // (reading a pipe to EOF would wait for the container to end).
                let log = self.crun_sleep.with_file_name(format!("{name}.log"));
                let f = std::fs::File::create(&log)?;
                let mut c = Command::new("crun");
                c.arg("run")
                    .arg("-d")
                    .arg("--bundle")
                    .arg(&self.crun_sleep)
                    .arg(&name);
                c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(f);
                let st = c.status().context("spawn crun run -d")?;
                let msg = std::fs::read_to_string(&log).unwrap_or_default();
                let _ = std::fs::remove_file(&log);
                if !st.success() {
                    let _ = Command::new("crun").args(["delete", "-f", &name]).output();
                    bail!("crun run -d {name} failed ({st}): {}", msg.trim());
                }
                Ok(Idle::Crun(name))
            }
            k => bail!("{} has no idle mode in this bench", k.name()),
        }
    }
}

fn bwrap(root: &Path) -> Command {
    let mut c = Command::new("bwrap");
    c.arg("--unshare-all").arg("--die-with-parent");
    c.arg("--ro-bind").arg(root).arg("/");
    c.args(["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]);
    c
}

/// A running idle peer sandbox.
pub enum Idle {
    Child(Child),
    Crun(String),
}

impl Idle {
    pub fn stop(self) -> Result<()> {
        match self {
            Idle::Child(mut c) => {
                let _ = c.kill();
                c.wait().context("wait bwrap")?;
            }
            Idle::Crun(name) => {
                util::run(Command::new("crun").args(["delete", "-f", &name]))?;
            }
        }
        Ok(())
    }
}

/// Writes an OCI bundle (from `crun spec`) running `args` read-only on `root`, with memory and pids limits so
/// crun sets up cgroups as Grove does.
fn write_bundle(dir: &Path, root: &Path, args: &[&str]) -> Result<()> {
    if dir.join("config.json").is_file() {
        return Ok(()); // written by an earlier scenario of this run
    }
    std::fs::create_dir_all(dir)?;
    util::run(Command::new("crun").arg("spec").current_dir(dir))?;
    let path = dir.join("config.json");
    let mut c: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    c["root"] = serde_json::json!({"path": root, "readonly": true});
    c["process"]["args"] = serde_json::json!(args);
    c["process"]["terminal"] = serde_json::json!(false);
    c["linux"]["resources"]["memory"] = serde_json::json!({"limit": 512u64 << 20});
    c["linux"]["resources"]["pids"] = serde_json::json!({"limit": 1024});
    std::fs::write(&path, serde_json::to_vec_pretty(&c)?)?;
    Ok(())
}

/// Debian's crun refuses hybrid cgroups while hugetlb sits on cgroup2; binding hugetlb to a temporary v1
/// hierarchy for the duration works around it. The guard unmounts it (hugetlb then returns to cgroup2).
pub fn hugetlb_workaround() -> Result<Option<Guard>> {
    let ctl =
        std::fs::read_to_string("/sys/fs/cgroup/unified/cgroup.controllers").unwrap_or_default();
    if !ctl.split_whitespace().any(|c| c == "hugetlb") {
        return Ok(None);
    }
    let dir = PathBuf::from("/sys/fs/cgroup/hugetlb");
    if dir.exists() {
        return Ok(None);
    }
    std::fs::create_dir(&dir).context("mkdir /sys/fs/cgroup/hugetlb")?;
    let r = util::run(
        Command::new("mount")
            .args(["-t", "cgroup", "-o", "hugetlb", "cgroup"])
            .arg(&dir),
    );
    let undo = move || {
        let r = util::unmount(&dir);
        let _ = std::fs::remove_dir(&dir);
        r
    };
    if let Err(e) = r {
        let _ = undo();
        return Err(e);
    }
    Ok(Some(Guard::new("temporary hugetlb v1 mount", undo)))
}
