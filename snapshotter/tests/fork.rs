//! Snapshot a live sandbox (python state, open file offset, loopback server) and fork it.

mod common;

use common::app::{self, ask, DATA};
use common::grove::{self, Env};
use grove_snapshotter::{Error, ForkOptions, MemoryDump, SnapshotOptions};

/// PTRACE_ATTACH to pid 1 from inside; prints the errno's name (or "attached", then detaches).
const PTRACE_INIT: &str = "python3 -c 'import ctypes, errno, os
l = ctypes.CDLL(None, use_errno=True)
if l.ptrace(16, 1, None, None) == 0:
    os.waitpid(1, 0x40000000); l.ptrace(17, 1, None, None); print(\"attached\")
else:
    print(errno.errorcode[ctypes.get_errno()])'";

#[test]
fn fork_branches_continue_from_the_snapshot_and_diverge() {
    let Some(_serial) = grove::serial_with_prereqs() else {
        return;
    };
    common::tree::become_subreaper();
    let env = Env::new("grove-stest-fork");
    let src = env.rt.create(env.spec()).unwrap();
    app::start(&env, &src.id);
    assert_eq!(ask(&env, &src.id, "read", 1)["got"], "klm");
    let before = ask(&env, &src.id, "inc", 2);
    assert_eq!(before["counter"], 42);
    assert_eq!(before["offset"], 13);
    env.sh(&src.id, "echo before > /root/marker");
    // The sandbox's tmpfs mounts: CRIU archives them at the dump and extracts them in each
    // branch (without gzip: compat/criu-shim.c, 6).
    env.sh(
        &src.id,
        "echo tmp > /tmp/t && echo shm > /dev/shm/s && mkdir -p /run/d && echo run > /run/d/r",
    );
    // A shell that exits leaving a background child: its session leader is dead, so CRIU
    // restores the session through a helper task (see compat/criu-shim.c).
    env.sh(&src.id, "sleep 1000 >/dev/null 2>&1 &");

    let snap = env
        .snap
        .snapshot(
            &src.id,
            SnapshotOptions {
                name: Some("fork-test".into()),
                durable: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(snap.source, src.id.to_string());
    assert!(snap.bytes_added > 0);
    // The memory path the record names is the one this kernel allows: a soft-dirty pre-dump
    // where CRIU finds the tracking, else every page while frozen.
    let want = if env.snap.criu().features().mem_dirty_track {
        MemoryDump::SoftDirty
    } else {
        MemoryDump::Full
    };
    assert_eq!(snap.memory_dump, want);
    assert_eq!(env.snap.get("fork-test").unwrap().id, snap.id);
    assert_eq!(env.snap.get(&snap.id).unwrap(), snap);
    assert!(env.snap.live_manifests().len() >= 2);

    // The source keeps running, untouched by the snapshot.
    assert_eq!(ask(&env, &src.id, "inc", 3)["counter"], 43);

    let opts = ForkOptions {
        hostname_prefix: Some("branch".into()),
        ..Default::default()
    };
    let branches: Vec<_> = env
        .snap
        .fork("fork-test", 3, opts)
        .unwrap()
        .into_iter()
        .map(|r| r.expect("branch"))
        .collect();
    assert_eq!(branches.len(), 3);
    for (i, b) in branches.iter().enumerate() {
        assert_ne!(b.id, src.id);
        assert_eq!(b.spec.labels.get("grove.snapshot"), Some(&snap.id));
        // Python state exactly as at the snapshot: variable, file offset, heap.
        let st = ask(&env, &b.id, "state", 10);
        assert_eq!(st["counter"], 42, "branch {i}: {st}");
        assert_eq!(st["offset"], 13, "branch {i}: {st}");
        assert_eq!(st["heap"], before["heap"], "branch {i}: heap");
        assert_eq!(
            st["host"],
            format!("branch-{i}"),
            "branch {i} has its own hostname"
        );
        // The open file continues from its offset.
        assert_eq!(ask(&env, &b.id, "read", 11)["got"], "nop");
        // The loopback server still listens inside the branch.
        assert_eq!(app::wait_http(&env, &b.id), DATA);
        assert_eq!(env.out(&b.id, "cat /root/marker"), "before");
        assert_eq!(
            env.out(&b.id, "cat /tmp/t /dev/shm/s /run/d/r | tr '\\n' ' '"),
            "tmp shm run",
            "branch {i}: tmpfs contents"
        );
        // Init stays non-dumpable across the restore: its own sandbox cannot ptrace it.
        assert_eq!(env.out(&b.id, PTRACE_INIT), "EPERM", "branch {i}");
        assert_eq!(
            env.out(&b.id, "ps -eo args | grep -c '^sleep 1000'"),
            "1",
            "branch {i}: the orphaned background child is restored"
        );
    }
    // Branches diverge independently.
    for (i, b) in branches.iter().enumerate() {
        for k in 0..=i as u64 {
            ask(&env, &b.id, "inc", 20 + k);
        }
        env.sh(&b.id, &format!("echo {i} > /root/own"));
    }
    for (i, b) in branches.iter().enumerate() {
        let st = ask(&env, &b.id, "state", 30);
        assert_eq!(st["counter"], 42 + 1 + i as u64, "branch {i}");
        assert_eq!(env.out(&b.id, "cat /root/own"), i.to_string());
    }
    assert_eq!(
        ask(&env, &src.id, "state", 31)["counter"],
        43,
        "the source is unaffected"
    );
    let r = env
        .rt
        .exec(
            &src.id,
            grove_runtime::ExecRequest::shell("test -e /root/own"),
        )
        .unwrap();
    assert_ne!(
        r.exit_code,
        Some(0),
        "branch files do not leak into the source"
    );

    // Eager restores (every page copied before the branch runs) give the same state.
    env.snap.set_lazy_pages(false);
    let eager = env.snap.fork(&snap.id, 2, ForkOptions::default()).unwrap();
    env.snap.set_lazy_pages(true);
    for (i, b) in eager.into_iter().enumerate() {
        let b = b.expect("eager branch");
        let st = ask(&env, &b.id, "state", 40);
        assert_eq!(st["counter"], 42, "eager branch {i}: {st}");
        assert_eq!(st["heap"], before["heap"], "eager branch {i}: heap");
        env.rt.destroy(&b.id).unwrap();
    }

    // A lazily restored branch snapshotted while its lazy-pages daemon is still copying (held
    // stopped here): the snapshot waits for the memory to be complete, so a branch of that
    // snapshot holds the whole heap (a dump of the holes would read zeros). Busy CPUs keep
    // the daemon (nice 19) from finishing before it is stopped.
    let (lazy, daemons) = lazy_branch_held(&env, &snap.id);
    // Its daemon stopped mid-copy, the processes' argument strings are there for another
    // process to read (they are restored eagerly: `ps` and `pgrep -f` work at once).
    let cmdlines: Vec<String> = descendants(lazy.init_pid.expect("init pid"))
        .iter()
        .map(|p| std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .collect();
    assert!(
        cmdlines.iter().any(|c| c == "sleep 1000 "),
        "the orphaned sleep's command line, read from outside: {cmdlines:?}"
    );
    assert!(cmdlines.iter().all(|c| !c.is_empty()), "{cmdlines:?}");
    let again = std::thread::scope(|s| {
        let t = s.spawn(|| env.snap.snapshot(&lazy.id, SnapshotOptions::default()));
        std::thread::sleep(std::time::Duration::from_millis(500));
        assert!(
            !t.is_finished(),
            "a snapshot of a branch whose memory is incomplete did not wait"
        );
        common::tree::signal_all(&daemons, libc::SIGCONT);
        t.join().unwrap().unwrap()
    });
    env.rt.destroy(&lazy.id).unwrap();
    env.snap.set_lazy_pages(false);
    let c = env
        .snap
        .fork(&again.id, 1, ForkOptions::default())
        .unwrap()
        .remove(0)
        .expect("branch of the lazy branch");
    env.snap.set_lazy_pages(true);
    let st = ask(&env, &c.id, "state", 50);
    assert_eq!(st["counter"], 42, "{st}");
    assert_eq!(
        st["heap"], before["heap"],
        "the snapshot of a lazy branch lost memory"
    );
    env.rt.destroy(&c.id).unwrap();
    env.snap.delete(&again.id).unwrap();

    // A lazy branch whose daemon is lost before every page is delivered (SIGKILL, while held
    // stopped so that pages are surely missing) is marked failed, with an event, and its
    // processes are gone: never left running on pages that read as zeros.
    let events = env.rt.subscribe();
    let (holed, daemons) = lazy_branch_held(&env, &snap.id);
    common::tree::signal_all(&daemons, libc::SIGKILL);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while env.rt.get(&holed.id).unwrap().state != grove_runtime::SandboxState::Failed {
        assert!(
            std::time::Instant::now() < deadline,
            "a branch whose lazy-pages daemon was killed is {:?}",
            env.rt.get(&holed.id).unwrap().state
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let failed =
        std::iter::from_fn(|| events.recv_timeout(std::time::Duration::from_secs(10)).ok())
            .find(|e| e.sandbox == holed.id && e.kind == grove_runtime::EventKind::Failed)
            .expect("a failed event for the branch");
    assert!(
        failed
            .reason
            .as_deref()
            .unwrap_or("")
            .contains("lazy-pages"),
        "{failed:?}"
    );
    assert!(
        env.rt
            .exec(&holed.id, grove_runtime::ExecRequest::shell("true"))
            .is_err(),
        "a failed branch runs no exec"
    );
    env.rt.destroy(&holed.id).unwrap();

    // Unknown snapshots.
    for bad in ["no-such-snapshot", &"0".repeat(64)] {
        match env.snap.fork(bad, 1, ForkOptions::default()) {
            Err(e @ Error::NotFound { .. }) => assert_eq!(e.code(), "not_found"),
            other => panic!("fork of {bad}: expected NotFound, got {other:?}"),
        }
    }
    env.finish();
}

/// A lazy branch of `snap` whose lazy-pages daemon is held stopped while still copying, and the
/// daemon's process group (negated, for kill(2)): it runs under a shell of ours, in a group of
/// its own. Busy CPUs keep the daemon (nice 19) from finishing first; when it finished anyway,
/// another branch is tried. Daemons of earlier branches may still be copying: only the new one
/// is this branch's.
/// `pid` and every process below it.
fn descendants(pid: i32) -> Vec<i32> {
    let parent_of = |p: i32| -> Option<i32> {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
        stat.rsplit_once(") ")?.1.split(' ').nth(1)?.parse().ok()
    };
    let all: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    let mut found = vec![pid];
    let mut at = 0;
    while at < found.len() {
        let p = found[at];
        found.extend(all.iter().filter(|c| parent_of(**c) == Some(p)));
        at += 1;
    }
    found
}

fn lazy_branch_held(env: &Env, snap: &str) -> (grove_runtime::SandboxInfo, Vec<i32>) {
    let busy = common::tree::BusyCpus::start(2);
    for _ in 0..8 {
        let earlier = common::tree::group_leaders_named("lazy-pages");
        let b = env
            .snap
            .fork(snap, 1, ForkOptions::default())
            .unwrap()
            .remove(0)
            .expect("lazy branch");
        let daemons: Vec<i32> = common::tree::group_leaders_named("lazy-pages")
            .into_iter()
            .filter(|p| !earlier.contains(p))
            .map(|p| -p)
            .collect();
        common::tree::signal_all(&daemons, libc::SIGSTOP);
        assert!(daemons.len() <= 1, "one lazy-pages daemon per lazy branch");
        if daemons.len() == 1 {
            drop(busy);
            return (b, daemons);
        }
        env.rt.destroy(&b.id).unwrap();
    }
    panic!("no lazy branch whose daemon was still copying in 8 tries");
}

/// Holds a loopback TCP connection open with bytes sent but not yet read, then, once
/// /root/go exists, reads them, answers them upper-cased and records what came back.
const CONNECTED: &str = r#"
import os, socket, time
l = socket.socket()
l.bind(("127.0.0.1", 9100))
l.listen()
c = socket.create_connection(("127.0.0.1", 9100))
s, _ = l.accept()
c.sendall(b"in-flight")
open("/root/conn-ready", "w").write("1")
while not os.path.exists("/root/go"):
    time.sleep(0.01)
got = s.recv(100)
s.sendall(got.upper())
open("/root/conn-result", "w").write(c.recv(100).decode())
time.sleep(1000)
"#;

/// A sandbox snapshotted with an established loopback connection (so with CRIU's network
/// lock: only a namespace without one is dumped without it) gives branches in which the
/// connection carries on, the unread bytes included.
#[test]
fn an_established_connection_with_bytes_in_flight_carries_on_in_branches() {
    let Some(_serial) = grove::serial_with_prereqs() else {
        return;
    };
    common::tree::become_subreaper();
    let env = Env::new("grove-stest-tcp");
    let src = env.rt.create(env.spec()).unwrap();
    env.rt
        .write_file(&src.id, "/root/conn.py", CONNECTED.as_bytes(), None)
        .unwrap();
    let mut req = grove_runtime::ExecRequest::shell("python3 /root/conn.py");
    req.background = true;
    env.rt.exec(&src.id, req).unwrap();
    wait_for(&env, &src.id, "cat /root/conn-ready", "1");
    let snap = env
        .snap
        .snapshot(&src.id, SnapshotOptions::default())
        .unwrap();
    let mut all = vec![src.id.clone()];
    for b in env.snap.fork(&snap.id, 2, ForkOptions::default()).unwrap() {
        all.push(b.expect("branch").id);
    }
    for id in &all {
        env.sh(id, "touch /root/go");
    }
    for id in &all {
        wait_for(&env, id, "cat /root/conn-result 2>/dev/null", "IN-FLIGHT");
    }
    for id in &all[1..] {
        env.rt.destroy(id).unwrap();
    }
    env.finish();
}

fn wait_for(env: &Env, id: &grove_runtime::SandboxId, cmd: &str, want: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let r = env
            .rt
            .exec(id, grove_runtime::ExecRequest::shell(cmd))
            .unwrap();
        let got = String::from_utf8_lossy(&r.stdout).trim().to_string();
        if got == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{id}: `{cmd}` gave {got:?}, not {want:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
