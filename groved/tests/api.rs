//! The HTTP API end to end against a real groved (see common/mod.rs): every endpoint, bad input, and every
//! request/response validated against openapi.yaml.

mod common;

use std::time::{Duration, Instant};

use base64::Engine as _;
use common::{daemon, rand_suffix, spec, sse_events, EXCLUSIVE, IMAGE};
use hyper::Method;
use serde_json::{json, Value};

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

#[test]
fn node_health_and_metrics() {
    let _g = EXCLUSIVE.read().unwrap();
    let d = daemon();
    let h = d.call(Method::GET, "/v1/health", None).expect(200).json();
    assert_eq!(h["status"], "ok");
    let n = d.call(Method::GET, "/v1/node", None).expect(200).json();
    assert_eq!(n["labels"]["purpose"], "groved-tests");
    assert_eq!(n["root_provider"], "nodefs");
    assert_eq!(n["capacity"]["total"]["memory_mb"], 8192);
    assert_eq!(n["capacity"]["total"]["sandboxes"], 64);
    // Something measured, so the histograms are not all empty.
    let id = d.create(json!({}));
    d.exec(&id, "true");
    d.delete(&id);
    let m = d.call(Method::GET, "/metrics", None).expect(200).text();
    for name in [
        "grove_create_duration_seconds_bucket",
        "grove_exec_duration_seconds_count",
        "grove_snapshot_duration_seconds_sum",
        "grove_restore_duration_seconds_count",
        "grove_fork_duration_seconds_count",
        "grove_sandboxes{state=\"running\"}",
        "grove_http_requests_total{route=\"/v1/sandboxes/{id}/exec\"",
    ] {
        assert!(m.contains(name), "metrics lack {name}:\n{m}");
    }
    let created: f64 = m
        .lines()
        .find(|l| l.starts_with("grove_create_duration_seconds_count"))
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(created >= 1.0);
    assert!(
        !m.contains("sb-"),
        "a sandbox id leaked into a metric label"
    );
}

#[test]
fn unknown_routes_and_methods_are_json_errors() {
    let d = daemon();
    let r = d.send_unchecked(Method::GET, "/v1/nope", None, &[]);
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["code"], "no_route");
}

#[test]
fn tcp_needs_the_api_key() {
    let d = daemon();
    let get = |auth: Option<&str>| {
        let mut s = std::net::TcpStream::connect(&d.tcp).unwrap();
        let auth = auth
            .map(|k| format!("Authorization: Bearer {k}\r\n"))
            .unwrap_or_default();
        std::io::Write::write_all(
            &mut s,
            format!("GET /v1/health HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n")
                .as_bytes(),
        )
        .unwrap();
        let mut out = String::new();
        std::io::Read::read_to_string(&mut s, &mut out).unwrap();
        out
    };
    assert!(get(None).starts_with("HTTP/1.1 401"));
    assert!(get(Some("wrong")).starts_with("HTTP/1.1 401"));
    let ok = get(Some(&d.api_key));
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
}

#[test]
fn images_import_list_delete() {
    let _g = EXCLUSIVE.read().unwrap();
    let d = daemon();
    let l = d.call(Method::GET, "/v1/images", None).expect(200).json();
    assert!(l["items"]
        .as_array()
        .unwrap()
        .iter()
        .any(|i| i["name"] == IMAGE));
    // Duplicate, bad name, bad source, missing path.
    d.call(
        Method::POST,
        "/v1/images",
        Some(json!({"name": IMAGE, "source": "dir", "path": common::BASE_IMAGE_DIR})),
    )
    .expect_error(409, Some("name"));
    d.call(
        Method::POST,
        "/v1/images",
        Some(json!({"name": "../x", "source": "dir", "path": "/tmp"})),
    )
    .expect_error(422, Some("name"));
    // Names the routes beside /v1/images/{name} take: such an image could not be reached.
    for name in ["pull", "build"] {
        let e = d
            .call(
                Method::POST,
                "/v1/images",
                Some(json!({"name": name, "source": "dir", "path": common::BASE_IMAGE_DIR})),
            )
            .expect_error(422, Some("name"));
        assert!(e["message"].as_str().unwrap().contains("reserved"), "{e}");
    }
    d.call(Method::POST, "/v1/images/build?name=pull", None)
        .expect_error(422, Some("name"));
    d.call(
        Method::POST,
        "/v1/images",
        Some(json!({"name": "x", "source": "zip", "path": "/tmp"})),
    )
    .expect_error(422, Some("source"));
    d.call(
        Method::POST,
        "/v1/images",
        Some(json!({"name": "x", "source": "dir", "path": "/nonexistent/grove"})),
    )
    .expect_error(404, Some("path"));
    d.call(
        Method::POST,
        "/v1/images",
        Some(json!({"name": "x", "source": "dir", "path": "relative"})),
    )
    .expect_error(422, Some("path"));
    // A tar upload becomes an image a sandbox can't boot (no shell), but it lists and deletes.
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(5);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_cksum();
    b.append_data(&mut h, "hello.txt", &b"hello"[..]).unwrap();
    let tarball = b.into_inner().unwrap();
    let name = format!("tarimg-{}", common::rand_suffix());
    let r = d.send(
        Method::PUT,
        &format!("/v1/images/{name}/tar"),
        Some(("application/x-tar", tarball.into())),
        &[],
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["name"], name.as_str());
    let l = d.call(Method::GET, "/v1/images", None).expect(200).json();
    assert!(l["items"]
        .as_array()
        .unwrap()
        .iter()
        .any(|i| i["name"] == name.as_str()));
    d.call(Method::DELETE, &format!("/v1/images/{name}"), None)
        .expect(204);
    d.call(Method::DELETE, &format!("/v1/images/{name}"), None)
        .expect_error(404, None);
    let r = d.send(
        Method::PUT,
        "/v1/images/garbage/tar",
        Some(("application/x-tar", b"not a tar at all".to_vec().into())),
        &[],
    );
    assert!(r.status == 400, "garbage tar: {} {}", r.status, r.text());
    // Store maintenance answers with a report.
    let gc = d.call(Method::POST, "/v1/node/gc", None).expect(200).json();
    assert_eq!(gc["ok"], true);
    let f = d
        .call(Method::POST, "/v1/node/fsck", None)
        .expect(200)
        .json();
    assert_eq!(f["ok"], true, "{f}");
}

#[test]
fn bad_create_input_names_the_field() {
    let _g = EXCLUSIVE.read().unwrap();
    let d = daemon();
    let post = |b: Value| d.call(Method::POST, "/v1/sandboxes", Some(b));
    post(json!({"image": "no-such-image"})).expect_error(404, Some("image"));
    post(json!({})).expect_error(422, Some("image"));
    post(json!({"image": IMAGE, "snapshot": "x"})).expect_error(422, Some("snapshot"));
    post(json!({"image": IMAGE, "limits": {"memory_mb": 0}})).expect_error(422, Some("memory_mb"));
    post(json!({"image": IMAGE, "limits": {"cpu_millis": 0}}))
        .expect_error(422, Some("cpu_millis"));
    post(json!({"image": IMAGE, "limits": {"pids": 0}})).expect_error(422, Some("pids"));
    post(json!({"image": IMAGE, "limits": {"memory_mb": 1u64 << 40}}))
        .expect_error(422, Some("memory_mb"));
    post(json!({"image": IMAGE, "limits": {"cpu_millis": 4_000_000}}))
        .expect_error(422, Some("cpu_millis"));
    post(json!({"image": IMAGE, "count": 0})).expect_error(422, Some("count"));
    // 0 is "no expiry" (even on a node with default_ttl_secs), not an error.
    let r = post(json!({"image": IMAGE, "ttl_secs": 0}))
        .expect(201)
        .json();
    assert_eq!(r["ttl_secs"], Value::Null);
    d.delete(r["id"].as_str().unwrap());
    post(
        json!({"image": IMAGE, "network": {"mode": "egress", "allow": [{"cidr": "10.0.0.0/33"}]}}),
    )
    .expect_error(422, Some("network.allow[0].cidr"));
    post(json!({"image": IMAGE, "network": {"mode": "egress", "allow": [{"cidr": "not-a-cidr"}]}}))
        .expect_error(422, Some("cidr"));
    post(json!({"image": IMAGE, "network": {"mode": "bridge"}}))
        .expect_error(422, Some("network.mode"));
    post(json!({"image": IMAGE, "hostname": "bad host"})).expect_error(422, Some("hostname"));
    post(json!({"image": IMAGE, "workdir": "rel"})).expect_error(422, Some("workdir"));
    post(json!({"image": IMAGE, "labels": {"bad key!": "v"}})).expect_error(422, Some("labels"));
    post(json!({"image": IMAGE, "cap_add": ["MKNOD", "SYS_ADMIN"]}))
        .expect_error(422, Some("cap_add[1]"));
    // Outside the schema: negative numbers, unknown fields, wrong types, broken JSON.
    let raw = |b: &str| d.call_invalid(Method::POST, "/v1/sandboxes", b);
    raw(r#"{"image":"debian12","limits":{"memory_mb":-5}}"#)
        .expect_error(422, Some("limits.memory_mb"));
    raw(r#"{"image":"debian12","bogus":1}"#).expect_error(422, Some("bogus"));
    raw(r#"{"image":"debian12","limits":{"memory":5}}"#).expect_error(422, Some("limits.memory"));
    raw(r#"{"image":5}"#).expect_error(422, Some("image"));
    let e = raw(r#"{"image": "#).expect_error(400, None);
    assert_eq!(e["code"], "invalid_json");
    // Nothing was left behind by any of it.
    let l = d
        .call(Method::GET, "/v1/sandboxes?label=case%3Dbad-input", None)
        .expect(200)
        .json();
    assert_eq!(l["items"].as_array().unwrap().len(), 0);
}

#[test]
fn sandbox_lifecycle_exec_files() {
    let _g = EXCLUSIVE.read().unwrap();
    let d = daemon();
    let id = d.create(
        json!({"env": {"GREETING": "hi"}, "labels": {"case": "lifecycle"}, "hostname": "box1"}),
    );
    let s = d
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .expect(200)
        .json();
    assert_eq!(s["state"], "running");
    assert_eq!(s["labels"]["case"], "lifecycle");
    assert_eq!(s["limits"]["memory_mb"], 256);

    // exec: argv, shell, env, cwd, exit codes, stdin, base64, timeout.
    let ex = |b: Value| {
        d.call(Method::POST, &format!("/v1/sandboxes/{id}/exec"), Some(b))
            .expect(200)
            .json()
    };
    let r = ex(json!({"argv": ["sh", "-c", "echo $GREETING $(hostname); echo err >&2; exit 3"]}));
    assert_eq!(
        (
            r["stdout"].as_str(),
            r["stderr"].as_str(),
            r["exit_code"].as_i64()
        ),
        (Some("hi box1\n"), Some("err\n"), Some(3))
    );
    assert_eq!(r["timed_out"], false);
    let r = ex(json!({"shell": "pwd; echo $X", "cwd": "/tmp", "env": {"X": "y"}}));
    assert_eq!(r["stdout"], "/tmp\ny\n");
    let r = ex(json!({"argv": ["cat"], "stdin": b64("piped"), "encoding": "base64"}));
    assert_eq!(r["stdout"], b64("piped"));
    assert_eq!(r["encoding"], "base64");
    let t = Instant::now();
    let r = ex(json!({"shell": "sleep 30", "timeout_ms": 300}));
    assert_eq!(r["timed_out"], true);
    assert!(t.elapsed() < Duration::from_secs(10));
    let r = ex(json!({"shell": "kill -9 $$"}));
    assert_eq!(r["signal"], 9);
    // exec input errors
    let bad = |b: Value, field: &str| {
        d.call(Method::POST, &format!("/v1/sandboxes/{id}/exec"), Some(b))
            .expect_error(422, Some(field));
    };
    bad(json!({}), "argv");
    bad(json!({"argv": []}), "argv");
    bad(json!({"argv": ["true"], "shell": "true"}), "shell");
    bad(json!({"shell": "true", "timeout_ms": 0}), "timeout_ms");
    bad(json!({"shell": "true", "cwd": "relative"}), "cwd");
    bad(json!({"shell": "true", "stdin": "%%%"}), "stdin");

    // streaming exec
    let evs = sse_events(
        d,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec/stream"),
        Some(json!({"shell": "for i in 1 2 3; do echo line$i; done; echo oops >&2; exit 7"})),
        |e, _| e == "exit" || e == "error",
    );
    let out: String = evs
        .iter()
        .filter(|(e, _)| e == "stdout")
        .map(|(_, v)| v["data"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(out, "line1\nline2\nline3\n");
    assert!(evs
        .iter()
        .any(|(e, v)| e == "stderr" && v["data"] == "oops\n"));
    let (last, v) = evs.last().unwrap();
    assert_eq!(last, "exit");
    spec().check_schema("ExecResult", v).unwrap();
    assert_eq!(v["exit_code"], 7);

    // files: write, read, list, mode, traversal, missing
    let w = d.send(
        Method::PUT,
        &format!("/v1/sandboxes/{id}/files?path=/tmp/data.bin&mode=600"),
        Some(("application/octet-stream", vec![0u8, 1, 2, 255].into())),
        &[],
    );
    assert_eq!(w.status, 204, "{}", w.text());
    let r = d.send(
        Method::GET,
        &format!("/v1/sandboxes/{id}/files?path=/tmp/data.bin"),
        None,
        &[],
    );
    assert_eq!((r.status, &r.body[..]), (200, &[0u8, 1, 2, 255][..]));
    let l = d
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files/list?path=/tmp"),
            None,
        )
        .expect(200)
        .json();
    let e = l["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "data.bin")
        .cloned()
        .unwrap();
    assert_eq!(
        (
            e["size"].as_u64(),
            e["kind"].as_str(),
            e["mode"].as_u64().map(|m| m & 0o777)
        ),
        (Some(4), Some("file"), Some(0o600))
    );
    d.send(
        Method::GET,
        &format!("/v1/sandboxes/{id}/files?path=/tmp/../../etc/shadow"),
        None,
        &[],
    )
    .expect_error(400, Some("path"));
    d.send(
        Method::GET,
        &format!("/v1/sandboxes/{id}/files?path=etc/passwd"),
        None,
        &[],
    )
    .expect_error(400, Some("path"));
    d.send(Method::GET, &format!("/v1/sandboxes/{id}/files"), None, &[])
        .expect_error(400, Some("path"));
    d.send(
        Method::GET,
        &format!("/v1/sandboxes/{id}/files?path=/no/such/file"),
        None,
        &[],
    )
    .expect_error(404, None);
    // A symlink pointing out of the sandbox does not lead out.
    ex(json!({"shell": "ln -s /../../../../etc /tmp/escape"}));
    let r = d.send(
        Method::GET,
        &format!("/v1/sandboxes/{id}/files?path=/tmp/escape/hostname"),
        None,
        &[],
    );
    let inside = ex(json!({"shell": "cat /etc/hostname"}))["stdout"]
        .as_str()
        .unwrap()
        .to_string();
    if r.status == 200 {
        assert_eq!(
            r.text(),
            inside,
            "read through a symlink must stay in the sandbox"
        );
    }

    // tar upload and download
    let mut b = tar::Builder::new(Vec::new());
    for (name, body) in [("proj/a.txt", "A"), ("proj/sub/b.txt", "BB")] {
        let mut h = tar::Header::new_gnu();
        h.set_size(body.len() as u64);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_cksum();
        b.append_data(&mut h, name, body.as_bytes()).unwrap();
    }
    let up = d.send(
        Method::PUT,
        &format!("/v1/sandboxes/{id}/archive?path=/work"),
        Some(("application/x-tar", b.into_inner().unwrap().into())),
        &[],
    );
    assert_eq!(up.status, 204, "{}", up.text());
    assert_eq!(
        ex(json!({"shell": "cat /work/proj/a.txt /work/proj/sub/b.txt"}))["stdout"],
        "ABB"
    );
    let dl = d
        .send(
            Method::GET,
            &format!("/v1/sandboxes/{id}/archive?path=/work/proj"),
            None,
            &[],
        )
        .expect(200);
    let mut names: Vec<String> = tar::Archive::new(&dl.body[..])
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().display().to_string())
        .filter(|n| n.ends_with(".txt"))
        .collect();
    names.sort();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(names[0].ends_with("a.txt") && names[1].ends_with("b.txt"));

    // background processes
    let p = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/processes"),
            Some(json!({"shell": "sleep 300"})),
        )
        .expect(201)
        .json();
    let pid = p["pid"].as_i64().unwrap();
    let l = d
        .call(Method::GET, &format!("/v1/sandboxes/{id}/processes"), None)
        .expect(200)
        .json();
    assert!(
        l["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["pid"] == pid && x["running"] == true),
        "{l}"
    );
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/processes/{pid}/signal"),
        Some(json!({"signal": 15})),
    )
    .expect(204);
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/processes/{pid}/signal"),
        Some(json!({"signal": 99})),
    )
    .expect_error(422, Some("signal"));
    let t = Instant::now();
    loop {
        let l = d
            .call(Method::GET, &format!("/v1/sandboxes/{id}/processes"), None)
            .expect(200)
            .json();
        if !l["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["pid"] == pid && x["running"] == true)
        {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "SIGTERM did not stop {pid}: {l}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The signal reached the shell's child too.
    assert_eq!(
        ex(json!({"shell": "ps -eo args | grep -c '^sleep 300' || true"}))["stdout"],
        "0\n"
    );

    // usage, ttl, pause/resume
    let u = d
        .call(Method::GET, &format!("/v1/sandboxes/{id}/usage"), None)
        .expect(200)
        .json();
    assert!(
        u["memory_bytes"].as_u64().unwrap() > 0 && u["pids"].as_u64().unwrap() >= 1,
        "{u}"
    );
    let s = d
        .call(
            Method::PUT,
            &format!("/v1/sandboxes/{id}/ttl"),
            Some(json!({"ttl_secs": 3600})),
        )
        .expect(200)
        .json();
    assert!(s["expires_at_ms"].as_u64().unwrap() > s["created_at_ms"].as_u64().unwrap());
    let s = d
        .call(
            Method::PUT,
            &format!("/v1/sandboxes/{id}/ttl"),
            Some(json!({"ttl_secs": null})),
        )
        .expect(200)
        .json();
    assert!(s["expires_at_ms"].is_null());
    d.call(
        Method::PUT,
        &format!("/v1/sandboxes/{id}/ttl"),
        Some(json!({"ttl_secs": 0})),
    )
    .expect_error(422, Some("ttl_secs"));
    d.call_invalid(Method::PUT, &format!("/v1/sandboxes/{id}/ttl"), "{}")
        .expect_error(422, Some("ttl_secs"));
    let e = d
        .send(Method::PUT, &format!("/v1/sandboxes/{id}/ttl"), None, &[])
        .expect_error(400, Some("body"));
    assert_eq!(e["code"], "invalid_json");
    // Pause to the store and back, with this sandbox's whole history, and a shell that exited
    // before its child (a session without its leader: CRIU restores it through a helper task).
    ex(json!({"shell": "sleep 1000 >/dev/null 2>&1 &"}));
    d.send(
        Method::PUT,
        &format!("/v1/sandboxes/{id}/files?path=/root/kept"),
        Some(("application/octet-stream", b"kept".to_vec().into())),
        &[],
    )
    .expect(204);
    let s = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/pause?to=store"),
            None,
        )
        .expect(200)
        .json();
    assert_eq!(s["state"], "paused");
    assert!(
        s["init_pid"].is_null(),
        "paused to the store: nothing runs: {s}"
    );
    d.call(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None)
        .expect_error(409, None);
    let s = d
        .call(Method::POST, &format!("/v1/sandboxes/{id}/resume"), None)
        .expect(200)
        .json();
    assert_eq!(s["state"], "running");
    d.call(Method::POST, &format!("/v1/sandboxes/{id}/resume"), None)
        .expect_error(409, None);
    // Files written before a pause are there after it; an exec on a paused sandbox resumes it.
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/pause?to=store"),
        None,
    )
    .expect(200);
    let r = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"shell": "cat /root/kept; hostname"})),
        )
        .expect(200)
        .json();
    assert_eq!(r["stdout"], "keptbox1\n");
    assert_eq!(
        ex(json!({"shell": "ps -eo args | grep -c '^sleep 1000'"}))["stdout"],
        "1\n"
    );
    let s = d
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .expect(200)
        .json();
    assert_eq!(s["state"], "running");

    // delete; then everything about it is 404
    d.delete(&id);
    d.call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .expect_error(404, None);
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"shell": "true"})),
    )
    .expect_error(404, None);
    d.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .expect_error(404, None);
    d.send(
        Method::GET,
        &format!("/v1/sandboxes/{id}/files?path=/etc/hostname"),
        None,
        &[],
    )
    .expect_error(404, None);
    d.call(Method::GET, "/v1/sandboxes/not-an-id", None)
        .expect_error(400, Some("id"));
}

#[test]
fn batches_labels_pagination_idempotency() {
    let _g = EXCLUSIVE.read().unwrap();
    let d = daemon();
    let tag = common::rand_suffix();
    let r = d
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"image": IMAGE, "count": 3, "labels": {"batch": tag}})),
        )
        .expect(201)
        .json();
    let ids: Vec<String> = r["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["sandbox"]["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids.len(), 3);
    // label filter + pagination
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let q = match &token {
            Some(t) => format!("/v1/sandboxes?label=batch%3D{tag}&limit=2&page_token={t}"),
            None => format!("/v1/sandboxes?label=batch%3D{tag}&limit=2"),
        };
        let page = d.call(Method::GET, &q, None).expect(200).json();
        assert!(page["items"].as_array().unwrap().len() <= 2);
        seen.extend(
            page["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["id"].as_str().unwrap().to_string()),
        );
        match page["next_page_token"].as_str() {
            Some(t) => token = Some(t.to_string()),
            None => break,
        }
    }
    seen.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(seen, want);
    let l = d
        .call(
            Method::GET,
            &format!("/v1/sandboxes?label=batch%3D{tag}&state=paused"),
            None,
        )
        .expect(200)
        .json();
    assert_eq!(l["items"].as_array().unwrap().len(), 0);
    d.call(Method::GET, "/v1/sandboxes?state=sleepy", None)
        .expect_error(400, Some("state"));
    d.call(Method::GET, "/v1/sandboxes?limit=0", None)
        .expect_error(400, Some("limit"));

    // Idempotency-Key: same key + same body → same sandbox; same key + other body → 422.
    let key = format!("k-{tag}");
    let body = json!({"image": IMAGE, "labels": {"batch": tag, "idem": "1"}});
    let send = |b: &Value| {
        d.send(
            Method::POST,
            "/v1/sandboxes",
            Some(("application/json", b.to_string().into())),
            &[("Idempotency-Key", key.as_str())],
        )
    };
    let a = send(&body);
    assert_eq!(a.status, 201, "{}", a.text());
    let b = send(&body);
    assert_eq!(b.status, 201);
    assert_eq!(a.json()["id"], b.json()["id"]);
    assert_eq!(
        b.headers
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true")
    );
    let other = json!({"image": IMAGE, "labels": {"batch": tag, "idem": "2"}});
    let c = send(&other);
    assert_eq!(c.status, 422);
    assert_eq!(c.json()["code"], "idempotency_key_reused");
    let l = d
        .call(
            Method::GET,
            &format!("/v1/sandboxes?label=idem%3D1&label=batch%3D{tag}"),
            None,
        )
        .expect(200)
        .json();
    assert_eq!(
        l["items"].as_array().unwrap().len(),
        1,
        "a replayed create made a second sandbox"
    );
    // Idempotent delete replays its 204.
    let idem_id = a.json()["id"].as_str().unwrap().to_string();
    let del = |k: &str| {
        d.send(
            Method::DELETE,
            &format!("/v1/sandboxes/{idem_id}"),
            None,
            &[("Idempotency-Key", k)],
        )
    };
    assert_eq!(del("del-1").status, 204);
    assert_eq!(del("del-1").status, 204);
    assert_eq!(del("del-2").status, 404);

    // batch delete by label
    let r = d
        .call(
            Method::POST,
            "/v1/sandboxes/delete",
            Some(json!({"labels": {"batch": tag}, "ids": ["sb-000000000000"]})),
        )
        .expect(200)
        .json();
    let res = r["results"].as_array().unwrap();
    assert_eq!(
        res.iter().filter(|x| x["deleted"] == true).count(),
        3,
        "{r}"
    );
    assert!(res
        .iter()
        .any(|x| x["id"] == "sb-000000000000" && x["error"]["code"] == "not_found"));
    d.call(Method::POST, "/v1/sandboxes/delete", Some(json!({})))
        .expect_error(422, Some("ids"));
}

#[test]
fn ttl_expiry_and_events() {
    let _g = EXCLUSIVE.read().unwrap();
    let d = daemon();
    let creator = std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(300));
        let d = daemon();
        let id = d.create(json!({"ttl_secs": 1, "labels": {"case": "ttl"}}));
        let t = Instant::now();
        loop {
            let r = d.call(Method::GET, &format!("/v1/sandboxes/{id}"), None);
            if r.status == 404 {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(15),
                "ttl 1s sandbox still there"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        id
    });
    let mut created = None;
    let evs = sse_events(d, Method::GET, "/v1/events", None, |e, v| {
        spec().check_schema("Event", v).unwrap();
        if e == "created" && created.is_none() {
            created = v["sandbox"].as_str().map(String::from);
        }
        (e == "expired" || e == "destroyed") && v["sandbox"].as_str() == created.as_deref()
    });
    let id = creator.join().unwrap();
    assert!(
        evs.iter()
            .any(|(e, v)| e == "created" && v["sandbox"] == id.as_str()),
        "{evs:?}"
    );
    assert!(
        evs.iter()
            .any(|(e, v)| (e == "expired" || e == "destroyed") && v["sandbox"] == id.as_str()),
        "{evs:?}"
    );
}

#[test]
fn idle_sandboxes_are_paused_or_destroyed_and_resume_on_the_next_request() {
    let _g = EXCLUSIVE.read().unwrap();
    let d = daemon();
    let post = |b: Value| d.call(Method::POST, "/v1/sandboxes", Some(b));
    d.call_invalid(
        Method::POST,
        "/v1/sandboxes",
        &json!({"image": IMAGE, "on_idle": "nap", "idle_timeout_secs": 5}).to_string(),
    )
    .expect_error(422, Some("on_idle"));
    post(json!({"image": IMAGE, "idle_timeout_secs": 0}))
        .expect_error(422, Some("idle_timeout_secs"));
    post(json!({"image": IMAGE, "on_idle": "destroy"}))
        .expect_error(422, Some("idle_timeout_secs"));

    let napper = d.create(json!({"idle_timeout_secs": 1, "labels": {"case": "idle"}}));
    let goner = d.create(json!({"idle_timeout_secs": 1, "on_idle": "destroy"}));
    let s = d
        .call(Method::GET, &format!("/v1/sandboxes/{napper}"), None)
        .expect(200)
        .json();
    assert_eq!(
        (s["idle_timeout_secs"].as_u64(), s["on_idle"].as_str()),
        (Some(1), Some("pause"))
    );
    let t = Instant::now();
    let (mut paused, mut gone) = (false, false);
    while !(paused && gone) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "idle reclaim did not happen (paused {paused}, gone {gone})"
        );
        std::thread::sleep(Duration::from_millis(200));
        let s = d
            .call(Method::GET, &format!("/v1/sandboxes/{napper}"), None)
            .expect(200)
            .json();
        paused = s["state"] == "paused" && s["init_pid"].is_null();
        gone = d
            .call(Method::GET, &format!("/v1/sandboxes/{goner}"), None)
            .status
            == 404;
    }
    // The next request resumes it, transparently.
    let r = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{napper}/exec"),
            Some(json!({"shell": "echo awake"})),
        )
        .expect(200)
        .json();
    assert_eq!(r["stdout"], "awake\n");
    d.delete(&napper);
}

#[test]
fn node_full_is_429_with_retry_after() {
    let _g = EXCLUSIVE.write().unwrap();
    let d = daemon();
    let big = json!({"image": IMAGE, "limits": {"memory_mb": 5000}});
    let a = d
        .call(Method::POST, "/v1/sandboxes", Some(big.clone()))
        .expect(201)
        .json();
    let r = d.call(Method::POST, "/v1/sandboxes", Some(big.clone()));
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.headers.get("retry-after").is_some());
    assert_eq!(r.json()["code"], "capacity_exceeded");
    let mut batch = big.clone();
    batch["count"] = json!(2);
    let r = d.call(Method::POST, "/v1/sandboxes", Some(batch));
    assert_eq!(r.status, 429, "{}", r.text());
    d.delete(a["id"].as_str().unwrap());
    // Room again.
    let b = d
        .call(Method::POST, "/v1/sandboxes", Some(big))
        .expect(201)
        .json();
    d.delete(b["id"].as_str().unwrap());
}

#[test]
fn snapshot_fork_export_import() {
    let _g = EXCLUSIVE.read().unwrap();
    let d = daemon();
    let n = d.call(Method::GET, "/v1/node", None).expect(200).json();
    assert_eq!(
        n["snapshots_enabled"],
        true,
        "CRIU is installed here, so snapshots must work; log:\n{}",
        d.log()
    );
    let id = d.create(json!({"labels": {"case": "snap"}}));
    d.exec(&id, "echo base > /root/state.txt");
    d.call(Method::POST, &format!("/v1/sandboxes/{id}/processes"), Some(json!({"shell": "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done"}))).expect(201);
    std::thread::sleep(Duration::from_millis(500));
    let name = format!("snap-{}", common::rand_suffix());
    let s = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/snapshot"),
            Some(json!({"name": name})),
        )
        .expect(201)
        .json();
    assert_eq!(s["name"], name.as_str());
    assert_eq!(s["source_sandbox"], id.as_str());
    assert!(
        s["memory_dump"] == "full" || s["memory_dump"] == "soft_dirty",
        "the snapshot names its memory path: {s}"
    );
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/snapshot"),
        Some(json!({"name": name})),
    )
    .expect_error(409, None);
    // A second snapshot of a tracked sandbox dumps only what was written since the first; a
    // full dump where tracking works says why.
    let name2 = format!("{name}-2");
    let s2 = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/snapshot"),
            Some(json!({"name": name2})),
        )
        .expect(201)
        .json();
    match s["full_dump_reason"].as_str() {
        Some(why) => {
            assert_eq!(s["memory_dump"], "full", "{s}");
            assert_eq!(
                s2["memory_dump"], "uffd_wp",
                "tracked since the first snapshot ({why}): {s2}"
            );
        }
        None => assert!(
            s2["memory_dump"] == "full" || s2["memory_dump"] == "soft_dirty",
            "no tracking here, so no incremental dump: {s2}"
        ),
    }
    d.call(Method::DELETE, &format!("/v1/snapshots/{name2}"), None)
        .expect(204);
    let l = d
        .call(Method::GET, "/v1/snapshots", None)
        .expect(200)
        .json();
    assert!(l["items"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["name"] == name.as_str()));
    d.call(Method::GET, &format!("/v1/snapshots/{name}"), None)
        .expect(200);
    d.call(Method::GET, "/v1/snapshots/no-such-snap", None)
        .expect_error(404, None);

    // fork 2: both have the file and a running counter; they diverge
    let branches = d.fork(
        &name,
        json!({"count": 2, "labels": {"case": "snap-branch"}}),
    );
    assert_eq!(branches.len(), 2);
    for (i, b) in branches.iter().enumerate() {
        assert_eq!(d.exec(b, "cat /root/state.txt")["stdout"], "base\n");
        d.exec(b, &format!("echo branch{i} > /root/state.txt"));
        let c1: u64 = d.exec(b, "cat /tmp/counter")["stdout"]
            .as_str()
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        std::thread::sleep(Duration::from_millis(400));
        let c2: u64 = d.exec(b, "cat /tmp/counter")["stdout"]
            .as_str()
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(c2 > c1, "the restored process runs on in {b}");
    }
    assert_eq!(
        d.exec(&branches[0], "cat /root/state.txt")["stdout"],
        "branch0\n"
    );
    assert_eq!(
        d.exec(&branches[1], "cat /root/state.txt")["stdout"],
        "branch1\n"
    );
    assert_eq!(d.exec(&id, "cat /root/state.txt")["stdout"], "base\n");
    // An idempotent fork replays its branches instead of making more.
    let key = format!("fork-{name}");
    let fork1 = || {
        d.send(
            Method::POST,
            &format!("/v1/snapshots/{name}/fork"),
            Some(("application/json", json!({"count": 1}).to_string().into())),
            &[("Idempotency-Key", key.as_str())],
        )
    };
    let (f1, f2) = (fork1(), fork1());
    assert_eq!((f1.status, f2.status), (201, 201), "{}", f1.text());
    let idem_branch = f1.json()["results"][0]["sandbox"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        f2.json()["results"][0]["sandbox"]["id"],
        idem_branch.as_str()
    );
    d.delete(&idem_branch);
    // create from a snapshot = a one-branch fork
    let one = d
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"snapshot": name})),
        )
        .expect(201)
        .json();
    let one = one["id"].as_str().unwrap().to_string();
    assert_eq!(d.exec(&one, "cat /root/state.txt")["stdout"], "base\n");
    d.call(
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"snapshot": name, "limits": {"memory_mb": 64}})),
    )
    .expect_error(422, Some("limits"));
    d.call(
        Method::POST,
        &format!("/v1/snapshots/{name}/fork"),
        Some(json!({"count": 0})),
    )
    .expect_error(422, Some("count"));

    // export → delete → import → fork again
    let ex = d
        .send(
            Method::GET,
            &format!("/v1/snapshots/{name}/export"),
            None,
            &[],
        )
        .expect(200);
    assert!(ex.body.len() > 1000);

    // delta transfer: the objects list, what this node lacks, an export of just those
    let objs = d
        .call(Method::GET, &format!("/v1/snapshots/{name}/objects"), None)
        .expect(200)
        .json();
    let objs: Vec<String> = serde_json::from_value(objs["objects"].clone()).unwrap();
    assert!(objs.len() > 10, "{objs:?}");
    let absent = "ab".repeat(32);
    let mut asked = objs[..3].to_vec();
    asked.push(absent.clone());
    let m = d
        .call(
            Method::POST,
            "/v1/snapshots/missing",
            Some(json!({ "objects": asked })),
        )
        .expect(200)
        .json();
    assert_eq!(
        m["objects"],
        json!([absent]),
        "this node holds its own objects"
    );
    d.send(
        Method::POST,
        "/v1/snapshots/missing",
        Some((
            "application/json",
            br#"{"objects": ["XYZ"]}"#.to_vec().into(),
        )),
        &[],
    )
    .expect_error(422, Some("objects"));
    let delta = |missing: &[String]| {
        d.send(
            Method::POST,
            &format!("/v1/snapshots/{name}/export"),
            Some((
                "application/json",
                serde_json::to_vec(&json!({ "missing": missing }))
                    .unwrap()
                    .into(),
            )),
            &[],
        )
        .expect(200)
        .body
    };
    // pull: from a peer (here this node's own TCP address; its key is given for that source, since
    // the node's own key is never sent anywhere)
    let pull = |source: &str, snap: &str| {
        d.call(
            Method::POST,
            "/v1/snapshots/pull",
            Some(json!({"source": source, "name": snap, "source_api_key": d.api_key})),
        )
    };
    let me = format!("http://{}", d.tcp);
    pull(&me, &name).expect_error(409, None); // already here
    let e = pull(&me, "no-such-snapshot").expect_error(404, None);
    assert!(
        e["message"].as_str().unwrap().contains("answered 404"),
        "{e}"
    );
    pull("ftp://x", &name).expect_error(422, Some("source"));
    pull("http://peer.example:7070", &name).expect_error(422, Some("source"));
    pull(&format!("{me}/v1"), &name).expect_error(422, Some("source"));
    pull("http://127.0.0.1:1", "other").expect_error(502, Some("source"));
    let empty = delta(&[]);
    let some = delta(&objs[..objs.len() / 2]);
    assert!(
        empty.len() < some.len() && some.len() < ex.body.len(),
        "delta sizes {} < {} < {}",
        empty.len(),
        some.len(),
        ex.body.len()
    );
    for b in branches.iter().chain([&one, &id]) {
        d.delete(b);
    }
    d.call(Method::DELETE, &format!("/v1/snapshots/{name}"), None)
        .expect(204);
    d.call(Method::GET, &format!("/v1/snapshots/{name}"), None)
        .expect_error(404, None);
    let im = d.send(
        Method::POST,
        "/v1/snapshots/import",
        Some(("application/octet-stream", ex.body.clone())),
        &[],
    );
    assert_eq!(im.status, 201, "{}", im.text());
    let imported = im.json()["id"].as_str().unwrap().to_string();
    let f = d
        .call(
            Method::POST,
            &format!("/v1/snapshots/{imported}/fork"),
            Some(json!({"count": 1})),
        )
        .expect(201)
        .json();
    let b = f["results"][0]["sandbox"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(d.exec(&b, "cat /root/state.txt")["stdout"], "base\n");
    d.delete(&b);
    d.call(Method::DELETE, &format!("/v1/snapshots/{imported}"), None)
        .expect(204);
    let bad = d.send(
        Method::POST,
        "/v1/snapshots/import",
        Some(("application/octet-stream", b"garbage".to_vec().into())),
        &[],
    );
    assert_eq!(bad.status, 400, "{}", bad.text());
}

/// Sandboxes that ran, wrote files and left a process behind leave nothing once deleted. The
/// test makes and deletes its own, whatever ran before it: residue never counts a live sandbox's
/// things, so other tests' sandboxes (left or not) do not matter, and the node is held to itself
/// so that none is half made or half destroyed while it scans.
#[test]
fn deleted_sandboxes_leave_no_residue() {
    let _g = EXCLUSIVE.write().unwrap();
    let d = daemon();
    let status = |id: &str| {
        d.call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .status
    };
    let ours: Vec<String> = (0..2)
        .map(|_| d.create(json!({"labels": {"case": "residue"}})))
        .collect();
    for id in &ours {
        let r = d.exec(
            id,
            "mkdir -p /tmp/x; echo hi > /dev/shm/y; sleep 1000 >/dev/null 2>&1 & echo ok",
        );
        assert_eq!(r["stdout"], "ok\n", "{r}");
        assert_eq!(status(id), 200);
    }
    for id in &ours {
        d.delete(id);
        assert_eq!(status(id), 404, "{id} is gone");
    }
    let r = d.residue();
    assert_eq!(r["clean"], true, "{r}");
}

/// A one-layer OCI image layout in `dir`, tagged `v1`.
fn oci_layout(dir: &std::path::Path) {
    use sha2::{Digest, Sha256};
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let put = |data: &[u8]| -> (String, usize) {
        let hex = format!("{:x}", Sha256::digest(data));
        std::fs::write(blobs.join(&hex), data).unwrap();
        (format!("sha256:{hex}"), data.len())
    };
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(8);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_cksum();
    b.append_data(&mut h, "oci.txt", &b"from oci"[..]).unwrap();
    let (layer, layer_len) = put(&b.into_inner().unwrap());
    let config = json!({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": [layer]}});
    let (cfg, cfg_len) = put(config.to_string().as_bytes());
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg, "size": cfg_len},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer, "size": layer_len}],
    });
    let (man, man_len) = put(manifest.to_string().as_bytes());
    let index = json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": man, "size": man_len,
        "annotations": {"org.opencontainers.image.ref.name": "v1"}}]});
    std::fs::write(dir.join("index.json"), index.to_string()).unwrap();
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
}

#[test]
fn oci_layout_import() {
    let _g = EXCLUSIVE.read().unwrap();
    let d = daemon();
    let dir = tempfile::Builder::new()
        .prefix("grove-oci-")
        .tempdir()
        .unwrap();
    oci_layout(dir.path());
    let path = dir.path().display().to_string();
    let name = format!("oci-{}", common::rand_suffix());
    let body = |reference: &str| json!({"name": name, "source": "oci", "path": path, "reference": reference});
    d.call(Method::POST, "/v1/images", Some(body("no-such-tag")))
        .expect_error(400, None);
    let img = d
        .call(Method::POST, "/v1/images", Some(body("v1")))
        .expect(201)
        .json();
    assert_eq!(img["name"], name.as_str());
    assert!(img["root"].as_str().is_some_and(|r| r.len() == 64), "{img}");
    let l = d.call(Method::GET, "/v1/images", None).expect(200).json();
    assert!(l["items"]
        .as_array()
        .unwrap()
        .iter()
        .any(|i| i["name"] == name.as_str() && i["root"] == img["root"]));
    d.call(
        Method::POST,
        "/v1/images",
        Some(json!({"name": "x", "source": "dir", "path": path, "reference": "v1"})),
    )
    .expect_error(422, Some("reference"));
    d.call(Method::DELETE, &format!("/v1/images/{name}"), None)
        .expect(204);
}

#[test]
fn pools_jobs_and_their_metrics() {
    // Pools take node room: keep capacity tests out while this runs.
    let _g = EXCLUSIVE.write().unwrap();
    let d = daemon();
    let job = format!("api-{}", rand_suffix());
    let small = json!({"memory_mb": 64});
    let p = d
        .call(
            Method::PUT,
            "/v1/pools",
            Some(json!({"pools": [{"image": IMAGE, "limits": small, "mode": "fixed", "max": 1}]})),
        )
        .expect(200)
        .json();
    assert_eq!(p["config"]["pools"][0]["limits"]["memory_mb"], 64);
    assert_eq!(
        p["config"]["pools"][0]["limits"]["cpu_millis"], 500,
        "node defaults fill the rest"
    );
    let t0 = std::time::Instant::now();
    while d.call(Method::GET, "/v1/pools", None).expect(200).json()["pools"][0]["idle"] != 1 {
        assert!(t0.elapsed().as_secs() < 30, "pool never filled");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let sb = d
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"image": IMAGE, "limits": small, "job": job, "priority": 2, "hostname": "warm"})),
        )
        .expect(201)
        .json();
    assert_eq!(sb["job"], job.as_str());
    assert_eq!(sb["priority"], 2);
    let id = sb["id"].as_str().unwrap().to_string();
    assert_eq!(d.exec(&id, "hostname")["stdout"], "warm\n");
    let pools = d.call(Method::GET, "/v1/pools", None).expect(200).json();
    assert_eq!(pools["pools"][0]["hits"], 1, "{pools}");

    let jobs = d
        .call(
            Method::PUT,
            "/v1/jobs",
            Some(json!({"queue_timeout_ms": 300, "jobs": {job.clone(): {"share": 3, "max_sandboxes": 1}}})),
        )
        .expect(200)
        .json();
    let mine = jobs["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["job"] == job.as_str())
        .unwrap()
        .clone();
    assert_eq!(mine["usage"]["sandboxes"], 1);
    assert_eq!(mine["policy"]["share"], 3);
    // At its quota: the next create of the job waits out the queue timeout, then 429.
    let r = d.call(
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"image": IMAGE, "limits": small, "job": job})),
    );
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.headers.get("retry-after").is_some());
    assert!(r.json()["message"]
        .as_str()
        .unwrap()
        .contains("max_sandboxes"));
    let m = d.call(Method::GET, "/metrics", None).expect(200).text();
    assert!(
        m.contains(&format!("grove_job_running{{job=\"{job}\"}} 1")),
        "{m}"
    );
    assert!(m.contains(&format!(
        "grove_job_queue_timeouts_total{{job=\"{job}\"}} 1"
    )));
    assert!(m.contains("grove_pool_hits_total{image=\"debian12\",memory_mb=\"64\""));

    d.call_invalid(
        Method::PUT,
        "/v1/jobs",
        &json!({"jobs": {"bad": {"share": 0}}}).to_string(),
    )
    .expect_error(422, Some("jobs.bad.share"));
    d.call(
        Method::PUT,
        "/v1/jobs",
        Some(json!({"queue_timeout_ms": 300})),
    )
    .expect(200);
    d.call_invalid(
        Method::POST,
        "/v1/sandboxes",
        &json!({"image": IMAGE, "job": "no spaces"}).to_string(),
    )
    .expect_error(422, Some("job"));
    d.delete(&id);
    let p = d
        .call(Method::PUT, "/v1/pools", Some(json!({})))
        .expect(200)
        .json();
    assert_eq!(p["pools"].as_array().map(Vec::len), Some(0), "{p}");
    assert_eq!(d.residue()["items"], json!([]));
}
