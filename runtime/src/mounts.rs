//! Host mount-table helpers (reading /proc/self/mountinfo, unmounting).

use std::io;
use std::path::{Path, PathBuf};

/// Mount points from /proc/self/mountinfo (octal escapes decoded).
pub fn mount_points() -> io::Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(text
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(grove_sys::mountinfo::unescape)
        .collect())
}

/// Unmounts `target` (all stacked mounts), tolerating "not mounted". Falls back to a lazy detach when busy.
pub fn unmount_if_mounted(target: &Path) -> io::Result<()> {
    for _ in 0..8 {
        match nix::mount::umount2(target, nix::mount::MntFlags::empty()) {
            Ok(()) => continue,
            Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => return Ok(()),
            Err(nix::errno::Errno::EBUSY) => {
                nix::mount::umount2(target, nix::mount::MntFlags::MNT_DETACH)
                    .map_err(io::Error::from)?;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Why a sandbox's run dir was not removed.
#[derive(Debug, thiserror::Error)]
pub enum RemoveDirError {
    /// Something is still mounted below it: left in place, never read through.
    #[error("{} still has mounts; left in place", .0.display())]
    Mounted(PathBuf),
    #[error("remove {}: {error}", .dir.display())]
    Remove { dir: PathBuf, error: io::Error },
}

/// Removes `dir` (a sandbox's run dir) without ever walking into a mount. Its entries are
/// removed one level deep: rmdir refuses a directory something is mounted on (EBUSY) rather
/// than reading through it, and costs nothing like a read of the host's whole mount table.
/// Only a directory with content of its own (nothing Grove leaves there) falls back to that
/// table and a recursive removal.
pub fn remove_dir_unless_mounted(dir: &Path) -> Result<(), RemoveDirError> {
    let shallow = || -> io::Result<()> {
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            if e.file_type()?.is_dir() {
                std::fs::remove_dir(e.path())?;
            } else {
                std::fs::remove_file(e.path())?;
            }
        }
        std::fs::remove_dir(dir)
    };
    match shallow() {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            Err(RemoveDirError::Mounted(dir.to_path_buf()))
        }
        Err(_) => {
            let mounted = mount_points()
                .map(|m| m.iter().any(|p| p.starts_with(dir)))
                .unwrap_or(true);
            if mounted {
                return Err(RemoveDirError::Mounted(dir.to_path_buf()));
            }
            std::fs::remove_dir_all(dir).map_err(|error| RemoveDirError::Remove {
                dir: dir.to_path_buf(),
                error,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{remove_dir_unless_mounted, RemoveDirError};

    #[test]
    fn a_run_dir_is_removed_but_never_through_a_mount() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("sb");
        std::fs::create_dir_all(dir.join("root")).unwrap();
        std::fs::write(dir.join("record"), b"x").unwrap();
        remove_dir_unless_mounted(&dir).unwrap();
        assert!(!dir.exists());
        // Content below the first level (not Grove's) takes the careful path, and goes.
        std::fs::create_dir_all(dir.join("root/deeper")).unwrap();
        remove_dir_unless_mounted(&dir).unwrap();
        assert!(!dir.exists());
        remove_dir_unless_mounted(&dir).expect("an absent dir is removed already");
        if !nix::unistd::Uid::effective().is_root() {
            grove_testkit::capability_missing("the mounted half needs root to mount a tmpfs");
            return;
        }
        std::fs::create_dir_all(dir.join("root")).unwrap();
        let root = dir.join("root");
        nix::mount::mount(
            Some("tmpfs"),
            &root,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .unwrap();
        /// Unmounts even when an assertion fails, so a failed run leaves no mount behind.
        struct Unmount<'a>(&'a std::path::Path);
        impl Drop for Unmount<'_> {
            fn drop(&mut self) {
                let _ = nix::mount::umount2(self.0, nix::mount::MntFlags::MNT_DETACH);
            }
        }
        let mounted = Unmount(&root);
        std::fs::write(root.join("precious"), b"keep").unwrap();
        let err = remove_dir_unless_mounted(&dir).unwrap_err();
        assert!(
            matches!(&err, RemoveDirError::Mounted(d) if *d == dir),
            "{err}"
        );
        assert!(err.to_string().contains("still has mounts"), "{err}");
        assert_eq!(std::fs::read(root.join("precious")).unwrap(), b"keep");
        drop(mounted);
        remove_dir_unless_mounted(&dir).unwrap();
        assert!(!dir.exists());
    }
}
