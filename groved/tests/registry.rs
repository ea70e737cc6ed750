//! Pulls from real registries: Debian's `docker-registry` (the CNCF distribution registry) on
//! loopback ports, one with htpasswd (Basic) auth and one with token auth from a tiny issuer of
//! this test's own, images pushed into them with `skopeo` from OCI layouts built here from
//! the base image's shell and libc. Proxies in front of the first one count what is fetched,
//! cut a blob mid-way, and alter a manifest. Two more serve over TLS: one with a certificate a
//! CA of the test's own signs (given to groved in `ca_files`), one whose CA groved is not told.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::*;
use hyper::Method;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const USER: &str = "grove";
const PASS: &str = "s3cret-pass";

fn sha(b: &[u8]) -> String {
    format!("sha256:{}", hex_of(&Sha256::digest(b)))
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn tools_missing() -> Option<String> {
    for t in ["docker-registry", "skopeo", "htpasswd", "openssl"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {t}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return Some(format!("{t} is not installed (scripts/setup installs it)"));
        }
    }
    None
}

/// A `docker-registry serve` on a loopback port.
struct Registry {
    port: u16,
    child: Child,
}

impl Registry {
    fn start(dir: &Path, auth_yaml: &str) -> Registry {
        Registry::serve(dir, auth_yaml, None)
    }

    /// Over TLS with `cert` (for 127.0.0.1) and its `key`.
    fn start_tls(dir: &Path, auth_yaml: &str, (cert, key): (&Path, &Path)) -> Registry {
        Registry::serve(dir, auth_yaml, Some((cert, key)))
    }

    fn serve(dir: &Path, auth_yaml: &str, tls: Option<(&Path, &Path)>) -> Registry {
        std::fs::create_dir_all(dir.join("data")).unwrap();
        let port = free_port();
        let tls_yaml = tls.map_or(String::new(), |(c, k)| {
            format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                c.display(),
                k.display()
            )
        });
        let cfg = format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n  \
             delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n{tls_yaml}{auth_yaml}",
            dir.join("data").display()
        );
        std::fs::write(dir.join("config.yml"), cfg).unwrap();
        let log = std::fs::File::create(dir.join("registry.log")).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(dir.join("config.yml"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("docker-registry");
        AT_EXIT.lock().unwrap().0.push(child.id() as i32);
        let t = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "registry did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Registry { port, child }
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads one HTTP/1 request head; returns (request line, headers lower-cased, raw head).
fn read_head(s: &mut BufReader<TcpStream>) -> Option<(String, HashMap<String, String>, Vec<u8>)> {
    let mut raw = Vec::new();
    let mut line = String::new();
    s.read_line(&mut line).ok()?;
    if line.is_empty() {
        return None;
    }
    raw.extend_from_slice(line.as_bytes());
    let first = line.trim_end().to_string();
    let mut headers = HashMap::new();
    loop {
        let mut l = String::new();
        s.read_line(&mut l).ok()?;
        raw.extend_from_slice(l.as_bytes());
        if l == "\r\n" || l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.trim_end().split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    Some((first, headers, raw))
}

/// A CA of the test's own in `dir` and a server certificate it signs for 127.0.0.1 (nothing
/// else: `localhost` is a name the certificate does not hold). Returns (ca, cert, key).
fn tls_certs(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=grove-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "srv.key",
        "-out",
        "srv.csr",
    ]);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
        "-out",
        "srv.pem",
    ]);
    (dir.join("ca.pem"), dir.join("srv.pem"), dir.join("srv.key"))
}

/// A plain-HTTP server that answers every request with a 400, as an HTTP registry answers a
/// TLS hello.
fn plain_http_server() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            let mut buf = [0u8; 512];
            let _ = c.read(&mut buf);
            let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        }
    });
    port
}

/// What a proxy does to the answers it relays.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Pass,
    /// Blobs over 1.5 MB: half, then the connection closes.
    CutBigBlobs,
    /// Manifests get a byte more than their digest covers.
    AlterManifests,
}

/// A proxy in front of a registry, one request per connection; counts the GETs per path.
struct Proxy {
    port: u16,
    gets: Arc<Mutex<HashMap<String, usize>>>,
}

impl Proxy {
    fn start(upstream: u16, mode: Mode) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let gets = Arc::new(Mutex::new(HashMap::new()));
        let g = gets.clone();
        std::thread::spawn(move || {
            for c in l.incoming().flatten() {
                let g = g.clone();
                std::thread::spawn(move || relay(c, upstream, mode, &g));
            }
        });
        Proxy { port, gets }
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn gets_of(&self, needle: &str) -> usize {
        let g = self.gets.lock().unwrap();
        g.iter()
            .filter(|(p, _)| p.contains(needle))
            .map(|(_, n)| n)
            .sum()
    }
}

fn relay(c: TcpStream, upstream: u16, mode: Mode, gets: &Mutex<HashMap<String, usize>>) {
    let mut r = BufReader::new(c.try_clone().unwrap());
    let Some((first, headers, _)) = read_head(&mut r) else {
        return;
    };
    let path = first.split(' ').nth(1).unwrap_or("").to_string();
    if first.starts_with("GET ") {
        *gets.lock().unwrap().entry(path.clone()).or_default() += 1;
    }
    let mut up = TcpStream::connect(("127.0.0.1", upstream)).unwrap();
    let mut head = format!("{first}\r\n");
    for (k, v) in &headers {
        if k != "connection" && k != "host" {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
    }
    head.push_str(&format!(
        "host: 127.0.0.1:{upstream}\r\nconnection: close\r\n\r\n"
    ));
    up.write_all(head.as_bytes()).unwrap();
    let mut resp = Vec::new();
    let _ = up.read_to_end(&mut resp);
    let split = resp
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| p + 4)
        .unwrap_or(resp.len());
    let (h, body) = resp.split_at(split);
    let mut h = String::from_utf8_lossy(h).into_owned();
    let mut body = body.to_vec();
    let mut c = c;
    if mode == Mode::CutBigBlobs && path.contains("/blobs/") && body.len() > 1_500_000 {
        let _ = c.write_all(h.as_bytes());
        let _ = c.write_all(&body[..body.len() / 2]);
        return;
    }
    if mode == Mode::AlterManifests && path.contains("/manifests/") && !body.is_empty() {
        body.push(b' ');
        h = h
            .lines()
            .map(|l| {
                if l.to_ascii_lowercase().starts_with("content-length:") {
                    format!("Content-Length: {}", body.len())
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\r\n");
        h.push_str("\r\n");
    }
    let _ = c.write_all(h.as_bytes());
    let _ = c.write_all(&body);
}

/// A token issuer for the registry's `auth: token`: Basic credentials in, an RS256 JWT with
/// the asked access out (signed by `openssl`, its certificate in `x5c`).
struct Issuer {
    port: u16,
    issued: Arc<AtomicUsize>,
}

impl Issuer {
    fn start(dir: &Path) -> Issuer {
        let ok = Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            ])
            .args(["-subj", "/CN=grove-test-token"])
            .arg("-keyout")
            .arg(dir.join("key.pem"))
            .arg("-out")
            .arg(dir.join("cert.pem"))
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(ok.success());
        let der = Command::new("openssl")
            .args(["x509", "-outform", "DER", "-in"])
            .arg(dir.join("cert.pem"))
            .output()
            .unwrap()
            .stdout;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let issued = Arc::new(AtomicUsize::new(0));
        let (n, key) = (issued.clone(), dir.join("key.pem"));
        std::thread::spawn(move || {
            for c in l.incoming().flatten() {
                let (n, key, der) = (n.clone(), key.clone(), der.clone());
                std::thread::spawn(move || issue(c, &key, &der, &n));
            }
        });
        Issuer { port, issued }
    }
}

fn b64u(b: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

fn issue(c: TcpStream, key: &Path, der: &[u8], issued: &AtomicUsize) {
    let mut r = BufReader::new(c.try_clone().unwrap());
    let Some((first, headers, _)) = read_head(&mut r) else {
        return;
    };
    let mut c = c;
    let want = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASS}"))
    );
    if headers.get("authorization") != Some(&want) {
        let _ = c.write_all(
            b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        );
        return;
    }
    let query = first
        .split(' ')
        .nth(1)
        .and_then(|p| p.split_once('?'))
        .map(|(_, q)| q.to_string())
        .unwrap_or_default();
    let mut access = Vec::new();
    for kv in query.split('&') {
        if let Some(s) = kv.strip_prefix("scope=") {
            let s = s
                .replace("%3A", ":")
                .replace("%2F", "/")
                .replace("%2C", ",");
            let parts: Vec<&str> = s.splitn(3, ':').collect();
            if parts.len() == 3 {
                access.push(json!({"type": parts[0], "name": parts[1],
                    "actions": parts[2].split(',').collect::<Vec<_>>()}));
            }
        }
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let header = json!({"alg": "RS256", "typ": "JWT",
        "x5c": [base64::engine::general_purpose::STANDARD.encode(der)]});
    let claims = json!({"iss": "grove-test-issuer", "sub": USER, "aud": "grove-test",
        "exp": now + 600, "nbf": now - 10, "iat": now, "jti": rand_suffix(), "access": access});
    let input = format!(
        "{}.{}",
        b64u(header.to_string().as_bytes()),
        b64u(claims.to_string().as_bytes())
    );
    let mut p = Command::new("openssl")
        .args(["dgst", "-sha256", "-sign"])
        .arg(key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    p.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let sig = p.wait_with_output().unwrap().stdout;
    let tok = format!("{input}.{}", b64u(&sig));
    issued.fetch_add(1, Ordering::SeqCst);
    let body = json!({"token": tok, "access_token": tok, "expires_in": 600}).to_string();
    let _ = c.write_all(
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
}

/// A gzip'd tar layer of `files` (path, content; a trailing `/` makes a directory, `->` a symlink).
fn layer(files: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in files {
        let mut h = tar::Header::new_ustar();
        h.set_mtime(1_700_000_000);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mode(0o777);
        if let Some(dir) = path.strip_suffix('/') {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_mode(0o755);
            h.set_size(0);
            b.append_data(&mut h, dir, &[][..]).unwrap();
        } else if let Some((link, target)) = path.split_once(" -> ") {
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            b.append_link(&mut h, link, target).unwrap();
        } else {
            h.set_entry_type(tar::EntryType::Regular);
            h.set_mode(0o755);
            h.set_size(data.len() as u64);
            b.append_data(&mut h, path, &data[..]).unwrap();
        }
    }
    let tar = b.into_inner().unwrap();
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(&tar).unwrap();
    e.finish().unwrap()
}

/// The base image's shell and libc: enough to run `sh -c` in a sandbox (a few MB).
fn base_layer() -> Vec<u8> {
    let f = |p: &str| std::fs::read(Path::new(BASE_IMAGE_DIR).join(p)).unwrap();
    let mut files: Vec<(&str, Vec<u8>)> = [
        "usr/",
        "usr/bin/",
        "usr/lib/",
        "usr/lib/x86_64-linux-gnu/",
        "usr/lib64/",
        "etc/",
        "tmp/",
        "proc/",
        "dev/",
        "sys/",
        "run/",
        "root/",
        "srv/",
    ]
    .iter()
    .map(|d| (*d, Vec::new()))
    .collect();
    files.extend([
        ("etc/passwd", f("etc/passwd")),
        ("etc/group", f("etc/group")),
        ("usr/bin/dash", f("usr/bin/dash")),
        ("usr/bin/sh", f("usr/bin/dash")),
        ("usr/bin/cat", f("usr/bin/cat")),
        (
            "usr/lib/x86_64-linux-gnu/libc.so.6",
            f("usr/lib/x86_64-linux-gnu/libc.so.6"),
        ),
        (
            "usr/lib64/ld-linux-x86-64.so.2",
            f("usr/lib64/ld-linux-x86-64.so.2"),
        ),
        // A grove-init built against glibc (not the static one CI uses) needs it.
        (
            "usr/lib/x86_64-linux-gnu/libgcc_s.so.1",
            f("usr/lib/x86_64-linux-gnu/libgcc_s.so.1"),
        ),
        ("bin -> usr/bin", Vec::new()),
        ("lib -> usr/lib", Vec::new()),
        ("lib64 -> usr/lib64", Vec::new()),
    ]);
    layer(&files)
}

/// Deterministic incompressible bytes.
fn noise(seed: u8, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n + 32);
    let mut h = Sha256::digest([seed]).to_vec();
    while out.len() < n {
        h = Sha256::digest(&h).to_vec();
        out.extend_from_slice(&h);
    }
    out.truncate(n);
    out
}

/// An OCI layout being filled with blobs.
struct Layout {
    dir: PathBuf,
    index: Vec<Value>,
}

impl Layout {
    fn new(dir: &Path) -> Layout {
        std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        Layout {
            dir: dir.into(),
            index: Vec::new(),
        }
    }

    fn blob(&self, data: &[u8]) -> Value {
        let d = sha(data);
        std::fs::write(
            self.dir
                .join("blobs/sha256")
                .join(d.trim_start_matches("sha256:")),
            data,
        )
        .unwrap();
        json!({"digest": d, "size": data.len()})
    }

    /// An image manifest of `layers` with `config` (the OCI config's `config` object).
    fn image(&self, arch: &str, layers: &[&Vec<u8>], config: Value) -> Value {
        let cfg = json!({"architecture": arch, "os": "linux", "config": config,
            "rootfs": {"type": "layers", "diff_ids": []}});
        let mut c = self.blob(cfg.to_string().as_bytes());
        c["mediaType"] = "application/vnd.oci.image.config.v1+json".into();
        let ls: Vec<Value> = layers
            .iter()
            .map(|l| {
                let mut d = self.blob(l);
                d["mediaType"] = "application/vnd.oci.image.layer.v1.tar+gzip".into();
                d
            })
            .collect();
        let m = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": c, "layers": ls});
        let mut d = self.blob(m.to_string().as_bytes());
        d["mediaType"] = "application/vnd.oci.image.manifest.v1+json".into();
        d["platform"] = json!({"os": "linux", "architecture": arch});
        d
    }

    fn tag(&mut self, name: &str, mut desc: Value) {
        desc["annotations"] = json!({"org.opencontainers.image.ref.name": name});
        self.index.push(desc);
        let idx = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": self.index});
        std::fs::write(self.dir.join("index.json"), idx.to_string()).unwrap();
    }

    fn index_of(&self, manifests: Vec<Value>) -> Value {
        let idx = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": manifests});
        let mut d = self.blob(idx.to_string().as_bytes());
        d["mediaType"] = "application/vnd.oci.image.index.v1+json".into();
        d
    }

    fn push(&self, tag: &str, dest: &str) {
        let out = Command::new("skopeo")
            .args(["copy", "--all", "--quiet", "--dest-tls-verify=false"])
            .args(["--dest-creds", &format!("{USER}:{PASS}")])
            .arg(format!("oci:{}:{tag}", self.dir.display()))
            .arg(format!("docker://{dest}"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "skopeo push of {tag} to {dest}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// What the fixture leaves for the end of the test binary (statics are never dropped): the
/// registries' pids and the scratch directory.
static AT_EXIT: Mutex<(Vec<i32>, Option<PathBuf>)> = Mutex::new((Vec::new(), None));

extern "C" fn cleanup_at_exit() {
    let Ok(mut g) = AT_EXIT.lock() else { return };
    for pid in g.0.drain(..) {
        // SAFETY: kill(2) and waitpid(2) on the pid of a child this process started.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
    }
    if let Some(d) = g.1.take() {
        let _ = std::fs::remove_dir_all(d);
    }
}

struct Fixture {
    basic: Registry,
    token: Registry,
    /// TLS, its CA in `ca_files`, htpasswd auth.
    tls: Registry,
    /// TLS, signed by a CA groved is not told of.
    tls_untrusted: Registry,
    /// Plain HTTP, not listed as insecure.
    plain_unlisted: u16,
    issuer: Issuer,
    counting: Proxy,
    cutting: Proxy,
    altering: Proxy,
    /// A registry address nothing listens on, mirrored by `basic`.
    mirrored: String,
    /// `basic` under another name, with a wrong password configured.
    wrong_pass: String,
    big_layers: Vec<String>,
    conc_layer: String,
    _tmp: tempfile::TempDir,
}

/// Starts the registries, pushes the images, and points the test daemon at them.
fn fixture() -> Option<&'static Fixture> {
    static F: OnceLock<Option<Fixture>> = OnceLock::new();
    F.get_or_init(|| {
        if let Some(why) = tools_missing() {
            grove_testkit::capability_missing(&why);
            return None;
        }
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        AT_EXIT.lock().unwrap().1 = Some(t.to_path_buf());
        // SAFETY: registers a plain extern "C" fn with no captured state.
        unsafe { libc::atexit(cleanup_at_exit) };
        std::fs::create_dir_all(t.join("basic")).unwrap();
        let ht = Command::new("htpasswd")
            .args(["-Bbn", USER, PASS])
            .output()
            .unwrap();
        assert!(ht.status.success());
        std::fs::write(t.join("basic/htpasswd"), ht.stdout).unwrap();
        let basic = Registry::start(
            &t.join("basic"),
            &format!(
                "auth:\n  htpasswd:\n    realm: grove-test\n    path: {}\n",
                t.join("basic/htpasswd").display()
            ),
        );
        std::fs::create_dir_all(t.join("token")).unwrap();
        let issuer = Issuer::start(&t.join("token"));
        let token = Registry::start(
            &t.join("token"),
            &format!(
                "auth:\n  token:\n    realm: http://127.0.0.1:{}/token\n    service: grove-test\n    \
                 issuer: grove-test-issuer\n    rootcertbundle: {}\n",
                issuer.port,
                t.join("token/cert.pem").display()
            ),
        );

        let (ca, cert, key) = tls_certs(&t.join("tls/certs"));
        let htpasswd_yaml = format!(
            "auth:\n  htpasswd:\n    realm: grove-test\n    path: {}\n",
            t.join("basic/htpasswd").display()
        );
        let tls = Registry::start_tls(&t.join("tls"), &htpasswd_yaml, (&cert, &key));
        let (_, other_cert, other_key) = tls_certs(&t.join("tls-untrusted/certs"));
        let tls_untrusted =
            Registry::start_tls(&t.join("tls-untrusted"), "", (&other_cert, &other_key));
        let plain_unlisted = plain_http_server();

        let base = base_layer();
        let app1 = layer(&[("srv/", vec![]), ("srv/app.txt", b"app one\n".to_vec())]);
        let app2 = layer(&[("srv/", vec![]), ("srv/app.txt", b"app two\n".to_vec())]);
        let arm = layer(&[("srv/", vec![]), ("srv/arch", b"arm64\n".to_vec())]);
        let big1 = layer(&[("one", noise(1, 600_000))]);
        let big2 = layer(&[("two", noise(2, 2_000_000))]);
        let conc = layer(&[("srv/", vec![]), ("srv/c", noise(3, 300_000))]);
        let cfg = |greeting: &str| {
            json!({"Env": ["PATH=/usr/bin:/bin", format!("GREETING={greeting}")],
                "WorkingDir": "/srv", "User": "1000:1000",
                "Entrypoint": ["/bin/sh", "-c"], "Cmd": ["echo cmd-ran; cat app.txt"],
                "ExposedPorts": {"8080/tcp": {}}, "Labels": {"org.example.app": greeting}})
        };
        let mut l = Layout::new(&t.join("layout"));
        let d = l.image("amd64", &[&base, &app1], cfg("hello"));
        l.tag("app", d.clone());
        let d2 = l.image("amd64", &[&base, &app2], cfg("two"));
        l.tag("app2", d2);
        let darm = l.image("arm64", &[&base, &arm], cfg("arm"));
        let multi = l.index_of(vec![darm, d]);
        l.tag("multi", multi);
        let dbig = l.image("amd64", &[&big1, &big2], json!({}));
        l.tag("big", dbig);
        let dconc = l.image("amd64", &[&base, &conc], cfg("conc"));
        l.tag("conc", dconc);
        for (tag, repo) in [
            ("app", "ns/app:1"),
            ("app2", "ns/app2:1"),
            ("multi", "ns/multi:1"),
            ("big", "ns/big:1"),
            ("conc", "ns/conc:1"),
        ] {
            l.push(tag, &format!("{}/{repo}", basic.host()));
        }
        l.push("app", &format!("{}/ns/app:1", token.host()));
        l.push("app", &format!("{}/ns/app:1", tls.host()));

        let counting = Proxy::start(basic.port, Mode::Pass);
        let cutting = Proxy::start(basic.port, Mode::CutBigBlobs);
        let altering = Proxy::start(basic.port, Mode::AlterManifests);
        let mirrored = format!("127.0.0.1:{}", free_port());
        let wrong_pass = format!("localhost:{}", basic.port);
        std::fs::write(
            t.join("auth.json"),
            json!({"auths": {token.host(): {"auth": base64::engine::general_purpose::STANDARD
                .encode(format!("{USER}:{PASS}"))}}})
            .to_string(),
        )
        .unwrap();
        let mut extra = format!(
            "[registries]\ninsecure = [{}]\nauth_file = \"{}\"\nca_files = [\"{}\"]\n\
             [registries.mirrors]\n\"{mirrored}\" = [\"{}\"]\n",
            [
                basic.host(),
                token.host(),
                format!("127.0.0.1:{}", issuer.port),
                counting.host(),
                cutting.host(),
                altering.host(),
                mirrored.clone(),
                wrong_pass.clone(),
            ]
            .iter()
            .map(|h| format!("\"{h}\""))
            .collect::<Vec<_>>()
            .join(", "),
            t.join("auth.json").display(),
            ca.display(),
            basic.host(),
        );
        for (h, p) in [
            (basic.host(), PASS),
            (counting.host(), PASS),
            (cutting.host(), PASS),
            (altering.host(), PASS),
            (wrong_pass.clone(), "not-the-password"),
            (tls.host(), PASS),
            (format!("localhost:{}", tls.port), PASS),
        ] {
            extra.push_str(&format!(
                "[registries.credentials.\"{h}\"]\nusername = \"{USER}\"\npassword = \"{p}\"\n"
            ));
        }
        std::env::set_var("GROVE_TEST_EXTRA_CONFIG", extra);
        Some(Fixture {
            basic,
            token,
            tls,
            tls_untrusted,
            plain_unlisted,
            issuer,
            counting,
            cutting,
            altering,
            mirrored,
            wrong_pass,
            big_layers: vec![sha(&big1), sha(&big2)],
            conc_layer: sha(&conc),
            _tmp: tmp,
        })
    })
    .as_ref()
}

fn pull(d: &Daemon, body: Value) -> Resp {
    d.call(Method::POST, "/v1/images/pull", Some(body))
}

/// The events of a streamed pull, up to its `done` or `error`.
fn pull_events(d: &Daemon, body: Value) -> Vec<Value> {
    sse_events(
        d,
        Method::POST,
        "/v1/images/pull?stream=true",
        Some(body),
        |k, _| k == "done" || k == "error",
    )
    .into_iter()
    .map(|(_, v)| v)
    .collect()
}

fn forget(d: &Daemon, name: &str) {
    d.call(Method::DELETE, &format!("/v1/images/{name}"), None)
        .expect(204);
}

fn clean_store(d: &Daemon) {
    let r = d
        .call(Method::POST, "/v1/node/fsck", None)
        .expect(200)
        .json();
    assert_eq!(r["ok"], true, "fsck: {r}");
}

#[test]
fn a_pulled_image_runs_with_its_config_and_shares_layers() {
    let Some(f) = fixture() else { return };
    let d = daemon();
    let img = pull(
        d,
        json!({"reference": format!("{}/ns/app:1", f.basic.host()), "name": "reg-app"}),
    )
    .expect(201)
    .json();
    assert_eq!(img["name"], "reg-app");
    let got = d
        .call(Method::GET, "/v1/images/reg-app", None)
        .expect(200)
        .json();
    let c = &got["config"];
    assert_eq!(c["working_dir"], "/srv");
    assert_eq!(c["user"], "1000:1000");
    assert_eq!(c["cmd"], json!(["echo cmd-ran; cat app.txt"]));
    assert_eq!(c["exposed_ports"], json!(["8080/tcp"]));
    assert_eq!(c["labels"]["org.example.app"], "hello");
    assert_eq!(c["layers"].as_array().unwrap().len(), 2);

    // Env and WorkingDir apply at create; the request's env wins over the image's.
    let id = {
        let r = d.call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"image": "reg-app", "env": {"OTHER": "x"}})),
        );
        let log = d.log();
        let tail = &log[log.len().saturating_sub(3000)..];
        assert_eq!(r.status, 201, "{} {tail}", r.text());
        r.json()["id"].as_str().unwrap().to_string()
    };
    let out = d.exec(&id, "echo $GREETING $OTHER; pwd; cat app.txt");
    assert_eq!(out["stdout"], "hello x\n/srv\napp one\n", "{out}");
    d.delete(&id);

    // `grove run IMAGE` with no command runs Entrypoint + Cmd.
    let run = Command::new(grove_bin())
        .arg("--socket")
        .arg(&d.socket)
        .args(["run", "reg-app"])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&run.stdout), "cmd-ran\napp one\n");

    // The second image shares the base layer: it is not fetched again.
    let ev = pull_events(
        d,
        json!({"reference": format!("{}/ns/app2:1", f.basic.host()), "name": "reg-app2"}),
    );
    let layers: Vec<&Value> = ev.iter().filter(|e| e["status"] == "layer").collect();
    assert_eq!(layers.len(), 2, "{ev:?}");
    assert_eq!(layers[0]["cached"], true, "{ev:?}");
    assert_eq!(layers[1]["cached"], false, "{ev:?}");
    let done = ev.last().unwrap();
    assert_eq!(done["status"], "done", "{ev:?}");
    assert_eq!(done["layers_fetched"], 1);
    assert_eq!(done["image"]["name"], "reg-app2");
    // The name is taken now.
    pull(
        d,
        json!({"reference": format!("{}/ns/app2:1", f.basic.host()), "name": "reg-app2"}),
    )
    .expect_error(409, Some("name"));
    forget(d, "reg-app");
    forget(d, "reg-app2");
    d.call(Method::POST, "/v1/node/gc", None).expect(200);
    clean_store(d);
}

#[test]
fn token_auth_from_the_auth_file_and_a_mirror() {
    let Some(f) = fixture() else { return };
    let d = daemon();
    let before = f.issuer.issued.load(Ordering::SeqCst);
    let img = pull(
        d,
        json!({"reference": format!("{}/ns/app:1", f.token.host()), "name": "reg-tok"}),
    )
    .expect(201)
    .json();
    assert_eq!(img["config"]["labels"]["org.example.app"], "hello");
    assert!(
        f.issuer.issued.load(Ordering::SeqCst) > before,
        "no token was asked for"
    );
    // Nothing listens at the mirrored address: its mirror serves.
    pull(
        d,
        json!({"reference": format!("{}/ns/app:1", f.mirrored), "name": "reg-mirror"}),
    )
    .expect(201);
    forget(d, "reg-tok");
    forget(d, "reg-mirror");
}

#[test]
fn an_index_gives_the_platform_asked_for() {
    let Some(f) = fixture() else { return };
    let d = daemon();
    let r = format!("{}/ns/multi:1", f.basic.host());
    let amd = pull(d, json!({"reference": r, "name": "reg-multi"}))
        .expect(201)
        .json();
    assert_eq!(amd["config"]["labels"]["org.example.app"], "hello");
    let arm = pull(
        d,
        json!({"reference": r, "name": "reg-multi-arm", "platform": "linux/arm64"}),
    )
    .expect(201)
    .json();
    assert_eq!(arm["config"]["labels"]["org.example.app"], "arm");
    let e = pull(
        d,
        json!({"reference": r, "name": "reg-multi-s", "platform": "linux/s390x"}),
    )
    .expect_error(404, Some("platform"));
    assert!(
        e["message"].as_str().unwrap().contains("linux/arm64"),
        "{e}"
    );
    forget(d, "reg-multi");
    forget(d, "reg-multi-arm");
}

#[test]
fn concurrent_pulls_fetch_each_blob_once() {
    let Some(f) = fixture() else { return };
    let d = daemon();
    let r = format!("{}/ns/conc:1", f.counting.host());
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| pull(d, json!({"reference": r, "name": "reg-conc-a"})).status);
        let b = s.spawn(|| pull(d, json!({"reference": r, "name": "reg-conc-b"})).status);
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!((a, b), (201, 201));
    // Each layer blob the store lacked was fetched once between the two pulls.
    assert_eq!(
        f.counting.gets_of(&f.conc_layer),
        1,
        "{:?}",
        f.counting.gets.lock().unwrap()
    );
    forget(d, "reg-conc-a");
    forget(d, "reg-conc-b");
}

#[test]
fn bad_pulls_fail_naming_what_and_keep_nothing() {
    let Some(f) = fixture() else { return };
    let d = daemon();
    // Unknown reference.
    let e = pull(
        d,
        json!({"reference": format!("{}/ns/nope:1", f.basic.host()), "name": "reg-bad"}),
    )
    .expect_error(404, Some("reference"));
    assert!(e["message"].as_str().unwrap().contains("ns/nope"), "{e}");
    // Wrong password.
    let e = pull(
        d,
        json!({"reference": format!("{}/ns/app:1", f.wrong_pass), "name": "reg-bad"}),
    )
    .expect_error(403, Some("reference"));
    assert_eq!(e["code"], "registry_denied", "{e}");
    // A plain-HTTP registry not listed as insecure is spoken to over TLS only, which it
    // cannot answer: the error says where to list it.
    let e = pull(
        d,
        json!({"reference": format!("127.0.0.1:{}/x:1", f.plain_unlisted), "name": "reg-bad"}),
    )
    .expect_error(502, Some("reference"));
    assert_eq!(e["code"], "registry_untrusted", "{e}");
    assert!(e["message"].as_str().unwrap().contains("insecure"), "{e}");
    // Malformed input.
    pull(
        d,
        json!({"reference": "127.0.0.1:1/../x", "name": "reg-bad"}),
    )
    .expect_error(422, Some("reference"));
    pull(d, json!({"reference": "x", "name": "../x"})).expect_error(422, Some("name"));
    pull(d, json!({"reference": "x", "platform": "linux"})).expect_error(422, Some("platform"));
    // A manifest that is not what its digest says.
    let e = pull(
        d,
        json!({"reference": format!("{}/ns/app:1", f.altering.host()), "name": "reg-bad"}),
    )
    .expect_error(502, Some("reference"));
    assert_eq!(e["code"], "digest_mismatch", "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("manifest ns/app:1"),
        "{e}"
    );
    // A registry that closes mid-blob: the pull fails naming the blob; the layer below it was
    // stored and a later pull resumes from it.
    let ev = pull_events(
        d,
        json!({"reference": format!("{}/ns/big:1", f.cutting.host()), "name": "reg-big"}),
    );
    let last = ev.last().unwrap();
    assert_eq!(last["status"], "error", "{ev:?}");
    assert!(
        last["message"].as_str().unwrap().contains(&f.big_layers[1]),
        "{last}"
    );
    d.call(Method::GET, "/v1/images/reg-big", None)
        .expect_error(404, Some("name"));
    d.call(Method::GET, "/v1/images/reg-bad", None)
        .expect_error(404, Some("name"));
    d.call(Method::POST, "/v1/node/gc", None).expect(200);
    clean_store(d);
    let ev = pull_events(
        d,
        json!({"reference": format!("{}/ns/big:1", f.basic.host()), "name": "reg-big"}),
    );
    let layers: Vec<&Value> = ev.iter().filter(|e| e["status"] == "layer").collect();
    assert_eq!(layers[0]["cached"], true, "{ev:?}");
    assert_eq!(layers[1]["cached"], false, "{ev:?}");
    assert_eq!(ev.last().unwrap()["status"], "done", "{ev:?}");
    forget(d, "reg-big");
    d.call(Method::POST, "/v1/node/gc", None).expect(200);
    clean_store(d);
}

#[test]
fn tls_registries_are_verified() {
    let Some(f) = fixture() else { return };
    let d = daemon();
    // Signed by the CA in ca_files, with Basic auth over the TLS connection.
    let r = pull(
        d,
        json!({"reference": format!("{}/ns/app:1", f.tls.host()), "name": "reg-tls"}),
    )
    .expect(201)
    .json();
    assert_eq!(r["name"], "reg-tls", "{r}");
    let id = d
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"image": "reg-tls"})),
        )
        .expect(201)
        .json()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let out = d.exec(&id, "cat /srv/app.txt");
    assert_eq!(out["stdout"], "app one\n", "{out}");
    d.delete(&id);
    forget(d, "reg-tls");
    // The same registry by a name its certificate does not hold.
    let e = pull(
        d,
        json!({"reference": format!("localhost:{}/ns/app:1", f.tls.port), "name": "reg-bad"}),
    )
    .expect_error(502, Some("reference"));
    assert_eq!(e["code"], "registry_untrusted", "{e}");
    let m = e["message"].as_str().unwrap();
    assert!(m.contains("localhost") && m.contains("certificate"), "{e}");
    // A certificate from a CA this node does not trust.
    let e = pull(
        d,
        json!({"reference": format!("{}/ns/app:1", f.tls_untrusted.host()), "name": "reg-bad"}),
    )
    .expect_error(502, Some("reference"));
    assert_eq!(e["code"], "registry_untrusted", "{e}");
    let m = e["message"].as_str().unwrap();
    assert!(m.contains("certificate") && m.contains("ca_files"), "{e}");
    d.call(Method::GET, "/v1/images/reg-bad", None)
        .expect_error(404, Some("name"));
    d.call(Method::POST, "/v1/node/gc", None).expect(200);
    clean_store(d);
}
