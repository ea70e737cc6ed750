//! What nodefs asks the kernel about its FUSE mounts: the session's mount options, which
//! nodefs mounts `/proc/self/mountinfo` lists, and unmounting one, detaching and aborting its
//! connection when it is busy or its server no longer answers.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use fuser::{Config, MountOption, SessionACL};

/// The FUSE session of one view: its kernel mount options and server threads.
pub(super) fn session_config(read_only: bool, clone_fd: bool) -> Config {
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("nodefs".into()),
        MountOption::Subtype("nodefs".into()),
        MountOption::DefaultPermissions,
        // The host must never honour a setuid bit or a device node a sandbox made in its
        // root: a setuid-root binary written there would run as root for any host user
        // who can reach it, a block device node would open the host's disks. Binds of
        // this mount (the sandbox's own root) inherit both flags.
        MountOption::NoSuid,
        MountOption::NoDev,
        if read_only {
            MountOption::RO
        } else {
            MountOption::RW
        },
    ];
    config.acl = SessionACL::All;
    config.n_threads = Some(2);
    config.clone_fd = clone_fd;
    config
}

/// The mountpoints of the nodefs mounts (a FUSE filesystem whose source is `nodefs`) in
/// `mountinfo` (the text of a `/proc/<pid>/mountinfo`), in its order.
pub(super) fn nodefs_mountpoints(mountinfo: &str) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let mut f = post.split(' ');
            let (fstype, source) = (f.next()?, f.next()?);
            let nodefs = (fstype == "fuse" || fstype == "fuse.nodefs") && source == "nodefs";
            if nodefs {
                Some(grove_sys::mountinfo::unescape(pre.split(' ').nth(4)?))
            } else {
                None
            }
        })
        .collect()
}

/// Unmount; if busy, detach lazily and abort the FUSE connection so that the session
/// threads exit and processes still inside get ENOTCONN. Returns whether it was aborted.
pub(super) fn detach(mountpoint: &Path) -> bool {
    use nix::mount::{umount2, MntFlags};
    if umount2(mountpoint, MntFlags::empty()).is_ok() {
        return true;
    }
    // Still mounted: its device names the connection to abort.
    let c = std::ffi::CString::new(mountpoint.as_os_str().as_bytes()).unwrap_or_default();
    let minor = crate::sys::cached_dev_minor(&c).ok();
    let _ = umount2(mountpoint, MntFlags::MNT_DETACH);
    minor.is_some_and(abort_connection)
}

/// The fuse module's switch for FUSE over io_uring: the kernel offers the ring at INIT only
/// while it is on.
const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// Whether the kernel offers FUSE over io_uring to new connections, turning the switch on if
/// it is off and this process may (root). False where the kernel lacks it (no parameter:
/// older than 6.14 or built without CONFIG_FUSE_IO_URING).
pub(super) fn enable_uring() -> bool {
    let on = |s: &str| matches!(s.trim(), "Y" | "y" | "1");
    match std::fs::read_to_string(ENABLE_URING) {
        Ok(s) if on(&s) => true,
        Ok(_) => match std::fs::write(ENABLE_URING, "Y") {
            Ok(()) => {
                tracing::info!("turned on FUSE over io_uring ({ENABLE_URING})");
                true
            }
            Err(e) => {
                tracing::info!(error = %e, "FUSE over io_uring is off and cannot be turned on");
                false
            }
        },
        Err(_) => false,
    }
}

/// Write `1` to the connection's fusectl `abort` file. fusectl is mounted, if the host has
/// not, in a private mount namespace of a short-lived thread, so nothing is left behind.
pub(super) fn abort_connection(minor: u32) -> bool {
    let path = format!("/sys/fs/fuse/connections/{minor}/abort");
    if std::fs::write(&path, "1").is_ok() {
        return true;
    }
    grove_sys::thread::on_own_thread(move || {
        use nix::mount::{mount, MsFlags};
        // This thread's own fs and mount namespace: the mount below is seen nowhere else.
        if nix::sched::unshare(
            nix::sched::CloneFlags::CLONE_NEWNS | nix::sched::CloneFlags::CLONE_FS,
        )
        .is_err()
        {
            return false;
        }
        let none = None::<&str>;
        let _ = mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none);
        mount(
            Some("none"),
            "/sys/fs/fuse/connections",
            Some("fusectl"),
            MsFlags::empty(),
            none,
        )
        .is_ok()
            && std::fs::write(&path, "1").is_ok()
    })
    .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodefs_mountpoints_are_the_fuse_mounts_whose_source_is_nodefs() {
        let mi = "\
36 1 0:32 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 36 0:45 / /run/grove/sandboxes/sb-1/root rw,nosuid,nodev - fuse.nodefs nodefs rw
41 36 0:46 / /run/with\\040space rw - fuse nodefs rw
42 36 0:47 / /mnt/other rw - fuse.sshfs host:/ rw
43 36 0:48 / /mnt/named-nodefs rw - tmpfs nodefs rw
malformed line
";
        assert_eq!(
            nodefs_mountpoints(mi),
            vec![
                PathBuf::from("/run/grove/sandboxes/sb-1/root"),
                PathBuf::from("/run/with space"),
            ]
        );
    }
}
