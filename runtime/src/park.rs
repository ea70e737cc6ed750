//! Snapshot-based pause: `park` destroys a sandbox but keeps its id (state `Paused`);
//! `create_restored_as` brings it back under the same id from a CRIU restore (`Paused` → `Running`).

use crate::error::Error;
use crate::runtime::{RestoreFn, Runtime};
use crate::types::{EventKind, SandboxId, SandboxInfo, SandboxSpec, SandboxState};

impl Runtime {
    /// Destroys a sandbox for a snapshot-based pause, after the snapshotter has dumped it: every
    /// host resource is reclaimed (and its capacity released) as by `destroy`, but the id stays
    /// reserved in state `Paused` — `get`/`list` show it, exec and files answer Conflict, no create
    /// can take the id — until `create_restored_as` brings it back or `destroy` forgets it.
    /// Emits `paused`. A frozen (`pause`d) sandbox may be parked too.
    pub fn park(&self, id: &SandboxId) -> Result<SandboxInfo, Error> {
        self.destroy_with(id, EventKind::Paused)?;
        self.get(id)
    }

    /// `create_restored` under a parked id: the way back from `park` (or `register_parked` after a
    /// daemon restart): `Paused` → `Running`, `created_at_ms` kept, event `resumed`. Conflict if the
    /// id is live or being created/destroyed; NotFound if it is not parked — in particular when a
    /// destroy won the race against this resume, which must not bring the sandbox back. If the
    /// restore fails the sandbox stays parked so the caller can retry or destroy it; nothing else
    /// is left.
    pub fn create_restored_as(
        &self,
        id: SandboxId,
        spec: SandboxSpec,
        restore: &mut RestoreFn<'_>,
    ) -> Result<SandboxInfo, Error> {
        self.create_inner(spec, Some(restore), Some(id))
    }

    /// Registers a sandbox parked by an earlier run of this node (its pause record survived a
    /// daemon restart): it shows as `Paused` and `create_restored_as` can bring it back.
    /// Conflict if the id is known already.
    pub fn register_parked(&self, mut info: SandboxInfo) -> Result<(), Error> {
        let live = self.sandboxes.lock();
        let pending = self.pending.lock();
        let mut parked = self.parked.lock();
        if live.contains_key(&info.id)
            || pending.contains(&info.id)
            || parked.contains_key(&info.id)
        {
            return Err(Error::Conflict {
                id: info.id.clone(),
                reason: "sandbox is known already; only an unknown id can be adopted as parked"
                    .into(),
            });
        }
        info.state = SandboxState::Paused;
        info.init_pid = None;
        info.address = None;
        parked.insert(info.id.clone(), info);
        Ok(())
    }

    /// Reserves `id` for a create (in `pending`) and takes its parked record.
    pub(crate) fn claim_parked(&self, id: &SandboxId) -> Result<SandboxInfo, Error> {
        let live = self.sandboxes.lock();
        let mut pending = self.pending.lock();
        if live.contains_key(id) || pending.contains(id) {
            let state = live
                .get(id)
                .map(|s| *s.state.lock())
                .unwrap_or(SandboxState::Creating);
            return Err(Error::Conflict {
                id: id.clone(),
                reason: format!("sandbox exists ({state:?}); only a parked id can be restored as"),
            });
        }
        let parked = self
            .parked
            .lock()
            .remove(id)
            .ok_or_else(|| Error::NotFound { id: id.to_string() })?;
        pending.insert(id.clone());
        self.transit.lock().insert(id.clone(), parked.clone());
        Ok(parked)
    }

    /// Drops a parked record; false when `id` was not parked.
    pub(crate) fn forget_parked(&self, id: &SandboxId, kind: EventKind) -> bool {
        let gone = self.parked.lock().remove(id).is_some();
        if gone {
            self.emit(id, kind, None);
        }
        gone
    }

    /// Parked sandboxes past their time-to-live are forgotten (event `expired`).
    pub(crate) fn expire_parked(&self, now: u64) -> Vec<SandboxId> {
        let due: Vec<SandboxId> = self
            .parked
            .lock()
            .values()
            .filter(|i| i.expires_at_ms.is_some_and(|t| t <= now))
            .map(|i| i.id.clone())
            .collect();
        due.into_iter()
            .filter(|id| self.forget_parked(id, EventKind::Expired))
            .collect()
    }
}
