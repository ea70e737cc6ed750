//! Pause to the store and back, the runtime's side: `park` reclaims a sandbox and keeps its id,
//! `create_restored_as` brings it back from what a restore callback (CRIU, in production) made.
//! Also a freeze and thaw (`pause`/`resume`).

use super::create::{new_sandbox, undo_of, undone, Fault};
use super::*;
use crate::error::Error;
use crate::registry::SlotState;
use crate::runtime::RestoreTarget;
use crate::types::{EventKind, SandboxState};

type Restored = Result<i32, Box<dyn std::error::Error + Send + Sync>>;

/// The restore callback a test hands in: an init started in the target's cgroups, or `fault`'s
/// way of failing.
fn restorer<'a>(
    host: &'a FakeHost,
    fault: Option<Fault>,
    seen: &'a mut Vec<RestoreTarget>,
) -> impl FnMut(&RestoreTarget) -> Restored + 'a {
    move |t| {
        seen.push(t.clone());
        let root = t.root_dir.parent().unwrap();
        match fault {
            Some(Fault::Restore) => return Err("criu restore: injected failure".into()),
            Some(Fault::Record) => std::fs::create_dir(root.join("sandbox.json.tmp"))?,
            _ => {}
        }
        let pid = host.restore_init(t.id.as_str());
        if matches!(fault, Some(Fault::InitExits)) {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            )?;
            while std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| !s.contains(") Z "))
            {
                std::thread::yield_now();
            }
        }
        Ok(pid)
    }
}

#[test]
fn park_reclaims_everything_and_resume_brings_the_same_id_back() {
    let node = Node::new();
    let rt = node.runtime();
    let spec = SandboxSpec {
        hostname: Some("box".into()),
        ..egress()
    };
    let created = rt.create(spec.clone()).unwrap();
    let id = created.id.clone();
    let events = rt.subscribe();
    let parked = rt.park(&id).unwrap();
    assert_eq!(parked.state, SandboxState::Paused);
    assert_eq!(rt.state_of(&id), Some(SlotState::Parked));
    assert_eq!(
        left(&node, &id),
        Vec::<String>::new(),
        "nothing on the host"
    );
    assert!(nothing_allocated(&rt));
    assert!(
        matches!(rt.processes(&id), Err(Error::Conflict { .. })),
        "a parked sandbox runs nothing"
    );

    let mut seen = Vec::new();
    let info = rt
        .create_restored_as(
            id.clone(),
            spec.clone(),
            &mut restorer(&node.host, None, &mut seen),
        )
        .unwrap();
    assert_eq!(info.id, id);
    assert_eq!(info.state, SandboxState::Running);
    assert_eq!(info.created_at_ms, created.created_at_ms, "its age is kept");
    // The restore landed in the new sandbox's root, cgroups and veth name.
    let t = &seen[0];
    assert!(t.root_dir.join(host::MARKER).exists(), "root mounted first");
    assert_eq!(t.cgroups, rt.cgroups.criu_paths(id.as_str()));
    assert_eq!(t.veth_host, Some(crate::network::host_if(&id)));
    // The restored tree takes the sandbox's hostname and must answer.
    let pid = info.init_pid.unwrap();
    assert_eq!(node.host.hostname_of(pid).as_deref(), Some("box"));
    let after: Vec<Op> = node
        .host
        .calls(id.as_str())
        .iter()
        .map(|c| c.op)
        .skip_while(|o| *o != Op::CgroupKill)
        .skip_while(|o| *o != Op::RootMount)
        .collect();
    assert_eq!(
        after,
        [
            Op::RootMount,
            Op::CgroupCreate,
            Op::SetHostname,
            Op::Ping,
            Op::NetSetup
        ]
    );
    let kinds: Vec<EventKind> = events.try_iter().map(|e| e.kind).collect();
    assert_eq!(kinds, [EventKind::Paused, EventKind::Resumed]);

    rt.destroy(&id).unwrap();
    assert_eq!(left(&node, &id), Vec::<String>::new());
    assert!(!host::unreaped(pid));
    rt.shutdown();
}

#[test]
fn a_resume_failing_at_any_step_leaves_nothing_and_the_sandbox_parked() {
    let node = Node::new();
    let rt = node.runtime();
    let id = rt.create(egress()).unwrap().id;
    rt.park(&id).unwrap();
    let all = [Op::RootMount, Op::CgroupCreate, Op::NetSetup];
    let steps = [
        (Fault::Host(Op::RootMount), 0),
        (Fault::Host(Op::CgroupCreate), 1),
        (Fault::Restore, 2),
        (Fault::InitExits, 2),
        (Fault::Host(Op::SetHostname), 2),
        (Fault::Host(Op::Ping), 2),
        (Fault::Host(Op::NetSetup), 2),
        (Fault::Record, 3),
    ];
    for (fault, before_k) in steps {
        let seen = node.host.journal().len();
        fault.inject(&node.host);
        let mut targets = Vec::new();
        let err = rt
            .create_restored_as(
                id.clone(),
                egress(),
                &mut restorer(&node.host, Some(fault), &mut targets),
            )
            .unwrap_err();
        if let Fault::Restore = fault {
            assert!(matches!(err, Error::Restore { .. }), "{err:?}");
        }
        let calls: Vec<Call> = node.host.journal()[seen..].to_vec();
        let made: Vec<Op> = calls
            .iter()
            .filter(|c| c.ok && all.contains(&c.op))
            .map(|c| c.op)
            .collect();
        assert_eq!(made, all[..before_k], "{fault:?}: made before it");
        assert_eq!(undone(&calls), undo_of(&made), "{fault:?}: {calls:?}");
        assert_eq!(left(&node, &id), Vec::<String>::new(), "{fault:?}");
        assert_eq!(rt.state_of(&id), Some(SlotState::Parked), "{fault:?}");
        assert!(nothing_allocated(&rt), "{fault:?}");
    }
    // Then it comes back, and a destroy of a parked one just forgets it.
    let mut targets = Vec::new();
    rt.create_restored_as(
        id.clone(),
        egress(),
        &mut restorer(&node.host, None, &mut targets),
    )
    .unwrap();
    rt.park(&id).unwrap();
    let seen = node.host.journal().len();
    rt.destroy(&id).unwrap();
    assert_eq!(node.host.journal().len(), seen, "no host call");
    assert_eq!(rt.state_of(&id), None);
    assert!(rt.residue().items.is_empty());
    rt.shutdown();
}

#[test]
fn only_a_parked_id_can_be_restored_as() {
    let node = Node::new();
    let rt = node.runtime();
    let live = rt.create(offline()).unwrap().id;
    let allocated = rt.capacity().allocated;
    let before = node.host.sandboxes();
    let mut targets = Vec::new();
    let mut restore = restorer(&node.host, None, &mut targets);
    let err = rt
        .create_restored_as(live.clone(), offline(), &mut restore)
        .unwrap_err();
    assert!(matches!(err, Error::Conflict { .. }), "{err:?}");
    let unknown = SandboxId::generate();
    let err = rt
        .create_restored_as(unknown, offline(), &mut restore)
        .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err:?}");
    drop(restore);
    assert!(targets.is_empty(), "nothing restored");
    assert_eq!(node.host.sandboxes(), before, "no host call");
    assert_eq!(
        rt.capacity().allocated,
        allocated,
        "the refusals gave back what they took"
    );
    // A fresh restored create gets an id of its own.
    let info = rt
        .create_restored(offline(), &mut restorer(&node.host, None, &mut targets))
        .unwrap();
    assert_eq!(new_sandbox(&node.host, &before), info.id);
    rt.destroy(&info.id).unwrap();
    rt.destroy(&live).unwrap();
    rt.shutdown();
}

#[test]
fn pause_freezes_and_resume_thaws_in_place() {
    let node = Node::new();
    let rt = node.runtime();
    let id = rt.create(offline()).unwrap().id;
    rt.pause(&id).unwrap();
    assert_eq!(rt.get(&id).unwrap().state, SandboxState::Paused);
    assert_eq!(rt.state_of(&id), Some(SlotState::Frozen));
    let dir = node.sandbox_dir(&id);
    assert_eq!(
        crate::record::read(&dir).unwrap().state,
        SandboxState::Paused
    );
    assert!(matches!(rt.pause(&id), Err(Error::Conflict { .. })));
    // A failed freeze changes nothing.
    rt.resume(&id).unwrap();
    node.host.fail(Op::CgroupFreeze);
    assert!(rt.pause(&id).is_err());
    assert_eq!(rt.state_of(&id), Some(SlotState::Running));
    assert_eq!(
        crate::record::read(&dir).unwrap().state,
        SandboxState::Running
    );
    let ops: Vec<Op> = node
        .host
        .calls(id.as_str())
        .iter()
        .map(|c| c.op)
        .filter(|o| matches!(o, Op::CgroupFreeze | Op::CgroupThaw))
        .collect();
    assert_eq!(ops, [Op::CgroupFreeze, Op::CgroupThaw, Op::CgroupFreeze]);
    // A frozen sandbox parks as well.
    rt.pause(&id).unwrap();
    rt.park(&id).unwrap();
    assert_eq!(left(&node, &id), Vec::<String>::new());
    rt.destroy(&id).unwrap();
    rt.shutdown();
}
