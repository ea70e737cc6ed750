//! Lifetimes (issue 26): the node's default TTL, snapshot TTLs that wait for what needs the snapshot,
//! a delete with descendants, gc of snapshots nothing needs (their store bytes freed), and batch
//! deletes by label and job. This binary's daemon has `default_ttl_secs = 3`.

mod common;

use std::time::{Duration, Instant};

use common::{daemon, rand_suffix, Daemon, IMAGE};
use hyper::Method;
use serde_json::{json, Value};

const DEFAULT_TTL: u64 = 3;

fn node() -> &'static Daemon {
    let _ = common::EXTRA_CONFIG.set("default_ttl_secs = 3");
    daemon()
}

/// Polls `f` until it is true, for at most `secs`.
fn eventually(secs: u64, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(secs) {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

fn snapshot(d: &Daemon, id: &str, body: Value) -> Value {
    let r = d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/snapshot"),
        Some(body),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()
}

fn fork(d: &Daemon, snap: &str) -> String {
    let r = d.call(
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"snapshot": snap, "ttl_secs": 600})),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()["id"].as_str().unwrap().to_string()
}

fn snapshot_names(d: &Daemon) -> Vec<String> {
    d.call(Method::GET, "/v1/snapshots", None)
        .expect(200)
        .json()["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect()
}

fn gone(d: &Daemon, id: &str) -> bool {
    d.call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .status
        == 404
}

#[test]
fn sandboxes_without_a_ttl_get_the_nodes_default() {
    let d = node();
    let r = d
        .call(Method::POST, "/v1/sandboxes", Some(json!({"image": IMAGE})))
        .expect(201)
        .json();
    assert_eq!(r["ttl_secs"], DEFAULT_TTL, "{r}");
    let leaked = r["id"].as_str().unwrap().to_string();
    // 0 says "no expiry" even here; an explicit TTL wins over the default.
    let keep = d.create(json!({"ttl_secs": 0}));
    let own = d.create(json!({"ttl_secs": 600}));
    let info = |id: &str| {
        d.call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .expect(200)
            .json()
    };
    assert_eq!(info(&keep)["ttl_secs"], Value::Null);
    assert_eq!(info(&own)["ttl_secs"], 600);
    // Nobody deletes it (a trainer that crashed): the default TTL does.
    assert!(
        eventually(DEFAULT_TTL + 10, || gone(d, &leaked)),
        "the default TTL never reaped {leaked}"
    );
    assert!(!gone(d, &keep) && !gone(d, &own));
    d.delete(&keep);
    d.delete(&own);
}

#[test]
fn an_expired_snapshot_waits_for_the_sandboxes_forked_from_it() {
    let d = node();
    let src = d.create(json!({"ttl_secs": 600}));
    let name = format!("ttl-{}", rand_suffix());
    let s = snapshot(d, &src, json!({"name": name, "ttl_secs": 1}));
    assert!(s["expires_at_ms"].as_u64().is_some(), "{s}");
    let branch = fork(d, &name);
    d.delete(&src);
    // Past its TTL but a branch lives: kept.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        snapshot_names(d).contains(&name),
        "deleted under a live fork"
    );
    d.delete(&branch);
    assert!(
        eventually(10, || !snapshot_names(d).contains(&name)),
        "the expired snapshot stayed after its last fork went"
    );
    // ttl_secs at snapshot time is validated like a sandbox's.
    let src = d.create(json!({"ttl_secs": 600}));
    d.call_invalid(
        Method::POST,
        &format!("/v1/sandboxes/{src}/snapshot"),
        &json!({"ttl_secs": -1}).to_string(),
    )
    .expect_error(422, Some("ttl_secs"));
    d.delete(&src);
}

#[test]
fn a_tree_is_deleted_with_its_descendants_and_gc_frees_the_store() {
    let d = node();
    let run = rand_suffix();
    // A depth-3 chain: root -> child -> grandchild, each from a fork of the one above.
    let src = d.create(json!({"ttl_secs": 600, "labels": {"run": run}}));
    d.exec(&src, "head -c 3000000 /dev/urandom > /root/a");
    let root = format!("tree-{run}");
    let r = snapshot(d, &src, json!({"name": root}));
    assert_eq!(r["parent"], Value::Null);
    let root_id = r["id"].as_str().unwrap().to_string();
    let b1 = fork(d, &root);
    d.exec(&b1, "head -c 3000000 /dev/urandom > /root/b");
    let child = format!("tree-{run}-c");
    let r = snapshot(d, &b1, json!({"name": child}));
    assert_eq!(r["parent"], root_id.as_str(), "{r}");
    let b2 = fork(d, &child);
    let grandchild = format!("tree-{run}-g");
    snapshot(d, &b2, json!({"name": grandchild}));
    let other = format!("other-{run}");
    let o = d.create(json!({"ttl_secs": 600}));
    snapshot(d, &o, json!({"name": other}));
    for id in [&src, &b1, &b2, &o] {
        d.delete(id);
    }
    let r = d
        .call(
            Method::DELETE,
            &format!("/v1/snapshots/{root}?descendants=true"),
            None,
        )
        .expect(200)
        .json();
    assert_eq!(r["count"], 3, "{r}");
    assert_eq!(r["deleted"][2], root.as_str(), "the root goes last: {r}");
    let names = snapshot_names(d);
    for n in [&root, &child, &grandchild] {
        assert!(!names.contains(n), "{n} survived: {names:?}");
    }
    assert!(names.contains(&other), "an unrelated snapshot went too");
    // gc by label: the snapshots of a finished run go, and the store frees their bytes.
    let run2 = rand_suffix();
    let s = d.create(json!({"ttl_secs": 600, "labels": {"run": run2}}));
    d.exec(&s, "head -c 4000000 /dev/urandom > /root/c");
    let g1 = format!("gc-{run2}");
    snapshot(d, &s, json!({"name": g1}));
    let kept = d.create(json!({"ttl_secs": 600, "labels": {"run": run2}}));
    let g2 = format!("gc-{run2}-kept");
    snapshot(d, &kept, json!({"name": g2}));
    // A live fork keeps g2 needed.
    let live = fork(d, &g2);
    d.delete(&s);
    d.delete(&kept);
    let r = d
        .call(
            Method::POST,
            "/v1/snapshots/gc",
            Some(json!({"labels": {"run": run2}})),
        )
        .expect(200)
        .json();
    // (Another test's expired snapshot may go in the same pass.)
    let deleted = |r: &Value, n: &str| r["deleted"].as_array().unwrap().contains(&json!(n));
    assert!(deleted(&r, &g1) && !deleted(&r, &g2), "{r}");
    assert!(
        r["store"]["freed_bytes"].as_u64().unwrap_or(0) > 1_000_000,
        "the store kept the bytes: {r}"
    );
    d.delete(&live);
    let r = d
        .call(
            Method::POST,
            "/v1/snapshots/gc",
            Some(json!({"labels": {"run": run2}})),
        )
        .expect(200)
        .json();
    assert!(deleted(&r, &g2), "{r}");
    d.call(Method::DELETE, &format!("/v1/snapshots/{other}"), None)
        .expect(204);
    d.call(
        Method::DELETE,
        &format!("/v1/snapshots/{other}?descendants=maybe"),
        None,
    )
    .expect_error(400, Some("descendants"));
}

#[test]
fn batch_delete_by_label_and_job_says_how_many() {
    let d = node();
    let job = format!("bd-{}", rand_suffix());
    let tag = rand_suffix();
    let a = d.create(json!({"ttl_secs": 600, "job": job}));
    let b = d.create(json!({"ttl_secs": 600, "job": job, "labels": {"t": tag}}));
    let c = d.create(json!({"ttl_secs": 600, "labels": {"t": tag}}));
    let r = d
        .call(
            Method::POST,
            "/v1/sandboxes/delete",
            Some(json!({"job": job, "labels": {"t": tag}})),
        )
        .expect(200)
        .json();
    assert_eq!(r["deleted"], 1, "{r}");
    assert!(gone(d, &b) && !gone(d, &a) && !gone(d, &c));
    let r = d
        .call(
            Method::POST,
            "/v1/sandboxes/delete",
            Some(json!({"job": job})),
        )
        .expect(200)
        .json();
    assert_eq!(r["deleted"], 1, "{r}");
    assert!(gone(d, &a));
    let r = d
        .call(
            Method::POST,
            "/v1/sandboxes/delete",
            Some(json!({"labels": {"t": tag}})),
        )
        .expect(200)
        .json();
    assert_eq!(r["deleted"], 1, "{r}");
    assert!(gone(d, &c));
    d.call_invalid(
        Method::POST,
        "/v1/sandboxes/delete",
        &json!({"job": "no spaces"}).to_string(),
    )
    .expect_error(422, Some("job"));
}
