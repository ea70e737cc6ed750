//! Append-only pack files holding checksummed object records, and the in-memory index
//! rebuilt from them at open (a torn tail from a crash is cut off).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::error::{store_io, StoreError};
use crate::id::ObjectId;

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

fn parse_header(pack: u32, offset: u64, h: &[u8]) -> Option<(ObjectId, Loc)> {
    if h.len() < HDR || &h[0..4] != REC_MAGIC {
        return None;
    }
    if blake3::hash(&h[..80]).as_bytes()[..4] != h[80..84] {
        return None;
    }
    let kind = match h[4] {
        1 => Kind::Chunk,
        2 => Kind::Tree,
        _ => return None,
    };
    let codec = match h[5] {
        0 => Codec::Raw,
        1 => Codec::Zstd,
        2 => Codec::Delta,
        _ => return None,
    };
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

struct Writer {
    pack: u32,
    file: Arc<File>,
    len: u64,
}

/// The set of pack files in `<store>/packs`.
pub struct PackSet {
    dir: PathBuf,
    index: RwLock<HashMap<ObjectId, Loc>>,
    files: RwLock<HashMap<u32, Arc<File>>>,
    writer: Mutex<Option<Writer>>,
}

fn pack_path(dir: &Path, n: u32) -> PathBuf {
    dir.join(format!("pack-{n:08}.pack"))
}

impl PackSet {
    /// Open every pack and index its records.
    pub fn open(dir: &Path) -> Result<PackSet, StoreError> {
        fs::create_dir_all(dir).map_err(store_io(dir))?;
        let mut numbers = Vec::new();
        for e in fs::read_dir(dir).map_err(store_io(dir))? {
            let e = e.map_err(store_io(dir))?;
            let name = e.file_name();
            let name = name.to_string_lossy();
            if let Some(n) = name
                .strip_prefix("pack-")
                .and_then(|s| s.strip_suffix(".pack"))
                .and_then(|s| s.parse::<u32>().ok())
            {
                numbers.push(n);
            } else if name.ends_with(".tmp") {
                let _ = fs::remove_file(e.path());
            }
        }
        numbers.sort_unstable();
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
            let end = scan(&file, n, &path, &mut index)?;
            let file = Arc::new(file);
            if Some(n) == last {
                let len = file.metadata().map_err(store_io(&path))?.len();
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
        Ok(PackSet {
            dir: dir.to_path_buf(),
            index: RwLock::new(index),
            files: RwLock::new(files),
            writer: Mutex::new(writer),
        })
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
        match parse_header(loc.pack, loc.offset, &buf[..HDR]) {
            Some((hid, _)) if hid == *id => {}
            _ => {
                return Err(StoreError::Corrupt {
                    id: *id,
                    why: format!(
                        "record header at {} of {} is damaged",
                        loc.offset,
                        pack_path(&self.dir, loc.pack).display()
                    ),
                })
            }
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
            Some(w) => w.len >= ROTATE_AT,
        };
        if needs_new {
            if let Some(old) = w.as_ref() {
                old.file
                    .sync_all()
                    .map_err(store_io(pack_path(&self.dir, old.pack)))?;
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

    fn create_pack(&self, n: u32) -> Result<Writer, StoreError> {
        let path = pack_path(&self.dir, n);
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

    /// Make everything appended so far durable.
    pub fn sync(&self) -> Result<(), StoreError> {
        let w = self.writer.lock();
        if let Some(w) = &*w {
            w.file
                .sync_data()
                .map_err(store_io(pack_path(&self.dir, w.pack)))?;
        }
        Ok(())
    }

    /// Rewrite the packs keeping only `keep`: new packs are written and synced before the
    /// old ones are deleted, so a crash leaves either the old or both sets.
    pub fn compact(&self, keep: &dyn Fn(&ObjectId) -> bool) -> Result<(u64, u64), StoreError> {
        let mut w = self.writer.lock();
        let old: Vec<u32> = self.files.read().keys().copied().collect();
        let entries = self.all();
        let mut removed = 0u64;
        let mut freed = 0u64;
        let next = old.iter().max().map(|m| m + 1).unwrap_or(1);
        let mut nw = self.create_pack(next)?;
        let mut new_index = HashMap::new();
        // Copy in old order so delta bases stay valid.
        let mut sorted = entries;
        sorted.sort_by_key(|(_, l)| (l.pack, l.offset));
        for (id, loc) in sorted {
            if !keep(&id) {
                removed += 1;
                freed += HDR as u64 + loc.stored_len as u64;
                continue;
            }
            let file = self.files.read().get(&loc.pack).cloned();
            let Some(file) = file else { continue };
            let mut buf = vec![0u8; HDR + loc.stored_len as usize];
            file.read_exact_at(&mut buf, loc.offset)
                .map_err(store_io(pack_path(&self.dir, loc.pack)))?;
            let path = pack_path(&self.dir, nw.pack);
            nw.file
                .write_all_at(&buf, nw.len)
                .map_err(store_io(&path))?;
            new_index.insert(
                id,
                Loc {
                    pack: nw.pack,
                    offset: nw.len,
                    ..loc
                },
            );
            nw.len += buf.len() as u64;
        }
        nw.file
            .sync_all()
            .map_err(store_io(pack_path(&self.dir, nw.pack)))?;
        *self.index.write() = new_index;
        {
            let mut files = self.files.write();
            for n in &old {
                files.remove(n);
                let p = pack_path(&self.dir, *n);
                fs::remove_file(&p).map_err(store_io(&p))?;
            }
        }
        sync_dir(&self.dir)?;
        *w = Some(nw);
        Ok((removed, freed))
    }

    /// Total bytes of all pack files.
    pub fn disk_bytes(&self) -> u64 {
        self.files
            .read()
            .values()
            .filter_map(|f| f.metadata().ok())
            .map(|m| m.len())
            .sum()
    }
}

/// Index one pack; returns the offset where valid records end.
fn scan(
    file: &File,
    n: u32,
    path: &Path,
    index: &mut HashMap<ObjectId, Loc>,
) -> Result<u64, StoreError> {
    let len = file.metadata().map_err(store_io(path))?.len();
    if len < PACK_MAGIC.len() as u64 {
        return Ok(0);
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
    let mut off = PACK_MAGIC.len();
    while off + HDR <= map.len() {
        let rec = parse_header(n, off as u64, &map[off..off + HDR])
            .filter(|(_, l)| off + HDR + l.stored_len as usize <= map.len());
        let Some((id, loc)) = rec else {
            // A damaged record in the middle (valid records follow) is skipped, and its
            // objects read as missing; only a torn tail (nothing valid after) is cut.
            match next_record(n, &map, off + 1) {
                Some(next) => {
                    tracing::warn!(pack = %path.display(), off, next, "skipping a damaged record");
                    off = next;
                    continue;
                }
                None => break,
            }
        };
        index.entry(id).or_insert(loc);
        off += HDR + loc.stored_len as usize;
    }
    Ok(off as u64)
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
