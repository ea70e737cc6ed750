//! Exec as a user, terminals (`/pty`) and kept processes' streams over the HTTP API, against a
//! real groved, every request and response checked against openapi.yaml.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use base64::Engine as _;
use common::{daemon, sse_events};
use hyper::Method;
use serde_json::{json, Value};

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

fn text(evs: &[(String, Value)], kind: &str) -> String {
    evs.iter()
        .filter(|(e, _)| e == kind)
        .map(|(_, v)| {
            let d = base64::engine::general_purpose::STANDARD
                .decode(v["data"].as_str().unwrap())
                .unwrap();
            String::from_utf8_lossy(&d).into_owned()
        })
        .collect()
}

#[test]
fn exec_as_user_and_its_bad_input() {
    let d = daemon();
    let id = d.create(json!({}));
    d.exec(&id, "echo s3cret > /root/secret && chmod 600 /root/secret");
    let r = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"shell": "id -u; echo $HOME; cat /root/secret", "user": "user"})),
        )
        .expect(200)
        .json();
    assert_eq!(r["stdout"], "1000\n/home/user\n", "{r}");
    assert_ne!(r["exit_code"], 0);
    assert!(
        r["stderr"].as_str().unwrap().contains("Permission denied"),
        "{r}"
    );
    for bad in ["", "no-such-user", "a\nb"] {
        d.call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"shell": "true", "user": bad})),
        )
        .expect_error(422, Some("user"));
    }
    d.delete(&id);
}

#[test]
fn pty_stream_input_resize_kill() {
    let d = daemon();
    let id = d.create(json!({}));
    // A terminal that reads a line: input and resize arrive while its stream is open.
    let (tx, rx) = mpsc::channel();
    let path = format!("/v1/sandboxes/{id}/pty");
    let t = std::thread::spawn(move || {
        sse_events(
            daemon(),
            Method::POST,
            &path,
            Some(
                json!({"cols": 80, "rows": 24, "shell": "tty; stty size; read x; stty size; echo got:$x; exit 5"}),
            ),
            |e, v| {
                if e == "started" {
                    let _ = tx.send(v["pid"].as_i64().unwrap());
                }
                e == "exit" || e == "error"
            },
        )
    });
    let pid = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/pty/{pid}/resize"),
        Some(json!({"cols": 120, "rows": 50})),
    )
    .expect(204);
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/pty/{pid}/input"),
        Some(json!({"data": b64("hi\r")})),
    )
    .expect(204);
    let evs = t.join().unwrap();
    let out = text(&evs, "data");
    assert!(out.contains("/dev/pts/") && out.contains("24 80"), "{out}");
    assert!(out.contains("50 120") && out.contains("got:hi"), "{out}");
    let (last, v) = evs.last().unwrap();
    assert_eq!((last.as_str(), &v["exit_code"]), ("exit", &json!(5)), "{v}");

    // Bad sizes and unknown terminals.
    d.call_invalid(
        Method::POST,
        &format!("/v1/sandboxes/{id}/pty"),
        r#"{"cols": 0, "rows": 24}"#,
    )
    .expect_error(422, Some("cols"));
    d.call_invalid(
        Method::POST,
        &format!("/v1/sandboxes/{id}/pty/{pid}/resize"),
        r#"{"cols": 10, "rows": 0}"#,
    )
    .expect_error(422, Some("pty"));
    d.call(
        Method::DELETE,
        &format!("/v1/sandboxes/{id}/pty/99999"),
        None,
    )
    .expect(404);
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/pty/99999/input"),
        Some(json!({"data": b64("x")})),
    )
    .expect(404);

    // Kill ends the stream with the signal; a dropped stream kills its terminal.
    let (tx, rx) = mpsc::channel();
    let path = format!("/v1/sandboxes/{id}/pty");
    let t = std::thread::spawn(move || {
        sse_events(
            daemon(),
            Method::POST,
            &path,
            Some(json!({"cols": 80, "rows": 24})),
            |e, v| {
                if e == "started" {
                    let _ = tx.send(v["pid"].as_i64().unwrap());
                }
                e == "exit" || e == "error"
            },
        )
    });
    let pid = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    d.call(
        Method::DELETE,
        &format!("/v1/sandboxes/{id}/pty/{pid}"),
        None,
    )
    .expect(204);
    let evs = t.join().unwrap();
    assert_eq!(evs.last().unwrap().1["signal"], 9, "{evs:?}");
    let evs = sse_events(
        d,
        Method::POST,
        &format!("/v1/sandboxes/{id}/pty"),
        Some(json!({"cols": 80, "rows": 24, "argv": ["sleep", "876"]})),
        |e, _| e == "started",
    );
    let pid = evs[0].1["pid"].as_i64().unwrap();
    let mut gone = false;
    for _ in 0..100 {
        let l = d
            .call(Method::GET, &format!("/v1/sandboxes/{id}/processes"), None)
            .expect(200)
            .json();
        if !l["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == pid && p["running"] == true)
        {
            gone = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(gone, "the terminal outlived its stream");
    d.delete(&id);
}

#[test]
fn background_process_stream_replays_and_leftovers_are_readable() {
    let d = daemon();
    let id = d.create(json!({}));
    let r = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/processes"),
            Some(json!({"shell": "echo one; sleep 0.5; echo two >&2"})),
        )
        .expect(201)
        .json();
    let pid = r["pid"].as_i64().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let evs = sse_events(
        d,
        Method::GET,
        &format!("/v1/sandboxes/{id}/processes/{pid}/stream"),
        None,
        |e, _| e == "exit" || e == "error",
    );
    assert_eq!(text(&evs, "stdout"), "one\n", "{evs:?}");
    assert_eq!(text(&evs, "stderr"), "two\n");
    assert_eq!(evs.last().unwrap().1["exit_code"], 0);
    d.call(
        Method::GET,
        &format!("/v1/sandboxes/{id}/processes/99999/stream"),
        None,
    )
    .expect(404);
    // A process started in the background without stdin has none to write to.
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/processes/{pid}/stdin"),
        Some(json!({"data": b64("x")})),
    )
    .expect(409);

    // What an exec's leftover child writes after the exec returned is in its log.
    let r = d.exec(&id, "(sleep 0.2; echo late) & echo now");
    assert_eq!(r["stdout"], "now\n");
    std::thread::sleep(Duration::from_millis(600));
    // The exec's pid is not in its result: the leftover's log is found by listing.
    let l = d
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files/list?path=/run/grove/logs"),
            None,
        )
        .expect(200)
        .json();
    let mut found = false;
    for e in l["entries"].as_array().unwrap() {
        let name = e["name"].as_str().unwrap();
        let f = d.send(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=/run/grove/logs/{name}"),
            None,
            &[],
        );
        found |= f.body == b"late\n"[..];
    }
    assert!(found, "{l}");
    d.delete(&id);
}

/// Whether a running process of the sandbox has exactly this argv.
fn running(d: &common::Daemon, id: &str, argv: &[&str]) -> bool {
    let l = d
        .call(Method::GET, &format!("/v1/sandboxes/{id}/processes"), None)
        .expect(200)
        .json();
    l["items"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["running"] == true && p["argv"] == json!(argv))
}

#[test]
fn a_client_that_leaves_exec_stream_takes_its_quiet_command_with_it() {
    let d = daemon();
    let id = d.create(json!({}));
    let evs = sse_events(
        d,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec/stream"),
        Some(json!({"shell": "echo up; exec sleep 778"})),
        |e, _| e == "stdout",
    );
    assert_eq!(evs[0].0, "stdout");
    let t = std::time::Instant::now();
    while running(d, &id, &["sleep", "778"]) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the command outlived its client"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    d.delete(&id);
}
