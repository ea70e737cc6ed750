//! Pause to the store: the sandbox's processes and memory are gone while paused, and resume
//! brings back the exact state (python variables, file offset, loopback server, files) under
//! the same id.

mod common;

use std::path::Path;

use common::app::{self, ask, DATA};
use common::grove::{self, Env};
use grove_runtime::{ExecRequest, SandboxState};

#[test]
fn pause_frees_the_sandbox_and_resume_restores_it_in_place() {
    let Some(_serial) = grove::serial_with_prereqs() else {
        return;
    };
    common::tree::become_subreaper();
    let instance = "grove-stest-pause";
    let env = Env::new(instance);
    let src = env.rt.create(env.spec()).unwrap();
    let id = src.id.clone();
    app::start(&env, &id);
    assert_eq!(ask(&env, &id, "read", 1)["got"], "klm");
    let before = ask(&env, &id, "inc", 2);
    env.sh(&id, "echo before > /root/marker");
    let mem = env.rt.usage(&id).unwrap().memory_bytes;
    assert!(mem > 8 << 20, "the app holds its 8 MiB heap: {mem}");

    let (parked, timing) = env.snap.pause(&id).expect("pause");
    eprintln!("pause: {timing:?}");
    assert_eq!(parked.state, SandboxState::Paused);
    assert_eq!(env.rt.get(&id).unwrap().state, SandboxState::Paused);
    assert!(env.snap.is_paused(&id));
    assert!(
        env.snap.list().is_empty(),
        "pause records are not snapshots"
    );
    // Nothing runs and no memory is charged: the sandbox's cgroups are gone.
    let memcg = Path::new("/sys/fs/cgroup/memory")
        .join(instance)
        .join(id.as_str());
    assert!(!memcg.exists(), "{} still exists", memcg.display());
    assert_eq!(
        env.rt
            .exec(&id, ExecRequest::shell("true"))
            .unwrap_err()
            .code(),
        "conflict"
    );
    // Pausing twice is a conflict, not a second record.
    assert_eq!(env.snap.pause(&id).unwrap_err().code(), "conflict");

    let (back, timing) = env.snap.resume(&id).expect("resume");
    eprintln!("resume: {timing:?}");
    assert_eq!(back.id, id);
    assert_eq!(back.state, SandboxState::Running);
    assert_eq!(back.created_at_ms, src.created_at_ms);
    assert!(!env.snap.is_paused(&id));
    let st = ask(&env, &id, "state", 3);
    assert_eq!(st["counter"], before["counter"], "{st}");
    assert_eq!(st["offset"], before["offset"], "{st}");
    assert_eq!(st["heap"], before["heap"]);
    assert_eq!(st["host"], id.as_str(), "same hostname");
    assert_eq!(ask(&env, &id, "read", 4)["got"], "nop");
    assert_eq!(app::wait_http(&env, &id), DATA);
    assert_eq!(env.out(&id, "cat /root/marker"), "before");
    assert_eq!(env.snap.resume(&id).unwrap_err().code(), "conflict");

    // Paused again, then destroyed while paused: the pause record goes with it.
    env.snap.pause(&id).expect("second pause");
    env.rt.destroy(&id).expect("destroy paused");
    common::tree::wait_for(5, "pause record dropped", || !env.snap.is_paused(&id));
    assert_eq!(env.rt.get(&id).unwrap_err().code(), "not_found");
    env.finish();
}
