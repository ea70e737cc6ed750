//! Fast path for fixed-size chunked files (CRIU page images, hundreds of MiB on a snapshot's
//! critical path): every core reads its own blocks with `pread`, hashes and compresses pages
//! in place (one reusable zstd context per thread, no per-page allocation), zero pages skip
//! hashing, pages zstd cannot shrink are stored raw, and each block is one pack append. The
//! caller's `seal_manifest` makes it durable with one fdatasync.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::error::{io_err, Error};
use crate::id::ObjectId;
use crate::pack::{Codec, Kind, Record};
use crate::store::{Store, CHUNK_ZSTD_LEVEL};
use crate::tree::{ChunkRef, Node};

/// Bytes each worker reads and appends at a time (a multiple of any sane page size).
const BLOCK: usize = 4 << 20;

/// The id of an all-zero chunk of `n` bytes (cached for 4 KiB, the common page).
fn zero_id(n: usize) -> ObjectId {
    static PAGE: OnceLock<ObjectId> = OnceLock::new();
    if n == 4096 {
        *PAGE.get_or_init(|| ObjectId::hash(&[0u8; 4096]))
    } else {
        ObjectId::hash(&vec![0u8; n])
    }
}

/// Word-wise (vectorized); a page of data usually fails on its first word.
fn is_zero(b: &[u8]) -> bool {
    // SAFETY: every bit pattern is a valid u64; align_to only splits the slice.
    let (pre, mid, post) = unsafe { b.align_to::<u64>() };
    pre.iter().all(|&x| x == 0) && mid.iter().all(|&x| x == 0) && post.iter().all(|&x| x == 0)
}

/// Whether a page looks like random bytes (compressed or encrypted data, random heaps): 512
/// bytes sampled across it show as many distinct values as uniform noise does (about 221 of
/// 256, σ ≈ 4), so a zstd attempt would only burn CPU. Skewed data (text, pointers, small
/// integers) shows far fewer. A miss costs a few stored bytes, never correctness.
fn looks_random(page: &[u8]) -> bool {
    const SAMPLES: usize = 512;
    if page.len() < SAMPLES {
        return false;
    }
    let stride = page.len() / SAMPLES;
    let mut seen = [0u64; 4];
    for i in 0..SAMPLES {
        let b = page[i * stride] as usize;
        seen[b >> 6] |= 1 << (b & 63);
    }
    seen.iter().map(|w| w.count_ones()).sum::<u32>() >= 200
}

/// One worker's reusable state.
struct Worker {
    buf: Vec<u8>,
    /// Compressed payloads of the block, back to back.
    arena: Vec<u8>,
    zstd: zstd::bulk::Compressor<'static>,
}

/// Where a page's payload is: raw in `buf` at `off`, or compressed in `arena`.
enum Payload {
    Skip,
    Raw(usize, usize),
    Zstd(usize, usize),
}

impl Store {
    /// Chunks the file at `path` into fixed `n`-byte chunks on all cores and stores them.
    /// No whole-file passthrough object is made: fixed chunks are for data read back by
    /// export (page images), not served by a mount.
    pub(crate) fn chunk_fixed(&self, path: &Path, n: usize) -> Result<Node, Error> {
        let file = File::open(path).map_err(io_err(path))?;
        let size = file.metadata().map_err(io_err(path))?.len();
        let file = &file;
        let n = n.max(1);
        let block = (BLOCK / n).max(1) * n;
        let blocks = (size as usize).div_ceil(block);
        let next = AtomicUsize::new(0);
        let results: Mutex<Vec<(usize, Vec<ChunkRef>)>> = Mutex::new(Vec::with_capacity(blocks));
        let err: Mutex<Option<Error>> = Mutex::new(None);
        let threads = crate::cpus().min(blocks).max(1);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    let mut w = match zstd::bulk::Compressor::new(CHUNK_ZSTD_LEVEL) {
                        Ok(z) => Worker {
                            buf: vec![0u8; block],
                            arena: Vec::with_capacity(block),
                            zstd: z,
                        },
                        Err(e) => {
                            err.lock().get_or_insert(io_err(path)(e));
                            return;
                        }
                    };
                    loop {
                        let b = next.fetch_add(1, Ordering::Relaxed);
                        if b >= blocks || err.lock().is_some() {
                            break;
                        }
                        let start = b * block;
                        let len = block.min(size as usize - start);
                        match self.fixed_block(path, file, &mut w, start as u64, len, n) {
                            Ok(refs) => results.lock().push((b, refs)),
                            Err(e) => {
                                err.lock().get_or_insert(e);
                                break;
                            }
                        }
                    }
                });
            }
        });
        if let Some(e) = err.into_inner() {
            return Err(e);
        }
        let mut results = results.into_inner();
        results.sort_unstable_by_key(|(b, _)| *b);
        let chunks: Vec<ChunkRef> = results.into_iter().flat_map(|(_, r)| r).collect();
        let size = chunks.iter().map(|c| c.len as u64).sum();
        Ok(Node::File { size, chunks })
    }

    /// Reads `len` bytes at `off`, stores their pages, returns their refs in order.
    fn fixed_block(
        &self,
        path: &Path,
        file: &File,
        w: &mut Worker,
        off: u64,
        len: usize,
        n: usize,
    ) -> Result<Vec<ChunkRef>, Error> {
        let buf = &mut w.buf[..len];
        file.read_exact_at(buf, off).map_err(io_err(path))?;
        w.arena.clear();
        let packs = self.packs();
        let mut refs = Vec::with_capacity(len.div_ceil(n));
        let mut payloads = Vec::with_capacity(refs.capacity());
        let mut fresh = HashSet::new();
        for (i, page) in buf.chunks(n).enumerate() {
            let id = if page.len() == n && is_zero(page) {
                zero_id(n)
            } else {
                ObjectId::hash(page)
            };
            refs.push(ChunkRef {
                id,
                len: page.len() as u32,
            });
            if packs.contains(&id) || !fresh.insert(id) {
                payloads.push(Payload::Skip);
                continue;
            }
            if looks_random(page) {
                payloads.push(Payload::Raw(i * n, page.len()));
                continue;
            }
            // A page zstd cannot shrink does not fit in a page-sized window: store it raw.
            let at = w.arena.len();
            w.arena.resize(at + page.len() - 1, 0);
            match w.zstd.compress_to_buffer(page, &mut w.arena[at..]) {
                Ok(z) if z < page.len() - 1 => {
                    w.arena.truncate(at + z);
                    payloads.push(Payload::Zstd(at, z));
                }
                _ => {
                    w.arena.truncate(at);
                    payloads.push(Payload::Raw(i * n, page.len()));
                }
            }
        }
        let recs: Vec<Record<'_>> = refs
            .iter()
            .zip(&payloads)
            .filter_map(|(r, p)| {
                let (codec, payload) = match *p {
                    Payload::Skip => return None,
                    Payload::Raw(o, l) => (Codec::Raw, &buf[o..o + l]),
                    Payload::Zstd(o, l) => (Codec::Zstd, &w.arena[o..o + l]),
                };
                Some(Record {
                    id: r.id,
                    kind: Kind::Chunk,
                    codec,
                    depth: 0,
                    raw_len: r.len,
                    base: ObjectId([0; 32]),
                    payload,
                })
            })
            .collect();
        if !recs.is_empty() {
            packs.append_batch(&recs)?;
        }
        Ok(refs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection() {
        let mut p = vec![0u8; 4096];
        assert!(is_zero(&p));
        assert!(is_zero(&p[1..4000]));
        p[4095] = 1;
        assert!(!is_zero(&p));
        p[4095] = 0;
        p[3] = 1;
        assert!(!is_zero(&p[1..]));
        assert_eq!(zero_id(4096), ObjectId::hash(&[0u8; 4096]));
        assert_eq!(zero_id(512), ObjectId::hash(&[0u8; 512]));
    }

    #[test]
    fn random_pages_skip_compression_and_text_does_not() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let random: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        assert!(looks_random(&random));
        let text: Vec<u8> = b"the quick brown fox jumps over the lazy dog 0123456789 "
            .iter()
            .cycle()
            .take(4096)
            .copied()
            .collect();
        assert!(!looks_random(&text));
        let pointers: Vec<u8> = (0..512u64)
            .flat_map(|i| (0x7f3a_1000_0000u64 + i * 48).to_le_bytes())
            .collect();
        assert!(!looks_random(&pointers));
        assert!(!looks_random(&[0u8; 4096]));
    }
}
