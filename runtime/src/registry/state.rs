//! The states of a registry slot and the named transitions between them: one table (`edge`)
//! says which are legal, and the registry refuses the rest with a `TransitionError`.

use std::fmt;

use crate::types::{SandboxId, SandboxState};

/// Where a sandbox id stands in the runtime. "Paused" is three of them: `Frozen` (a frozen
/// cgroup, memory kept), `Parked` (nothing on the host, its image in the store), and the two
/// in-transit states between (`Parking`, `Restoring`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SlotState {
    /// Id reserved while a create (cold, restored or pooled hand-over) or a pool build/teardown
    /// makes or removes its parts; not shown.
    Creating,
    Running,
    /// Its cgroup is frozen: the processes keep their memory.
    Frozen,
    /// Live but broken (its init died, its root was lost): shown `failed` until destroyed.
    Failed,
    /// Being reclaimed by a destroy; not shown (a destroy has begun: the id is gone for clients).
    Destroying,
    /// In transit to `Parked`: reclaimed after the snapshotter dumped it. Shown `paused`.
    Parking,
    /// Paused to the store: nothing on the host, the id kept. Shown `paused`.
    Parked,
    /// In transit from `Parked`: a restore is bringing it back. Shown `paused`.
    Restoring,
    /// Found dead by a restart: reclaimed, shown `failed` until destroyed.
    Lost,
}

impl SlotState {
    pub const ALL: [SlotState; 9] = [
        SlotState::Creating,
        SlotState::Running,
        SlotState::Frozen,
        SlotState::Failed,
        SlotState::Destroying,
        SlotState::Parking,
        SlotState::Parked,
        SlotState::Restoring,
        SlotState::Lost,
    ];

    /// The state clients see (`get`/`list`); None: the id is not shown (404).
    pub fn shown(self) -> Option<SandboxState> {
        match self {
            SlotState::Creating | SlotState::Destroying => None,
            SlotState::Running => Some(SandboxState::Running),
            SlotState::Frozen | SlotState::Parking | SlotState::Parked | SlotState::Restoring => {
                Some(SandboxState::Paused)
            }
            SlotState::Failed | SlotState::Lost => Some(SandboxState::Failed),
        }
    }

    /// Paused in any of its three ways: the next request inside it resumes it.
    pub fn is_paused(self) -> bool {
        self.shown() == Some(SandboxState::Paused)
    }

    /// Moving between frozen/running and parked: wait for it to land.
    pub fn in_transit(self) -> bool {
        matches!(self, SlotState::Parking | SlotState::Restoring)
    }

    /// Its processes, cgroups, root or run dir may exist on the host (residue is judged against
    /// these ids; a shutdown leaves its cgroup parents while any remains).
    pub fn on_host(self) -> bool {
        !matches!(self, SlotState::Parked | SlotState::Lost)
    }
}

impl fmt::Display for SlotState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            SlotState::Creating => "being created",
            SlotState::Running => "running",
            SlotState::Frozen => "frozen",
            SlotState::Failed => "failed",
            SlotState::Destroying => "being destroyed",
            SlotState::Parking => "being paused to the store",
            SlotState::Parked => "paused to the store",
            SlotState::Restoring => "being restored from the store",
            SlotState::Lost => "lost",
        };
        f.write_str(s)
    }
}

/// One named step of the state machine. `None` in an edge is "no slot": the id unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transition {
    /// An unused id taken for a create or a pool sandbox.
    Reserve,
    /// A create's commit point: its sandbox joins the live ones.
    Create,
    /// A create (or a pool build/teardown) gave its id up.
    Abandon,
    Freeze,
    Thaw,
    /// Its init died or its root was lost.
    Fail,
    Destroy,
    /// A destroy or a park whose reclaim failed: the id is forgotten.
    Finish,
    Park,
    /// A park's reclaim is done.
    Parked,
    /// A resume from the store begins.
    Unpark,
    Restored,
    /// The restore failed: still parked, to retry or destroy.
    RestoreFailed,
    /// A pause record of an earlier run, registered at start.
    RegisterParked,
    ForgetParked,
    /// A restart adopts a recorded live sandbox.
    Adopt,
    /// A restart found a recorded sandbox dead.
    Lose,
    ForgetLost,
}

impl Transition {
    pub const ALL: [Transition; 18] = [
        Transition::Reserve,
        Transition::Create,
        Transition::Abandon,
        Transition::Freeze,
        Transition::Thaw,
        Transition::Fail,
        Transition::Destroy,
        Transition::Finish,
        Transition::Park,
        Transition::Parked,
        Transition::Unpark,
        Transition::Restored,
        Transition::RestoreFailed,
        Transition::RegisterParked,
        Transition::ForgetParked,
        Transition::Adopt,
        Transition::Lose,
        Transition::ForgetLost,
    ];

    /// The states this transition leaves, and the one it enters.
    pub fn edge(self) -> (&'static [Option<SlotState>], Option<SlotState>) {
        use SlotState as S;
        const LIVE: &[Option<SlotState>] = &[
            Some(SlotState::Running),
            Some(SlotState::Frozen),
            Some(SlotState::Failed),
        ];
        match self {
            Transition::Reserve => (&[None], Some(S::Creating)),
            Transition::Create => (&[Some(S::Creating)], Some(S::Running)),
            Transition::Abandon => (&[Some(S::Creating)], None),
            Transition::Freeze => (&[Some(S::Running)], Some(S::Frozen)),
            Transition::Thaw => (&[Some(S::Frozen)], Some(S::Running)),
            Transition::Fail => (&[Some(S::Running), Some(S::Frozen)], Some(S::Failed)),
            Transition::Destroy => (LIVE, Some(S::Destroying)),
            Transition::Finish => (&[Some(S::Destroying), Some(S::Parking)], None),
            Transition::Park => (&[Some(S::Running), Some(S::Frozen)], Some(S::Parking)),
            Transition::Parked => (&[Some(S::Parking)], Some(S::Parked)),
            Transition::Unpark => (&[Some(S::Parked)], Some(S::Restoring)),
            Transition::Restored => (&[Some(S::Restoring)], Some(S::Running)),
            Transition::RestoreFailed => (&[Some(S::Restoring)], Some(S::Parked)),
            Transition::RegisterParked => (&[None], Some(S::Parked)),
            Transition::ForgetParked => (&[Some(S::Parked)], None),
            Transition::Adopt => (&[None], Some(S::Running)),
            Transition::Lose => (&[None], Some(S::Lost)),
            Transition::ForgetLost => (&[Some(S::Lost)], None),
        }
    }

    pub fn legal_from(self, from: Option<SlotState>) -> bool {
        self.edge().0.contains(&from)
    }
}

impl fmt::Display for Transition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A transition the state machine does not have from where the slot is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// The id has no slot, and `transition` needs one.
    #[error("sandbox {id} is unknown (cannot {transition})")]
    Unknown {
        id: SandboxId,
        transition: Transition,
    },
    /// The slot is in a state `transition` does not leave (`Reserve`/`Register…`/`Adopt`/`Lose`
    /// of an id that has a slot land here too).
    #[error("sandbox {id} is {state} (cannot {transition})")]
    Illegal {
        id: SandboxId,
        state: SlotState,
        transition: Transition,
    },
    /// The slot holds another sandbox under the same id than the caller's (it was destroyed and
    /// its id reused meanwhile): the caller's is not there any more.
    #[error("sandbox {id} was replaced (cannot {transition})")]
    Replaced {
        id: SandboxId,
        transition: Transition,
    },
}

impl TransitionError {
    /// The state the slot was in; None if the id had none.
    pub fn state(&self) -> Option<SlotState> {
        match self {
            TransitionError::Illegal { state, .. } => Some(*state),
            _ => None,
        }
    }
}
