//! The node's content store: chunks and tree objects in packs, manifests, refs.
//!
//! This file opens a store (its lock, format and directories) and holds what every part
//! shares; the parts, one job each:
//! - `objects`: putting and getting chunks and trees (compression, deltas, the caches);
//! - `refs`: manifest markers, names for manifests, and the grace of an import's manifest;
//! - `reach`: walking what a manifest reaches;
//! - `gc`: pins and garbage collection;
//! - `fsck`: verifying every stored manifest and the whole-file cache.

mod fsck;
mod gc;
mod objects;
mod reach;
mod refs;
pub(crate) mod zstd_ctx;

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use serde::{Deserialize, Serialize};

use crate::cache::Cache;
use crate::error::{store_io, StoreError};
use crate::id::{ManifestId, ObjectId};
use crate::pack::{sync_dir, Kind, PackSet};
use crate::tree::Tree;

pub use fsck::FsckReport;
pub use gc::GcReport;

const FORMAT: &str = "nodefs-store 1\n";
/// Longest delta chain; deeper would make reads slow.
pub(crate) const MAX_DELTA_DEPTH: u8 = 4;
const CACHE_BYTES: usize = 64 << 20;
/// Decoded trees kept, counted in entries: a mount loads a directory from here, so every
/// sandbox on an image shares one decoded copy of each directory it opens.
const TREE_CACHE_ENTRIES: usize = 1 << 17;
const ZSTD_LEVEL: i32 = 3;
/// File content is compressed faster (imports and snapshots are on the hot path).
pub(crate) const CHUNK_ZSTD_LEVEL: i32 = 1;
/// How long gc keeps a manifest that an import made and no ref names yet (tests change it
/// with `Store::set_fresh_grace`, feature `test-knobs`).
const FRESH_GRACE: std::time::Duration = std::time::Duration::from_secs(600);
/// How long `Store::open` waits for another holder of the store's lock to let go.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Counters describing the store.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct StoreStats {
    pub chunks: u64,
    /// Compressed bytes on disk (pack payloads and headers).
    pub stored_bytes: u64,
    /// Uncompressed bytes of all chunks.
    pub logical_bytes: u64,
    pub manifests: u64,
}

static OPEN_STORES: Mutex<Option<HashMap<PathBuf, std::sync::Weak<Store>>>> = Mutex::new(None);

/// The node's content store in a directory.
pub struct Store {
    /// Holds an exclusive flock on `<dir>/LOCK` for the store's lifetime.
    _lock: Flock<fs::File>,
    dir: PathBuf,
    packs: PackSet,
    cache: Mutex<Cache<Vec<u8>>>,
    trees: Mutex<Cache<Tree>>,
    /// Writers (imports, commits) hold it shared; gc holds it exclusively, so chunks of a
    /// manifest being built are never collected.
    gc_lock: RwLock<()>,
    refs_lock: Mutex<()>,
    pins: Mutex<HashMap<ObjectId, usize>>,
    /// Manifests made by an import and not yet named by a ref, with when: gc keeps them for
    /// `fresh_grace`, so one that gc runs between an import returning and the caller's
    /// `set_ref` is not lost (the import may have come over the service, so no pin can span
    /// it).
    fresh: Mutex<HashMap<ManifestId, std::time::Instant>>,
    fresh_grace: Mutex<std::time::Duration>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("dir", &self.dir).finish()
    }
}

/// Write `data` to `path` durably: temp file, fsync, rename, fsync dir.
pub(crate) fn write_durable(path: &Path, data: &[u8]) -> Result<(), StoreError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = fs::File::create(&tmp).map_err(store_io(&tmp))?;
    f.write_all(data).map_err(store_io(&tmp))?;
    f.sync_all().map_err(store_io(&tmp))?;
    drop(f);
    fs::rename(&tmp, path).map_err(store_io(path))?;
    sync_dir(dir)
}

impl Store {
    /// Open (creating if missing) the store in `dir`. Safe after a crash: torn pack tails
    /// are cut and temp files removed. Opening a store this process already has open returns
    /// the same instance; a store held by another process is refused (packs have one writer).
    pub fn open(dir: &Path) -> Result<Arc<Store>, StoreError> {
        fs::create_dir_all(dir).map_err(store_io(dir))?;
        let key = dir.canonicalize().map_err(store_io(dir))?;
        let mut open = OPEN_STORES.lock();
        let map = open.get_or_insert_with(HashMap::new);
        map.retain(|_, w| w.strong_count() > 0);
        if let Some(s) = map.get(&key).and_then(|w| w.upgrade()) {
            return Ok(s);
        }
        let s = Store::open_new(dir)?;
        map.insert(key, Arc::downgrade(&s));
        Ok(s)
    }

    fn open_new(dir: &Path) -> Result<Arc<Store>, StoreError> {
        let lock_path = dir.join("LOCK");
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(store_io(&lock_path))?;
        // A holder that is exiting (a restarting daemon's predecessor, or a child forked by
        // another thread that has not reached exec yet) lets go within moments: wait a little
        // before refusing.
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        let mut lock = lock;
        let lock = loop {
            match Flock::lock(lock, FlockArg::LockExclusiveNonblock) {
                Ok(held) => break held,
                Err((file, Errno::EWOULDBLOCK)) => lock = file,
                Err((_, e)) => {
                    return Err(StoreError::Io {
                        path: lock_path,
                        source: e.into(),
                    })
                }
            }
            if std::time::Instant::now() >= deadline {
                return Err(StoreError::Io {
                    path: lock_path,
                    source: std::io::Error::other("store is in use by another process"),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let fmt = dir.join("FORMAT");
        // Compared byte for byte: a damaged file is refused like another version.
        match fs::read(&fmt) {
            Ok(s) if s == FORMAT.as_bytes() => {}
            Ok(s) => {
                return Err(StoreError::Version {
                    path: fmt,
                    version: String::from_utf8_lossy(&s).into_owned(),
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                write_durable(&fmt, FORMAT.as_bytes())?;
            }
            Err(e) => return Err(store_io(&fmt)(e)),
        }
        for sub in ["refs", "manifests", "cache"] {
            let p = dir.join(sub);
            fs::create_dir_all(&p).map_err(store_io(&p))?;
            for e in fs::read_dir(&p).map_err(store_io(&p))?.flatten() {
                if e.file_name().to_string_lossy().contains(".tmp") {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        let packs = PackSet::open(&dir.join("packs"))?;
        Ok(Arc::new(Store {
            _lock: lock,
            dir: dir.to_path_buf(),
            packs,
            cache: Mutex::new(Cache::new(CACHE_BYTES)),
            trees: Mutex::new(Cache::new(TREE_CACHE_ENTRIES)),
            gc_lock: RwLock::new(()),
            refs_lock: Mutex::new(()),
            pins: Mutex::new(HashMap::new()),
            fresh: Mutex::new(HashMap::new()),
            fresh_grace: Mutex::new(FRESH_GRACE),
        }))
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Held while building objects that are not yet reachable from a ref.
    pub(crate) fn write_guard(&self) -> RwLockReadGuard<'_, ()> {
        self.gc_lock.read()
    }

    /// Store counters.
    pub fn stats(&self) -> StoreStats {
        let mut s = StoreStats::default();
        for (_, l) in self.packs.all() {
            if l.kind == Kind::Chunk {
                s.chunks += 1;
                s.logical_bytes += l.raw_len as u64;
            }
        }
        s.stored_bytes = self.packs.disk_bytes();
        s.manifests = fs::read_dir(self.dir.join("manifests"))
            .map(|d| d.flatten().filter(|e| e.file_name().len() == 64).count() as u64)
            .unwrap_or(0);
        s
    }

    /// Bytes of all pack files: what `stats().stored_bytes` says, without walking the index.
    pub fn stored_bytes(&self) -> u64 {
        self.packs.disk_bytes()
    }

    pub(crate) fn packs(&self) -> &PackSet {
        &self.packs
    }
}
