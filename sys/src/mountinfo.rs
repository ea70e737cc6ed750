//! `/proc/*/mountinfo` fields.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

/// Decodes a mountinfo path field: the kernel writes space, tab, newline and backslash as
/// `\ooo`. Paths need not be UTF-8, so the bytes are kept as they are.
pub fn unescape(s: &str) -> PathBuf {
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
    PathBuf::from(OsString::from_vec(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;

    #[test]
    fn decodes_octal_escapes_and_keeps_non_utf8_bytes() {
        assert_eq!(
            unescape(r"/a\040b\011c\012d\134e"),
            PathBuf::from("/a b\tc\nd\\e")
        );
        assert_eq!(unescape(r"/x\377y").as_os_str().as_bytes(), b"/x\xffy");
        // Not an escape: too short, or not octal.
        assert_eq!(unescape(r"/end\04"), PathBuf::from(r"/end\04"));
        assert_eq!(unescape(r"/n\089"), PathBuf::from(r"/n\089"));
    }
}
