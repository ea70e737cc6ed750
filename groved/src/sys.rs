//! groved's system calls that `nix` does not wrap: one place for their unsafe blocks.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

/// io_uring_setup(2) with a two-entry ring: whether this process may use io_uring (a kernel can
/// have it compiled out or disabled by `kernel.io_uring_disabled`). The ring is closed at once.
pub fn io_uring_probe() -> io::Result<()> {
    // io_uring_params is 120 bytes; the kernel fills it in.
    let mut params = [0u8; 120];
    // SAFETY: io_uring_setup reads/writes exactly one io_uring_params struct (120 bytes)
    // through the pointer, which `params` provides.
    let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 2u32, params.as_mut_ptr()) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a descriptor we just obtained; dropping it closes the ring.
    drop(unsafe { OwnedFd::from_raw_fd(fd as i32) });
    Ok(())
}
