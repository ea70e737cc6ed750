//! Operations of a cgroup2 directory used by both backends: freeze, kill, wait for empty.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{CgroupError, CgroupFs, Result};

fn events_has(fs: &dyn CgroupFs, dir: &Path, key: &str, want: &str) -> Result<bool> {
    let p = dir.join("cgroup.events");
    let text = fs.read(&p).map_err(|e| CgroupError::new("read", &p, e))?;
    Ok(text.lines().any(|l| l.split_once(' ') == Some((key, want))))
}

/// Polls `cgroup.events` until `key` reads `want` (fast at first, then backing off) or 5 s pass.
fn wait_for(fs: &dyn CgroupFs, dir: &Path, key: &str, want: &str) -> Result<()> {
    let start = Instant::now();
    let mut nap = Duration::from_micros(50);
    while !events_has(fs, dir, key, want)? {
        if start.elapsed() > Duration::from_secs(5) {
            let err = std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("{key} never became {want}"),
            );
            return Err(CgroupError::new("wait", dir, err));
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(5));
    }
    Ok(())
}

pub fn freeze(fs: &dyn CgroupFs, dir: &Path, on: bool) -> Result<()> {
    let p = dir.join("cgroup.freeze");
    fs.write(&p, if on { "1" } else { "0" })
        .map_err(|e| CgroupError::new("write", &p, e))?;
    wait_for(fs, dir, "frozen", if on { "1" } else { "0" })
}

/// cgroup.kill is atomic against concurrent forks, so no freeze is needed first.
pub fn kill(fs: &dyn CgroupFs, dir: &Path) -> Result<()> {
    if !fs.exists(dir) {
        return Ok(());
    }
    let p = dir.join("cgroup.kill");
    fs.write(&p, "1")
        .map_err(|e| CgroupError::new("write", &p, e))?;
    wait_for(fs, dir, "populated", "0")
}

/// How long rmdir keeps retrying on EBUSY. Killed tasks leave their cgroups
/// only once they have exited, which takes seconds when thousands of sandboxes
/// are torn down at once on a busy node.
const RMDIR_PATIENCE: Duration = Duration::from_secs(15);

/// rmdir, retrying with backoff on EBUSY (exiting tasks hold the dir until they are gone). An
/// rmdir that reports success (or ENOENT) is only believed once the dir is out of its parent's
/// listing: a path lookup is answered from the dentry cache, and under heavy load v1 cgroup dirs
/// were seen gone by `stat` yet still listed (and still removable by hand) after a destroy that
/// answered OK. A destroy must not leave an empty cgroup dir behind.
pub fn rmdir(fs: &dyn CgroupFs, dir: &Path) -> Result<()> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(200);
    loop {
        let err = match fs.rmdir(dir) {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => e,
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(CgroupError::new("rmdir", dir, e))
            }
            _ if !listed(fs, dir) => return Ok(()),
            res => {
                // Logged so a soak can tell this from a dir made afresh later.
                tracing::warn!(dir = %dir.display(), ?res, stat_sees_it = fs.exists(dir),
                    "cgroup dir still listed after rmdir reported it gone; retrying");
                std::io::Error::other("still listed after rmdir reported it gone")
            }
        };
        if start.elapsed() >= RMDIR_PATIENCE {
            return Err(CgroupError::new("rmdir", dir, err));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// Whether `dir` is in its parent's listing: what the kernel holds, not what a path lookup
/// (answered from the dentry cache) says.
pub fn listed(fs: &dyn CgroupFs, dir: &Path) -> bool {
    match (dir.parent(), dir.file_name()) {
        (Some(parent), Some(name)) => fs.subdirs(parent).iter().any(|s| *name == **s),
        _ => false,
    }
}

/// Removes every dir, even after one fails, so one busy hierarchy never
/// strands the others; returns the first failure.
pub fn rmdir_all(fs: &dyn CgroupFs, dirs: &[PathBuf]) -> Result<()> {
    let mut first = None;
    for d in dirs {
        if let Err(e) = rmdir(fs, d) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// Parses `usage_usec` from a cgroup2 cpu.stat.
pub fn cpu_usec(fs: &dyn CgroupFs, dir: &Path) -> u64 {
    fs.read(&dir.join("cpu.stat"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("usage_usec ")?.trim().parse().ok())
        })
        .unwrap_or(0)
}

pub fn read_u64(fs: &dyn CgroupFs, p: &Path) -> u64 {
    fs.read(p)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0)
}
