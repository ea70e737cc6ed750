//! Commands in a sandbox: one-shot, streamed (SSE), and background processes.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::IntoResponse;
use axum::Json;
use base64::Engine as _;
use grove_runtime::{ExecCancel, ExecRequest, OutputChunk, DEFAULT_MAX_OUTPUT, MAX_OUTPUT};
use tokio_stream::wrappers::ReceiverStream;

use super::pause::awake;
use super::{sandbox_id, timed};
use crate::api_shapes::{
    encode, Encoding, ExecRequestWire, ExecResultWire, Process, ProcessList, SignalRequest,
    StartedProcess,
};
use crate::app::{blocking, App};
use crate::error::{ApiError, ApiResult};
use crate::idempotency::Tag;
use crate::metrics::Op;
use crate::request_parse::ApiJson;

/// Longest timeout one command may ask for.
const MAX_TIMEOUT_MS: u64 = 24 * 3600 * 1000;

fn to_runtime(w: ExecRequestWire, background: bool) -> ApiResult<(ExecRequest, Encoding)> {
    let argv = w.argv.unwrap_or_default();
    match (argv.is_empty(), &w.shell) {
        (true, None) => return Err(ApiError::invalid("argv", "give argv (non-empty) or shell")),
        (false, Some(_)) => return Err(ApiError::invalid("shell", "give argv or shell, not both")),
        _ => {}
    }
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::invalid("argv", "arguments may not contain NUL"));
    }
    match w.timeout_ms {
        Some(0) => return Err(ApiError::invalid("timeout_ms", "must be at least 1")),
        Some(t) if t > MAX_TIMEOUT_MS => {
            return Err(ApiError::invalid(
                "timeout_ms",
                format!("at most {MAX_TIMEOUT_MS} (24 h)"),
            ))
        }
        Some(_) if background => {
            return Err(ApiError::invalid(
                "timeout_ms",
                "background processes take no timeout",
            ))
        }
        _ => {}
    }
    if let Some(cwd) = &w.cwd {
        if !cwd.starts_with('/') {
            return Err(ApiError::invalid("cwd", format!("{cwd:?} is not absolute")));
        }
    }
    for k in w.env.keys() {
        if k.is_empty() || k.contains('=') {
            return Err(ApiError::invalid(
                &format!("env.{k}"),
                "names are non-empty, without '='",
            ));
        }
    }
    match w.max_output_bytes {
        Some(m) if m > MAX_OUTPUT => {
            return Err(ApiError::invalid(
                "max_output_bytes",
                format!("at most {MAX_OUTPUT} (64 MiB)"),
            ))
        }
        Some(_) if background => {
            return Err(ApiError::invalid(
                "max_output_bytes",
                "background processes return no output",
            ))
        }
        _ => {}
    }
    if let Some(u) = &w.user {
        if u.is_empty() || u.len() > 256 || u.contains(['\0', '\n']) {
            return Err(ApiError::invalid(
                "user",
                "a user name or uid[:gid] of at most 256 bytes",
            ));
        }
    }
    let stdin = match &w.stdin {
        Some(s) => Some(
            base64::engine::general_purpose::STANDARD
                .decode(s)
                .map_err(|e| ApiError::invalid("stdin", format!("not base64: {e}")))?,
        ),
        None => None,
    };
    let req = ExecRequest {
        argv,
        shell: w.shell,
        env: w.env,
        cwd: w.cwd,
        stdin,
        timeout_ms: w.timeout_ms,
        background,
        max_output_bytes: w.max_output_bytes,
        user: w.user,
    };
    Ok((req, w.encoding.unwrap_or_default()))
}

/// POST /v1/sandboxes/{id}/exec: runs to completion (or timeout) and returns the output.
pub async fn exec(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    tag: Option<Extension<Tag>>,
    ApiJson(w): ApiJson<ExecRequestWire>,
) -> ApiResult<Json<ExecResultWire>> {
    let id = sandbox_id(&id)?;
    let (req, enc) = to_runtime(w, false)?;
    if tag.is_some() && req.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT) > MAX_OUTPUT_REPLAYED {
        return Err(ApiError::invalid(
            "max_output_bytes",
            format!(
                "at most {MAX_OUTPUT_REPLAYED} (16 MiB) with an Idempotency-Key: the answer is kept to replay"
            ),
        ));
    }
    let rt = awake(&app, &id).await?;
    // Dropped with this request's future: a client that hangs up takes its command with it.
    let cancel = CancelOnDrop(ExecCancel::default());
    let c = cancel.0.clone();
    let r = timed(
        &app,
        Op::Exec,
        blocking(move || {
            rt.exec_cancellable(&id, req, &c, &mut |_| true)
                .map_err(ApiError::from)
        }),
    )
    .await?;
    Ok(Json(ExecResultWire::from_result(&r, enc)))
}

/// The most output an exec that carries an Idempotency-Key may keep: its answer is stored to replay.
const MAX_OUTPUT_REPLAYED: u64 = 16 << 20;

/// Cancels an exec when the request handling it is dropped (hyper drops it when the client hangs up).
struct CancelOnDrop(ExecCancel);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// POST /v1/sandboxes/{id}/exec/stream: output as SSE `stdout`/`stderr` events (`{"data": ...}`), then one
/// `exit` event with the result (empty stdout/stderr) or one `error` event. Nothing is kept: each chunk
/// goes through a bounded channel, so a slow client slows the command down instead of filling memory.
pub async fn exec_stream(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    ApiJson(w): ApiJson<ExecRequestWire>,
) -> ApiResult<impl IntoResponse> {
    let id = sandbox_id(&id)?;
    if headers.contains_key("idempotency-key") {
        return Err(ApiError::bad_request(
            "invalid_header",
            "Idempotency-Key",
            "a stream cannot be replayed: use exec, or start a background process, with a key",
        ));
    }
    let (mut req, enc) = to_runtime(w, false)?;
    req.max_output_bytes = Some(0);
    let rt = awake(&app, &id).await?;
    {
        let (rt, id) = (rt.clone(), id.clone());
        blocking(move || rt.get(&id).map_err(ApiError::from)).await?;
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    let app2 = app.clone();
    // The stream is dropped when the client goes: the command ends then, even one that prints nothing.
    let cancel = ExecCancel::default();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    {
        let (tx, cancel) = (tx.clone(), cancel.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = tx.closed() => cancel.cancel(),
                _ = done_rx => {}
            }
        });
    }
    tokio::task::spawn_blocking(move || {
        let t = std::time::Instant::now();
        let mut on_output = |c: OutputChunk| {
            let (name, data) = match c {
                // The runtime's "still there?" while the command is quiet.
                OutputChunk::Stdout(d) if d.is_empty() => return !tx.is_closed(),
                OutputChunk::Stdout(d) => ("stdout", d),
                OutputChunk::Stderr(d) => ("stderr", d),
            };
            let ev = Event::default()
                .event(name)
                .json_data(serde_json::json!({ "data": encode(&data, enc) }));
            // Blocks while the client is slow (backpressure); fails once it is gone, which ends the command.
            match ev {
                Ok(ev) => tx.blocking_send(Ok(ev)).is_ok(),
                Err(_) => true,
            }
        };
        let res = rt.exec_cancellable(&id, req, &cancel, &mut on_output);
        // The watcher lets go of its sender, so the stream ends after the last event.
        let _ = done_tx.send(());
        let ev = match res {
            Ok(mut r) => {
                app2.metrics.observe(Op::Exec, t.elapsed());
                // Everything was streamed; the result keeps none of it, which is no truncation.
                r.stdout_truncated = false;
                r.stderr_truncated = false;
                Event::default()
                    .event("exit")
                    .json_data(ExecResultWire::from_result(&r, enc))
            }
            Err(e) => {
                let e = ApiError::from(e);
                app2.metrics.failure("exec", &e.code);
                Event::default().event("error").json_data(e.body())
            }
        };
        if let Ok(ev) = ev {
            let _ = tx.blocking_send(Ok(ev));
        }
    });
    Ok(Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default()))
}

/// POST /v1/sandboxes/{id}/processes: starts a background process.
pub async fn start(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    ApiJson(w): ApiJson<ExecRequestWire>,
) -> ApiResult<(StatusCode, Json<StartedProcess>)> {
    let id = sandbox_id(&id)?;
    if w.encoding.is_some() {
        return Err(ApiError::invalid(
            "encoding",
            "background processes return no output",
        ));
    }
    let (req, _) = to_runtime(w, true)?;
    let rt = awake(&app, &id).await?;
    let r = blocking(move || rt.exec(&id, req).map_err(ApiError::from)).await?;
    let pid = r.pid.ok_or_else(|| {
        ApiError::internal("the runtime returned no pid for a background process")
    })?;
    Ok((
        StatusCode::CREATED,
        Json(StartedProcess {
            pid,
            log_path: r.log_path,
        }),
    ))
}

pub async fn processes(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> ApiResult<Json<ProcessList>> {
    let id = sandbox_id(&id)?;
    let rt = awake(&app, &id).await?;
    let list = blocking(move || rt.processes(&id).map_err(ApiError::from)).await?;
    let items = list
        .into_iter()
        .map(|p| Process {
            pid: p.pid,
            argv: p.argv,
            running: p.running,
        })
        .collect();
    Ok(Json(ProcessList { items }))
}

pub async fn signal(
    State(app): State<Arc<App>>,
    Path((id, pid)): Path<(String, String)>,
    ApiJson(req): ApiJson<SignalRequest>,
) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let pid: i32 = match pid.parse() {
        Ok(p) if p > 0 => p,
        _ => {
            return Err(ApiError::bad_request(
                "invalid_pid",
                "pid",
                format!("{pid:?} is not a pid"),
            ))
        }
    };
    if !(1..=64).contains(&req.signal) {
        return Err(ApiError::invalid(
            "signal",
            format!("{} is not a signal number (1-64)", req.signal),
        ));
    }
    let rt = awake(&app, &id).await?;
    blocking(move || rt.signal(&id, pid, req.signal).map_err(ApiError::from)).await?;
    Ok(StatusCode::NO_CONTENT)
}
