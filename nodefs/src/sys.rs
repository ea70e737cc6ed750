//! nodefs's system calls that neither std nor `nix` wraps (xattrs, a statx that does not sync,
//! open by file handle, allocator tuning): one place for their unsafe blocks.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// All xattrs of `p` (not following symlinks).
pub fn lxattrs(p: &Path) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let c = cpath(p)?;
    // SAFETY: c is a valid C string; a null buffer with size 0 asks for the needed size.
    let n = unsafe { libc::llistxattr(c.as_ptr(), std::ptr::null_mut(), 0) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOTSUP) {
            return Ok(Vec::new());
        }
        return Err(e);
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut names = vec![0u8; n as usize];
    // SAFETY: the buffer is valid for names.len() bytes.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    names.truncate(n as usize);
    let mut out = Vec::new();
    for name in names.split(|b| *b == 0).filter(|s| !s.is_empty()) {
        let cn = CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: valid C strings; null buffer asks for the size.
        let sz = unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), std::ptr::null_mut(), 0) };
        if sz < 0 {
            continue;
        }
        let mut v = vec![0u8; sz as usize];
        // SAFETY: the buffer is valid for v.len() bytes.
        let sz =
            unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        if sz < 0 {
            continue;
        }
        v.truncate(sz as usize);
        out.push((name.to_vec(), v));
    }
    Ok(out)
}

/// Set one xattr on `p` (not following symlinks).
pub fn lsetxattr(p: &Path, name: &[u8], value: &[u8]) -> io::Result<()> {
    let c = cpath(p)?;
    let cn = CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: valid C strings and a buffer valid for value.len() bytes.
    check(unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            cn.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    })
}

/// The device minor of the filesystem at `path` from what the kernel has cached
/// (`AT_STATX_DONT_SYNC`): a plain stat asks a FUSE server, and one that no longer answers would
/// hang it.
pub fn cached_dev_minor(path: &CStr) -> io::Result<u32> {
    // SAFETY: statx is plain old data; all zeroes is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: path is NUL-terminated; stx is a valid, writable statx.
    check(unsafe {
        libc::statx(
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::AT_STATX_DONT_SYNC,
            libc::STATX_BASIC_STATS,
            &mut stx,
        )
    })?;
    Ok(stx.stx_dev_minor)
}

/// Open the inode whose FUSE node id is `nodeid` on the FUSE mount `mount` (read-only), by the
/// file handle the kernel's FUSE export operations encode (`FILEID_INO64_GEN`: the node id's
/// high and low words, then the generation, which nodefs leaves 0). The kernel finds the inode
/// only while it is in its cache (nodefs does not offer `export_support`), so an open file's:
/// `ESTALE` otherwise. Needs CAP_DAC_READ_SEARCH.
pub fn open_fuse_inode(mount: BorrowedFd<'_>, nodeid: u64) -> io::Result<OwnedFd> {
    const FILEID_INO64_GEN: libc::c_int = 0x81;
    #[repr(C)]
    struct Handle {
        handle_bytes: libc::c_uint,
        handle_type: libc::c_int,
        f_handle: [u32; 3],
    }
    let mut h = Handle {
        handle_bytes: 12,
        handle_type: FILEID_INO64_GEN,
        f_handle: [(nodeid >> 32) as u32, nodeid as u32, 0],
    };
    // SAFETY: `h` is laid out as the kernel's struct file_handle with its 12 handle bytes
    // inline; the kernel reads it and returns a new fd or -1.
    let fd = unsafe {
        libc::open_by_handle_at(
            mount.as_raw_fd(),
            (&mut h as *mut Handle).cast(),
            libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOCTTY,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sets the allocator's mmap threshold to `bytes`: allocations at or above it get fresh mmap'd
/// pages, returned to the kernel when freed.
pub fn set_mmap_threshold(bytes: i32) {
    // SAFETY: mallopt only changes allocator tuning; any positive threshold is valid.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, bytes) };
}
