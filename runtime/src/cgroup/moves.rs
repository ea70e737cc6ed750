//! Task moves into cgroups without an RCU grace period each: cgroup2's `favordynmods`.
//!
//! Writing a pid to `cgroup.procs` takes the kernel's global `cgroup_threadgroup_rwsem` for
//! writing, and a writer of that per-CPU rwsem waits out an RCU grace period first, unless
//! its readers are already kept on their slow path. CRIU's restore moves every task it
//! restores (`move_in_cgroup`), and a new sandbox's init joins its cgroups the same way.
//! Measured on this project's machine (6.18, 2 vCPUs, idle): a move into a fresh cgroup took
//! 6-16 ms, 13.3 ms of the 47 ms one fork's restore spent in CRIU. With `favordynmods` the
//! readers stay on the slow path (one atomic op per fork and exit instead of a per-CPU one;
//! 6.18 also gives `cgroup.procs` writes a per-thread-group rwsem), and a move took 0.5-1.5 ms.
//!
//! The flag belongs to the cgroup2 superblock, which every cgroup2 mount shares, and it acts
//! on the one global rwsem, so turning it on there serves v1 hierarchies too. It is a host
//! setting, and a fragile one: a later cgroup2 mount in the host's cgroup namespace applies
//! its own options to that one superblock and clears it (raw CRIU without a cgroup yard and
//! podman on a v1 host do such mounts; Grove's CRIU runs use a yard). From Linux 6.18 on,
//! once it has been on, moves keep their per-thread-group lock until reboot either way.

use std::path::{Path, PathBuf};

/// The cgroup2 parameter.
pub const FAVOR_DYNMODS: &str = "favordynmods";

/// What the host's cgroup2 superblock says about `favordynmods`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dynmods {
    On {
        mount: PathBuf,
    },
    /// Off; `flags` are the superblock's other parameters, to be given again in a reconfigure
    /// (one that leaves a flag out clears it, `nsdelegate` included).
    Off {
        mount: PathBuf,
        flags: Vec<String>,
    },
    /// No cgroup2 mount in this mount namespace (a v1-only host: v1 cannot change the flag
    /// after mounting).
    NoCgroup2,
}

/// The first cgroup2 mount in `/proc/self/mountinfo` text, and its superblock's parameter
/// flags (`rw`/`ro` left out: they are the superblock's, not the filesystem's parameters).
fn cgroup2_superblock(mountinfo: &str) -> Option<(PathBuf, Vec<String>)> {
    mountinfo.lines().find_map(|line| {
        let (mine, sb) = line.split_once(" - ")?;
        let mut sb = sb.split(' ');
        if sb.next() != Some("cgroup2") {
            return None;
        }
        let mount = grove_sys::mountinfo::unescape(mine.split(' ').nth(4)?);
        let flags = sb
            .nth(1)
            .unwrap_or("")
            .split(',')
            .filter(|o| !o.is_empty() && *o != "rw" && *o != "ro")
            .map(str::to_owned)
            .collect();
        Some((mount, flags))
    })
}

/// Reads the state from `/proc/self/mountinfo` text.
pub fn state(mountinfo: &str) -> Dynmods {
    match cgroup2_superblock(mountinfo) {
        None => Dynmods::NoCgroup2,
        Some((mount, flags)) if flags.iter().any(|f| f == FAVOR_DYNMODS) => Dynmods::On { mount },
        Some((mount, flags)) => Dynmods::Off { mount, flags },
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MovesError {
    #[error("read /proc/self/mountinfo")]
    Mountinfo(#[source] std::io::Error),
    #[error("no cgroup2 mount to set {FAVOR_DYNMODS} on")]
    NoCgroup2,
    #[error("reconfigure the cgroup2 superblock at {} with {flags}", mount.display())]
    Reconfigure {
        mount: PathBuf,
        flags: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{FAVOR_DYNMODS} still reads off at {} after a reconfigure", mount.display())]
    NotTaken { mount: PathBuf },
}

/// What [`favor_moves`] found or did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Favored {
    AlreadyOn,
    TurnedOn,
}

/// Turns `favordynmods` on, keeping the superblock's other flags, unless it is on already.
pub fn favor_moves() -> Result<Favored, MovesError> {
    let read = || std::fs::read_to_string("/proc/self/mountinfo").map_err(MovesError::Mountinfo);
    let (mount, mut flags) = match state(&read()?) {
        Dynmods::On { .. } => return Ok(Favored::AlreadyOn),
        Dynmods::NoCgroup2 => return Err(MovesError::NoCgroup2),
        Dynmods::Off { mount, flags } => (mount, flags),
    };
    flags.push(FAVOR_DYNMODS.into());
    let refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    crate::sys::reconfigure_superblock(&mount, &refs).map_err(|source| {
        MovesError::Reconfigure {
            mount: mount.clone(),
            flags: flags.join(","),
            source,
        }
    })?;
    match state(&read()?) {
        Dynmods::On { .. } => Ok(Favored::TurnedOn),
        _ => Err(MovesError::NotTaken { mount }),
    }
}

/// One line for reports: the flag's state, and the mount it was read at.
pub fn describe(state: &Dynmods) -> String {
    let at = |m: &Path| m.display().to_string();
    match state {
        Dynmods::On { mount } => format!("{FAVOR_DYNMODS} on ({})", at(mount)),
        Dynmods::Off { mount, .. } => format!("{FAVOR_DYNMODS} off ({})", at(mount)),
        Dynmods::NoCgroup2 => "no cgroup2 mount".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
35 26 0:30 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 26 0:36 / /sys/fs/cgroup/unified rw,nosuid,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";

    #[test]
    fn reads_the_first_cgroup2_superblock_and_keeps_its_other_flags() {
        assert_eq!(
            state(HYBRID),
            Dynmods::Off {
                mount: "/sys/fs/cgroup/unified".into(),
                flags: vec!["nsdelegate".into(), "memory_recursiveprot".into()],
            }
        );
        let on = "29 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,favordynmods\n\
                  30 1 0:26 / /x rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            state(on),
            Dynmods::On {
                mount: "/sys/fs/cgroup".into()
            }
        );
        assert_eq!(
            state(&HYBRID.replace("cgroup2", "tmpfs")),
            Dynmods::NoCgroup2
        );
        let escaped = "29 1 0:26 / /a\\040b rw - cgroup2 none rw\n";
        assert_eq!(
            state(escaped),
            Dynmods::Off {
                mount: "/a b".into(),
                flags: vec![]
            }
        );
    }

    /// Real: turns the flag on for this host (as groved does at start; 6.18 keeps it on until
    /// a reboot) and checks that the superblock's other flags survived the reconfigure.
    #[test]
    fn turning_it_on_keeps_the_other_flags() {
        let mountinfo = || std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let Some((_, before)) = cgroup2_superblock(&mountinfo()) else {
            grove_testkit::capability_missing("no cgroup2 mount");
            return;
        };
        if !nix::unistd::geteuid().is_root() {
            grove_testkit::capability_missing("reconfiguring the cgroup2 superblock needs root");
            return;
        }
        let was_on = before.iter().any(|f| f == FAVOR_DYNMODS);
        let done = favor_moves().expect("turn favordynmods on");
        // Off before may still read on by now: another groved or test run on the host.
        assert!(!was_on || done == Favored::AlreadyOn, "{done:?}");
        let (_, after) = cgroup2_superblock(&mountinfo()).unwrap();
        assert!(after.iter().any(|f| f == FAVOR_DYNMODS), "{after:?}");
        for f in before {
            assert!(after.contains(&f), "{f} lost in the reconfigure: {after:?}");
        }
    }
}
