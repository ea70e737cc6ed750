//! The compatibility shim preloaded into CRIU (see compat/criu-shim.c): without it CRIU 4.1 cannot
//! dump TCP/UDP sockets on kernels >= 6.16, nor restore a tree with a dead session leader (the
//! root task then fails to re-enter its own mount namespace). Held in a memfd so no file is left on disk;
//! the child gets it at fd [`SHIM_FD`] and loads it through /proc/self/fd.

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

const SHIM: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/criu-shim.so"));

/// The fd number the shim has in the CRIU process.
pub const SHIM_FD: RawFd = 3;

#[derive(Debug)]
pub struct Shim {
    fd: OwnedFd,
}

impl Shim {
    /// None when the shim was not built (no C compiler at build time).
    pub fn load() -> Option<Shim> {
        if SHIM.is_empty() {
            return None;
        }
        // SAFETY: memfd_create with a valid NUL-terminated name; the result is checked.
        let raw = unsafe { libc::memfd_create(c"grove-criu-shim".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "memfd for the criu shim");
            return None;
        }
        // SAFETY: raw is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut f = std::fs::File::from(fd);
        if let Err(e) = f.write_all(SHIM) {
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
