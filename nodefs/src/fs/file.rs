//! A regular file's data in a mount: base chunks from the store overlaid, block by block,
//! by an upper file on disk. A small write copies up at most two blocks, never the file.

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::upper::{Upper, Uppers};
use crate::store::Store;
use crate::tree::ChunkRef;

/// Overlay granularity.
pub const BLOCK: u64 = 4096;

/// Base content: chunk list and chunk start offsets.
#[derive(Debug, Default)]
pub struct Base {
    pub chunks: Vec<ChunkRef>,
    pub offsets: Vec<u64>,
}

impl Base {
    pub fn new(chunks: Vec<ChunkRef>) -> Base {
        let mut offsets = Vec::with_capacity(chunks.len());
        let mut o = 0u64;
        for c in &chunks {
            offsets.push(o);
            o += c.len as u64;
        }
        Base { chunks, offsets }
    }

    pub fn len(&self) -> u64 {
        self.offsets
            .last()
            .map(|o| o + self.chunks.last().map(|c| c.len as u64).unwrap_or(0))
            .unwrap_or(0)
    }

    /// Copy base bytes [off, off+buf.len()) into buf.
    pub fn read(&self, store: &Store, mut off: u64, mut buf: &mut [u8]) -> std::io::Result<()> {
        while !buf.is_empty() {
            let i = match self.offsets.binary_search(&off) {
                Ok(i) => i,
                Err(i) => i - 1,
            };
            let c = &self.chunks[i];
            let data = store.get_chunk(&c.id).map_err(|e| {
                tracing::error!(error = %e, "chunk read failed");
                std::io::Error::from_raw_os_error(libc::EIO)
            })?;
            let start = (off - self.offsets[i]) as usize;
            let n = (data.len() - start).min(buf.len());
            buf[..n].copy_from_slice(&data[start..start + n]);
            buf = &mut buf[n..];
            off += n as u64;
        }
        Ok(())
    }
}

/// File data of one inode.
#[derive(Debug)]
pub struct FileData {
    pub size: u64,
    pub base: Arc<Base>,
    /// Bytes of `base` still visible (truncation hides the rest).
    pub base_len: u64,
    /// Blocks whose content lives in the upper layer.
    pub present: Vec<u64>,
    /// The mount's upper storage, and where in it this file's upper blocks are.
    pub uppers: Arc<Uppers>,
    pub ino: u64,
    pub upper: Upper,
    /// Bumped on every content change; commit memoizes per version.
    pub version: u64,
    pub memo: Option<(u64, Arc<Vec<ChunkRef>>)>,
    /// The content as this mount last committed it (sealed), if it has. The next commit
    /// starts from it: only blocks changed since are re-chunked, as deltas against the
    /// chunks they replace, instead of everything that differs from the base.
    pub committed: Option<Arc<Base>>,
    /// Blocks whose content changed since `committed` (or since the mount, before a commit).
    pub changed: Vec<u64>,
    /// Named like a shared library in the manifest (passthrough policy).
    pub lib_name: bool,
}

impl FileData {
    pub fn new(size: u64, chunks: Vec<ChunkRef>, uppers: Arc<Uppers>, ino: u64) -> FileData {
        let base = Base::new(chunks);
        let base_len = base.len().min(size);
        FileData {
            size,
            base: Arc::new(base),
            base_len,
            present: Vec::new(),
            uppers,
            ino,
            upper: Upper::default(),
            version: 0,
            memo: None,
            committed: None,
            changed: Vec::new(),
            lib_name: false,
        }
    }

    /// Stands for "a new regular file" until [`super::state::State::create`] makes the real one.
    pub fn placeholder() -> FileData {
        FileData::new(0, Vec::new(), Arc::new(Uppers::new("".as_ref())), 0)
    }

    pub fn is_present(&self, b: u64) -> bool {
        self.present
            .get((b / 64) as usize)
            .is_some_and(|w| w & (1 << (b % 64)) != 0)
    }

    fn set_present(&mut self, b: u64) {
        let i = (b / 64) as usize;
        if self.present.len() <= i {
            self.present.resize(i + 1, 0);
        }
        self.present[i] |= 1 << (b % 64);
    }

    pub fn is_changed(&self, b: u64) -> bool {
        self.changed
            .get((b / 64) as usize)
            .is_some_and(|w| w & (1 << (b % 64)) != 0)
    }

    /// Record that bytes [from, to) changed since the last commit.
    fn mark_changed(&mut self, from: u64, to: u64) {
        if to <= from {
            return;
        }
        for b in from / BLOCK..=(to - 1) / BLOCK {
            let i = (b / 64) as usize;
            if self.changed.len() <= i {
                self.changed.resize(i + 1, 0);
            }
            self.changed[i] |= 1 << (b % 64);
        }
    }

    /// The content is now sealed in a commit as `chunks`: later commits start from it.
    pub fn committed_as(&mut self, chunks: &[ChunkRef]) {
        self.committed = Some(Arc::new(Base::new(chunks.to_vec())));
        self.changed = Vec::new();
    }

    /// Blocks held in the upper layer (what the mount is charged for).
    pub fn upper_blocks(&self) -> u64 {
        self.present.iter().map(|w| w.count_ones() as u64).sum()
    }

    /// Whether the content is exactly the base (no upper blocks, nothing hidden).
    pub fn is_pristine(&self) -> bool {
        self.upper_blocks() == 0 && self.base_len == self.base.len() && self.size == self.base_len
    }

    /// Write `data` at `off` of the upper layer.
    fn upper_write(&mut self, data: &[u8], off: u64) -> std::io::Result<()> {
        let end = off + data.len() as u64;
        let (f, base) = self
            .upper
            .for_write(&self.uppers, self.ino, end, self.size)?;
        f.write_all_at(data, base + off)
    }

    /// The file to fsync for this file, if it has upper data.
    pub fn sync_handle(&mut self) -> std::io::Result<Option<Arc<std::fs::File>>> {
        self.upper.sync_handle(&self.uppers, self.ino)
    }

    /// The inode is gone: release its upper storage.
    pub fn free_upper(&mut self) {
        self.upper.free(&self.uppers, self.ino);
    }

    /// Content of block `b` as seen through the overlay, for copy-up.
    fn block_view(&mut self, store: &Store, b: u64) -> std::io::Result<Vec<u8>> {
        let start = b * BLOCK;
        let mut buf = vec![0u8; BLOCK as usize];
        self.read_into(store, start, &mut buf)?;
        Ok(buf)
    }

    /// Read [off, off+buf.len()) through the overlay (caller clamps to size).
    pub fn read_into(&mut self, store: &Store, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let end = off + buf.len() as u64;
        let mut pos = off;
        while pos < end {
            let b = pos / BLOCK;
            let present = self.is_present(b);
            // Extend the run while blocks have the same presence.
            let mut run_end = ((b + 1) * BLOCK).min(end);
            while run_end < end && self.is_present(run_end / BLOCK) == present {
                run_end = ((run_end / BLOCK + 1) * BLOCK).min(end);
            }
            let dst = &mut buf[(pos - off) as usize..(run_end - off) as usize];
            if present {
                self.upper.read(&self.uppers, self.ino, dst, pos)?;
            } else {
                let base_end = self.base_len.min(run_end);
                if pos < base_end {
                    let n = (base_end - pos) as usize;
                    self.base.read(store, pos, &mut dst[..n])?;
                    dst[n..].fill(0);
                } else {
                    dst.fill(0);
                }
            }
            pos = run_end;
        }
        Ok(())
    }

    /// Make sure block `b` is in the upper layer, copying its current content up.
    fn copy_up(&mut self, store: &Store, b: u64) -> std::io::Result<()> {
        if self.is_present(b) {
            return Ok(());
        }
        if b * BLOCK >= self.base_len {
            // Nothing from the base shows here: the upper file already reads as zeros.
            self.set_present(b);
            return Ok(());
        }
        let data = self.block_view(store, b)?;
        let start = b * BLOCK;
        let keep = self.size.saturating_sub(start).min(BLOCK) as usize;
        self.upper_write(&data[..keep], start)?;
        self.set_present(b);
        Ok(())
    }

    /// Blocks that `write(off, len)` would newly add to the upper layer.
    pub fn new_blocks_for(&self, off: u64, len: u64) -> u64 {
        if len == 0 {
            return 0;
        }
        (off / BLOCK..=(off + len - 1) / BLOCK)
            .filter(|b| !self.is_present(*b))
            .count() as u64
    }

    pub fn write(&mut self, store: &Store, off: u64, data: &[u8]) -> std::io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let end = off + data.len() as u64;
        let first = off / BLOCK;
        let last = (end - 1) / BLOCK;
        if !off.is_multiple_of(BLOCK) {
            self.copy_up(store, first)?;
        }
        if !end.is_multiple_of(BLOCK) {
            self.copy_up(store, last)?;
        }
        self.upper_write(data, off)?;
        for b in first..=last {
            self.set_present(b);
        }
        self.mark_changed(off, end);
        if end > self.size {
            self.size = end;
        }
        self.version += 1;
        Ok(())
    }

    /// Change the size; bytes past a shrink read as zeros if the file grows again.
    pub fn truncate(&mut self, store: &Store, size: u64) -> std::io::Result<()> {
        // The block holding the new end, and everything between the two ends.
        self.mark_changed(
            size.min(self.size) / BLOCK * BLOCK,
            size.max(self.size).max(size + 1),
        );
        if size < self.size {
            if !size.is_multiple_of(BLOCK) && size < self.base_len {
                self.copy_up(store, size / BLOCK)?;
            }
            self.base_len = self.base_len.min(size);
            // Drop upper blocks past the end.
            let keep_blocks = size.div_ceil(BLOCK);
            for b in keep_blocks..(self.present.len() as u64 * 64) {
                let i = (b / 64) as usize;
                self.present[i] &= !(1 << (b % 64));
            }
            while self.present.last() == Some(&0) {
                self.present.pop();
            }
        }
        self.upper
            .truncate(&self.uppers, self.ino, self.size, size)?;
        self.size = size;
        self.version += 1;
        Ok(())
    }

    /// Make [off, off+len) read as zeros, keeping the size.
    pub fn zero_range(&mut self, store: &Store, off: u64, len: u64) -> std::io::Result<()> {
        let end = (off + len).min(self.size);
        if off >= end {
            return Ok(());
        }
        let mut pos = off;
        while pos < end {
            let b = pos / BLOCK;
            let bend = ((b + 1) * BLOCK).min(end);
            if pos.is_multiple_of(BLOCK) && (bend.is_multiple_of(BLOCK) || bend == self.size) {
                self.upper_write(&vec![0u8; (bend - pos) as usize], pos)?;
                self.set_present(b);
                self.mark_changed(pos, bend);
            } else {
                let zeros = vec![0u8; (bend - pos) as usize];
                self.write(store, pos, &zeros)?;
            }
            pos = bend;
        }
        self.version += 1;
        Ok(())
    }

    /// Reserve [off, off+len): blocks become upper blocks (content preserved).
    pub fn allocate(
        &mut self,
        store: &Store,
        off: u64,
        len: u64,
        keep_size: bool,
    ) -> std::io::Result<()> {
        let end = off + len;
        if !keep_size && end > self.size {
            self.truncate(store, end)?;
        }
        let lim = end.min(self.size);
        if lim > off {
            for b in off / BLOCK..=(lim - 1) / BLOCK {
                self.copy_up(store, b)?;
            }
        }
        self.version += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// One random write, truncate, hole punch or allocation, on `f` and on `model`.
    fn random_op(
        rng: &mut rand::rngs::StdRng,
        f: &mut FileData,
        store: &Store,
        model: &mut Vec<u8>,
    ) {
        let len = model.len() as u64;
        match rng.gen_range(0..5) {
            0 | 1 => {
                let off = rng.gen_range(0..len + 10_000);
                let data: Vec<u8> = (0..rng.gen_range(1..20_000)).map(|_| rng.gen()).collect();
                f.write(store, off, &data).unwrap();
                let end = off as usize + data.len();
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[off as usize..end].copy_from_slice(&data);
            }
            2 => {
                let size = rng.gen_range(0..len + 50_000);
                f.truncate(store, size).unwrap();
                model.resize(size as usize, 0);
            }
            3 => {
                let off = rng.gen_range(0..len + 1);
                let l = rng.gen_range(0..30_000);
                f.zero_range(store, off, l).unwrap();
                let end = ((off + l) as usize).min(model.len());
                if (off as usize) < end {
                    model[off as usize..end].fill(0);
                }
            }
            _ => {
                let off = rng.gen_range(0..len + 10_000);
                let l = rng.gen_range(1..30_000);
                let keep = rng.gen_bool(0.5);
                f.allocate(store, off, l, keep).unwrap();
                if !keep && model.len() < (off + l) as usize {
                    model.resize((off + l) as usize, 0);
                }
            }
        }
    }

    /// Random writes, truncates, hole punches and allocations against a plain byte vector.
    #[test]
    fn overlay_matches_a_model() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(&tmp.path().join("store")).unwrap();
        let upper_dir = tmp.path().join("upper");
        std::fs::create_dir_all(&upper_dir).unwrap();
        let upper = Arc::new(Uppers::new(&upper_dir));
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for round in 0..20u64 {
            let n = rng.gen_range(0..300_000);
            let mut model: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            let chunks: Vec<ChunkRef> = model
                .chunks(40_000)
                .map(|c| ChunkRef {
                    id: store.put_chunk(c, None).unwrap(),
                    len: c.len() as u32,
                })
                .collect();
            let mut f = FileData::new(model.len() as u64, chunks, upper.clone(), round);
            for _ in 0..60 {
                random_op(&mut rng, &mut f, &store, &mut model);
                assert_eq!(f.size, model.len() as u64);
                let mut got = vec![0u8; model.len()];
                f.read_into(&store, 0, &mut got).unwrap();
                assert!(got == model, "round {round}: content differs");
            }
            // What a commit would store is exactly the content, also when it starts from
            // an earlier commit of the file (a chain of commits in one mount).
            for commit in 0..3 {
                let chunks = super::super::commit::rechunk(&mut f, &store).unwrap();
                let mut stored = Vec::new();
                for c in &chunks {
                    stored.extend_from_slice(&store.get_chunk(&c.id).unwrap());
                }
                assert!(
                    stored == model,
                    "round {round}, commit {commit}: committed content differs"
                );
                f.committed_as(&chunks);
                for _ in 0..10 {
                    random_op(&mut rng, &mut f, &store, &mut model);
                }
            }
        }
    }
}
