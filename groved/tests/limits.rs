//! What a sandbox (or an API client) can make groved hold in memory or wait on, attacked the way the
//! tester did: a 1 GiB sparse file read, 300 MB of exec output, FIFOs in the files API, a 64 MiB JSON
//! body, uploads past the disk quota. groved's peak RSS (VmHWM, reset before each attack) must stay
//! bounded and every answer come promptly.

mod common;

use std::io::{Read as _, Write as _};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{daemon, Daemon, EXCLUSIVE};
use http_body_util::BodyExt as _;
use hyper::Method;
use serde_json::{json, Value};
use sha2::Digest as _;

/// The memory attacks run one at a time: each measures groved's peak alone.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const MIB: u64 = 1 << 20;

fn status_kib(pid: i32, key: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
}

/// Peak-RSS meter: resets groved's high-water mark, then reports how far the peak rose above the
/// RSS it had at the start.
struct Peak {
    pid: i32,
    base_kib: u64,
}

impl Peak {
    fn start(d: &Daemon) -> Peak {
        // "5" resets VmHWM to the current RSS (proc(5), clear_refs).
        std::fs::write(format!("/proc/{}/clear_refs", d.pid()), "5").unwrap();
        Peak {
            pid: d.pid(),
            base_kib: status_kib(d.pid(), "VmRSS:"),
        }
    }
    fn rise_bytes(&self) -> u64 {
        status_kib(self.pid, "VmHWM:").saturating_sub(self.base_kib) * 1024
    }
    fn assert_below(&self, what: &str, bound: u64) {
        let rise = self.rise_bytes();
        assert!(
            rise < bound,
            "{what}: groved's RSS peaked {} MiB above its start (bound {} MiB)",
            rise / MIB,
            bound / MIB
        );
    }
}

/// GET streamed to the end: (status, length, sha256), without holding the body.
fn get_streamed(d: &Daemon, path: &str) -> (u16, u64, String, Vec<u8>) {
    d.rt.block_on(async {
        let stream = tokio::net::UnixStream::connect(&d.socket).await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        let req = hyper::Request::builder()
            .method(Method::GET)
            .uri(path)
            .header("host", "groved")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        let (mut n, mut h, mut head) = (0u64, sha2::Sha256::new(), Vec::new());
        while let Some(frame) = tokio::time::timeout(Duration::from_secs(60), body.frame())
            .await
            .expect("body stalled")
        {
            if let Some(data) = frame.unwrap().data_ref() {
                n += data.len() as u64;
                h.update(data);
                if head.len() < 4096 {
                    head.extend_from_slice(&data[..data.len().min(4096 - head.len())]);
                }
            }
        }
        (status, n, format!("{:x}", h.finalize()), head)
    })
}

/// One request over a raw socket, the body written by another thread while the answer is read (so
/// an early answer, before the body is all sent, is seen as the client sees it). `Connection: close`.
fn raw_request(
    d: &Daemon,
    method: &str,
    path: &str,
    content_type: &str,
    body_len: u64,
    fill: u8,
) -> (u16, Value) {
    raw_request_with(d, method, path, content_type, &[], body_len, fill)
}

fn raw_request_with(
    d: &Daemon,
    method: &str,
    path: &str,
    content_type: &str,
    headers: &[(&str, &str)],
    body_len: u64,
    fill: u8,
) -> (u16, Value) {
    let mut s = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: groved\r\nContent-Type: {content_type}\r\nContent-Length: {body_len}\r\nConnection: close\r\n{extra}\r\n"
    )
    .unwrap();
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let chunk = vec![fill; 256 << 10];
        let mut left = body_len;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            if w.write_all(&chunk[..n]).is_err() {
                return; // the server answered and closed early
            }
            left -= n as u64;
        }
    });
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let _ = s.shutdown(std::net::Shutdown::Both);
    writer.join().unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status: u16 = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    let v = if body.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body:?}"))
    };
    (status, v)
}

#[test]
fn a_1gib_sparse_file_streams_in_bounded_memory() {
    let _g = EXCLUSIVE.read().unwrap();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let d = daemon();
    let id = d.create(json!({}));
    let r = d.exec(
        &id,
        "truncate -s 1G /tmp/sparse && head -c 3000001 /dev/urandom > /tmp/small && sha256sum /tmp/small",
    );
    assert_eq!(r["exit_code"], 0, "{r}");
    let want = r["stdout"]
        .as_str()
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .to_string();

    // The bytes are right: length and hash of a file of random bytes.
    let (status, n, hash, _) =
        get_streamed(d, &format!("/v1/sandboxes/{id}/files?path=/tmp/small"));
    assert_eq!((status, n), (200, 3_000_001));
    assert_eq!(hash, want);

    let peak = Peak::start(d);
    let t = Instant::now();
    let (status, n, _, head) =
        get_streamed(d, &format!("/v1/sandboxes/{id}/files?path=/tmp/sparse"));
    assert_eq!(status, 200);
    assert_eq!(n, 1 << 30, "every byte of the 1 GiB file came");
    assert!(head.iter().all(|b| *b == 0));
    peak.assert_below("reading a 1 GiB sparse file", 64 * MIB);
    eprintln!(
        "1 GiB read in {:?}, groved peak +{} MiB",
        t.elapsed(),
        peak.rise_bytes() / MIB
    );
    d.delete(&id);
}

#[test]
fn exec_of_300mb_output_is_capped_and_flagged() {
    let _g = EXCLUSIVE.read().unwrap();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let d = daemon();
    let id = d.create(json!({}));
    let peak = Peak::start(d);
    let r = d.exec(
        &id,
        "head -c 300000000 /dev/zero | tr '\\0' a; echo done >&2",
    );
    // Default cap: 16 MiB kept of stdout, the rest dropped while the command ran to its end.
    assert_eq!(r["exit_code"], 0);
    assert_eq!(r["stdout"].as_str().unwrap().len() as u64, 16 * MIB);
    assert_eq!(r["stdout_truncated"], true);
    assert_eq!(r["stderr"], "done\n");
    assert_eq!(r["stderr_truncated"], false);
    // 590 MB before; now the kept 16 MiB and its JSON copies.
    peak.assert_below("300 MB of exec stdout", 128 * MIB);

    // A request's own cap.
    let r = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"shell": "seq 1 100000", "max_output_bytes": 6})),
        )
        .expect(200)
        .json();
    assert_eq!(
        (r["stdout"].as_str().unwrap(), &r["stdout_truncated"]),
        ("1\n2\n3\n", &json!(true))
    );
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"shell": "true", "max_output_bytes": 1u64 << 40})),
    )
    .expect_error(422, Some("max_output_bytes"));
    d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/processes"),
        Some(json!({"shell": "true", "max_output_bytes": 10})),
    )
    .expect_error(422, Some("max_output_bytes"));

    // The stream forwards everything and keeps nothing.
    let peak = Peak::start(d);
    let mut streamed = 0usize;
    let evs = common::sse_events(
        d,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec/stream"),
        Some(json!({"shell": "head -c 300000000 /dev/zero | tr '\\0' b"})),
        |ev, v| {
            if ev == "stdout" {
                streamed += v["data"].as_str().unwrap().len();
            }
            ev == "exit" || ev == "error"
        },
    );
    let (last, exit) = evs.last().unwrap();
    assert_eq!(last, "exit", "{exit}");
    common::spec().check_schema("ExecResult", exit).unwrap();
    assert_eq!(streamed, 300_000_000);
    assert_eq!(
        (&exit["stdout"], &exit["stdout_truncated"]),
        (&json!(""), &json!(false))
    );
    peak.assert_below("300 MB through exec/stream", 64 * MIB);
    d.delete(&id);
}

/// Processes named `yes` in this daemon's sandboxes, seen from the host.
fn yes_running(d: &Daemon) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let p = e.path();
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        let cg = std::fs::read_to_string(p.join("cgroup")).unwrap_or_default();
        if comm.trim() == "yes" && cg.contains(&format!("/{}/", d.cgroup_root)) {
            n += 1;
        }
    }
    n
}

#[test]
fn a_stream_nobody_reads_does_not_fill_groved() {
    let _g = EXCLUSIVE.read().unwrap();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let d = daemon();
    let id = d.create(json!({}));
    let peak = Peak::start(d);
    // A client that sends the request and never reads: `yes` must be held back, not buffered.
    let mut s = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
    let body = json!({"shell": "yes; true", "timeout_ms": 120000}).to_string();
    write!(
        s,
        "POST /v1/sandboxes/{id}/exec/stream HTTP/1.1\r\nHost: groved\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    std::thread::sleep(Duration::from_secs(4));
    peak.assert_below("an unread exec stream of `yes`", 64 * MIB);
    // Looked at from the host: init is held up writing to the stalled stream meanwhile.
    assert_eq!(yes_running(d), 1, "`yes` runs, held back");
    // The client goes: the command goes with it, long before its timeout.
    drop(s);
    let t = Instant::now();
    loop {
        if yes_running(d) == 0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "`yes` still runs after its stream's client left"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    d.delete(&id);
}

#[test]
fn fifos_and_other_non_files_are_refused_promptly() {
    let _g = EXCLUSIVE.read().unwrap();
    let d = daemon();
    let id = d.create(json!({}));
    let r = d.exec(&id, "mkfifo /tmp/fifo && mkdir /tmp/dir");
    assert_eq!(r["exit_code"], 0, "{r}");
    let path = |p: &str| format!("/v1/sandboxes/{id}/files?path={p}");
    let get = |p: String| async move {
        let stream = tokio::net::UnixStream::connect(&d.socket).await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        let req = hyper::Request::builder()
            .uri(p.as_str())
            .header("host", "groved")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null),
        )
    };
    // 20 at once: each answers at once (before, each one wedged a worker forever).
    let answers = d.rt.block_on(async {
        let all: Vec<_> = (0..20).map(|_| get(path("/tmp/fifo"))).collect();
        tokio::time::timeout(Duration::from_secs(20), futures::future::join_all(all))
            .await
            .expect("FIFO reads hung")
    });
    for (status, v) in answers {
        assert_eq!(status, 422, "{v}");
        assert_eq!(v["field"], "path");
        assert!(
            v["message"]
                .as_str()
                .unwrap()
                .contains("not a regular file"),
            "{v}"
        );
    }
    // The same through the spec-checked client, and the server still answers.
    let v = d
        .call(Method::GET, &path("/tmp/fifo"), None)
        .expect_error(422, Some("path"));
    assert!(v["message"]
        .as_str()
        .unwrap()
        .contains("not a regular file"));
    let v = d
        .call(Method::GET, &path("/tmp/dir"), None)
        .expect_error(422, Some("path"));
    assert!(v["message"].as_str().unwrap().contains("files/list"), "{v}");
    d.call(Method::GET, &path("/dev/null"), None)
        .expect_error(422, Some("path"));
    // Writing into a FIFO would block just the same.
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path("/tmp/fifo");
    std::thread::spawn(move || {
        let _ = tx.send(raw_request(
            daemon(),
            "PUT",
            &p,
            "application/octet-stream",
            1,
            b'x',
        ));
    });
    let (status, v) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("FIFO write hung");
    assert_eq!(status, 422, "{v}");
    assert_eq!(v["field"], "path");
    d.call(Method::GET, "/v1/health", None).expect(200);
    d.delete(&id);
}

#[test]
fn a_64mib_json_body_is_413() {
    let _g = EXCLUSIVE.read().unwrap();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let d = daemon();
    let peak = Peak::start(d);
    let (status, v) = raw_request(
        d,
        "POST",
        "/v1/sandboxes",
        "application/json",
        64 * MIB,
        b' ',
    );
    assert_eq!(status, 413, "{v}");
    assert_eq!(v["code"], "body_too_large");
    assert_eq!(v["field"], "body");
    common::spec().check_schema("Error", &v).unwrap();
    peak.assert_below("a 64 MiB JSON body", 48 * MIB);
    // The same where the idempotency layer reads the body first.
    let peak = Peak::start(d);
    let (status, v) = raw_request_with(
        d,
        "POST",
        "/v1/sandboxes",
        "application/json",
        &[("Idempotency-Key", "big-body")],
        64 * MIB,
        b' ',
    );
    assert_eq!(status, 413, "{v}");
    assert_eq!(
        (&v["code"], &v["field"]),
        (&json!("body_too_large"), &json!("body"))
    );
    peak.assert_below("a 64 MiB JSON body with an Idempotency-Key", 48 * MIB);
}

#[test]
fn uploads_stream_and_stop_at_the_disk_quota() {
    let _g = EXCLUSIVE.read().unwrap();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let d = daemon();
    let id = d.create(json!({"limits": {"disk_mb": 64}}));
    let put = |p: &str, len: u64| {
        raw_request(
            d,
            "PUT",
            &format!("/v1/sandboxes/{id}/files?path={p}"),
            "application/octet-stream",
            len,
            b'u',
        )
    };
    // 48 MiB streams in (groved holds a few chunks of it, not the whole body).
    let peak = Peak::start(d);
    let (status, v) = put("/tmp/big", 48 * MIB);
    assert_eq!(status, 204, "{v}");
    peak.assert_below("a 48 MiB upload", 32 * MIB);
    let r = d.exec(&id, "stat -c %s /tmp/big; tr -d u < /tmp/big | wc -c");
    assert_eq!(r["stdout"], format!("{}\n0\n", 48 * MIB));
    // Past the quota: 507, and the file the upload created is gone.
    let (status, v) = put("/tmp/toobig", 200 * MIB);
    assert_eq!(status, 507, "{v}");
    assert_eq!(v["code"], "insufficient_storage");
    common::spec().check_schema("Error", &v).unwrap();
    let r = d.exec(&id, "test -e /tmp/toobig; echo $?");
    assert_eq!(r["stdout"], "1\n");
    d.delete(&id);
}

#[test]
fn absurd_ttl_and_cpu_millis_are_4xx_naming_the_field() {
    let _g = EXCLUSIVE.read().unwrap();
    let d = daemon();
    let post = |b: Value| d.call(Method::POST, "/v1/sandboxes", Some(b));
    post(json!({"image": common::IMAGE, "limits": {"cpu_millis": 1}}))
        .expect_error(422, Some("cpu_millis"));
    for ttl in [u64::MAX, u64::MAX / 1000 + 1, 10 * 365 * 24 * 3600 + 1] {
        post(json!({"image": common::IMAGE, "ttl_secs": ttl})).expect_error(422, Some("ttl_secs"));
    }
    let id = d.create(json!({"ttl_secs": 10 * 365 * 24 * 3600}));
    d.call(
        Method::PUT,
        &format!("/v1/sandboxes/{id}/ttl"),
        Some(json!({"ttl_secs": u64::MAX})),
    )
    .expect_error(422, Some("ttl_secs"));
    // Not reaped: the reaper runs every 200 ms here.
    std::thread::sleep(Duration::from_millis(600));
    let s = d
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .expect(200)
        .json();
    assert_eq!(s["state"], "running");
    d.delete(&id);
}
