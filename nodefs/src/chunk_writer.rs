//! Storing an import's chunks on other threads while the importing thread cuts the next ones.
//!
//! A tar import (a registry layer above all) is one stream: read, gunzip, untar, cut into
//! chunks. Done on one thread, the other cores idle while it compresses and appends. A
//! [`ChunkWriter`] takes each chunk with its id (hashed on the cutting thread, so the tree can
//! name the chunk at once) and compresses and appends it on `cpus - 1` threads of its own,
//! batching the chunks of many small files into one pack write.
//!
//! Everything handed to [`ChunkWriter::put`] is stored once [`ChunkWriter::finish`] returns Ok;
//! a worker's error comes back from `finish` (or from a later `put`). Dropped unfinished (the
//! import failed), the workers store what they were given and stop: garbage for the next gc,
//! as any failed import's chunks are.

use std::cell::{Cell, RefCell};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::{Scope, ScopedJoinHandle};

use parking_lot::Mutex;

use crate::error::{Error, StoreError};
use crate::id::ObjectId;
use crate::store::Store;

/// Chunks go to the workers in batches of about this many bytes: one pack write each.
const BATCH_BYTES: usize = 1 << 20;
/// Batches waiting for a worker; bounds the memory in flight to about this many MiB.
const QUEUE: usize = 8;

type Batch = Vec<(ObjectId, Vec<u8>)>;

pub(crate) struct ChunkWriter<'scope> {
    store_dir: std::path::PathBuf,
    pending: RefCell<Batch>,
    pending_bytes: Cell<usize>,
    tx: Option<SyncSender<Batch>>,
    workers: Vec<ScopedJoinHandle<'scope, Result<(), StoreError>>>,
}

impl<'scope> ChunkWriter<'scope> {
    /// Workers for `store`, living in `scope`.
    pub(crate) fn start<'env>(scope: &'scope Scope<'scope, 'env>, store: &'env Store) -> Self {
        let (tx, rx) = sync_channel::<Batch>(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..crate::cpus().saturating_sub(1).max(1))
            .map(|_| {
                let rx = rx.clone();
                scope.spawn(move || work(store, &rx))
            })
            .collect();
        ChunkWriter {
            store_dir: store.dir().to_path_buf(),
            pending: RefCell::new(Vec::new()),
            pending_bytes: Cell::new(0),
            tx: Some(tx),
            workers,
        }
    }

    /// Hand over one chunk; its id.
    pub(crate) fn put(&self, data: &[u8]) -> Result<ObjectId, Error> {
        let id = ObjectId::hash(data);
        self.pending.borrow_mut().push((id, data.to_vec()));
        self.pending_bytes
            .set(self.pending_bytes.get() + data.len());
        if self.pending_bytes.get() >= BATCH_BYTES {
            self.send()?;
        }
        Ok(id)
    }

    fn send(&self) -> Result<(), Error> {
        let batch = std::mem::take(&mut *self.pending.borrow_mut());
        self.pending_bytes.set(0);
        if batch.is_empty() {
            return Ok(());
        }
        let tx = self.tx.as_ref().expect("sender lives until finish");
        // Fails only when every worker has stopped, each on an error that `finish` returns.
        tx.send(batch).map_err(|_| {
            Error::Store(StoreError::Io {
                path: self.store_dir.clone(),
                source: std::io::Error::other("the chunk writers stopped on an error"),
            })
        })
    }

    /// Wait until every chunk handed over is stored.
    pub(crate) fn finish(mut self) -> Result<(), Error> {
        let sent = self.send();
        drop(self.tx.take());
        let mut first = None;
        for w in self.workers.drain(..) {
            let r = w.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
            if let (Err(e), None) = (r, &first) {
                first = Some(e);
            }
        }
        match first {
            Some(e) => Err(Error::Store(e)),
            None => sent,
        }
    }
}

fn work(store: &Store, rx: &Mutex<Receiver<Batch>>) -> Result<(), StoreError> {
    loop {
        // The guard is a temporary: the lock is held while waiting, not while storing.
        let batch = rx.lock().recv();
        match batch {
            Ok(b) => store.put_hashed_chunks(&b)?,
            Err(_) => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_put_is_stored_when_finish_returns() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let chunks: Vec<Vec<u8>> = (0..3000u32)
            .map(|i| {
                let n = 100 + (i as usize * 7919) % 5000;
                (0..n)
                    .map(|k| (k as u32 ^ i.wrapping_mul(2654435761)) as u8)
                    .collect()
            })
            .collect();
        let ids = std::thread::scope(|s| {
            let w = ChunkWriter::start(s, &store);
            let ids: Vec<ObjectId> = chunks.iter().map(|c| w.put(c).unwrap()).collect();
            // A chunk twice in one import is stored once (the pack dedups under its lock).
            w.put(&chunks[0]).unwrap();
            w.finish().unwrap();
            ids
        });
        for (id, c) in ids.iter().zip(&chunks) {
            assert_eq!(*id, ObjectId::hash(c));
            assert_eq!(store.get_chunk(id).unwrap().as_slice(), c.as_slice());
        }
    }
}
