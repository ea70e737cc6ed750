//! Terminals (`/pty`) and kept processes' streams and stdin: the native face of init's kept
//! processes (the E2B process service uses the same runtime calls).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::IntoResponse;
use base64::Engine as _;
use grove_runtime::live::{ProcEvent, ProcExit, ProcessRequest, PtySize};
use serde::{Deserialize, Serialize};
use tokio_stream::wrappers::ReceiverStream;

use super::pause::awake;
use super::sandbox_id;
use crate::app::{blocking, App};
use crate::error::{ApiError, ApiResult};
use crate::request_parse::ApiJson;

/// POST /v1/sandboxes/{id}/pty
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PtyCreate {
    pub cols: u16,
    pub rows: u16,
    /// Default: `/bin/bash -i -l`.
    pub argv: Option<Vec<String>>,
    pub shell: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PtyResize {
    pub cols: u16,
    pub rows: u16,
}

/// Bytes for a terminal or a kept process's stdin.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputWire {
    /// base64
    #[serde(default)]
    pub data: Option<String>,
    /// Close stdin after `data` (not for terminals: send EOT, `BA==`).
    #[serde(default)]
    pub close: bool,
}

fn pid_of(s: &str) -> ApiResult<i32> {
    match s.parse::<i32>() {
        Ok(p) if p > 1 => Ok(p),
        _ => Err(ApiError::bad_request(
            "invalid_pid",
            "pid",
            format!("{s:?} is not a pid"),
        )),
    }
}

fn b64(s: &str, field: &str) -> ApiResult<Vec<u8>> {
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| ApiError::invalid(field, format!("not base64: {e}")))
}

fn exit_json(x: &ProcExit) -> serde_json::Value {
    serde_json::json!({
        "exit_code": x.exit_code,
        "signal": x.signal,
        "timed_out": x.timed_out,
        "duration_ms": x.duration_ms,
    })
}

/// SSE of a kept process: `started` {pid}, `stdout`/`stderr`/`data` (terminal) {data: base64},
/// then `exit` or `error`. The blocking call runs on a worker thread; a bounded channel gives
/// backpressure, and a gone client ends the call (which kills a process not kept).
fn stream<F>(app: Arc<App>, call: F) -> impl IntoResponse
where
    F: FnOnce(&mut dyn FnMut(ProcEvent) -> bool) -> Result<ProcExit, grove_runtime::Error>
        + Send
        + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    tokio::task::spawn_blocking(move || {
        let _app = app;
        let enc = |d: &[u8]| base64::engine::general_purpose::STANDARD.encode(d);
        let mut on_event = |e: ProcEvent| {
            let ev = match e {
                ProcEvent::Started { pid } => Event::default()
                    .event("started")
                    .json_data(serde_json::json!({ "pid": pid })),
                ProcEvent::Stdout(d) => Event::default()
                    .event("stdout")
                    .json_data(serde_json::json!({ "data": enc(&d) })),
                ProcEvent::Stderr(d) => Event::default()
                    .event("stderr")
                    .json_data(serde_json::json!({ "data": enc(&d) })),
                ProcEvent::Pty(d) => Event::default()
                    .event("data")
                    .json_data(serde_json::json!({ "data": enc(&d) })),
                ProcEvent::Idle => return !tx.is_closed(),
            };
            match ev {
                Ok(ev) => tx.blocking_send(Ok(ev)).is_ok(),
                Err(_) => true,
            }
        };
        let ev = match call(&mut on_event) {
            Ok(x) => Event::default().event("exit").json_data(exit_json(&x)),
            Err(e) => Event::default()
                .event("error")
                .json_data(ApiError::from(e).body()),
        };
        if let Ok(ev) = ev {
            let _ = tx.blocking_send(Ok(ev));
        }
    });
    Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default())
}

/// POST /v1/sandboxes/{id}/pty: a terminal; its stream's end kills it.
pub async fn create(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    ApiJson(w): ApiJson<PtyCreate>,
) -> ApiResult<impl IntoResponse> {
    let id = sandbox_id(&id)?;
    let max = grove_runtime::live::MAX_PTY_CELLS;
    if w.cols == 0 || w.rows == 0 || w.cols > max || w.rows > max {
        return Err(ApiError::invalid(
            if w.cols == 0 || w.cols > max {
                "cols"
            } else {
                "rows"
            },
            format!("1..={max}"),
        ));
    }
    let argv = match (&w.argv, &w.shell) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("shell", "give argv or shell, not both"))
        }
        (Some(a), None) if a.is_empty() => return Err(ApiError::invalid("argv", "empty")),
        (Some(a), None) => a.clone(),
        (None, _) if w.shell.is_some() => Vec::new(),
        (None, _) => vec!["/bin/bash".into(), "-i".into(), "-l".into()],
    };
    if let Some(cwd) = &w.cwd {
        if !cwd.starts_with('/') {
            return Err(ApiError::invalid("cwd", format!("{cwd:?} is not absolute")));
        }
    }
    let req = ProcessRequest {
        argv,
        shell: w.shell,
        env: w.env,
        cwd: w.cwd,
        user: w.user,
        pty: Some(PtySize {
            cols: w.cols,
            rows: w.rows,
        }),
        ..ProcessRequest::default()
    };
    let rt = awake(&app, &id).await?;
    {
        let (rt, id) = (rt.clone(), id.clone());
        blocking(move || rt.get(&id).map_err(ApiError::from)).await?;
    }
    Ok(stream(app, move |on_event| {
        rt.proc_start(&id, req, true, on_event)
            .map(|(_, x)| x.unwrap_or_default())
    }))
}

/// POST /v1/sandboxes/{id}/pty/{pid}/input
pub async fn input(
    State(app): State<Arc<App>>,
    Path((id, pid)): Path<(String, String)>,
    ApiJson(w): ApiJson<InputWire>,
) -> ApiResult<StatusCode> {
    stdin(State(app), Path((id, pid)), ApiJson(w)).await
}

/// POST /v1/sandboxes/{id}/pty/{pid}/resize
pub async fn resize(
    State(app): State<Arc<App>>,
    Path((id, pid)): Path<(String, String)>,
    ApiJson(w): ApiJson<PtyResize>,
) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let pid = pid_of(&pid)?;
    let rt = awake(&app, &id).await?;
    let size = PtySize {
        cols: w.cols,
        rows: w.rows,
    };
    blocking(move || rt.proc_resize(&id, pid, size).map_err(ApiError::from)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// DELETE /v1/sandboxes/{id}/pty/{pid}: SIGKILL to the terminal's session.
pub async fn kill(
    State(app): State<Arc<App>>,
    Path((id, pid)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let pid = pid_of(&pid)?;
    let rt = awake(&app, &id).await?;
    blocking(move || {
        let known = rt
            .proc_list(&id)?
            .into_iter()
            .any(|p| p.pid == pid && p.pty && p.running);
        if !known {
            return Err(ApiError::not_found(
                "not_found",
                format!("no running terminal {pid}"),
            ));
        }
        rt.signal(&id, pid, 9).map_err(ApiError::from)
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// POST /v1/sandboxes/{id}/processes/{pid}/stdin
pub async fn stdin(
    State(app): State<Arc<App>>,
    Path((id, pid)): Path<(String, String)>,
    ApiJson(w): ApiJson<InputWire>,
) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let pid = pid_of(&pid)?;
    let data = match &w.data {
        Some(d) => b64(d, "data")?,
        None => Vec::new(),
    };
    if data.len() > 1 << 20 {
        return Err(ApiError::invalid("data", "at most 1 MiB per call"));
    }
    let rt = awake(&app, &id).await?;
    blocking(move || {
        if !data.is_empty() {
            rt.proc_input(&id, pid, data)?;
        }
        if w.close {
            rt.proc_close_stdin(&id, pid)?;
        }
        Ok(())
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// GET /v1/sandboxes/{id}/processes/{pid}/stream: a kept (background) process's output from
/// its buffered start, live after that, then its exit; leaving does not stop the process.
pub async fn connect(
    State(app): State<Arc<App>>,
    Path((id, pid)): Path<(String, String)>,
) -> ApiResult<impl IntoResponse> {
    let id = sandbox_id(&id)?;
    let pid = pid_of(&pid)?;
    let rt = awake(&app, &id).await?;
    {
        let (rt, id) = (rt.clone(), id.clone());
        blocking(move || {
            if rt.proc_list(&id)?.iter().any(|p| p.pid == pid) {
                Ok(())
            } else {
                Err(ApiError::not_found(
                    "not_found",
                    format!("no kept process {pid}"),
                ))
            }
        })
        .await?;
    }
    Ok(stream(app, move |on_event| {
        rt.proc_connect(&id, pid, on_event)
    }))
}
