//! Processes kept by init past their request (terminals, processes with stdin, E2B processes):
//! start, attach to one's output (its buffered output first), input, resize, list.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::client::{self, ClientError};
use crate::proto::{
    self, InitErrorKind, ProcSpec, Reply, Request, KIND_JSON, KIND_PTY, KIND_STDERR, KIND_STDOUT,
};
use crate::runtime::Runtime;
use crate::types::SandboxId;
use crate::validate;
use crate::{Error, ExecRequest};

pub use crate::proto::{LiveInfo, PtySize};

/// A process to start and keep.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProcessRequest {
    /// Exactly one of `argv` / `shell`.
    pub argv: Vec<String>,
    pub shell: Option<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
    /// A `user` name the sandbox lacks runs as root instead of failing.
    pub user_or_root: bool,
    pub pty: Option<PtySize>,
    /// Keep a stdin pipe open for [`Runtime::proc_input`].
    pub stdin: bool,
    pub tag: Option<String>,
    /// The process outlives the stream that started it (otherwise the stream's end kills it).
    pub keep: bool,
    pub timeout_ms: Option<u64>,
}

/// What an attached stream carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcEvent {
    Started {
        pid: i32,
    },
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Pty(Vec<u8>),
    /// Nothing came for a while: returning false (the reader is gone) ends the stream, so a quiet
    /// process does not outlive a client that left.
    Idle,
}

/// How long a stream waits for a frame before asking its reader whether it is still there.
const IDLE_CHECK_MS: u16 = 500;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcExit {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub duration_ms: u64,
}

/// Most columns or rows of a terminal.
pub const MAX_PTY_CELLS: u16 = 4096;

fn check_size(s: PtySize) -> Result<(), Error> {
    if s.cols == 0 || s.rows == 0 || s.cols > MAX_PTY_CELLS || s.rows > MAX_PTY_CELLS {
        return Err(Error::invalid(
            "pty",
            format!("cols and rows are 1..={MAX_PTY_CELLS}"),
        ));
    }
    Ok(())
}

/// Waits up to IDLE_CHECK_MS for `s` to be readable; false when nothing came (the caller asks its
/// reader whether it is still there, then waits again).
pub(crate) fn wait_readable(s: &std::os::unix::net::UnixStream) -> Result<bool, ClientError> {
    use std::os::fd::AsFd;
    loop {
        let mut fds = [nix::poll::PollFd::new(
            s.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        match nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(IDLE_CHECK_MS)) {
            Ok(0) => return Ok(false),
            Ok(_) => return Ok(true),
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(ClientError::Io(e.into())),
        }
    }
}

/// Reads the stream of one attached connection until the exit frame.
fn follow(
    s: &mut std::os::unix::net::UnixStream,
    on_event: &mut dyn FnMut(ProcEvent) -> bool,
) -> Result<ProcExit, ClientError> {
    let gone = || ClientError::Protocol("the output's reader went away".into());
    loop {
        if !wait_readable(s)? {
            if !on_event(ProcEvent::Idle) {
                return Err(gone());
            }
            continue;
        }
        let ev = match proto::read_frame(s)? {
            Some((KIND_STDOUT, d)) => ProcEvent::Stdout(d),
            Some((KIND_STDERR, d)) => ProcEvent::Stderr(d),
            Some((KIND_PTY, d)) => ProcEvent::Pty(d),
            Some((KIND_JSON, body)) => match client::decode_reply(&body)? {
                Reply::Started { pid, .. } => ProcEvent::Started { pid },
                Reply::Exit {
                    exit_code,
                    signal,
                    timed_out,
                    duration_ms,
                } => {
                    return Ok(ProcExit {
                        exit_code,
                        signal,
                        timed_out,
                        duration_ms,
                    })
                }
                r => return Err(ClientError::Protocol(format!("{r:?}"))),
            },
            Some((k, _)) => return Err(ClientError::Protocol(format!("frame kind {k}"))),
            None => {
                return Err(ClientError::Protocol(
                    "init closed the stream before the exit status".into(),
                ))
            }
        };
        if !on_event(ev) {
            return Err(gone());
        }
    }
}

/// Init's refusal of a request about a kept process: 404 for a pid it does not keep, 409 for
/// anything else (the process cannot take it).
fn live_refusal(id: &SandboxId, pid: i32, kind: InitErrorKind, message: String) -> Error {
    match kind {
        InitErrorKind::NoProcess => Error::NotFound {
            id: format!("process {pid} in {id}"),
        },
        _ => Error::Conflict {
            id: id.clone(),
            reason: message,
        },
    }
}

impl Runtime {
    /// Starts a kept process. With `attach`, streams its events to `on_event` until it exits
    /// (returning its exit); without, returns once it started. When `on_event` returns false the
    /// stream is dropped, which kills a process not `keep`.
    pub fn proc_start(
        &self,
        id: &SandboxId,
        req: ProcessRequest,
        attach: bool,
        on_event: &mut dyn FnMut(ProcEvent) -> bool,
    ) -> Result<(i32, Option<ProcExit>), Error> {
        let sb = self.running(id)?;
        sb.activity.touch();
        let as_exec = ExecRequest {
            argv: req.argv.clone(),
            shell: req.shell.clone(),
            env: req.env.clone(),
            cwd: req.cwd.clone(),
            timeout_ms: req.timeout_ms,
            ..ExecRequest::default()
        };
        let argv = validate::exec_argv(&as_exec)?;
        if let Some(s) = req.pty {
            check_size(s)?;
        }
        if req.tag.as_ref().is_some_and(|t| t.len() > 256) {
            return Err(Error::invalid("tag", "at most 256 bytes"));
        }
        let mut env = sb.spec.env.clone();
        env.extend(req.env);
        // None: the user's home (init knows it), or /.
        let cwd = req
            .cwd
            .or_else(|| sb.spec.workdir.clone())
            .unwrap_or_default();
        let spec = ProcSpec {
            argv,
            env,
            cwd,
            user: req.user,
            user_or_root: req.user_or_root,
            pty: req.pty,
            stdin: req.stdin,
            tag: req.tag,
            attach,
            keep: req.keep || !attach,
            timeout_ms: req.timeout_ms,
            log: false,
        };
        let timeout = req.timeout_ms;
        let r = (|| {
            let mut s = sb.init.connect()?;
            s.write_all(&proto::encode_json(&Request::ProcStart(spec)))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            let pid = match proto::read_frame(&mut s)? {
                Some((KIND_JSON, body)) => match client::decode_reply(&body)? {
                    Reply::Started { pid, .. } => pid,
                    r => return Err(ClientError::Protocol(format!("{r:?}"))),
                },
                _ => return Err(ClientError::Protocol("no start reply".into())),
            };
            if !attach {
                return Ok((pid, None));
            }
            if !on_event(ProcEvent::Started { pid }) {
                return Err(ClientError::Protocol(
                    "the output's reader went away".into(),
                ));
            }
            s.set_read_timeout(
                timeout.map(|ms| Duration::from_millis(ms) + Duration::from_secs(30)),
            )?;
            follow(&mut s, on_event).map(|x| (pid, Some(x)))
        })();
        r.map_err(|e| self.client_error(&sb, e))
    }

    /// Streams a kept process: `Started`, its buffered output, then live output, then its exit.
    pub fn proc_connect(
        &self,
        id: &SandboxId,
        pid: i32,
        on_event: &mut dyn FnMut(ProcEvent) -> bool,
    ) -> Result<ProcExit, Error> {
        let sb = self.running(id)?;
        sb.activity.touch();
        let r = (|| {
            let mut s = sb.init.connect()?;
            s.write_all(&proto::encode_json(&Request::ProcConnect { pid }))?;
            follow(&mut s, on_event)
        })();
        r.map_err(|e| self.live_error(id, pid, e))
    }

    fn live_simple(&self, id: &SandboxId, pid: i32, req: Request) -> Result<Reply, Error> {
        let sb = self.running(id)?;
        sb.activity.touch();
        let r = (|| {
            let mut s = sb.init.connect()?;
            s.write_all(&proto::encode_json(&req))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            match proto::read_frame(&mut s)? {
                Some((KIND_JSON, body)) => client::decode_reply(&body),
                _ => Err(ClientError::Protocol("no reply".into())),
            }
        })();
        r.map_err(|e| self.live_error(id, pid, e))
    }

    /// Init's refusals about a pid are the request's fault (404 for an unknown one, 409 for one
    /// that cannot take it).
    fn live_error(&self, id: &SandboxId, pid: i32, e: ClientError) -> Error {
        match e {
            ClientError::Init { kind, message } => live_refusal(id, pid, kind, message),
            e => match self.running(id) {
                Ok(sb) => self.client_error(&sb, e),
                Err(e) => e,
            },
        }
    }

    pub fn proc_input(&self, id: &SandboxId, pid: i32, data: Vec<u8>) -> Result<(), Error> {
        if data.len() > 1 << 20 {
            return Err(Error::invalid("data", "at most 1 MiB per call"));
        }
        self.live_simple(id, pid, Request::ProcInput { pid, data })
            .map(|_| ())
    }

    pub fn proc_close_stdin(&self, id: &SandboxId, pid: i32) -> Result<(), Error> {
        self.live_simple(id, pid, Request::ProcCloseStdin { pid })
            .map(|_| ())
    }

    pub fn proc_resize(&self, id: &SandboxId, pid: i32, size: PtySize) -> Result<(), Error> {
        check_size(size)?;
        self.live_simple(id, pid, Request::ProcResize { pid, size })
            .map(|_| ())
    }

    /// Kept processes, running and recently ended.
    pub fn proc_list(&self, id: &SandboxId) -> Result<Vec<LiveInfo>, Error> {
        match self.live_simple(id, 0, Request::ProcList)? {
            Reply::Live { list } => Ok(list),
            r => Err(Error::Init {
                id: id.clone(),
                reason: format!("unexpected reply {r:?}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_refusals_by_kind() {
        let id = SandboxId::generate();
        let gone = live_refusal(&id, 7, InitErrorKind::NoProcess, "no process 7".into());
        assert!(
            matches!(&gone, Error::NotFound { id } if id.starts_with("process 7 in")),
            "{gone:?}"
        );
        for k in [
            InitErrorKind::Refused,
            InitErrorKind::Other,
            InitErrorKind::Spawn,
        ] {
            // By kind, not text: an older init's "no process" (no kind) is a conflict.
            let e = live_refusal(&id, 7, k, "no process 7".into());
            assert!(matches!(e, Error::Conflict { .. }), "{k:?}: {e:?}");
        }
    }
}
