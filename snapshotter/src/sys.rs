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

/// A file mapped read-only and shared (its page cache, no copy), unmapped on drop.
pub struct Mapped {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is read-only and owned by this value alone; sharing `&[u8]` views of it
// across threads is as safe as sharing any immutable byte slice.
unsafe impl Send for Mapped {}
// SAFETY: as above, only shared reads.
unsafe impl Sync for Mapped {}

impl Mapped {
    /// Maps all of `file` (which must not shrink while mapped: image files are only replaced,
    /// never truncated). An empty file maps to an empty slice.
    pub fn file(file: &std::fs::File) -> io::Result<Mapped> {
        use std::os::fd::AsRawFd;
        let len = file.metadata()?.len() as usize;
        if len == 0 {
            return Ok(Mapped {
                ptr: std::ptr::null_mut(),
                len: 0,
            });
        }
        // SAFETY: a fresh read-only shared mapping of a file we hold open; the kernel picks the
        // address; nothing else aliases it.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapped { ptr, len })
    }

    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` maps `len` readable bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: unmaps exactly the mapping made in `file`, once; no slice of it outlives
            // `self` (they borrow it).
            unsafe { libc::munmap(self.ptr, self.len) };
        }
    }
}
