//! SWE-ReX's remote runtime protocol (swe-rex 1.4, `swerex/server.py`), served per sandbox under
//! `/v1/sandboxes/{id}/swerex`, so that an unmodified
//! `RemoteRuntime(host="http://NODE/v1/sandboxes/ID/swerex", port=None, auth_token=KEY)` drives a
//! Grove sandbox. Sessions are Grove's shell sessions (the native `/sessions` API sees the same
//! ones and forks carry them), `execute` is exec and the file calls are the files API.
//!
//! Failures SWE-ReX's own server raises as Python exceptions leave as status 511 with
//! `{"swerexception": {message, class_path, traceback, extra_info}}`, which its client re-raises
//! as the same class (`swerex.exceptions.NonZeroExitCodeError`, `builtins.FileNotFoundError`, ...).
//! Everything else is an ordinary Grove error body with FastAPI's `detail` beside it.

mod interactive;
mod session;
mod upload;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{to_bytes, Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use grove_runtime::{ExecRequest, SandboxState};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::pause::awake;
use super::sandbox_id;
use crate::app::{blocking, App};
use crate::error::ApiError;
use crate::request_parse::parse_json;

/// The routes below `/v1/sandboxes/{id}/swerex`.
pub fn routes() -> Router<Arc<App>> {
    let json_routes = Router::new()
        .route("/create_session", post(session::create))
        .route("/run_in_session", post(session::run))
        .route("/close_session", post(session::close))
        .route("/execute", post(execute))
        .route("/read_file", post(read_file))
        .route("/write_file", post(write_file))
        .route("/close", post(session::close_all))
        .route_layer(middleware::from_fn(request_id_layer));
    Router::new()
        .route("/is_alive", get(is_alive))
        .route("/", get(root))
        .route(
            "/upload",
            post(upload::upload).layer(DefaultBodyLimit::disable()),
        )
        .merge(json_routes)
}

/// The header under which `X-API-Key` authenticates these routes (the node's API key).
pub const API_KEY_HEADER: &str = "x-api-key";

/// True for a path served by this module: the only routes that take `X-API-Key`.
pub fn is_swerex_path(path: &str) -> bool {
    path.strip_prefix("/v1/sandboxes/")
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(_, tail)| tail == "swerex" || tail.starts_with("swerex/"))
}

/// A failure on a SWE-ReX route.
#[derive(Debug, thiserror::Error)]
pub enum RexError {
    /// One SWE-ReX's server raises as an exception: 511, re-raised by its client as `class_path`.
    #[error("{class_path}: {message}")]
    Exception {
        class_path: &'static str,
        message: String,
        extra_info: Value,
    },
    /// An HTTP error (bad request, no such sandbox, wrong state, dependency down).
    #[error(transparent)]
    Api(#[from] ApiError),
}

pub type RexResult<T> = Result<T, RexError>;

impl RexError {
    pub fn exception(class_path: &'static str, message: impl Into<String>) -> Self {
        RexError::Exception {
            class_path,
            message: message.into(),
            extra_info: json!({}),
        }
    }
}

impl IntoResponse for RexError {
    fn into_response(self) -> Response {
        match self {
            RexError::Exception {
                class_path,
                message,
                extra_info,
            } => {
                let body = json!({"swerexception": {
                    "message": message,
                    "class_path": class_path,
                    "traceback": "",
                    "extra_info": extra_info,
                }});
                let status = StatusCode::from_u16(511).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                (status, Json(body)).into_response()
            }
            RexError::Api(e) => {
                let mut body = serde_json::to_value(e.body()).unwrap_or_else(|_| json!({}));
                // SWE-ReX's client shows FastAPI's `detail` (is_alive reports it).
                body["detail"] = Value::String(e.message.clone());
                let mut r = (e.status, Json(body)).into_response();
                if let Some(s) = e.retry_after {
                    if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                        r.headers_mut().insert("retry-after", v);
                    }
                }
                r
            }
        }
    }
}

/// The body of a JSON route, shaped as `T` (errors name the field, like every other route).
pub(crate) fn body<T: serde::de::DeserializeOwned>(bytes: &Bytes) -> RexResult<T> {
    let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    Ok(parse_json(bytes)?)
}

async fn root() -> Json<Value> {
    Json(json!({"message": "hello world"}))
}

#[derive(Debug, Serialize)]
struct IsAlive {
    is_alive: bool,
    message: String,
}

/// GET is_alive: a running (or paused: it resumes on the next call) sandbox is alive. Answers
/// without waking it: SWE-ReX polls this with a 0.15 s timeout.
async fn is_alive(State(app): State<Arc<App>>, Path(id): Path<String>) -> RexResult<Json<IsAlive>> {
    let id = sandbox_id(&id)?;
    let rt = app.runtime.clone();
    let info = blocking(move || rt.get(&id).map_err(ApiError::from)).await?;
    let alive = matches!(info.state, SandboxState::Running | SandboxState::Paused);
    Ok(Json(IsAlive {
        is_alive: alive,
        message: if alive {
            String::new()
        } else {
            format!("sandbox {} is {:?}", info.id, info.state)
        },
    }))
}

/// SWE-ReX's `Command`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum CommandLine {
    Line(String),
    Argv(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct Command {
    command: CommandLine,
    #[serde(default)]
    timeout: Option<f64>,
    #[serde(default)]
    shell: bool,
    #[serde(default)]
    check: bool,
    #[serde(default)]
    error_msg: String,
    #[serde(default)]
    env: Option<std::collections::BTreeMap<String, String>>,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    merge_output_streams: bool,
}

#[derive(Debug, Serialize)]
struct CommandResponse {
    stdout: String,
    stderr: String,
    exit_code: Option<i32>,
}

/// Longest timeout one call may ask for (as exec's).
const MAX_TIMEOUT_S: f64 = 24.0 * 3600.0;

/// A SWE-ReX timeout in seconds as milliseconds (None: no timeout).
pub(crate) fn timeout_ms(field: &str, t: Option<f64>) -> RexResult<Option<u64>> {
    match t {
        None => Ok(None),
        Some(t) if !t.is_finite() || t <= 0.0 || t > MAX_TIMEOUT_S => Err(ApiError::invalid(
            field,
            format!("{t}: seconds, above 0 and at most {MAX_TIMEOUT_S}"),
        )
        .into()),
        Some(t) => Ok(Some(((t * 1000.0).ceil() as u64).max(1))),
    }
}

/// POST execute: a command as `subprocess.run` would run it, through exec.
async fn execute(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> RexResult<Json<CommandResponse>> {
    let id = sandbox_id(&id)?;
    let c: Command = body(&bytes)?;
    let shown = match &c.command {
        CommandLine::Line(s) => py_repr(s),
        CommandLine::Argv(a) => format!(
            "[{}]",
            a.iter().map(|s| py_repr(s)).collect::<Vec<_>>().join(", ")
        ),
    };
    // subprocess.run: with shell, argv[0] is the script and the rest its $0, $1...; without, a
    // string is the program's name.
    let mut argv = match (c.command, c.shell) {
        (CommandLine::Line(s), true) => vec!["/bin/sh".into(), "-c".into(), s],
        (CommandLine::Argv(a), true) if !a.is_empty() => {
            let mut v = vec!["/bin/sh".to_string(), "-c".to_string()];
            v.extend(a);
            v
        }
        (CommandLine::Line(s), false) => vec![s],
        (CommandLine::Argv(a), _) => a,
    };
    if argv.is_empty() || argv[0].is_empty() {
        return Err(ApiError::invalid("command", "is empty").into());
    }
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::invalid("command", "may not contain NUL").into());
    }
    if c.merge_output_streams {
        let mut v = vec![
            "/bin/sh".to_string(),
            "-c".into(),
            "exec \"$@\" 2>&1".into(),
            "sh".into(),
        ];
        v.append(&mut argv);
        argv = v;
    }
    if let Some(cwd) = &c.cwd {
        if !cwd.starts_with('/') {
            return Err(ApiError::invalid("cwd", format!("{cwd:?} is not absolute")).into());
        }
    }
    let env = c.env.unwrap_or_default();
    if let Some(k) = env.keys().find(|k| k.is_empty() || k.contains(['=', '\0'])) {
        return Err(
            ApiError::invalid(&format!("env.{k}"), "names are non-empty, without '='").into(),
        );
    }
    let timeout = timeout_ms("timeout", c.timeout)?;
    let req = ExecRequest {
        argv,
        env,
        cwd: c.cwd,
        timeout_ms: timeout,
        ..Default::default()
    };
    let rt = awake(&app, &id).await?;
    let r = blocking(move || rt.exec(&id, req).map_err(ApiError::from)).await?;
    if r.timed_out {
        return Err(RexError::exception(
            "swerex.exceptions.CommandTimeoutError",
            format!(
                "Timeout ({}s) exceeded while running command",
                c.timeout.unwrap_or_default()
            ),
        ));
    }
    let out = CommandResponse {
        stdout: backslashreplace(&r.stdout),
        stderr: if c.merge_output_streams {
            String::new()
        } else {
            backslashreplace(&r.stderr)
        },
        // subprocess: killed by signal N is -N.
        exit_code: r.exit_code.or(r.signal.map(|s| -s)),
    };
    if c.check && out.exit_code != Some(0) {
        let mut msg = format!(
            "Command {shown} failed with exit code {}. Stdout:\n{}\nStderr:\n{}",
            out.exit_code.map_or("None".into(), |c| c.to_string()),
            py_repr(&out.stdout),
            py_repr(&out.stderr)
        );
        if !c.error_msg.is_empty() {
            msg = format!("{}: {msg}", c.error_msg);
        }
        return Err(RexError::exception(
            "swerex.exceptions.NonZeroExitCodeError",
            msg,
        ));
    }
    Ok(Json(out))
}

#[derive(Debug, Deserialize)]
struct ReadFileRequest {
    path: String,
    #[serde(default)]
    encoding: Option<String>,
    #[serde(default)]
    errors: Option<String>,
}

/// The most read_file returns (its content travels inside one JSON answer).
const MAX_READ: u64 = 32 << 20;

/// A path as SWE-ReX's server would resolve it (relative to its cwd, `/`).
pub(crate) fn rex_path(field: &str, p: &str) -> RexResult<String> {
    if p.is_empty() || p.contains('\0') {
        return Err(ApiError::invalid(field, "empty or contains NUL").into());
    }
    Ok(if p.starts_with('/') {
        p.to_string()
    } else {
        format!("/{p}")
    })
}

/// A runtime error of a file call as the Python exception `Path.read_text`/`write_text` raises.
pub(crate) fn file_error(path: &str, e: grove_runtime::Error) -> RexError {
    use grove_runtime::Error as E;
    let p = py_repr(path);
    match &e {
        E::FileNotFound { .. } => RexError::exception(
            "builtins.FileNotFoundError",
            format!("[Errno 2] No such file or directory: {p}"),
        ),
        E::InvalidSpec { reason, .. } if reason.contains("is a directory") => RexError::exception(
            "builtins.IsADirectoryError",
            format!("[Errno 21] Is a directory: {p}"),
        ),
        E::InvalidSpec { reason, .. } if reason.contains("not a regular file") => {
            RexError::exception("builtins.OSError", format!("{p} is not a regular file"))
        }
        E::PathOutsideSandbox { .. } => RexError::exception(
            "builtins.PermissionError",
            format!("[Errno 13] Permission denied: {p} (outside the sandbox)"),
        ),
        _ => RexError::Api(ApiError::from(e)),
    }
}

/// POST read_file.
async fn read_file(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> RexResult<Json<Value>> {
    use std::io::Read as _;
    let id = sandbox_id(&id)?;
    let req: ReadFileRequest = body(&bytes)?;
    let path = rex_path("path", &req.path)?;
    let enc = Encoding::parse(req.encoding.as_deref())?;
    let errors = Errors::parse(req.errors.as_deref())?;
    let rt = awake(&app, &id).await?;
    let p = path.clone();
    let data = off_thread(move || {
        let (f, _) = rt.open_file(&id, &p).map_err(|e| file_error(&p, e))?;
        let mut buf = Vec::new();
        f.take(MAX_READ + 1)
            .read_to_end(&mut buf)
            .map_err(|e| ApiError::internal(format!("read {p:?}: {e}")))?;
        Ok(buf)
    })
    .await?;
    if data.len() as u64 > MAX_READ {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "file_too_large",
            format!("{path:?} is over {MAX_READ} bytes: download it with GET /files"),
        )
        .with_field("path")
        .into());
    }
    let content = enc.decode(&data, errors, &path)?;
    Ok(Json(json!({ "content": content })))
}

/// Runs blocking runtime work off the async threads (as [`blocking`], for SWE-ReX's errors).
pub(crate) async fn off_thread<T: Send + 'static>(
    f: impl FnOnce() -> RexResult<T> + Send + 'static,
) -> RexResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("worker task failed: {e}")))?
}

#[derive(Debug, Deserialize)]
struct WriteFileRequest {
    content: String,
    path: String,
}

/// POST write_file: parents made, the file replaced (`Path.write_text`).
async fn write_file(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> RexResult<Json<Value>> {
    let id = sandbox_id(&id)?;
    let req: WriteFileRequest = body(&bytes)?;
    let path = rex_path("path", &req.path)?;
    let rt = awake(&app, &id).await?;
    let p = path.clone();
    off_thread(move || {
        rt.write_file(&id, &p, req.content.as_bytes(), None)
            .map_err(|e| file_error(&p, e))
    })
    .await?;
    Ok(Json(json!({})))
}

#[derive(Debug, Clone, Copy)]
enum Encoding {
    Utf8,
    Latin1,
    Ascii,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Errors {
    Strict,
    Replace,
    Ignore,
    BackslashReplace,
}

impl Encoding {
    fn parse(e: Option<&str>) -> RexResult<Encoding> {
        let norm = e.map(|e| e.to_ascii_lowercase().replace('_', "-"));
        Ok(match norm.as_deref() {
            None | Some("utf-8") | Some("utf8") => Encoding::Utf8,
            Some("latin-1") | Some("latin1") | Some("iso-8859-1") => Encoding::Latin1,
            Some("ascii") | Some("us-ascii") => Encoding::Ascii,
            Some(other) => {
                return Err(RexError::exception(
                    "builtins.LookupError",
                    format!("unknown encoding: {other} (Grove reads utf-8, latin-1 and ascii)"),
                ))
            }
        })
    }

    fn decode(self, data: &[u8], errors: Errors, path: &str) -> RexResult<String> {
        let bad = |at: usize| {
            RexError::exception(
                "builtins.UnicodeDecodeError",
                format!(
                    "{path:?}: byte 0x{:02x} in position {at} cannot be decoded",
                    data[at]
                ),
            )
        };
        match self {
            Encoding::Latin1 => Ok(data.iter().map(|&b| b as char).collect()),
            Encoding::Ascii => {
                let mut s = String::with_capacity(data.len());
                for (i, &b) in data.iter().enumerate() {
                    if b.is_ascii() {
                        s.push(b as char);
                    } else {
                        match errors {
                            Errors::Strict => return Err(bad(i)),
                            Errors::Replace => s.push('\u{fffd}'),
                            Errors::Ignore => {}
                            Errors::BackslashReplace => s.push_str(&format!("\\x{b:02x}")),
                        }
                    }
                }
                Ok(s)
            }
            Encoding::Utf8 => match std::str::from_utf8(data) {
                Ok(s) => Ok(s.to_string()),
                Err(e) if errors == Errors::Strict => Err(bad(e.valid_up_to())),
                Err(_) => Ok(lossy(data, errors)),
            },
        }
    }
}

impl Errors {
    fn parse(e: Option<&str>) -> RexResult<Errors> {
        Ok(match e {
            None | Some("strict") => Errors::Strict,
            Some("replace") => Errors::Replace,
            Some("ignore") => Errors::Ignore,
            Some("backslashreplace") => Errors::BackslashReplace,
            Some(other) => {
                return Err(RexError::exception(
                    "builtins.LookupError",
                    format!("unknown error handler name {other:?}"),
                ))
            }
        })
    }
}

/// UTF-8 with each invalid byte handled as Python's `errors=` would.
fn lossy(data: &[u8], errors: Errors) -> String {
    let mut out = String::with_capacity(data.len());
    for chunk in data.utf8_chunks() {
        out.push_str(chunk.valid());
        for &b in chunk.invalid() {
            match errors {
                Errors::Replace | Errors::Strict => out.push('\u{fffd}'),
                Errors::Ignore => {}
                Errors::BackslashReplace => out.push_str(&format!("\\x{b:02x}")),
            }
        }
    }
    out
}

/// Output as SWE-ReX decodes it (`errors="backslashreplace"`).
pub(crate) fn backslashreplace(data: &[u8]) -> String {
    lossy(data, Errors::BackslashReplace)
}

/// A string as Python's `repr` shows it (in SWE-ReX's error messages).
pub(crate) fn py_repr(s: &str) -> String {
    let q = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(q);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == q => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(q);
    out
}

// --- X-Request-ID ---------------------------------------------------------------------------

/// Answers kept for retries (node-wide, oldest dropped first) and for how long.
const KEEP_ANSWERS: usize = 1024;
const KEEP_FOR: Duration = Duration::from_secs(600);
const MAX_ANSWER: usize = 64 << 20;

struct Answer {
    fingerprint: [u8; 32],
    at: Instant,
    slot: Arc<tokio::sync::Mutex<Option<(StatusCode, Bytes)>>>,
}

#[derive(Default)]
struct Answers {
    map: HashMap<String, Answer>,
    order: VecDeque<String>,
}

static ANSWERS: std::sync::LazyLock<Mutex<Answers>> =
    std::sync::LazyLock::new(|| Mutex::new(Answers::default()));

/// SWE-ReX's client sends every call with an `X-Request-ID` and retries with the same one: the
/// first answer to an id (for this sandbox, route and body) is replayed, and a retry that comes
/// while the first attempt still runs waits for it instead of running the command twice. In
/// memory only, as SWE-ReX's own server: a groved restart ends the sandbox's sessions anyway.
async fn request_id_layer(req: Request, next: Next) -> Response {
    let Some(rid) = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 255)
        .map(str::to_string)
    else {
        return next.run(req).await;
    };
    let (parts, body) = req.into_parts();
    let bytes = match to_bytes(body, crate::app::MAX_JSON_BODY).await {
        Ok(b) => b,
        Err(_) => return RexError::Api(ApiError::body_too_large()).into_response(),
    };
    let mut h = Sha256::new();
    h.update(parts.uri.path().as_bytes());
    h.update([0]);
    h.update(&bytes);
    let fingerprint: [u8; 32] = h.finalize().into();
    let key = format!("{}\0{rid}", parts.uri.path());
    let slot = {
        let mut a = ANSWERS.lock();
        let now = Instant::now();
        let stale = a
            .map
            .get(&key)
            .is_some_and(|e| now.duration_since(e.at) > KEEP_FOR);
        if stale {
            a.map.remove(&key);
        }
        match a.map.get(&key) {
            Some(e) if e.fingerprint != fingerprint => {
                return RexError::Api(
                    ApiError::new(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "request_id_reused",
                        "this X-Request-ID was first used for a different request",
                    )
                    .with_field("X-Request-ID"),
                )
                .into_response()
            }
            Some(e) => e.slot.clone(),
            None => {
                while a.order.len() >= KEEP_ANSWERS {
                    if let Some(old) = a.order.pop_front() {
                        a.map.remove(&old);
                    }
                }
                let slot = Arc::new(tokio::sync::Mutex::new(None));
                a.map.insert(
                    key.clone(),
                    Answer {
                        fingerprint,
                        at: now,
                        slot: slot.clone(),
                    },
                );
                a.order.push_back(key.clone());
                slot
            }
        }
    };
    let mut slot = slot.lock().await;
    if let Some((status, body)) = slot.as_ref() {
        let mut r = (*status, body.clone()).into_response();
        r.headers_mut()
            .insert("content-type", HeaderValue::from_static("application/json"));
        r.headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
        return r;
    }
    let resp = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    let (rparts, rbody) = resp.into_parts();
    let body = match to_bytes(rbody, MAX_ANSWER).await {
        Ok(b) => b,
        Err(e) => {
            return RexError::Api(ApiError::internal(format!("buffering the answer: {e}")))
                .into_response()
        }
    };
    let status = rparts.status;
    // An answer that invites a retry (429, 503, a 5xx other than SWE-ReX's 511) is not kept.
    let retryable = status == StatusCode::TOO_MANY_REQUESTS
        || (status.is_server_error() && status.as_u16() != 511);
    if !retryable {
        *slot = Some((status, body.clone()));
    }
    Response::from_parts(rparts, Body::from(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swerex_paths() {
        assert!(is_swerex_path(
            "/v1/sandboxes/sb-0123456789ab/swerex/is_alive"
        ));
        assert!(is_swerex_path("/v1/sandboxes/sb-0123456789ab/swerex"));
        assert!(!is_swerex_path("/v1/sandboxes/sb-0123456789ab/exec"));
        assert!(!is_swerex_path("/v1/sandboxes/sb-0123456789ab/x/swerex"));
        assert!(!is_swerex_path("/v1/snapshots/swerex"));
    }

    #[test]
    fn python_like_decoding_and_repr() {
        assert_eq!(backslashreplace(b"a\xffb"), "a\\xffb");
        assert_eq!(lossy(b"a\xffb", Errors::Ignore), "ab");
        assert_eq!(py_repr("it's\n"), "\"it's\\n\"");
        assert_eq!(py_repr("a'\""), "'a\\'\"'");
        assert!(Encoding::Utf8
            .decode(b"\xff", Errors::Strict, "/x")
            .is_err());
        assert_eq!(
            Encoding::Latin1
                .decode(b"\xe9", Errors::Strict, "/x")
                .unwrap(),
            "é"
        );
    }

    #[test]
    fn timeouts_are_bounded() {
        assert_eq!(timeout_ms("t", Some(0.0015)).unwrap(), Some(2));
        assert!(timeout_ms("t", Some(-1.0)).is_err());
        assert!(timeout_ms("t", Some(f64::NAN)).is_err());
        assert_eq!(timeout_ms("t", None).unwrap(), None);
    }
}
