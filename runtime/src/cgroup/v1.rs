//! cgroup v1: one dir per controller hierarchy (`<base>/<ctrl>/<root>/<id>`), plus the controller-less
//! cgroup2 mount (`<unified>/<root>/<id>`) for kill/freeze/populated when present; without it the v1
//! freezer is used and processes are SIGKILLed one by one.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{
    controllers, daemon, unified, CgroupBackend, CgroupError, CgroupFs, CgroupUsage, Controller,
    Result,
};
use crate::types::Limits;
use daemon::mkdir_p;

pub struct V1 {
    fs: Arc<dyn CgroupFs>,
    base: PathBuf,
    root: String,
    ctrls: Vec<Box<dyn Controller>>,
    unified: Option<PathBuf>,
}

impl V1 {
    pub fn new(fs: Arc<dyn CgroupFs>, base: PathBuf, root: &str, unified: Option<PathBuf>) -> Self {
        V1 {
            fs,
            base,
            root: root.to_string(),
            ctrls: controllers(),
            unified,
        }
    }

    /// Hierarchy names in use (the v1 freezer only when there is no cgroup2 mount).
    fn hierarchies(&self) -> Vec<&'static str> {
        let mut h: Vec<&'static str> = self.ctrls.iter().map(|c| c.v1_name()).collect();
        if self.unified.is_none() {
            h.push("freezer");
        }
        h
    }

    fn dir(&self, hier: &str, id: &str) -> PathBuf {
        self.base.join(hier).join(&self.root).join(id)
    }

    fn unified_dir(&self, id: &str) -> Option<PathBuf> {
        self.unified.as_ref().map(|u| u.join(&self.root).join(id))
    }

    /// Every dir of `id`, whether it exists or not.
    fn all_dirs(&self, id: &str) -> Vec<PathBuf> {
        let mut d: Vec<PathBuf> = self.hierarchies().iter().map(|h| self.dir(h, id)).collect();
        d.extend(self.unified_dir(id));
        d
    }

    fn v1_freeze(&self, id: &str, on: bool) -> Result<()> {
        let dir = self.dir("freezer", id);
        let p = dir.join("freezer.state");
        let want = if on { "FROZEN" } else { "THAWED" };
        self.fs
            .write(&p, want)
            .map_err(|e| CgroupError::new("write", &p, e))?;
        let start = Instant::now();
        while self
            .fs
            .read(&p)
            .map_err(|e| CgroupError::new("read", &p, e))?
            .trim()
            != want
        {
            if start.elapsed() > Duration::from_secs(5) {
                let e = std::io::Error::new(std::io::ErrorKind::TimedOut, format!("never {want}"));
                return Err(CgroupError::new("freeze", &dir, e));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    fn pids_in(&self, dir: &Path) -> Vec<i32> {
        self.fs
            .read(&dir.join("cgroup.procs"))
            .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }
}

impl CgroupBackend for V1 {
    fn prepare(&self) -> Result<()> {
        for h in self.hierarchies() {
            mkdir_p(&*self.fs, &self.base.join(h).join(&self.root))?;
        }
        if let Some(u) = &self.unified {
            mkdir_p(&*self.fs, &u.join(&self.root))?;
        }
        Ok(())
    }

    fn unprepare(&self) {
        for h in self.hierarchies() {
            let _ = self.fs.rmdir(&self.base.join(h).join(&self.root));
        }
        if let Some(u) = &self.unified {
            let _ = self.fs.rmdir(&u.join(&self.root));
        }
    }

    fn create(&self, id: &str, limits: &Limits) -> Result<()> {
        let mut made: Vec<PathBuf> = Vec::new();
        let res = (|| {
            for c in &self.ctrls {
                let d = self.dir(c.v1_name(), id);
                self.fs
                    .mkdir(&d)
                    .map_err(|e| CgroupError::new("mkdir", &d, e))?;
                made.push(d.clone());
                c.apply_v1(&*self.fs, &d, limits)?;
            }
            for d in self.all_dirs(id).into_iter().skip(self.ctrls.len()) {
                self.fs
                    .mkdir(&d)
                    .map_err(|e| CgroupError::new("mkdir", &d, e))?;
                made.push(d);
            }
            // The cgroup2 device program as well as the v1 controller: either alone holds. The
            // v1 controller is the one this backend needs; where bpf(2) is refused (a container
            // whose seccomp filter bans it, as systemd-nspawn's does), it holds alone.
            if let Some(u) = self.unified_dir(id) {
                match self.fs.attach_device_filter(&u) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                        static SAID: std::sync::Once = std::sync::Once::new();
                        SAID.call_once(|| {
                            tracing::warn!(error = %e, "bpf(2) refused here: sandboxes' devices \
                                are held by the cgroup v1 devices controller alone");
                        });
                    }
                    Err(e) => return Err(CgroupError::new("attach device filter", &u, e)),
                }
            }
            Ok(())
        })();
        if res.is_err() {
            made.reverse();
            if let Err(e) = unified::rmdir_all(&*self.fs, &made) {
                tracing::warn!(sandbox = id, error = %e, "undo of a failed cgroup create");
            }
        }
        res
    }

    fn procs_files(&self, id: &str) -> Vec<PathBuf> {
        self.all_dirs(id)
            .into_iter()
            .map(|d| d.join("cgroup.procs"))
            .collect()
    }

    fn criu_paths(&self, id: &str) -> Vec<(String, PathBuf)> {
        let rel = PathBuf::from("/").join(&self.root).join(id);
        let mut v: Vec<(String, PathBuf)> = self
            .hierarchies()
            .iter()
            .map(|h| (h.to_string(), rel.clone()))
            .collect();
        if self.unified.is_some() {
            v.push(("unified".into(), rel));
        }
        v
    }

    fn freeze(&self, id: &str) -> Result<()> {
        match self.unified_dir(id) {
            Some(u) => unified::freeze(&*self.fs, &u, true),
            None => self.v1_freeze(id, true),
        }
    }

    fn thaw(&self, id: &str) -> Result<()> {
        match self.unified_dir(id) {
            Some(u) => unified::freeze(&*self.fs, &u, false),
            None => self.v1_freeze(id, false),
        }
    }

    fn kill_all(&self, id: &str) -> Result<()> {
        if let Some(u) = self.unified_dir(id) {
            if self.fs.exists(&u) {
                unified::kill(&*self.fs, &u)?;
            }
        }
        // v1 fallback (and a check after cgroup.kill): freeze, SIGKILL each member, thaw, until empty.
        let dir = self.dir("pids", id);
        let start = Instant::now();
        loop {
            if !self.fs.exists(&dir) || self.pids_in(&dir).is_empty() {
                return Ok(());
            }
            let frozen = self.unified.is_none() && self.v1_freeze(id, true).is_ok();
            for pid in self.pids_in(&dir) {
                // Pids from the sandbox's own cgroup.
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            if frozen {
                self.v1_freeze(id, false)?;
            }
            if start.elapsed() > Duration::from_secs(5) {
                let e =
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "processes survive SIGKILL");
                return Err(CgroupError::new("kill", &dir, e));
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }

    fn remove(&self, id: &str) -> Result<()> {
        let mut dirs = self.all_dirs(id);
        dirs.reverse();
        unified::rmdir_all(&*self.fs, &dirs)
    }

    fn usage(&self, id: &str) -> CgroupUsage {
        CgroupUsage {
            cpu_usec: self
                .unified_dir(id)
                .map(|u| unified::cpu_usec(&*self.fs, &u))
                .unwrap_or(0),
            memory_bytes: unified::read_u64(
                &*self.fs,
                &self.dir("memory", id).join("memory.usage_in_bytes"),
            ),
            pids: unified::read_u64(&*self.fs, &self.dir("pids", id).join("pids.current")),
        }
    }

    fn existing(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .hierarchies()
            .iter()
            .map(|h| self.base.join(h).join(&self.root))
            .chain(self.unified.iter().map(|u| u.join(&self.root)))
            .flat_map(|p| self.fs.subdirs(&p))
            .filter(|d| d != daemon::DAEMON_DIR)
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    fn dirs(&self, id: &str) -> Vec<PathBuf> {
        self.all_dirs(id)
            .into_iter()
            .filter(|d| unified::listed(&*self.fs, d))
            .collect()
    }

    /// Daemons are limited in the memory hierarchy only: they stay in the host's other cgroups.
    fn create_daemon(&self, name: &str, memory_mb: u64) -> Result<Vec<PathBuf>> {
        let parent = self.base.join("memory").join(&self.root);
        let dir = daemon::make(&*self.fs, &parent, name, false)?;
        daemon::limit(&*self.fs, &dir, memory_mb, false)?;
        Ok(vec![dir.join("cgroup.procs")])
    }

    fn remove_daemons(&self, names: &[&str]) {
        daemon::remove(&*self.fs, &self.base.join("memory").join(&self.root), names);
    }
}
