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
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::file::Base;
use crate::store::Store;
use crate::tree::ChunkRef;

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

/// What identifies one version of a cache file's content: any write to it (even one that
/// puts its mtime back with utimensat) changes its ctime, a replacement changes its inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(f: &File) -> std::io::Result<Stamp> {
        let m = f.metadata()?;
        Ok(Stamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
}

/// Cache files whose content this process has checked against their chunks' ids (or
/// written itself), with the stamp they had then. A cache file is handed to the kernel for
/// passthrough only while its stamp is the one recorded: the kernel reads it without asking
/// the server, so this is the only point where a damaged copy can be caught.
static VERIFIED: Mutex<Option<HashMap<PathBuf, Stamp>>> = Mutex::new(None);

fn verified(path: &Path, stamp: &Stamp) -> bool {
    VERIFIED
        .lock()
        .as_ref()
        .and_then(|m| m.get(path))
        .is_some_and(|s| s == stamp)
}

fn mark_verified(path: &Path, stamp: Stamp) {
    VERIFIED
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(path.to_path_buf(), stamp);
}

/// Whether `f` holds exactly the content of `chunks`: its size, and the BLAKE3 of every
/// chunk-sized piece against the chunk's id (the content address itself, not a hash kept
/// next to the copy).
fn content_matches(f: &File, chunks: &[ChunkRef]) -> std::io::Result<bool> {
    let want: u64 = chunks.iter().map(|c| c.len as u64).sum();
    if f.metadata()?.size() != want {
        return Ok(false);
    }
    let mut r = std::io::BufReader::with_capacity(1 << 20, f);
    let mut buf = Vec::new();
    for c in chunks {
        buf.resize(c.len as usize, 0);
        if let Err(e) = r.read_exact(&mut buf) {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                return Ok(false);
            }
            return Err(e);
        }
        if crate::id::ObjectId::hash(&buf) != c.id {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Opens the cache file at `path` if it holds `base`'s content: checked once per version
/// of the file (see [`Stamp`]). A file that does not match is removed (it is derived data)
/// and `Ok(None)` returned; so is a missing one.
fn open_checked(path: &Path, base: &Base) -> std::io::Result<Option<File>> {
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let stamp = Stamp::of(&f)?;
    if verified(path, &stamp) {
        return Ok(Some(f));
    }
    // Hashed through a second descriptor, so `f`'s offset stays at 0 for the kernel.
    let ok = content_matches(&File::open(path)?, &base.chunks)?;
    // A change while it was being hashed shows in the stamp.
    if ok && Stamp::of(&f)? == stamp {
        mark_verified(path, stamp);
        return Ok(Some(f));
    }
    tracing::warn!(path = %path.display(), "whole-file cache object does not match its content; rebuilding it");
    // Only if it is still the file that failed (another thread may have replaced it).
    if File::open(path).and_then(|g| Stamp::of(&g)).ok() == Some(stamp) {
        let _ = fs::remove_file(path);
    }
    Ok(None)
}

/// The whole-file object for `base` if it can be had now, verified (see [`open_checked`]).
/// Small objects are built or checked inside the call; big ones in the background (this
/// open is then served by the server, a later one passes through).
pub fn open_object(store: &Arc<Store>, base: &Arc<Base>) -> std::io::Result<Option<File>> {
    let name = object_name(&base.chunks);
    let path = store.dir().join("cache").join(&name);
    let small = base.len() <= SYNC_LIMIT;
    if small {
        if let Some(f) = open_checked(&path, base)? {
            return Ok(Some(f));
        }
        return materialize(store, base, &name).map(Some);
    }
    // Already checked: no need to go to the background.
    if let Ok(f) = File::open(&path) {
        if Stamp::of(&f).is_ok_and(|s| verified(&path, &s)) {
            return Ok(Some(f));
        }
    }
    let mut g = IN_PROGRESS.lock();
    if g.get_or_insert_with(HashSet::new).insert(name.clone()) {
        let (store, base) = (store.clone(), base.clone());
        std::thread::spawn(move || {
            let r = match open_checked(&path, &base) {
                Ok(Some(_)) => Ok(()),
                Ok(None) => materialize(&store, &base, &name).map(drop),
                Err(e) => Err(e),
            };
            if let Err(e) = r {
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
    let r = write_object(store, base, &tmp, &path);
    if r.is_err() {
        // A full disk must not leave half an object behind.
        let _ = fs::remove_file(&tmp);
    }
    r
}

fn write_object(store: &Store, base: &Base, tmp: &Path, path: &Path) -> std::io::Result<File> {
    let mut out = std::io::BufWriter::with_capacity(1 << 20, File::create(tmp)?);
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
    crate::sys::lsetxattr(tmp, CONTENT_XATTR, h.finalize().to_hex().as_bytes())?;
    install_checked(tmp, path)
}

/// Rename a cache object this process wrote (from verified chunks) into place, open it and
/// record it as checked. Opened before the rename, so what is recorded is that file, not
/// one put there meanwhile; stamped after it (a rename changes the ctime).
fn install_checked(tmp: &Path, path: &Path) -> std::io::Result<File> {
    let f = File::open(tmp)?;
    fs::rename(tmp, path)?;
    mark_verified(path, Stamp::of(&f)?);
    Ok(f)
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
    /// Whether a file of `size` bytes gets its object at import (whether or not a server that
    /// mounts it later passes through).
    pub fn wanted(size: u64) -> bool {
        size >= LARGE
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
        // Written from the bytes the chunks were cut from: checked, for this process.
        install_checked(&self.tmp, &self.dir.join(object_name(chunks))).map(drop)
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
