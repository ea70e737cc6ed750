//! A cold create, whole and failing at each of its steps.

use super::*;
use crate::error::Error;
use crate::types::{EventKind, SandboxState};

/// How a step of a cold create is made to fail.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// The host call itself fails.
    Host(Op),
    /// Pid 1 reports ready, then exits before the runtime holds it.
    InitExits,
    /// The durable record cannot be written (the commit point).
    Record,
    /// The restore callback fails (a restored create only).
    Restore,
}

impl Fault {
    pub fn inject(self, host: &FakeHost) {
        match self {
            Fault::Host(op) => host.fail(op),
            Fault::InitExits => host.init_dies_after_ready(),
            Fault::Record => host.block_record(),
            Fault::Restore => {}
        }
    }
}

/// The calls that make something, in the order a create makes them.
fn made(calls: &[Call]) -> Vec<Op> {
    calls
        .iter()
        .filter(|c| c.ok && c.op.undo().is_some())
        .map(|c| c.op)
        .collect()
}

/// The calls that undo something, in the order they came.
pub fn undone(calls: &[Call]) -> Vec<Op> {
    let undos: Vec<Op> = [Op::RootMount, Op::CgroupCreate, Op::Spawn, Op::NetSetup]
        .iter()
        .filter_map(|o| o.undo())
        .collect();
    calls
        .iter()
        .map(|c| c.op)
        .filter(|o| undos.contains(o))
        .collect()
}

/// What a reclaim of `made` must call: the processes killed first (everything they use is
/// still there), then each other part undone in reverse order of making.
pub fn undo_of(made: &[Op]) -> Vec<Op> {
    let kill = made.contains(&Op::CgroupCreate).then_some(Op::CgroupKill);
    kill.into_iter()
        .chain(
            made.iter()
                .rev()
                .filter(|o| **o != Op::Spawn)
                .filter_map(|o| o.undo()),
        )
        .collect()
}

/// The id of the one sandbox the journal has calls for that it had none for in `before`.
pub fn new_sandbox(host: &FakeHost, before: &[String]) -> SandboxId {
    let new: Vec<String> = host
        .sandboxes()
        .into_iter()
        .filter(|s| !before.contains(s))
        .collect();
    assert_eq!(new.len(), 1, "one new sandbox in the journal: {new:?}");
    new[0].parse().unwrap()
}

#[test]
fn a_create_failing_at_any_step_undoes_every_step_before_it_in_reverse() {
    let node = Node::new();
    let rt = node.runtime();
    let events = rt.subscribe();
    let all = [Op::RootMount, Op::CgroupCreate, Op::Spawn, Op::NetSetup];
    // Each fault and how many of `all` were made before it.
    let steps = [
        (Fault::Host(Op::RootMount), 0),
        (Fault::Host(Op::CgroupCreate), 1),
        (Fault::Host(Op::Spawn), 2),
        (Fault::InitExits, 3),
        (Fault::Host(Op::NetSetup), 3),
        (Fault::Record, 4),
    ];
    for (fault, before_k) in steps {
        let before = node.host.sandboxes();
        fault.inject(&node.host);
        let err = rt.create(egress()).unwrap_err();
        let id = new_sandbox(&node.host, &before);
        match (fault, &err) {
            (Fault::Host(Op::RootMount), Error::Root(_))
            | (Fault::Host(Op::CgroupCreate), Error::Cgroup { .. })
            | (Fault::Host(Op::Spawn) | Fault::InitExits, Error::Init { .. })
            | (Fault::Host(Op::NetSetup), Error::Network { .. })
            | (Fault::Record, Error::Io { .. }) => {}
            _ => panic!("{fault:?} failed the create with {err:?}"),
        }
        let calls = node.host.calls(id.as_str());
        let made = made(&calls);
        assert_eq!(made, all[..before_k], "{fault:?}: made before it");
        assert_eq!(
            undone(&calls),
            undo_of(&made),
            "{fault:?}: undone, the processes first, then in reverse: {calls:?}"
        );
        assert_eq!(left(&node, &id), Vec::<String>::new(), "{fault:?}: left");
        assert!(rt.get(&id).is_err(), "{fault:?}: the id is forgotten");
        assert!(nothing_allocated(&rt), "{fault:?}: {:?}", rt.capacity());
        let ev = events.try_recv().expect("an event");
        assert_eq!((ev.sandbox, ev.kind), (id, EventKind::Failed), "{fault:?}");
    }
    assert!(rt.list().is_empty());
    assert!(rt.residue().items.is_empty(), "{:?}", rt.residue());
    // Every fault was consumed: the next create works.
    let info = rt.create(egress()).unwrap();
    assert_eq!(info.state, SandboxState::Running);
    rt.destroy(&info.id).unwrap();
    rt.shutdown();
}

#[test]
fn create_runs_then_destroy_leaves_nothing() {
    let node = Node::new();
    let rt = node.runtime();
    let events = rt.subscribe();
    let info = rt.create(egress()).unwrap();
    let id = info.id.clone();
    assert_eq!(info.state, SandboxState::Running);
    let pid = info.init_pid.unwrap();
    assert_eq!(node.host.inits_of(id.as_str()), [pid]);
    assert!(info.address.is_some(), "an egress sandbox has an address");
    let held = left(&node, &id);
    for part in ["cgroup", "upper", "link", "lease", "process", "dir"] {
        assert!(
            held.iter().any(|h| h.starts_with(part)),
            "{part} in {held:?}"
        );
    }
    // The root was mounted at <dir>/root and the record written beside it.
    let dir = node.sandbox_dir(&id);
    assert!(dir.join("root").join(host::MARKER).exists());
    assert_eq!(crate::record::read(&dir).unwrap().init_pid, pid);
    assert_eq!(rt.get(&id).unwrap().state, SandboxState::Running);
    assert!(!nothing_allocated(&rt));
    // Nothing of a live sandbox is residue.
    assert!(rt.residue().items.is_empty(), "{:?}", rt.residue());

    rt.destroy(&id).unwrap();
    let calls = node.host.calls(id.as_str());
    assert_eq!(undone(&calls), undo_of(&made(&calls)), "{calls:?}");
    assert_eq!(left(&node, &id), Vec::<String>::new());
    assert!(!host::unreaped(pid), "init {pid} is reaped");
    assert!(rt.get(&id).is_err());
    assert!(nothing_allocated(&rt));
    let kinds: Vec<EventKind> = events.try_iter().map(|e| e.kind).collect();
    assert_eq!(kinds, [EventKind::Created, EventKind::Destroyed]);
    assert!(matches!(rt.destroy(&id), Err(Error::NotFound { .. })));
    rt.shutdown();
    assert!(
        !node.config.run_dir.exists(),
        "shutdown removes the run dir"
    );
}
