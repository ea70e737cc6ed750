//! Host mount-table helpers (reading /proc/self/mountinfo, unmounting).

use std::io;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

/// Mount points from /proc/self/mountinfo (octal escapes decoded).
pub fn mount_points() -> io::Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(text
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape)
        .collect())
}

/// Decodes mountinfo's \ooo escapes (space, tab, newline, backslash); paths need not be UTF-8.
fn unescape(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
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

#[cfg(test)]
mod tests {
    use std::os::unix::ffi::OsStrExt;

    use super::unescape;

    #[test]
    fn unescape_decodes_octal_and_keeps_non_utf8_bytes() {
        assert_eq!(unescape(r"/run/a\040b"), std::path::Path::new("/run/a b"));
        let p = unescape(r"/x\377y");
        assert_eq!(p.as_os_str().as_bytes(), b"/x\xffy");
    }
}
