//! SWE-ReX's sessions (`create_session`, `run_in_session`, `close_session`, `close`) on Grove's shell
//! sessions: one Grove session per SWE-ReX session, under the same name.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::Json;
use grove_runtime::{ExecRequest, Runtime, SandboxId};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{backslashreplace, body, off_thread, py_repr, timeout_ms, RexError, RexResult};
use crate::api::pause::awake;
use crate::api::sandbox_id;
use crate::app::App;
use crate::error::ApiError;

/// SWE-ReX's prompt string: its clients see it as `expect_string` of a command that finished.
const PS1: &str = "SHELLPS1PREFIX";

#[derive(Debug, Deserialize)]
struct CreateRequest {
    #[serde(default)]
    startup_source: Vec<String>,
    #[serde(default = "default_session")]
    session: String,
    #[serde(default = "bash")]
    session_type: String,
    #[serde(default)]
    startup_timeout: Option<f64>,
}

fn default_session() -> String {
    "default".into()
}

fn bash() -> String {
    "bash".into()
}

fn bash_only(t: &str) -> RexResult<()> {
    if t == "bash" {
        Ok(())
    } else {
        Err(ApiError::invalid("session_type", format!("{t:?}: only \"bash\"")).into())
    }
}

/// POST create_session: a bash session, the startup files sourced in it.
pub async fn create(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> RexResult<Json<Value>> {
    let id = sandbox_id(&id)?;
    let req: CreateRequest = body(&bytes)?;
    bash_only(&req.session_type)?;
    let startup = timeout_ms("startup_timeout", req.startup_timeout.or(Some(1.0)))?;
    let rt = awake(&app, &id).await?;
    let name = req.session;
    let output = off_thread(move || {
        backend::create(&rt, &id, &name)?;
        if req.startup_source.is_empty() {
            return Ok(String::new());
        }
        let cmd = req
            .startup_source
            .iter()
            .map(|p| format!("source {}", shell_quote(p)))
            .collect::<Vec<_>>()
            .join(" ; ");
        // Sourcing is generous about time: files that set up a venv or conda take a while.
        let r = backend::run(&rt, &id, &name, &cmd, startup.map(|t| t.max(10_000)))?;
        Ok(backslashreplace(&r.output))
    })
    .await?;
    Ok(Json(json!({"output": output, "session_type": "bash"})))
}

#[derive(Debug, Deserialize)]
#[serde(tag = "action_type")]
enum Action {
    #[serde(rename = "bash")]
    Bash(BashAction),
    #[serde(rename = "bash_interrupt")]
    Interrupt(InterruptAction),
}

#[derive(Debug, Deserialize)]
struct BashAction {
    command: String,
    #[serde(default = "default_session")]
    session: String,
    #[serde(default)]
    timeout: Option<f64>,
    #[serde(default)]
    is_interactive_command: bool,
    #[serde(default)]
    is_interactive_quit: bool,
    #[serde(default = "raise")]
    check: Check,
    #[serde(default)]
    error_msg: String,
    #[serde(default)]
    expect: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct InterruptAction {
    #[serde(default = "default_session")]
    session: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Check {
    Silent,
    Raise,
    Ignore,
}

fn raise() -> Check {
    Check::Raise
}

/// POST run_in_session.
pub async fn run(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> RexResult<Json<Value>> {
    let id = sandbox_id(&id)?;
    let mut v: Value = body(&bytes)?;
    // SWE-ReX's discriminator defaults to "bash".
    if let Some(o) = v.as_object_mut() {
        o.entry("action_type").or_insert_with(|| json!("bash"));
    }
    let action: Action = super::body(&Bytes::from(serde_json::to_vec(&v).unwrap_or_default()))?;
    let rt = awake(&app, &id).await?;
    let obs = off_thread(move || match action {
        Action::Interrupt(a) => {
            backend::interrupt(&rt, &id, &a.session)?;
            Ok(observation(String::new(), Some(0), PS1))
        }
        Action::Bash(a) if a.is_interactive_command || a.is_interactive_quit => {
            super::interactive::run(
                &rt,
                &id,
                &a.session,
                &a.command,
                a.is_interactive_quit,
                &a.expect,
                timeout_ms("timeout", a.timeout)?,
            )
        }
        Action::Bash(a) => run_normal(&rt, &id, a),
    })
    .await?;
    Ok(Json(obs))
}

pub(crate) fn observation(output: String, exit_code: Option<i32>, expect: &str) -> Value {
    json!({
        "output": output,
        "exit_code": exit_code,
        "failure_reason": "",
        "expect_string": expect,
        "session_type": "bash",
    })
}

/// A command that runs to its end: syntax checked first (as SWE-ReX does, with `bash -n` in the
/// sandbox), then run in the session; `check` decides what a failure is.
fn run_normal(rt: &Arc<Runtime>, id: &SandboxId, a: BashAction) -> RexResult<Value> {
    let timeout = timeout_ms("timeout", a.timeout)?;
    if !backend::exists(rt, id, &a.session)? {
        return Err(does_not_exist(&a.session));
    }
    check_syntax(rt, id, &a.command)?;
    let r = backend::run(rt, id, &a.session, &a.command, timeout)?;
    let output = backslashreplace(&r.output);
    if r.timed_out {
        return Err(RexError::exception(
            "swerex.exceptions.CommandTimeoutError",
            format!(
                "timeout after {} seconds while running command {}",
                a.timeout.unwrap_or_default(),
                py_repr(&a.command)
            ),
        ));
    }
    if !r.alive {
        return Err(RexError::exception(
            "swerex.exceptions.SessionNotInitializedError",
            format!(
                "the shell of session {} died while running {} (output: {})",
                py_repr(&a.session),
                py_repr(&a.command),
                py_repr(&output)
            ),
        ));
    }
    let exit_code = match a.check {
        Check::Ignore => None,
        _ => r.exit_code,
    };
    if a.check == Check::Raise && exit_code != Some(0) {
        let mut msg = format!(
            "Command {} failed with exit code {}. Here is the output:\n{}",
            py_repr(&a.command),
            exit_code.map_or("None".into(), |c| c.to_string()),
            py_repr(&output)
        );
        if !a.error_msg.is_empty() {
            msg = format!("{}: {msg}", a.error_msg);
        }
        return Err(RexError::exception(
            "swerex.exceptions.NonZeroExitCodeError",
            msg,
        ));
    }
    let _ = &a.expect; // A command that ran to its end matched the prompt, not an expect string.
    Ok(observation(output, exit_code, PS1))
}

/// `bash -n` on the command in the sandbox (never on the host): a syntax error is SWE-ReX's
/// `BashIncorrectSyntaxError`, and the command is not run.
fn check_syntax(rt: &Arc<Runtime>, id: &SandboxId, command: &str) -> RexResult<()> {
    let req = ExecRequest {
        argv: vec!["bash".into(), "-n".into()],
        stdin: Some(command.as_bytes().to_vec()),
        timeout_ms: Some(10_000),
        max_output_bytes: Some(64 << 10),
        ..Default::default()
    };
    let r = rt.exec(id, req).map_err(ApiError::from)?;
    if r.exit_code == Some(0) {
        return Ok(());
    }
    let stdout = backslashreplace(&r.stdout);
    let stderr = backslashreplace(&r.stderr);
    let msg = format!(
        "Error (exit code {}) while checking bash command \n{}\n---- Stderr ----\n{stderr}\n---- Stdout ----\n{stdout}",
        r.exit_code.unwrap_or(-1),
        py_repr(command)
    );
    Err(RexError::Exception {
        class_path: "swerex.exceptions.BashIncorrectSyntaxError",
        message: msg,
        extra_info: json!({"bash_stdout": stdout, "bash_stderr": stderr}),
    })
}

pub(crate) fn does_not_exist(name: &str) -> RexError {
    RexError::exception(
        "swerex.exceptions.SessionDoesNotExistError",
        format!("session {} does not exist", py_repr(name)),
    )
}

#[derive(Debug, Deserialize)]
struct CloseRequest {
    #[serde(default = "default_session")]
    session: String,
    #[serde(default = "bash")]
    session_type: String,
}

/// POST close_session.
pub async fn close(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> RexResult<Json<Value>> {
    let id = sandbox_id(&id)?;
    let req: CloseRequest = body(&bytes)?;
    bash_only(&req.session_type)?;
    let rt = awake(&app, &id).await?;
    off_thread(move || {
        backend::close(&rt, &id, &req.session)?;
        super::interactive::forget(&rt, &id, &req.session);
        Ok(())
    })
    .await?;
    Ok(Json(json!({"session_type": "bash"})))
}

/// POST close: SWE-ReX's runtime closes all its sessions (the sandbox stays: the deployment's
/// `stop` destroys it).
pub async fn close_all(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> RexResult<Json<Value>> {
    let id = sandbox_id(&id)?;
    let rt = awake(&app, &id).await?;
    off_thread(move || {
        for name in backend::list(&rt, &id)? {
            match backend::close(&rt, &id, &name) {
                // Closed meanwhile by someone else.
                Err(RexError::Exception {
                    class_path: "swerex.exceptions.SessionDoesNotExistError",
                    ..
                }) => {}
                r => r?,
            }
            super::interactive::forget(&rt, &id, &name);
        }
        Ok(())
    })
    .await?;
    Ok(Json(json!({})))
}

/// `s` quoted for a POSIX shell.
pub(crate) fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Grove's sessions (runtime/src/runtime/sessions.rs), failing as SWE-ReX's own would.
pub(crate) mod backend {
    use super::*;
    use grove_runtime::{Error as E, SessionCreate, SessionRun};

    pub struct Ran {
        /// stdout and stderr, merged as on a terminal.
        pub output: Vec<u8>,
        pub exit_code: Option<i32>,
        pub timed_out: bool,
        /// The shell still runs.
        pub alive: bool,
    }

    /// A session error as the exception SWE-ReX raises for it; anything else as an HTTP error.
    fn fail(name: &str, e: E) -> RexError {
        match e {
            E::SessionNotFound { .. } => does_not_exist(name),
            E::SessionDead { reason, .. } => RexError::exception(
                "swerex.exceptions.SessionNotInitializedError",
                format!("session {} is dead: {reason}", py_repr(name)),
            ),
            E::SessionConflict { reason, .. } if reason.contains("exist") => RexError::exception(
                "swerex.exceptions.SessionExistsError",
                format!("session {} already exists", py_repr(name)),
            ),
            E::SessionConflict { reason, .. } => ApiError::new(
                axum::http::StatusCode::CONFLICT,
                "session_conflict",
                format!("session {}: {reason}", py_repr(name)),
            )
            .with_field("session")
            .into(),
            e => {
                let mut a = ApiError::from(e);
                // SWE-ReX calls the session's name `session`.
                if a.field.as_deref() == Some("name") {
                    a.field = Some("session".into());
                }
                a.into()
            }
        }
    }

    pub fn create(rt: &Arc<Runtime>, id: &SandboxId, name: &str) -> RexResult<()> {
        if exists(rt, id, name)? {
            return Err(fail(
                name,
                E::SessionConflict {
                    id: id.clone(),
                    name: name.into(),
                    reason: "exists".into(),
                },
            ));
        }
        let req = SessionCreate {
            name: name.into(),
            ..Default::default()
        };
        rt.session_create(id, req)
            .map(|_| ())
            .map_err(|e| fail(name, e))
    }

    pub fn exists(rt: &Arc<Runtime>, id: &SandboxId, name: &str) -> RexResult<bool> {
        Ok(list(rt, id)?.iter().any(|n| n == name))
    }

    pub fn run(
        rt: &Arc<Runtime>,
        id: &SandboxId,
        name: &str,
        command: &str,
        timeout_ms: Option<u64>,
    ) -> RexResult<Ran> {
        let req = SessionRun {
            command: command.into(),
            timeout_ms,
            ..Default::default()
        };
        let r = rt.session_run(id, name, req).map_err(|e| fail(name, e))?;
        Ok(Ran {
            output: r.output,
            exit_code: r.exit_code,
            timed_out: r.timed_out,
            alive: r.session_alive,
        })
    }

    pub fn interrupt(rt: &Arc<Runtime>, id: &SandboxId, name: &str) -> RexResult<()> {
        rt.session_interrupt(id, name).map_err(|e| fail(name, e))
    }

    pub fn close(rt: &Arc<Runtime>, id: &SandboxId, name: &str) -> RexResult<()> {
        if !exists(rt, id, name)? {
            return Err(does_not_exist(name));
        }
        rt.session_close(id, name).map_err(|e| fail(name, e))
    }

    pub fn list(rt: &Arc<Runtime>, id: &SandboxId) -> RexResult<Vec<String>> {
        let l = rt.session_list(id).map_err(|e| fail("", e))?;
        Ok(l.into_iter().map(|s| s.name).collect())
    }
}
