//! Dropping privileges a change must take away, done by the server (FUSE_HANDLE_KILLPRIV_V2).
//!
//! Without that flag the kernel asks the server for `security.capability` before every
//! write and fetches the attributes before every chown, two round trips per file in an
//! untar. With it the kernel leaves the job to the server and marks inodes it has checked
//! (S_NOSEC), and the server does what native Linux does:
//! - write: the capability xattr goes; setuid/setgid go when the kernel says so
//!   (`FUSE_WRITE_KILL_SUIDGID`, set when the writer lacks CAP_FSETID);
//! - truncate: the capability xattr goes; setuid/setgid go if the caller lacks CAP_FSETID
//!   (fuser does not pass the kernel's FATTR_KILL_SUIDGID on, so the server asks /proc, and
//!   only for files that carry those bits);
//! - chown of a non-directory: the capability xattr, setuid, and setgid of a
//!   group-executable file go, whoever asks.

use crate::tree::Meta;

const CAPABILITY: &[u8] = b"security.capability";

/// CAP_FSETID's bit in a capability set.
const CAP_FSETID: u32 = 4;

/// Remove file capabilities. Returns whether anything changed.
pub fn drop_caps(meta: &mut Meta) -> bool {
    meta.xattrs.remove(CAPABILITY).is_some()
}

/// Clear setuid, and setgid if the file is group-executable (otherwise setgid means
/// mandatory locking and stays, as in Linux). Returns whether anything changed.
pub fn drop_suidgid(meta: &mut Meta) -> bool {
    let old = meta.mode;
    meta.mode &= !libc::S_ISUID;
    if meta.mode & libc::S_IXGRP != 0 {
        meta.mode &= !libc::S_ISGID;
    }
    meta.mode != old
}

/// Whether setuid/setgid would be cleared from this mode.
pub fn has_suidgid(mode: u32) -> bool {
    mode & libc::S_ISUID != 0
        || mode & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP
}

/// Whether process `pid` (as the kernel names it to this server) holds CAP_FSETID. A
/// process that is gone, or unreadable, is treated as not holding it.
pub fn has_fsetid(pid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_FSETID) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(mode: u32) -> Meta {
        Meta {
            mode,
            uid: 0,
            gid: 0,
            mtime_sec: 0,
            mtime_nsec: 0,
            xattrs: Default::default(),
        }
    }

    #[test]
    fn suid_and_group_executable_sgid_go() {
        let mut m = meta(0o6755);
        assert!(has_suidgid(m.mode));
        assert!(drop_suidgid(&mut m));
        assert_eq!(m.mode, 0o755);
        // setgid without group execute is mandatory locking: kept.
        let mut m = meta(0o2644);
        assert!(!has_suidgid(m.mode));
        assert!(!drop_suidgid(&mut m));
        assert_eq!(m.mode, 0o2644);
    }

    #[test]
    fn capabilities_go() {
        let mut m = meta(0o755);
        m.xattrs.insert(CAPABILITY.to_vec(), vec![1, 2, 3]);
        m.xattrs.insert(b"user.keep".to_vec(), vec![]);
        assert!(drop_caps(&mut m));
        assert!(!drop_caps(&mut m));
        assert_eq!(m.xattrs.len(), 1);
    }

    #[test]
    fn this_process_has_fsetid_as_root() {
        let root = nix::unistd::geteuid().is_root();
        assert_eq!(has_fsetid(std::process::id()), root);
    }
}
