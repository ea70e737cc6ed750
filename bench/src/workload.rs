//! The checkpoint workload: python3 holding N random bytes on its heap, an open file, and an HTTP server.
//!
//! The server listens on an abstract unix socket, which lives in the sandbox's network namespace like a
//! loopback port: CRIU 4.1.1 cannot dump TCP sockets on kernel >= 6.16 (getsockopt SO_PASSCRED/SO_PASSSEC
//! return EOPNOTSUPP on non-unix sockets there), so a TCP listener would make every system fail alike.
//! `GET /` answers "ok <heap bytes> <file offset>"; `GET /touch=F` rewrites 8 bytes in a fraction F of the
//! heap's pages (spread evenly), so exactly those pages are dirty.

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Result};

use crate::util;

pub const SCRIPT: &str = r#"
import os, sys, socketserver, http.server
N = int(sys.argv[1]); name = sys.argv[2]; fpath = sys.argv[3]
heap = bytearray(os.urandom(N))
state = open(fpath, 'w+'); state.write('grove-bench state\n'); state.flush()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith('/touch='):
            frac = float(self.path.split('=')[1]); pages = len(heap) // 4096
            k = max(1, int(pages * frac)); step = max(1, pages // k); r = os.urandom(k * 8)
            for i in range(k):
                off = (i * step) * 4096; heap[off:off + 8] = r[i * 8:i * 8 + 8]
            body = b'touched %d' % k
        else:
            body = b'ok %d %d' % (len(heap), state.tell())
        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers()
        self.wfile.write(body)
    def address_string(self): return 'unix'
    def log_message(self, *a): pass
class S(socketserver.UnixStreamServer):
    def get_request(self):
        c, _ = self.socket.accept(); return c, ('unix', 0)
S('\0' + name, H).serve_forever()
"#;

/// The abstract socket name the server listens on.
pub const SOCKET: &str = "grove-bench-ckpt";

/// argv after the interpreter: `-c SCRIPT <heap bytes> <socket> <state file>`.
pub fn args(heap: u64, state_file: &str) -> Vec<String> {
    vec![
        "-c".into(),
        SCRIPT.into(),
        heap.to_string(),
        SOCKET.into(),
        state_file.into(),
    ]
}

/// Closes inherited descriptors above 2 in the child (CRIU refuses to dump unknown pipes from outside).
pub fn close_inherited_fds(cmd: &mut Command) {
    // SAFETY: close_range is async-signal-safe and touches only the child's descriptor table.
    unsafe {
        cmd.pre_exec(|| {
            grove_sys::fd::close_from(3);
            Ok(())
        });
    }
}

/// GET `path` from the workload in the network namespace of host pid `pid`.
pub fn get(pid: i32, path: &str) -> Result<String> {
    let mut c = Command::new("nsenter");
    c.arg("-t").arg(pid.to_string()).arg("-n");
    c.args([
        "curl",
        "-sf",
        "--max-time",
        "20",
        "--abstract-unix-socket",
        SOCKET,
    ]);
    c.arg(format!("http://grove-bench{path}"));
    util::output(&mut c)
}

/// Waits until the workload answers "ok <heap>" (python fills the heap first, which takes a while).
pub fn wait_ready(pid: i32, heap: u64, timeout: Duration) -> Result<()> {
    let want = format!("ok {heap} ");
    let mut last = String::new();
    let ok = util::wait_until(timeout, || match get(pid, "/") {
        Ok(s) if s.starts_with(&want) => true,
        Ok(s) => {
            last = s;
            std::thread::sleep(Duration::from_millis(50));
            false
        }
        Err(e) => {
            last = format!("{e:#}");
            std::thread::sleep(Duration::from_millis(50));
            false
        }
    });
    if !ok {
        bail!("workload in pid {pid} not answering after {timeout:?}: {last}");
    }
    Ok(())
}

/// Asks the workload to dirty `frac` of its heap pages; returns the pages touched.
pub fn touch(pid: i32, frac: f64) -> Result<u64> {
    let s = get(pid, &format!("/touch={frac}"))?;
    s.trim()
        .strip_prefix("touched ")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("unexpected touch answer {s:?}"))
}

/// Total size of the files under `dir` (bytes).
pub fn dir_bytes(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}
