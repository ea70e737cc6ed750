//! Runtime side of init's control socket: one connection per request.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::init_handle::{HandleError, InitHandle};
use crate::proto::{
    self, ExecSpec, InitErrorKind, Proc, Reply, Request, KIND_JSON, KIND_STDERR, KIND_STDOUT,
};
use crate::types::{ExecResult, OutputChunk};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No verified connection to the init (see `InitHandle::connect`).
    #[error("reach init")]
    Connect(#[from] HandleError),
    #[error("talk to init")]
    Io(#[from] std::io::Error),
    /// Init refused the request; `kind` is what to classify it by (the message is for people).
    #[error("init: {message}")]
    Init {
        kind: InitErrorKind,
        message: String,
    },
    #[error("bad reply from init: {0}")]
    Protocol(String),
    /// The exec was cancelled (see [`ExecCancel`]).
    #[error("cancelled: the client went away")]
    Cancelled,
}

/// Ends an exec from outside its thread (its HTTP client went away): the connection to init is shut
/// down, which init takes as a hang-up and kills the command's tree. Cancelling before the exec
/// connects stops it from starting; after it returned, nothing happens.
#[derive(Debug, Clone, Default)]
pub struct ExecCancel(Arc<Mutex<CancelState>>);

#[derive(Debug, Default)]
struct CancelState {
    cancelled: bool,
    conn: Option<UnixStream>,
}

impl ExecCancel {
    pub fn cancel(&self) {
        let mut st = self.0.lock();
        st.cancelled = true;
        if let Some(c) = st.conn.take() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.lock().cancelled
    }

    /// Watches `s` until [`ExecCancel::detach`]; false when cancelled already.
    fn attach(&self, s: &UnixStream) -> Result<(), ClientError> {
        let mut st = self.0.lock();
        if st.cancelled {
            return Err(ClientError::Cancelled);
        }
        st.conn = Some(s.try_clone()?);
        Ok(())
    }

    fn detach(&self) {
        self.0.lock().conn = None;
    }
}

fn connect(init: &InitHandle, req: &Request) -> Result<UnixStream, ClientError> {
    let mut s = init.connect()?;
    s.write_all(&proto::encode_json(req))?;
    Ok(s)
}

/// A JSON frame's reply, init's refusal (`Reply::Error`) as the error it is.
pub(crate) fn decode_reply(body: &[u8]) -> Result<Reply, ClientError> {
    match serde_json::from_slice(body).map_err(|e| ClientError::Protocol(e.to_string()))? {
        Reply::Error { kind, message } => Err(ClientError::Init { kind, message }),
        r => Ok(r),
    }
}

fn read_reply(s: &mut UnixStream) -> Result<Reply, ClientError> {
    match proto::read_frame(s)? {
        Some((KIND_JSON, body)) => decode_reply(&body),
        Some((k, _)) => Err(ClientError::Protocol(format!("unexpected frame kind {k}"))),
        None => Err(ClientError::Protocol("connection closed".into())),
    }
}

/// How long a plain request waits for init's reply.
pub const TIMEOUT: Duration = Duration::from_secs(10);

fn simple(init: &InitHandle, req: &Request) -> Result<Reply, ClientError> {
    simple_within(init, req, TIMEOUT)
}

fn simple_within(
    init: &InitHandle,
    req: &Request,
    timeout: Duration,
) -> Result<Reply, ClientError> {
    let mut s = connect(init, req)?;
    s.set_read_timeout(Some(timeout))?;
    read_reply(&mut s)
}

/// A ping that gives up after `timeout` (a healthy init answers in microseconds).
pub fn ping_within(init: &InitHandle, timeout: Duration) -> Result<(), ClientError> {
    simple_within(init, &Request::Ping, timeout).map(|_| ())
}

pub fn processes(init: &InitHandle) -> Result<Vec<Proc>, ClientError> {
    match simple(init, &Request::Processes)? {
        Reply::Processes { list } => Ok(list),
        r => Err(ClientError::Protocol(format!("{r:?}"))),
    }
}

pub fn signal(init: &InitHandle, pid: i32, signal: i32) -> Result<(), ClientError> {
    simple(init, &Request::Signal { pid, signal }).map(|_| ())
}

/// Keeps what fits of `data` under `cap` bytes in `buf`; says when something was dropped.
fn keep(buf: &mut Vec<u8>, data: &[u8], cap: usize, truncated: &mut bool) {
    let room = cap.saturating_sub(buf.len());
    if data.len() > room {
        *truncated = true;
    }
    buf.extend_from_slice(&data[..data.len().min(room)]);
}

/// Runs a command, streaming its output to `on_output` and keeping the first `max_keep` bytes of
/// each stream in the result (the rest is dropped, never buffered: output may be unbounded). When
/// `on_output` returns false (its reader went away) the connection is dropped, and init kills the
/// command.
pub fn exec(
    init: &InitHandle,
    spec: ExecSpec,
    max_keep: usize,
    cancel: &ExecCancel,
    on_output: &mut dyn FnMut(OutputChunk) -> bool,
) -> Result<ExecResult, ClientError> {
    if cancel.is_cancelled() {
        return Err(ClientError::Cancelled);
    }
    let (background, timeout) = (spec.background, spec.timeout_ms);
    let s = connect(init, &Request::Exec(spec))?;
    cancel.attach(&s)?;
    let r = exec_on(s, background, timeout, max_keep, on_output);
    cancel.detach();
    match r {
        Err(_) if cancel.is_cancelled() => Err(ClientError::Cancelled),
        r => r,
    }
}

fn exec_on(
    mut s: UnixStream,
    background: bool,
    timeout: Option<u64>,
    max_keep: usize,
    on_output: &mut dyn FnMut(OutputChunk) -> bool,
) -> Result<ExecResult, ClientError> {
    let start = Instant::now();
    // A safety net against a wedged init; init itself enforces the command timeout.
    s.set_read_timeout(timeout.map(|ms| Duration::from_millis(ms) + Duration::from_secs(30)))?;
    let mut res = ExecResult::default();
    match read_reply(&mut s)? {
        Reply::Started { pid, log_path } => {
            res.pid = Some(pid);
            res.log_path = log_path;
        }
        r => return Err(ClientError::Protocol(format!("{r:?}"))),
    }
    if background {
        res.duration_ms = start.elapsed().as_millis() as u64;
        return Ok(res);
    }
    let gone = || ClientError::Protocol("the output's reader went away".into());
    loop {
        // A quiet command: an empty chunk asks the reader whether it is still there, so a client
        // that left does not keep a command running that prints nothing.
        if !crate::live::wait_readable(&s)? {
            if !on_output(OutputChunk::Stdout(Vec::new())) {
                return Err(gone());
            }
            continue;
        }
        match proto::read_frame(&mut s)? {
            Some((KIND_STDOUT, data)) => {
                keep(&mut res.stdout, &data, max_keep, &mut res.stdout_truncated);
                if !on_output(OutputChunk::Stdout(data)) {
                    return Err(gone());
                }
            }
            Some((KIND_STDERR, data)) => {
                keep(&mut res.stderr, &data, max_keep, &mut res.stderr_truncated);
                if !on_output(OutputChunk::Stderr(data)) {
                    return Err(gone());
                }
            }
            Some((KIND_JSON, body)) => match decode_reply(&body)? {
                Reply::Exit {
                    exit_code,
                    signal,
                    timed_out,
                    duration_ms,
                } => {
                    res.exit_code = exit_code;
                    res.signal = signal;
                    res.timed_out = timed_out;
                    res.duration_ms = duration_ms;
                    return Ok(res);
                }
                r => return Err(ClientError::Protocol(format!("{r:?}"))),
            },
            Some((k, _)) => {
                return Err(ClientError::Protocol(format!("unexpected frame kind {k}")))
            }
            None => {
                return Err(ClientError::Protocol(
                    "init closed the connection before the exit status".into(),
                ))
            }
        }
    }
}
