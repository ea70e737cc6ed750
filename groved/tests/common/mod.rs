//! Test harness: one real groved per test binary (own temp state/run dirs, own cgroup root, never the node's
//! defaults), the base image imported once through the API, and every request/response checked against
//! groved/openapi.yaml.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use groved::client::Client;
use http_body_util::BodyExt as _;
use hyper::Method;
use serde_json::{json, Value};

pub const BASE_IMAGE_DIR: &str = "/var/lib/grove/images/debian12";
pub const IMAGE: &str = "debian12";

/// The OpenAPI document as JSON.
pub struct Spec {
    doc: Value,
    cache: Mutex<HashMap<String, std::sync::Arc<jsonschema::Validator>>>,
}

impl Spec {
    pub fn load() -> Spec {
        let text = include_str!("../../openapi.yaml");
        let doc: Value = serde_yaml::from_str(text).expect("openapi.yaml parses");
        Spec {
            doc,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The path template and operation matching a concrete request.
    pub fn operation(&self, method: &Method, path: &str) -> Result<(String, &Value), String> {
        let path = path.split('?').next().unwrap_or(path);
        let segs: Vec<&str> = path.split('/').collect();
        let paths = self.doc["paths"].as_object().ok_or("no paths")?;
        let mut best: Option<(usize, &String, &Value)> = None;
        for (tmpl, item) in paths {
            let t: Vec<&str> = tmpl.split('/').collect();
            if t.len() != segs.len() {
                continue;
            }
            let mut literal = 0;
            let ok = t.iter().zip(&segs).all(|(a, b)| {
                if a.starts_with('{') {
                    true
                } else {
                    literal += 1;
                    a == b
                }
            });
            if ok && best.is_none_or(|(l, _, _)| literal > l) {
                best = Some((literal, tmpl, item));
            }
        }
        let (_, tmpl, item) = best.ok_or_else(|| format!("{path} is not in openapi.yaml"))?;
        let op = &item[method.as_str().to_ascii_lowercase()];
        if op.is_null() {
            return Err(format!("{method} {tmpl} is not in openapi.yaml"));
        }
        Ok((tmpl.clone(), op))
    }

    fn deref<'a>(&'a self, v: &'a Value) -> &'a Value {
        match v.get("$ref").and_then(Value::as_str) {
            Some(r) => self
                .doc
                .pointer(r.trim_start_matches('#'))
                .unwrap_or(&Value::Null),
            None => v,
        }
    }

    fn validate(&self, schema: &Value, instance: &Value) -> Result<(), String> {
        let key = schema.to_string();
        let v = {
            let mut cache = self.cache.lock().unwrap();
            match cache.get(&key) {
                Some(v) => v.clone(),
                None => {
                    let mut root = self.doc.clone();
                    root["$schema"] = json!("https://json-schema.org/draft/2020-12/schema");
                    root["$defs"] = json!({ "target": schema });
                    root["$ref"] = json!("#/$defs/target");
                    let v = std::sync::Arc::new(
                        jsonschema::draft202012::new(&root).map_err(|e| e.to_string())?,
                    );
                    cache.insert(key, v.clone());
                    v
                }
            }
        };
        let errors: Vec<String> = v
            .iter_errors(instance)
            .map(|e| format!("{} at {}", e, e.instance_path))
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    /// Checks a value against a named component schema.
    pub fn check_schema(&self, name: &str, v: &Value) -> Result<(), String> {
        self.validate(
            &json!({ "$ref": format!("#/components/schemas/{name}") }),
            v,
        )
    }

    pub fn check_request(&self, method: &Method, path: &str, body: &Value) -> Result<(), String> {
        let (tmpl, op) = self.operation(method, path)?;
        let schema = &op["requestBody"]["content"]["application/json"]["schema"];
        if schema.is_null() {
            return Err(format!("{method} {tmpl} takes no JSON body"));
        }
        self.validate(schema, body)
            .map_err(|e| format!("request to {method} {tmpl}: {e}"))
    }

    pub fn check_response(
        &self,
        method: &Method,
        path: &str,
        status: u16,
        ct: &str,
        body: &[u8],
    ) -> Result<(), String> {
        let (tmpl, op) = self.operation(method, path)?;
        let responses = &op["responses"];
        let r = responses
            .get(status.to_string())
            .or_else(|| responses.get("default"));
        let r =
            self.deref(r.ok_or_else(|| format!("{status} not documented for {method} {tmpl}"))?);
        let content = &r["content"];
        if content.is_null() {
            return if body.is_empty() {
                Ok(())
            } else {
                Err(format!("{method} {tmpl} {status} documents no body"))
            };
        }
        let mime = ct.split(';').next().unwrap_or("").trim();
        let media = content
            .get(mime)
            .ok_or_else(|| format!("{method} {tmpl} {status}: {mime:?} not documented"))?;
        if mime == "application/json" {
            let v: Value = serde_json::from_slice(body)
                .map_err(|e| format!("{method} {tmpl}: not JSON: {e}"))?;
            self.validate(&media["schema"], &v)
                .map_err(|e| format!("response of {method} {tmpl} {status}: {e}"))?;
        }
        Ok(())
    }
}

pub fn spec() -> &'static Spec {
    static SPEC: OnceLock<Spec> = OnceLock::new();
    SPEC.get_or_init(Spec::load)
}

/// A response, already checked against the spec.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// Asserts the status; prints the body when it differs.
    pub fn expect(self, status: u16) -> Resp {
        assert_eq!(self.status, status, "body: {}", self.text());
        self
    }
    /// Asserts an error response with this status and field.
    pub fn expect_error(self, status: u16, field: Option<&str>) -> Value {
        assert_eq!(self.status, status, "body: {}", self.text());
        let v = self.json();
        if let Some(f) = field {
            let got = v["field"].as_str().unwrap_or("");
            assert!(got.contains(f), "field {got:?} should name {f:?}: {v}");
        }
        v
    }
}

pub struct Daemon {
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub tcp: String,
    pub api_key: String,
    pub cgroup_root: String,
    pid: i32,
    child: Mutex<Option<Child>>,
    pub rt: tokio::runtime::Runtime,
    pub client: Client,
}

static DAEMON: OnceLock<Daemon> = OnceLock::new();
/// Top-level config lines for this test binary's daemon: set before the first `daemon()`.
pub static EXTRA_CONFIG: OnceLock<&'static str> = OnceLock::new();
/// Tests that need the node to themselves (capacity) take this for writing; everyone else for reading.
pub static EXCLUSIVE: RwLock<()> = RwLock::new(());

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn groved_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_groved"))
}

pub fn grove_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_grove"))
}

pub fn init_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("GROVE_INIT_BINARY") {
        return PathBuf::from(p);
    }
    groved_bin().parent().unwrap().join("grove-init")
}

extern "C" fn stop_at_exit() {
    if let Some(d) = DAEMON.get() {
        d.stop();
    }
}

/// The test binary's daemon, started on first use and stopped (SIGTERM, then checked) at exit.
pub fn daemon() -> &'static Daemon {
    DAEMON.get_or_init(|| {
        let d = Daemon::start();
        // SAFETY: registers a plain extern "C" fn with no captured state.
        unsafe { libc::atexit(stop_at_exit) };
        d.import_base_image();
        d
    })
}

impl Daemon {
    fn start() -> Daemon {
        let tag = format!("{:x}", std::process::id());
        let dir = PathBuf::from(format!("/tmp/grove-test-{tag}-{}", rand_suffix()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("state")).unwrap();
        std::fs::create_dir_all(dir.join("run")).unwrap();
        let api_key = format!("key-{}", rand_suffix());
        std::fs::write(dir.join("api-key"), &api_key).unwrap();
        let tcp = format!("127.0.0.1:{}", free_port());
        let cgroup_root = format!("grove-t{tag}");
        let config = format!(
            r#"state_dir = "{state}"
run_dir = "{run}"
socket = "{run}/groved.sock"
listen = ["{tcp}"]
api_key_file = "{dir}/api-key"
root_provider = "nodefs"
cgroup_root = "{cgroup_root}"
reap_interval_ms = 200
net_pool = "10.213.0.0/16"
queue_timeout_ms = 300
{extra}
[capacity]
memory_mb = 8192
memory_reserve_mb = 0
sandboxes = 64
[defaults]
cpu_millis = 500
memory_mb = 256
pids = 256
open_files = 1024
# Admission holds each quota against the disk's free space: keep the suite's demand modest.
disk_mb = 64
[labels]
purpose = "groved-tests"
"#,
            state = dir.join("state").display(),
            run = dir.join("run").display(),
            dir = dir.display(),
            extra = EXTRA_CONFIG.get().copied().unwrap_or(""),
        );
        // A test binary's own sections (its registries, say), set before its first daemon().
        let config = config + &std::env::var("GROVE_TEST_EXTRA_CONFIG").unwrap_or_default();
        std::fs::write(dir.join("groved.toml"), config).unwrap();
        let log = std::fs::File::create(dir.join("groved.log")).unwrap();
        let child = Command::new(
            std::env::var_os("GROVE_FAULTS_GROVED").map_or_else(groved_bin, PathBuf::from),
        )
        .arg("--config")
        .arg(dir.join("groved.toml"))
        .env("GROVE_INIT_BINARY", init_binary())
        .env("GROVE_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawn groved");
        let socket = dir.join("run/groved.sock");
        let d = Daemon {
            pid: child.id() as i32,
            child: Mutex::new(Some(child)),
            dir,
            socket: socket.clone(),
            tcp,
            api_key,
            cgroup_root,
            rt: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap(),
            client: Client::new(socket),
        };
        let t = Instant::now();
        loop {
            if d.client.reachable() {
                break;
            }
            if let Some(status) = d
                .child
                .lock()
                .unwrap()
                .as_mut()
                .unwrap()
                .try_wait()
                .unwrap()
            {
                panic!("groved exited at start ({status}): {}", d.log());
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "groved did not come up: {}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        d
    }

    /// The daemon's pid (tests that watch its memory read /proc/<pid>/status).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("groved.log")).unwrap_or_default()
    }

    fn import_base_image(&self) {
        let r = self.call(
            Method::POST,
            "/v1/images",
            Some(json!({"name": IMAGE, "source": "dir", "path": BASE_IMAGE_DIR})),
        );
        assert!(
            r.status == 201,
            "importing the base image: {} {}",
            r.status,
            r.text()
        );
    }

    /// A JSON request (body checked against the spec when `valid`), the response checked against the spec.
    pub fn call(&self, method: Method, path: &str, body: Option<Value>) -> Resp {
        if let Some(b) = &body {
            spec()
                .check_request(&method, path, b)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        self.send(
            method,
            path,
            body.map(|b| ("application/json", Bytes::from(b.to_string()))),
            &[],
        )
    }

    /// A request whose body is deliberately outside the spec (bad-input tests): the request must NOT validate.
    pub fn call_invalid(&self, method: Method, path: &str, body: &str) -> Resp {
        if let Ok(v) = serde_json::from_str::<Value>(body) {
            assert!(
                spec().check_request(&method, path, &v).is_err(),
                "spec accepts {body}: tighten it or the test"
            );
        }
        self.send(
            method,
            path,
            Some(("application/json", Bytes::from(body.to_string()))),
            &[],
        )
    }

    pub fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<(&str, Bytes)>,
        headers: &[(&str, &str)],
    ) -> Resp {
        let r = self.send_unchecked(method.clone(), path, body, headers);
        let ct = r
            .headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        spec()
            .check_response(&method, path, r.status, &ct, &r.body)
            .unwrap_or_else(|e| panic!("{e}\nbody: {}", String::from_utf8_lossy(&r.body)));
        r
    }

    /// Only for paths the spec deliberately lacks.
    pub fn send_unchecked(
        &self,
        method: Method,
        path: &str,
        body: Option<(&str, Bytes)>,
        headers: &[(&str, &str)],
    ) -> Resp {
        let (ct, bytes) = body
            .map(|(c, b)| (Some(c), b))
            .unwrap_or((None, Bytes::new()));
        self.rt.block_on(async {
            let stream = tokio::net::UnixStream::connect(&self.socket)
                .await
                .expect("connect");
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .unwrap();
            tokio::spawn(conn);
            let mut req = hyper::Request::builder()
                .method(method.clone())
                .uri(path)
                .header("host", "groved");
            if let Some(ct) = ct {
                req = req.header("content-type", ct);
            }
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let resp = sender
                .send_request(req.body(http_body_util::Full::new(bytes)).unwrap())
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let headers = resp.headers().clone();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            Resp {
                status,
                headers,
                body,
            }
        })
    }

    /// Creates a sandbox from the base image; returns its id.
    pub fn create(&self, extra: Value) -> String {
        let mut body = json!({ "image": IMAGE });
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let r = self
            .call(Method::POST, "/v1/sandboxes", Some(body))
            .expect(201);
        r.json()["id"].as_str().unwrap().to_string()
    }

    pub fn exec(&self, id: &str, shell: &str) -> Value {
        self.call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({ "shell": shell })),
        )
        .expect(200)
        .json()
    }

    /// Forks `snapshot` with `body` (`{"count": N, ...}`); every branch must succeed. Their ids.
    pub fn fork(&self, snapshot: &str, body: Value) -> Vec<String> {
        let f = self
            .call(
                Method::POST,
                &format!("/v1/snapshots/{snapshot}/fork"),
                Some(body),
            )
            .expect(201)
            .json();
        f["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                assert!(r["error"].is_null(), "branch failed: {r}\n{}", self.log());
                r["sandbox"]["id"].as_str().unwrap().to_string()
            })
            .collect()
    }

    pub fn delete(&self, id: &str) {
        self.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .expect(204);
    }

    pub fn residue(&self) -> Value {
        self.call(Method::GET, "/v1/node/residue", None)
            .expect(200)
            .json()
    }

    /// SIGTERM, wait for a clean exit, check nothing is left under our cgroup root and run dir, remove the dirs.
    pub fn stop(&self) {
        let Some(mut child) = self.child.lock().unwrap().take() else {
            return;
        };
        // SAFETY: kill(2) on the pid of our own child.
        unsafe { libc::kill(self.pid, libc::SIGTERM) };
        let t = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break Some(s);
            }
            if t.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut leftovers = leftovers(&self.dir, &self.cgroup_root);
        // A clean stop empties and removes the run dir (socket, grove-init copy, CRIU's yard...).
        if let Ok(rd) = std::fs::read_dir(self.dir.join("run")) {
            let names: Vec<_> = rd.flatten().map(|e| e.file_name()).collect();
            leftovers.push(format!("run dir still there, holding {names:?}"));
        }
        if status.is_some_and(|s| s.success()) && leftovers.is_empty() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!(
                "groved stop: exit {status:?}, leftovers {leftovers:?}; log kept in {}",
                self.dir.display()
            );
            // SAFETY: _exit in an atexit handler to make the failure visible in the exit code.
            unsafe { libc::_exit(101) };
        }
    }
}

/// Mounts under `dir`, cgroups named `cgroup_root`, processes still using `dir`.
pub fn leftovers(dir: &Path, cgroup_root: &str) -> Vec<String> {
    let mut out = Vec::new();
    let d = dir.display().to_string();
    for line in std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
    {
        if line.contains(&d) {
            out.push(format!("mount {line}"));
        }
    }
    if let Ok(ctrls) = std::fs::read_dir("/sys/fs/cgroup") {
        for c in ctrls.flatten() {
            let p = c.path().join(cgroup_root);
            if let Ok(rd) = std::fs::read_dir(&p) {
                for e in rd.flatten().filter(|e| e.path().is_dir()) {
                    out.push(format!("cgroup {}", e.path().display()));
                }
            }
        }
    }
    out
}

/// What a groved that is still running holds that is not its own: [`leftovers`] less its copy of
/// grove-init (a tmpfs at `<run_dir>/init`) and its own cgroups (`<cgroup root>/daemon`).
pub fn leftovers_while_running(dir: &Path, cgroup_root: &str) -> Vec<String> {
    let own_mount = format!(" {}/run/init ", dir.display());
    let own_cgroup = format!("/{cgroup_root}/daemon");
    leftovers(dir, cgroup_root)
        .into_iter()
        .filter(|l| !l.contains(&own_mount) && !l.ends_with(&own_cgroup))
        .collect()
}

/// Pids of grove-fsd processes serving a socket under `dir`.
pub fn fsd_of(dir: &std::path::Path) -> Vec<i32> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd);
            (cmd.contains("grove-fsd") && cmd.contains(&needle)).then_some(pid)
        })
        .collect()
}

pub fn rand_suffix() -> String {
    format!("{:08x}", rand::random::<u32>())
}

/// Reads SSE events from a streaming response until `stop` says so or the stream ends.
pub fn sse_events(
    d: &Daemon,
    method: Method,
    path: &str,
    body: Option<Value>,
    mut stop: impl FnMut(&str, &Value) -> bool,
) -> Vec<(String, Value)> {
    if let Some(b) = &body {
        spec()
            .check_request(&method, path, b)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    d.rt.block_on(async {
        let stream = tokio::net::UnixStream::connect(&d.socket).await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
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
        let resp = sender
            .send_request(req.body(http_body_util::Full::new(bytes)).unwrap())
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let ct = resp
            .headers()
            .get("content-type")
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        spec().check_response(&method, path, 200, &ct, b"").unwrap();
        let mut b = resp.into_body();
        let mut parser = groved::client::SseParser::default();
        let mut out = Vec::new();
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(30), b.frame())
                .await
                .expect("SSE stalled");
            let Some(frame) = frame else { break };
            if let Some(data) = frame.unwrap().data_ref() {
                for (ev, data) in parser.push(data) {
                    let v: Value = serde_json::from_str(&data).unwrap();
                    let done = stop(&ev, &v);
                    out.push((ev, v));
                    if done {
                        return out;
                    }
                }
            }
        }
        out
    })
}

#[allow(unused_imports)] // not every test binary skips
pub use grove_testkit::capability_missing;
