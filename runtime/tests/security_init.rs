//! Attacks on the way the runtime reaches a sandbox's init, run from inside real sandboxes (root):
//! a control socket replaced by a symlink to another sandbox's (absolute, `..`, a symlinked
//! directory) or by an impostor's listener must never run a command in another sandbox; init must
//! not be ptraceable from its own sandbox; an init killed from the host fails its sandbox at once
//! (event, 409s, clean destroy); and a dead init's pid, reused by a host process, must never turn
//! the files API onto the host — neither live nor after a restart.

mod common;

use std::path::Path;
use std::process::{Child, Command};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use grove_runtime::{
    Error, Event, EventKind, ExecRequest, OverlayRoot, Runtime, SandboxId, SandboxSpec,
    SandboxState,
};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::waitpid;
use nix::unistd::Pid;

fn named(hostname: &str) -> SandboxSpec {
    let mut s = spec();
    s.hostname = Some(hostname.into());
    s
}

fn init_of(rt: &Runtime, id: &SandboxId) -> i32 {
    rt.get(id).unwrap().init_pid.unwrap()
}

/// Waits for a `failed` event of `id`; its reason.
fn failed_event(events: &Receiver<Event>, id: &SandboxId, within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match events.recv_timeout(left) {
            Ok(ev) if ev.sandbox == *id && ev.kind == EventKind::Failed => {
                return ev.reason.unwrap_or_default()
            }
            Ok(_) => {}
            Err(_) => panic!("no failed event for {id} within {within:?}"),
        }
    }
}

/// A host process holding exactly `pid` (a dead init's, reaped): set through ns_last_pid, retried
/// while other processes on the host take it first.
fn host_process_with_pid(pid: i32) -> Child {
    for _ in 0..500 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).unwrap();
        let mut c = Command::new("sleep").arg("120").spawn().unwrap();
        if c.id() as i32 == pid {
            return c;
        }
        let _ = c.kill();
        let _ = c.wait();
    }
    panic!("could not start a host process with pid {pid}");
}

/// SIGKILLs a sandbox's init from the host and reaps it ourselves (as its parent would after a
/// restart), so its pid is free for anyone.
fn kill_and_reap(pid: i32) {
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    waitpid(Pid::from_raw(pid), None).unwrap();
}

/// Files through a dead init: every route refuses with the wrong-state error, and nothing on the
/// host is read or written.
fn files_refused(rt: &Runtime, id: &SandboxId, probe: &str) {
    let host_path = format!("/tmp/{probe}");
    assert!(matches!(
        rt.read_file(id, "/etc/hostname"),
        Err(Error::Conflict { .. })
    ));
    assert!(matches!(
        rt.write_file(id, &host_path, b"pwned", None),
        Err(Error::Conflict { .. })
    ));
    assert!(matches!(rt.list_dir(id, "/"), Err(Error::Conflict { .. })));
    assert!(!Path::new(&host_path).exists(), "PUT wrote on the host");
    assert!(matches!(
        rt.exec(id, ExecRequest::shell("true")),
        Err(Error::Conflict { .. })
    ));
}

#[test]
fn a_replaced_control_socket_never_runs_exec_in_another_sandbox() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let b = rt.create(named("h2-victim")).unwrap().id;
    rt.write_file(&b, "/tmp/marker", b"B-MARKER", None).unwrap();
    let bpid = init_of(&rt, &b);
    let up = "../".repeat(12);
    let impostor = r#"
import json, os, socket, struct
def fr(k, b): return struct.pack(">I", len(b) + 1) + bytes([k]) + b
s = socket.socket(socket.AF_UNIX)
s.bind("/run/grove/init.sock.new")
s.listen(8)
os.rename("/run/grove/init.sock.new", "/run/grove/init.sock")
open("/tmp/imp.ready", "w").close()
while True:
    c, _ = s.accept()
    c.recv(65536)
    c.sendall(fr(1, json.dumps({"type": "started", "pid": 7, "log_path": None}).encode())
        + fr(2, b"IMPOSTOR\n")
        + fr(1, json.dumps({"type": "exit", "exit_code": 0, "signal": None,
                            "timed_out": False, "duration_ms": 1}).encode()))
    c.close()
"#;
    let attacks = [
        format!("rm /run/grove/init.sock && ln -s /proc/{bpid}/root/run/grove/init.sock /run/grove/init.sock"),
        format!("rm /run/grove/init.sock && ln -s {up}proc/{bpid}/root/run/grove/init.sock /run/grove/init.sock"),
        format!("mv /run/grove /run/grove.old && ln -s /proc/{bpid}/root/run/grove /run/grove"),
        "(setsid python3 /tmp/imp.py >/dev/null 2>&1 &); \
         for i in $(seq 200); do [ -e /tmp/imp.ready ] && break; sleep 0.05; done; [ -e /tmp/imp.ready ]"
            .to_string(),
    ];
    for (n, attack) in attacks.iter().enumerate() {
        let a = rt.create(named(&format!("h2-attacker-{n}"))).unwrap().id;
        rt.write_file(&a, "/tmp/imp.py", impostor.as_bytes(), None)
            .unwrap();
        let r = sh(&rt, &a, attack);
        assert_eq!(r.exit_code, Some(0), "attack {n} setup: {r:?}");
        // Chosen behaviour: an error (the sandbox broke its own control socket), never B's output
        // nor an impostor's.
        match rt.exec(&a, ExecRequest::shell("cat /tmp/marker; hostname")) {
            Ok(r) => panic!(
                "attack {n}: exec in A answered {:?} (B's or an impostor's)",
                String::from_utf8_lossy(&r.stdout)
            ),
            Err(Error::Conflict { reason, .. }) => {
                assert!(reason.contains("control socket"), "attack {n}: {reason}")
            }
            Err(e) => panic!("attack {n}: not the wrong-state error: {e}"),
        }
        // A still runs (its files are reached through its init, not the socket); B is untouched.
        assert_eq!(rt.get(&a).unwrap().state, SandboxState::Running);
        assert!(rt.list_dir(&a, "/tmp").is_ok());
        assert_eq!(
            out(&sh(&rt, &b, "cat /tmp/marker; hostname")),
            "B-MARKERh2-victim"
        );
        rt.destroy(&a).unwrap();
        assert_gone(&rt, &a);
    }
    rt.destroy(&b).unwrap();
    assert_gone(&rt, &b);
}

#[test]
fn init_cannot_be_ptraced_or_written_from_its_sandbox() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).unwrap().id;
    let attack = r#"
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
if libc.ptrace(16, 1, None, None) == 0:   # PTRACE_ATTACH
    os.waitpid(1, 0x40000000)             # __WALL
    libc.ptrace(17, 1, None, None)        # PTRACE_DETACH: leave init running
    print("attached")
else:
    print(errno.errorcode[ctypes.get_errno()])
try:
    open("/proc/1/mem", "r+b")
    print("mem-open")
except OSError as e:
    print(errno.errorcode[e.errno])
"#;
    let r = rt
        .exec(
            &id,
            ExecRequest {
                stdin: Some(attack.as_bytes().to_vec()),
                ..ExecRequest::shell("python3 -")
            },
        )
        .unwrap();
    assert_eq!(
        out(&r),
        "EPERM\nEACCES",
        "stderr: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    // Init is untouched: later requests work.
    assert_eq!(out(&sh(&rt, &id, "echo still")), "still");
    assert_eq!(rt.get(&id).unwrap().state, SandboxState::Running);
    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

#[test]
fn an_init_killed_from_the_host_fails_its_sandbox_at_once() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let events = rt.subscribe();
    let id = rt.create(spec()).unwrap().id;
    sh(&rt, &id, "true");
    let t0 = Instant::now();
    kill(Pid::from_raw(init_of(&rt, &id)), Signal::SIGKILL).unwrap();
    let reason = failed_event(&events, &id, Duration::from_secs(2));
    assert!(reason.contains("init"), "{reason}");
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert_eq!(rt.get(&id).unwrap().state, SandboxState::Failed);
    files_refused(&rt, &id, &format!("grove-h2-{id}"));
    assert!(matches!(rt.processes(&id), Err(Error::Conflict { .. })));
    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

#[test]
fn a_dead_inits_pid_reused_on_the_host_never_reaches_the_host() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).unwrap().id;
    let pid = init_of(&rt, &id);
    kill_and_reap(pid);
    let mut host = host_process_with_pid(pid);
    // /proc/<pid>/root is the host's / now.
    files_refused(&rt, &id, &format!("grove-h2-{id}"));
    assert_eq!(rt.get(&id).unwrap().state, SandboxState::Failed);
    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
    // The destroy did not touch the process that holds the pid now.
    assert!(host.try_wait().unwrap().is_none());
    host.kill().unwrap();
    host.wait().unwrap();
}

#[test]
fn after_a_restart_a_reused_pid_is_not_adopted_and_an_adopted_init_is_watched() {
    if !can_run() {
        return;
    }
    let cfg = config("grove-rtest-h2");
    let roots = || Arc::new(OverlayRoot::new(STATE_DIR));
    let rt = Runtime::new(cfg.clone(), roots()).unwrap();
    for left in rt.list() {
        rt.destroy(&left.id).unwrap(); // an aborted earlier run's
    }
    let reused = rt.create(spec()).unwrap().id;
    let watched = rt.create(spec()).unwrap().id;
    let reused_pid = init_of(&rt, &reused);
    let watched_pid = init_of(&rt, &watched);
    drop(rt); // a crash: everything stays

    kill_and_reap(reused_pid);
    let mut host = host_process_with_pid(reused_pid);
    let rt = Runtime::new(cfg.clone(), roots()).unwrap();
    let events = rt.subscribe();
    // Not adopted: the pid is another process's now.
    assert_eq!(rt.get(&reused).unwrap().state, SandboxState::Failed);
    files_refused(&rt, &reused, &format!("grove-h2-{reused}"));
    // Adopted, and its death noticed at once.
    assert_eq!(out(&sh(&rt, &watched, "echo adopted")), "adopted");
    kill(Pid::from_raw(watched_pid), Signal::SIGKILL).unwrap();
    let reason = failed_event(&events, &watched, Duration::from_secs(2));
    assert!(reason.contains("init"), "{reason}");
    assert_eq!(rt.get(&watched).unwrap().state, SandboxState::Failed);
    files_refused(&rt, &watched, &format!("grove-h2-{watched}"));
    for id in [&reused, &watched] {
        rt.destroy(id).unwrap();
    }
    assert!(rt.list().is_empty());
    assert!(rt.residue().items.is_empty(), "{:#?}", rt.residue().items);
    assert!(host.try_wait().unwrap().is_none());
    host.kill().unwrap();
    host.wait().unwrap();
    rt.shutdown();
    assert!(!Path::new(&cfg.run_dir).exists());
}
