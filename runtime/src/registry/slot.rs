//! One sandbox id's slot: its state with what that state holds, so a live state always has
//! its sandbox and a parked one its last shown info.

use crate::record::LostRecord;
use crate::types::{SandboxInfo, SandboxState};

use super::SlotState;

/// What the registry holds of a live sandbox (`Arc<Sandbox>` in the runtime; fakes in tests).
pub(crate) trait Occupant: Clone {
    /// Its info, showing `state`.
    fn info(&self, state: SandboxState) -> SandboxInfo;
    /// The same sandbox (not another one made under the same id since).
    fn same(&self, other: &Self) -> bool;
    fn expires_at_ms(&self) -> Option<u64>;
}

pub(crate) enum Slot<S> {
    Creating,
    Running(S),
    Frozen(S),
    Failed(S),
    Destroying,
    /// The info it shows meanwhile (`paused`, no pid or address).
    Parking(SandboxInfo),
    Parked(SandboxInfo),
    Restoring(SandboxInfo),
    Lost(LostRecord),
}

impl<S: Occupant> Slot<S> {
    pub(crate) fn state(&self) -> SlotState {
        match self {
            Slot::Creating => SlotState::Creating,
            Slot::Running(_) => SlotState::Running,
            Slot::Frozen(_) => SlotState::Frozen,
            Slot::Failed(_) => SlotState::Failed,
            Slot::Destroying => SlotState::Destroying,
            Slot::Parking(_) => SlotState::Parking,
            Slot::Parked(_) => SlotState::Parked,
            Slot::Restoring(_) => SlotState::Restoring,
            Slot::Lost(_) => SlotState::Lost,
        }
    }

    /// The live sandbox (running, frozen or failed), if this slot holds one.
    pub(crate) fn occupant(&self) -> Option<&S> {
        match self {
            Slot::Running(s) | Slot::Frozen(s) | Slot::Failed(s) => Some(s),
            _ => None,
        }
    }

    /// What `get` shows; None for the states clients do not see.
    pub(crate) fn info(&self) -> Option<SandboxInfo> {
        let shown = self.state().shown()?;
        match self {
            Slot::Running(s) | Slot::Frozen(s) | Slot::Failed(s) => Some(s.info(shown)),
            Slot::Parking(i) | Slot::Parked(i) | Slot::Restoring(i) => Some(i.clone()),
            Slot::Lost(l) => Some(l.info.clone()),
            Slot::Creating | Slot::Destroying => None,
        }
    }

    /// When it expires, for the states a TTL reaps.
    pub(crate) fn expires_at_ms(&self) -> Option<u64> {
        match self {
            Slot::Running(s) | Slot::Frozen(s) | Slot::Failed(s) => s.expires_at_ms(),
            Slot::Parked(i) => i.expires_at_ms,
            Slot::Lost(l) => l.info.expires_at_ms,
            _ => None,
        }
    }
}

/// How a sandbox shows while it has no processes (parking, parked, restoring).
pub(crate) fn paused_info(mut info: SandboxInfo) -> SandboxInfo {
    info.state = SandboxState::Paused;
    info.init_pid = None;
    info.address = None;
    info
}
