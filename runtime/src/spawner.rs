//! Runtime side of sandbox start: runs `grove-init --setup` as a fresh process (no namespace work
//! after fork in this multi-threaded process), hands it the setup config and waits for
//! `pid <n>` + `ready`.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::proto::{SetupConfig, OWNER_INSTANCE_ARG, OWNER_SANDBOX_ARG};

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("start {path}")]
    Start {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The sandbox init reported a failure (pid set when pid 1 existed).
    #[error("{message}")]
    Failed { pid: Option<i32>, message: String },
}

const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// Starts sandbox pid 1 and returns its host pid once its control socket listens. `instance` and
/// `sandbox` go on the setup process's argv so residue scans can tell whose it is.
pub fn spawn_init(
    init_binary: &Path,
    cfg: &SetupConfig,
    instance: &str,
    sandbox: &str,
) -> Result<i32, SpawnError> {
    let mut child = Command::new(init_binary)
        .args([
            "--setup",
            OWNER_INSTANCE_ARG,
            instance,
            OWNER_SANDBOX_ARG,
            sandbox,
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| SpawnError::Start {
            path: init_binary.display().to_string(),
            source: e,
        })?;
    let config = serde_json::to_vec(cfg).unwrap_or_default();
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(&config);
    }
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let mut text = String::new();
    let mut pid: Option<i32> = None;
    let mut ready = false;
    let deadline = Instant::now() + READY_TIMEOUT;
    let outcome = loop {
        // Lines: "pid N" (from the setup process) and "ready" or "error ..." (from pid 1), in
        // either order: pid 1 can win the race to the pipe.
        if ready && pid.is_some() {
            break Ok(());
        }
        if let Some(line_end) = text.find('\n') {
            let line: String = text.drain(..=line_end).collect();
            let line = line.trim_end();
            if let Some(p) = line.strip_prefix("pid ") {
                pid = p.parse().ok();
            } else if line == "ready" {
                ready = true;
            } else {
                break Err(line.strip_prefix("error ").unwrap_or(line).to_string());
            }
            continue;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break Err("timed out waiting for sandbox init".into());
        }
        let mut pfd = libc::pollfd {
            fd: stdout.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32 + 1) };
        if n <= 0 {
            continue;
        }
        let mut buf = [0u8; 512];
        match stdout.read(&mut buf) {
            Ok(0) if ready => break Err("setup process exited without reporting the pid".into()),
            Ok(0) => {
                break Err(format!(
                    "sandbox init exited during setup{}",
                    if pid.is_some() {
                        ""
                    } else {
                        " (before forking pid 1)"
                    }
                ))
            }
            Ok(n) => text.push_str(&String::from_utf8_lossy(&buf[..n])),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break Err(format!("read from sandbox init: {e}")),
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    match (outcome, pid) {
        (Ok(()), Some(pid)) => Ok(pid),
        (Ok(()), None) => Err(SpawnError::Failed {
            pid: None,
            message: "init never reported its pid".into(),
        }),
        (Err(message), pid) => Err(SpawnError::Failed { pid, message }),
    }
}
