//! Exec features, for real (root).

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::*;
use grove_runtime::{Error, ExecRequest, OutputChunk};

#[test]
fn exec_features() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let mut s = spec();
    s.env = BTreeMap::from([("FROM_SPEC".into(), "spec".into())]);
    s.workdir = Some("/tmp".into());
    let id = rt.create(s).expect("create").id;

    // argv (no shell), env from the spec and the request, default cwd from workdir.
    let mut req = ExecRequest::argv(["/usr/bin/env"]);
    req.env.insert("FROM_REQ".into(), "req".into());
    let r = rt.exec(&id, req).unwrap();
    let text = out(&r);
    assert!(
        text.contains("FROM_SPEC=spec") && text.contains("FROM_REQ=req"),
        "{text}"
    );
    assert_eq!(
        out(&rt.exec(&id, ExecRequest::argv(["pwd"])).unwrap()),
        "/tmp"
    );

    // cwd, stdin.
    let mut req = ExecRequest::shell("pwd; cat");
    req.cwd = Some("/etc".into());
    req.stdin = Some(b"from stdin\n".repeat(10_000));
    let r = rt.exec(&id, req).unwrap();
    assert_eq!(r.exit_code, Some(0));
    assert!(r.stdout.starts_with(b"/etc\nfrom stdin\n"));
    assert_eq!(r.stdout.len(), 5 + 11 * 10_000);

    // Streaming sees every chunk, in order, and the result holds the same bytes.
    let mut streamed = Vec::new();
    let r = rt
        .exec_stream(
            &id,
            ExecRequest::shell("for i in 1 2 3; do echo $i; sleep 0.05; done"),
            &mut |c| {
                if let OutputChunk::Stdout(d) = c {
                    streamed.extend(d);
                }
            },
        )
        .unwrap();
    assert_eq!(streamed, b"1\n2\n3\n");
    assert_eq!(r.stdout, streamed);

    // Exit code vs signal.
    assert_eq!(sh(&rt, &id, "exit 42").exit_code, Some(42));
    let r = sh(&rt, &id, "kill -9 $$");
    assert_eq!((r.exit_code, r.signal), (None, Some(9)));

    // Not found binary / bad cwd are errors, not exit codes.
    let e = rt
        .exec(&id, ExecRequest::argv(["/no/such/binary"]))
        .unwrap_err();
    assert_eq!(e.field(), Some("argv"), "{e}");
    let mut req = ExecRequest::argv(["true"]);
    req.cwd = Some("/no/such/dir".into());
    assert_eq!(rt.exec(&id, req).unwrap_err().field(), Some("cwd"));
    assert!(matches!(
        rt.exec(&id, ExecRequest::default()),
        Err(Error::InvalidSpec { .. })
    ));

    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

#[test]
fn timeout_kills_the_whole_tree() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    // A child in its own session that double-forks, and a plain background child.
    let mut req = ExecRequest::shell(
        "setsid sh -c 'sleep 1000 & echo $! > /tmp/daemon.pid; wait' & sleep 1001 & echo started; sleep 1002",
    );
    req.timeout_ms = Some(500);
    let t = Instant::now();
    let r = rt.exec(&id, req).unwrap();
    assert!(r.timed_out, "{r:?}");
    assert_eq!(r.signal, Some(9));
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(out(&r), "started");
    let left = sh(&rt, &id, "ps -eo args | grep -c '^sleep 10' || true");
    assert_eq!(out(&left), "0", "{:?}", rt.processes(&id).unwrap());

    // Without a timeout, a finished exec returns though its background child keeps the pipe.
    let r = sh(&rt, &id, "sleep 30 >/dev/null 2>&1 & echo done");
    assert_eq!(out(&r), "done");
    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

#[test]
fn background_outlives_exec_and_processes_and_signal() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    let mut req = ExecRequest::shell("echo bg-out; exec sleep 1000");
    req.background = true;
    let r = rt.exec(&id, req).unwrap();
    let pid = r.pid.expect("pid");
    let log = r.log_path.clone().expect("log path");
    std::thread::sleep(Duration::from_millis(100));
    let procs = rt.processes(&id).unwrap();
    let p = procs
        .iter()
        .find(|p| p.pid == pid)
        .expect("background process listed");
    assert!(p.running && p.argv == ["sleep", "1000"], "{p:?}");
    assert_eq!(rt.read_file(&id, &log).unwrap(), b"bg-out\n");
    assert!(procs.iter().all(|p| p.pid != 1), "init is not listed");

    // A connection that never sends its request does not hold init up.
    let init = rt.get(&id).unwrap().init_pid.unwrap();
    let stalled =
        std::os::unix::net::UnixStream::connect(format!("/proc/{init}/root/run/grove/init.sock"))
            .unwrap();
    let t = Instant::now();
    assert_eq!(out(&sh(&rt, &id, "echo quick")), "quick");
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "exec waited on a stalled connection"
    );
    drop(stalled);

    // Several execs at once.
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let (rt, id) = (rt.clone(), id.clone());
            std::thread::spawn(move || out(&sh(&rt, &id, &format!("sleep 0.3; echo {i}"))))
        })
        .collect();
    let t = Instant::now();
    let outs: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(outs, ["0", "1", "2", "3"]);
    assert!(
        t.elapsed() < Duration::from_millis(1200),
        "execs ran concurrently"
    );

    rt.signal(&id, pid, 15).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        rt.processes(&id).unwrap().iter().all(|p| p.pid != pid),
        "reaped after SIGTERM"
    );
    assert!(rt.signal(&id, 1, 9).is_err());
    assert!(rt.signal(&id, 99_999, 9).is_err());
    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}
