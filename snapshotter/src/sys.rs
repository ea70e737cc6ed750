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

/// A mapping this value owns, unmapped on drop: a file mapped read-only and shared (its page
/// cache, no copy: `pagemap.rs` reads page images so), or one private anonymous region (the
/// dirty-tracking probe's page).
pub struct Mapping {
    ptr: *mut libc::c_void,
    len: usize,
    writable: bool,
}

// SAFETY: the mapping is owned by this value alone; shared access is only through `&[u8]`
// views, and writes need `&mut self`.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps all of `file` read-only (it must not shrink while mapped: image files are only
    /// replaced, never truncated). An empty file maps to an empty slice.
    pub fn file(file: &std::fs::File) -> io::Result<Mapping> {
        use std::os::fd::AsRawFd;
        let len = file.metadata()?.len() as usize;
        Self::map(len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd())
    }

    /// `len` bytes of fresh private anonymous memory, readable and writable.
    pub fn anon(len: usize) -> io::Result<Mapping> {
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        Self::map(len, prot, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1)
    }

    fn map(
        len: usize,
        prot: libc::c_int,
        flags: libc::c_int,
        fd: libc::c_int,
    ) -> io::Result<Mapping> {
        if len == 0 {
            return Ok(Mapping {
                ptr: std::ptr::null_mut(),
                len: 0,
                writable: false,
            });
        }
        // SAFETY: a fresh mapping at an address the kernel picks (of a file we hold open, or
        // anonymous): it aliases nothing this process has.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr,
            len,
            writable: prot & libc::PROT_WRITE != 0,
        })
    }

    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` maps `len` readable bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// The address of the first byte.
    pub fn start(&self) -> u64 {
        self.ptr as u64
    }

    /// Writes `value` to the first byte of page `page` (of an [`Mapping::anon`]).
    pub fn touch(&mut self, page: usize, value: u8) {
        assert!(self.writable && page * 4096 < self.len);
        // SAFETY: in bounds of a writable mapping (both asserted) this value owns exclusively;
        // `&mut self` rules out a concurrent access.
        unsafe { std::ptr::write_volatile((self.ptr as *mut u8).add(page * 4096), value) };
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: unmaps exactly the mapping made in `map`, once; no view of it outlives
            // `self` (they borrow it).
            unsafe { libc::munmap(self.ptr, self.len) };
        }
    }
}
