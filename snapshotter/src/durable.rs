//! Snapshots become durable in the background.
//!
//! A snapshot returns once the sandbox is thawed and the snapshot is recorded: its CRIU images
//! stay in scratch space (the materialized copy forks restore from anyway), and one worker
//! imports them into the content store, oldest first, then records the images manifest and the
//! content root. Storing 256 MiB of incompressible pages takes this disk about 0.8 s; nobody
//! waits for it unless they ask (`SnapshotOptions::durable`, [`Snapshotter::wait_durable`]).
//!
//! Crash safety: the record (with the fs ref) is written before the snapshot is returned, so a
//! daemon that dies mid-import finds the record at start and imports again from scratch space.
//! A host reboot empties a tmpfs scratch: a snapshot that was never durable is then dropped,
//! with an error in the log.

use std::collections::HashMap;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::Error;
use crate::images;
use crate::record::{self, SnapshotInfo};
use crate::snapshotter::{Pin, Snapshotter};

/// The background import queue and who waits on it.
#[derive(Default)]
pub(crate) struct Imports {
    queue: Mutex<Option<Sender<String>>>,
    /// Snapshots whose import failed, with the error (until the next start retries them).
    failed: Mutex<HashMap<String, Arc<Error>>>,
    /// Signalled whenever an import ends.
    ended: Condvar,
    ended_lock: Mutex<()>,
    /// Held while an import's result is recorded and while a snapshot is deleted, so that a
    /// delete never races the import recording refs for a snapshot that is gone.
    pub(crate) commit: Mutex<()>,
}

impl Snapshotter {
    /// Starts the import worker and queues the snapshots an earlier run left non-durable
    /// (dropping those whose images are gone).
    pub(crate) fn start_imports(self: &Arc<Self>) {
        let (tx, rx) = mpsc::channel::<String>();
        let me: Weak<Snapshotter> = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("grove-snap-store".into())
            .spawn(move || {
                let _ = grove_sys::sched::into_background();
                for id in rx {
                    let Some(s) = me.upgrade() else { return };
                    s.import_one(&id);
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "no snapshot import worker: snapshots stay non-durable");
            return;
        }
        *self.imports.queue.lock() = Some(tx);
        let pending: Vec<SnapshotInfo> = self
            .index
            .read()
            .values()
            .filter(|s| !s.durable)
            .cloned()
            .collect();
        for info in pending {
            if let Some(dir) = self.cache.existing(&info.id) {
                tracing::info!(snapshot = %info.id, "resuming the import of a snapshot's images");
                // A crash while an incremental dump was being made whole: finish it first.
                if crate::snapshotter::has_parent(&dir) {
                    self.whole_again(&info.id, dir);
                }
                self.queue_import(&info.id);
            } else {
                tracing::error!(
                    snapshot = %info.id,
                    "snapshot lost: its images were never stored and scratch space no longer has them (host reboot?)"
                );
                let _ = self.delete_by_id(&info.id);
            }
        }
    }

    pub(crate) fn queue_import(&self, id: &str) {
        let sent = self
            .imports
            .queue
            .lock()
            .as_ref()
            .is_some_and(|q| q.send(id.to_string()).is_ok());
        if !sent {
            self.imports
                .failed
                .lock()
                .insert(id.to_string(), Arc::new(Error::NoImportWorker));
        }
    }

    fn import_one(&self, id: &str) {
        if let Err(e) = self.store_images(id) {
            tracing::error!(snapshot = id, error = %nodefs::chain(&e), "storing a snapshot's images failed; retried later");
            self.imports
                .failed
                .lock()
                .insert(id.to_string(), Arc::new(e));
        }
        let _g = self.imports.ended_lock.lock();
        self.imports.ended.notify_all();
    }

    /// Imports the images of a non-durable snapshot and records the result. A snapshot
    /// deleted meanwhile is left alone (its objects go with the next gc).
    fn store_images(&self, id: &str) -> Result<(), Error> {
        let Some(info) = self.index.read().get(id).cloned() else {
            return Ok(());
        };
        if info.durable {
            return Ok(());
        }
        self.wait_whole(id)?;
        let Some(dir) = self.cache.existing(id) else {
            return Err(Error::Unsupported {
                what: format!("snapshot {id}: its images left scratch space before being stored"),
            });
        };
        let t = Instant::now();
        let before = self.store().stored_bytes()?;
        let base = self.images_base(&info.source, &info.spec, info.created_at_ms, Some(&info.id));
        let images_root = match images::import(&**self.store(), &dir, base.as_ref()) {
            Ok(r) => r,
            Err(_) if !self.index.read().contains_key(id) => return Ok(()),
            Err(e) => return Err(e),
        };
        let _pin = Pin::new(&**self.store(), images_root)?;
        let img_hex = images_root.to_hex();
        let done = SnapshotInfo {
            root: Some(record::root_hash(&info.fs_root, &img_hex, &info.spec)),
            images_root: img_hex,
            bytes_added: self.store().stored_bytes()?.saturating_sub(before),
            store_ms: t.elapsed().as_millis() as u64,
            durable: true,
            ..info
        };
        let _commit = self.imports.commit.lock();
        if !self.index.read().contains_key(id) {
            return Ok(());
        }
        self.commit_images(&done, &images_root)?;
        drop(_commit);
        self.trim_cache();
        tracing::info!(
            snapshot = id,
            store_ms = done.store_ms,
            bytes_added = done.bytes_added,
            "snapshot durable"
        );
        Ok(())
    }

    /// Snapshots (by id) whose background import failed, with the reason, until retried.
    pub fn import_failures(&self) -> HashMap<String, String> {
        self.imports
            .failed
            .lock()
            .iter()
            .map(|(id, e)| (id.clone(), nodefs::chain(&**e)))
            .collect()
    }

    /// Queues every failed import again (space may have come back); returns how many.
    pub fn retry_imports(&self) -> usize {
        let failed: Vec<String> = self
            .imports
            .failed
            .lock()
            .drain()
            .map(|(id, _)| id)
            .collect();
        for id in &failed {
            self.queue_import(id);
        }
        failed.len()
    }

    /// Waits (up to `limit`) until `snapshot`'s images are in the content store.
    pub fn wait_durable(&self, snapshot: &str, limit: Duration) -> Result<SnapshotInfo, Error> {
        let deadline = Instant::now() + limit;
        let mut g = self.imports.ended_lock.lock();
        loop {
            let info = self.get(snapshot)?;
            if info.durable {
                return Ok(info);
            }
            if let Some(e) = self.imports.failed.lock().get(&info.id) {
                return Err(Error::NotStored {
                    snapshot: info.id,
                    source: e.clone(),
                });
            }
            if self.imports.ended.wait_until(&mut g, deadline).timed_out() {
                return Err(Error::Conflict {
                    sandbox: info.source,
                    reason: format!(
                        "snapshot {} is still being stored after {} s",
                        info.id,
                        limit.as_secs()
                    ),
                });
            }
        }
    }
}
