//! Crash recovery under fire: a worker streams create / exec / snapshot / fork / destroy through the
//! API while groved is SIGKILLed at random moments (at least 200 times) and restarted on the same
//! state and run dirs. Asserted throughout and at the end: every sandbox reported created is
//! usable (running, exec works) or reported failed, never silently gone; every snapshot reported
//! committed forks; after deleting everything the node reports no residue, and nothing is left
//! under the test's run dir or cgroup root, and no grove-fsd of the test runs. Both kinds of root
//! outlive groved (kernel overlayfs; nodefs served by grove-fsd), so every such sandbox must be
//! adopted with the files it wrote, through SIGKILLs and through an orderly stop that keeps them.
//!
//! A bounded variant puts the state dir on a small tmpfs, so creates, writes and snapshots hit
//! ENOSPC, and its execs read image files through the passthrough cache (`ls`, `python3 -c
//! 'import json'` open cached whole-file copies): no answer about space may be a 500.
//!
//! GROVE_CRASH_KILLS overrides the number of kills (default 200), GROVE_CRASH_LOG groved's log
//! filter (default `warn`; the log is kept in the test's dir when a test fails).

mod common;

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use groved::client::Client;
use http_body_util::BodyExt as _;
use hyper::Method;
use serde_json::{json, Value};

use common::{fsd_of, groved_bin, init_binary, leftovers, rand_suffix, BASE_IMAGE_DIR, IMAGE};

/// At most this many sandboxes alive at once (the stream creates more when below).
const MAX_LIVE: usize = 4;

fn pick(n: usize) -> usize {
    (rand::random::<u64>() % n as u64) as usize
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Roots {
    /// Roots served by grove-fsd, which outlives groved; snapshots and forks are in the stream.
    Nodefs,
    /// Kernel overlayfs roots outlive groved. No snapshots (they need nodefs).
    Overlay,
}

/// The state dir of the full-disk variant: the image (~106 MiB in the store), its passthrough
/// cache, a few snapshots and sandboxes of `FULL_DISK_QUOTA_MB` do not all fit.
const FULL_DISK_STATE_MB: u64 = 224;
/// Each sandbox's disk quota in the full-disk variant (admission needs this much free).
const FULL_DISK_QUOTA_MB: u64 = 16;
/// Committed snapshots the full-disk stream keeps (older ones are deleted), so the end can fork.
const FULL_DISK_SNAPSHOTS: usize = 4;

/// One groved on a private state dir, run dir and cgroup root, restartable.
struct Node {
    dir: PathBuf,
    cgroup_root: String,
    child: Option<Child>,
    /// The state dir is a tmpfs of this many MiB (unmounted by `unmount_state`).
    state_fs_mb: Option<u64>,
}

impl Node {
    fn new(roots: Roots, state_fs_mb: Option<u64>) -> Node {
        let dir = PathBuf::from(format!("/tmp/grove-crash-{}", rand_suffix()));
        let cgroup_root = format!("grove-k{}", &rand_suffix()[..6]);
        std::fs::create_dir_all(dir.join("state")).unwrap();
        if let Some(mb) = state_fs_mb {
            nix::mount::mount(
                Some("tmpfs"),
                &dir.join("state"),
                Some("tmpfs"),
                nix::mount::MsFlags::empty(),
                Some(format!("size={mb}m,mode=0700").as_str()),
            )
            .expect("mount a tmpfs state dir");
        }
        std::fs::create_dir_all(dir.join("state/images")).unwrap();
        let disk_mb = if state_fs_mb.is_some() {
            FULL_DISK_QUOTA_MB
        } else {
            128
        };
        let provider = match roots {
            Roots::Nodefs => "nodefs",
            Roots::Overlay => {
                std::os::unix::fs::symlink(BASE_IMAGE_DIR, dir.join("state/images").join(IMAGE))
                    .unwrap();
                "overlay"
            }
        };
        let config = format!(
            r#"state_dir = "{state}"
run_dir = "{run}"
socket = "{run}/groved.sock"
root_provider = "{provider}"
keep_sandboxes_on_stop = {keep}
cgroup_root = "{cgroup_root}"
net_pool = "10.214.0.0/16"
[capacity]
memory_mb = 4096
memory_reserve_mb = 0
sandboxes = 32
[defaults]
cpu_millis = 500
memory_mb = 128
pids = 64
open_files = 256
disk_mb = {disk_mb}
"#,
            state = dir.join("state").display(),
            run = dir.join("run").display(),
            keep = true,
        );
        std::fs::write(dir.join("groved.toml"), config).unwrap();
        Node {
            dir,
            cgroup_root,
            child: None,
            state_fs_mb,
        }
    }

    /// Unmounts the tmpfs state dir (groved stopped); a no-op without one.
    fn unmount_state(&mut self) {
        if self.state_fs_mb.take().is_some() {
            nix::mount::umount2(&self.dir.join("state"), nix::mount::MntFlags::MNT_DETACH)
                .expect("unmount the state dir");
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("run/groved.sock")
    }

    fn start(&mut self) {
        if let Err(e) = self.try_start() {
            panic!("{e}");
        }
    }

    /// Starts groved and waits until it answers; never panics (`Drop` uses it mid-unwind).
    fn try_start(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("groved.log"))
            .map_err(|e| format!("groved.log: {e}"))?;
        let out = log.try_clone().map_err(|e| format!("groved.log: {e}"))?;
        let child = Command::new(groved_bin())
            .arg("--config")
            .arg(self.dir.join("groved.toml"))
            .env("GROVE_INIT_BINARY", init_binary())
            .env(
                "GROVE_LOG",
                std::env::var("GROVE_CRASH_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawn groved: {e}"))?;
        let child = self.child.insert(child);
        let socket = self.dir.join("run/groved.sock");
        let t = Instant::now();
        while !Client::new(socket.clone()).reachable() {
            if let Ok(Some(s)) = child.try_wait() {
                self.child = None;
                return Err(format!("groved exited at start ({s}): {}", self.log_tail()));
            }
            if t.elapsed() > Duration::from_secs(60) {
                return Err("groved did not come up in 60 s".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
    }

    fn stop(&mut self) {
        let mut child = self.child.take().expect("running");
        // SAFETY: kill(2) on the pid of our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "groved exit {status}: {}",
            self.log_tail()
        );
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("groved.log")).unwrap_or_default();
        log[log.len().saturating_sub(4000)..].to_string()
    }
}

impl Drop for Node {
    /// On a failed run the node's sandboxes go too, or a panicking test would leave them (and
    /// their grove-fsd, mounts, cgroups and heaps) to the tests after it: the daemon is started
    /// again with `keep_sandboxes_on_stop` off (a running one read it on, so it is stopped
    /// first, leaving them to the next), and stopped, so that its SIGTERM destroys everything
    /// it adopted. The dir and its log stay.
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("crash test: log kept in {}", self.dir.display());
            let config = self.dir.join("groved.toml");
            if let Ok(c) = std::fs::read_to_string(&config) {
                let c = c.replace(
                    "keep_sandboxes_on_stop = true",
                    "keep_sandboxes_on_stop = false",
                );
                let _ = std::fs::write(&config, c);
            }
            if let Some(mut child) = self.child.take() {
                // SAFETY: kill(2) on the pid of our own child.
                unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
                let _ = child.wait();
            }
            if let Err(e) = self.try_start() {
                eprintln!("crash test: could not restart groved to clean up: {e}");
            }
        }
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on the pid of our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
        }
        if self.state_fs_mb.is_some() {
            let _ = nix::mount::umount2(&self.dir.join("state"), nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// A blocking API client; a request that dies with the daemon is an `Err`.
struct Api {
    client: Client,
    rt: tokio::runtime::Runtime,
}

impl Api {
    fn new(socket: PathBuf) -> Api {
        Api {
            client: Client::new(socket),
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
        }
    }

    fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value), String> {
        let (ct, bytes) = match &body {
            Some(b) => (Some("application/json"), Bytes::from(b.to_string())),
            None => (None, Bytes::new()),
        };
        self.rt.block_on(async {
            let fut = async {
                let resp = self
                    .client
                    .send(method.clone(), path, ct, bytes)
                    .await
                    .map_err(|e| e.to_string())?;
                let status = resp.status().as_u16();
                let ct = resp
                    .headers()
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                common::spec()
                    .check_response(&method, path, status, &ct, &body)
                    .unwrap_or_else(|e| panic!("{e}"));
                let v = serde_json::from_slice(&body).unwrap_or(Value::Null);
                Ok((status, v))
            };
            tokio::time::timeout(Duration::from_secs(60), fut)
                .await
                .map_err(|_| format!("{method} {path} timed out"))?
        })
    }

    /// Retries while the daemon is down (connection refused or reset); for the checks only.
    fn must(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let t = Instant::now();
        loop {
            match self.call(method.clone(), path, body.clone()) {
                Ok(r) => return r,
                Err(e) if t.elapsed() > Duration::from_secs(60) => panic!("{method} {path}: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// What the API has told the worker.
#[derive(Default)]
struct Book {
    /// Reported created (201, or a fork branch with a sandbox).
    created: HashSet<String>,
    /// A DELETE was sent and its outcome is unknown (sent again until it answers).
    deleting: HashSet<String>,
    /// Reported committed (201), by name.
    snapshots: Vec<String>,
    /// Wrote its own id to `/var/tmp/mark` on its root (the exec answered).
    marked: HashSet<String>,
}

impl Book {
    fn live(&self) -> Vec<String> {
        self.created.difference(&self.deleting).cloned().collect()
    }
}

#[derive(Default)]
struct Counts {
    ok: AtomicU32,
    failed: AtomicU32,
    created: AtomicU32,
    committed: AtomicU32,
    forked: AtomicU32,
    /// 507 answers (a full disk, honestly reported).
    no_space: AtomicU32,
    /// Answers of 500 that are about space (ENOSPC or a quota): each is a bug.
    space_500: Mutex<Vec<String>>,
    /// Execs in a running sandbox that could not read its image files (ls, python3).
    read_failures: Mutex<Vec<String>>,
}

/// Whether an error answer talks about space (so must have been a 507).
fn about_space(v: &Value) -> bool {
    let m = v.to_string().to_lowercase();
    [
        "no space",
        "os error 28",
        "enospc",
        "quota",
        "edquot",
        "os error 122",
    ]
    .iter()
    .any(|w| m.contains(w))
}

/// One op of the stream. Errors (the daemon died under it, a conflict with a lost sandbox) are
/// expected; only what the API reported as done is booked.
fn one_op(api: &Api, book: &Mutex<Book>, counts: &Counts, roots: Roots, full_disk: bool) {
    let live = book.lock().unwrap().live();
    let snaps = book.lock().unwrap().snapshots.clone();
    let mut roll = pick(100);
    if roots == Roots::Overlay && (50..80).contains(&roll) {
        roll -= 30; // no snapshot or fork: exec instead
    }
    let r = if full_disk && snaps.len() > FULL_DISK_SNAPSHOTS && roll >= 80 {
        // Keep the store from staying full: drop the oldest snapshot from the book first (a
        // delete the kill cut may or may not have happened; the end deletes whatever is listed).
        let name = book.lock().unwrap().snapshots.remove(0);
        api.call(Method::DELETE, &format!("/v1/snapshots/{name}"), None)
    } else if live.len() < 2 || (roll < 25 && live.len() < MAX_LIVE) {
        let r = api.call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({ "image": IMAGE })),
        );
        if let Ok((201, v)) = &r {
            book.lock()
                .unwrap()
                .created
                .insert(v["id"].as_str().unwrap().to_string());
            counts.created.fetch_add(1, Ordering::Relaxed);
        }
        r
    } else if full_disk && roll < 40 {
        // Reads through the passthrough cache, then fills the quota (ENOSPC is expected there).
        let id = &live[pick(live.len())];
        let r = api.call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(
                json!({ "shell": "ls / >/dev/null && python3 -c 'import json' && echo read-ok; \
                head -c 6M /dev/urandom > /var/tmp/fill.$$; true" }),
            ),
        );
        if let Ok((200, v)) = &r {
            if !v["stdout"].as_str().unwrap_or("").contains("read-ok") {
                counts
                    .read_failures
                    .lock()
                    .unwrap()
                    .push(format!("{id}: {v}"));
            }
        }
        r
    } else if roll < 50 {
        let id = &live[pick(live.len())];
        let r = api.call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            // Written aside and renamed: a kill of groved mid-exec kills the command (its client
            // went away), which must not leave a truncated mark behind.
            Some(json!({ "shell": format!(
                "echo {id} > /var/tmp/mark.new && sync /var/tmp/mark.new && mv /var/tmp/mark.new /var/tmp/mark"
            ) })),
        );
        if matches!(&r, Ok((200, v)) if v["exit_code"] == 0) {
            book.lock().unwrap().marked.insert(id.clone());
        }
        r
    } else if roll < 70 {
        let id = &live[pick(live.len())];
        let r = api.call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/snapshot"),
            Some(json!({})),
        );
        if let Ok((201, v)) = &r {
            let name = v["name"].as_str().unwrap().to_string();
            book.lock().unwrap().snapshots.push(name);
            counts.committed.fetch_add(1, Ordering::Relaxed);
        }
        r
    } else if roll < 80 && !snaps.is_empty() {
        let name = &snaps[pick(snaps.len())];
        let r = api.call(
            Method::POST,
            &format!("/v1/snapshots/{name}/fork"),
            Some(json!({ "count": 1 })),
        );
        if let Ok((201, v)) = &r {
            for item in v["results"].as_array().unwrap() {
                if let Some(id) = item["sandbox"]["id"].as_str() {
                    book.lock().unwrap().created.insert(id.to_string());
                    counts.forked.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        r
    } else {
        // A delete a kill interrupted is sent again first: an adopted sandbox stays until deleted.
        let unsure = book.lock().unwrap().deleting.iter().next().cloned();
        let id = unsure.unwrap_or_else(|| live[pick(live.len())].clone());
        book.lock().unwrap().deleting.insert(id.clone());
        let r = api.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None);
        if matches!(&r, Ok((204 | 404, _))) {
            let mut b = book.lock().unwrap();
            b.deleting.remove(&id);
            b.created.remove(&id);
        }
        r
    };
    if let Ok((s, v)) = &r {
        if *s == 507 {
            counts.no_space.fetch_add(1, Ordering::Relaxed);
        } else if *s == 500 && about_space(v) {
            counts.space_500.lock().unwrap().push(v.to_string());
        }
    }
    match r {
        Ok((s, _)) if s < 300 => counts.ok.fetch_add(1, Ordering::Relaxed),
        Ok(_) => counts.failed.fetch_add(1, Ordering::Relaxed),
        Err(_) => {
            // The daemon is down: wait for it without burning the CPU it needs to come back.
            std::thread::sleep(Duration::from_millis(10));
            counts.failed.fetch_add(1, Ordering::Relaxed)
        }
    };
}

/// Every sandbox reported created and not deleted is listed, running, answers an exec and holds the
/// mark it wrote on its root. Runs while the worker is paused.
fn check_sandboxes(api: &Api, book: &Book, roots: Roots) {
    let (status, list) = api.must(Method::GET, "/v1/sandboxes?limit=1000", None);
    assert_eq!(status, 200, "{list}");
    let states: std::collections::HashMap<String, String> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["id"].as_str().unwrap().to_string(),
                s["state"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for id in book.live() {
        let state = states
            .get(&id)
            .unwrap_or_else(|| panic!("{id} was reported created, is not deleted, and is gone"));
        match state.as_str() {
            "running" => {
                let (s, v) = api.must(
                    Method::POST,
                    &format!("/v1/sandboxes/{id}/exec"),
                    Some(json!({ "shell": "cat /var/tmp/mark 2>/dev/null; true" })),
                );
                assert_eq!((s, v["exit_code"].as_i64()), (200, Some(0)), "{id}: {v}");
                if book.marked.contains(&id) {
                    let mark = v["stdout"].as_str().unwrap_or("").trim();
                    assert_eq!(mark, id, "{id} lost the file it wrote ({roots:?} roots)");
                }
            }
            other => {
                let (_, why) = api.must(Method::GET, &format!("/v1/sandboxes/{id}"), None);
                panic!("{id} is {other}: not usable ({roots:?} roots): {why}")
            }
        }
    }
}

fn runnable() -> bool {
    let ok =
        nix::unistd::geteuid().is_root() && PathBuf::from(BASE_IMAGE_DIR).join("bin/sh").exists();
    if !ok {
        common::capability_missing(&format!("needs root and the base image {BASE_IMAGE_DIR}"));
    }
    ok
}

fn kills(default: usize) -> usize {
    std::env::var("GROVE_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn groved_survives_sigkill_at_random_moments() {
    if runnable() {
        kill_stream(Roots::Nodefs, kills(200), None);
    }
}

/// The kill stream with the state dir on a small filesystem (creates, writes and snapshots hit
/// ENOSPC) and execs that read image files through the passthrough cache. A few dozen kills
/// (never fewer than 45: the stream needs that long to fill the disk, and at 30 it once did not).
#[test]
fn groved_survives_sigkills_on_a_full_disk_with_the_passthrough_cache() {
    if runnable() {
        let n = (kills(200) / 6).max(45);
        kill_stream(Roots::Nodefs, n, Some(FULL_DISK_STATE_MB));
    }
}

#[test]
fn sandboxes_on_overlay_roots_keep_running_through_sigkills() {
    if runnable() {
        kill_stream(Roots::Overlay, kills(200) / 4, None);
    }
}

/// Sets its flag when dropped.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// `state_fs_mb`: the state dir on a tmpfs of that size (the full-disk variant).
fn kill_stream(roots: Roots, kills: usize, state_fs_mb: Option<u64>) {
    let started = Instant::now();
    let full_disk = state_fs_mb.is_some();
    let mut node = Node::new(roots, state_fs_mb);
    node.start();
    let api = Api::new(node.socket());
    if roots == Roots::Nodefs {
        let (s, v) = api.must(
            Method::POST,
            "/v1/images",
            Some(json!({"name": IMAGE, "source": "dir", "path": BASE_IMAGE_DIR})),
        );
        assert_eq!(s, 201, "importing the base image: {v}");
    }

    let book = Arc::new(Mutex::new(Book::default()));
    let counts = Arc::new(Counts::default());
    let gate = Arc::new(RwLock::new(()));
    let stop = Arc::new(AtomicBool::new(false));
    // Dropped before `node` when a check panics: the worker stops streaming into the clean-up.
    let _stop_worker = StopOnDrop(stop.clone());
    let worker = {
        let (book, counts, gate, stop) = (book.clone(), counts.clone(), gate.clone(), stop.clone());
        let socket = node.socket();
        std::thread::spawn(move || {
            let api = Api::new(socket);
            while !stop.load(Ordering::Relaxed) {
                let _open = gate.read().unwrap();
                one_op(&api, &book, &counts, roots, full_disk);
            }
        })
    };
    let mut restarts = Vec::with_capacity(kills);
    for k in 0..kills {
        // Mostly short gaps (a kill lands inside an op); now and then a long one so that
        // snapshots and forks get to complete.
        let gap = if k % 8 == 7 {
            600 + pick(900)
        } else {
            5 + pick(146)
        };
        std::thread::sleep(Duration::from_millis(gap as u64));
        node.kill9();
        let t = Instant::now();
        node.start();
        restarts.push(t.elapsed());
        if k % 10 == 9 {
            let _paused = gate.write().unwrap();
            check_sandboxes(&api, &book.lock().unwrap(), roots);
        }
    }
    stop.store(true, Ordering::Relaxed);
    worker.join().unwrap();
    let stream_secs = started.elapsed().as_secs_f64();
    restarts.sort();
    let ms = |d: Duration| d.as_millis();

    let book = book.lock().unwrap();
    check_sandboxes(&api, &book, roots);
    // An orderly stop (SIGTERM, keep_sandboxes_on_stop) leaves them running too, and the next
    // start adopts them.
    node.stop();
    node.start();
    check_sandboxes(&api, &book, roots);
    // Forks need room for their quota: on a small disk, the sandboxes (checked) go first.
    if full_disk {
        let (s, v) = api.must(Method::POST, "/v1/node/fsck", None);
        assert!(s == 200 && v["ok"] == true, "fsck after the kills: {v}");
        delete_all_sandboxes(&api);
        let (s, v) = api.must(Method::POST, "/v1/node/gc", None);
        assert_eq!(s, 200, "gc on a full disk: {v}");
        // What gc keeps is whole: a manifest kept only as a later version's delta base keeps
        // no marker that fsck would walk into children gc dropped.
        let (s, v) = api.must(Method::POST, "/v1/node/fsck", None);
        assert!(s == 200 && v["ok"] == true, "fsck after gc: {v}");
    }
    // Every committed snapshot is listed and forks into a working sandbox.
    for name in &book.snapshots {
        let (s, v) = api.must(
            Method::POST,
            &format!("/v1/snapshots/{name}/fork"),
            Some(json!({ "count": 1 })),
        );
        assert_eq!(s, 201, "fork of committed snapshot {name}: {v}");
        let branch = &v["results"][0];
        let id = branch["sandbox"]["id"]
            .as_str()
            .unwrap_or_else(|| panic!("committed snapshot {name} does not fork: {branch}"));
        let (s, out) = api.must(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({ "shell": "echo forked" })),
        );
        assert_eq!(s, 200, "{out}");
        assert_eq!(
            out["stdout"].as_str().map(str::trim),
            Some("forked"),
            "{out}"
        );
        let (s, v) = api.must(Method::DELETE, &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(s, 204, "delete fork {id}: {v}");
    }
    // Delete everything; then nothing may be left.
    delete_all_sandboxes(&api);
    let (_, snaps) = api.must(Method::GET, "/v1/snapshots", None);
    for snap in snaps["items"].as_array().into_iter().flatten() {
        let name = snap["name"].as_str().unwrap();
        let (s, v) = api.must(Method::DELETE, &format!("/v1/snapshots/{name}"), None);
        assert_eq!(s, 204, "delete snapshot {name}: {v}");
    }
    let (_, residue) = api.must(Method::GET, "/v1/node/residue", None);
    assert_eq!(residue["items"], json!([]), "residue: {residue}");
    node.stop();
    node.unmount_state();
    let left = leftovers(&node.dir, &node.cgroup_root);
    assert!(left.is_empty(), "left behind: {left:?}");
    let space_500 = counts.space_500.lock().unwrap();
    assert!(
        space_500.is_empty(),
        "{} answers about space were 500, not 507; first: {}",
        space_500.len(),
        space_500[0]
    );
    let unread = counts.read_failures.lock().unwrap();
    assert!(
        unread.is_empty(),
        "{} execs could not read image files; first: {}",
        unread.len(),
        unread[0]
    );
    let no_space = counts.no_space.load(Ordering::Relaxed);
    if full_disk {
        assert!(no_space > 0, "the disk never filled: nothing answered 507");
    }
    let sandbox_dirs = std::fs::read_dir(node.dir.join("run/sandboxes"))
        .map(|rd| rd.count())
        .unwrap_or(0);
    assert_eq!(sandbox_dirs, 0, "sandbox run dirs left");
    let fsd = fsd_of(&node.dir);
    assert!(fsd.is_empty(), "grove-fsd still running: {fsd:?}");
    eprintln!(
        "crash ({roots:?} roots): {kills} SIGKILLs in {stream_secs:.1} s (total {:.1} s); ops ok {}, failed {}; \
         sandboxes created {}, snapshots committed {}, fork branches {}, 507s {no_space}; \
         restart to serving median {} ms, max {} ms",
        started.elapsed().as_secs_f64(),
        counts.ok.load(Ordering::Relaxed),
        counts.failed.load(Ordering::Relaxed),
        counts.created.load(Ordering::Relaxed),
        counts.committed.load(Ordering::Relaxed),
        counts.forked.load(Ordering::Relaxed),
        ms(restarts[restarts.len() / 2]),
        ms(restarts[restarts.len() - 1]),
    );
    for ctrl in [
        "memory", "pids", "cpu", "cpuacct", "freezer", "unified", "cpuset", "devices", "blkio",
    ] {
        let _ = std::fs::remove_dir(format!("/sys/fs/cgroup/{ctrl}/{}", node.cgroup_root));
    }
    std::fs::remove_dir_all(&node.dir).unwrap();
}

/// Deletes every listed sandbox (each must answer 204).
fn delete_all_sandboxes(api: &Api) {
    let (_, list) = api.must(Method::GET, "/v1/sandboxes?limit=1000", None);
    for sb in list["items"].as_array().unwrap() {
        let id = sb["id"].as_str().unwrap();
        let (s, v) = api.must(Method::DELETE, &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(s, 204, "delete {id}: {v}");
    }
}

/// The workload of `a_fork_reported_done_is_complete_after_a_crash`: a 256 MiB heap whose
/// sha256 it writes to /root/hash before the snapshot; on `/root/go.<n>` it hashes the heap
/// again into `/root/now.<n>` (every page read, so every lazily restored page is needed). With
/// 128 MiB an idle machine's daemons had copied all 8 branches before a restarted groved looked,
/// and no crash met them copying; 256 MiB takes them longer than the restart (10-15 of 24
/// adopted in three runs). The heap is filled in 16 MiB pieces to stay within the limit.
const HEAP_APP: &str = r#"
import os, hashlib, time
heap = bytearray(256 << 20)
for i in range(0, len(heap), 1 << 24):
    heap[i:i + (1 << 24)] = os.urandom(1 << 24)
with open('/root/hash.tmp', 'w') as o:
    o.write(hashlib.sha256(heap).hexdigest())
os.rename('/root/hash.tmp', '/root/hash')
done = set()
while True:
    for n in os.listdir('/root'):
        if n.startswith('go.') and n not in done:
            done.add(n)
            with open('/root/now.tmp', 'w') as o:
                o.write(hashlib.sha256(heap).hexdigest())
            os.rename('/root/now.tmp', '/root/now.' + n[3:])
    time.sleep(0.01)
"#;

/// Issue 25 item 1: fork a 256 MiB-heap snapshot into 8 with lazy pages (the default) and
/// SIGKILL groved right after the 201, or a little later, while the branches' lazy-pages
/// daemons are still copying; restart it. Every branch reported running must hash its heap
/// to the original (no page reads as zeros), a branch whose pages were lost must be reported
/// failed, none may be gone; three crashes, then zero residue.
#[test]
fn a_fork_reported_done_is_complete_after_a_crash() {
    if !runnable() {
        return;
    }
    let (mut node, api) = nodefs_node_with_image();
    let (src, hash) = heap_sandbox(&api);
    let (s, v) = api.must(
        Method::POST,
        &format!("/v1/sandboxes/{src}/snapshot"),
        Some(json!({})),
    );
    assert_eq!(s, 201, "{v}");
    let snap = v["id"].as_str().unwrap().to_string();
    let (s, v) = api.must(Method::DELETE, &format!("/v1/sandboxes/{src}"), None);
    assert_eq!(s, 204, "{v}");

    // The last round also loses the daemons while groved is down (SIGKILL, as an OOM kill
    // would): the branches they were still filling must then be reported failed.
    let (mut running, mut failed, mut failed_lost) = (0, 0, 0);
    let rounds = [(0u64, false), (150, false), (600, false), (0, true)];
    for (round, (delay_ms, lose_daemons)) in rounds.into_iter().enumerate() {
        let t = Instant::now();
        let (s, v) = api.must(
            Method::POST,
            &format!("/v1/snapshots/{snap}/fork"),
            Some(json!({"count": 8})),
        );
        let fork_ms = t.elapsed().as_millis();
        std::thread::sleep(Duration::from_millis(delay_ms));
        node.kill9();
        assert_eq!(s, 201, "{v}");
        let branches: Vec<String> = v["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r["sandbox"]["id"]
                    .as_str()
                    .unwrap_or_else(|| panic!("a branch failed to fork: {r}"))
                    .to_string()
            })
            .collect();
        assert_eq!(branches.len(), 8, "{v}");
        if lose_daemons {
            for (pid, cmd) in processes_naming(&node.dir) {
                if cmd.contains("lazy-pages") {
                    // SAFETY: kill(2) of a lazy-pages daemon (or its shell) of this test's node.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        node.start();
        for id in &branches {
            let (s, v) = api.must(Method::GET, &format!("/v1/sandboxes/{id}"), None);
            assert_eq!(s, 200, "{id} was reported forked and is gone: {v}");
            match v["state"].as_str() {
                Some("running") => {
                    let now = heap_hash_now(&api, id, round);
                    assert_eq!(
                        now,
                        hash,
                        "round {round} (kill {delay_ms} ms after the reply): branch {id} is \
                         running but its heap changed (pages lost?): {}",
                        node.log_tail()
                    );
                    running += 1;
                }
                Some("failed") if lose_daemons => failed_lost += 1,
                Some("failed") => failed += 1,
                other => panic!("{id} is {other:?} after the restart: {v}"),
            }
            let (s, v) = api.must(Method::DELETE, &format!("/v1/sandboxes/{id}"), None);
            assert_eq!(s, 204, "delete {id}: {v}");
        }
        eprintln!(
            "fork crash round {round}: fork(8) answered in {fork_ms} ms, groved killed {delay_ms} ms \
             later{}",
            if lose_daemons { ", its lazy-pages daemons too" } else { "" }
        );
    }
    // The crashes landed while daemons were still copying (else this tested nothing).
    let log = std::fs::read_to_string(node.dir.join("groved.log")).unwrap_or_default();
    let adopted = log
        .matches("adopting a predecessor's lazy-pages daemon")
        .count();
    eprintln!(
        "fork crash: {running} branches running with their whole heap, {failed} failed; \
         {adopted} lazy-pages daemons still copying at a crash were adopted; {failed_lost} \
         branches failed whose daemons were killed"
    );
    assert!(
        failed_lost > 0,
        "killing the lazy-pages daemons right after the reply failed no branch: none was copying?"
    );
    if std::env::var("GROVE_LAZY_PAGES").as_deref() != Ok("0") {
        assert!(adopted > 0, "no crash hit a lazy restore in flight");
    }
    assert!(
        running > 0,
        "every branch failed: a crash must not cost the branches whose pages can be delivered"
    );

    let (s, v) = api.must(Method::DELETE, &format!("/v1/snapshots/{snap}"), None);
    assert_eq!(s, 204, "{v}");
    end_clean(node, &api);
}

/// A dump cut short, two ways: groved SIGKILLed (and restarted) while CRIU's code sits in the
/// sandbox's python (CRIU writes a `syscall` over the start of a process's lowest executable
/// mapping while its parasite runs there, and takes it out when it cures the process), and the
/// dump's CRIU itself SIGKILLed at that moment. The sandbox must never be left running with
/// that code in it (every later snapshot would carry it; where it sits in the vDSO, none of
/// them restores). A restart
/// lets the predecessor's dump finish: the sandbox stays running, clean, and snapshots and
/// forks with its heap whole. A CRIU killed outright leaves its parasite (the python, thawed,
/// would run on into it and die of a trap): the sandbox is failed.
#[test]
fn a_dump_cut_short_leaves_no_criu_code_in_a_running_sandbox() {
    if !runnable() {
        return;
    }
    let (mut node, api) = nodefs_node_with_image();

    // groved killed mid-dump.
    let (id, hash) = heap_sandbox(&api);
    let python = python_of(&node, &id);
    let mut criu = 0;
    let snapshot = snapshot_caught_mid_dump(node.socket(), &id, python, |pid| {
        criu = pid;
        node.kill9();
    });
    assert!(
        snapshot.is_err(),
        "the snapshot answered although groved was killed: {snapshot:?}"
    );
    // The restarted groved finds the predecessor's CRIU still held (as a slow dump would be):
    // it must let it finish, not kill it. It goes on half a second into the start.
    let resume = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        // SAFETY: kill(2) of the CRIU this test stopped.
        unsafe { libc::kill(criu, libc::SIGCONT) };
    });
    node.start();
    resume.join().unwrap();
    let (s, v) = api.must(Method::GET, &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(
        (s, v["state"].as_str()),
        (200, Some("running")),
        "after a restart during its dump: {v}"
    );
    assert_eq!(
        grove_runtime::criu_leftovers::find_in([python]),
        None,
        "the restarted groved left CRIU's code in the running sandbox"
    );
    let (s, v) = api.must(
        Method::POST,
        &format!("/v1/sandboxes/{id}/snapshot"),
        Some(json!({})),
    );
    assert_eq!(s, 201, "snapshot after the restart: {v}");
    let snap = v["id"].as_str().unwrap().to_string();
    let (s, v) = api.must(
        Method::POST,
        &format!("/v1/snapshots/{snap}/fork"),
        Some(json!({ "count": 1 })),
    );
    assert_eq!(s, 201, "fork after the restart: {v}");
    let branch = v["results"][0]["sandbox"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("the branch failed: {v}"))
        .to_string();
    assert_eq!(heap_hash_now(&api, &branch, 0), hash, "the branch's heap");
    for sb in [&branch, &id] {
        let (s, v) = api.must(Method::DELETE, &format!("/v1/sandboxes/{sb}"), None);
        assert_eq!(s, 204, "delete {sb}: {v}");
    }
    let (s, v) = api.must(Method::DELETE, &format!("/v1/snapshots/{snap}"), None);
    assert_eq!(s, 204, "{v}");

    // The dump's CRIU killed mid-dump.
    let (id, _) = heap_sandbox(&api);
    let python = python_of(&node, &id);
    let snapshot = snapshot_caught_mid_dump(node.socket(), &id, python, |criu| {
        // SAFETY: kill(2) of the CRIU this test stopped.
        unsafe { libc::kill(criu, libc::SIGKILL) };
    });
    let (s, v) = snapshot.expect("groved answers a snapshot whose CRIU was killed");
    assert!(s >= 400, "a dump whose CRIU was killed succeeded: {s} {v}");
    let (s, v) = api.must(Method::GET, &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["state"].as_str(),
        Some("failed"),
        "a sandbox holding CRIU's code was left {}: {v}",
        v["state"]
    );
    let log = std::fs::read_to_string(node.dir.join("groved.log")).unwrap_or_default();
    assert!(
        log.contains("its checkpoint's CRIU was killed part-way"),
        "the log says why: {}",
        node.log_tail()
    );
    let (s, v) = api.must(Method::DELETE, &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(s, 204, "delete {id}: {v}");
    end_clean(node, &api);
}

/// Asks for a snapshot of `id` on a thread, watches `python`'s mappings and, once CRIU's
/// parasite is mapped there (`grove_runtime::criu_leftovers`: it stays for the python's whole
/// dump), SIGSTOPs its tracer (the dump's CRIU, held with its parasite in the python) and calls
/// `cut` with the CRIU's pid; then the snapshot's answer (Err if groved was killed before it
/// answered).
fn snapshot_caught_mid_dump(
    socket: PathBuf,
    id: &str,
    python: i32,
    cut: impl FnOnce(i32),
) -> Result<(u16, Value), String> {
    use grove_runtime::criu_leftovers::CRIU_PARASITE_MAPPING;
    let maps = || std::fs::read_to_string(format!("/proc/{python}/maps")).unwrap_or_default();
    let path = format!("/v1/sandboxes/{id}/snapshot");
    let request =
        std::thread::spawn(move || Api::new(socket).call(Method::POST, &path, Some(json!({}))));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !maps().contains(CRIU_PARASITE_MAPPING) {
        assert!(
            !request.is_finished() && Instant::now() < deadline,
            "CRIU's parasite was never seen in the python during its dump"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    let status = std::fs::read_to_string(format!("/proc/{python}/status")).unwrap();
    let criu: i32 = status
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .and_then(|v| v.trim().parse().ok())
        .filter(|&pid| pid != 0)
        .expect("CRIU traces the python while its parasite is there");
    // SAFETY: kill(2) of the CRIU dumping this test's sandbox.
    unsafe { libc::kill(criu, libc::SIGSTOP) };
    if !maps().contains(CRIU_PARASITE_MAPPING) {
        // SAFETY: as above; a groved stopping on the panic would wait for it forever.
        unsafe { libc::kill(criu, libc::SIGCONT) };
        panic!("CRIU cured the python before it stopped");
    }
    cut(criu);
    request.join().unwrap()
}

/// The host pid of sandbox `id`'s `HEAP_APP` python.
fn python_of(node: &Node, id: &str) -> i32 {
    let cgroup = format!("/{}/{id}", node.cgroup_root);
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .find(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
            String::from_utf8_lossy(&cmd).contains("heap.py") && cg.contains(&cgroup)
        })
        .unwrap_or_else(|| panic!("no heap.py python in {id}"))
}

/// The node, everything deleted through the API, has no residue, leaves nothing behind once
/// stopped (no files, cgroups, CRIU or lazy-pages processes, grove-fsd), and its dir goes.
fn end_clean(mut node: Node, api: &Api) {
    let (_, residue) = api.must(Method::GET, "/v1/node/residue", None);
    assert_eq!(residue["items"], json!([]), "residue: {residue}");
    node.stop();
    let left = leftovers(&node.dir, &node.cgroup_root);
    assert!(left.is_empty(), "left behind: {left:?}");
    let criu = processes_naming(&node.dir);
    assert!(criu.is_empty(), "processes left: {criu:?}");
    let lazy: Vec<_> = std::fs::read_dir(node.dir.join("run/lazy-pages"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(lazy.is_empty(), "lazy restore dirs left: {lazy:?}");
    let fsd = fsd_of(&node.dir);
    assert!(fsd.is_empty(), "grove-fsd still running: {fsd:?}");
    for ctrl in [
        "memory", "pids", "cpu", "cpuacct", "freezer", "unified", "cpuset", "devices", "blkio",
    ] {
        let _ = std::fs::remove_dir(format!("/sys/fs/cgroup/{ctrl}/{}", node.cgroup_root));
    }
    std::fs::remove_dir_all(&node.dir).unwrap();
}

/// A started groved on nodefs roots with the base image imported, and its API.
fn nodefs_node_with_image() -> (Node, Api) {
    let mut node = Node::new(Roots::Nodefs, None);
    node.start();
    let api = Api::new(node.socket());
    let (s, v) = api.must(
        Method::POST,
        "/v1/images",
        Some(json!({"name": IMAGE, "source": "dir", "path": BASE_IMAGE_DIR})),
    );
    assert_eq!(s, 201, "importing the base image: {v}");
    (node, api)
}

/// A sandbox running `HEAP_APP`, once its heap is hashed: its id and the hash.
fn heap_sandbox(api: &Api) -> (String, String) {
    let limits = json!({"memory_mb": 400, "pids": 64});
    let (s, v) = api.must(
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"image": IMAGE, "limits": limits})),
    );
    assert_eq!(s, 201, "{v}");
    let src = v["id"].as_str().unwrap().to_string();
    let (s, v) = api.must(
        Method::POST,
        &format!("/v1/sandboxes/{src}/exec"),
        Some(json!({"shell": format!("cat > /root/heap.py <<'EOF'\n{HEAP_APP}\nEOF")})),
    );
    assert_eq!((s, v["exit_code"].as_i64()), (200, Some(0)), "{v}");
    let (s, v) = api.must(
        Method::POST,
        &format!("/v1/sandboxes/{src}/processes"),
        Some(json!({"shell": "exec python3 /root/heap.py"})),
    );
    assert_eq!(s, 201, "{v}");
    let (s, v) = api.must(
        Method::POST,
        &format!("/v1/sandboxes/{src}/exec"),
        Some(json!({"shell": "for i in $(seq 600); do [ -s /root/hash ] && break; sleep 0.1; done; cat /root/hash"})),
    );
    let hash = v["stdout"].as_str().unwrap_or("").trim().to_string();
    assert!(s == 200 && hash.len() == 64, "the heap hash: {v}");
    (src, hash)
}

/// Asks branch `id`'s workload to hash its heap again; "" if it died (a page read as zeros).
fn heap_hash_now(api: &Api, id: &str, round: usize) -> String {
    let n = format!("{round}{}", rand_suffix());
    let (s, v) = api.must(
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"shell": format!(
            "touch /root/go.{n}; for i in $(seq 450); do [ -s /root/now.{n} ] && break; \
             pgrep -x python3 >/dev/null || {{ echo dead; exit 0; }}; sleep 0.1; done; \
             cat /root/now.{n}"
        )})),
    );
    assert_eq!(s, 200, "exec in running branch {id}: {v}");
    v["stdout"].as_str().unwrap_or("").trim().to_string()
}

/// Pids of processes whose command line names `dir` (CRIU, its lazy-pages daemons, grove-fsd).
fn processes_naming(dir: &std::path::Path) -> Vec<(i32, String)> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            cmd.contains(&needle).then_some((pid, cmd))
        })
        .collect()
}
