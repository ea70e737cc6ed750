//! Thin wrappers over the few libc calls std lacks (xattrs, mknod, lchown, times).

use std::ffi::CString;
use std::io;
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

/// mknod(2).
pub fn mknod(p: &Path, mode: u32, rdev: u64) -> io::Result<()> {
    let c = cpath(p)?;
    // SAFETY: valid C string.
    check(unsafe { libc::mknod(c.as_ptr(), mode as libc::mode_t, rdev as libc::dev_t) })
}

/// lchown(2).
pub fn lchown(p: &Path, uid: u32, gid: u32) -> io::Result<()> {
    let c = cpath(p)?;
    // SAFETY: valid C string.
    check(unsafe { libc::lchown(c.as_ptr(), uid, gid) })
}

/// Set atime and mtime of `p` to (sec, nsec), not following symlinks.
pub fn lutimes(p: &Path, sec: i64, nsec: u32) -> io::Result<()> {
    let c = cpath(p)?;
    let ts = libc::timespec {
        tv_sec: sec as libc::time_t,
        tv_nsec: nsec as libc::c_long,
    };
    let times = [ts, ts];
    // SAFETY: valid C string and a two-element timespec array.
    check(unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })
}
