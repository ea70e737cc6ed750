//! Exec as a user, kept processes (stdin, connect, replay, kill), terminals, and the output of an
//! exec's leftover children, for real (root).

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use grove_runtime::live::{ProcEvent, ProcessRequest, PtySize};
use grove_runtime::{Error, ExecRequest, Runtime, SandboxId};

fn as_user(cmd: &str, user: &str) -> ExecRequest {
    ExecRequest {
        user: Some(user.into()),
        ..ExecRequest::shell(cmd)
    }
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Follows a kept process on a thread; events arrive on the channel, the exit last.
fn follow(
    rt: &std::sync::Arc<Runtime>,
    id: &SandboxId,
    pid: i32,
) -> (
    mpsc::Receiver<ProcEvent>,
    std::thread::JoinHandle<Result<grove_runtime::live::ProcExit, Error>>,
) {
    let (tx, rx) = mpsc::channel();
    let (rt, id) = (rt.clone(), id.clone());
    let h = std::thread::spawn(move || {
        rt.proc_connect(&id, pid, &mut |e| {
            e == ProcEvent::Idle || tx.send(e).is_ok()
        })
    });
    (rx, h)
}

fn text_of(rx: &mpsc::Receiver<ProcEvent>, acc: &mut String) {
    while let Ok(e) = rx.try_recv() {
        match e {
            ProcEvent::Stdout(d) | ProcEvent::Stderr(d) | ProcEvent::Pty(d) => {
                acc.push_str(&String::from_utf8_lossy(&d))
            }
            ProcEvent::Started { .. } | ProcEvent::Idle => {}
        }
    }
}

#[test]
fn exec_as_user_has_its_ids_and_cannot_read_root_files() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    sh(&rt, &id, "echo s3cret > /root/secret; chmod 600 /root/secret; echo tok > /tmp/rootonly; chmod 600 /tmp/rootonly");

    let r = rt
        .exec(
            &id,
            as_user(
                "id -u; id -g; id -G; echo $HOME $USER; pwd; grep CapEff /proc/self/status",
                "user",
            ),
        )
        .unwrap();
    let lines: Vec<String> = out(&r).lines().map(str::to_string).collect();
    assert_eq!(lines[0], "1000", "{lines:?}");
    assert_eq!(lines[1], "1000");
    assert_eq!(lines[3], "/home/user user");
    assert_eq!(
        lines[5].split_whitespace().nth(1),
        Some("0000000000000000"),
        "no capability left: {lines:?}"
    );

    // The attack: a user process reads, writes or signals what only root may.
    for attack in [
        "cat /root/secret",
        "cat /tmp/rootonly",
        "ls /root",
        "echo x >> /etc/passwd",
        "kill -9 1",
        "cat /proc/1/environ",
    ] {
        let r = rt.exec(&id, as_user(attack, "user")).unwrap();
        assert_ne!(
            r.exit_code,
            Some(0),
            "{attack} succeeded as user: {}",
            out(&r)
        );
        assert!(
            !out(&r).contains("s3cret") && !out(&r).contains("tok"),
            "{attack}"
        );
    }
    // The secret is intact and root still reads it.
    assert_eq!(out(&sh(&rt, &id, "cat /root/secret")), "s3cret");

    // uid[:gid], with no entry: gid defaults to the uid, home is /.
    let r = rt
        .exec(&id, as_user("id -u; id -g; echo $HOME", "4242:4343"))
        .unwrap();
    assert_eq!(out(&r), "4242\n4343\n/");
    // The sandbox's own /etc/passwd is the one read (a user made in it resolves)...
    sh(
        &rt,
        &id,
        "echo 'tester:x:1234:1235::/tmp:/bin/sh' >> /etc/passwd",
    );
    assert_eq!(
        out(&rt
            .exec(&id, as_user("id -u; id -g; echo $HOME", "tester"))
            .unwrap()),
        "1234\n1235\n/tmp"
    );
    // ...an unknown name is the request's error, not an exit code...
    let e = rt.exec(&id, as_user("true", "nobody-such")).unwrap_err();
    assert_eq!(e.field(), Some("user"), "{e}");
    // ...and a FIFO in place of /etc/group does not hang init.
    sh(
        &rt,
        &id,
        "mv /etc/group /etc/group.real && mkfifo /etc/group",
    );
    let t = Instant::now();
    assert_eq!(
        out(&rt.exec(&id, as_user("id -u", "user")).unwrap()),
        "1000"
    );
    assert!(t.elapsed() < Duration::from_secs(3));
    sh(&rt, &id, "rm /etc/group && mv /etc/group.real /etc/group");

    // A background process as user: its log says who it ran as.
    let mut req = as_user("id -u", "user");
    req.background = true;
    let r = rt.exec(&id, req).unwrap();
    let log = r.log_path.unwrap();
    wait_until("background log", || {
        rt.read_file(&id, &log)
            .map(|b| b == b"1000\n")
            .unwrap_or(false)
    });

    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

#[test]
fn pty_is_a_controlling_terminal_in_its_own_session() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    let req = ProcessRequest {
        shell: Some(
            "tty; echo sid=$(ps -o sid= -p $$ | tr -d ' ') pid=$$; stty size; read x; stty size; echo got:$x; exit 3"
                .into(),
        ),
        pty: Some(PtySize { cols: 80, rows: 24 }),
        keep: true,
        ..Default::default()
    };
    let (pid, none) = rt.proc_start(&id, req, false, &mut |_| true).unwrap();
    assert!(none.is_none());
    let (rx, h) = follow(&rt, &id, pid);
    let mut text = String::new();
    wait_until("first size", || {
        text_of(&rx, &mut text);
        text.contains("24 80")
    });
    assert!(text.contains("/dev/pts/"), "{text}");
    assert!(
        text.contains(&format!("sid={pid} pid={pid}")),
        "own session: {text}"
    );
    rt.proc_resize(
        &id,
        pid,
        PtySize {
            cols: 100,
            rows: 40,
        },
    )
    .unwrap();
    rt.proc_input(&id, pid, b"hello\r".to_vec()).unwrap();
    let exit = h.join().unwrap().unwrap();
    text_of(&rx, &mut text);
    assert_eq!(exit.exit_code, Some(3), "{text}");
    assert!(
        text.contains("40 100") && text.contains("got:hello"),
        "{text}"
    );

    // Resizing or writing to what has ended is a conflict; an unknown pid is not found.
    assert!(matches!(
        rt.proc_input(&id, pid, b"x".to_vec()),
        Err(Error::Conflict { .. })
    ));
    assert!(matches!(
        rt.proc_resize(&id, 99999, PtySize { cols: 1, rows: 1 }),
        Err(Error::NotFound { .. })
    ));
    assert!(rt
        .proc_resize(&id, pid, PtySize { cols: 0, rows: 1 })
        .is_err());

    // A pty shell killed by signal.
    let req = ProcessRequest {
        argv: vec!["/bin/bash".into()],
        pty: Some(PtySize { cols: 80, rows: 24 }),
        keep: true,
        ..Default::default()
    };
    let (pid, _) = rt.proc_start(&id, req, false, &mut |_| true).unwrap();
    rt.signal(&id, pid, 9).unwrap();
    let (_rx, h) = follow(&rt, &id, pid);
    assert_eq!(h.join().unwrap().unwrap().signal, Some(9));

    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

#[test]
fn kept_process_stdin_connect_replay_and_hangup() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    let req = ProcessRequest {
        argv: vec!["cat".into()],
        stdin: true,
        keep: true,
        tag: Some("the-cat".into()),
        ..Default::default()
    };
    let (pid, _) = rt.proc_start(&id, req, false, &mut |_| true).unwrap();
    rt.proc_input(&id, pid, b"abc\n".to_vec()).unwrap();
    // A connect that leaves after the first chunk (the replay) does not end the process.
    let mut first = Vec::new();
    let e = rt.proc_connect(&id, pid, &mut |e| match e {
        ProcEvent::Stdout(d) => {
            first = d;
            false
        }
        _ => true,
    });
    assert!(e.is_err());
    assert_eq!(first, b"abc\n");
    let list = rt.proc_list(&id).unwrap();
    let me = list.iter().find(|p| p.pid == pid).expect("listed");
    assert!(me.running && me.tag.as_deref() == Some("the-cat"), "{me:?}");

    rt.proc_input(&id, pid, b"def\n".to_vec()).unwrap();
    rt.proc_close_stdin(&id, pid).unwrap();
    let (rx, h) = follow(&rt, &id, pid);
    let exit = h.join().unwrap().unwrap();
    let mut text = String::new();
    text_of(&rx, &mut text);
    assert_eq!((exit.exit_code, text.as_str()), (Some(0), "abc\ndef\n"));
    assert!(
        !rt.proc_list(&id)
            .unwrap()
            .iter()
            .find(|p| p.pid == pid)
            .unwrap()
            .running
    );

    // A stream that started a process not kept: its hang-up kills the process.
    let req = ProcessRequest {
        shell: Some("echo up; exec sleep 987".into()),
        ..Default::default()
    };
    let e = rt.proc_start(&id, req.clone(), true, &mut |e| {
        !matches!(e, ProcEvent::Stdout(_))
    });
    assert!(e.is_err());
    wait_until("sleep 987 gone", || {
        !rt.processes(&id)
            .unwrap()
            .iter()
            .any(|p| p.running && p.argv == ["sleep", "987"])
    });
    // Kept, it survives the same hang-up, and is killed by signal.
    let keep = ProcessRequest { keep: true, ..req };
    let mut pid = 0;
    let _ = rt.proc_start(&id, keep, true, &mut |e| match e {
        ProcEvent::Started { pid: p } => {
            pid = p;
            true
        }
        _ => false,
    });
    std::thread::sleep(Duration::from_millis(200));
    assert!(rt
        .processes(&id)
        .unwrap()
        .iter()
        .any(|p| p.pid == pid && p.running));
    rt.signal(&id, pid, 9).unwrap();
    let (_rx, h) = follow(&rt, &id, pid);
    assert_eq!(h.join().unwrap().unwrap().signal, Some(9));

    // A timeout kills an attached process and says so.
    let req = ProcessRequest {
        shell: Some("sleep 50".into()),
        timeout_ms: Some(300),
        ..Default::default()
    };
    let (_, exit) = rt.proc_start(&id, req, true, &mut |_| true).unwrap();
    assert!(exit.unwrap().timed_out);

    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

#[test]
fn leftover_children_of_an_exec_are_drained_into_a_log() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    // `cmd &` that writes after exec returned: before, it died on a dead pipe.
    let r = sh(
        &rt,
        &id,
        "(sleep 0.3; head -c 1000000 /dev/zero | tr '\\0' x; echo; echo done-late) & echo main",
    );
    assert_eq!(out(&r), "main");
    let log = format!("/run/grove/logs/{}.log", r.pid.unwrap());
    wait_until("the leftover output", || {
        rt.read_file(&id, &log)
            .map(|b| b.ends_with(b"done-late\n"))
            .unwrap_or(false)
    });
    assert_eq!(rt.read_file(&id, &log).unwrap().len(), 1_000_000 + 1 + 10);

    // Issue 26: a server started with `&` keeps serving (it logs each request to its stderr).
    let r = sh(
        &rt,
        &id,
        "python3 -m http.server 8123 --bind 127.0.0.1 & echo started",
    );
    assert_eq!(out(&r), "started");
    let get = "for i in $(seq 50); do c=$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8123/) && { echo $c; break; }; sleep 0.1; done";
    for _ in 0..3 {
        assert_eq!(out(&sh(&rt, &id, get)), "200");
    }
    let log = format!("/run/grove/logs/{}.log", r.pid.unwrap());
    assert!(String::from_utf8_lossy(&rt.read_file(&id, &log).unwrap())
        .contains("\"GET / HTTP/1.1\" 200"));

    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}

#[test]
fn a_reader_that_does_not_read_stalls_neither_init_nor_other_readers() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    let req = ProcessRequest {
        shell: Some("head -c 30000000 /dev/zero; echo end".into()),
        keep: true,
        ..Default::default()
    };
    let (pid, _) = rt.proc_start(&id, req, false, &mut |_| true).unwrap();
    // A reader that takes the first chunk, then sits on the stream without reading.
    let (stuck_tx, stuck_rx) = mpsc::channel::<()>();
    let (rt2, id2) = (rt.clone(), id.clone());
    let stuck = std::thread::spawn(move || {
        let _ = rt2.proc_connect(&id2, pid, &mut |_| {
            let _ = stuck_rx.recv_timeout(Duration::from_secs(20));
            false
        });
    });
    std::thread::sleep(Duration::from_millis(300));
    // Init still answers at once.
    let t = Instant::now();
    assert_eq!(out(&sh(&rt, &id, "echo quick")), "quick");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // Once the stuck reader leaves, the process runs to its end.
    drop(stuck_tx);
    stuck.join().unwrap();
    let (rx, h) = follow(&rt, &id, pid);
    assert_eq!(h.join().unwrap().unwrap().exit_code, Some(0));
    let mut tail = String::new();
    text_of(&rx, &mut tail);
    assert!(tail.ends_with("end\n"));

    rt.destroy(&id).unwrap();
    assert_gone(&rt, &id);
}
