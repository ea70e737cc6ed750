//! The state machine without a sandbox: a fake occupant stands in for `Arc<Sandbox>`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::*;
use crate::types::{SandboxSpec, SandboxState};

#[derive(Clone)]
struct Fake {
    id: SandboxId,
    created_at_ms: u64,
    expires_at_ms: Option<u64>,
    /// Identity: two fakes are the same sandbox when they share this.
    me: Arc<()>,
}

impl Fake {
    fn new(id: &SandboxId) -> Fake {
        Fake {
            id: id.clone(),
            created_at_ms: 1,
            expires_at_ms: None,
            me: Arc::new(()),
        }
    }
}

impl Occupant for Fake {
    fn info(&self, state: SandboxState) -> SandboxInfo {
        SandboxInfo {
            id: self.id.clone(),
            state,
            spec: SandboxSpec::from_image("img"),
            created_at_ms: self.created_at_ms,
            expires_at_ms: self.expires_at_ms,
            init_pid: Some(7),
            hostname: "h".into(),
            address: Some("10.0.0.2".into()),
        }
    }

    fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.me, &other.me)
    }

    fn expires_at_ms(&self) -> Option<u64> {
        self.expires_at_ms
    }
}

fn lost(id: &SandboxId) -> LostRecord {
    LostRecord {
        info: SandboxInfo {
            state: SandboxState::Failed,
            init_pid: None,
            address: None,
            ..Fake::new(id).info(SandboxState::Failed)
        },
        reason: "init gone".into(),
    }
}

/// A registry with `id` in `state`, reached by legal transitions only; and its occupant.
fn at(state: Option<SlotState>) -> (Registry<Fake>, SandboxId, Fake) {
    let r = Registry::default();
    let id = SandboxId::generate();
    let sb = Fake::new(&id);
    let parked = |r: &Registry<Fake>| {
        r.register_parked(sb.info(SandboxState::Running)).unwrap();
    };
    match state {
        None => {}
        Some(SlotState::Creating) => r.with(|s| s.reserve(&id)).unwrap(),
        Some(SlotState::Running) => {
            r.with(|s| s.reserve(&id)).unwrap();
            r.create(&id, sb.clone()).unwrap();
        }
        Some(SlotState::Frozen) => {
            r.with(|s| s.adopt(&id, sb.clone())).unwrap();
            r.freeze(&id, &sb).unwrap();
        }
        Some(SlotState::Failed) => {
            r.with(|s| s.adopt(&id, sb.clone())).unwrap();
            r.fail(&id, &sb).unwrap();
        }
        Some(SlotState::Destroying) => {
            r.with(|s| s.adopt(&id, sb.clone())).unwrap();
            r.destroy(&id).unwrap();
        }
        Some(SlotState::Parking) => {
            r.with(|s| s.adopt(&id, sb.clone())).unwrap();
            r.park(&id).unwrap();
        }
        Some(SlotState::Parked) => parked(&r),
        Some(SlotState::Restoring) => {
            parked(&r);
            r.unpark(&id).unwrap();
        }
        Some(SlotState::Lost) => r.lose(lost(&id)).unwrap(),
    }
    assert_eq!(r.state(&id), state);
    (r, id, sb)
}

/// Runs `t` on `id` with whatever it needs.
fn run(
    r: &Registry<Fake>,
    id: &SandboxId,
    sb: &Fake,
    t: Transition,
) -> Result<(), TransitionError> {
    let info = sb.info(SandboxState::Running);
    r.with(|s| match t {
        Transition::Reserve => s.reserve(id),
        Transition::Create => s.create(id, sb.clone()),
        Transition::Abandon => s.abandon(id),
        Transition::Freeze => s.freeze(id, sb),
        Transition::Thaw => s.thaw(id, sb),
        Transition::Fail => s.fail(id, sb),
        Transition::Destroy => s.destroy(id).map(drop),
        Transition::Finish => s.finish(id),
        Transition::Park => s.park(id).map(drop),
        Transition::Parked => s.parked(id).map(drop),
        Transition::Unpark => s.unpark(id).map(drop),
        Transition::Restored => s.restored(id, sb.clone()),
        Transition::RestoreFailed => s.restore_failed(id),
        Transition::RegisterParked => s.register_parked(info),
        Transition::ForgetParked => s.forget_parked(id).map(drop),
        Transition::Adopt => s.adopt(id, sb.clone()),
        Transition::Lose => s.lose(lost(id)),
        Transition::ForgetLost => s.forget_lost(id).map(drop),
    })
}

#[test]
fn every_transition_from_every_state_is_legal_exactly_as_its_edge_says() {
    let mut legal = 0;
    for t in Transition::ALL {
        let (_, to) = t.edge();
        for from in std::iter::once(None).chain(SlotState::ALL.map(Some)) {
            let (r, id, sb) = at(from);
            let res = run(&r, &id, &sb, t);
            if t.legal_from(from) {
                legal += 1;
                assert_eq!(res, Ok(()), "{t} from {from:?}");
                assert_eq!(r.state(&id), to, "{t} from {from:?}");
            } else {
                let err = res.expect_err(&format!("{t} from {from:?} must be refused"));
                assert_eq!(err.state(), from, "{t} from {from:?}: {err}");
                assert_eq!(r.state(&id), from, "{t} from {from:?} changed the slot");
            }
        }
    }
    // The edges of state.rs: 23 legal (from, transition) pairs.
    assert_eq!(legal, 23);
}

#[test]
fn illegal_transitions_say_what_and_where() {
    let (r, id, _) = at(Some(SlotState::Parked));
    let e = r.destroy(&id).map(drop).unwrap_err();
    assert_eq!(
        e,
        TransitionError::Illegal {
            id: id.clone(),
            state: SlotState::Parked,
            transition: Transition::Destroy
        }
    );
    assert!(e.to_string().contains("paused to the store"), "{e}");
    let (r, id, sb) = at(None);
    assert!(matches!(
        r.thaw(&id, &sb),
        Err(TransitionError::Unknown {
            transition: Transition::Thaw,
            ..
        })
    ));
    // A frozen sandbox cannot be frozen again, nor a running one thawed.
    let (r, id, sb) = at(Some(SlotState::Frozen));
    assert_eq!(
        r.freeze(&id, &sb).unwrap_err().state(),
        Some(SlotState::Frozen)
    );
    let (r, id, sb) = at(Some(SlotState::Running));
    assert_eq!(
        r.thaw(&id, &sb).unwrap_err().state(),
        Some(SlotState::Running)
    );
    // A failed sandbox is not parked: its processes or root are gone.
    let (r, id, _) = at(Some(SlotState::Failed));
    assert_eq!(
        r.park(&id).map(drop).unwrap_err().state(),
        Some(SlotState::Failed)
    );
}

#[test]
fn a_transition_on_behalf_of_a_replaced_sandbox_is_refused() {
    // Parked and restored: the same id, another sandbox.
    let (r, id, old) = at(Some(SlotState::Running));
    r.park(&id).unwrap();
    r.parked(&id).unwrap();
    r.unpark(&id).unwrap();
    let new = Fake::new(&id);
    r.restored(&id, new.clone()).unwrap();
    assert!(matches!(
        r.fail(&id, &old),
        Err(TransitionError::Replaced { .. })
    ));
    assert_eq!(r.state(&id), Some(SlotState::Running));
    r.fail(&id, &new).unwrap();
    assert_eq!(r.state(&id), Some(SlotState::Failed));
}

#[test]
fn get_shows_each_state_as_clients_know_it() {
    for state in SlotState::ALL {
        let (r, id, _) = at(Some(state));
        let got = r.get(&id);
        assert_eq!(got.as_ref().map(|i| i.state), state.shown(), "{state:?}");
        if let Some(info) = got {
            let has_process = matches!(
                state,
                SlotState::Running | SlotState::Frozen | SlotState::Failed
            );
            assert_eq!(info.init_pid.is_some(), has_process, "{state:?}");
            assert_eq!(info.address.is_some(), has_process, "{state:?}");
        }
        assert_eq!(r.list().len(), usize::from(state.shown().is_some()));
    }
}

#[test]
fn expiry_and_host_ownership_follow_the_state() {
    let r: Registry<Fake> = Registry::default();
    let live = SandboxId::generate();
    let mut sb = Fake::new(&live);
    sb.expires_at_ms = Some(10);
    r.with(|s| s.adopt(&live, sb.clone())).unwrap();
    let parked = SandboxId::generate();
    r.register_parked(SandboxInfo {
        expires_at_ms: Some(20),
        ..Fake::new(&parked).info(SandboxState::Running)
    })
    .unwrap();
    let creating = r.reserve_fresh();
    assert_eq!(r.expired(&[SlotState::Running], 15), vec![live.clone()]);
    assert_eq!(r.expired(&[SlotState::Parked], 15), Vec::<SandboxId>::new());
    assert_eq!(r.expired(&[SlotState::Parked], 20), vec![parked.clone()]);
    let mut on_host: Vec<SandboxId> = r.with(|s| s.on_host().cloned().collect());
    on_host.sort_by_key(|i| i.to_string());
    let mut want = vec![live, creating];
    want.sort_by_key(|i| i.to_string());
    assert_eq!(on_host, want);
}

/// While one thread walks an id round and round the park/restore cycle (and another creates and
/// destroys others), `get` never misses it and `list` never shows it twice or not at all.
#[test]
fn get_and_list_never_see_a_sandbox_twice_or_missing_mid_transition() {
    let r = Arc::new(Registry::<Fake>::default());
    let id = SandboxId::generate();
    let sb = Fake::new(&id);
    r.with(|s| s.adopt(&id, sb.clone())).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mover = {
        let (r, id, stop) = (r.clone(), id.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rounds = 0u32;
            while !stop.load(Ordering::Relaxed) || rounds < 200 {
                let sb = r.park(&id).unwrap();
                r.parked(&id).unwrap();
                r.unpark(&id).unwrap();
                if rounds.is_multiple_of(3) {
                    r.restore_failed(&id).unwrap();
                    r.unpark(&id).unwrap();
                }
                r.restored(&id, sb.clone()).unwrap();
                r.freeze(&id, &sb).unwrap();
                r.thaw(&id, &sb).unwrap();
                rounds += 1;
            }
            rounds
        })
    };
    let churn = {
        let (r, stop) = (r.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let other = r.reserve_fresh();
                r.create(&other, Fake::new(&other)).unwrap();
                r.destroy(&other).unwrap();
                r.finish(&other).unwrap();
            }
        })
    };
    for _ in 0..20_000 {
        let got = r.get(&id).expect("get missed the sandbox mid-transition");
        assert!(
            matches!(got.state, SandboxState::Running | SandboxState::Paused),
            "{:?}",
            got.state
        );
        let listed = r.list().iter().filter(|i| i.id == id).count();
        assert_eq!(listed, 1, "list showed it {listed} times");
    }
    stop.store(true, Ordering::Relaxed);
    assert!(mover.join().unwrap() >= 200);
    churn.join().unwrap();
    assert_eq!(r.list().len(), 1);
}
