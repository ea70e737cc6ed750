//! Putting and getting the store's objects: chunks and trees, compressed, deduplicated, and
//! stored as zstd deltas against an earlier version when that is clearly smaller; reads
//! verify each object against its id and go through the caches.

use std::sync::Arc;

use super::{zstd_ctx, Store, CHUNK_ZSTD_LEVEL, MAX_DELTA_DEPTH, ZSTD_LEVEL};
use crate::error::{store_io, StoreError};
use crate::id::{ManifestId, ObjectId};
use crate::pack::{Codec, Kind, Record};
use crate::tree::Tree;

impl Store {
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
        let plain = zstd_ctx::compress(data, CHUNK_ZSTD_LEVEL).map_err(store_io(&self.dir))?;
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
                *p = Some(compress_chunk(data));
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
        let lens = chunks.iter().map(Vec::len);
        self.packs
            .append_batch(&chunk_records(ids.iter().zip(lens), &payloads))?;
        Ok(ids)
    }

    /// Store chunks whose ids the caller hashed (a [`crate::chunk_writer::ChunkWriter`]'s
    /// worker): compressed on this thread, one pack write.
    pub(crate) fn put_hashed_chunks(
        &self,
        chunks: &[(ObjectId, Vec<u8>)],
    ) -> Result<(), StoreError> {
        let payloads: Vec<Option<(Codec, Vec<u8>)>> = chunks
            .iter()
            .map(|(id, data)| (!self.packs.contains(id)).then(|| compress_chunk(data)))
            .collect();
        let lens = chunks.iter().map(|(id, data)| (id, data.len()));
        self.packs.append_batch(&chunk_records(lens, &payloads))?;
        Ok(())
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
        let mut payload = zstd_ctx::compress(&data, level).map_err(store_io(&self.dir))?;
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
            Codec::Zstd => zstd_ctx::decompress(&payload, loc.raw_len as usize)
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

/// The pack records of chunks (id and raw length) whose payload was made (`None`: the store
/// had the chunk already).
fn chunk_records<'p>(
    chunks: impl Iterator<Item = (&'p ObjectId, usize)>,
    payloads: &'p [Option<(Codec, Vec<u8>)>],
) -> Vec<Record<'p>> {
    chunks
        .zip(payloads)
        .filter_map(|((id, raw_len), p)| {
            p.as_ref().map(|(codec, payload)| Record {
                id: *id,
                kind: Kind::Chunk,
                codec: *codec,
                depth: 0,
                raw_len: raw_len as u32,
                base: ObjectId([0; 32]),
                payload,
            })
        })
        .collect()
}

/// A chunk's payload: zstd where that is smaller, else the bytes as they are.
fn compress_chunk(data: &[u8]) -> (Codec, Vec<u8>) {
    match zstd_ctx::compress(data, CHUNK_ZSTD_LEVEL) {
        Ok(z) if z.len() < data.len() => (Codec::Zstd, z),
        _ => (Codec::Raw, data.to_vec()),
    }
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
}
