//! The per-pack index file (`pack-NNNNNNNN.idx`): a sealed pack's records sorted by id,
//! checksummed, covering the pack's exact length; loaded through a memory map at open instead
//! of walking the pack. Format: docs/nodefs-format.md.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::{codec_from, kind_from, sync_dir, Loc, HDR, PACK_MAGIC};
use crate::error::{store_io, StoreError};
use crate::id::ObjectId;

const IDX_MAGIC: &[u8; 8] = b"GRVPIDX1";
const IDX_VERSION: u32 = 1;
/// Size of the idx header: magic, version, reserved, covered pack length, entry count.
pub(super) const IDX_HDR: usize = 32;
/// Size of one idx entry: id, offset, stored_len, raw_len, kind, codec, depth, reserved, base.
pub(super) const IDX_ENTRY: usize = 84;
/// Size of the idx trailer: BLAKE3 of everything before it.
pub(super) const IDX_SUM: usize = 32;

pub(super) fn idx_path(dir: &Path, n: u32) -> PathBuf {
    dir.join(format!("pack-{n:08}.idx"))
}

/// Why a pack's idx was not used.
#[derive(Debug, thiserror::Error)]
pub(super) enum IdxProblem {
    #[error("no idx")]
    Missing,
    #[error("cannot read the idx: {0}")]
    Unreadable(std::io::Error),
    #[error("idx is damaged: {0}")]
    Damaged(String),
    #[error("idx covers {covered} bytes of the pack, which has {len}")]
    Stale { covered: u64, len: u64 },
}

/// Load pack `n`'s idx if it is intact and covers exactly the pack's current `pack_len`.
pub(super) fn load_idx(
    dir: &Path,
    n: u32,
    pack_len: u64,
) -> Result<Vec<(ObjectId, Loc)>, IdxProblem> {
    let path = idx_path(dir, n);
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(IdxProblem::Missing),
        Err(e) => return Err(IdxProblem::Unreadable(e)),
    };
    let len = file.metadata().map_err(IdxProblem::Unreadable)?.len();
    let damaged = |why: String| IdxProblem::Damaged(why);
    if len < (IDX_HDR + IDX_SUM) as u64 {
        return Err(damaged(format!(
            "{len} bytes is shorter than header and checksum"
        )));
    }
    // SAFETY: an idx is written whole under a temp name and renamed into place, never
    // modified in place, and the store's LOCK keeps other nodefs processes out; every read
    // below is bounds-checked against the mapping's length and entries are copied out
    // before it is dropped.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(IdxProblem::Unreadable)?;
    let m: &[u8] = &map;
    if &m[0..8] != IDX_MAGIC {
        return Err(damaged("bad magic".into()));
    }
    let u32_at = |o: usize| u32::from_le_bytes(m[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(m[o..o + 8].try_into().expect("8 bytes"));
    let version = u32_at(8);
    if version != IDX_VERSION {
        return Err(damaged(format!("unknown version {version}")));
    }
    let covered = u64_at(16);
    let count = u64_at(24);
    let want = count
        .checked_mul(IDX_ENTRY as u64)
        .and_then(|b| b.checked_add((IDX_HDR + IDX_SUM) as u64));
    if want != Some(len) {
        return Err(damaged(format!(
            "{len} bytes, but {count} entries need {}",
            want.map_or("more than 2^64".into(), |w| w.to_string())
        )));
    }
    let body = m.len() - IDX_SUM;
    if blake3::hash(&m[..body]).as_bytes() != &m[body..] {
        return Err(damaged("checksum mismatch".into()));
    }
    if covered != pack_len {
        return Err(IdxProblem::Stale {
            covered,
            len: pack_len,
        });
    }
    let mut entries = Vec::with_capacity(count as usize);
    let mut prev: Option<ObjectId> = None;
    for e in m[IDX_HDR..body].chunks_exact(IDX_ENTRY) {
        let id = ObjectId(e[0..32].try_into().expect("32 bytes"));
        if prev.is_some_and(|p| p >= id) {
            return Err(damaged(format!("entries out of order at {id}")));
        }
        prev = Some(id);
        let offset = u64::from_le_bytes(e[32..40].try_into().expect("8 bytes"));
        let stored_len = u32::from_le_bytes(e[40..44].try_into().expect("4 bytes"));
        let raw_len = u32::from_le_bytes(e[44..48].try_into().expect("4 bytes"));
        let (Some(kind), Some(codec)) = (kind_from(e[48]), codec_from(e[49])) else {
            return Err(damaged(format!("bad kind or codec for {id}")));
        };
        let fits =
            offset >= PACK_MAGIC.len() as u64 && offset + HDR as u64 + stored_len as u64 <= covered;
        if !fits {
            return Err(damaged(format!("record of {id} lies outside the pack")));
        }
        entries.push((
            id,
            Loc {
                pack: n,
                offset,
                stored_len,
                raw_len,
                kind,
                codec,
                depth: e[50],
                base: ObjectId(e[52..84].try_into().expect("32 bytes")),
            },
        ));
    }
    Ok(entries)
}

/// Write pack `n`'s idx for its first `pack_len` bytes (temp file, fsync, rename, fsync dir).
/// Sorts `entries` by id.
pub(super) fn write_idx(
    dir: &Path,
    n: u32,
    pack_len: u64,
    entries: &mut [(ObjectId, Loc)],
) -> Result<(), StoreError> {
    entries.sort_unstable_by_key(|(id, _)| *id);
    let mut buf = Vec::with_capacity(IDX_HDR + entries.len() * IDX_ENTRY + IDX_SUM);
    buf.extend_from_slice(IDX_MAGIC);
    buf.extend_from_slice(&IDX_VERSION.to_le_bytes());
    buf.extend_from_slice(&0u32.to_le_bytes());
    buf.extend_from_slice(&pack_len.to_le_bytes());
    buf.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for (id, l) in entries.iter() {
        debug_assert_eq!(l.pack, n, "idx entry from another pack");
        buf.extend_from_slice(&id.0);
        buf.extend_from_slice(&l.offset.to_le_bytes());
        buf.extend_from_slice(&l.stored_len.to_le_bytes());
        buf.extend_from_slice(&l.raw_len.to_le_bytes());
        buf.extend_from_slice(&[l.kind as u8, l.codec as u8, l.depth, 0]);
        buf.extend_from_slice(&l.base.0);
    }
    let sum = blake3::hash(&buf);
    buf.extend_from_slice(sum.as_bytes());
    let path = idx_path(dir, n);
    let tmp = dir.join(format!("pack-{n:08}.idx.tmp"));
    let written = File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(&buf)?;
            f.sync_all()
        })
        .map_err(store_io(&tmp));
    if written.is_err() {
        // A full disk must not leave half a file behind.
        let _ = fs::remove_file(&tmp);
    }
    written?;
    fs::rename(&tmp, &path).map_err(store_io(&path))?;
    sync_dir(dir)
}
