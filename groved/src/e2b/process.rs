//! envd's `process.Process` Connect service on Grove's kept processes (runtime `proc_*`, init's
//! live table): start (cmd/args/envs/cwd, the user from the `Authorization: Basic` header, an
//! optional pty, stdin), connect by pid or tag with the buffered output replayed, list, input,
//! close stdin, signal, resize.
//!
//! Lifetime: like envd, a process is killed when the stream's `Connect-Timeout-Ms` passes (the
//! SDK's `timeout`). A start stream that ends before the process does kills it too, unless the
//! stream had no deadline (the SDK's `timeout=0`, how E2B code asks for a process that outlives
//! its client); such processes are reachable again with `Connect`.

use std::time::Duration;

use base64::Engine as _;
use grove_runtime::live::{ProcEvent, ProcExit, ProcessRequest, PtySize};
use grove_runtime::SandboxId;

use super::connect::{BoxStream, Code, ConnectError, Ctx, Services};
use super::proto::process as pb;
use crate::app::blocking;
use crate::error::ApiError;

use pb::process_event::{data_event::Output, DataEvent, EndEvent, Event, KeepAlive, StartEvent};

/// The user a request without `Authorization` runs as: E2B images' default.
const DEFAULT_USER: &str = "user";
/// A keepalive event this often when the client asks for none (`Keepalive-Ping-Interval`).
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(50);

pub fn register(s: &mut Services) {
    s.server_stream("/process.Process/Start", start);
    s.server_stream("/process.Process/Connect", connect);
    s.unary("/process.Process/List", list);
    s.unary("/process.Process/SendInput", send_input);
    s.client_stream("/process.Process/StreamInput", stream_input);
    s.unary("/process.Process/SendSignal", send_signal);
    s.unary("/process.Process/CloseStdin", close_stdin);
    s.unary("/process.Process/Update", update);
}

fn api(e: grove_runtime::Error) -> ConnectError {
    ConnectError::from(ApiError::from(e))
}

/// `Authorization: Basic base64(user:)` as the SDK sends it; None without the header.
fn user_of(ctx: &Ctx) -> Result<Option<String>, ConnectError> {
    let Some(v) = ctx.headers.get("authorization") else {
        return Ok(None);
    };
    let bad = || {
        ConnectError::new(
            Code::Unauthenticated,
            "Authorization: expected Basic <user:>",
        )
    };
    let v = v.to_str().map_err(|_| bad())?;
    let b = v.strip_prefix("Basic ").ok_or_else(bad)?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b.trim())
        .map_err(|_| bad())?;
    let s = String::from_utf8(raw).map_err(|_| bad())?;
    let user = s.split(':').next().unwrap_or("");
    if user.is_empty() || user.len() > 256 || user.contains(['\0', '\n']) {
        return Err(ConnectError::invalid(format!(
            "user {user:?} is not a user name"
        )));
    }
    Ok(Some(user.to_string()))
}

fn keepalive_of(ctx: &Ctx) -> Duration {
    ctx.headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|s| (1..=3600).contains(s))
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_KEEPALIVE)
}

fn ev(e: Event) -> pb::ProcessEvent {
    pb::ProcessEvent { event: Some(e) }
}

fn data(o: Output) -> pb::ProcessEvent {
    ev(Event::Data(DataEvent { output: Some(o) }))
}

/// The end event as envd (Go's ProcessState) words it.
fn end_of(x: &ProcExit) -> pb::ProcessEvent {
    let (code, exited, status) = match (x.exit_code, x.signal) {
        (Some(c), _) => (c, true, format!("exit status {c}")),
        (None, Some(9)) => (-1, false, "signal: killed".to_string()),
        (None, Some(s)) => (-1, false, format!("signal: {s}")),
        (None, None) => (-1, false, "unknown".to_string()),
    };
    ev(Event::End(EndEvent {
        exit_code: code,
        exited,
        status,
        error: x
            .timed_out
            .then(|| "the process ran past its timeout".to_string()),
    }))
}

/// Runs a blocking attach (start or connect) on a worker thread; its events become the RPC's
/// stream, with keepalives in quiet stretches. The first event (started, or the failure) is
/// awaited here, so a refused start is the RPC's error. Dropping the stream (client gone, or the
/// deadline) fails the worker's next send, which ends the attach.
async fn attach<F>(
    ctx: &Ctx,
    call: F,
) -> Result<BoxStream<Result<pb::ProcessEvent, ConnectError>>, ConnectError>
where
    F: FnOnce(&mut dyn FnMut(ProcEvent) -> bool) -> Result<ProcExit, grove_runtime::Error>
        + Send
        + 'static,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<pb::ProcessEvent, ConnectError>>(64);
    tokio::task::spawn_blocking(move || {
        let mut on_event = |e: ProcEvent| {
            let m = match e {
                ProcEvent::Started { pid } => ev(Event::Start(StartEvent { pid: pid as u32 })),
                ProcEvent::Stdout(d) => data(Output::Stdout(d)),
                ProcEvent::Stderr(d) => data(Output::Stderr(d)),
                ProcEvent::Pty(d) => data(Output::Pty(d)),
                ProcEvent::Idle => return !tx.is_closed(),
            };
            tx.blocking_send(Ok(m)).is_ok()
        };
        let last = match call(&mut on_event) {
            Ok(x) => Ok(end_of(&x)),
            Err(e) => Err(api(e)),
        };
        let _ = tx.blocking_send(last);
    });
    let first = match rx.recv().await {
        Some(Ok(m)) => m,
        Some(Err(e)) => return Err(e),
        None => return Err(ConnectError::internal("the process stream ended at once")),
    };
    let every = keepalive_of(ctx);
    let rest = futures::stream::unfold(Some(rx), move |rx| async move {
        let mut rx = rx?;
        match tokio::time::timeout(every, rx.recv()).await {
            Ok(Some(Ok(m))) => {
                let end = matches!(m.event, Some(Event::End(_)));
                Some((Ok(m), if end { None } else { Some(rx) }))
            }
            Ok(Some(Err(e))) => Some((Err(e), None)),
            Ok(None) => None,
            Err(_) => Some((Ok(ev(Event::Keepalive(KeepAlive {}))), Some(rx))),
        }
    });
    let first = futures::stream::once(async move { Ok(first) });
    Ok(Box::pin(futures::StreamExt::chain(first, rest)))
}

/// The events in a Start or Connect response.
fn wrap<M: Send + 'static>(
    f: fn(pb::ProcessEvent) -> M,
    s: BoxStream<Result<pb::ProcessEvent, ConnectError>>,
) -> BoxStream<Result<M, ConnectError>> {
    Box::pin(futures::StreamExt::map(s, move |r| r.map(f)))
}

async fn start(
    ctx: Ctx,
    req: pb::StartRequest,
) -> Result<BoxStream<Result<pb::StartResponse, ConnectError>>, ConnectError> {
    let cfg = req
        .process
        .ok_or_else(|| ConnectError::invalid("process: required"))?;
    if cfg.cmd.is_empty() {
        return Err(ConnectError::invalid("process.cmd: empty"));
    }
    let pty = match req.pty.and_then(|p| p.size) {
        Some(s) => {
            let ok = |n: u32| (1..=u32::from(grove_runtime::live::MAX_PTY_CELLS)).contains(&n);
            if !ok(s.cols) || !ok(s.rows) {
                return Err(ConnectError::invalid(
                    "pty.size: cols and rows are 1..=4096",
                ));
            }
            Some(PtySize {
                cols: s.cols as u16,
                rows: s.rows as u16,
            })
        }
        None => None,
    };
    if let Some(cwd) = &cfg.cwd {
        if !cwd.is_empty() && !cwd.starts_with('/') {
            return Err(ConnectError::invalid(format!(
                "process.cwd {cwd:?} is not absolute"
            )));
        }
    }
    let explicit = user_of(&ctx)?;
    let deadline = ctx.timeout.filter(|t| !t.is_zero());
    let mut argv = vec![cfg.cmd];
    argv.extend(cfg.args);
    let r = ProcessRequest {
        argv,
        env: cfg.envs.into_iter().collect(),
        cwd: cfg.cwd.filter(|c| !c.is_empty()),
        // An image without E2B's `user` account runs an unnamed request as root.
        user_or_root: explicit.is_none(),
        user: Some(explicit.unwrap_or_else(|| DEFAULT_USER.into())),
        pty,
        stdin: req.stdin.unwrap_or(true) || pty.is_some(),
        tag: req.tag,
        keep: deadline.is_none(),
        // The stream's deadline ends it first (the SDK's TimeoutException) and its end kills the
        // process; init's own timeout, a little later, is the backstop.
        timeout_ms: deadline.map(|t| t.as_millis() as u64 + 2000),
        shell: None,
    };
    let rt = ctx.app.runtime.clone();
    let id = ctx.sandbox.clone();
    let s = attach(&ctx, move |on_event| {
        rt.proc_start(&id, r, true, on_event)
            .map(|(_, x)| x.unwrap_or_default())
    })
    .await?;
    Ok(wrap(|e| pb::StartResponse { event: Some(e) }, s))
}

/// The pid a selector names (a tag is looked up among the running processes).
async fn pid_of(ctx: &Ctx, sel: Option<pb::ProcessSelector>) -> Result<i32, ConnectError> {
    use pb::process_selector::Selector;
    match sel.and_then(|s| s.selector) {
        Some(Selector::Pid(p)) if p > 1 && p <= i32::MAX as u32 => Ok(p as i32),
        Some(Selector::Pid(p)) => Err(ConnectError::invalid(format!(
            "process.pid {p} is not a pid"
        ))),
        Some(Selector::Tag(t)) => {
            let rt = ctx.app.runtime.clone();
            let id = ctx.sandbox.clone();
            let list = blocking(move || rt.proc_list(&id).map_err(ApiError::from))
                .await
                .map_err(ConnectError::from)?;
            list.iter()
                .find(|p| p.running && p.tag.as_deref() == Some(t.as_str()))
                .map(|p| p.pid)
                .ok_or_else(|| ConnectError::not_found(format!("process with tag {t:?} not found")))
        }
        None => Err(ConnectError::invalid("process: give a pid or a tag")),
    }
}

async fn connect(
    ctx: Ctx,
    req: pb::ConnectRequest,
) -> Result<BoxStream<Result<pb::ConnectResponse, ConnectError>>, ConnectError> {
    let pid = pid_of(&ctx, req.process).await?;
    let rt = ctx.app.runtime.clone();
    let id = ctx.sandbox.clone();
    let s = attach(&ctx, move |on_event| rt.proc_connect(&id, pid, on_event)).await?;
    Ok(wrap(|e| pb::ConnectResponse { event: Some(e) }, s))
}

async fn run<T: Send + 'static>(
    ctx: &Ctx,
    f: impl FnOnce(&grove_runtime::Runtime, &SandboxId) -> Result<T, grove_runtime::Error>
        + Send
        + 'static,
) -> Result<T, ConnectError> {
    let rt = ctx.app.runtime.clone();
    let id = ctx.sandbox.clone();
    blocking(move || f(&rt, &id).map_err(ApiError::from))
        .await
        .map_err(ConnectError::from)
}

async fn list(ctx: Ctx, _req: pb::ListRequest) -> Result<pb::ListResponse, ConnectError> {
    let list = run(&ctx, |rt, id| rt.proc_list(id)).await?;
    let processes = list
        .into_iter()
        .filter(|p| p.running)
        .map(|p| {
            let mut argv = p.argv.into_iter();
            pb::ProcessInfo {
                config: Some(pb::ProcessConfig {
                    cmd: argv.next().unwrap_or_default(),
                    args: argv.collect(),
                    envs: p.env.into_iter().collect(),
                    cwd: Some(p.cwd),
                }),
                pid: p.pid as u32,
                tag: p.tag,
            }
        })
        .collect();
    Ok(pb::ListResponse { processes })
}

async fn input(ctx: &Ctx, pid: i32, i: Option<pb::ProcessInput>) -> Result<(), ConnectError> {
    use pb::process_input::Input;
    let data = match i.and_then(|i| i.input) {
        Some(Input::Stdin(d)) | Some(Input::Pty(d)) => d,
        None => return Err(ConnectError::invalid("input: give stdin or pty bytes")),
    };
    if data.is_empty() {
        return Ok(());
    }
    run(ctx, move |rt, id| rt.proc_input(id, pid, data)).await
}

async fn send_input(
    ctx: Ctx,
    req: pb::SendInputRequest,
) -> Result<pb::SendInputResponse, ConnectError> {
    let pid = pid_of(&ctx, req.process).await?;
    input(&ctx, pid, req.input).await?;
    Ok(pb::SendInputResponse {})
}

async fn stream_input(
    ctx: Ctx,
    mut reqs: BoxStream<Result<pb::StreamInputRequest, ConnectError>>,
) -> Result<pb::StreamInputResponse, ConnectError> {
    use futures::StreamExt as _;
    use pb::stream_input_request::Event as In;
    let mut pid = None;
    while let Some(r) = reqs.next().await {
        match (r?.event, pid) {
            (Some(In::Start(s)), None) => pid = Some(pid_of(&ctx, s.process).await?),
            (Some(In::Start(_)), Some(_)) => {
                return Err(ConnectError::invalid("start: sent twice"));
            }
            (Some(In::Data(d)), Some(p)) => input(&ctx, p, d.input).await?,
            (Some(In::Data(_)), None) => {
                return Err(ConnectError::invalid("data before the start event"));
            }
            (Some(In::Keepalive(_)), _) | (None, _) => {}
        }
    }
    Ok(pb::StreamInputResponse {})
}

async fn send_signal(
    ctx: Ctx,
    req: pb::SendSignalRequest,
) -> Result<pb::SendSignalResponse, ConnectError> {
    let sig = match pb::Signal::try_from(req.signal) {
        Ok(pb::Signal::Sigkill) => 9,
        Ok(pb::Signal::Sigterm) => 15,
        _ => {
            return Err(ConnectError::invalid(format!(
                "signal {}: SIGTERM or SIGKILL",
                req.signal
            )))
        }
    };
    let pid = pid_of(&ctx, req.process).await?;
    // Only a process init keeps (or one of its children) is signalled through this service.
    let known = run(&ctx, move |rt, id| {
        Ok(rt.proc_list(id)?.iter().any(|p| p.pid == pid && p.running))
    })
    .await?;
    if !known {
        return Err(ConnectError::not_found(format!(
            "process with pid {pid} not found"
        )));
    }
    run(&ctx, move |rt, id| rt.signal(id, pid, sig)).await?;
    Ok(pb::SendSignalResponse {})
}

async fn close_stdin(
    ctx: Ctx,
    req: pb::CloseStdinRequest,
) -> Result<pb::CloseStdinResponse, ConnectError> {
    let pid = pid_of(&ctx, req.process).await?;
    run(&ctx, move |rt, id| rt.proc_close_stdin(id, pid)).await?;
    Ok(pb::CloseStdinResponse {})
}

async fn update(ctx: Ctx, req: pb::UpdateRequest) -> Result<pb::UpdateResponse, ConnectError> {
    let pid = pid_of(&ctx, req.process).await?;
    let Some(size) = req.pty.and_then(|p| p.size) else {
        return Ok(pb::UpdateResponse {});
    };
    let max = u32::from(grove_runtime::live::MAX_PTY_CELLS);
    if size.cols == 0 || size.rows == 0 || size.cols > max || size.rows > max {
        return Err(ConnectError::invalid(
            "pty.size: cols and rows are 1..=4096",
        ));
    }
    let size = PtySize {
        cols: size.cols as u16,
        rows: size.rows as u16,
    };
    run(&ctx, move |rt, id| rt.proc_resize(id, pid, size)).await?;
    Ok(pb::UpdateResponse {})
}
