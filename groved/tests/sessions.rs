//! Shell sessions through the HTTP API against a real groved (requests and responses checked against
//! openapi.yaml): bad input, and a session that has cd'd, exported a variable and started a job
//! before a snapshot, alive with that state in every branch of a fork, each branch then diverging.

mod common;

use std::time::Instant;

use common::{daemon, EXCLUSIVE};
use hyper::Method;
use serde_json::{json, Value};

fn run(d: &common::Daemon, id: &str, name: &str, body: Value) -> Value {
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/sessions/{name}/run"),
        Some(body),
    )
    .expect(200)
    .json()
}

fn out(d: &common::Daemon, id: &str, name: &str, cmd: &str) -> String {
    let r = run(d, id, name, json!({"command": cmd, "timeout_ms": 20000}));
    assert_eq!(r["session_alive"], true, "{r}");
    r["output"].as_str().unwrap().to_string()
}

#[test]
fn sessions_api_and_fork_carries_them_into_every_branch() {
    let _g = EXCLUSIVE.read().unwrap();
    let d = daemon();
    let id = d.create(json!({"labels": {"case": "sessions"}}));
    let base = format!("/v1/sandboxes/{id}/sessions");

    // Bad input: 400 malformed name, 404 unknown session, 409 duplicate, 422 bad field.
    d.call_invalid(Method::POST, &base, r#"{"name": "a b"}"#)
        .expect_error(400, Some("name"));
    d.call(
        Method::POST,
        &format!("{base}/no-such/run"),
        Some(json!({"command": "true"})),
    )
    .expect_error(404, Some("name"));
    d.call(Method::DELETE, &format!("{base}/no-such"), None)
        .expect_error(404, Some("name"));
    let s = d
        .call(
            Method::POST,
            &base,
            Some(json!({"name": "main", "env": {"FROM_CREATE": "c"}, "cwd": "/tmp"})),
        )
        .expect(201)
        .json();
    assert_eq!(
        (s["name"].as_str(), s["alive"].as_bool()),
        (Some("main"), Some(true))
    );
    d.call(Method::POST, &base, Some(json!({"name": "main"})))
        .expect_error(409, Some("name"));
    d.call(
        Method::POST,
        &format!("{base}/main/run"),
        Some(json!({"command": "true", "timeout_ms": 0})),
    )
    .expect_error(422, Some("timeout_ms"));

    // State before the snapshot: cwd, a variable, a background job; input and a timeout.
    assert_eq!(out(d, &id, "main", "pwd; echo $FROM_CREATE"), "/tmp\nc\n");
    out(
        d,
        &id,
        "main",
        "mkdir -p /srv/app && cd /srv/app && export STAGE=before; sleep 600 & echo started",
    );
    let r = run(d, &id, "main", json!({"command": "cat", "input": "in\n"}));
    assert_eq!(r["output"], "in\n");
    let r = run(
        d,
        &id,
        "main",
        json!({"command": "sleep 100", "timeout_ms": 200}),
    );
    assert_eq!(
        (r["timed_out"].as_bool(), r["session_alive"].as_bool()),
        (Some(true), Some(true))
    );
    let l = d.call(Method::GET, &base, None).expect(200).json();
    assert_eq!(l["sessions"].as_array().unwrap().len(), 1);

    // Snapshot, then fork into 3 branches: each has the session with its cwd, variable and job.
    let snap = format!("sess-{}", common::rand_suffix());
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/snapshot"),
        Some(json!({"name": snap})),
    )
    .expect(201);
    let t = Instant::now();
    let branches = d.fork(&snap, json!({"count": 3}));
    let state = "pwd; echo $STAGE; jobs | grep -c 'sleep 600'";
    for b in &branches {
        assert_eq!(
            out(d, b, "main", state),
            "/srv/app\nbefore\n1\n",
            "branch {b}"
        );
    }
    eprintln!("fork 3 + first run in each: {:?}", t.elapsed());
    // They diverge: each branch's next run sees its own state, the source keeps its own.
    for (i, b) in branches.iter().enumerate() {
        out(
            d,
            b,
            "main",
            &format!("mkdir -p /b{i} && cd /b{i}; export STAGE=branch{i}"),
        );
    }
    for (i, b) in branches.iter().enumerate() {
        assert_eq!(
            out(d, b, "main", "pwd; echo $STAGE"),
            format!("/b{i}\nbranch{i}\n")
        );
    }
    assert_eq!(out(d, &id, "main", state), "/srv/app\nbefore\n1\n");

    // A shell that dies: that run says so, the next is a 409 naming the session; close removes it.
    let r = run(d, &branches[0], "main", json!({"command": "exit 7"}));
    assert_eq!(
        (r["session_alive"].as_bool(), r["exit_code"].as_i64()),
        (Some(false), Some(7))
    );
    let e = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/sessions/main/run", branches[0]),
            Some(json!({"command": "true"})),
        )
        .expect_error(409, Some("name"));
    assert_eq!(e["code"], "session_dead");
    assert!(e["message"].as_str().unwrap().contains("\"main\""), "{e}");
    d.call(
        Method::DELETE,
        &format!("/v1/sandboxes/{}/sessions/main", branches[0]),
        None,
    )
    .expect(204);
    d.call(Method::POST, &format!("{base}/main/interrupt"), None)
        .expect(204);
    d.call(Method::DELETE, &format!("{base}/main"), None)
        .expect(204);

    for b in branches.iter().chain([&id]) {
        d.delete(b);
    }
    d.call(Method::DELETE, &format!("/v1/snapshots/{snap}"), None)
        .expect(204);
}
