//! Shell sessions: named long-lived shells that grove-init holds (see init/session.rs). Each call
//! is one control connection, like exec; a run holds its connection until the command ends, so a
//! snapshot taken meanwhile is refused as for an exec in flight.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Runtime;
use crate::client::ClientError;
use crate::error::Error;
use crate::proto::{self, Reply, Request, SessionErrorKind, SessionRunSpec, SessionSpec};
use crate::sandbox::Sandbox;
use crate::types::{SandboxId, DEFAULT_MAX_OUTPUT, MAX_OUTPUT};

pub use crate::init::session::{MAX_COMMAND, MAX_INPUT, MAX_SESSIONS};

/// What a new session starts with.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionCreate {
    pub name: String,
    /// A POSIX shell (path or name in PATH); None: bash.
    pub shell: Option<String>,
    /// On top of the sandbox's own env.
    pub env: BTreeMap<String, String>,
    /// None: the sandbox's workdir, else /.
    pub cwd: Option<String>,
}

/// A session as init reports it.
pub type SessionInfo = proto::SessionStatus;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRun {
    pub command: String,
    /// SIGINT at the deadline, then SIGKILL of what the run started; the session lives on.
    pub timeout_ms: Option<u64>,
    /// The command's stdin (else /dev/null).
    pub input: Option<Vec<u8>>,
    /// Output kept (the rest is dropped); None: [`DEFAULT_MAX_OUTPUT`].
    pub max_output_bytes: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRunResult {
    /// stdout and stderr merged, in the order written.
    pub output: Vec<u8>,
    pub output_truncated: bool,
    /// `$?` after the command (130 after an interrupt); the shell's status if it died.
    pub exit_code: Option<i32>,
    /// The signal that killed the shell, when it died of one.
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub interrupted: bool,
    /// False when the shell died during the run: the session is dead from now on.
    pub session_alive: bool,
    pub duration_ms: u64,
}

/// Longest timeout one run may ask for.
pub const MAX_RUN_TIMEOUT_MS: u64 = 24 * 3600 * 1000;

fn check_name(name: &str) -> Result<(), Error> {
    if crate::init::session::valid_name(name) {
        Ok(())
    } else {
        Err(Error::invalid(
            "name",
            format!("{name:?}: 1 to 64 of A-Z a-z 0-9 _ . - (not starting with .)"),
        ))
    }
}

impl Runtime {
    pub fn session_create(&self, id: &SandboxId, req: SessionCreate) -> Result<SessionInfo, Error> {
        check_name(&req.name)?;
        if let Some(sh) = &req.shell {
            if sh.is_empty() || sh.contains(|c: char| c.is_whitespace() || c == '\0') {
                return Err(Error::invalid(
                    "shell",
                    format!("{sh:?}: one program, by path or name in PATH"),
                ));
            }
        }
        for (k, v) in &req.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(Error::invalid(
                    &format!("env.{k}"),
                    "names are non-empty, without '=' or NUL; values without NUL",
                ));
            }
        }
        if let Some(cwd) = &req.cwd {
            if !cwd.starts_with('/') || cwd.contains('\0') {
                return Err(Error::invalid("cwd", format!("{cwd:?} is not absolute")));
            }
        }
        let sb = self.running(id)?;
        sb.activity.touch();
        let mut env = sb.spec.env.clone();
        env.extend(req.env);
        let spec = SessionSpec {
            name: req.name.clone(),
            shell: req.shell,
            env,
            cwd: req
                .cwd
                .or_else(|| sb.spec.workdir.clone())
                .unwrap_or_else(|| "/".into()),
        };
        match self.session_call(&sb, &req.name, &Request::SessionCreate(spec))? {
            Reply::Sessions { mut list } if list.len() == 1 => Ok(list.remove(0)),
            r => Err(self.session_protocol(&sb, r)),
        }
    }

    pub fn session_list(&self, id: &SandboxId) -> Result<Vec<SessionInfo>, Error> {
        let sb = self.running(id)?;
        match self.session_call(&sb, "", &Request::SessionList)? {
            Reply::Sessions { list } => Ok(list),
            r => Err(self.session_protocol(&sb, r)),
        }
    }

    pub fn session_get(&self, id: &SandboxId, name: &str) -> Result<SessionInfo, Error> {
        check_name(name)?;
        self.session_list(id)?
            .into_iter()
            .find(|s| s.name == name)
            .ok_or_else(|| Error::SessionNotFound {
                id: id.clone(),
                name: name.into(),
            })
    }

    /// SIGINT to the session's foreground job (the run in progress, if any).
    pub fn session_interrupt(&self, id: &SandboxId, name: &str) -> Result<(), Error> {
        check_name(name)?;
        let sb = self.running(id)?;
        let req = Request::SessionInterrupt { name: name.into() };
        self.session_call(&sb, name, &req).map(|_| ())
    }

    /// Kills the shell and everything it started; a dead session is just forgotten.
    pub fn session_close(&self, id: &SandboxId, name: &str) -> Result<(), Error> {
        check_name(name)?;
        let sb = self.running(id)?;
        let req = Request::SessionClose { name: name.into() };
        self.session_call(&sb, name, &req).map(|_| ())
    }

    pub fn session_run(
        &self,
        id: &SandboxId,
        name: &str,
        req: SessionRun,
    ) -> Result<SessionRunResult, Error> {
        check_name(name)?;
        if req.command.contains('\0') {
            return Err(Error::invalid("command", "may not contain NUL"));
        }
        if req.command.len() > MAX_COMMAND {
            return Err(Error::invalid(
                "command",
                format!("at most {MAX_COMMAND} bytes"),
            ));
        }
        if req.input.as_ref().is_some_and(|i| i.len() > MAX_INPUT) {
            return Err(Error::invalid(
                "input",
                format!("at most {MAX_INPUT} bytes"),
            ));
        }
        match req.timeout_ms {
            Some(0) => return Err(Error::invalid("timeout_ms", "must be at least 1")),
            Some(t) if t > MAX_RUN_TIMEOUT_MS => {
                return Err(Error::invalid(
                    "timeout_ms",
                    format!("at most {MAX_RUN_TIMEOUT_MS} (24 h)"),
                ))
            }
            _ => {}
        }
        let max_keep = match req.max_output_bytes {
            Some(m) if m > MAX_OUTPUT => {
                return Err(Error::invalid(
                    "max_output_bytes",
                    format!("at most {MAX_OUTPUT} (64 MiB)"),
                ))
            }
            m => m.unwrap_or(DEFAULT_MAX_OUTPUT) as usize,
        };
        let sb = self.running(id)?;
        sb.activity.touch();
        let spec = SessionRunSpec {
            name: name.into(),
            command: req.command,
            input: req.input,
            timeout_ms: req.timeout_ms,
        };
        let timeout = spec.timeout_ms;
        let mut s = self.session_connect(&sb, &Request::SessionRun(spec))?;
        // A safety net against a wedged init: init enforces the run's timeout (and its
        // escalation, two grace seconds) itself.
        let net = timeout.map(|ms| Duration::from_millis(ms) + Duration::from_secs(30));
        s.set_read_timeout(net)
            .map_err(|e| self.client_error(&sb, e.into()))?;
        let mut res = SessionRunResult::default();
        loop {
            let frame = proto::read_frame(&mut s).map_err(|e| self.client_error(&sb, e.into()))?;
            match frame {
                Some((proto::KIND_STDOUT, data)) => {
                    let room = max_keep.saturating_sub(res.output.len());
                    if data.len() > room {
                        res.output_truncated = true;
                    }
                    res.output.extend_from_slice(&data[..data.len().min(room)]);
                }
                Some((proto::KIND_JSON, body)) => {
                    let r: Reply = serde_json::from_slice(&body).map_err(|e| {
                        self.client_error(&sb, ClientError::Protocol(e.to_string()))
                    })?;
                    return match r {
                        Reply::SessionDone {
                            exit_code,
                            signal,
                            timed_out,
                            interrupted,
                            alive,
                            duration_ms,
                        } => {
                            res.exit_code = exit_code;
                            res.signal = signal;
                            res.timed_out = timed_out;
                            res.interrupted = interrupted;
                            res.session_alive = alive;
                            res.duration_ms = duration_ms;
                            Ok(res)
                        }
                        r => Err(self.session_reply_error(&sb, name, r)),
                    };
                }
                Some((k, _)) => {
                    let e = ClientError::Protocol(format!("unexpected frame kind {k}"));
                    return Err(self.client_error(&sb, e));
                }
                None => {
                    let e = ClientError::Protocol("init closed the connection mid-run".into());
                    return Err(self.client_error(&sb, e));
                }
            }
        }
    }

    fn session_connect(&self, sb: &Arc<Sandbox>, req: &Request) -> Result<UnixStream, Error> {
        let mut s = sb
            .init
            .connect()
            .map_err(|e| self.client_error(sb, ClientError::Connect(e)))?;
        s.write_all(&proto::encode_json(req))
            .map_err(|e| self.client_error(sb, e.into()))?;
        Ok(s)
    }

    /// One request, one reply (init answers at once: no session call waits on a shell).
    fn session_call(&self, sb: &Arc<Sandbox>, name: &str, req: &Request) -> Result<Reply, Error> {
        let mut s = self.session_connect(sb, req)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| self.client_error(sb, e.into()))?;
        let frame = proto::read_frame(&mut s).map_err(|e| self.client_error(sb, e.into()))?;
        let r = match frame {
            Some((proto::KIND_JSON, body)) => serde_json::from_slice::<Reply>(&body)
                .map_err(|e| self.client_error(sb, ClientError::Protocol(e.to_string())))?,
            _ => {
                let e = ClientError::Protocol("no reply to a session request".into());
                return Err(self.client_error(sb, e));
            }
        };
        match r {
            Reply::SessionError { .. } | Reply::Error { .. } => {
                Err(self.session_reply_error(sb, name, r))
            }
            r => Ok(r),
        }
    }

    fn session_reply_error(&self, sb: &Arc<Sandbox>, name: &str, r: Reply) -> Error {
        let id = sb.id.clone();
        let name = name.to_string();
        match r {
            Reply::SessionError { kind, message } => session_refusal(id, name, kind, message),
            Reply::Error { kind, message } => {
                self.client_error(sb, ClientError::Init { kind, message })
            }
            r => self.session_protocol(sb, r),
        }
    }

    fn session_protocol(&self, sb: &Arc<Sandbox>, r: Reply) -> Error {
        self.client_error(sb, ClientError::Protocol(format!("{r:?}")))
    }
}

/// Init's refusal of a session request, by its kind alone.
fn session_refusal(id: SandboxId, name: String, kind: SessionErrorKind, message: String) -> Error {
    match kind {
        SessionErrorKind::NotFound => Error::SessionNotFound { id, name },
        SessionErrorKind::Dead => Error::SessionDead {
            id,
            name,
            reason: message,
        },
        SessionErrorKind::Exists | SessionErrorKind::Busy | SessionErrorKind::Limit => {
            Error::SessionConflict {
                id,
                name,
                reason: message,
            }
        }
        SessionErrorKind::BadCwd
        | SessionErrorKind::BadShell
        | SessionErrorKind::BadCommand
        | SessionErrorKind::BadInput
        | SessionErrorKind::Invalid => Error::invalid(kind.field().unwrap_or("name"), message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_refusals_by_kind() {
        let id = || SandboxId::generate();
        let r = |kind, m: &str| session_refusal(id(), "main".into(), kind, m.into());
        for (kind, field) in [
            (SessionErrorKind::BadCwd, "cwd"),
            (SessionErrorKind::BadShell, "shell"),
            (SessionErrorKind::BadCommand, "command"),
            (SessionErrorKind::BadInput, "input"),
            // The text does not count: an older init's `invalid` is the generic field.
            (SessionErrorKind::Invalid, "name"),
        ] {
            let e = r(kind, "cwd \"/x\": ENOENT (input command)");
            assert_eq!(e.field(), Some(field), "{kind:?}: {e:?}");
        }
        assert!(matches!(
            r(SessionErrorKind::NotFound, "m"),
            Error::SessionNotFound { .. }
        ));
        assert!(matches!(
            r(SessionErrorKind::Dead, "m"),
            Error::SessionDead { .. }
        ));
        for k in [
            SessionErrorKind::Exists,
            SessionErrorKind::Busy,
            SessionErrorKind::Limit,
        ] {
            assert!(matches!(r(k, "m"), Error::SessionConflict { .. }));
        }
    }
}
