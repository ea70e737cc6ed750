//! groved and grove-fsd each run in a cgroup of their own with a memory limit, so an allocation a
//! sandbox drives in a daemon (a huge read, a flood of files) ends in that daemon's cgroup
//! instead of taking the node. Under systemd on cgroup v2 they are leaves of the (delegated)
//! service cgroup; otherwise `<cgroup_root>/daemon/{groved,fsd}` through the runtime's cgroup
//! backend, reused by the next start after a crash and removed at a clean exit.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use grove_runtime::cgroup::{CgroupBackend, CgroupError};

use crate::config::Config;
use crate::systemd::{self, SystemdError};

const GROVED: &str = "groved";
const FSD: &str = "fsd";
const MOUNT: &str = "/sys/fs/cgroup";

#[derive(Debug, thiserror::Error)]
pub enum DaemonCgroupError {
    #[error("the cgroup of {daemon}")]
    Cgroup {
        daemon: &'static str,
        #[source]
        source: CgroupError,
    },
    #[error("{op} {}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Systemd(#[from] SystemdError),
}

/// The cgroup.procs files a grove-fsd started by this groved joins (empty before `enter`).
static FSD_PROCS: OnceLock<Vec<PathBuf>> = OnceLock::new();

pub fn fsd_procs() -> Vec<PathBuf> {
    FSD_PROCS.get().cloned().unwrap_or_default()
}

/// Held for groved's life; dropping it at exit removes the cgroups this groved made (not under
/// systemd, which removes the service's).
pub struct DaemonCgroups {
    own: Option<(Arc<dyn CgroupBackend>, PathBuf)>,
}

fn write(path: &Path, v: &str, op: &'static str) -> Result<(), DaemonCgroupError> {
    std::fs::write(path, v).map_err(|source| DaemonCgroupError::Io {
        op,
        path: path.to_path_buf(),
        source,
    })
}

fn memory_max(mb: u64) -> String {
    match mb.saturating_mul(1 << 20) {
        0 => "max".into(),
        b => b.to_string(),
    }
}

/// Moves groved into its cgroup and prepares grove-fsd's. Call before any thread or child exists.
pub fn enter(config: &Config) -> Result<DaemonCgroups, DaemonCgroupError> {
    let v2 = Path::new(MOUNT).join("cgroup.controllers").exists();
    if v2 && std::env::var_os("INVOCATION_ID").is_some() {
        // Never leave the service's tree: systemd would take the service for exited.
        systemd::enter_leaf_cgroup()?;
        if let Some(leaf) = own_cgroup(&Path::new(MOUNT).join("cgroup.procs"), true)
            .and_then(|p| p.parent().map(Path::to_path_buf))
            .filter(|l| l.ends_with(systemd::LEAF))
        {
            limit_service_leaves(&leaf, config)?;
            tracing::info!(cgroup = %leaf.display(), "in the service's leaf cgroup");
        }
        return Ok(DaemonCgroups { own: None });
    }
    let backend = grove_runtime::cgroup::detect(&config.cgroup_root);
    let err = |daemon| move |source| DaemonCgroupError::Cgroup { daemon, source };
    backend.prepare().map_err(err(GROVED))?;
    let fallback = if v2 {
        Path::new(MOUNT).join("cgroup.procs")
    } else {
        Path::new(MOUNT).join("memory/cgroup.procs")
    };
    let home = own_cgroup(&fallback, v2).unwrap_or(fallback);
    let mine = backend
        .create_daemon(GROVED, config.daemon_memory_max_mb)
        .map_err(err(GROVED))?;
    let fsd = backend
        .create_daemon(FSD, config.fsd_memory_max_mb)
        .map_err(err(FSD))?;
    let cg = DaemonCgroups {
        own: Some((backend, home)),
    };
    for p in &mine {
        write(p, &std::process::id().to_string(), "joining")?;
    }
    let _ = FSD_PROCS.set(fsd);
    tracing::info!(cgroup = ?mine, memory_max_mb = config.daemon_memory_max_mb, "in groved's own cgroup");
    Ok(cg)
}

/// Under systemd: memory limits on groved's leaf and on a sibling leaf for grove-fsd.
fn limit_service_leaves(leaf: &Path, config: &Config) -> Result<(), DaemonCgroupError> {
    let service = leaf.parent().unwrap_or(leaf);
    write(
        &service.join("cgroup.subtree_control"),
        "+memory",
        "enabling memory in",
    )?;
    write(
        &leaf.join("memory.max"),
        &memory_max(config.daemon_memory_max_mb),
        "limiting",
    )?;
    let fsd = service.join(FSD);
    match std::fs::create_dir(&fsd) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(DaemonCgroupError::Io {
                op: "creating",
                path: fsd,
                source: e,
            })
        }
        _ => {}
    }
    write(
        &fsd.join("memory.max"),
        &memory_max(config.fsd_memory_max_mb),
        "limiting",
    )?;
    let _ = FSD_PROCS.set(vec![fsd.join("cgroup.procs")]);
    Ok(())
}

/// The cgroup.procs file of this process's memory cgroup (v1) or its cgroup (v2).
fn own_cgroup(fallback: &Path, v2: bool) -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = text.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctrls, path) = (f.next()?, f.next()?, f.next()?);
        let hit = if v2 {
            ctrls.is_empty()
        } else {
            ctrls.split(',').any(|c| c == "memory")
        };
        hit.then_some(path)
    })?;
    let dir = fallback.parent()?.join(rel.trim_start_matches('/'));
    Some(dir.join("cgroup.procs"))
}

impl Drop for DaemonCgroups {
    fn drop(&mut self) {
        let Some((backend, home)) = &self.own else {
            return;
        };
        // A cgroup holding its own remover cannot go: back to where groved started first.
        if let Err(e) = write(home, &std::process::id().to_string(), "returning to") {
            tracing::warn!("leaving groved's cgroup: {}", crate::error::chain(&e));
            return;
        }
        backend.remove_daemons(&[GROVED, FSD]);
        // The runtime's own removal of the cgroup root found our dir in it.
        backend.unprepare();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_max_zero_is_unlimited() {
        assert_eq!(memory_max(0), "max");
        assert_eq!(memory_max(2), "2097152");
        assert_eq!(memory_max(u64::MAX), u64::MAX.to_string());
    }
}
