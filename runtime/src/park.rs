//! Snapshot-based pause: `park` destroys a sandbox but keeps its id (state `Paused`);
//! `create_restored_as` brings it back under the same id from a CRIU restore (`Paused` → `Running`).

use crate::error::Error;
use crate::registry::SlotState;
use crate::runtime::{RestoreFn, Runtime};
use crate::types::{EventKind, SandboxId, SandboxInfo, SandboxSpec};

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
    pub fn register_parked(&self, info: SandboxInfo) -> Result<(), Error> {
        let id = info.id.clone();
        self.registry
            .register_parked(info)
            .map_err(|e| Error::Conflict {
                id,
                reason: format!(
                    "sandbox is known already ({e}); only an unknown id can be adopted as parked"
                ),
            })
    }

    /// Drops a parked record; false when `id` was not parked.
    pub(crate) fn forget_parked(&self, id: &SandboxId, kind: EventKind) -> bool {
        let gone = self.registry.forget_parked(id).is_ok();
        if gone {
            self.emit(id, kind, None);
        }
        gone
    }

    /// Parked sandboxes past their time-to-live are forgotten (event `expired`).
    pub(crate) fn expire_parked(&self, now: u64) -> Vec<SandboxId> {
        let due = self.registry.expired(&[SlotState::Parked], now);
        due.into_iter()
            .filter(|id| self.forget_parked(id, EventKind::Expired))
            .collect()
    }
}
