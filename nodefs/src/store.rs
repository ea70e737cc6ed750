//! The node's content store: chunks and tree objects in packs, manifests, refs.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use serde::{Deserialize, Serialize};

use crate::cache::Cache;
use crate::error::{io_err, store_io, Error, StoreError};
use crate::id::{ManifestId, ObjectId};
use crate::pack::{sync_dir, Codec, Kind, PackSet, Record};
use crate::tree::{Node, Tree};

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

/// What a gc run did.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct GcReport {
    pub kept_objects: u64,
    pub removed_objects: u64,
    /// Disk space the store's files took before the run less what they take after
    /// (allocated blocks of packs, idx files, cache files and markers), measured.
    pub freed_bytes: u64,
    /// Packs deleted whole (nothing in them was live).
    #[serde(default)]
    pub packs_deleted: u64,
    /// Packs whose dead records were punched out in place.
    #[serde(default)]
    pub packs_punched: u64,
    /// Packs rewritten (on a filesystem that cannot punch holes).
    #[serde(default)]
    pub packs_rewritten: u64,
    /// Packs whose dead records stay for now: no hole punching and no room to rewrite them.
    #[serde(default)]
    pub packs_left: u64,
}

/// What fsck found.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FsckReport {
    pub manifests: u64,
    pub objects_checked: u64,
    /// Objects that are missing or fail their hash, with why.
    pub bad: Vec<(ObjectId, String)>,
    /// Whole-file cache entries that failed their check and were deleted (derived data).
    pub cache_removed: Vec<PathBuf>,
}

impl FsckReport {
    pub fn is_clean(&self) -> bool {
        self.bad.is_empty()
    }
}

static OPEN_STORES: Mutex<Option<HashMap<PathBuf, std::sync::Weak<Store>>>> = Mutex::new(None);

/// The node's content store in a directory.
pub struct Store {
    /// Holds an exclusive flock on `<dir>/LOCK` for the store's lifetime.
    _lock: fs::File,
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

fn check8(s: &str) -> String {
    hex::encode(&blake3::hash(s.as_bytes()).as_bytes()[..4])
}

fn valid_ref(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && !name.starts_with('/')
        && !name.ends_with('/')
        && !name.contains("..")
        && !name.contains("//")
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:@+=/-".contains(&b))
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
        loop {
            // SAFETY: flock on an fd we own.
            let r = unsafe {
                libc::flock(
                    std::os::fd::AsRawFd::as_raw_fd(&lock),
                    libc::LOCK_EX | libc::LOCK_NB,
                )
            };
            if r == 0 {
                break;
            }
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(StoreError::Io {
                    path: lock_path,
                    source: err,
                });
            }
            if std::time::Instant::now() >= deadline {
                return Err(StoreError::Io {
                    path: lock_path,
                    source: std::io::Error::other("store is in use by another process"),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
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

    /// Store a chunk (deduplicated). With `parent`, try a zstd delta against it.
    pub fn put_chunk(
        &self,
        data: &[u8],
        parent: Option<&ObjectId>,
    ) -> Result<ObjectId, StoreError> {
        let id = ObjectId::hash(data);
        if self.packs.contains(&id) {
            return Ok(id);
        }
        let plain = zstd::bulk::compress(data, CHUNK_ZSTD_LEVEL).map_err(store_io(&self.dir))?;
        let (mut codec, mut payload, mut base, mut depth) = if plain.len() < data.len() {
            (Codec::Zstd, plain, ObjectId([0; 32]), 0)
        } else {
            (Codec::Raw, data.to_vec(), ObjectId([0; 32]), 0)
        };
        if let Some(p) = parent.filter(|p| **p != id) {
            if let Some(ploc) = self.packs.get(p) {
                if ploc.depth < MAX_DELTA_DEPTH && ploc.kind == Kind::Chunk {
                    if let Ok(pdata) = self.get_chunk(p) {
                        if let Ok(d) = delta_compress(data, &pdata) {
                            // Only worth a chain link when clearly smaller.
                            if d.len() + 64 < payload.len() / 2 {
                                codec = Codec::Delta;
                                payload = d;
                                base = *p;
                                depth = ploc.depth + 1;
                            }
                        }
                    }
                }
            }
        }
        self.packs.append(&Record {
            id,
            kind: Kind::Chunk,
            codec,
            depth,
            raw_len: data.len() as u32,
            base,
            payload: &payload,
        })?;
        Ok(id)
    }

    /// Store many chunks: hashing and compression run on all cores, the pack gets one
    /// write. Returns the ids in order.
    pub fn put_chunks(&self, chunks: &[Vec<u8>]) -> Result<Vec<ObjectId>, StoreError> {
        let threads = crate::cpus().min(chunks.len().max(1));
        let mut ids = vec![ObjectId([0; 32]); chunks.len()];
        let mut payloads: Vec<Option<(Codec, Vec<u8>)>> = vec![None; chunks.len()];
        let work = |k: usize, ids: &mut [ObjectId], out: &mut [Option<(Codec, Vec<u8>)>]| {
            for (j, (id, p)) in ids.iter_mut().zip(out.iter_mut()).enumerate() {
                let data = &chunks[k + j];
                *id = ObjectId::hash(data);
                if self.packs.contains(id) {
                    continue;
                }
                *p = Some(match zstd::bulk::compress(data, CHUNK_ZSTD_LEVEL) {
                    Ok(z) if z.len() < data.len() => (Codec::Zstd, z),
                    _ => (Codec::Raw, data.clone()),
                });
            }
        };
        if threads <= 1 {
            work(0, &mut ids, &mut payloads);
        } else {
            let per = chunks.len().div_ceil(threads);
            std::thread::scope(|s| {
                for (t, (ic, pc)) in ids
                    .chunks_mut(per)
                    .zip(payloads.chunks_mut(per))
                    .enumerate()
                {
                    let work = &work;
                    s.spawn(move || work(t * per, ic, pc));
                }
            });
        }
        let recs: Vec<Record<'_>> = ids
            .iter()
            .zip(&payloads)
            .zip(chunks)
            .filter_map(|((id, p), data)| {
                p.as_ref().map(|(codec, payload)| Record {
                    id: *id,
                    kind: Kind::Chunk,
                    codec: *codec,
                    depth: 0,
                    raw_len: data.len() as u32,
                    base: ObjectId([0; 32]),
                    payload,
                })
            })
            .collect();
        self.packs.append_batch(&recs)?;
        Ok(ids)
    }

    /// Store a tree object.
    pub fn put_tree(&self, tree: &Tree) -> Result<ObjectId, StoreError> {
        self.put_tree_based(tree, None)
    }

    /// Store a tree object (deduplicated). With `base` (the same directory in an earlier
    /// manifest), store it as a zstd delta against that tree when that is clearly smaller: a
    /// directory holding a big file's chunk list (a CRIU page image: 36 bytes per page) changes
    /// little between two snapshots, but its plain encoding is incompressible hashes.
    pub fn put_tree_based(
        &self,
        tree: &Tree,
        base: Option<&ObjectId>,
    ) -> Result<ObjectId, StoreError> {
        let data = tree.encode();
        let id = ObjectId::hash(&data);
        if self.packs.contains(&id) {
            return Ok(id);
        }
        // Big trees are mostly chunk ids (incompressible hashes): the fast level does as well.
        let level = if data.len() > 64 << 10 {
            CHUNK_ZSTD_LEVEL
        } else {
            ZSTD_LEVEL
        };
        let mut payload = zstd::bulk::compress(&data, level).map_err(store_io(&self.dir))?;
        let (mut codec, mut base_id, mut depth) = (Codec::Zstd, ObjectId([0; 32]), 0);
        if let Some((b, bdepth)) = base.and_then(|b| self.tree_delta_base(b, &id)) {
            if let Ok(bdata) = self.get_object(&b) {
                if let Ok(d) = delta_compress(&data, &bdata) {
                    if d.len() + 64 < payload.len() / 2 {
                        (codec, base_id, depth) = (Codec::Delta, b, bdepth + 1);
                        payload = d;
                    }
                }
            }
        }
        self.packs.append(&Record {
            id,
            kind: Kind::Tree,
            codec,
            depth,
            raw_len: data.len() as u32,
            base: base_id,
            payload: &payload,
        })?;
        Ok(id)
    }

    /// The tree a new tree `id` may be a delta of, given the caller's `base`: `base` itself, or
    /// when its chain is at the depth bound, the nearest link above it (older, but still the
    /// same directory), with that link's depth.
    fn tree_delta_base(&self, base: &ObjectId, id: &ObjectId) -> Option<(ObjectId, u8)> {
        let mut b = *base;
        loop {
            let loc = self.packs.get(&b)?;
            if b == *id || loc.kind != Kind::Tree {
                return None;
            }
            if loc.depth < MAX_DELTA_DEPTH {
                return Some((b, loc.depth));
            }
            b = loc.base;
        }
    }

    /// Raw bytes of an object, verified against its id.
    pub fn get_object(&self, id: &ObjectId) -> Result<Arc<Vec<u8>>, StoreError> {
        if let Some(d) = self.cache.lock().get(id) {
            return Ok(d);
        }
        let mut loc = self.packs.get(id).ok_or(StoreError::Missing { id: *id })?;
        let payload = match self.packs.read_payload(id, &loc) {
            Ok(p) => p,
            Err(e) => {
                // gc may have moved the object to a new pack since we looked it up.
                match self.packs.get(id) {
                    Some(l) if (l.pack, l.offset) != (loc.pack, loc.offset) => {
                        loc = l;
                        self.packs.read_payload(id, &loc)?
                    }
                    _ => return Err(e),
                }
            }
        };
        let corrupt = |why: String| StoreError::Corrupt { id: *id, why };
        let raw = match loc.codec {
            Codec::Raw => payload,
            Codec::Zstd => zstd::bulk::decompress(&payload, loc.raw_len as usize)
                .map_err(|e| corrupt(format!("zstd: {e}")))?,
            Codec::Delta => {
                let base = self.get_object(&loc.base)?;
                delta_decompress(&payload, &base, loc.raw_len as usize)
                    .map_err(|e| corrupt(format!("zstd delta: {e}")))?
            }
        };
        if raw.len() != loc.raw_len as usize || ObjectId::hash(&raw) != *id {
            return Err(corrupt("content does not match its hash".into()));
        }
        let raw = Arc::new(raw);
        let len = raw.len();
        self.cache.lock().put(*id, raw.clone(), len);
        Ok(raw)
    }

    /// A chunk's bytes.
    pub fn get_chunk(&self, id: &ObjectId) -> Result<Arc<Vec<u8>>, StoreError> {
        self.get_object(id)
    }

    /// A tree, decoded once and shared: what mounts load directories from.
    pub fn get_tree_shared(&self, id: &ObjectId) -> Result<Arc<Tree>, StoreError> {
        if let Some(t) = self.trees.lock().get(id) {
            return Ok(t);
        }
        let t = Arc::new(self.get_tree(id)?);
        let weight = t.entries.len() + 1;
        self.trees.lock().put(*id, t.clone(), weight);
        Ok(t)
    }

    /// A decoded tree object.
    pub fn get_tree(&self, id: &ObjectId) -> Result<Tree, StoreError> {
        let raw = self.get_object(id)?;
        Tree::decode(&raw).map_err(|e| StoreError::Corrupt {
            id: *id,
            why: e.to_string(),
        })
    }

    /// Make appended objects durable and record `id` as a manifest.
    pub(crate) fn seal_manifest(&self, id: &ManifestId) -> Result<(), StoreError> {
        self.packs.sync()?;
        let p = self.dir.join("manifests").join(id.to_hex());
        if !p.exists() {
            write_durable(&p, format!("{id}\n").as_bytes())?;
        }
        Ok(())
    }

    /// [`Store::seal_manifest`] for a manifest an import made: gc keeps it until a ref names
    /// it or the grace runs out. Called with the write guard still held, so no gc comes
    /// between.
    pub(crate) fn seal_import(&self, id: &ManifestId) -> Result<(), StoreError> {
        self.seal_manifest(id)?;
        let now = std::time::Instant::now();
        let grace = *self.fresh_grace.lock();
        let mut fresh = self.fresh.lock();
        fresh.retain(|_, t| now.duration_since(*t) < grace);
        fresh.insert(*id, now);
        Ok(())
    }

    /// How long gc keeps a manifest that an import returned and no ref names yet (default 10
    /// minutes). Naming it (`set_ref`) ends the grace; so does its running out, after which
    /// gc collects it like anything else that nothing holds. A test knob (feature
    /// `test-knobs`): shipped builds keep the default.
    #[cfg(any(test, feature = "test-knobs"))]
    pub fn set_fresh_grace(&self, grace: std::time::Duration) {
        *self.fresh_grace.lock() = grace;
    }

    /// Whether `id` is a manifest (root tree) held by this store.
    pub fn contains(&self, id: &ManifestId) -> bool {
        matches!(self.packs.get(id), Some(l) if l.kind == Kind::Tree)
    }

    /// How many deltas deep chunk `id` is stored (0: whole), if it is stored.
    pub(crate) fn delta_depth(&self, id: &ObjectId) -> Option<u8> {
        self.packs.get(id).map(|l| l.depth)
    }

    /// Whether any object (chunk or tree) `id` is stored.
    pub fn has_object(&self, id: &ObjectId) -> bool {
        self.packs.contains(id)
    }

    fn ref_path(&self, name: &str) -> PathBuf {
        self.dir.join("refs").join(name.replace('/', "%"))
    }

    /// Point `name` at `id`, durably.
    pub fn set_ref(&self, name: &str, id: &ManifestId) -> Result<(), Error> {
        if !valid_ref(name) {
            return Err(Error::BadRefName(name.to_string()));
        }
        if !self.contains(id) {
            return Err(Error::UnknownManifest(*id));
        }
        let _g = self.refs_lock.lock();
        let hex = id.to_hex();
        let body = format!("{hex} {}\n", check8(&hex));
        write_durable(&self.ref_path(name), body.as_bytes())?;
        // The ref holds it now.
        self.fresh.lock().remove(id);
        Ok(())
    }

    /// The manifest `name` points at, if any.
    pub fn get_ref(&self, name: &str) -> Result<Option<ManifestId>, Error> {
        if !valid_ref(name) {
            return Err(Error::BadRefName(name.to_string()));
        }
        let p = self.ref_path(name);
        match fs::read_to_string(&p) {
            Ok(s) => parse_ref(&s).map(Some).ok_or_else(|| {
                Error::Store(StoreError::CorruptPack {
                    path: p,
                    offset: 0,
                    why: "ref file damaged".into(),
                })
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(p)(e)),
        }
    }

    /// All refs, sorted by name.
    pub fn refs(&self) -> Result<Vec<(String, ManifestId)>, Error> {
        let d = self.dir.join("refs");
        let mut out = Vec::new();
        for e in fs::read_dir(&d).map_err(io_err(&d))? {
            let e = e.map_err(io_err(&d))?;
            let name = e.file_name().to_string_lossy().replace('%', "/");
            if name.contains(".tmp") {
                continue;
            }
            if let Some(id) = fs::read_to_string(e.path())
                .ok()
                .and_then(|s| parse_ref(&s))
            {
                out.push((name, id));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Remove a ref (no error if absent).
    pub fn delete_ref(&self, name: &str) -> Result<(), Error> {
        if !valid_ref(name) {
            return Err(Error::BadRefName(name.to_string()));
        }
        let _g = self.refs_lock.lock();
        let p = self.ref_path(name);
        match fs::remove_file(&p) {
            Ok(()) => {
                sync_dir(&self.dir.join("refs"))?;
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(p)(e)),
        }
    }

    /// A ref name, or the hex id of a stored manifest.
    pub fn resolve(&self, name_or_hex: &str) -> Result<ManifestId, Error> {
        if let Ok(id) = name_or_hex.parse::<ObjectId>() {
            if self.contains(&id) {
                return Ok(id);
            }
        }
        if valid_ref(name_or_hex) {
            if let Some(id) = self.get_ref(name_or_hex)? {
                return Ok(id);
            }
        }
        Err(Error::UnknownRef(name_or_hex.to_string()))
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

    /// Logical size (sum of regular file sizes, hard links once) of a tree.
    pub fn manifest_bytes(&self, id: &ManifestId) -> Result<u64, Error> {
        let mut total = 0u64;
        let mut links = HashSet::new();
        self.walk(id, &mut |_, t| {
            for e in &t.entries {
                if let Node::File { size, .. } = e.node {
                    if e.link == 0 || links.insert(e.link) {
                        total += size;
                    }
                }
            }
            Ok(())
        })?;
        Ok(total)
    }

    /// Visit every tree object reachable from `root` (each distinct tree once).
    pub fn walk(
        &self,
        root: &ObjectId,
        f: &mut dyn FnMut(&ObjectId, &Tree) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let mut seen = HashSet::new();
        let mut stack = vec![*root];
        while let Some(id) = stack.pop() {
            if !seen.insert(id) {
                continue;
            }
            let t = self.get_tree(&id)?;
            for e in &t.entries {
                if let Node::Dir(c) = e.node {
                    stack.push(c);
                }
            }
            f(&id, &t)?;
        }
        Ok(())
    }

    /// Every object id (trees and chunks, plus delta bases) a manifest reaches.
    pub fn reachable(&self, root: &ManifestId) -> Result<HashSet<ObjectId>, Error> {
        let mut out = HashSet::new();
        self.reach(root, &mut out, &mut |_| {})?;
        self.add_delta_bases(&mut out);
        Ok(out)
    }

    /// Adds the trees and chunks `root` reaches to `out` (not their delta bases), calling
    /// `on_file` with each file's chunk list.
    fn reach(
        &self,
        root: &ManifestId,
        out: &mut HashSet<ObjectId>,
        on_file: &mut dyn FnMut(&[crate::ChunkRef]),
    ) -> Result<(), Error> {
        self.walk(root, &mut |id, t| {
            out.insert(*id);
            for e in &t.entries {
                if let Node::File { chunks, .. } = &e.node {
                    out.extend(chunks.iter().map(|c| c.id));
                    on_file(chunks);
                }
            }
            Ok(())
        })
    }

    fn add_delta_bases(&self, set: &mut HashSet<ObjectId>) {
        let mut todo: Vec<ObjectId> = set.iter().copied().collect();
        while let Some(id) = todo.pop() {
            if let Some(l) = self.packs.get(&id) {
                if l.codec == Codec::Delta && set.insert(l.base) {
                    todo.push(l.base);
                }
            }
        }
    }

    /// Keep `id` (and what it reaches) alive through gc while pinned.
    pub fn pin(&self, id: &ObjectId) {
        *self.pins.lock().entry(*id).or_default() += 1;
    }

    /// Undo one [`Store::pin`].
    pub fn unpin(&self, id: &ObjectId) {
        let mut p = self.pins.lock();
        if let Some(n) = p.get_mut(id) {
            *n -= 1;
            if *n == 0 {
                p.remove(id);
            }
        }
    }

    /// Drop every object not reachable from a ref, a pinned manifest, `live`, or a manifest
    /// an import made less than the fresh grace ago that no ref names yet.
    pub fn gc(&self, live: &[ManifestId]) -> Result<GcReport, Error> {
        let _g = self.gc_lock.write();
        // Fresh manifests before refs: `set_ref` writes the ref before it ends the grace, so
        // one that is named meanwhile is seen in one or the other.
        let mut roots: Vec<ObjectId> = {
            let grace = *self.fresh_grace.lock();
            let now = std::time::Instant::now();
            let mut fresh = self.fresh.lock();
            fresh.retain(|_, t| now.duration_since(*t) < grace);
            fresh.keys().copied().collect()
        };
        roots.extend(self.refs()?.into_iter().map(|(_, id)| id));
        roots.extend_from_slice(live);
        roots.extend(self.pins.lock().keys().copied());
        let mut keep = HashSet::new();
        // Names of the whole-file cache objects of every live file (see `fs::passthrough`).
        let mut cache_names = HashSet::new();
        for r in &roots {
            if self.contains(r) {
                self.reach(r, &mut keep, &mut |chunks| {
                    if !chunks.is_empty() {
                        cache_names.insert(crate::fs::object_name(chunks));
                    }
                })?;
            }
        }
        // A manifest marker stays only for a manifest still reached whole. A root tree kept only
        // as the delta base of a later version keeps its bytes, not its children: its marker
        // goes, or fsck (which walks every marker) would look for children gc dropped.
        let whole = keep.clone();
        self.add_delta_bases(&mut keep);
        let before = self.disk_usage();
        // Derived data first: it frees space and costs nothing to lose.
        self.clean_cache_dir(&cache_names);
        let c = self.packs.compact(&|id| keep.contains(id))?;
        self.cache.lock().retain(|k| keep.contains(k));
        self.trees.lock().retain(|k| keep.contains(k));
        let mdir = self.dir.join("manifests");
        for e in fs::read_dir(&mdir).map_err(io_err(&mdir))?.flatten() {
            let keep_it = e
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<ObjectId>().ok())
                .is_some_and(|id| whole.contains(&id));
            if !keep_it {
                let _ = fs::remove_file(e.path());
            }
        }
        Ok(GcReport {
            kept_objects: keep.len() as u64,
            removed_objects: c.removed,
            freed_bytes: before.saturating_sub(self.disk_usage()),
            packs_deleted: c.packs_deleted,
            packs_punched: c.packs_punched,
            packs_rewritten: c.packs_rewritten,
            packs_left: c.packs_left,
        })
    }

    /// Disk space (allocated blocks) of the files gc can free: packs and their idx files,
    /// whole-file cache objects, manifest markers.
    fn disk_usage(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        ["packs", "cache", "manifests"]
            .iter()
            .filter_map(|d| fs::read_dir(self.dir.join(d)).ok())
            .flat_map(|rd| rd.flatten())
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.blocks() * 512)
            .sum()
    }

    /// Remove the whole-file cache objects no live file uses (`keep`: the names of those
    /// that one does). Objects being written (temp names) are left to their writer.
    fn clean_cache_dir(&self, keep: &HashSet<String>) {
        let d = self.dir.join("cache");
        if let Ok(rd) = fs::read_dir(&d) {
            for e in rd.flatten() {
                let name = e.file_name();
                let name = name.to_string_lossy();
                if name.contains(".tmp") || keep.contains(name.as_ref()) {
                    continue;
                }
                let _ = fs::remove_file(e.path());
            }
        }
    }

    /// Verify every object reachable from every ref and stored manifest.
    pub fn fsck(&self) -> Result<FsckReport, Error> {
        // No gc meanwhile: one that drops a manifest fsck has listed but not yet walked would
        // read as damage. Imports may go on (they only add).
        let _g = self.gc_lock.read();
        let mut rep = FsckReport::default();
        let mut roots: HashSet<ObjectId> = self.refs()?.into_iter().map(|(_, id)| id).collect();
        let mdir = self.dir.join("manifests");
        for e in fs::read_dir(&mdir).map_err(io_err(&mdir))?.flatten() {
            if let Some(id) = e.file_name().to_str().and_then(|s| s.parse().ok()) {
                roots.insert(id);
            }
        }
        let mut checked = HashSet::new();
        for root in roots {
            rep.manifests += 1;
            let mut stack = vec![root];
            while let Some(id) = stack.pop() {
                if !checked.insert(id) {
                    continue;
                }
                rep.objects_checked += 1;
                self.cache.lock().remove(&id);
                self.trees.lock().remove(&id);
                match self.get_tree(&id) {
                    Ok(t) => {
                        for e in &t.entries {
                            match &e.node {
                                Node::Dir(c) => stack.push(*c),
                                Node::File { chunks, .. } => {
                                    for c in chunks {
                                        if !checked.insert(c.id) {
                                            continue;
                                        }
                                        rep.objects_checked += 1;
                                        self.cache.lock().remove(&c.id);
                                        match self.get_chunk(&c.id) {
                                            Ok(d) if d.len() == c.len as usize => {}
                                            Ok(_) => rep.bad.push((c.id, "length mismatch".into())),
                                            Err(e) => rep.bad.push((c.id, e.to_string())),
                                        }
                                    }
                                }
                                _ => {}
                            }
                        }
                    }
                    Err(e) => rep.bad.push((id, e.to_string())),
                }
            }
        }
        rep.cache_removed = self.check_cache_dir();
        Ok(rep)
    }

    /// Re-hash whole-file cache entries; delete those that do not match their xattr.
    fn check_cache_dir(&self) -> Vec<PathBuf> {
        let mut removed = Vec::new();
        let d = self.dir.join("cache");
        let Ok(rd) = fs::read_dir(&d) else {
            return removed;
        };
        for e in rd.flatten() {
            let p = e.path();
            let want = crate::sys::lxattrs(&p).ok().and_then(|x| {
                x.into_iter()
                    .find(|(k, _)| k == crate::fs::CONTENT_XATTR)
                    .map(|(_, v)| v)
            });
            let ok = match (want, fs::File::open(&p)) {
                (Some(want), Ok(mut f)) => {
                    let mut h = blake3::Hasher::new();
                    std::io::copy(&mut f, &mut h).is_ok()
                        && h.finalize().to_hex().as_bytes() == want.as_slice()
                }
                _ => false,
            };
            if !ok {
                let _ = fs::remove_file(&p);
                removed.push(p);
            }
        }
        removed
    }

    pub(crate) fn packs(&self) -> &PackSet {
        &self.packs
    }
}

fn parse_ref(s: &str) -> Option<ManifestId> {
    let mut it = s.split_whitespace();
    let hex = it.next()?;
    let sum = it.next()?;
    if check8(hex) != sum {
        return None;
    }
    hex.parse().ok()
}

fn delta_compress(data: &[u8], base: &[u8]) -> Result<Vec<u8>, std::io::Error> {
    use zstd::zstd_safe::{CCtx, CParameter};
    let mut cctx = CCtx::create();
    let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(data.len()));
    let e = |c: usize| std::io::Error::other(zstd::zstd_safe::get_error_name(c));
    cctx.set_parameter(CParameter::CompressionLevel(ZSTD_LEVEL))
        .map_err(e)?;
    // The window must reach back over the whole base, or a match further back than the level's
    // default window is lost: the page list of a 256 MiB heap alone is 2.3 MiB.
    // Readers accept windows up to 2^27 by default.
    let span = (base.len() + data.len()).max(1 << 10);
    let window_log = (usize::BITS - (span - 1).leading_zeros()).clamp(10, 27);
    cctx.set_parameter(CParameter::WindowLog(window_log))
        .map_err(e)?;
    // The level's hash tables are too small to remember megabytes of prefix: long-distance
    // matching finds the (long) unchanged runs wherever they are.
    cctx.set_parameter(CParameter::EnableLongDistanceMatching(true))
        .map_err(e)?;
    cctx.ref_prefix(base).map_err(e)?;
    cctx.compress2(&mut out, data).map_err(e)?;
    Ok(out)
}

fn delta_decompress(
    payload: &[u8],
    base: &[u8],
    raw_len: usize,
) -> Result<Vec<u8>, std::io::Error> {
    use zstd::zstd_safe::DCtx;
    let mut dctx = DCtx::create();
    let e = |c: usize| std::io::Error::other(zstd::zstd_safe::get_error_name(c));
    dctx.ref_prefix(base).map_err(e)?;
    let mut out = Vec::with_capacity(raw_len);
    dctx.decompress(&mut out, payload).map_err(e)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_reaches_back_over_a_base_larger_than_the_default_window() {
        // 4 MiB of incompressible bytes (like a page list of hashes), 1 % changed.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let base: Vec<u8> = (0..4 << 20)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let mut new = base.clone();
        for i in (0..new.len()).step_by(100) {
            new[i] ^= 0x5a;
        }
        let d = delta_compress(&new, &base).unwrap();
        assert!(
            d.len() < new.len() / 5,
            "delta {} of {}",
            d.len(),
            new.len()
        );
        assert_eq!(delta_decompress(&d, &base, new.len()).unwrap(), new);
    }

    #[test]
    fn delta_roundtrip() {
        let base: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut new = base.clone();
        new[5000] ^= 1;
        let d = delta_compress(&new, &base).unwrap();
        assert!(d.len() < 200, "delta {}", d.len());
        assert_eq!(delta_decompress(&d, &base, new.len()).unwrap(), new);
    }

    #[test]
    fn refs_validate() {
        assert!(valid_ref("images/debian12"));
        assert!(!valid_ref("../x"));
        assert!(!valid_ref(""));
        assert!(!valid_ref("a b"));
    }
}
