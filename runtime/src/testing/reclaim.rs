//! Reclaim: destroys whose teardown fails at a step, TTL expiry, a dead init, shutdown.

use std::time::{Duration, Instant};

use super::create::undone;
use super::*;
use crate::error::Error;
use crate::registry::SlotState;
use crate::types::{EventKind, SandboxState};

#[test]
fn a_reclaim_step_that_fails_does_not_stop_the_others_and_what_it_leaves_is_residue() {
    let node = Node::new();
    let rt = node.runtime();
    for (op, kept) in [
        (Op::NetTeardown, "lease"),
        (Op::CgroupRemove, "cgroup"),
        (Op::RootUnmount, "upper"),
    ] {
        let id = rt.create(egress()).unwrap().id;
        let events = rt.subscribe();
        node.host.fail(op);
        let err = rt.destroy(&id).unwrap_err();
        assert!(matches!(err, Error::Cleanup { .. }), "{op:?}: {err:?}");
        // Every step was tried, the failed one included.
        let tried = undone(&node.host.calls(id.as_str()));
        assert_eq!(
            tried,
            [
                Op::CgroupKill,
                Op::NetTeardown,
                Op::CgroupRemove,
                Op::RootUnmount
            ],
            "{op:?}"
        );
        let held = left(&node, &id);
        assert!(held.iter().any(|h| h.starts_with(kept)), "{op:?}: {held:?}");
        assert!(
            !held.iter().any(|h| h.starts_with("process")),
            "{op:?}: the processes are gone whatever failed: {held:?}"
        );
        // The id is gone for clients, with a failed event, and its capacity back.
        assert!(matches!(rt.get(&id), Err(Error::NotFound { .. })), "{op:?}");
        let ev = events.try_recv().unwrap();
        assert_eq!((&ev.sandbox, ev.kind), (&id, EventKind::Failed), "{op:?}");
        assert!(nothing_allocated(&rt), "{op:?}");
        // What is left shows as residue, named by the sandbox.
        let residue = rt.residue().items;
        assert!(
            residue.iter().any(|i| i.what.contains(id.short())),
            "{op:?}: {residue:?}"
        );
        // An orphan cgroup dir is swept by the reaper's pass; the rest is the operator's.
        if op == Op::CgroupRemove {
            rt.reap_expired();
            assert!(!left(&node, &id).iter().any(|h| h.starts_with("cgroup")));
        }
    }
    rt.shutdown();
}

#[test]
fn a_sandbox_past_its_ttl_is_reclaimed_by_the_reaper() {
    let node = Node::new();
    let rt = node.runtime();
    let events = rt.subscribe();
    let spec = SandboxSpec {
        ttl_secs: Some(1),
        ..offline()
    };
    let id = rt.create(spec).unwrap().id;
    let keep = rt.create(offline()).unwrap().id;
    assert!(rt.reap_expired().is_empty(), "not yet");
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(rt.reap_expired(), std::slice::from_ref(&id));
    assert_eq!(left(&node, &id), Vec::<String>::new());
    assert_eq!(rt.get(&keep).unwrap().state, SandboxState::Running);
    let kinds: Vec<(SandboxId, EventKind)> =
        events.try_iter().map(|e| (e.sandbox, e.kind)).collect();
    assert!(kinds.contains(&(id, EventKind::Expired)), "{kinds:?}");
    rt.destroy(&keep).unwrap();
    rt.shutdown();
}

#[test]
fn a_sandbox_whose_init_dies_is_failed_and_destroy_reclaims_it() {
    let node = Node::new();
    let rt = node.runtime();
    let events = rt.subscribe();
    let info = rt.create(egress()).unwrap();
    let pid = info.init_pid.unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // The init watcher notices through the pidfd.
    let deadline = Instant::now() + Duration::from_secs(5);
    while rt.state_of(&info.id) != Some(SlotState::Failed) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(rt.get(&info.id).unwrap().state, SandboxState::Failed);
    let ev = events.iter().find(|e| e.kind == EventKind::Failed).unwrap();
    assert!(ev.reason.unwrap().contains("exited"));
    assert!(
        matches!(rt.processes(&info.id), Err(Error::Conflict { .. })),
        "requests hear it failed"
    );
    rt.destroy(&info.id).unwrap();
    assert_eq!(left(&node, &info.id), Vec::<String>::new());
    assert!(!host::unreaped(pid));
    rt.shutdown();
}

#[test]
fn shutdown_destroys_every_sandbox_and_gives_up_the_host() {
    let node = Node::new();
    let rt = node.runtime();
    let ids: Vec<SandboxId> = [offline(), egress(), offline()]
        .into_iter()
        .map(|s| rt.create(s).unwrap().id)
        .collect();
    rt.pause(&ids[2]).unwrap();
    rt.shutdown();
    for id in &ids {
        assert_eq!(left(&node, id), Vec::<String>::new(), "{id}");
    }
    let instance = instance_ops(&node);
    assert_eq!(
        instance,
        [
            Op::Prepare,
            Op::InitInstall,
            Op::NetRestore,
            Op::Unprepare,
            Op::InitRemove
        ]
    );
    assert!(!node.config.run_dir.exists());
}

/// A destroy under way on another thread (the reaper's, or a request's whose client went away)
/// when shutdown starts: shutdown waits for it, then gives up the host all the same.
#[test]
fn shutdown_waits_for_a_destroy_under_way() {
    let node = Node::new();
    let rt = node.runtime();
    let id = rt.create(offline()).unwrap().id;
    node.host.slow(Op::CgroupRemove, Duration::from_millis(300));
    let destroying = {
        let (rt, id) = (rt.clone(), id.clone());
        std::thread::spawn(move || rt.destroy(&id))
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while rt.state_of(&id) != Some(SlotState::Destroying) {
        assert!(Instant::now() < deadline, "the destroy never began");
        std::thread::sleep(Duration::from_millis(1));
    }
    rt.shutdown();
    destroying.join().unwrap().unwrap();
    assert_eq!(left(&node, &id), Vec::<String>::new());
    let instance = instance_ops(&node);
    assert_eq!(instance.last(), Some(&Op::InitRemove), "{instance:?}");
    assert!(instance.contains(&Op::Unprepare), "{instance:?}");
    assert!(!node.config.run_dir.exists());
}

/// The host calls the runtime made for the whole instance (not for one sandbox), in order.
fn instance_ops(node: &Node) -> Vec<Op> {
    node.host
        .journal()
        .into_iter()
        .filter(|c| c.id.is_empty())
        .map(|c| c.op)
        .collect()
}
