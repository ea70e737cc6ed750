//! The snapshotter's system calls that neither `nix` nor `grove_sys` wraps: one place for their
//! unsafe blocks.

use std::io;

/// PR_GET_MEMORY_MERGE: whether KSM merges this process's memory. EINVAL before Linux 6.4.
pub fn memory_merge() -> io::Result<bool> {
    // SAFETY: PR_GET_MEMORY_MERGE reads a flag of this process's mm; no memory is passed.
    let r = unsafe { libc::prctl(libc::PR_GET_MEMORY_MERGE, 0, 0, 0, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r == 1)
}

/// PR_SET_MEMORY_MERGE: lets KSM merge this process's memory (and its children's, which inherit
/// the flag). Async-signal-safe: for a child between fork and exec.
pub fn set_memory_merge() -> io::Result<()> {
    // SAFETY: PR_SET_MEMORY_MERGE sets a flag of this process's mm; no memory is passed.
    if unsafe { libc::prctl(libc::PR_SET_MEMORY_MERGE, 1, 0, 0, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
