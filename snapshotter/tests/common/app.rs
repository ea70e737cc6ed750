//! A python3 program run inside test sandboxes: it holds a counter variable and an open file at
//! an offset, and answers requests written to /root/req by writing /root/state.json. Its heap is
//! larger than the areas a lazy restore copies eagerly (16 MiB, `eager.rs`), so a branch's daemon
//! has pages to serve.

use std::time::{Duration, Instant};

use grove_runtime::{ExecRequest, SandboxId};
use serde_json::Value;

use super::grove::Env;

pub const DATA: &str = "abcdefghijklmnopqrstuvwxyz";

pub const APP: &str = r#"
import os, json, time, hashlib
counter = 41
heap = bytearray(os.urandom(24 << 20))
f = open('/root/data.txt', 'r')
f.seek(10)
done = set()
while True:
    reqs = [n for n in os.listdir('/root') if n.startswith('req.') and n not in done]
    if not reqs:
        time.sleep(0.005)
        continue
    name = min(reqs, key=lambda n: int(n.split('.')[1]))
    with open('/root/' + name) as r:
        req = r.read()
    if not req.endswith('\n'):
        time.sleep(0.005)
        continue
    done.add(name)
    cmd, seq = req.split()
    got = ''
    if cmd == 'inc':
        counter += 1
    elif cmd == 'read':
        got = f.read(3)
    st = {'seq': int(seq), 'counter': counter, 'offset': f.tell(), 'got': got,
          'host': os.uname().nodename, 'heap': hashlib.sha256(heap).hexdigest()}
    with open('/root/state.tmp', 'w') as o:
        json.dump(st, o)
    os.rename('/root/state.tmp', '/root/state.json')
"#;

/// Starts the app and a loopback HTTP server serving /root, in the background.
pub fn start(env: &Env, id: &SandboxId) {
    env.rt
        .write_file(id, "/root/data.txt", DATA.as_bytes(), None)
        .unwrap();
    env.rt
        .write_file(id, "/root/app.py", APP.as_bytes(), None)
        .unwrap();
    for cmd in [
        "python3 /root/app.py",
        "cd /root && exec python3 -m http.server 8000 --bind 127.0.0.1",
    ] {
        let mut req = ExecRequest::shell(cmd);
        req.background = true;
        env.rt.exec(id, req).unwrap();
    }
    wait_http(env, id);
}

/// Waits until the loopback server answers inside the sandbox and returns what it served.
pub fn wait_http(env: &Env, id: &SandboxId) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = env
            .rt
            .exec(
                id,
                ExecRequest::shell("curl -sf http://127.0.0.1:8000/data.txt"),
            )
            .unwrap();
        if r.exit_code == Some(0) {
            return String::from_utf8_lossy(&r.stdout).to_string();
        }
        assert!(
            Instant::now() < deadline,
            "http server in {id} does not answer"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends `cmd` (inc | read | state) with sequence number `seq` and returns the app's state.
pub fn ask(env: &Env, id: &SandboxId, cmd: &str, seq: u64) -> Value {
    // A new file per request: nodefs refuses a write open while another process reads the same
    // file through FUSE passthrough (ETXTBSY), so the app never reads a file being written.
    let path = format!("/root/req.{seq}");
    env.rt
        .write_file(id, &path, format!("{cmd} {seq}\n").as_bytes(), None)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(body) = env.rt.read_file(id, "/root/state.json") {
            if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                if v["seq"] == seq {
                    return v;
                }
            }
        }
        if Instant::now() > deadline {
            let logs = env.rt.exec(
                id,
                ExecRequest::shell("tail -n 5 /run/grove/logs/*.log; ps -ef"),
            );
            let logs = logs
                .map(|r| String::from_utf8_lossy(&r.stdout).to_string())
                .unwrap_or_default();
            panic!("app in {id} did not answer {cmd} {seq}; logs and processes:\n{logs}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
