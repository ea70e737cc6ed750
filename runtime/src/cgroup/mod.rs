//! Sandbox cgroups behind one interface: `V1` (limits in the v1 hierarchies; kill/freeze/empty
//! events in the controller-less cgroup2 mount when there is one) and `V2` (pure cgroup2).
//! All file access goes through `CgroupFs` so unit tests run against a tempdir.

mod cpu;
mod daemon;
mod devices;
mod fs;
mod memory;
pub mod moves;
mod pids;
mod unified;
mod v1;
mod v2;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use daemon::DAEMON_DIR;
pub use devices::{attach_device_filter, v1_rules as device_rules, ALLOWED_CHAR_DEVICES};
pub use fs::{CgroupFs, RealFs};
pub use v1::V1;
pub use v2::V2;

use crate::types::Limits;

#[derive(Debug, thiserror::Error)]
#[error("{op} {}", path.display())]
pub struct CgroupError {
    pub op: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

impl CgroupError {
    pub fn new(op: &'static str, path: &Path, source: std::io::Error) -> Self {
        CgroupError {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, CgroupError>;

/// Counters read from a sandbox's cgroups.
#[derive(Debug, Clone, Copy, Default)]
pub struct CgroupUsage {
    pub cpu_usec: u64,
    pub memory_bytes: u64,
    pub pids: u64,
}

/// One resource controller: how a limit is written in each cgroup version.
pub trait Controller: Send + Sync {
    /// v1 hierarchy directory name under the cgroup mount (e.g. "memory").
    fn v1_name(&self) -> &'static str;
    fn apply_v1(&self, fs: &dyn CgroupFs, dir: &Path, limits: &Limits) -> Result<()>;
    fn apply_v2(&self, fs: &dyn CgroupFs, dir: &Path, limits: &Limits) -> Result<()>;
}

pub fn controllers() -> Vec<Box<dyn Controller>> {
    vec![
        Box::new(memory::Memory),
        Box::new(pids::Pids),
        Box::new(cpu::Cpu),
        Box::new(devices::Devices),
    ]
}

/// A sandbox cgroup set, addressed by the sandbox id.
pub trait CgroupBackend: Send + Sync {
    /// Makes the parent `<root>` dirs (idempotent).
    fn prepare(&self) -> Result<()>;
    /// Removes the parent `<root>` dirs if empty (at shutdown).
    fn unprepare(&self);
    /// Makes the sandbox's cgroups with `limits`; on error removes what it made.
    fn create(&self, id: &str, limits: &Limits) -> Result<()>;
    /// cgroup.procs files a process writes itself into to join.
    fn procs_files(&self, id: &str) -> Vec<PathBuf>;
    /// (controller or "unified", path relative to the hierarchy root) for CRIU.
    fn criu_paths(&self, id: &str) -> Vec<(String, PathBuf)>;
    fn freeze(&self, id: &str) -> Result<()>;
    fn thaw(&self, id: &str) -> Result<()>;
    /// Kills every process in the sandbox's cgroups and waits until they are empty.
    fn kill_all(&self, id: &str) -> Result<()>;
    /// Removes the sandbox's cgroup dirs (idempotent; processes must be gone).
    fn remove(&self, id: &str) -> Result<()>;
    fn usage(&self, id: &str) -> CgroupUsage;
    /// Sandbox ids with at least one cgroup dir present.
    fn existing(&self) -> Vec<String>;
    /// Every sandbox cgroup dir of `id` that exists (for residue reports).
    fn dirs(&self, id: &str) -> Vec<PathBuf>;
    /// Makes (or reuses, after a crash) the cgroup of daemon `name` at `<root>/daemon/<name>`
    /// with a memory limit (0: unlimited); returns the cgroup.procs files it joins by. Needs
    /// `prepare` first.
    fn create_daemon(&self, name: &str, memory_mb: u64) -> Result<Vec<PathBuf>>;
    /// Removes the (empty) cgroups of daemons `names`, then `<root>/daemon` if empty.
    fn remove_daemons(&self, names: &[&str]);
}

/// Picks the backend for this host: pure v2 when /sys/fs/cgroup is cgroup2, else v1.
pub fn detect(root: &str) -> Arc<dyn CgroupBackend> {
    let fs: Arc<dyn CgroupFs> = Arc::new(RealFs);
    let base = Path::new("/sys/fs/cgroup");
    if base.join("cgroup.controllers").exists() {
        Arc::new(V2::new(fs, base.to_path_buf(), root))
    } else {
        let unified = base.join("unified");
        let unified = unified.join("cgroup.procs").exists().then_some(unified);
        Arc::new(V1::new(fs, base.to_path_buf(), root, unified))
    }
}
