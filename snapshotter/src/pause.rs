//! Pause to the store: a paused sandbox costs disk, not memory. `pause` dumps the sandbox
//! (frozen throughout, so nothing diverges from the dump), stores the images and the root,
//! writes a pause record, then parks it in the runtime (every process and host resource gone,
//! the id kept as `Paused`). `resume` restores it in place under the same id and drops the
//! record. The record is durable: after a daemon crash the sandbox is adopted as parked again.

use std::sync::{Arc, Weak};
use std::time::Instant;

use grove_runtime::{EventKind, SandboxId, SandboxInfo};
use serde::Serialize;

use crate::error::Error;
use crate::images;
use crate::record::{self, SnapshotInfo};
use crate::snapshotter::{now_ms, parse_manifest, Pin, Snapshotter};

/// Where a pause or resume spent its time (milliseconds).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PauseTiming {
    /// Frozen while CRIU dumped and the root was committed (pause), or the restore (resume).
    pub criu_ms: u64,
    /// Page images into the content store (pause) or materialized from it (resume).
    pub store_ms: u64,
    /// Host resources reclaimed (pause) — included in `total_ms`.
    pub park_ms: u64,
    pub total_ms: u64,
}

impl Snapshotter {
    /// Pauses a running (or frozen) sandbox to the store. On failure before the park the
    /// sandbox is thawed and keeps running as it was; nothing is recorded.
    pub fn pause(&self, sandbox: &SandboxId) -> Result<(SandboxInfo, PauseTiming), Error> {
        let t0 = Instant::now();
        let _busy = self.claim(sandbox)?;
        let view = self.runtime().checkpoint_view(sandbox)?;
        if view.veth_host.is_some() {
            return Err(Error::Unsupported {
                what: format!(
                    "pause to the store of {sandbox}: its egress veth is not checkpointed yet"
                ),
            });
        }
        let mut cap = self.capture(sandbox, true)?;
        // Its processes end with the park; a resumed sandbox is tracked afresh.
        self.forget_tracking(sandbox);
        // Imported at once below: an incremental dump is made whole first.
        if crate::snapshotter::has_parent(&cap.images_dir) {
            crate::snapshotter::make_whole(&cap.images_dir)
                .map_err(|e| Error::io(&cap.images_dir, e))?;
        }
        let t_store = Instant::now();
        let base = self.images_base(sandbox.as_str(), &cap.spec, now_ms(), None);
        let images_root = images::import(&**self.store(), &cap.images_dir, base.as_ref())?;
        let _pins = [
            Pin::new(&**self.store(), images_root)?,
            Pin::new(&**self.store(), cap.fs_root)?,
        ];
        let store_ms = t_store.elapsed().as_millis() as u64;
        let (fs_hex, img_hex) = (cap.fs_root.to_hex(), images_root.to_hex());
        let at = now_ms();
        let mut parked = self.runtime().get(sandbox)?;
        let info = SnapshotInfo {
            id: record::pause_hash(sandbox.as_str(), &fs_hex, &img_hex, at),
            name: None,
            source: sandbox.to_string(),
            created_at_ms: at,
            fs_root: fs_hex,
            images_root: img_hex,
            spec: cap.spec.clone(),
            dump_ms: cap.dump_ms,
            bytes_added: 0,
            store_ms,
            root: None,
            durable: true,
            paused: None,
            memory_dump: cap.memory_dump,
            full_dump_reason: cap.full_dump_reason.clone(),
        };
        parked.init_pid = None;
        parked.address = None;
        let info = SnapshotInfo {
            paused: Some(parked),
            ..info
        };
        self.commit_record(&info, &cap.fs_root, &images_root)?;
        // From here the record is the sandbox: it stays frozen until the park removes it.
        cap.release();
        self.cache.take_best_effort(&info.id, &cap.images_dir);
        let t_park = Instant::now();
        let parked = self.runtime().park(sandbox)?;
        let timing = PauseTiming {
            criu_ms: cap.dump_ms,
            store_ms,
            park_ms: t_park.elapsed().as_millis() as u64,
            total_ms: t0.elapsed().as_millis() as u64,
        };
        tracing::info!(%sandbox, record = %info.id, ?timing, "paused to the store");
        Ok((parked, timing))
    }

    /// Brings a sandbox paused to the store back under its id, from the exact state of the
    /// pause. If the restore fails it stays paused (retry or destroy it).
    pub fn resume(&self, sandbox: &SandboxId) -> Result<(SandboxInfo, PauseTiming), Error> {
        let t0 = Instant::now();
        let _busy = self.claim(sandbox)?;
        let info = self.pause_record(sandbox).ok_or_else(|| Error::Conflict {
            sandbox: sandbox.to_string(),
            reason: "not paused to the store".into(),
        })?;
        let images_root = parse_manifest(&info.images_root, "images root")?;
        let t_store = Instant::now();
        let images = self.cache.get(&**self.store(), &info.id, &images_root)?;
        let store_ms = t_store.elapsed().as_millis() as u64;
        let mut spec = info.spec.clone();
        spec.image = info.fs_root.clone();
        let t_restore = Instant::now();
        let back = self.restore_as(sandbox, spec, &images)?;
        let criu_ms = t_restore.elapsed().as_millis() as u64;
        self.drop_record(&info);
        let timing = PauseTiming {
            criu_ms,
            store_ms,
            park_ms: 0,
            total_ms: t0.elapsed().as_millis() as u64,
        };
        tracing::info!(%sandbox, ?timing, "resumed from the store");
        Ok((back, timing))
    }

    /// Whether `sandbox` is paused to the store (has a pause record).
    pub fn is_paused(&self, sandbox: &SandboxId) -> bool {
        self.pause_record(sandbox).is_some()
    }

    pub(crate) fn pause_record(&self, sandbox: &SandboxId) -> Option<SnapshotInfo> {
        self.index
            .read()
            .values()
            .find(|s| s.paused.as_ref().is_some_and(|p| &p.id == sandbox))
            .cloned()
    }

    /// Record, refs and materialized images of a pause; its chunks go with the next gc.
    fn drop_record(&self, info: &SnapshotInfo) {
        if let Err(e) = self.delete_by_id(&info.id) {
            tracing::warn!(record = %info.id, error = %e, "pause record left behind");
        }
    }

    /// At start: sandboxes paused by an earlier run are parked in the runtime again.
    pub(crate) fn register_paused(&self) {
        let paused: Vec<SandboxInfo> = self
            .index
            .read()
            .values()
            .filter_map(|s| s.paused.clone())
            .collect();
        for p in paused {
            let id = p.id.clone();
            if let Err(e) = self.runtime().register_parked(p) {
                tracing::warn!(sandbox = %id, error = %e, "paused sandbox not adopted");
            }
        }
    }

    /// Drops the pause record of a sandbox the runtime destroyed or expired while parked.
    /// Runs on its own thread until the runtime goes away.
    pub(crate) fn watch_parked(self: &Arc<Self>) {
        let events = self.runtime().subscribe();
        let me: Weak<Snapshotter> = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("grove-pause-gc".into())
            .spawn(move || {
                for ev in events {
                    if !matches!(ev.kind, EventKind::Destroyed | EventKind::Expired) {
                        continue;
                    }
                    let Some(s) = me.upgrade() else { return };
                    s.forget_tracking(&ev.sandbox);
                    if let Some(info) = s.pause_record(&ev.sandbox) {
                        s.drop_record(&info);
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "no pause-record watcher: records of destroyed paused sandboxes stay until restart");
        }
    }
}
