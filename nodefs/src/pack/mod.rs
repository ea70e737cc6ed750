//! Append-only pack files holding checksummed object records, and the in-memory index
//! built from them at open (a torn tail from a crash is cut off).
//!
//! A sealed pack (and a pack written by `compact`) gets a `pack-NNNNNNNN.idx` next to it:
//! its records sorted by id, checksummed, covering the pack's exact length. At open a valid
//! idx is loaded (through a memory map) instead of walking the pack; anything else — missing,
//! truncated, damaged, stale — falls back to the walk. The idx is only an acceleration: reads
//! still check every record header and content hash, so a bad one can never yield wrong bytes.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::error::{store_io, StoreError};
use crate::id::ObjectId;

mod idx;
use idx::{idx_path, load_idx, write_idx, IdxProblem};
#[cfg(test)]
use idx::{IDX_ENTRY, IDX_HDR, IDX_SUM};

const PACK_MAGIC: &[u8; 8] = b"GRVPACK1";
const REC_MAGIC: &[u8; 4] = b"GRVR";
/// Size of a record header in bytes.
pub const HDR: usize = 84;
/// Start a new pack file once the active one reaches this size.
const ROTATE_AT: u64 = 1 << 30;

/// What an object is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chunk = 1,
    Tree = 2,
}

/// How a record's payload is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    Raw = 0,
    Zstd = 1,
    /// zstd with the raw bytes of `base` as reference prefix.
    Delta = 2,
}

/// Where an object lives.
#[derive(Clone, Copy, Debug)]
pub struct Loc {
    pub pack: u32,
    /// Offset of the record header.
    pub offset: u64,
    pub stored_len: u32,
    pub raw_len: u32,
    pub kind: Kind,
    pub codec: Codec,
    pub depth: u8,
    pub base: ObjectId,
}

/// An index entry.
type Entry = (ObjectId, Loc);

/// A record ready to append.
pub struct Record<'a> {
    pub id: ObjectId,
    pub kind: Kind,
    pub codec: Codec,
    pub depth: u8,
    pub raw_len: u32,
    pub base: ObjectId,
    pub payload: &'a [u8],
}

fn header(r: &Record<'_>) -> [u8; HDR] {
    let mut h = [0u8; HDR];
    h[0..4].copy_from_slice(REC_MAGIC);
    h[4] = r.kind as u8;
    h[5] = r.codec as u8;
    h[6] = r.depth;
    h[8..12].copy_from_slice(&r.raw_len.to_le_bytes());
    h[12..16].copy_from_slice(&(r.payload.len() as u32).to_le_bytes());
    h[16..48].copy_from_slice(&r.id.0);
    h[48..80].copy_from_slice(&r.base.0);
    let check = blake3::hash(&h[..80]);
    h[80..84].copy_from_slice(&check.as_bytes()[..4]);
    h
}

fn kind_from(b: u8) -> Option<Kind> {
    match b {
        1 => Some(Kind::Chunk),
        2 => Some(Kind::Tree),
        _ => None,
    }
}

fn codec_from(b: u8) -> Option<Codec> {
    match b {
        0 => Some(Codec::Raw),
        1 => Some(Codec::Zstd),
        2 => Some(Codec::Delta),
        _ => None,
    }
}

fn parse_header(pack: u32, offset: u64, h: &[u8]) -> Option<(ObjectId, Loc)> {
    if h.len() < HDR || &h[0..4] != REC_MAGIC {
        return None;
    }
    if blake3::hash(&h[..80]).as_bytes()[..4] != h[80..84] {
        return None;
    }
    let kind = kind_from(h[4])?;
    let codec = codec_from(h[5])?;
    let raw_len = u32::from_le_bytes(h[8..12].try_into().ok()?);
    let stored_len = u32::from_le_bytes(h[12..16].try_into().ok()?);
    let id = ObjectId(h[16..48].try_into().ok()?);
    let base = ObjectId(h[48..80].try_into().ok()?);
    Some((
        id,
        Loc {
            pack,
            offset,
            stored_len,
            raw_len,
            kind,
            codec,
            depth: h[6],
            base,
        },
    ))
}

/// Whether two locations describe the same record (everything but the `pack` number, which
/// a header does not carry).
fn same_record(a: &Loc, b: &Loc) -> bool {
    a.offset == b.offset
        && a.stored_len == b.stored_len
        && a.raw_len == b.raw_len
        && a.kind == b.kind
        && a.codec == b.codec
        && a.depth == b.depth
        && a.base == b.base
}

struct Writer {
    pack: u32,
    file: Arc<File>,
    len: u64,
}

/// How [`PackSet::open`] indexed the packs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// Packs whose `.idx` was loaded instead of walking the pack.
    pub from_idx: usize,
    /// Packs walked record by record.
    pub scanned: usize,
    /// `.idx` files found but not trusted (damaged, truncated, stale, unreadable).
    pub idx_rejected: usize,
    /// `.idx` files written at open for sealed packs that had no valid one.
    pub idx_written: usize,
    /// `.idx` files removed because their pack is gone.
    pub idx_orphans_removed: usize,
    /// Packs removed because they hold no object no earlier pack has (or none at all).
    pub empty_removed: usize,
}

/// The set of pack files in `<store>/packs`.
pub struct PackSet {
    dir: PathBuf,
    index: RwLock<HashMap<ObjectId, Loc>>,
    files: RwLock<HashMap<u32, Arc<File>>>,
    writer: Mutex<Option<Writer>>,
    /// Size at which the active pack is sealed and a new one started.
    rotate_at: u64,
    #[cfg_attr(not(test), allow(dead_code))]
    opened: OpenReport,
    /// Makes hole punching fail as on a filesystem without it.
    #[cfg(test)]
    no_punch: std::sync::atomic::AtomicBool,
}

fn pack_path(dir: &Path, n: u32) -> PathBuf {
    dir.join(format!("pack-{n:08}.pack"))
}

/// The number in `pack-NNNNNNNN<suffix>`.
fn numbered(name: &str, suffix: &str) -> Option<u32> {
    name.strip_prefix("pack-")
        .and_then(|s| s.strip_suffix(suffix))
        .and_then(|s| s.parse::<u32>().ok())
}

/// Remove a file that may already be gone.
fn remove_if_present(path: &Path) -> std::io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

impl PackSet {
    /// Open every pack and index its records, from its `.idx` where that is valid.
    pub fn open(dir: &Path) -> Result<PackSet, StoreError> {
        PackSet::open_with(dir, ROTATE_AT)
    }

    fn open_with(dir: &Path, rotate_at: u64) -> Result<PackSet, StoreError> {
        fs::create_dir_all(dir).map_err(store_io(dir))?;
        let mut numbers = Vec::new();
        let mut idx_numbers = Vec::new();
        for e in fs::read_dir(dir).map_err(store_io(dir))? {
            let e = e.map_err(store_io(dir))?;
            let name = e.file_name();
            let name = name.to_string_lossy();
            if let Some(n) = numbered(&name, ".pack") {
                numbers.push(n);
            } else if let Some(n) = numbered(&name, ".idx") {
                idx_numbers.push(n);
            } else if name.ends_with(".tmp") {
                let _ = fs::remove_file(e.path());
            }
        }
        numbers.sort_unstable();
        let mut report = OpenReport::default();
        // An idx whose pack is gone (a crash between deleting the two in compaction) would
        // otherwise linger, and could be mistaken for a later pack of the same number.
        for n in idx_numbers {
            if numbers.binary_search(&n).is_err() {
                let p = idx_path(dir, n);
                match remove_if_present(&p) {
                    Ok(_) => report.idx_orphans_removed += 1,
                    Err(e) => {
                        tracing::warn!(idx = %p.display(), error = %e, "cannot remove orphan pack idx")
                    }
                }
            }
        }
        if report.idx_orphans_removed > 0 {
            sync_dir(dir)?;
        }
        let mut index = HashMap::new();
        let mut files = HashMap::new();
        let last = numbers.last().copied();
        let mut writer = None;
        for n in numbers {
            let path = pack_path(dir, n);
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(store_io(&path))?;
            let len = file.metadata().map_err(store_io(&path))?.len();
            let active = Some(n) == last;
            // Packs are indexed in order and the first record of an id wins, from an idx or
            // from a walk alike, so both give the same index.
            // Whether the pack adds an object to the index, or may hold one (damage).
            let mut holds = false;
            let end = match load_idx(dir, n, len) {
                Ok(entries) => {
                    report.from_idx += 1;
                    for (id, loc) in entries {
                        if let std::collections::hash_map::Entry::Vacant(v) = index.entry(id) {
                            v.insert(loc);
                            holds = true;
                        }
                    }
                    len
                }
                Err(problem) => {
                    let ip = idx_path(dir, n);
                    match &problem {
                        IdxProblem::Missing if active => {}
                        // The active pack's idx (written by compaction) goes stale with the
                        // first append after it; that is expected.
                        IdxProblem::Stale { .. } if active => {
                            report.idx_rejected += 1;
                            tracing::debug!(idx = %ip.display(), %problem, "active pack grew past its idx");
                        }
                        IdxProblem::Missing => {
                            tracing::warn!(pack = %path.display(), "sealed pack has no idx; walking it");
                        }
                        _ => {
                            report.idx_rejected += 1;
                            tracing::warn!(idx = %ip.display(), %problem, "ignoring pack idx; walking the pack");
                        }
                    }
                    let (mut entries, end, damaged) = scan_checked(&file, n, &path)?;
                    report.scanned += 1;
                    holds |= damaged || end < len;
                    // A sealed pack that walks cleanly to its end gets its idx back, so the
                    // next open is fast again. The active one is indexed when it is sealed.
                    if !active && end == len {
                        match write_idx(dir, n, len, &mut entries) {
                            Ok(()) => report.idx_written += 1,
                            Err(e) => tracing::warn!(
                                idx = %ip.display(),
                                error = %crate::error::chain(&e),
                                "cannot write pack idx"
                            ),
                        }
                    }
                    for (id, loc) in entries {
                        if let std::collections::hash_map::Entry::Vacant(v) = index.entry(id) {
                            v.insert(loc);
                            holds = true;
                        }
                    }
                    end
                }
            };
            if !holds {
                // Every record in it is an earlier pack's too, or it has none: what an
                // interrupted compaction of an older version left (a partial copy). It holds
                // nothing, so it goes rather than taking the disk.
                drop(file);
                let ip = idx_path(dir, n);
                remove_if_present(&ip).map_err(store_io(&ip))?;
                remove_if_present(&path).map_err(store_io(&path))?;
                report.empty_removed += 1;
                if len > PACK_MAGIC.len() as u64 {
                    tracing::warn!(pack = %path.display(), "removing a pack that holds no object of its own");
                }
                continue;
            }
            let file = Arc::new(file);
            if active {
                if end < len {
                    tracing::warn!(pack = %path.display(), end, len, "cutting torn pack tail");
                    file.set_len(end).map_err(store_io(&path))?;
                    file.sync_all().map_err(store_io(&path))?;
                }
                writer = Some(Writer {
                    pack: n,
                    file: file.clone(),
                    len: end,
                });
            }
            files.insert(n, file);
        }
        tracing::debug!(dir = %dir.display(), ?report, objects = index.len(), "packs opened");
        Ok(PackSet {
            dir: dir.to_path_buf(),
            index: RwLock::new(index),
            files: RwLock::new(files),
            writer: Mutex::new(writer),
            rotate_at,
            opened: report,
            #[cfg(test)]
            no_punch: Default::default(),
        })
    }

    /// How `open` indexed the packs.
    #[cfg(test)]
    pub fn open_report(&self) -> OpenReport {
        self.opened
    }

    pub fn get(&self, id: &ObjectId) -> Option<Loc> {
        self.index.read().get(id).copied()
    }

    pub fn contains(&self, id: &ObjectId) -> bool {
        self.index.read().contains_key(id)
    }

    /// Snapshot of the whole index.
    pub fn all(&self) -> Vec<(ObjectId, Loc)> {
        self.index.read().iter().map(|(k, v)| (*k, *v)).collect()
    }

    /// Read a record's payload and check its header against the index.
    pub fn read_payload(&self, id: &ObjectId, loc: &Loc) -> Result<Vec<u8>, StoreError> {
        let file = self
            .files
            .read()
            .get(&loc.pack)
            .cloned()
            .ok_or(StoreError::Missing { id: *id })?;
        let mut buf = vec![0u8; HDR + loc.stored_len as usize];
        file.read_exact_at(&mut buf, loc.offset)
            .map_err(|e| StoreError::Corrupt {
                id: *id,
                why: format!(
                    "cannot read {} bytes at {} of {}: {e}",
                    buf.len(),
                    loc.offset,
                    pack_path(&self.dir, loc.pack).display()
                ),
            })?;
        // The header must name this id and agree with the index entry in full: an entry
        // loaded from a (checksummed, but possibly wrong) idx is never taken on trust.
        let wrong = match parse_header(loc.pack, loc.offset, &buf[..HDR]) {
            Some((hid, hloc)) if hid == *id && same_record(&hloc, loc) => None,
            Some((hid, _)) if hid == *id => Some("does not match the index"),
            _ => Some("is damaged"),
        };
        if let Some(wrong) = wrong {
            return Err(StoreError::Corrupt {
                id: *id,
                why: format!(
                    "record header at {} of {} {wrong}",
                    loc.offset,
                    pack_path(&self.dir, loc.pack).display()
                ),
            });
        }
        buf.drain(..HDR);
        Ok(buf)
    }

    /// Append a record unless the id is already present. Returns true if written.
    pub fn append(&self, rec: &Record<'_>) -> Result<bool, StoreError> {
        if self.contains(&rec.id) {
            return Ok(false);
        }
        Ok(self.append_batch(std::slice::from_ref(rec))? > 0)
    }

    /// Append records (skipping ids already present) with one write. Returns how many
    /// were written.
    pub fn append_batch(&self, recs: &[Record<'_>]) -> Result<usize, StoreError> {
        let mut w = self.writer.lock();
        let needs_new = match &*w {
            None => true,
            Some(w) => w.len >= self.rotate_at,
        };
        if needs_new {
            if let Some(old) = w.as_ref() {
                old.file
                    .sync_all()
                    .map_err(store_io(pack_path(&self.dir, old.pack)))?;
                self.seal(old);
            }
            let n = w.as_ref().map(|w| w.pack + 1).unwrap_or(1);
            let n = n.max(self.files.read().keys().max().map(|m| m + 1).unwrap_or(1));
            *w = Some(self.create_pack(n)?);
        }
        let wr = w.as_mut().expect("writer present");
        let mut buf = Vec::with_capacity(recs.iter().map(|r| HDR + r.payload.len()).sum());
        let mut locs = Vec::with_capacity(recs.len());
        {
            let index = self.index.read();
            let mut seen = std::collections::HashSet::new();
            for rec in recs {
                if index.contains_key(&rec.id) || !seen.insert(rec.id) {
                    continue;
                }
                locs.push((
                    rec.id,
                    Loc {
                        pack: wr.pack,
                        offset: wr.len + buf.len() as u64,
                        stored_len: rec.payload.len() as u32,
                        raw_len: rec.raw_len,
                        kind: rec.kind,
                        codec: rec.codec,
                        depth: rec.depth,
                        base: rec.base,
                    },
                ));
                buf.extend_from_slice(&header(rec));
                buf.extend_from_slice(rec.payload);
            }
        }
        if buf.is_empty() {
            return Ok(0);
        }
        let path = pack_path(&self.dir, wr.pack);
        wr.file
            .write_all_at(&buf, wr.len)
            .map_err(store_io(&path))?;
        wr.len += buf.len() as u64;
        let n = locs.len();
        self.index.write().extend(locs);
        Ok(n)
    }

    /// Write the idx of a pack that is full and synced and will not be appended to again.
    /// A failure only costs a walk of the pack at the next open, so it is logged, not
    /// returned.
    fn seal(&self, w: &Writer) {
        let path = pack_path(&self.dir, w.pack);
        // The idx holds exactly what a walk of the pack finds, taken from the pack itself
        // rather than from the index (which has no per-pack view and may hold a record of
        // the same id from an earlier pack).
        let res = scan(&w.file, w.pack, &path).and_then(|(mut entries, end)| {
            if end != w.len {
                return Err(StoreError::CorruptPack {
                    path: path.clone(),
                    offset: end,
                    why: format!("records end at {end}, not at {} as written", w.len),
                });
            }
            write_idx(&self.dir, w.pack, w.len, &mut entries)
        });
        if let Err(e) = res {
            tracing::warn!(
                pack = %path.display(),
                error = %crate::error::chain(&e),
                "cannot write the idx of a sealed pack; it will be walked at open"
            );
        }
    }

    fn create_pack(&self, n: u32) -> Result<Writer, StoreError> {
        let path = pack_path(&self.dir, n);
        // A leftover idx of an earlier pack with this number must not describe the new one.
        let ip = idx_path(&self.dir, n);
        remove_if_present(&ip).map_err(store_io(&ip))?;
        let tmp = path.with_extension("tmp");
        let mut f = File::create(&tmp).map_err(store_io(&tmp))?;
        f.write_all(PACK_MAGIC).map_err(store_io(&tmp))?;
        f.sync_all().map_err(store_io(&tmp))?;
        drop(f);
        fs::rename(&tmp, &path).map_err(store_io(&path))?;
        sync_dir(&self.dir)?;
        let file = Arc::new(
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(store_io(&path))?,
        );
        self.files.write().insert(n, file.clone());
        Ok(Writer {
            pack: n,
            file,
            len: PACK_MAGIC.len() as u64,
        })
    }

    /// Make everything appended so far durable. The writer lock is held only to find the pack
    /// being written: appends go on while it syncs (a sync behind a large import's backlog
    /// took 180-580 ms here, and a snapshot's commit waited for it to append its chunks).
    /// What was appended before this call is in that pack or in an earlier one, and a pack is
    /// synced before the writer moves on from it.
    pub fn sync(&self) -> Result<(), StoreError> {
        let current = self
            .writer
            .lock()
            .as_ref()
            .map(|w| (w.file.clone(), w.pack));
        if let Some((file, pack)) = current {
            file.sync_data()
                .map_err(store_io(pack_path(&self.dir, pack)))?;
        }
        Ok(())
    }

    /// Drop every object `keep` says no to and give their space back, never needing more
    /// space than it frees: packs with nothing live are deleted; in the others the dead
    /// records' bytes are punched out in place (a hole reads as zeros, which a walk skips
    /// like a damaged record, and a pack's dead tail is cut off). Where the filesystem cannot
    /// punch holes, a pack is rewritten instead, but only if its live records fit in the
    /// free space less a reserve. A failure leaves no partial output.
    pub fn compact(&self, keep: &dyn Fn(&ObjectId) -> bool) -> Result<Compacted, StoreError> {
        let mut w = self.writer.lock();
        let mut rep = Compacted::default();
        let mut live: HashMap<u32, Vec<(ObjectId, Loc)>> = HashMap::new();
        let mut dead = Vec::new();
        for (id, loc) in self.all() {
            if keep(&id) {
                live.entry(loc.pack).or_default().push((id, loc));
            } else {
                dead.push(id);
            }
        }
        rep.removed = dead.len() as u64;
        // Out of the index before their bytes go: from now on nothing finds them.
        {
            let mut index = self.index.write();
            for id in &dead {
                index.remove(id);
            }
        }
        let mut packs: Vec<u32> = self.files.read().keys().copied().collect();
        packs.sort_unstable();
        let mut deleted = false;
        for &n in packs.iter().filter(|n| !live.contains_key(n)) {
            self.delete_pack(n)?;
            if w.as_ref().is_some_and(|w| w.pack == n) {
                *w = None;
            }
            rep.packs_deleted += 1;
            deleted = true;
        }
        if deleted {
            sync_dir(&self.dir)?;
        }
        for n in packs {
            let Some(mut recs) = live.remove(&n) else {
                continue;
            };
            let Some(file) = self.files.read().get(&n).cloned() else {
                continue;
            };
            recs.sort_by_key(|(_, l)| l.offset);
            let path = pack_path(&self.dir, n);
            let len = match w.as_ref().filter(|w| w.pack == n) {
                Some(w) => w.len,
                None => file.metadata().map_err(store_io(&path))?.len(),
            };
            let holes = dead_ranges(&recs, len);
            let live_bytes: u64 = recs
                .iter()
                .map(|(_, l)| HDR as u64 + l.stored_len as u64)
                .sum();
            let allocated = allocated_bytes(&file).map_err(store_io(&path))?;
            let tail = holes.last().is_some_and(|h| h.1 == len);
            // Nothing but partial blocks to gain (or punched already).
            let slack = (holes.len() as u64 + 1) * 4096 + PACK_MAGIC.len() as u64;
            if holes.is_empty() || (!tail && allocated <= live_bytes + slack) {
                continue;
            }
            match self.punch(n, &file, &mut recs, &holes, len, &mut w) {
                Ok(()) => rep.packs_punched += 1,
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                    if self.rewrite(n, &recs, live_bytes, &mut w)? {
                        rep.packs_rewritten += 1;
                    } else {
                        rep.packs_left += 1;
                    }
                }
                Err(e) => return Err(store_io(&path)(e)),
            }
        }
        Ok(rep)
    }

    /// Remove pack `n` and its idx (the idx first: a crash in between leaves a pack without
    /// an idx, walked at open, rather than an idx without a pack).
    fn delete_pack(&self, n: u32) -> Result<(), StoreError> {
        self.files.write().remove(&n);
        let ip = idx_path(&self.dir, n);
        remove_if_present(&ip).map_err(store_io(&ip))?;
        let p = pack_path(&self.dir, n);
        remove_if_present(&p).map_err(store_io(&p))?;
        Ok(())
    }

    /// Punch `holes` (the dead byte ranges of pack `n`, which holds `recs` live) out of it.
    /// The pack's idx is replaced by one of the live records first, so no idx ever lists a
    /// record whose bytes are gone; a dead tail is cut off and the idx written again for the
    /// new length.
    fn punch(
        &self,
        n: u32,
        file: &File,
        recs: &mut [(ObjectId, Loc)],
        holes: &[(u64, u64)],
        len: u64,
        w: &mut Option<Writer>,
    ) -> std::io::Result<()> {
        use nix::fcntl::{fallocate, FallocateFlags};
        use std::os::fd::AsRawFd;
        let idx = |len: u64, recs: &mut [(ObjectId, Loc)]| {
            if let Err(e) = write_idx(&self.dir, n, len, recs) {
                // Without one the pack is walked at open, which sees exactly the live
                // records once the holes are punched; a stale one must not stay.
                tracing::warn!(error = %crate::error::chain(&e), "cannot write a pack idx after gc");
                remove_if_present(&idx_path(&self.dir, n))?;
            }
            Ok::<(), std::io::Error>(())
        };
        #[cfg(test)]
        if self.no_punch.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(std::io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        }
        idx(len, recs)?;
        let mut new_len = len;
        for &(a, b) in holes {
            if b == len {
                new_len = a;
                continue;
            }
            let flags = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
            fallocate(file.as_raw_fd(), flags, a as i64, (b - a) as i64)
                .map_err(std::io::Error::from)?;
        }
        if new_len < len {
            file.set_len(new_len)?;
            if let Some(w) = w.as_mut().filter(|w| w.pack == n) {
                w.len = new_len;
            }
            idx(new_len, recs)?;
        }
        file.sync_all()
    }

    /// Rewrite pack `n` holding only `recs` into a new pack, if `live_bytes` fit in the free
    /// space less a reserve (else leave it: returns false). Written under a temp name and
    /// renamed once complete and synced; on any error the temp file goes.
    fn rewrite(
        &self,
        n: u32,
        recs: &[(ObjectId, Loc)],
        live_bytes: u64,
        w: &mut Option<Writer>,
    ) -> Result<bool, StoreError> {
        let (avail, total) = free_space(&self.dir).map_err(store_io(&self.dir))?;
        let reserve = (total / 64).clamp(1 << 20, 256 << 20);
        if live_bytes + reserve > avail {
            tracing::warn!(
                pack = n,
                live_bytes,
                avail,
                "no room to rewrite a pack; its dead records stay"
            );
            return Ok(false);
        }
        let q = self.files.read().keys().max().map_or(1, |m| m + 1);
        let tmp = pack_path(&self.dir, q).with_extension("tmp");
        let r = self.write_rewritten(n, q, &tmp, recs);
        let (file, locs, qlen) = match r {
            Ok(v) => v,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                let _ = remove_if_present(&idx_path(&self.dir, q));
                return Err(e);
            }
        };
        let file = Arc::new(file);
        self.files.write().insert(q, file.clone());
        self.index.write().extend(locs);
        self.delete_pack(n)?;
        sync_dir(&self.dir)?;
        // The newest pack is the one appended to.
        if let Some(old) = w.as_ref().filter(|w| w.pack != n) {
            old.file
                .sync_all()
                .map_err(store_io(pack_path(&self.dir, old.pack)))?;
            self.seal(old);
        }
        *w = Some(Writer {
            pack: q,
            file,
            len: qlen,
        });
        Ok(true)
    }

    fn write_rewritten(
        &self,
        n: u32,
        q: u32,
        tmp: &Path,
        recs: &[(ObjectId, Loc)],
    ) -> Result<(File, Vec<Entry>, u64), StoreError> {
        let src = self.files.read().get(&n).cloned().ok_or_else(|| {
            store_io(pack_path(&self.dir, n))(std::io::ErrorKind::NotFound.into())
        })?;
        let out = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(tmp)
            .map_err(store_io(tmp))?;
        out.write_all_at(PACK_MAGIC, 0).map_err(store_io(tmp))?;
        let mut len = PACK_MAGIC.len() as u64;
        let mut locs = Vec::with_capacity(recs.len());
        for (id, loc) in recs {
            let mut buf = vec![0u8; HDR + loc.stored_len as usize];
            src.read_exact_at(&mut buf, loc.offset)
                .map_err(store_io(pack_path(&self.dir, n)))?;
            out.write_all_at(&buf, len).map_err(store_io(tmp))?;
            locs.push((
                *id,
                Loc {
                    pack: q,
                    offset: len,
                    ..*loc
                },
            ));
            len += buf.len() as u64;
        }
        out.sync_all().map_err(store_io(tmp))?;
        write_idx(&self.dir, q, len, &mut locs.clone())?;
        let path = pack_path(&self.dir, q);
        fs::rename(tmp, &path).map_err(store_io(&path))?;
        Ok((out, locs, len))
    }

    /// Total bytes of all pack files, less the holes gc punched in them.
    pub fn disk_bytes(&self) -> u64 {
        self.files
            .read()
            .values()
            .filter_map(|f| f.metadata().ok())
            .map(|m| {
                m.len()
                    .min(std::os::unix::fs::MetadataExt::blocks(&m) * 512)
            })
            .sum()
    }
}

/// What [`PackSet::compact`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Compacted {
    /// Objects dropped.
    pub removed: u64,
    /// Packs deleted whole (nothing in them was live).
    pub packs_deleted: u64,
    /// Packs whose dead records were punched out in place.
    pub packs_punched: u64,
    /// Packs rewritten (the filesystem cannot punch holes).
    pub packs_rewritten: u64,
    /// Packs with dead records left as they are: no holes and no room to rewrite them.
    pub packs_left: u64,
}

/// The byte ranges of a pack of length `len` that no record of `live` (sorted by offset)
/// covers, past the magic.
fn dead_ranges(live: &[(ObjectId, Loc)], len: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = PACK_MAGIC.len() as u64;
    for (_, l) in live {
        if l.offset > at {
            out.push((at, l.offset));
        }
        at = at.max(l.offset + HDR as u64 + l.stored_len as u64);
    }
    if len > at {
        out.push((at, len));
    }
    out
}

/// Bytes of disk a file takes.
fn allocated_bytes(f: &File) -> std::io::Result<u64> {
    Ok(std::os::unix::fs::MetadataExt::blocks(&f.metadata()?) * 512)
}

/// Bytes available to this process on the filesystem of `dir`, and its size.
fn free_space(dir: &Path) -> std::io::Result<(u64, u64)> {
    let s = nix::sys::statvfs::statvfs(dir).map_err(std::io::Error::from)?;
    let frag = s.fragment_size() as u64;
    Ok((s.blocks_available() as u64 * frag, s.blocks() as u64 * frag))
}

/// Walk one pack's records. Returns each id's first valid record in the pack and the offset
/// where valid records end.
fn scan(file: &File, n: u32, path: &Path) -> Result<(Vec<(ObjectId, Loc)>, u64), StoreError> {
    scan_checked(file, n, path).map(|(e, end, _)| (e, end))
}

/// [`scan`], also saying whether it skipped anything but zeros (a hole gc punched) between
/// records: a damaged record.
fn scan_checked(file: &File, n: u32, path: &Path) -> Result<(Vec<Entry>, u64, bool), StoreError> {
    let len = file.metadata().map_err(store_io(path))?.len();
    if len < PACK_MAGIC.len() as u64 {
        return Ok((Vec::new(), 0, false));
    }
    // SAFETY: the pack is only appended to by this process under the writer lock and is
    // not truncated while mapped; we only read the mapping within its length.
    let map = unsafe { memmap2::Mmap::map(file) }.map_err(store_io(path))?;
    if &map[..8] != PACK_MAGIC {
        return Err(StoreError::CorruptPack {
            path: path.to_path_buf(),
            offset: 0,
            why: "bad pack magic".into(),
        });
    }
    let mut entries = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut damaged = false;
    let mut off = PACK_MAGIC.len();
    while off + HDR <= map.len() {
        let rec = parse_header(n, off as u64, &map[off..off + HDR])
            .filter(|(_, l)| off + HDR + l.stored_len as usize <= map.len());
        let Some((id, loc)) = rec else {
            // A damaged record in the middle (valid records follow) is skipped, and its
            // objects read as missing; only a torn tail (nothing valid after) is cut.
            match next_record(n, &map, off + 1) {
                Some(next) if map[off..next].iter().all(|b| *b == 0) => {
                    tracing::debug!(pack = %path.display(), off, next, "skipping a hole gc punched");
                    off = next;
                    continue;
                }
                Some(next) => {
                    tracing::warn!(pack = %path.display(), off, next, "skipping a damaged record");
                    damaged = true;
                    off = next;
                    continue;
                }
                None => break,
            }
        };
        if seen.insert(id) {
            entries.push((id, loc));
        }
        off += HDR + loc.stored_len as usize;
    }
    Ok((entries, off as u64, damaged))
}

/// Offset of the next valid, complete record at or after `from`.
fn next_record(n: u32, map: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while i + HDR <= map.len() {
        let rel = map[i..].windows(4).position(|w| w == REC_MAGIC)?;
        i += rel;
        if i + HDR > map.len() {
            return None;
        }
        if let Some((_, l)) = parse_header(n, i as u64, &map[i..i + HDR]) {
            if i + HDR + l.stored_len as usize <= map.len() {
                return Some(i);
            }
        }
        i += 1;
    }
    None
}

/// fsync a directory so renames in it are durable.
pub fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(store_io(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic, incompressible-looking bytes.
    fn bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        blake3::Hasher::new()
            .update(&seed.to_le_bytes())
            .finalize_xof()
            .fill(&mut out);
        out
    }

    /// Append `count` raw chunks of `size` bytes one by one (so the pack rotates between
    /// them); returns them.
    fn fill(ps: &PackSet, first_seed: u64, count: u64, size: usize) -> Vec<(ObjectId, Vec<u8>)> {
        let mut out = Vec::new();
        for seed in first_seed..first_seed + count {
            let data = bytes(seed, size);
            let id = ObjectId::hash(&data);
            let rec = Record {
                id,
                kind: Kind::Chunk,
                codec: Codec::Raw,
                depth: 0,
                raw_len: data.len() as u32,
                base: ObjectId([0; 32]),
                payload: &data,
            };
            assert!(ps.append(&rec).unwrap());
            out.push((id, data));
        }
        ps.sync().unwrap();
        out
    }

    fn read_all(ps: &PackSet, objs: &[(ObjectId, Vec<u8>)]) {
        for (id, data) in objs {
            let loc = ps.get(id).unwrap_or_else(|| panic!("{id} not indexed"));
            assert_eq!(&ps.read_payload(id, &loc).unwrap(), data, "{id}");
        }
    }

    /// Every field of a `Loc`, comparable.
    type LocKey = (u32, u64, u32, u32, u8, u8, u8, ObjectId);

    /// The whole index, comparable.
    fn lookups(ps: &PackSet) -> Vec<(ObjectId, LocKey)> {
        let mut v: Vec<_> = ps
            .all()
            .into_iter()
            .map(|(id, l)| {
                let key = (
                    l.pack,
                    l.offset,
                    l.stored_len,
                    l.raw_len,
                    l.kind as u8,
                    l.codec as u8,
                    l.depth,
                    l.base,
                );
                (id, key)
            })
            .collect();
        v.sort_by_key(|(id, _)| *id);
        v
    }

    fn files_with(dir: &Path, suffix: &str) -> Vec<u32> {
        let mut v: Vec<u32> = fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter_map(|e| numbered(&e.file_name().to_string_lossy(), suffix))
            .collect();
        v.sort_unstable();
        v
    }

    const ROT: u64 = 4096;

    /// A store of several sealed packs (1000-byte chunks, sealed past 4 KiB).
    fn sealed_store(dir: &Path) -> Vec<(ObjectId, Vec<u8>)> {
        let ps = PackSet::open_with(dir, ROT).unwrap();
        let objs = fill(&ps, 0, 40, 1000);
        let packs = files_with(dir, ".pack");
        assert!(packs.len() >= 5, "{packs:?}");
        // Every pack but the active (last) one is sealed and has its idx.
        assert_eq!(files_with(dir, ".idx"), packs[..packs.len() - 1]);
        objs
    }

    #[test]
    fn sealed_packs_reopen_from_their_idx() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let objs = sealed_store(dir);
        let sealed = files_with(dir, ".pack").len() - 1;
        let before = {
            let ps = PackSet::open_with(dir, ROT).unwrap();
            lookups(&ps)
        };
        let ps = PackSet::open_with(dir, ROT).unwrap();
        let rep = ps.open_report();
        assert_eq!(rep.from_idx, sealed, "{rep:?}");
        assert_eq!(rep.scanned, 1, "only the active pack is walked: {rep:?}");
        assert_eq!(rep.idx_rejected + rep.idx_written, 0, "{rep:?}");
        read_all(&ps, &objs);
        // Same objects in, same lookups out: the idx gives exactly what a walk gives.
        assert_eq!(lookups(&ps), before);
        assert_eq!(ps.all().len(), objs.len());
        drop(ps);
        for n in files_with(dir, ".idx") {
            fs::remove_file(idx_path(dir, n)).unwrap();
        }
        let ps = PackSet::open_with(dir, ROT).unwrap();
        let rep = ps.open_report();
        assert_eq!((rep.from_idx, rep.scanned), (0, sealed + 1), "{rep:?}");
        assert_eq!(
            lookups(&ps),
            before,
            "walking every pack gives the same index"
        );
        // Missing idx files of sealed packs are written back at open.
        assert_eq!(rep.idx_written, sealed, "{rep:?}");
        drop(ps);
        let ps = PackSet::open_with(dir, ROT).unwrap();
        assert_eq!(ps.open_report().from_idx, sealed);
        assert_eq!(lookups(&ps), before);
        // Appending after reopen continues in the active pack and seals it in turn.
        let more = fill(&ps, 1000, 10, 1000);
        drop(ps);
        let ps = PackSet::open_with(dir, ROT).unwrap();
        assert_eq!(ps.open_report().scanned, 1);
        read_all(&ps, &objs);
        read_all(&ps, &more);
    }

    /// Rewrite an idx's header field and fix up its checksum, as a writer with a bug would.
    fn rewrite_idx(path: &Path, edit: impl FnOnce(&mut Vec<u8>)) {
        let mut b = fs::read(path).unwrap();
        edit(&mut b);
        let body = b.len() - IDX_SUM;
        let sum = *blake3::hash(&b[..body]).as_bytes();
        b[body..].copy_from_slice(&sum);
        fs::write(path, &b).unwrap();
    }

    #[test]
    fn bad_idx_is_ignored_and_the_pack_walked() {
        type Damage = fn(&Path);
        let cases: [(&str, Damage); 6] = [
            ("flipped byte", |p| {
                let mut b = fs::read(p).unwrap();
                let mid = b.len() / 2;
                b[mid] ^= 0x01;
                fs::write(p, &b).unwrap();
            }),
            ("truncated", |p| {
                let len = fs::metadata(p).unwrap().len();
                fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .unwrap()
                    .set_len(len - 50)
                    .unwrap();
            }),
            ("empty", |p| fs::write(p, b"").unwrap()),
            ("covers another length", |p| {
                rewrite_idx(p, |b| {
                    let covered = u64::from_le_bytes(b[16..24].try_into().unwrap());
                    b[16..24].copy_from_slice(&(covered - 1).to_le_bytes());
                })
            }),
            ("unknown version", |p| {
                rewrite_idx(p, |b| b[8..12].copy_from_slice(&2u32.to_le_bytes()))
            }),
            ("entry outside the pack", |p| {
                rewrite_idx(p, |b| {
                    let o = IDX_HDR + 32;
                    b[o..o + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
                })
            }),
        ];
        for (what, damage) in cases {
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path();
            let objs = sealed_store(dir);
            let sealed = files_with(dir, ".pack").len() - 1;
            let before = lookups(&PackSet::open_with(dir, ROT).unwrap());
            damage(&idx_path(dir, 2));
            let ps = PackSet::open_with(dir, ROT).unwrap();
            let rep = ps.open_report();
            assert_eq!(rep.idx_rejected, 1, "{what}: {rep:?}");
            assert_eq!(rep.from_idx, sealed - 1, "{what}: {rep:?}");
            assert_eq!(
                rep.scanned, 2,
                "{what}: the bad one and the active one: {rep:?}"
            );
            assert_eq!(
                rep.idx_written, 1,
                "{what}: the bad idx is rebuilt: {rep:?}"
            );
            read_all(&ps, &objs);
            assert_eq!(lookups(&ps), before, "{what}");
            drop(ps);
            let ps = PackSet::open_with(dir, ROT).unwrap();
            assert_eq!(
                ps.open_report().from_idx,
                sealed,
                "{what}: rebuilt idx is used"
            );
            assert_eq!(lookups(&ps), before, "{what}");
        }
    }

    #[test]
    fn pack_that_changed_length_is_walked() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let objs = sealed_store(dir);
        // Garbage appended to a sealed pack: its idx no longer covers the whole pack.
        let mut f = OpenOptions::new()
            .append(true)
            .open(pack_path(dir, 1))
            .unwrap();
        f.write_all(b"GRVRtorn").unwrap();
        drop(f);
        let ps = PackSet::open_with(dir, ROT).unwrap();
        let rep = ps.open_report();
        assert_eq!((rep.idx_rejected, rep.scanned), (1, 2), "{rep:?}");
        read_all(&ps, &objs);
    }

    /// An idx that passes its checksum but lies is still caught when reading, never
    /// returning another object's bytes.
    #[test]
    fn lying_idx_never_yields_wrong_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let objs = sealed_store(dir);
        let p = idx_path(dir, 1);
        // Swap the offsets of the first two entries; shorten the third's stored length.
        rewrite_idx(&p, |b| {
            let (e0, e1, e2) = (IDX_HDR, IDX_HDR + IDX_ENTRY, IDX_HDR + 2 * IDX_ENTRY);
            let o0: [u8; 8] = b[e0 + 32..e0 + 40].try_into().unwrap();
            let o1: [u8; 8] = b[e1 + 32..e1 + 40].try_into().unwrap();
            b[e0 + 32..e0 + 40].copy_from_slice(&o1);
            b[e1 + 32..e1 + 40].copy_from_slice(&o0);
            let sl = u32::from_le_bytes(b[e2 + 40..e2 + 44].try_into().unwrap());
            b[e2 + 40..e2 + 44].copy_from_slice(&(sl - 1).to_le_bytes());
        });
        let ps = PackSet::open_with(dir, ROT).unwrap();
        assert_eq!(ps.open_report().idx_rejected, 0, "the checksum is right");
        let mut bad = 0;
        for (id, data) in &objs {
            let loc = ps.get(id).unwrap();
            match ps.read_payload(id, &loc) {
                Ok(got) => assert_eq!(&got, data, "{id}"),
                Err(StoreError::Corrupt { id: eid, .. }) => {
                    assert_eq!(eid, *id);
                    bad += 1;
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(bad, 3, "the three lied-about objects fail to read");
    }

    /// Allocated bytes of a pack file.
    fn allocated(dir: &Path, n: u32) -> u64 {
        allocated_bytes(&File::open(pack_path(dir, n)).unwrap()).unwrap()
    }

    #[test]
    fn compaction_frees_in_place_and_leaves_no_idx_without_its_pack() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        // 20 KiB chunks in packs sealed past 64 KiB: holes of whole blocks can be punched.
        let rot = 64 << 10;
        let ps = PackSet::open_with(dir, rot).unwrap();
        let objs = fill(&ps, 0, 40, 20 << 10);
        let old = files_with(dir, ".pack");
        assert!(old.len() >= 5, "{old:?}");
        // Pack 1 dies whole; in the others every other object does.
        let first: std::collections::HashSet<ObjectId> = objs
            .iter()
            .filter(|(id, _)| ps.get(id).unwrap().pack == 1)
            .map(|(id, _)| *id)
            .collect();
        let (keep, drop_): (Vec<_>, Vec<_>) = objs
            .iter()
            .cloned()
            .enumerate()
            .partition(|(i, (id, _))| i % 2 == 0 && !first.contains(id));
        let keep: Vec<_> = keep.into_iter().map(|(_, o)| o).collect();
        let drop_: Vec<_> = drop_.into_iter().map(|(_, o)| o).collect();
        let kept: std::collections::HashSet<ObjectId> = keep.iter().map(|(id, _)| *id).collect();
        let before: u64 = old.iter().map(|&n| allocated(dir, n)).sum();
        let rep = ps.compact(&|id| kept.contains(id)).unwrap();
        assert_eq!(rep.removed as usize, drop_.len(), "{rep:?}");
        assert_eq!(rep.packs_deleted, 1, "{rep:?}");
        assert_eq!(rep.packs_punched as usize, old.len() - 1, "{rep:?}");
        let packs = files_with(dir, ".pack");
        assert_eq!(packs, old[1..], "no new pack: the old ones shrink in place");
        assert_eq!(
            files_with(dir, ".idx"),
            packs,
            "every pack has an idx of its live records"
        );
        let after: u64 = packs.iter().map(|&n| allocated(dir, n)).sum();
        let dead: u64 = drop_.iter().map(|(_, d)| (HDR + d.len()) as u64).sum();
        assert!(
            before - after >= dead * 3 / 4,
            "freed {} of {dead} dead bytes",
            before - after
        );
        read_all(&ps, &keep);
        for (id, _) in &drop_ {
            assert!(!ps.contains(id));
        }
        let lookups_after = lookups(&ps);
        drop(ps);
        // Reopened from the new idx files: the same live records, nothing dead.
        let ps = PackSet::open_with(dir, rot).unwrap();
        let rep = ps.open_report();
        assert_eq!((rep.from_idx, rep.scanned), (packs.len(), 0), "{rep:?}");
        assert_eq!(lookups(&ps), lookups_after);
        read_all(&ps, &keep);
        drop(ps);
        // Walked (no idx): the holes read as zeros and are skipped, the dead stay dead.
        for n in files_with(dir, ".idx") {
            fs::remove_file(idx_path(dir, n)).unwrap();
        }
        let ps = PackSet::open_with(dir, rot).unwrap();
        assert_eq!(lookups(&ps), lookups_after);
        read_all(&ps, &keep);
        // Appending after reopen continues, and a second compaction changes nothing.
        let more = fill(&ps, 5000, 12, 20 << 10);
        let rep = ps.compact(&|_| true).unwrap();
        assert_eq!(rep, Compacted::default());
        read_all(&ps, &keep);
        read_all(&ps, &more);
        // Compacting everything away leaves no pack and no idx.
        let rep = ps.compact(&|_| false).unwrap();
        assert_eq!(
            rep.packs_deleted as usize,
            files_with(dir, ".pack").len() + rep.packs_deleted as usize
        );
        assert!(fs::read_dir(dir).unwrap().next().is_none());
        assert!(ps.all().is_empty());
        // Appends start a new pack.
        let again = fill(&ps, 9000, 2, 1000);
        read_all(&ps, &again);
        drop(ps);
        // An idx left without its pack (a crash inside compaction) is removed at open.
        fs::write(idx_path(dir, 77), b"stale").unwrap();
        let ps = PackSet::open_with(dir, rot).unwrap();
        assert_eq!(ps.open_report().idx_orphans_removed, 1);
        assert!(!idx_path(dir, 77).exists());
        read_all(&ps, &again);
    }

    /// Where holes cannot be punched, a pack with dead records is rewritten whole into a new
    /// one (the newest, then appended to), and the data stays readable across a reopen.
    #[test]
    fn without_hole_punching_packs_are_rewritten() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let rot = 64 << 10;
        let ps = PackSet::open_with(dir, rot).unwrap();
        let objs = fill(&ps, 0, 12, 20 << 10);
        let old = files_with(dir, ".pack");
        let keep: Vec<_> = objs.iter().step_by(3).cloned().collect();
        let kept: std::collections::HashSet<ObjectId> = keep.iter().map(|(id, _)| *id).collect();
        ps.no_punch
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let rep = ps.compact(&|id| kept.contains(id)).unwrap();
        assert_eq!(rep.packs_punched, 0, "{rep:?}");
        assert!(rep.packs_rewritten > 0, "{rep:?}");
        // Every pack left is dense: its magic and live records, nothing else.
        let packs = files_with(dir, ".pack");
        assert!(packs.len() <= old.len(), "{old:?} -> {packs:?}");
        for n in &packs {
            let live: u64 = ps
                .all()
                .iter()
                .filter(|(_, l)| l.pack == *n)
                .map(|(_, l)| HDR as u64 + l.stored_len as u64)
                .sum();
            let len = fs::metadata(pack_path(dir, *n)).unwrap().len();
            assert_eq!(len, PACK_MAGIC.len() as u64 + live, "pack {n}");
        }
        assert!(fs::read_dir(dir)
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().ends_with(".tmp")));
        read_all(&ps, &keep);
        let more = fill(&ps, 700, 3, 1000);
        let after = lookups(&ps);
        drop(ps);
        let ps = PackSet::open_with(dir, rot).unwrap();
        assert_eq!(lookups(&ps), after);
        read_all(&ps, &keep);
        read_all(&ps, &more);
    }

    /// A partial copy an interrupted compaction of an older version left (a complete pack of
    /// records every one of which an earlier pack holds) is removed at open.
    #[test]
    fn a_pack_of_nothing_but_copies_is_removed_at_open() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let ps = PackSet::open_with(dir, ROT).unwrap();
        let objs = fill(&ps, 0, 6, 1000);
        drop(ps);
        let packs = files_with(dir, ".pack");
        let last = *packs.last().unwrap();
        // pack N+1 = a copy of pack 1's first records.
        let src = fs::read(pack_path(dir, 1)).unwrap();
        fs::write(pack_path(dir, last + 1), &src[..8 + 2 * (HDR + 1000)]).unwrap();
        let ps = PackSet::open_with(dir, ROT).unwrap();
        assert_eq!(ps.open_report().empty_removed, 1);
        assert!(!pack_path(dir, last + 1).exists());
        read_all(&ps, &objs);
    }
}
