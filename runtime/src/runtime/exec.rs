//! Commands in a running sandbox, through its init: exec (buffered, streamed, cancellable), the
//! process list, signals; and how a failure of init's channel reads as an API error.

use std::sync::Arc;

use super::Runtime;
use crate::client::{self, ClientError, ExecCancel};
use crate::error::Error;
use crate::init_handle::HandleError;
use crate::proto::{ExecSpec, InitErrorKind};
use crate::sandbox::Sandbox;
use crate::types::*;
use crate::validate;

/// What an init refusal means for the request, by its kind alone; None for a failure of init's own
/// (judged by the sandbox's state: destroyed, init gone, or an init error).
fn init_refusal(id: &SandboxId, kind: InitErrorKind, message: &str) -> Option<Error> {
    match kind {
        // The root's file server is gone (a lost grove-fsd not yet noticed): not the request's fault.
        InitErrorKind::RootGone => Some(Error::Unavailable {
            what: format!("the root filesystem of {id}"),
            reason: message.to_string(),
        }),
        k => k.spec_field().map(|field| Error::InvalidSpec {
            field: field.into(),
            reason: message.to_string(),
        }),
    }
}

impl Runtime {
    pub fn exec(&self, id: &SandboxId, req: ExecRequest) -> Result<ExecResult, Error> {
        self.exec_stream(id, req, &mut |_| {})
    }

    pub fn exec_stream(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        on_output: &mut dyn FnMut(OutputChunk),
    ) -> Result<ExecResult, Error> {
        self.exec_stream_while(id, req, &mut |c| {
            on_output(c);
            true
        })
    }

    /// Like [`Runtime::exec_stream`]; when `on_output` returns false (nobody reads the output any more)
    /// the command is killed and this returns an error.
    pub fn exec_stream_while(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        on_output: &mut dyn FnMut(OutputChunk) -> bool,
    ) -> Result<ExecResult, Error> {
        self.exec_cancellable(id, req, &ExecCancel::default(), on_output)
    }

    /// Like [`Runtime::exec_stream_while`]; `cancel` ends the command from another thread (its
    /// caller went away). While it runs the sandbox counts as in use: idle reclaim leaves it be.
    pub fn exec_cancellable(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &ExecCancel,
        on_output: &mut dyn FnMut(OutputChunk) -> bool,
    ) -> Result<ExecResult, Error> {
        let sb = self.running(id)?;
        let _busy = sb.activity.busy();
        let argv = validate::exec_argv(&req)?;
        let mut env = sb.spec.env.clone();
        env.extend(req.env);
        let cwd = req
            .cwd
            .or_else(|| sb.spec.workdir.clone())
            .unwrap_or_else(|| "/".into());
        let max_keep = req
            .max_output_bytes
            .unwrap_or(crate::types::DEFAULT_MAX_OUTPUT) as usize;
        let spec = ExecSpec {
            argv,
            env,
            cwd,
            stdin: req.stdin,
            timeout_ms: req.timeout_ms,
            background: req.background,
            user: req.user,
        };
        client::exec(&sb.init, spec, max_keep, cancel, on_output)
            .map_err(|e| self.client_error(&sb, e))
    }

    pub(crate) fn client_error(&self, sb: &Arc<Sandbox>, e: ClientError) -> Error {
        let id = &sb.id;
        if let ClientError::Init { kind, message } = &e {
            if let Some(err) = init_refusal(id, *kind, message) {
                return err;
            }
        }
        match e {
            ClientError::Cancelled => Error::Cancelled { id: id.clone() },
            e if self.live(id).is_err() => Error::NotFound {
                id: format!("{id} (destroyed: {e})"),
            },
            ClientError::Connect(e) => self.unreachable(sb, e),
            // Init died during the request (the connection broke with it).
            _ if !sb.init.alive() => self.unreachable(sb, HandleError::Gone { pid: sb.init.pid() }),
            e => Error::Init {
                id: id.clone(),
                reason: e.to_string(),
            },
        }
    }

    pub fn processes(&self, id: &SandboxId) -> Result<Vec<ProcessInfo>, Error> {
        let sb = self.running(id)?;
        sb.activity.touch();
        let list = client::processes(&sb.init).map_err(|e| self.client_error(&sb, e))?;
        Ok(list
            .into_iter()
            .map(|p| ProcessInfo {
                pid: p.pid,
                argv: p.argv,
                running: p.running,
            })
            .collect())
    }

    pub fn signal(&self, id: &SandboxId, pid: i32, signal: i32) -> Result<(), Error> {
        if pid <= 1 {
            return Err(Error::invalid("pid", format!("{pid} cannot be signalled")));
        }
        if !(1..=64).contains(&signal) {
            return Err(Error::invalid(
                "signal",
                format!("{signal} is not a signal number"),
            ));
        }
        let sb = self.running(id)?;
        client::signal(&sb.init, pid, signal).map_err(|e| match e {
            // Whatever init refused (pid 1, a pid gone, kill's own failure), the pid is at fault.
            ClientError::Init { message, .. } => Error::invalid("pid", message),
            e => self.client_error(&sb, e),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_refusals_by_kind() {
        let id = SandboxId::generate();
        for (kind, field) in [
            (InitErrorKind::BadCwd, "cwd"),
            (InitErrorKind::BadExec, "argv"),
            (InitErrorKind::BadUser, "user"),
        ] {
            let e = init_refusal(&id, kind, "whatever the text").unwrap();
            assert_eq!(e.field(), Some(field), "{kind:?}: {e:?}");
            assert!(e.to_string().contains("whatever the text"), "{e}");
        }
        let gone = init_refusal(&id, InitErrorKind::RootGone, "cwd \"/x\": ENOTCONN").unwrap();
        assert!(matches!(gone, Error::Unavailable { .. }), "{gone:?}");
        // Init's own failures, and an older init's kindless refusals, whatever their text: judged
        // by the sandbox's state instead.
        for kind in [
            InitErrorKind::NoProcess,
            InitErrorKind::Refused,
            InitErrorKind::Protocol,
            InitErrorKind::Spawn,
            InitErrorKind::Other,
        ] {
            for text in [
                "cwd \"/x\": ENOENT",
                "exec \"x\": ENOENT",
                "user \"u\": x",
                "ENOTCONN",
            ] {
                assert!(init_refusal(&id, kind, text).is_none(), "{kind:?} {text:?}");
            }
        }
    }
}
