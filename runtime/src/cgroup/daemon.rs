//! The daemons' own cgroups (groved, grove-fsd) at `<root>/daemon/<name>`: a memory limit of their
//! own, so an allocation a sandbox drives in them (a huge read, a flood of files) is stopped there
//! instead of taking the node. Never listed as sandboxes (`existing` skips `DAEMON_DIR`).

use std::path::{Path, PathBuf};

use super::{CgroupError, CgroupFs, Result};

/// The dir under the cgroup root that holds the daemons' cgroups; no sandbox id looks like it.
pub const DAEMON_DIR: &str = "daemon";

pub(super) fn mkdir_p(fs: &dyn CgroupFs, p: &Path) -> Result<()> {
    match fs.mkdir(p) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            Err(CgroupError::new("mkdir", p, e))
        }
        _ => Ok(()),
    }
}

fn w(fs: &dyn CgroupFs, p: &Path, v: &str) -> Result<()> {
    fs.write(p, v).map_err(|e| CgroupError::new("write", p, e))
}

/// Makes `<parent>/daemon/<name>` (the parent must exist), and on v2 lets it have a memory limit.
pub(super) fn make(fs: &dyn CgroupFs, parent: &Path, name: &str, v2: bool) -> Result<PathBuf> {
    let daemons = parent.join(DAEMON_DIR);
    mkdir_p(fs, &daemons)?;
    if v2 {
        w(fs, &daemons.join("cgroup.subtree_control"), "+memory")?;
    }
    let dir = daemons.join(name);
    mkdir_p(fs, &dir)?;
    Ok(dir)
}

/// The memory limit of a daemon cgroup; 0 = unlimited.
pub(super) fn limit(fs: &dyn CgroupFs, dir: &Path, memory_mb: u64, v2: bool) -> Result<()> {
    let bytes = Some(memory_mb.saturating_mul(1 << 20)).filter(|&b| b > 0);
    match (v2, bytes) {
        (true, Some(b)) => w(fs, &dir.join("memory.max"), &b.to_string()),
        (true, None) => w(fs, &dir.join("memory.max"), "max"),
        (false, Some(b)) => w(fs, &dir.join("memory.limit_in_bytes"), &b.to_string()),
        (false, None) => w(fs, &dir.join("memory.limit_in_bytes"), "-1"),
    }
}

/// Removes each daemon cgroup of `names` that is empty, then `<parent>/daemon` if empty. A
/// daemon still running (a grove-fsd kept for the next groved) keeps its dir.
pub(super) fn remove(fs: &dyn CgroupFs, parent: &Path, names: &[&str]) {
    let daemons = parent.join(DAEMON_DIR);
    for n in names {
        let d = daemons.join(n);
        if fs.exists(&d) {
            // grove-fsd was just told to stop: its cgroup empties a moment after its socket
            // closes (an fsd kept for the next start keeps it, after half a second).
            let mut tries = 0;
            while let Err(e) = fs.rmdir(&d) {
                tries += 1;
                if e.raw_os_error() != Some(libc::EBUSY) || tries == 20 {
                    tracing::info!(dir = %d.display(), error = %e, "daemon cgroup kept");
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(25));
            }
        }
    }
    if fs.exists(&daemons) {
        let _ = fs.rmdir(&daemons);
    }
}
