//! Pure cgroup v2: one dir per sandbox at `<base>/<root>/<id>`, controllers enabled on `<root>`.

use std::path::PathBuf;
use std::sync::Arc;

use super::{
    controllers, daemon, unified, CgroupBackend, CgroupError, CgroupFs, CgroupUsage, Controller,
    Result,
};
use crate::types::Limits;

pub struct V2 {
    fs: Arc<dyn CgroupFs>,
    base: PathBuf,
    root: String,
    ctrls: Vec<Box<dyn Controller>>,
}

impl V2 {
    pub fn new(fs: Arc<dyn CgroupFs>, base: PathBuf, root: &str) -> Self {
        V2 {
            fs,
            base,
            root: root.to_string(),
            ctrls: controllers(),
        }
    }
    fn dir(&self, id: &str) -> PathBuf {
        self.base.join(&self.root).join(id)
    }
}

impl CgroupBackend for V2 {
    fn prepare(&self) -> Result<()> {
        let parent = self.base.join(&self.root);
        if let Err(e) = self.fs.mkdir(&parent) {
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                return Err(CgroupError::new("mkdir", &parent, e));
            }
        }
        for (dir, ctl) in [
            (&self.base, "+memory +pids +cpu"),
            (&parent, "+memory +pids +cpu"),
        ] {
            let p = dir.join("cgroup.subtree_control");
            self.fs
                .write(&p, ctl)
                .map_err(|e| CgroupError::new("write", &p, e))?;
        }
        Ok(())
    }

    fn unprepare(&self) {
        let _ = self.fs.rmdir(&self.base.join(&self.root));
    }

    fn create(&self, id: &str, limits: &Limits) -> Result<()> {
        let d = self.dir(id);
        self.fs
            .mkdir(&d)
            .map_err(|e| CgroupError::new("mkdir", &d, e))?;
        let res = self
            .ctrls
            .iter()
            .try_for_each(|c| c.apply_v2(&*self.fs, &d, limits));
        if res.is_err() {
            if let Err(e) = unified::rmdir(&*self.fs, &d) {
                tracing::warn!(sandbox = id, error = %e, "undo of a failed cgroup create");
            }
        }
        res
    }

    fn procs_files(&self, id: &str) -> Vec<PathBuf> {
        vec![self.dir(id).join("cgroup.procs")]
    }

    fn criu_paths(&self, id: &str) -> Vec<(String, PathBuf)> {
        vec![(
            "unified".into(),
            PathBuf::from("/").join(&self.root).join(id),
        )]
    }

    fn freeze(&self, id: &str) -> Result<()> {
        unified::freeze(&*self.fs, &self.dir(id), true)
    }

    fn thaw(&self, id: &str) -> Result<()> {
        unified::freeze(&*self.fs, &self.dir(id), false)
    }

    fn kill_all(&self, id: &str) -> Result<()> {
        unified::kill(&*self.fs, &self.dir(id))
    }

    fn remove(&self, id: &str) -> Result<()> {
        unified::rmdir(&*self.fs, &self.dir(id))
    }

    fn usage(&self, id: &str) -> CgroupUsage {
        let d = self.dir(id);
        CgroupUsage {
            cpu_usec: unified::cpu_usec(&*self.fs, &d),
            memory_bytes: unified::read_u64(&*self.fs, &d.join("memory.current")),
            pids: unified::read_u64(&*self.fs, &d.join("pids.current")),
        }
    }

    fn existing(&self) -> Vec<String> {
        let mut ids = self.fs.subdirs(&self.base.join(&self.root));
        ids.retain(|d| d != daemon::DAEMON_DIR);
        ids
    }

    fn dirs(&self, id: &str) -> Vec<PathBuf> {
        Some(self.dir(id))
            .filter(|d| unified::listed(&*self.fs, d))
            .into_iter()
            .collect()
    }

    fn create_daemon(&self, name: &str, memory_mb: u64) -> Result<Vec<PathBuf>> {
        let dir = daemon::make(&*self.fs, &self.base.join(&self.root), name, true)?;
        daemon::limit(&*self.fs, &dir, memory_mb, true)?;
        Ok(vec![dir.join("cgroup.procs")])
    }

    fn remove_daemons(&self, names: &[&str]) {
        daemon::remove(&*self.fs, &self.base.join(&self.root), names);
    }
}
