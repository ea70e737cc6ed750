//! Recovery: a second runtime over the run dir of one that died adopts what still lives and
//! reclaims the rest.

use super::*;
use crate::types::SandboxState;

/// SIGKILL, and wait until it took: the signal is delivered asynchronously, and a restart that
/// came first would find the init still running and rightly adopt it.
fn kill(pid: i32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while host::running(pid) {
        assert!(
            std::time::Instant::now() < deadline,
            "init {pid} survived SIGKILL"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn a_restart_adopts_the_live_sandboxes_and_reclaims_the_rest() {
    let node = Node::new();
    let rt = node.runtime();
    let create = |spec: SandboxSpec| {
        let info = rt.create(spec).unwrap();
        (info.id, info.init_pid.unwrap())
    };
    let running = create(offline());
    let wired = create(egress());
    let frozen = create(offline());
    let dead = create(offline());
    let unlinked = create(egress());
    let deaf = create(offline());
    let rootless = create(offline());
    let in_flight = create(offline());
    rt.pause(&frozen.0).unwrap();
    // What happens to them while no runtime runs, or as it dies.
    kill(dead.1);
    node.host.cut_link(&unlinked.0);
    node.host.deafen(deaf.1);
    node.host.lose_root(&rootless.0);
    // A create or destroy in flight: a run dir without a record.
    std::fs::remove_file(node.sandbox_dir(&in_flight.0).join("sandbox.json")).unwrap();
    // Killed: no shutdown, no destroy.
    drop(rt);
    let seen = node.host.journal().len();

    let rt = node.runtime();
    let after: Vec<Call> = node.host.journal()[seen..].to_vec();
    let state = |id: &SandboxId| rt.get(id).map(|i| i.state).ok();
    for (id, pid) in [&running, &wired] {
        let info = rt.get(id).unwrap();
        assert_eq!(info.state, SandboxState::Running, "{id}");
        assert_eq!(info.init_pid, Some(*pid), "{id}: the same init");
        // A running record is thawed (a snapshot may have been cut off frozen) and pinged.
        let mine: Vec<Op> = ops(&after)
            .into_iter()
            .zip(&after)
            .filter(|(_, c)| c.id == id.as_str())
            .map(|(o, _)| o)
            .collect();
        assert_eq!(mine, [Op::RootReattach, Op::CgroupThaw, Op::Ping], "{id}");
    }
    assert!(rt.get(&wired.0).unwrap().address.is_some());
    assert_eq!(state(&frozen.0), Some(SandboxState::Paused));
    // The lost ones are reported failed, with why, until destroyed; nothing of them is left.
    for (id, why) in [
        (&dead.0, "exited"),
        (&unlinked.0, "link"),
        (&deaf.0, "does not answer"),
        (&rootless.0, "root filesystem"),
    ] {
        assert_eq!(state(id), Some(SandboxState::Failed), "{id}");
        assert_eq!(left(&node, id), Vec::<String>::new(), "{id}");
        let failed = rt.list().into_iter().find(|i| &i.id == id).unwrap();
        assert_eq!(failed.init_pid, None);
        let reason = format!("{:?}", rt.processes(id).unwrap_err());
        assert!(reason.contains(why), "{id}: {reason}");
    }
    for (_, pid) in [&dead, &unlinked, &deaf, &rootless, &in_flight] {
        assert!(!host::unreaped(*pid), "init {pid} killed and reaped");
    }
    // The in-flight one is reclaimed and forgotten.
    assert_eq!(state(&in_flight.0), None);
    assert_eq!(left(&node, &in_flight.0), Vec::<String>::new());
    // The nft rules are exactly the adopted sandboxes'.
    assert!(after.iter().any(|c| c.op == Op::NetRestore));
    assert_eq!(
        rt.residue().items,
        Vec::new(),
        "adopted ones are owned, the rest is gone"
    );

    // A second restart still reports the lost ones.
    drop(rt);
    let rt = node.runtime();
    assert_eq!(
        rt.get(&dead.0).unwrap().state,
        SandboxState::Failed,
        "persisted"
    );
    assert_eq!(rt.get(&running.0).unwrap().init_pid, Some(running.1));
    for (id, _) in [
        &running, &wired, &frozen, &dead, &unlinked, &deaf, &rootless,
    ] {
        rt.destroy(id).unwrap();
        assert_eq!(left(&node, id), Vec::<String>::new(), "{id}");
    }
    assert!(rt.list().is_empty());
    assert!(nothing_allocated(&rt));
    rt.shutdown();
    assert!(!node.config.run_dir.exists());
}
