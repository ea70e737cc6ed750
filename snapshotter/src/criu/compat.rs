//! The compatibility shim preloaded into CRIU (see compat/criu-shim.c): without it CRIU 4.1 cannot
//! dump TCP/UDP sockets on kernels >= 6.16, nor restore a tree with a dead session leader (the
//! root task then fails to re-enter its own mount namespace). Held in a memfd so no file is left on disk;
//! the child gets it at fd [`SHIM_FD`] and loads it through /proc/self/fd. The shim also moves
//! CRIU's kernel-feature cache to a tmpfs where /run is none (see [`kdat_cache`]).

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use std::path::{Path, PathBuf};

const SHIM: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/criu-shim.so"));
/// The build with the userfaultfd write-protect part (see compat/criu-shim.c, 4).
const SHIM_UFFD: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/criu-shim-uffd.so"));

/// The fd number the shim has in the CRIU process.
pub const SHIM_FD: RawFd = 3;

#[derive(Debug)]
pub struct Shim {
    fd: OwnedFd,
}

impl Shim {
    /// None when the shim was not built (no C compiler at build time).
    pub fn load() -> Option<Shim> {
        Self::load_bytes(SHIM)
    }

    /// The build for dumps of sandboxes tracked by userfaultfd write-protect.
    pub fn load_uffd() -> Option<Shim> {
        Self::load_bytes(SHIM_UFFD)
    }

    fn load_bytes(bytes: &[u8]) -> Option<Shim> {
        if bytes.is_empty() {
            return None;
        }
        let fd = match memfd_create(c"grove-criu-shim", MemFdCreateFlag::MFD_CLOEXEC) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!(error = %std::io::Error::from(e), "memfd for the criu shim");
                return None;
            }
        };
        let mut f = std::fs::File::from(fd);
        if let Err(e) = f.write_all(bytes) {
            tracing::warn!(error = %e, "writing the criu shim");
            return None;
        }
        Some(Shim { fd: f.into() })
    }

    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The LD_PRELOAD value for the child.
    pub fn preload_path() -> String {
        format!("/proc/self/fd/{SHIM_FD}")
    }
}

/// Set to "1" for a dump whose sandbox Grove tracks with userfaultfd write-protect: the shim
/// then answers CRIU's soft-dirty questions from the tracking (see compat/criu-shim.c, 4).
pub const UFFD_WP_ENV: &str = "GROVE_UFFD_WP";

/// The variable through which the shim learns where the kernel-feature cache goes.
pub const KDAT_ENV: &str = "GROVE_CRIU_KDAT";

/// CRIU keeps its kernel-feature cache (`/run/criu.kdat`) only on a tmpfs, so that it never
/// outlives a reboot; without it every CRIU run probes the kernel again (about 30 ms on this
/// VM, for each dump, restore and lazy-pages daemon). None where /run is a tmpfs (CRIU's own
/// place works) or no tmpfs is at hand; else `/dev/shm/criu.kdat`.
pub fn kdat_cache() -> Option<PathBuf> {
    kdat_cache_for(Path::new("/run"), Path::new("/dev/shm"))
}

fn kdat_cache_for(run: &Path, shm: &Path) -> Option<PathBuf> {
    if is_tmpfs(run) || !is_tmpfs(shm) {
        return None;
    }
    Some(shm.join("criu.kdat"))
}

fn is_tmpfs(dir: &Path) -> bool {
    nix::sys::statfs::statfs(dir)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kdat_cache_goes_to_a_tmpfs_only_where_run_is_none() {
        let disk = tempfile::tempdir_in("/var/tmp").unwrap();
        let shm = Path::new("/dev/shm");
        if !is_tmpfs(shm) || is_tmpfs(disk.path()) {
            grove_testkit::capability_missing("needs /dev/shm on a tmpfs and /var/tmp on disk");
            return;
        }
        assert_eq!(
            kdat_cache_for(disk.path(), shm),
            Some(shm.join("criu.kdat"))
        );
        assert_eq!(
            kdat_cache_for(shm, shm),
            None,
            "/run on tmpfs: CRIU's own place"
        );
        assert_eq!(
            kdat_cache_for(disk.path(), disk.path()),
            None,
            "no tmpfs at hand"
        );
    }
}
