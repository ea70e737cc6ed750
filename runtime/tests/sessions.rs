//! Shell sessions held by init, for real (root): state carries, prompt-free runs, timeouts that
//! spare the session, dead shells, pause/resume, and nothing left after destroy.

mod common;

use std::time::{Duration, Instant};

use common::*;
use grove_runtime::{Error, ExecRequest, Runtime, SandboxId, SessionCreate, SessionRun};

fn create(rt: &Runtime, id: &SandboxId, name: &str) {
    let s = rt
        .session_create(
            id,
            SessionCreate {
                name: name.into(),
                ..Default::default()
            },
        )
        .expect("session create");
    assert!(s.alive && !s.busy, "{s:?}");
}

fn run_with(rt: &Runtime, id: &SandboxId, name: &str, req: SessionRun) -> (String, Option<i32>) {
    let r = rt.session_run(id, name, req).expect("session run");
    (String::from_utf8_lossy(&r.output).into_owned(), r.exit_code)
}

fn run(rt: &Runtime, id: &SandboxId, name: &str, cmd: &str) -> (String, Option<i32>) {
    run_with(
        rt,
        id,
        name,
        SessionRun {
            command: cmd.into(),
            timeout_ms: Some(20_000),
            ..Default::default()
        },
    )
}

#[test]
fn session_state_carries_and_runs_need_no_prompt() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    create(&rt, &id, "main");

    // cd, export, alias, function, a background job and a venv-style `source`.
    let (o, c) = run(
        &rt,
        &id,
        "main",
        "mkdir -p /tmp/w && cd /tmp/w && export GREETING=hello && alias ll='echo ALIAS' && \
         f() { echo \"FUNC $1\"; }; sleep 300 & \
         printf 'export ACTIVATED=yes\\n' > /tmp/activate",
    );
    assert_eq!(c, Some(0), "{o}");
    run(&rt, &id, "main", "cd /tmp/w; source /tmp/activate");
    let (o, c) = run(
        &rt,
        &id,
        "main",
        "pwd; echo $GREETING $ACTIVATED; ll; f x; jobs | grep -c sleep",
    );
    assert_eq!(c, Some(0));
    assert_eq!(o.trim(), "/tmp/w\nhello yes\nALIAS\nFUNC x\n1", "{o}");

    // Output without a trailing newline, quotes and odd characters, a failing status.
    let (o, c) = run(
        &rt,
        &id,
        "main",
        "printf 'no newline'; echo \"it's\" >&2; false",
    );
    assert_eq!((o.as_str(), c), ("no newlineit's\n", Some(1)));
    let (o, _) = run(&rt, &id, "main", "echo '}' \"$(echo ')')\" '\\'");
    assert_eq!(o, "} ) \\\n");
    // A command reading stdin gets /dev/null (it does not eat the session's input) or `input`.
    let (o, c) = run(&rt, &id, "main", "cat; read x; echo read=$?");
    assert_eq!((o.as_str(), c), ("read=1\n", Some(0)));
    let (o, _) = run_with(
        &rt,
        &id,
        "main",
        SessionRun {
            command: "tr a-z A-Z; echo; pwd".into(),
            input: Some(b"piped in".to_vec()),
            ..Default::default()
        },
    );
    assert_eq!(o, "PIPED IN\n/tmp/w\n");
    // A syntax error stays inside the run.
    let (_, c) = run(&rt, &id, "main", "if then fi");
    assert_eq!(c, Some(2));
    assert_eq!(run(&rt, &id, "main", "echo $GREETING").0, "hello\n");

    // Output cap.
    let r = rt
        .session_run(
            &id,
            "main",
            SessionRun {
                command: "head -c 100000 /dev/zero".into(),
                max_output_bytes: Some(1000),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(r.output.len(), 1000);
    assert!(r.output_truncated && r.session_alive);

    // Two sessions are independent; list shows both.
    create(&rt, &id, "second");
    assert_eq!(run(&rt, &id, "second", "pwd; echo x$GREETING").0, "/\nx\n");
    let names: Vec<String> = rt
        .session_list(&id)
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["main", "second"]);

    // Bad input: clear errors naming the session.
    assert!(matches!(
        rt.session_run(&id, "nope", SessionRun::default()),
        Err(Error::SessionNotFound { name, .. }) if name == "nope"
    ));
    for bad in ["", "../x", "a b", ".hidden"] {
        let r = rt.session_create(
            &id,
            SessionCreate {
                name: bad.into(),
                ..Default::default()
            },
        );
        assert!(
            matches!(&r, Err(Error::InvalidSpec { field, .. }) if field == "name"),
            "{bad:?}: {r:?}"
        );
    }
    let r = rt.session_create(
        &id,
        SessionCreate {
            name: "main".into(),
            ..Default::default()
        },
    );
    assert!(matches!(r, Err(Error::SessionConflict { .. })), "{r:?}");
    let r = rt.session_create(
        &id,
        SessionCreate {
            name: "noshell".into(),
            shell: Some("/no/such/shell".into()),
            ..Default::default()
        },
    );
    assert!(
        matches!(&r, Err(Error::InvalidSpec { field, .. }) if field == "shell"),
        "{r:?}"
    );

    // Pause and resume: the session and its job are still there.
    rt.pause(&id).unwrap();
    rt.resume(&id).unwrap();
    let (o, _) = run(&rt, &id, "main", "pwd; jobs | grep -c sleep");
    assert_eq!(o, "/tmp/w\n1\n");

    // Close kills the shell and its job; the other session lives on.
    rt.session_close(&id, "main").unwrap();
    let procs = |rt: &Runtime| -> Vec<String> {
        rt.processes(&id)
            .unwrap()
            .into_iter()
            .filter(|p| p.running)
            .map(|p| p.argv.join(" "))
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while procs(&rt).iter().any(|a| a == "sleep 300") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !procs(&rt).iter().any(|a| a == "sleep 300"),
        "{:?}",
        procs(&rt)
    );
    assert!(matches!(
        rt.session_run(&id, "main", SessionRun::default()),
        Err(Error::SessionNotFound { .. })
    ));
    assert_eq!(run(&rt, &id, "second", "echo ok").0, "ok\n");

    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

#[test]
fn session_timeouts_interrupts_and_dead_shells() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    create(&rt, &id, "s");
    run(&rt, &id, "s", "cd /tmp; export KEEP=1; sleep 300 &");

    // A command that never ends: the timeout interrupts it, not the session or its jobs.
    let t = Instant::now();
    let r = rt
        .session_run(
            &id,
            "s",
            SessionRun {
                command: "echo started; sleep 100".into(),
                timeout_ms: Some(300),
                ..Default::default()
            },
        )
        .unwrap();
    assert!(r.timed_out && r.session_alive, "{r:?}");
    assert_eq!(r.exit_code, Some(130));
    assert!(String::from_utf8_lossy(&r.output).starts_with("started"));
    assert!(t.elapsed() < Duration::from_secs(5));
    // A builtin loop in the shell itself is interrupted too.
    let r = rt
        .session_run(
            &id,
            "s",
            SessionRun {
                command: "while :; do :; done".into(),
                timeout_ms: Some(300),
                ..Default::default()
            },
        )
        .unwrap();
    assert!(r.timed_out && r.session_alive, "{r:?}");
    // A command that ignores SIGINT is killed after the grace period; the shell stays.
    let r = rt
        .session_run(
            &id,
            "s",
            SessionRun {
                command: "bash -c \"trap '' INT; sleep 100\"".into(),
                timeout_ms: Some(300),
                ..Default::default()
            },
        )
        .unwrap();
    assert!(r.timed_out && r.session_alive, "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(10));
    assert_eq!(
        run(&rt, &id, "s", "pwd; echo $KEEP; jobs | grep -c sleep").0,
        "/tmp\n1\n1\n"
    );

    // A long run blocks neither other requests nor other sessions; interrupt ends it.
    create(&rt, &id, "other");
    std::thread::scope(|sc| {
        let rt2 = rt.clone();
        let id2 = id.clone();
        let h = sc.spawn(move || {
            rt2.session_run(
                &id2,
                "s",
                SessionRun {
                    command: "sleep 60".into(),
                    ..Default::default()
                },
            )
        });
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        assert_eq!(out(&sh(&rt, &id, "echo exec")), "exec");
        assert_eq!(run(&rt, &id, "other", "echo other").0, "other\n");
        assert!(t.elapsed() < Duration::from_secs(2));
        let busy = rt.session_run(&id, "s", SessionRun::default());
        assert!(
            matches!(busy, Err(Error::SessionConflict { .. })),
            "{busy:?}"
        );
        rt.session_interrupt(&id, "s").unwrap();
        let r = h.join().unwrap().unwrap();
        assert!(r.interrupted && !r.timed_out && r.session_alive, "{r:?}");
        assert_eq!(r.exit_code, Some(130));
    });

    // The shell exits: that run reports it, later ones get a clear "dead" error.
    let r = rt
        .session_run(
            &id,
            "s",
            SessionRun {
                command: "echo bye; exit 3".into(),
                ..Default::default()
            },
        )
        .unwrap();
    assert!(!r.session_alive, "{r:?}");
    assert_eq!(r.exit_code, Some(3));
    let dead = rt.session_run(&id, "s", SessionRun::default());
    match dead {
        Err(Error::SessionDead { name, reason, .. }) => {
            assert_eq!(name, "s");
            assert!(reason.contains("status 3"), "{reason}");
        }
        r => panic!("{r:?}"),
    }
    let s = rt.session_get(&id, "s").unwrap();
    assert!(!s.alive && s.exit_code == Some(3), "{s:?}");
    // Its background job went with it.
    let left: Vec<_> = rt
        .processes(&id)
        .unwrap()
        .into_iter()
        .filter(|p| p.running && p.argv.first().is_some_and(|a| a == "sleep"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // Killed from outside (SIGKILL to the shell): dead too.
    let pid = rt.session_get(&id, "other").unwrap().pid;
    rt.exec(&id, ExecRequest::shell(format!("kill -9 {pid}")))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while rt.session_get(&id, "other").unwrap().alive && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let s = rt.session_get(&id, "other").unwrap();
    assert!(!s.alive && s.signal == Some(9), "{s:?}");
    assert!(matches!(
        rt.session_run(&id, "other", SessionRun::default()),
        Err(Error::SessionDead { .. })
    ));
    rt.session_close(&id, "s").unwrap();

    // A live session with a job at destroy: nothing is left.
    create(&rt, &id, "last");
    run(&rt, &id, "last", "sleep 300 & echo started");
    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

/// Commands start with every signal at its default, whatever the process that made the sandbox
/// ignored. A runtime started from a background job of a shell ignores SIGINT and SIGQUIT, and
/// before, so did every exec and session command (a session's interrupt then did nothing).
#[test]
fn commands_start_with_default_signals_whatever_the_runtime_inherited() {
    if !can_run() {
        return;
    }
    // As a background job of a shell starts it; this binary's other tests then run so too, and
    // must not notice.
    // SAFETY: signal(2) with integers, SIG_IGN installs no handler.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGQUIT, libc::SIG_IGN);
    }
    // The standard signals ignored (SigIgn, bits 0-30 for signals 1-31); the real-time ones
    // are libc's to manage.
    let ignored = |status: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:"))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .map(|mask| mask & 0x7fff_ffff)
    };
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    let r = rt
        .exec(&id, ExecRequest::argv(["cat", "/proc/self/status"]))
        .unwrap();
    assert_eq!(ignored(&out(&r)), Some(0), "exec: {}", out(&r));
    create(&rt, &id, "sig");
    let (text, code) = run(&rt, &id, "sig", "cat /proc/self/status");
    assert_eq!(code, Some(0), "{text}");
    assert_eq!(ignored(&text), Some(0), "session: {text}");
    rt.destroy(&id).unwrap();
}
