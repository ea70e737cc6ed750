//! Residue: every Grove-owned thing on the host that belongs to no live sandbox of this runtime
//! (the cleanup of a previous run's leftovers at start-up is in `recover`).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::mounts;
use crate::network::host_if;
use crate::proto::{setup_owner, INIT_PATH};
use crate::runtime::Runtime;
use crate::types::{ResidueItem, ResidueReport, SandboxId};

fn item(kind: &str, what: impl Into<String>) -> ResidueItem {
    ResidueItem {
        kind: kind.into(),
        what: what.into(),
    }
}

/// The sandbox id in a path component like `sb-0123456789ab`, if any.
fn id_in(path: &Path) -> Option<SandboxId> {
    path.components()
        .find_map(|c| c.as_os_str().to_str()?.parse().ok())
}

impl Runtime {
    fn owned(&self) -> HashSet<SandboxId> {
        // The pools under the registry's lock: a pooled sandbox moves between them in one step.
        self.registry.with(|slots| {
            let pooled = self.pools.ids();
            slots.on_host().chain(&pooled).cloned().collect()
        })
    }

    /// Removes the empty cgroup dirs of sandboxes this runtime no longer owns and returns them.
    /// A destroy verifies its rmdirs, so this finds nothing unless the kernel kept a dir listed
    /// after it was reported removed (issue 4's teardown race under load): the reaper's pass then
    /// bounds such a leak to one interval, and logs it. One rmdir each, no retry: a dir that still
    /// holds processes is left for `residue` to report.
    pub(crate) fn sweep_cgroups(&self) -> Vec<PathBuf> {
        let found = self.cgroups.existing();
        // Owned is read after the listing: a create claims its id before making its cgroups.
        let owned = self.owned();
        let mut removed = Vec::new();
        for id in found {
            match id.parse::<SandboxId>() {
                Ok(sid) if !owned.contains(&sid) => {}
                _ => continue,
            }
            for dir in self.cgroups.dirs(&id) {
                match std::fs::remove_dir(&dir) {
                    Ok(()) => removed.push(dir),
                    Err(e) => {
                        tracing::debug!(dir = %dir.display(), error = %e, "orphan cgroup dir kept")
                    }
                }
            }
        }
        if !removed.is_empty() {
            tracing::warn!(dirs = ?removed, "removed cgroup dirs no sandbox owns (left by an earlier destroy)");
        }
        removed
    }

    fn sandboxes_dir(&self) -> PathBuf {
        self.config.run_dir.join("sandboxes")
    }

    /// Everything Grove-owned on the host not belonging to a live sandbox. Empty = clean.
    pub fn residue(&self) -> ResidueReport {
        let mut items = self.scan(&self.owned());
        // Sandboxes created while scanning are not residue: drop whatever names an id owned now.
        let marks: Vec<String> = self
            .owned()
            .iter()
            .flat_map(|id| [id.to_string(), host_if(id), format!("sb_{}", id.short())])
            .collect();
        items.retain(|i| !marks.iter().any(|m| i.what.contains(m.as_str())));
        ResidueReport { items }
    }

    fn scan(&self, owned: &HashSet<SandboxId>) -> Vec<ResidueItem> {
        let mut items = Vec::new();
        let run = &self.config.run_dir;
        // The init copy's tmpfs is this live runtime's own (removed at shutdown).
        let init = crate::init_copy::dir(run);
        for m in mounts::mount_points().unwrap_or_default() {
            let ours = if m.starts_with(run) && m != *run && m != init {
                true
            } else {
                m.starts_with(&self.config.state_dir) && id_in(&m).is_some()
            };
            if ours && !id_in(&m).is_some_and(|id| owned.contains(&id)) {
                items.push(item("mount", m.display().to_string()));
            }
        }
        for id in self.cgroups.existing() {
            if id.parse::<SandboxId>().is_ok_and(|i| owned.contains(&i)) {
                continue;
            }
            for d in self.cgroups.dirs(&id) {
                items.push(item("cgroup", d.display().to_string()));
            }
        }
        // This runtime names no netns (sandboxes hold theirs through pid 1); a named one is ours
        // only if it carries our instance's name: `<root>` or `<root>-<sandbox id>`, never a mere
        // prefix (`grove` must not claim `grove-b`'s). Others' are for the host-wide scan.
        let root = self.config.cgroup_root.as_str();
        let named_ours = |n: &str| {
            n.strip_prefix(root).is_some_and(|rest| {
                rest.is_empty()
                    || rest
                        .strip_prefix('-')
                        .is_some_and(|id| id.parse::<SandboxId>().is_ok())
            })
        };
        for name in dir_names(Path::new("/run/netns"))
            .into_iter()
            .filter(|n| named_ours(n))
        {
            items.push(item("netns", name));
        }
        let links: HashSet<String> = owned.iter().map(host_if).collect();
        for name in dir_names(Path::new("/sys/class/net")) {
            if name.starts_with("grove") && !links.contains(&name) && self.link_is_ours(&name) {
                items.push(item("link", name));
            }
        }
        if let Some(chains) = self.net.table_chains() {
            if !self.net.has_leases() {
                items.push(item("nft", format!("table inet {}", self.net.table())));
            } else {
                let live: HashSet<String> = owned
                    .iter()
                    .map(|id| format!("sb_{}", id.short()))
                    .collect();
                for c in chains.iter().filter(|c| c.starts_with("sb_")) {
                    if !live.contains(c.trim_end_matches("_out")) {
                        items.push(item("nft", format!("chain {c}")));
                    }
                }
            }
        }
        for (pid, what) in self.stray_inits(owned) {
            items.push(item("process", format!("{pid} {what}")));
        }
        for (id, dir) in self.roots.upper_dirs() {
            if !id.parse::<SandboxId>().is_ok_and(|id| owned.contains(&id)) {
                items.push(item("upper", dir.display().to_string()));
            }
        }
        for name in dir_names(&self.sandboxes_dir()) {
            if !name
                .parse::<SandboxId>()
                .is_ok_and(|id| owned.contains(&id))
            {
                items.push(item(
                    "file",
                    self.sandboxes_dir().join(name).display().to_string(),
                ));
            }
        }
        items
    }

    /// A grove link is this instance's when its alias names our nft table (set at wiring), or, with
    /// no alias (wiring stopped before it), when a run dir of ours carries its sandbox's id.
    fn link_is_ours(&self, name: &str) -> bool {
        let alias = std::fs::read_to_string(Path::new("/sys/class/net").join(name).join("ifalias"))
            .unwrap_or_default();
        match alias.trim() {
            "" => dir_names(&self.sandboxes_dir())
                .iter()
                .filter_map(|d| d.parse::<SandboxId>().ok())
                .any(|id| host_if(&id) == name),
            a => a == self.net.table(),
        }
    }

    /// This instance's grove-init processes that belong to no owned sandbox. A process is this
    /// instance's when it sits in a cgroup under our cgroup root, or (a setup process that has not
    /// joined its cgroups yet, or never will) when its argv names our instance. Other instances'
    /// processes, and unmarked ones, are theirs to report; groved's host-wide `grove residue`
    /// scan lists every grove-init regardless.
    fn stray_inits(&self, owned: &HashSet<SandboxId>) -> Vec<(i32, String)> {
        let marker = format!("/{}/", self.config.cgroup_root);
        let mut out = Vec::new();
        for (pid, cmd) in host_processes() {
            let argv0 = cmd.split(|&b| b == 0).next().unwrap_or_default();
            if !argv0.ends_with(b"grove-init") && argv0 != INIT_PATH.as_bytes() {
                continue;
            }
            let cg = cgroup_of(pid);
            let in_cgroup = sandbox_of_cgroup(&cg, &self.config.cgroup_root);
            let ours_daemon = cg.contains(&format!("{marker}{}/", crate::cgroup::DAEMON_DIR));
            let mine = match in_cgroup {
                Some(id) => id,
                // Another runtime's sandbox (a child of our own daemon's cgroup is still ours).
                None if cg.contains("/grove") && !ours_daemon => continue,
                None => match setup_owner(&cmd) {
                    Some((instance, id)) if instance == self.config.cgroup_root => {
                        match id.parse::<SandboxId>() {
                            Ok(id) => id,
                            Err(_) => continue,
                        }
                    }
                    _ => continue, // another instance's setup, or not attributable
                },
            };
            if owned.contains(&mine) {
                continue;
            }
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            out.push((pid, format!("{} (sandbox {mine})", cmd.trim())));
        }
        out
    }
}

/// The names in a directory (none if it cannot be read).
pub(crate) fn dir_names(p: &Path) -> Vec<String> {
    std::fs::read_dir(p)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Every host process but this one, with its NUL-separated command line.
pub(crate) fn host_processes() -> Vec<(i32, Vec<u8>)> {
    let me = std::process::id() as i32;
    dir_names(Path::new("/proc"))
        .iter()
        .filter_map(|n| n.parse::<i32>().ok())
        .filter(|&p| p != me)
        .filter_map(|p| Some((p, std::fs::read(format!("/proc/{p}/cmdline")).ok()?)))
        .collect()
}

/// The sandbox of this runtime (cgroup root `root`) whose cgroup a `/proc/<pid>/cgroup` text
/// names, if any. The daemons' own cgroups (`<root>/daemon/…`) name none: groved's helpers live
/// there.
pub(crate) fn sandbox_of_cgroup(cg: &str, root: &str) -> Option<SandboxId> {
    let marker = format!("/{root}/");
    cg.lines().find_map(|l| {
        let path = l.splitn(3, ':').nth(2)?;
        let rest = path.split_once(&marker)?.1;
        rest.split('/').next()?.parse::<SandboxId>().ok()
    })
}

/// A process's /proc/<pid>/cgroup (empty once it is gone).
pub(crate) fn cgroup_of(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default()
}

/// Held for a runtime's life: a second runtime on the same cgroup root (so the same nft table,
/// marks and sweeps) would take the first one's sandboxes for leftovers and remove them. An
/// exclusive flock on the root's cgroup dir (no file of its own to leave behind); the kernel drops
/// it when the process dies. Waits a few seconds for a runtime of this process being dropped.
pub(crate) fn lock_instance(
    cgroup_root: &str,
) -> Result<Option<nix::fcntl::Flock<std::fs::File>>, crate::Error> {
    use nix::fcntl::{Flock, FlockArg};
    let base = Path::new("/sys/fs/cgroup");
    let Some(dir) = [
        base.join("memory").join(cgroup_root),
        base.join(cgroup_root),
    ]
    .into_iter()
    .find(|d| d.is_dir()) else {
        return Ok(None);
    };
    let mut file = std::fs::File::open(&dir).map_err(|source| crate::Error::Io {
        context: format!("open {} to lock the instance", dir.display()),
        source,
    })?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Ok(Some(lock)),
            Err((f, nix::errno::Errno::EWOULDBLOCK)) if std::time::Instant::now() < deadline => {
                file = f;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                return Err(crate::Error::invalid(
                    "cgroup_root",
                    format!(
                        "{cgroup_root:?} is in use by another running Grove runtime on this host; \
                         give each daemon its own instance name"
                    ),
                ))
            }
            Err((_, e)) => {
                return Err(crate::Error::Io {
                    context: format!("lock {}", dir.display()),
                    source: e.into(),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::sandbox_of_cgroup;

    #[test]
    fn a_daemon_cgroup_is_no_sandbox_of_ours() {
        let sandbox = "12:memory:/grove-a/sb-0123456789ab\n0::/grove-a/sb-0123456789ab\n";
        assert_eq!(
            sandbox_of_cgroup(sandbox, "grove-a").map(|id| id.to_string()),
            Some("sb-0123456789ab".to_string())
        );
        // groved's helpers (a CRIU restore, a setup not yet in its cgroups) run in its own.
        let daemon = "12:memory:/grove-a/daemon/groved\n0::/user.slice\n";
        assert_eq!(sandbox_of_cgroup(daemon, "grove-a"), None);
        // Another instance's sandbox is not ours either.
        assert_eq!(sandbox_of_cgroup(sandbox, "grove-b"), None);
    }
}
