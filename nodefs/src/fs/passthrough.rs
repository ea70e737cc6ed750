//! Whole-file objects for FUSE passthrough: a pristine base file is materialized once per
//! node under `<store>/cache/<content id>` and handed to the kernel as the backing file, so
//! reads bypass the server and the page cache is shared by every mount reading it. Large
//! files get theirs at import ([`ObjectWriter`]), the others at their first open.
//!
//! Which files pass through is a policy ([`wanted`]): while an inode has passthrough
//! readers the kernel accepts only passthrough opens of it, all to the same backing file,
//! and that file is the shared read-only object, so a writer cannot be let in. A write open
//! (or a truncate) then waits up to 200 ms for the readers' RELEASE and fails with ETXTBSY.
//! That matches native Linux for a running executable, so executables and shared libraries
//! pass through; ordinary files are served by the server and stay writable while read. The
//! one case left where a writer meets ETXTBSY although native Linux would let it in: a
//! pristine base file of 64 MiB or more (or an executable or library merely being read)
//! opened for writing while a read-only open of it is still held in the same mount.

use std::fs::{self, File};
use std::io::Write;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::file::Base;
use crate::store::Store;
use crate::tree::ChunkRef;

/// Passthrough is allowed unless `NODEFS_NO_PASSTHROUGH` is set: that turns it off for every
/// mount of the process and for import's whole-file objects. One mount can also go without
/// it through [`super::MountOptions::passthrough`] (for before/after measurements).
pub fn enabled() -> bool {
    std::env::var_os("NODEFS_NO_PASSTHROUGH").is_none()
}

/// Files at least this big pass through whatever they are: serving their reads costs most.
pub const LARGE: u64 = 64 << 20;

/// Whether read-only opens of a pristine base file should pass through. Passthrough puts the
/// inode in a mode where the kernel refuses writers (ETXTBSY) while readers are open, so it
/// is kept to files where that matches what programs expect or where speed matters most:
/// executables and shared libraries (native Linux refuses writing a running executable too)
/// and large files. Everything else is served with the kernel's page cache and stays
/// writable while read.
pub fn wanted(mode: u32, size: u64, lib_name: bool) -> bool {
    size > 0 && (mode & 0o111 != 0 || lib_name || size >= LARGE)
}

/// `*.so` or `*.so.N[.N...]`: a shared library (or a Python extension module) by name.
pub fn is_lib_name(name: &[u8]) -> bool {
    (1..name.len()).any(|i| {
        name[i..].starts_with(b".so") && {
            let tail = &name[i + 3..];
            tail.is_empty()
                || (tail.len() > 1
                    && tail[0] == b'.'
                    && tail[1..].iter().all(|c| c.is_ascii_digit() || *c == b'.'))
        }
    })
}

/// xattr holding the BLAKE3 of a cache file's content, checked by fsck.
pub const CONTENT_XATTR: &[u8] = b"user.nodefs.content";

/// Files up to this size are materialized inside the open call; bigger ones in the
/// background (that open is served by the server, later ones pass through).
const SYNC_LIMIT: u64 = 16 << 20;

static IN_PROGRESS: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// The cache file name of the whole-file object of a file made of `chunks`.
pub(crate) fn object_name(chunks: &[ChunkRef]) -> String {
    let mut h = blake3::Hasher::new();
    for c in chunks {
        h.update(&c.id.0);
        h.update(&c.len.to_le_bytes());
    }
    h.finalize().to_hex().to_string()
}

/// The whole-file object for `base` if it can be had now.
pub fn open_object(store: &Arc<Store>, base: &Arc<Base>) -> std::io::Result<Option<File>> {
    let name = object_name(&base.chunks);
    let path = store.dir().join("cache").join(&name);
    if let Ok(f) = File::open(&path) {
        return Ok(Some(f));
    }
    if base.len() <= SYNC_LIMIT {
        return materialize(store, base, &name).map(Some);
    }
    let mut g = IN_PROGRESS.lock();
    if g.get_or_insert_with(HashSet::new).insert(name.clone()) {
        let (store, base) = (store.clone(), base.clone());
        std::thread::spawn(move || {
            if let Err(e) = materialize(&store, &base, &name) {
                tracing::warn!(error = %e, "materializing a whole-file object failed");
            }
            if let Some(s) = IN_PROGRESS.lock().as_mut() {
                s.remove(&name);
            }
        });
    }
    Ok(None)
}

/// Write the whole-file object (temp file, rename) and open it read-only.
fn materialize(store: &Store, base: &Base, name: &str) -> std::io::Result<File> {
    let dir = store.dir().join("cache");
    let path = dir.join(name);
    let tmp = dir.join(format!(
        "{name}.tmp{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let mut out = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
    let mut h = blake3::Hasher::new();
    for c in &base.chunks {
        let data = store
            .get_chunk(&c.id)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        h.update(&data);
        out.write_all(&data)?;
    }
    let f = out.into_inner().map_err(|e| e.into_error())?;
    drop(f);
    crate::sys::lsetxattr(&tmp, CONTENT_XATTR, h.finalize().to_hex().as_bytes())?;
    fs::rename(&tmp, &path)?;
    File::open(&path)
}

/// A whole-file object written while a large file's content streams past during import, so
/// that even the first (cold) open of the file passes through instead of being served while
/// the object is built.
pub struct ObjectWriter {
    dir: PathBuf,
    tmp: PathBuf,
    out: Option<std::io::BufWriter<File>>,
    hash: blake3::Hasher,
}

impl ObjectWriter {
    /// Whether a file of `size` bytes gets its object at import.
    pub fn wanted(size: u64) -> bool {
        enabled() && size >= LARGE
    }

    pub fn new(store: &Store) -> std::io::Result<ObjectWriter> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let dir = store.dir().join("cache");
        let tmp = dir.join(format!(
            "import-{}-{}.tmp",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let out = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        Ok(ObjectWriter {
            dir,
            tmp,
            out: Some(out),
            hash: blake3::Hasher::new(),
        })
    }

    pub fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.hash.update(data);
        match &mut self.out {
            Some(o) => o.write_all(data),
            None => Ok(()),
        }
    }

    /// Name the object after the file's chunks and put it in place.
    pub fn finish(mut self, chunks: &[ChunkRef]) -> std::io::Result<()> {
        if let Some(o) = self.out.take() {
            drop(o.into_inner().map_err(|e| e.into_error())?);
        }
        crate::sys::lsetxattr(
            &self.tmp,
            CONTENT_XATTR,
            self.hash.finalize().to_hex().as_bytes(),
        )?;
        fs::rename(&self.tmp, self.dir.join(object_name(chunks)))
    }
}

impl Drop for ObjectWriter {
    fn drop(&mut self) {
        // Gone already after a successful finish.
        let _ = fs::remove_file(&self.tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_names() {
        for n in [
            "libc.so.6",
            "libpython3.11.so.1.0",
            "libz.so",
            "_ssl.cpython-311-x86_64-linux-gnu.so",
            "libfoo.so.so.2",
        ] {
            assert!(is_lib_name(n.as_bytes()), "{n}");
        }
        for n in [
            ".so",
            "so",
            "notes.sort",
            "libc.so.6.bak",
            "x.so.",
            "a.sox",
            "ld.so.conf",
        ] {
            assert!(!is_lib_name(n.as_bytes()), "{n}");
        }
    }

    #[test]
    fn policy() {
        assert!(wanted(0o755, 1, false));
        assert!(wanted(0o100, 1, false));
        assert!(wanted(0o644, 10, true));
        assert!(wanted(0o644, LARGE, false));
        assert!(!wanted(0o644, LARGE - 1, false));
        assert!(!wanted(0o755, 0, true));
    }
}
