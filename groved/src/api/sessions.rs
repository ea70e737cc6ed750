//! Shell sessions in a sandbox (issue 23): named long-lived shells whose state (cwd, variables,
//! functions, jobs) carries from one run to the next, and into every branch of a fork.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use grove_runtime::{SessionCreate, SessionInfo, SessionRun, SessionRunResult};
use serde::{Deserialize, Serialize};

use super::pause::awake;
use super::{sandbox_id, timed};
use crate::api_shapes::{encode, Encoding};
use crate::app::{blocking, App};
use crate::error::{ApiError, ApiResult};
use crate::metrics::Op;
use crate::request_parse::ApiJson;

/// POST /v1/sandboxes/{id}/sessions
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionCreateWire {
    pub name: String,
    pub shell: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
}

/// POST /v1/sandboxes/{id}/sessions/{name}/run
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionRunWire {
    pub command: String,
    pub timeout_ms: Option<u64>,
    /// The command's stdin, as text (else /dev/null).
    pub input: Option<String>,
    /// How `output` is returned: "utf8" (lossy, default) or "base64".
    pub encoding: Option<Encoding>,
    pub max_output_bytes: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionRunResultWire {
    /// stdout and stderr merged, in the order the command wrote them.
    pub output: String,
    pub encoding: Encoding,
    pub output_truncated: bool,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub interrupted: bool,
    pub session_alive: bool,
    pub duration_ms: u64,
}

impl SessionRunResultWire {
    fn from_result(r: &SessionRunResult, encoding: Encoding) -> Self {
        SessionRunResultWire {
            output: encode(&r.output, encoding),
            encoding,
            output_truncated: r.output_truncated,
            exit_code: r.exit_code,
            signal: r.signal,
            timed_out: r.timed_out,
            interrupted: r.interrupted,
            session_alive: r.session_alive,
            duration_ms: r.duration_ms,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionList {
    pub sessions: Vec<SessionInfo>,
}

/// A session name from the path or the body: 400 when malformed.
fn session_name(name: &str) -> ApiResult<String> {
    if grove_runtime::init::session::valid_name(name) {
        Ok(name.to_string())
    } else {
        Err(ApiError::bad_request(
            "invalid_name",
            "name",
            format!("{name:?} is not a session name (1 to 64 of A-Z a-z 0-9 _ . -, not starting with .)"),
        ))
    }
}

pub async fn create(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    ApiJson(w): ApiJson<SessionCreateWire>,
) -> ApiResult<(StatusCode, Json<SessionInfo>)> {
    let id = sandbox_id(&id)?;
    let name = session_name(&w.name)?;
    let req = SessionCreate {
        name,
        shell: w.shell,
        env: w.env,
        cwd: w.cwd,
    };
    let rt = awake(&app, &id).await?;
    let s = blocking(move || rt.session_create(&id, req).map_err(ApiError::from)).await?;
    Ok((StatusCode::CREATED, Json(s)))
}

pub async fn list(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> ApiResult<Json<SessionList>> {
    let id = sandbox_id(&id)?;
    let rt = awake(&app, &id).await?;
    let sessions = blocking(move || rt.session_list(&id).map_err(ApiError::from)).await?;
    Ok(Json(SessionList { sessions }))
}

pub async fn get(
    State(app): State<Arc<App>>,
    Path((id, name)): Path<(String, String)>,
) -> ApiResult<Json<SessionInfo>> {
    let id = sandbox_id(&id)?;
    let name = session_name(&name)?;
    let rt = awake(&app, &id).await?;
    let s = blocking(move || rt.session_get(&id, &name).map_err(ApiError::from)).await?;
    Ok(Json(s))
}

pub async fn run(
    State(app): State<Arc<App>>,
    Path((id, name)): Path<(String, String)>,
    ApiJson(w): ApiJson<SessionRunWire>,
) -> ApiResult<Json<SessionRunResultWire>> {
    let id = sandbox_id(&id)?;
    let name = session_name(&name)?;
    let encoding = w.encoding.unwrap_or_default();
    let req = SessionRun {
        command: w.command,
        timeout_ms: w.timeout_ms,
        input: w.input.map(String::into_bytes),
        max_output_bytes: w.max_output_bytes,
    };
    let rt = awake(&app, &id).await?;
    let r = timed(
        &app,
        Op::Exec,
        blocking(move || rt.session_run(&id, &name, req).map_err(ApiError::from)),
    )
    .await?;
    Ok(Json(SessionRunResultWire::from_result(&r, encoding)))
}

pub async fn interrupt(
    State(app): State<Arc<App>>,
    Path((id, name)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let name = session_name(&name)?;
    let rt = awake(&app, &id).await?;
    blocking(move || rt.session_interrupt(&id, &name).map_err(ApiError::from)).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn close(
    State(app): State<Arc<App>>,
    Path((id, name)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let name = session_name(&name)?;
    let rt = awake(&app, &id).await?;
    blocking(move || rt.session_close(&id, &name).map_err(ApiError::from)).await?;
    Ok(StatusCode::NO_CONTENT)
}
