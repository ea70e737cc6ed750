//! The sandbox registry: every id the runtime knows, in one map under one lock, each in one
//! explicit state (`SlotState`) that changes only by a named transition (`state::Transition`).
//! `get` and `list` read that one map, so no sandbox is ever seen twice or missing while it
//! moves between states, and a transition from the wrong state is a `TransitionError`.
//!
//! ```text
//!                Reserve              Create              Freeze
//!    (none) ─────────────▶ Creating ─────────▶ Running ◀─────────▶ Frozen
//!       ▲        Abandon      │       Adopt ──▶   │   ▲     Thaw      │
//!       └─────────────────────┘   (a restart)     │   │               │
//!                                   Fail ─────────┴───┼───────────────┴──▶ Failed
//!                                                     │ Restored
//!    Destroy: Running|Frozen|Failed ─▶ Destroying ─Finish─▶ (none)
//!    Park:    Running|Frozen ─▶ Parking ─Parked─▶ Parked ─Unpark─▶ Restoring ─Restored─▶ Running
//!                                  │ Finish         ▲  ▲    RestoreFailed  │
//!                                  ▼ (reclaim       │  └───────────────────┘
//!                                (none)  failed)    RegisterParked (a restart) from (none)
//!                                                   Parked ─ForgetParked─▶ (none)
//!    Lose (a restart): (none) ─▶ Lost ─ForgetLost─▶ (none)
//! ```
//!
//! Lock order: the registry before the pools' lock (a pooled sandbox is taken from its pool and
//! reserved here in one step, `Registry::with`). Nothing slow runs under it but the small record
//! writes of `persist`.

mod slot;
mod state;
#[cfg(test)]
mod tests;

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::record::LostRecord;
use crate::types::{SandboxId, SandboxInfo};

pub(crate) use slot::{paused_info, Occupant, Slot};
pub use state::{SlotState, Transition, TransitionError};

pub(crate) struct Registry<S> {
    slots: Mutex<Slots<S>>,
}

impl<S: Occupant> Default for Registry<S> {
    fn default() -> Self {
        Registry {
            slots: Mutex::new(Slots {
                map: HashMap::new(),
            }),
        }
    }
}

impl<S: Occupant> Registry<S> {
    /// Several transitions (or a transition and a pool operation) as one atomic step.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut Slots<S>) -> R) -> R {
        f(&mut self.slots.lock())
    }

    pub(crate) fn state(&self, id: &SandboxId) -> Option<SlotState> {
        self.slots.lock().map.get(id).map(Slot::state)
    }

    /// Reads a slot under the lock.
    pub(crate) fn peek<R>(&self, id: &SandboxId, f: impl FnOnce(Option<&Slot<S>>) -> R) -> R {
        f(self.slots.lock().map.get(id))
    }

    /// What clients see of `id`; None when it is not shown (unknown, being created or destroyed).
    pub(crate) fn get(&self, id: &SandboxId) -> Option<SandboxInfo> {
        self.slots.lock().map.get(id).and_then(Slot::info)
    }

    /// Every shown sandbox, oldest first.
    pub(crate) fn list(&self) -> Vec<SandboxInfo> {
        let mut v: Vec<SandboxInfo> = self
            .slots
            .lock()
            .map
            .values()
            .filter_map(Slot::info)
            .collect();
        v.sort_by_key(|i| i.created_at_ms);
        v
    }

    /// The live sandboxes (running, frozen, failed) with their state.
    pub(crate) fn live(&self) -> Vec<(S, SlotState)> {
        let slots = self.slots.lock();
        slots
            .map
            .values()
            .filter_map(|s| s.occupant().map(|o| (o.clone(), s.state())))
            .collect()
    }

    /// The ids in `states`.
    pub(crate) fn ids_in(&self, states: &[SlotState]) -> Vec<SandboxId> {
        let slots = self.slots.lock();
        slots
            .map
            .iter()
            .filter(|(_, s)| states.contains(&s.state()))
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The ids in `states` whose time-to-live ended by `now`.
    pub(crate) fn expired(&self, states: &[SlotState], now: u64) -> Vec<SandboxId> {
        let slots = self.slots.lock();
        slots
            .map
            .iter()
            .filter(|(_, s)| states.contains(&s.state()))
            .filter(|(_, s)| s.expires_at_ms().is_some_and(|t| t <= now))
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// A fresh id, reserved (`Creating`).
    pub(crate) fn reserve_fresh(&self) -> SandboxId {
        let mut slots = self.slots.lock();
        loop {
            let id = SandboxId::generate();
            if slots.reserve(&id).is_ok() {
                return id;
            }
        }
    }

    pub(crate) fn abandon(&self, id: &SandboxId) -> Result<(), TransitionError> {
        self.slots.lock().abandon(id)
    }

    pub(crate) fn create(&self, id: &SandboxId, sb: S) -> Result<(), TransitionError> {
        self.slots.lock().create(id, sb)
    }

    pub(crate) fn freeze(&self, id: &SandboxId, sb: &S) -> Result<(), TransitionError> {
        self.slots.lock().freeze(id, sb)
    }

    pub(crate) fn thaw(&self, id: &SandboxId, sb: &S) -> Result<(), TransitionError> {
        self.slots.lock().thaw(id, sb)
    }

    pub(crate) fn fail(&self, id: &SandboxId, sb: &S) -> Result<(), TransitionError> {
        self.slots.lock().fail(id, sb)
    }

    pub(crate) fn destroy(&self, id: &SandboxId) -> Result<S, TransitionError> {
        self.slots.lock().destroy(id)
    }

    pub(crate) fn park(&self, id: &SandboxId) -> Result<S, TransitionError> {
        self.slots.lock().park(id)
    }

    pub(crate) fn parked(&self, id: &SandboxId) -> Result<SandboxInfo, TransitionError> {
        self.slots.lock().parked(id)
    }

    pub(crate) fn finish(&self, id: &SandboxId) -> Result<(), TransitionError> {
        self.slots.lock().finish(id)
    }

    pub(crate) fn unpark(&self, id: &SandboxId) -> Result<SandboxInfo, TransitionError> {
        self.slots.lock().unpark(id)
    }

    pub(crate) fn restored(&self, id: &SandboxId, sb: S) -> Result<(), TransitionError> {
        self.slots.lock().restored(id, sb)
    }

    pub(crate) fn restore_failed(&self, id: &SandboxId) -> Result<(), TransitionError> {
        self.slots.lock().restore_failed(id)
    }

    pub(crate) fn register_parked(&self, info: SandboxInfo) -> Result<(), TransitionError> {
        self.slots.lock().register_parked(info)
    }

    pub(crate) fn forget_parked(&self, id: &SandboxId) -> Result<SandboxInfo, TransitionError> {
        self.slots.lock().forget_parked(id)
    }

    pub(crate) fn lose(&self, lost: LostRecord) -> Result<(), TransitionError> {
        self.slots.lock().lose(lost)
    }

    pub(crate) fn forget_lost(&self, id: &SandboxId) -> Result<LostRecord, TransitionError> {
        self.slots.lock().forget_lost(id)
    }
}

/// The map behind the lock; its methods are the transitions.
pub(crate) struct Slots<S> {
    map: HashMap<SandboxId, Slot<S>>,
}

impl<S: Occupant> Slots<S> {
    /// Checks `t` is legal from where `id` is (and, with `who`, that the slot holds that
    /// sandbox), then replaces the slot with what `next` makes of the old one. `next` must land
    /// in `t`'s target state.
    fn apply<R>(
        &mut self,
        id: &SandboxId,
        t: Transition,
        who: Option<&S>,
        next: impl FnOnce(Option<Slot<S>>) -> (Option<Slot<S>>, R),
    ) -> Result<R, TransitionError> {
        let slot = self.map.get(id);
        let from = slot.map(Slot::state);
        if !t.legal_from(from) {
            return Err(match from {
                None => TransitionError::Unknown {
                    id: id.clone(),
                    transition: t,
                },
                Some(state) => TransitionError::Illegal {
                    id: id.clone(),
                    state,
                    transition: t,
                },
            });
        }
        if let Some(who) = who {
            if !slot.and_then(Slot::occupant).is_some_and(|o| o.same(who)) {
                return Err(TransitionError::Replaced {
                    id: id.clone(),
                    transition: t,
                });
            }
        }
        let (new, out) = next(self.map.remove(id));
        debug_assert_eq!(new.as_ref().map(Slot::state), t.edge().1, "{t}");
        if let Some(new) = new {
            self.map.insert(id.clone(), new);
        }
        Ok(out)
    }

    /// The live sandbox of a slot `apply` has checked.
    fn take(old: Option<Slot<S>>) -> S {
        match old {
            Some(Slot::Running(s) | Slot::Frozen(s) | Slot::Failed(s)) => s,
            _ => unreachable!("the transition's edge admits live slots only"),
        }
    }

    fn info_of(old: Option<Slot<S>>) -> SandboxInfo {
        match old {
            Some(Slot::Parking(i) | Slot::Parked(i) | Slot::Restoring(i)) => i,
            _ => unreachable!("the transition's edge admits parked slots only"),
        }
    }

    pub(crate) fn get(&self, id: &SandboxId) -> Option<&Slot<S>> {
        self.map.get(id)
    }

    /// Every id whose parts may be on the host (see `SlotState::on_host`).
    pub(crate) fn on_host(&self) -> impl Iterator<Item = &SandboxId> {
        self.map
            .iter()
            .filter(|(_, s)| s.state().on_host())
            .map(|(id, _)| id)
    }

    pub(crate) fn reserve(&mut self, id: &SandboxId) -> Result<(), TransitionError> {
        self.apply(id, Transition::Reserve, None, |_| {
            (Some(Slot::Creating), ())
        })
    }

    pub(crate) fn abandon(&mut self, id: &SandboxId) -> Result<(), TransitionError> {
        self.apply(id, Transition::Abandon, None, |_| (None, ()))
    }

    pub(crate) fn create(&mut self, id: &SandboxId, sb: S) -> Result<(), TransitionError> {
        self.apply(id, Transition::Create, None, |_| {
            (Some(Slot::Running(sb)), ())
        })
    }

    pub(crate) fn freeze(&mut self, id: &SandboxId, sb: &S) -> Result<(), TransitionError> {
        self.apply(id, Transition::Freeze, Some(sb), |old| {
            (Some(Slot::Frozen(Self::take(old))), ())
        })
    }

    pub(crate) fn thaw(&mut self, id: &SandboxId, sb: &S) -> Result<(), TransitionError> {
        self.apply(id, Transition::Thaw, Some(sb), |old| {
            (Some(Slot::Running(Self::take(old))), ())
        })
    }

    pub(crate) fn fail(&mut self, id: &SandboxId, sb: &S) -> Result<(), TransitionError> {
        self.apply(id, Transition::Fail, Some(sb), |old| {
            (Some(Slot::Failed(Self::take(old))), ())
        })
    }

    /// Running, frozen or failed → `Destroying`; the sandbox is the caller's to reclaim.
    pub(crate) fn destroy(&mut self, id: &SandboxId) -> Result<S, TransitionError> {
        self.apply(id, Transition::Destroy, None, |old| {
            (Some(Slot::Destroying), Self::take(old))
        })
    }

    /// Running or frozen → `Parking`, shown paused; the sandbox is the caller's to reclaim.
    pub(crate) fn park(&mut self, id: &SandboxId) -> Result<S, TransitionError> {
        self.apply(id, Transition::Park, None, |old| {
            let sb = Self::take(old);
            let info = paused_info(sb.info(crate::types::SandboxState::Paused));
            (Some(Slot::Parking(info)), sb)
        })
    }

    /// `Parking` → `Parked`; returns what it shows.
    pub(crate) fn parked(&mut self, id: &SandboxId) -> Result<SandboxInfo, TransitionError> {
        self.apply(id, Transition::Parked, None, |old| {
            let info = Self::info_of(old);
            (Some(Slot::Parked(info.clone())), info)
        })
    }

    pub(crate) fn finish(&mut self, id: &SandboxId) -> Result<(), TransitionError> {
        self.apply(id, Transition::Finish, None, |_| (None, ()))
    }

    /// `Parked` → `Restoring`; returns the parked info.
    pub(crate) fn unpark(&mut self, id: &SandboxId) -> Result<SandboxInfo, TransitionError> {
        self.apply(id, Transition::Unpark, None, |old| {
            let info = Self::info_of(old);
            (Some(Slot::Restoring(info.clone())), info)
        })
    }

    pub(crate) fn restored(&mut self, id: &SandboxId, sb: S) -> Result<(), TransitionError> {
        self.apply(id, Transition::Restored, None, |_| {
            (Some(Slot::Running(sb)), ())
        })
    }

    pub(crate) fn restore_failed(&mut self, id: &SandboxId) -> Result<(), TransitionError> {
        self.apply(id, Transition::RestoreFailed, None, |old| {
            (Some(Slot::Parked(Self::info_of(old))), ())
        })
    }

    pub(crate) fn register_parked(&mut self, info: SandboxInfo) -> Result<(), TransitionError> {
        let id = info.id.clone();
        self.apply(&id, Transition::RegisterParked, None, |_| {
            (Some(Slot::Parked(paused_info(info))), ())
        })
    }

    pub(crate) fn forget_parked(&mut self, id: &SandboxId) -> Result<SandboxInfo, TransitionError> {
        self.apply(id, Transition::ForgetParked, None, |old| {
            (None, Self::info_of(old))
        })
    }

    /// A live sandbox a restart found (then `freeze` it if it was recorded frozen).
    pub(crate) fn adopt(&mut self, id: &SandboxId, sb: S) -> Result<(), TransitionError> {
        self.apply(id, Transition::Adopt, None, |_| {
            (Some(Slot::Running(sb)), ())
        })
    }

    pub(crate) fn lose(&mut self, lost: LostRecord) -> Result<(), TransitionError> {
        let id = lost.info.id.clone();
        self.apply(&id, Transition::Lose, None, |_| {
            (Some(Slot::Lost(lost)), ())
        })
    }

    pub(crate) fn forget_lost(&mut self, id: &SandboxId) -> Result<LostRecord, TransitionError> {
        self.apply(id, Transition::ForgetLost, None, |old| match old {
            Some(Slot::Lost(l)) => (None, l),
            _ => unreachable!("ForgetLost leaves Lost only"),
        })
    }
}
