//! Lifetimes of snapshots: a TTL given at snapshot time, lineage (a snapshot's parent is the snapshot
//! its source sandbox was forked from), and the deletes that follow from them — expiry, a delete with
//! descendants, and gc of snapshots nothing needs. A snapshot is needed while a sandbox forked from it
//! lives or a snapshot below it is kept: expiry waits for those.

pub use crate::events::now_ms;
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use grove_runtime::SandboxInfo;
use parking_lot::Mutex;

use crate::api_shapes::Snapshot;
use crate::app::App;
use crate::backend::Snapshots;
use crate::error::{ApiError, ApiResult};

/// The label a fork carries: the id of the snapshot it came from (set by the snapshotter).
pub const FORK_LABEL: &str = "grove.snapshot";

#[derive(Debug, thiserror::Error)]
pub enum TtlError {
    #[error("writing the snapshot TTLs {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// When each snapshot with a TTL expires (ms since the epoch), by snapshot id; kept in
/// `<state_dir>/snapshot-ttls.json` (written whole, atomically) so expiry survives a restart.
#[derive(Debug)]
pub struct SnapshotTtls {
    path: PathBuf,
    map: Mutex<BTreeMap<String, u64>>,
}

impl SnapshotTtls {
    pub fn open(state_dir: &Path) -> SnapshotTtls {
        let path = state_dir.join("snapshot-ttls.json");
        let map = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        SnapshotTtls {
            path,
            map: Mutex::new(map),
        }
    }

    pub fn get(&self, id: &str) -> Option<u64> {
        self.map.lock().get(id).copied()
    }

    /// Sets (or with None clears) a snapshot's expiry, on disk before it counts.
    pub fn set(&self, id: &str, expires_at_ms: Option<u64>) -> Result<(), TtlError> {
        let mut map = self.map.lock();
        let mut next = map.clone();
        match expires_at_ms {
            Some(t) => next.insert(id.to_string(), t),
            None => next.remove(id),
        };
        self.write(&next)?;
        *map = next;
        Ok(())
    }

    /// Forgets snapshots that are gone (a failed write only leaves stale ids, harmless).
    pub fn forget(&self, ids: &[String]) {
        if let Err(e) = self.forget_all(ids) {
            tracing::warn!("{}", crate::error::chain(&e));
        }
    }

    fn forget_all(&self, ids: &[String]) -> Result<(), TtlError> {
        let mut map = self.map.lock();
        if !ids.iter().any(|i| map.contains_key(i)) {
            return Ok(());
        }
        let mut next = map.clone();
        for i in ids {
            next.remove(i);
        }
        self.write(&next)?;
        *map = next;
        Ok(())
    }

    fn due(&self, now_ms: u64) -> HashSet<String> {
        let map = self.map.lock();
        map.iter()
            .filter(|(_, t)| **t <= now_ms)
            .map(|(id, _)| id.clone())
            .collect()
    }

    fn is_empty(&self) -> bool {
        self.map.lock().is_empty()
    }

    fn write(&self, map: &BTreeMap<String, u64>) -> Result<(), TtlError> {
        let err = |source| TtlError::Write {
            path: self.path.clone(),
            source,
        };
        let bytes = serde_json::to_vec(map).map_err(|e| err(e.into()))?;
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
            .and_then(|()| std::fs::rename(&tmp, &self.path))
            .map_err(err)
    }
}

/// The snapshot its source sandbox was forked from.
pub fn parent_of(s: &Snapshot) -> Option<&str> {
    s.labels.get(FORK_LABEL).map(String::as_str)
}

/// Fills in what the snapshotter does not know: the expiry and the parent.
pub fn decorate(app: &App, mut s: Snapshot) -> Snapshot {
    s.expires_at_ms = app.snapshot_ttls.get(&s.id);
    s.parent = parent_of(&s).map(str::to_string);
    s
}

/// `root` and every snapshot below it, deepest first (the order to delete them in).
pub fn with_descendants(all: &[Snapshot], root: &Snapshot) -> Vec<Snapshot> {
    let mut order = vec![root.clone()];
    let mut seen: HashSet<&str> = HashSet::from([root.id.as_str()]);
    let mut i = 0;
    while i < order.len() {
        let id = order[i].id.clone();
        for s in all {
            if parent_of(s) == Some(id.as_str()) && seen.insert(s.id.as_str()) {
                order.push(s.clone());
            }
        }
        i += 1;
    }
    order.reverse();
    order
}

/// Deletes those of `candidates` (ids) that nothing needs, leaves first, until none is left that
/// can go; returns the names deleted.
pub fn delete_unneeded(
    app: &App,
    snaps: &dyn Snapshots,
    sandboxes: &[SandboxInfo],
    candidates: &HashSet<String>,
) -> ApiResult<Vec<String>> {
    let mut all = snaps.list()?;
    let forked_from: HashSet<&str> = sandboxes
        .iter()
        .filter_map(|i| i.spec.labels.get(FORK_LABEL).map(String::as_str))
        .collect();
    let mut deleted = Vec::new();
    let mut gone_ids = Vec::new();
    loop {
        let next = all.iter().position(|s| {
            candidates.contains(&s.id)
                && !forked_from.contains(s.id.as_str())
                && !all.iter().any(|c| parent_of(c) == Some(s.id.as_str()))
        });
        let Some(i) = next else { break };
        let s = all.remove(i);
        match snaps.delete(&s.id).map_err(ApiError::from) {
            Ok(()) => {}
            // Someone else deleted it meanwhile: gone either way.
            Err(e) if e.status == axum::http::StatusCode::NOT_FOUND => {}
            Err(e) => {
                app.snapshot_ttls.forget(&gone_ids);
                return Err(e);
            }
        }
        app.emit(crate::events::own(
            "snapshot_deleted",
            None,
            Some(s.name.clone()),
            Some("unneeded".into()),
        ));
        gone_ids.push(s.id);
        deleted.push(s.name);
    }
    app.snapshot_ttls.forget(&gone_ids);
    Ok(deleted)
}

/// One reaper pass: expired snapshots that nothing needs are deleted.
pub async fn expire_snapshots(app: &Arc<App>) {
    let Some(snaps) = app.snapshots.clone() else {
        return;
    };
    if app.snapshot_ttls.is_empty() {
        return;
    }
    let due = app.snapshot_ttls.due(now_ms());
    if due.is_empty() {
        return;
    }
    let a = app.clone();
    let r = tokio::task::spawn_blocking(move || {
        let sandboxes = a.runtime.list();
        let known: HashSet<String> = snaps.list()?.into_iter().map(|s| s.id).collect();
        // Expiries of snapshots deleted some other way.
        let stale: Vec<String> = due
            .iter()
            .filter(|i| !known.contains(*i))
            .cloned()
            .collect();
        a.snapshot_ttls.forget(&stale);
        delete_unneeded(&a, &*snaps, &sandboxes, &due)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()));
    match r.and_then(|r| r) {
        Ok(names) if !names.is_empty() => {
            tracing::info!(count = names.len(), "expired snapshots deleted")
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e.message, "snapshot expiry"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(id: &str, parent: Option<&str>) -> Snapshot {
        Snapshot {
            id: id.into(),
            name: id.into(),
            source_sandbox: None,
            image: None,
            created_at_ms: 0,
            size_bytes: None,
            durable: true,
            labels: parent
                .map(|p| BTreeMap::from([(FORK_LABEL.to_string(), p.to_string())]))
                .unwrap_or_default(),
            error: None,
            expires_at_ms: None,
            parent: None,
            memory_dump: None,
            full_dump_reason: None,
        }
    }

    #[test]
    fn descendants_come_deepest_first() {
        let all = vec![
            snap("a", None),
            snap("b", Some("a")),
            snap("c", Some("b")),
            snap("d", Some("a")),
            snap("x", None),
        ];
        let order: Vec<_> = with_descendants(&all, &all[0])
            .into_iter()
            .map(|s| s.id)
            .collect();
        assert_eq!(order.len(), 4);
        assert_eq!(order.last().map(String::as_str), Some("a"));
        let pos = |id: &str| order.iter().position(|o| o == id).unwrap();
        assert!(pos("c") < pos("b"));
        assert!(!order.contains(&"x".to_string()));
    }
}
