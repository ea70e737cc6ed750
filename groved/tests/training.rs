//! What a training loop leans on (issue 26, server side): errors in the user's terms, execs that end
//! with their client and run once per Idempotency-Key, per-request queue waits, and lifetimes (default
//! TTL, snapshot TTLs, descendants, gc, batch delete).

mod common;

use std::time::{Duration, Instant};

use common::{daemon, IMAGE};
use hyper::Method;
use serde_json::{json, Value};

/// No Rust type names, serde positions or internal function names in a message meant for a user.
fn assert_user_terms(v: &Value) {
    let m = v["message"].as_str().unwrap_or("");
    for leak in [
        "u32",
        "u64",
        "line 1 column",
        "create_restored_as",
        "os error",
        "expected struct",
    ] {
        assert!(!m.contains(leak), "message leaks {leak:?}: {v}");
    }
}

#[test]
fn errors_speak_the_users_terms() {
    let d = daemon();
    let id = d.create(json!({}));
    // files.list of a file, files.write to a directory or under a file: 4xx naming `path`.
    let r = d.call(
        Method::GET,
        &format!("/v1/sandboxes/{id}/files/list?path=/etc/passwd"),
        None,
    );
    let v = r.expect_error(422, Some("path"));
    assert!(
        v["message"].as_str().unwrap().contains("not a directory"),
        "{v}"
    );
    assert_user_terms(&v);
    for path in ["/tmp", "/etc/passwd/x"] {
        let r = d.send(
            Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path={path}"),
            Some(("application/octet-stream", "hi".into())),
            &[],
        );
        let v = r.expect_error(422, Some("path"));
        assert_user_terms(&v);
    }
    // A negative CPU: what it must be, in the API's words.
    let r = d.call_invalid(
        Method::POST,
        "/v1/sandboxes",
        &json!({"image": IMAGE, "limits": {"cpu_millis": -1000}}).to_string(),
    );
    let v = r.expect_error(422, Some("limits.cpu_millis"));
    let m = v["message"].as_str().unwrap();
    assert!(m.contains("must be a positive number of millicores"), "{v}");
    assert_user_terms(&v);
    let r = d.call_invalid(
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({"shell": "true", "timeout_ms": "soon"}).to_string(),
    );
    let v = r.expect_error(422, Some("timeout_ms"));
    assert_user_terms(&v);
    // usage() of a sandbox paused to the store: it runs nothing, holds no memory.
    let p = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/pause?to=store"),
            None,
        )
        .expect(200)
        .json();
    assert_eq!(p["state"], "paused", "{p}");
    let u = d.call(Method::GET, &format!("/v1/sandboxes/{id}/usage"), None);
    assert_eq!(u.status, 200, "{}", u.text());
    let u = u.json();
    assert_eq!(
        (u["pids"].as_u64(), u["memory_bytes"].as_u64()),
        (Some(0), Some(0)),
        "{u}"
    );
    d.delete(&id);
}

/// Sends one HTTP/1.1 request on a fresh connection and leaves it open: the caller hangs up by dropping it.
fn send_raw(
    d: &common::Daemon,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> std::os::unix::net::UnixStream {
    use std::io::Write as _;
    let mut s = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
    let body = body.to_string();
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nhost: groved\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    s.write_all(req.as_bytes()).unwrap();
    s
}

/// How many processes in the sandbox have `needle` in their command line.
fn running(d: &common::Daemon, id: &str, needle: &str) -> usize {
    let out = d.exec(
        id,
        "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; true",
    );
    out["stdout"].as_str().unwrap_or("").matches(needle).count()
}

fn wait_gone(d: &common::Daemon, id: &str, needle: &str) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        if running(d, id, needle) == 0 {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

fn wait_running(d: &common::Daemon, id: &str, needle: &str) {
    let t = Instant::now();
    while running(d, id, needle) == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{needle} never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_client_that_hangs_up_takes_its_command_along() {
    let d = daemon();
    let id = d.create(json!({}));
    // Synchronous exec, silent and without a timeout: the hang-up alone must end it.
    let conn = send_raw(
        d,
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({"shell": "sleep 301; echo late >> /tmp/late"}),
        &[],
    );
    wait_running(d, &id, "sleep 301");
    drop(conn);
    assert!(wait_gone(d, &id, "sleep 301"), "exec outlived its client");
    // Streaming exec, silent too.
    let conn = send_raw(
        d,
        &format!("/v1/sandboxes/{id}/exec/stream"),
        &json!({"argv": ["sleep", "302"]}),
        &[],
    );
    wait_running(d, &id, "sleep 302");
    drop(conn);
    assert!(
        wait_gone(d, &id, "sleep 302"),
        "streamed exec outlived its client"
    );
    // A background start is meant to outlive the request.
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/processes"),
        Some(json!({"argv": ["sleep", "303"]})),
    )
    .expect(201);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(running(d, &id, "sleep 303"), 1);
    d.delete(&id);
}

#[test]
fn a_quiet_exec_without_timeout_is_not_reclaimed_as_idle() {
    let d = daemon();
    let id = d.create(json!({"idle_timeout_secs": 1, "on_idle": "destroy"}));
    // Silent and CPU-free for three idle timeouts: still the client's command, it must finish.
    let r = d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"shell": "sleep 3; echo done"})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["stdout"], "done\n");
    // Once the command is done the idle policy applies again.
    let t = Instant::now();
    loop {
        let r = d.call(Method::GET, &format!("/v1/sandboxes/{id}"), None);
        if r.status == 404 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(15), "never reclaimed");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn an_exec_with_an_idempotency_key_runs_once() {
    let d = daemon();
    let id = d.create(json!({}));
    let path = format!("/v1/sandboxes/{id}/exec");
    let body = json!({"shell": "echo run >> /tmp/runs; wc -l < /tmp/runs"});
    let key = format!("exec-{}", common::rand_suffix());
    let send = |key: &str| {
        d.send(
            Method::POST,
            &path,
            Some(("application/json", body.to_string().into())),
            &[("idempotency-key", key)],
        )
    };
    let first = send(&key).expect(200);
    let again = send(&key).expect(200);
    assert_eq!(first.json(), again.json());
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(first.json()["stdout"], "1\n");
    // A killed connection mid-exec: the retry with the key gets the first run's answer.
    let key2 = format!("exec-{}", common::rand_suffix());
    let slow = json!({"shell": "sleep 1; echo run >> /tmp/runs2; wc -l < /tmp/runs2"});
    let conn = send_raw(d, &path, &slow, &[("idempotency-key", &key2)]);
    std::thread::sleep(Duration::from_millis(300));
    drop(conn);
    let retry = d
        .send(
            Method::POST,
            &path,
            Some(("application/json", slow.to_string().into())),
            &[("idempotency-key", &key2)],
        )
        .expect(200);
    assert_eq!(retry.json()["stdout"], "1\n", "{}", retry.text());
    let runs = d.exec(&id, "wc -l < /tmp/runs2");
    assert_eq!(runs["stdout"], "1\n", "the command ran twice");
    // Snapshots too: one snapshot for one key.
    let snap = format!("idem-{}", common::rand_suffix());
    let skey = format!("snap-{}", common::rand_suffix());
    let spath = format!("/v1/sandboxes/{id}/snapshot");
    let sbody = json!({"name": snap});
    for _ in 0..2 {
        let r = d.send(
            Method::POST,
            &spath,
            Some(("application/json", sbody.to_string().into())),
            &[("idempotency-key", &skey)],
        );
        assert_eq!(r.status, 201, "{}", r.text());
    }
    // Without the key the same name is taken: the second snapshot did not run.
    d.call(Method::DELETE, &format!("/v1/snapshots/{snap}"), None)
        .expect(204);
    // A stream cannot be replayed: a key there is refused, not ignored.
    let r = d.send(
        Method::POST,
        &format!("{path}/stream"),
        Some(("application/json", body.to_string().into())),
        &[("idempotency-key", "k")],
    );
    r.expect_error(400, Some("Idempotency-Key"));
    d.delete(&id);
}

#[test]
fn queue_timeout_per_request() {
    let d = daemon();
    let job = format!("qt-{}", common::rand_suffix());
    d.call(
        Method::PUT,
        "/v1/jobs",
        Some(json!({"queue_timeout_ms": 300, "jobs": {job.clone(): {"max_sandboxes": 1}}})),
    )
    .expect(200);
    let id = d.create(json!({"job": job}));
    // 0: at once, 429 capacity_exceeded.
    let t = Instant::now();
    let r = d.call(
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"image": IMAGE, "job": job, "queue_timeout_ms": 0})),
    );
    let v = r.expect_error(429, None);
    assert_eq!(v["code"], "capacity_exceeded", "{v}");
    assert!(t.elapsed() < Duration::from_secs(2));
    // Longer than the node's 300 ms: it waits that long, and gets in when room appears meanwhile.
    let t = Instant::now();
    let r = d.call(
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"image": IMAGE, "job": job, "queue_timeout_ms": 1500})),
    );
    r.expect_error(429, None);
    assert!(
        t.elapsed() >= Duration::from_millis(1400),
        "{:?}",
        t.elapsed()
    );
    let freed = std::thread::scope(|s| {
        let h = s.spawn(|| {
            d.call(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"image": IMAGE, "job": job, "queue_timeout_ms": 20000})),
            )
        });
        std::thread::sleep(Duration::from_millis(800));
        d.delete(&id);
        h.join().unwrap()
    });
    let v = freed.expect(201).json();
    d.delete(v["id"].as_str().unwrap());
    d.call_invalid(
        Method::POST,
        "/v1/sandboxes",
        &json!({"image": IMAGE, "queue_timeout_ms": 3_600_001}).to_string(),
    )
    .expect_error(422, Some("queue_timeout_ms"));
    d.call(
        Method::PUT,
        "/v1/jobs",
        Some(json!({"queue_timeout_ms": 300})),
    )
    .expect(200);
}
