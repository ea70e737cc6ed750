//! Faults a real groved must answer honestly: a crash mid-batch (SIGKILL), grove-fsd killed under live
//! sandboxes, a full disk, a hostile pull source. Each test does what the fault tester did and asserts
//! the outcome: no duplicate sandboxes, no node key sent to strangers, 503/507/409 instead of 404/422/500.

mod common;

use std::io::{Read as _, Write as _};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use http_body_util::BodyExt as _;
use hyper::Method;
use serde_json::{json, Value};

use common::{
    daemon, groved_bin, init_binary, leftovers, rand_suffix, spec, BASE_IMAGE_DIR, IMAGE,
};

/// A groved of this test alone: its own dirs, cgroup root and config lines, restartable.
struct Node {
    dir: PathBuf,
    cgroup_root: String,
    child: Option<Child>,
    rt: tokio::runtime::Runtime,
    /// A tmpfs mounted on the state dir (unmounted on drop).
    tmpfs: bool,
}

struct Resp {
    status: u16,
    headers: hyper::HeaderMap,
    body: Value,
}

impl Node {
    /// `provider`: "overlay" (the base image linked, no import) or "nodefs"; `tmpfs_mb`: the state dir
    /// on a tmpfs of that size; `keep`: sandboxes outlive a stop (adopted after a SIGKILL too); `extra`:
    /// more config lines.
    fn new(provider: &str, tmpfs_mb: Option<u64>, keep: bool, extra: &str) -> Node {
        let dir = PathBuf::from(format!("/tmp/grove-faults-{}", rand_suffix()));
        let cgroup_root = format!("grove-f{}", &rand_suffix()[..6]);
        let state = dir.join("state");
        std::fs::create_dir_all(&state).unwrap();
        std::fs::create_dir_all(dir.join("run")).unwrap();
        if let Some(mb) = tmpfs_mb {
            nix::mount::mount(
                Some("tmpfs"),
                &state,
                Some("tmpfs"),
                nix::mount::MsFlags::empty(),
                Some(format!("size={mb}m,mode=0700").as_str()),
            )
            .expect("mount a tmpfs state dir");
        }
        if provider == "overlay" {
            std::fs::create_dir_all(state.join("images")).unwrap();
            std::os::unix::fs::symlink(BASE_IMAGE_DIR, state.join("images").join(IMAGE)).unwrap();
        }
        let config = format!(
            r#"state_dir = "{state}"
run_dir = "{run}"
socket = "{run}/groved.sock"
root_provider = "{provider}"
keep_sandboxes_on_stop = {keep}
cgroup_root = "{cgroup_root}"
net_pool = "10.215.0.0/16"
reap_interval_ms = 200
queue_timeout_ms = 0
{extra}
[capacity]
memory_mb = 4096
memory_reserve_mb = 0
sandboxes = 32
[defaults]
cpu_millis = 500
memory_mb = 128
pids = 64
open_files = 256
disk_mb = 16
"#,
            state = state.display(),
            run = dir.join("run").display(),
        );
        std::fs::write(dir.join("groved.toml"), config).unwrap();
        Node {
            dir,
            cgroup_root,
            child: None,
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            tmpfs: tmpfs_mb.is_some(),
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("run/groved.sock")
    }

    fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("groved.log"))
            .unwrap();
        // GROVE_FAULTS_GROVED: run the suite against another build (e.g. one without a fix).
        let bin = std::env::var_os("GROVE_FAULTS_GROVED").map_or_else(groved_bin, PathBuf::from);
        let child = Command::new(bin)
            .arg("--config")
            .arg(self.dir.join("groved.toml"))
            .env("GROVE_INIT_BINARY", init_binary())
            .env("GROVE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn groved");
        self.child = Some(child);
        let t = Instant::now();
        while !groved::client::Client::new(self.socket()).reachable() {
            if let Some(s) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("groved exited at start ({s}): {}", self.log_tail());
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "groved did not come up"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
    }

    /// Deletes every sandbox, stops groved (SIGTERM) and checks nothing is left.
    fn finish(mut self) {
        let list = self.call(Method::GET, "/v1/sandboxes", None, &[]);
        for s in list.body["items"].as_array().cloned().unwrap_or_default() {
            let id = s["id"].as_str().unwrap();
            let r = self.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None, &[]);
            assert_eq!(r.status, 204, "{}", r.body);
        }
        let mut child = self.child.take().expect("running");
        // SAFETY: kill(2) on the pid of our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "groved exit {status}: {}",
            self.log_tail()
        );
        let left = leftovers(&self.dir.join("run"), &self.cgroup_root);
        assert!(left.is_empty(), "{left:?}");
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("groved.log")).unwrap_or_default();
        log[log.len().saturating_sub(4000)..].to_string()
    }

    /// A JSON request over the unix socket; the answer is checked against openapi.yaml.
    fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        headers: &[(&str, &str)],
    ) -> Resp {
        self.try_call(method, path, body, headers)
            .unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    fn try_call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        headers: &[(&str, &str)],
    ) -> Result<Resp, String> {
        call(&self.rt, &self.socket(), method, path, body, headers)
    }
}

impl Drop for Node {
    /// On a failed run: delete what the node holds (a kept sandbox would outlive the stop), stop it,
    /// unmount the tmpfs; the dir and its log stay.
    fn drop(&mut self) {
        if self.child.is_some() {
            if let Ok(list) = self.try_call(Method::GET, "/v1/sandboxes", None, &[]) {
                for s in list.body["items"].as_array().cloned().unwrap_or_default() {
                    let path = format!("/v1/sandboxes/{}", s["id"].as_str().unwrap_or(""));
                    let _ = self.try_call(Method::DELETE, &path, None, &[]);
                }
            }
        }
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on the pid of our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
            eprintln!("faults test: log kept in {}", self.dir.display());
        }
        if self.tmpfs {
            let _ = nix::mount::umount2(&self.dir.join("state"), nix::mount::MntFlags::MNT_DETACH);
        }
        if leftovers(&self.dir.join("run"), &self.cgroup_root).is_empty()
            && !std::thread::panicking()
        {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn call(
    rt: &tokio::runtime::Runtime,
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Value>,
    headers: &[(&str, &str)],
) -> Result<Resp, String> {
    if let Some(b) = &body {
        spec().check_request(&method, path, b)?;
    }
    rt.block_on(async {
        let stream = tokio::net::UnixStream::connect(socket)
            .await
            .map_err(|e| e.to_string())?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let mut req = hyper::Request::builder()
            .method(method.clone())
            .uri(path)
            .header("host", "groved");
        let bytes = match &body {
            Some(b) => {
                req = req.header("content-type", "application/json");
                Bytes::from(b.to_string())
            }
            None => Bytes::new(),
        };
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = sender
            .send_request(req.body(http_body_util::Full::new(bytes)).unwrap())
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let raw = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        let ct = headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        spec().check_response(&method, path, status, ct, &raw)?;
        let body = if raw.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&raw).map_err(|e| format!("{e}: {raw:?}"))?
        };
        Ok(Resp {
            status,
            headers,
            body,
        })
    })
}

/// An HTTP listener on loopback that records each request's head and answers 404 in groved's error shape.
fn recorder() -> (String, Arc<Mutex<Vec<String>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("http://{}", l.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { return };
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && c.read(&mut b).is_ok_and(|n| n == 1) {
                head.push(b[0]);
            }
            s.lock()
                .unwrap()
                .push(String::from_utf8_lossy(&head).into_owned());
            let body = r#"{"code":"not_found","message":"no such snapshot","field":null}"#;
            let _ = write!(
                c,
                "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (addr, seen)
}

fn has_criu() -> bool {
    Path::new("/var/lib/grove/criu/criu").exists()
}

/// Issue 24, break 8: the node's API key went to whatever `source` a pull named.
#[test]
fn pull_sends_a_key_only_to_a_configured_peer() {
    if !has_criu() {
        common::capability_missing("snapshots (and so pulls) need CRIU");
        return;
    }
    let (stranger, stranger_seen) = recorder();
    let (peer, peer_seen) = recorder();
    let node_key = format!("node-key-{}", rand_suffix());
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("node.key"), &node_key).unwrap();
    std::fs::write(tmp.path().join("peer.key"), "peer-secret\n").unwrap();
    let tcp = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let extra = format!(
        "listen = [\"{tcp}\"]\napi_key_file = \"{}\"\n[[peers]]\nurl = \"{peer}/\"\napi_key_file = \"{}\"\n",
        tmp.path().join("node.key").display(),
        tmp.path().join("peer.key").display(),
    );
    let mut n = Node::new("nodefs", None, false, &extra);
    n.start();
    let pull = |source: &str, key: Option<&str>| {
        let mut body = json!({"source": source, "name": "wanted"});
        if let Some(k) = key {
            body["source_api_key"] = json!(k);
        }
        n.call(Method::POST, "/v1/snapshots/pull", Some(body), &[])
    };
    let r = pull(&stranger, None);
    assert_eq!(r.status, 404, "{}", r.body);
    let r = pull(&peer, None);
    assert_eq!(r.status, 404, "{}", r.body);
    let r = pull(&stranger, Some("given-for-it"));
    assert_eq!(r.status, 404, "{}", r.body);

    let stranger_seen = stranger_seen.lock().unwrap().clone();
    let peer_seen = peer_seen.lock().unwrap().clone();
    assert_eq!(stranger_seen.len(), 2, "{stranger_seen:?}");
    assert_eq!(peer_seen.len(), 1, "{peer_seen:?}");
    let auth = |head: &str| {
        head.lines()
            .filter(|l| l.to_ascii_lowercase().starts_with("authorization:"))
            .map(|l| l.split_once(':').unwrap().1.trim().to_string())
            .collect::<Vec<_>>()
    };
    assert!(
        !stranger_seen[0].contains(&node_key) && auth(&stranger_seen[0]).is_empty(),
        "a stranger got credentials: {}",
        stranger_seen[0]
    );
    assert_eq!(auth(&stranger_seen[1]), ["Bearer given-for-it"]);
    assert_eq!(auth(&peer_seen[0]), ["Bearer peer-secret"]);
    assert!(!peer_seen[0].contains(&node_key));
    n.finish();
}

/// Issue 25, item 4: a batch create cut off by SIGKILL, retried with the same Idempotency-Key after the
/// restart, made more sandboxes than asked (22 for 16).
#[test]
fn an_idempotent_batch_cut_by_sigkill_never_makes_more_than_asked() {
    const COUNT: usize = 6;
    let mut n = Node::new("overlay", None, true, "");
    n.start();
    let key = format!("batch-{}", rand_suffix());
    let body = json!({"image": IMAGE, "count": COUNT});
    let first = {
        let (socket, body, key) = (n.socket(), body.clone(), key.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            call(
                &rt,
                &socket,
                Method::POST,
                "/v1/sandboxes",
                Some(body),
                &[("idempotency-key", &key)],
            )
            .map(|r| r.status)
        })
    };
    // SIGKILL once part of the batch exists.
    let t = Instant::now();
    loop {
        let made = n
            .try_call(Method::GET, "/v1/sandboxes", None, &[])
            .map(|r| r.body["items"].as_array().map_or(0, Vec::len))
            .unwrap_or(0);
        if made >= 2 || first.is_finished() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the batch made nothing"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    n.kill9();
    let first = first.join().unwrap();
    eprintln!("first attempt: {first:?}");
    n.start();

    let retry = |n: &Node| {
        let r = n.call(
            Method::POST,
            "/v1/sandboxes",
            Some(body.clone()),
            &[("idempotency-key", &key)],
        );
        assert_eq!(r.status, 201, "{}", r.body);
        let mut ids: Vec<String> = r.body["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                i["sandbox"]["id"]
                    .as_str()
                    .unwrap_or_else(|| panic!("a failed item: {i}"))
                    .to_string()
            })
            .collect();
        ids.sort();
        (ids, r.headers.get("idempotent-replayed").is_some())
    };
    let total = |n: &Node| {
        n.call(Method::GET, "/v1/sandboxes", None, &[]).body["items"]
            .as_array()
            .unwrap()
            .len()
    };
    let (ids, _) = retry(&n);
    assert_eq!(ids.len(), COUNT);
    assert_eq!(total(&n), COUNT, "the retry made duplicates");
    let (again, replayed) = retry(&n);
    assert_eq!(again, ids);
    assert!(replayed, "the second retry is the stored answer");
    // And after another crash the answer is still on record.
    n.kill9();
    n.start();
    let (after, replayed) = retry(&n);
    assert_eq!(after, ids);
    assert!(replayed);
    assert_eq!(total(&n), COUNT);
    let other = n.call(
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"image": IMAGE, "count": 1})),
        &[("idempotency-key", &key)],
    );
    assert_eq!(other.status, 422, "{}", other.body);
    n.finish();
}

/// Issue 25, item 7: admission counted the filesystem, not its free space (ENOSPC at 31 MiB of a 100 MB
/// quota). The state dir is a 96 MiB tmpfs that something else fills after groved started.
#[test]
fn disk_admission_counts_free_space_less_what_sandboxes_may_still_write() {
    let mut n = Node::new("overlay", Some(96), false, "");
    n.start();
    let junk = n.dir.join("state/junk");
    std::fs::write(&junk, vec![7u8; 40 << 20]).unwrap();
    let create = |disk_mb: u64| {
        n.call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"image": IMAGE, "limits": {"disk_mb": disk_mb}})),
            &[],
        )
    };
    // 80 MB fits the filesystem (96) but not what is free (about 56).
    let r = create(80);
    assert_eq!(r.status, 507, "{}", r.body);
    assert_eq!(r.body["code"], "insufficient_storage", "{}", r.body);
    assert_eq!(r.body["field"], "limits.disk_mb", "{}", r.body);
    assert_eq!(total_sandboxes(&n), 0, "a refused create made nothing");
    let r = create(30);
    assert_eq!(r.status, 201, "{}", r.body);
    // The first may still write 30 of the ~56 free: a second 30 does not fit.
    let r = create(30);
    assert_eq!(r.status, 507, "{}", r.body);
    std::fs::remove_file(&junk).unwrap();
    let r = create(30);
    assert_eq!(r.status, 201, "space came back: {}", r.body);
    n.finish();
}

fn total_sandboxes(n: &Node) -> usize {
    n.call(Method::GET, "/v1/sandboxes", None, &[]).body["items"]
        .as_array()
        .unwrap()
        .len()
}

/// Issue 25, item 6: ENOSPC on a file PUT was a 500. The sandbox's own disk quota runs out.
#[test]
fn a_file_put_that_fills_the_disk_is_507_insufficient_storage() {
    let _g = common::EXCLUSIVE.read().unwrap();
    let d = daemon();
    let id = d.create(json!({"limits": {"disk_mb": 2}}));
    let big = Bytes::from(vec![1u8; 8 << 20]);
    let r = d.send(
        Method::PUT,
        &format!("/v1/sandboxes/{id}/files?path=/root/big"),
        Some(("application/octet-stream", big)),
        &[],
    );
    assert_eq!(r.status, 507, "{}", r.text());
    assert_eq!(r.json()["code"], "insufficient_storage");
    // The sandbox still works, and a small write fits.
    let out = d.exec(&id, "rm -f /root/big; echo ok");
    assert_eq!(out["stdout"], "ok\n", "{out}");
    d.delete(&id);
}

/// Pids of the grove-fsd serving the test daemon (found by its socket path on the command line).
fn fsd_pids(run_dir: &Path) -> Vec<i32> {
    let socket = run_dir.join("fsd.sock").display().to_string();
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args.first().is_some_and(|a| a.ends_with(b"grove-fsd"))
            && args.contains(&socket.as_bytes())
        {
            pids.push(pid);
        }
    }
    pids
}

/// Issue 25, item 6: after grove-fsd dies, the first create said 404 `image_not_found`, exec in the
/// moments before the loss is noticed said 422 `invalid_spec` ENOTCONN, and files routes on the failed
/// sandbox said 500.
#[test]
fn a_lost_fsd_gives_503_then_409_never_404_422_or_500() {
    let _g = common::EXCLUSIVE.write().unwrap();
    let d = daemon();
    let run = d.dir.join("run");
    let id = d.create(json!({}));
    let pids = fsd_pids(&run);
    assert_eq!(pids.len(), 1, "{pids:?}");
    // SAFETY: kill(2) with plain integers, on the test daemon's own grove-fsd.
    assert_eq!(unsafe { libc::kill(pids[0], libc::SIGKILL) }, 0);
    // At once, before the reaper notices (it looks every 200 ms): the moment the sandbox's root is a
    // dead FUSE mount.
    let root = run.join("sandboxes").join(&id).join("root");
    let t = Instant::now();
    // A name never looked up before: the kernel must ask the (dead) server.
    while std::fs::metadata(root.join(rand_suffix()))
        .err()
        .and_then(|e| e.raw_os_error())
        != Some(libc::ENOTCONN)
    {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the root never went dead"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let r = d.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"shell": "true"})),
    );
    eprintln!("exec right after grove-fsd died: {} {}", r.status, r.text());
    assert!(
        matches!(r.status, 503 | 409),
        "exec on a root whose server died: {} {}",
        r.status,
        r.text()
    );
    if r.status == 503 {
        assert!(r.headers.contains_key("retry-after"));
    }
    let r = d.call(Method::POST, "/v1/sandboxes", Some(json!({"image": IMAGE})));
    eprintln!(
        "create right after grove-fsd died: {} {}",
        r.status,
        r.text()
    );
    assert!(
        matches!(r.status, 201 | 503),
        "create right after grove-fsd died: {} {}",
        r.status,
        r.text()
    );
    if r.status == 201 {
        d.delete(r.json()["id"].as_str().unwrap());
    }
    let t = Instant::now();
    while d
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .json()["state"]
        != "failed"
    {
        assert!(t.elapsed() < Duration::from_secs(10), "not marked failed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let files = format!("/v1/sandboxes/{id}/files?path=/etc/hostname");
    d.call(Method::GET, &files, None).expect_error(409, None);
    let r = d.send(
        Method::PUT,
        &files,
        Some(("application/octet-stream", Bytes::from_static(b"x"))),
        &[],
    );
    assert_eq!(r.status, 409, "{}", r.text());
    d.call(
        Method::GET,
        &format!("/v1/sandboxes/{id}/files/list?path=/"),
        None,
    )
    .expect_error(409, None);
    d.delete(&id);
    // The node keeps working with the new grove-fsd.
    let again = d.create(json!({}));
    assert_eq!(d.exec(&again, "echo ok")["stdout"], "ok\n");
    d.delete(&again);
}

/// An image of a few MB: grove-init's and the shell's libraries, `sh` and `sleep`.
fn tiny_image(dir: &Path) -> PathBuf {
    let root = dir.join("tiny-image");
    for d in [
        "bin",
        "lib64",
        "lib/x86_64-linux-gnu",
        "etc",
        "tmp",
        "root",
        "proc",
        "dev",
        "sys",
        "run",
    ] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    for (src, dst) in [
        ("/lib64/ld-linux-x86-64.so.2", "lib64/ld-linux-x86-64.so.2"),
        (
            "/lib/x86_64-linux-gnu/libc.so.6",
            "lib/x86_64-linux-gnu/libc.so.6",
        ),
        (
            "/lib/x86_64-linux-gnu/libgcc_s.so.1",
            "lib/x86_64-linux-gnu/libgcc_s.so.1",
        ),
        ("/bin/dash", "bin/sh"),
        ("/bin/sleep", "bin/sleep"),
        ("/usr/bin/head", "bin/head"),
        ("/usr/bin/base64", "bin/base64"),
    ] {
        std::fs::copy(src, root.join(dst)).unwrap_or_else(|e| panic!("{src}: {e}"));
    }
    root
}

/// Starts a shell in sandbox `id` holding 4 MB that hardly compress (new to the store: part of the
/// next checkpoint's images), and waits until it holds them.
fn hold_fresh_bytes(n: &Node, id: &str, tag: &str) {
    let hold = format!(
        "sh -c 'x=$(head -c 3000000 /dev/urandom | base64 -w0); echo > /tmp/held-{tag}; sleep 100000' \
         </dev/null >/dev/null 2>&1 &"
    );
    let exec = |shell: &str| {
        n.call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({ "shell": shell })),
            &[],
        )
        .body
    };
    let r = exec(&hold);
    assert_eq!(r["exit_code"], 0, "{r}");
    let t = Instant::now();
    while exec(&format!("[ -e /tmp/held-{tag} ] && echo held"))["stdout"] != "held\n" {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the shell never held its bytes"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// KB free on the filesystem of `p`.
fn free_kb(p: &Path) -> u64 {
    let s = nix::sys::statvfs::statvfs(p).unwrap();
    s.blocks_available() * s.fragment_size() / 1024
}

/// Fills the filesystem of `dir` until `leave_kb` are free; returns the file that holds it.
fn fill(dir: &Path, leave_kb: u64) -> PathBuf {
    let junk = dir.join(format!("junk-{}", rand_suffix()));
    let kb = free_kb(dir).saturating_sub(leave_kb);
    let mut f = std::fs::File::create(&junk).unwrap();
    let chunk = vec![0x5au8; 1024];
    for _ in 0..kb {
        if f.write_all(&chunk).is_err() {
            break;
        }
    }
    junk
}

/// The SSE event stream of a node, collected in the background.
fn events(n: &Node) -> Arc<Mutex<String>> {
    let seen = Arc::new(Mutex::new(String::new()));
    let (socket, s) = (n.socket(), seen.clone());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let Ok(stream) = tokio::net::UnixStream::connect(&socket).await else {
                return;
            };
            let Ok((mut sender, conn)) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await
            else {
                return;
            };
            tokio::spawn(conn);
            let req = hyper::Request::builder()
                .uri("/v1/events")
                .header("host", "groved")
                .body(http_body_util::Full::new(Bytes::new()))
                .unwrap();
            let Ok(resp) = sender.send_request(req).await else {
                return;
            };
            let mut b = resp.into_body();
            while let Some(Ok(frame)) = b.frame().await {
                if let Some(d) = frame.data_ref() {
                    s.lock().unwrap().push_str(&String::from_utf8_lossy(d));
                }
            }
        });
    });
    seen
}

/// Issue 25, item 6: on a full store, `{"durable": true}` answered 501 and left a non-durable snapshot
/// behind; a background import that hit ENOSPC left `durable: false` with no error and no event, and was
/// never retried when space came back.
#[test]
fn a_full_store_fails_snapshots_honestly_and_retries_imports_when_space_returns() {
    if !has_criu() {
        common::capability_missing("snapshots need CRIU");
        return;
    }
    let mut n = Node::new("nodefs", Some(64), false, "import_retry_secs = 1\n");
    n.start();
    let state = n.dir.join("state");
    let img = tiny_image(&n.dir);
    let r = n.call(
        Method::POST,
        "/v1/images",
        Some(json!({"name": "tiny", "source": "dir", "path": img.display().to_string()})),
        &[],
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let r = n.call(
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"image": "tiny"})),
        &[],
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.body["id"].as_str().unwrap().to_string();
    hold_fresh_bytes(&n, &id, "a");
    let seen = events(&n);
    std::thread::sleep(Duration::from_millis(200));

    // Background import into a full store: on record, as an event, then retried once there is room.
    let junk = fill(&state, 256);
    let r = n.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/snapshot"),
        Some(json!({"name": "bg"})),
        &[],
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let t = Instant::now();
    let failed = loop {
        let s = n.call(Method::GET, "/v1/snapshots/bg", None, &[]).body;
        if s["error"].is_string() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no error on record: {s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(failed["durable"], false, "{failed}");
    let t = Instant::now();
    while !seen.lock().unwrap().contains("snapshot_import_failed") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no event: {}",
            seen.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::remove_file(&junk).unwrap();
    let t = Instant::now();
    loop {
        let s = n.call(Method::GET, "/v1/snapshots/bg", None, &[]).body;
        if s["durable"] == true {
            assert!(s.get("error").is_none(), "{s}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "never retried: {s}");
        std::thread::sleep(Duration::from_millis(200));
    }

    // A durable snapshot the store cannot hold: 507, and no snapshot.
    hold_fresh_bytes(&n, &id, "b");
    let junk = fill(&state, 256);
    let r = n.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/snapshot"),
        Some(json!({"name": "want-durable", "durable": true})),
        &[],
    );
    assert_eq!(r.status, 507, "{}", r.body);
    assert_eq!(r.body["code"], "insufficient_storage", "{}", r.body);
    let r = n.call(Method::GET, "/v1/snapshots/want-durable", None, &[]);
    assert_eq!(
        r.status, 404,
        "a failed durable snapshot was left behind: {}",
        r.body
    );
    std::fs::remove_file(&junk).unwrap();

    let r = n.call(Method::DELETE, "/v1/snapshots/bg", None, &[]);
    assert_eq!(r.status, 204, "{}", r.body);
    n.finish();
}
