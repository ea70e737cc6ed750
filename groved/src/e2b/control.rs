//! E2B's REST control plane (the shapes the SDK's generated client expects), onto groved's own
//! lifecycle: a template is a Grove image (`base`: the node's base image) or a Grove snapshot
//! (what `create_snapshot` made), metadata are labels, `timeout` is the time to live, pause is
//! Grove's pause to the store, connect resumes, fork is Grove's snapshot + fork.

use crate::events::now_ms;
use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use grove_runtime::{SandboxId, SandboxInfo, SandboxState};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use super::auth::{self, SECURE_LABEL};
use super::error::{E2bError, E2bResult};
use crate::api_shapes::{CreateSandboxRequest, ForkRequest, SnapshotRequest};
use crate::app::{blocking, App};

/// Labels this endpoint keeps on its sandboxes (E2B metadata may not use the prefix).
pub const LABEL_PREFIX: &str = "e2b.";
const TEMPLATE_LABEL: &str = "e2b.template";
const TIMEOUT_LABEL: &str = "e2b.timeout";
const AUTO_PAUSE_LABEL: &str = "e2b.auto-pause";
/// E2B's default sandbox timeout, seconds.
pub const DEFAULT_TIMEOUT: u64 = 300;
/// The image E2B's default template `base` maps to when the node has no image called `base`.
pub const BASE_IMAGE: &str = "debian12";
/// Most sandboxes one fork request makes (E2B's SDK allows up to 100).
const MAX_FORKS: u32 = 100;

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/sandboxes", post(create).get(list_v1))
        .route("/v2/sandboxes", post(create).get(list_v2))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(connect))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/snapshots", post(snapshot))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/snapshots", get(list_snapshots))
        .route("/templates/{id}", delete(delete_snapshot))
        .fallback(|| async { E2bError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async {
            E2bError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        })
        .layer(middleware::from_fn_with_state(app.clone(), authenticate))
        .with_state(app)
}

async fn authenticate(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    match auth::control(&app, req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

/// A JSON body, its problems reported as E2B's 400 naming the field. An empty body is `{}`.
fn body<T: DeserializeOwned>(b: &Bytes) -> E2bResult<T> {
    let b: &[u8] = if b.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        b
    };
    let de = &mut serde_json::Deserializer::from_slice(b);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." { "body".into() } else { path };
        E2bError::invalid(&field, e.inner())
    })
}

/// E2B sandbox ids are Grove's. An id that cannot be one names no sandbox (404).
fn sandbox_id(s: &str) -> E2bResult<SandboxId> {
    s.parse()
        .map_err(|_| E2bError::not_found(format!("sandbox {s:?} not found")))
}

async fn info_of(app: &Arc<App>, id: &SandboxId) -> E2bResult<SandboxInfo> {
    let (rt, id) = (app.runtime.clone(), id.clone());
    let shown = id.to_string();
    let got = blocking(move || Ok(rt.get(&id).ok())).await?;
    match got {
        Some(i) if matches!(i.state, SandboxState::Running | SandboxState::Paused) => Ok(i),
        _ => Err(E2bError::not_found(format!("sandbox {shown} not found"))),
    }
}

fn timeout_field(v: Option<i64>, field: &str) -> E2bResult<Option<u64>> {
    match v {
        None => Ok(None),
        Some(t) if t < 0 => Err(E2bError::invalid(field, "must not be negative")),
        Some(t) => {
            let t = t as u64;
            grove_runtime::check_ttl(field, Some(t))
                .map_err(|e| E2bError::invalid(field, crate::error::ApiError::from(e).message))?;
            Ok(Some(t))
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<i64>,
    #[serde(default)]
    auto_pause: bool,
    metadata: Option<BTreeMap<String, String>>,
    env_vars: Option<BTreeMap<String, String>>,
    /// Accepted for older SDKs; every sandbox made here has an access token.
    #[allow(dead_code)]
    secure: Option<bool>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    network: Option<Value>,
    mcp: Option<Value>,
    volume_mounts: Option<Value>,
}

fn metadata_labels(m: &BTreeMap<String, String>) -> E2bResult<BTreeMap<String, String>> {
    for k in m.keys() {
        if k.starts_with(LABEL_PREFIX) || k.starts_with("grove.") {
            return Err(E2bError::invalid(
                &format!("metadata.{k}"),
                format!("keys starting with {LABEL_PREFIX:?} or \"grove.\" are reserved"),
            ));
        }
    }
    crate::api::check_labels("metadata", m).map_err(E2bError::from)?;
    Ok(m.clone())
}

/// The metadata of a sandbox: its labels less the ones groved and this endpoint keep.
fn metadata_of(i: &SandboxInfo) -> BTreeMap<String, String> {
    i.spec
        .labels
        .iter()
        .filter(|(k, _)| !k.starts_with(LABEL_PREFIX) && !k.starts_with("grove."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn template_of(i: &SandboxInfo) -> String {
    i.spec
        .labels
        .get(TEMPLATE_LABEL)
        .cloned()
        .unwrap_or_else(|| i.spec.image.clone())
}

/// What E2B calls a sandbox in create/connect answers.
fn created(app: &App, i: &SandboxInfo) -> Value {
    json!({
        "templateID": template_of(i),
        "sandboxID": i.id.to_string(),
        "clientID": "grove",
        "envdVersion": super::ENVD_VERSION,
        "envdAccessToken": auth::token_of(app, i),
    })
}

fn rfc3339(ms: u64) -> String {
    let secs = (ms / 1000) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = crate::events::civil_date(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

fn state_name(s: SandboxState) -> &'static str {
    match s {
        SandboxState::Paused => "paused",
        _ => "running",
    }
}

/// E2B's ListedSandbox / SandboxDetail.
fn listed(i: &SandboxInfo) -> Value {
    let limits = i.spec.limits.unwrap_or_default();
    let end = i
        .expires_at_ms
        .unwrap_or(i.created_at_ms + 86_400_000 * 365);
    json!({
        "templateID": template_of(i),
        "sandboxID": i.id.to_string(),
        "clientID": "grove",
        "startedAt": rfc3339(i.created_at_ms),
        "endAt": rfc3339(end),
        "envdVersion": super::ENVD_VERSION,
        "cpuCount": (limits.cpu_millis / 1000).max(1),
        "memoryMB": limits.memory_mb,
        "diskSizeMB": limits.disk_mb,
        "state": state_name(i.state),
        "metadata": metadata_of(i),
    })
}

async fn create(State(app): State<Arc<App>>, raw: Bytes) -> E2bResult<Response> {
    let req: NewSandbox = body(&raw)?;
    if req.template_id.is_empty() {
        return Err(E2bError::invalid("templateID", "must not be empty"));
    }
    let unsupported = [
        (
            "network",
            req.network.as_ref().is_some_and(|v| !v.is_null()),
        ),
        ("mcp", req.mcp.as_ref().is_some_and(|v| !v.is_null())),
        (
            "volumeMounts",
            req.volume_mounts
                .as_ref()
                .is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty())),
        ),
    ];
    if let Some((field, _)) = unsupported.iter().find(|(_, given)| *given) {
        return Err(E2bError::invalid(field, "is not supported by this node"));
    }
    let timeout = timeout_field(req.timeout, "timeout")?.unwrap_or(DEFAULT_TIMEOUT);
    let mut labels = metadata_labels(&req.metadata.clone().unwrap_or_default())?;
    labels.insert(SECURE_LABEL.into(), "true".into());
    labels.insert(TEMPLATE_LABEL.into(), req.template_id.clone());
    labels.insert(TIMEOUT_LABEL.into(), timeout.to_string());
    if req.auto_pause {
        labels.insert(AUTO_PAUSE_LABEL.into(), "true".into());
    }
    let envs = req.env_vars.clone().unwrap_or_default();
    let info = if let Some(snap) = snapshot_named(&app, &req.template_id).await? {
        if !envs.is_empty() {
            return Err(E2bError::invalid(
                "envVars",
                "a sandbox made from a snapshot keeps the snapshot's environment",
            ));
        }
        let fork = ForkRequest {
            count: 1,
            labels,
            ttl_secs: Some(timeout),
            hostname_prefix: None,
            queue_timeout_ms: None,
        };
        let snaps = app.snapshots().map_err(E2bError::from)?;
        let mut made =
            blocking(move || Ok(crate::error::api_each(snaps.fork(&snap, &fork)?))).await?;
        made.pop()
            .unwrap_or_else(|| Err(crate::error::ApiError::internal("fork made nothing")))?
    } else {
        let image = image_for(&app, &req.template_id).await?;
        if req.allow_internet_access == Some(true) {
            return Err(E2bError::invalid(
                "allow_internet_access",
                "sandboxes here are offline unless made with Grove's own API and an egress allowlist",
            ));
        }
        let creq = CreateSandboxRequest {
            image: Some(image),
            env: envs,
            ttl_secs: Some(timeout),
            labels,
            ..Default::default()
        };
        let spec = crate::api::build_spec(&creq, &app.config.defaults).map_err(|e| {
            let mut e = E2bError::from(e);
            e.message = e.message.replace("env.", "envVars.");
            e
        })?;
        let rt = app.runtime.clone();
        blocking(move || rt.create(spec).map_err(Into::into)).await?
    };
    Ok((StatusCode::CREATED, Json(created(&app, &info))).into_response())
}

/// The Grove image a template names; `base` is the node's base image.
async fn image_for(app: &Arc<App>, template: &str) -> E2bResult<String> {
    let images = app.images.clone();
    let names: Vec<String> = blocking(move || Ok(images.list()?))
        .await?
        .into_iter()
        .map(|i| i.name)
        .collect();
    if names.iter().any(|n| n == template) {
        return Ok(template.to_string());
    }
    if template == "base" && names.iter().any(|n| n == BASE_IMAGE) {
        return Ok(BASE_IMAGE.to_string());
    }
    Err(E2bError::not_found(format!(
        "template '{template}' not found"
    )))
}

/// The snapshot a template names, when it names one.
async fn snapshot_named(app: &Arc<App>, template: &str) -> E2bResult<Option<String>> {
    let Some(snaps) = app.snapshots.clone() else {
        return Ok(None);
    };
    if crate::backend::check_name("templateID", template).is_err() {
        return Ok(None);
    }
    let name = template.to_string();
    Ok(blocking(move || Ok(snaps.get(&name).ok().map(|s| s.name))).await?)
}

/// Query of E2B's list: `metadata` (an urlencoded `k=v&...`, each part percent-encoded once
/// more), `state` (comma-separated), `limit`, `nextToken`.
struct ListQuery {
    metadata: Vec<(String, String)>,
    states: Vec<SandboxState>,
    limit: usize,
    after: Option<String>,
    desc: bool,
}

fn list_query(q: Option<&str>, v2: bool) -> E2bResult<ListQuery> {
    let pairs = crate::request_parse::query_pairs(q).map_err(E2bError::from)?;
    let mut out = ListQuery {
        metadata: Vec::new(),
        states: if v2 {
            vec![SandboxState::Running, SandboxState::Paused]
        } else {
            vec![SandboxState::Running]
        },
        limit: 100,
        after: None,
        desc: false,
    };
    for (k, v) in &pairs {
        match k.as_str() {
            "metadata" | "query" => {
                let inner = crate::request_parse::query_pairs(Some(v)).map_err(|_| {
                    E2bError::invalid("metadata", format!("{v:?} is not k=v&k2=v2"))
                })?;
                for (mk, mv) in inner {
                    let dec = |s: &str| {
                        crate::request_parse::query_pairs(Some(&format!("x={s}")))
                            .ok()
                            .and_then(|p| p.into_iter().next().map(|(_, v)| v))
                            .unwrap_or_else(|| s.to_string())
                    };
                    out.metadata.push((dec(&mk), dec(&mv)));
                }
            }
            "state" => {
                out.states.clear();
                for s in v.split(',').filter(|s| !s.is_empty()) {
                    out.states.push(match s {
                        "running" => SandboxState::Running,
                        "paused" => SandboxState::Paused,
                        other => {
                            return Err(E2bError::invalid(
                                "state",
                                format!("{other:?} is not running or paused"),
                            ))
                        }
                    });
                }
            }
            "limit" => {
                out.limit = match v.parse::<usize>() {
                    Ok(n) if (1..=1000).contains(&n) => n,
                    _ => {
                        return Err(E2bError::invalid(
                            "limit",
                            format!("{v:?}: must be 1..=1000"),
                        ))
                    }
                }
            }
            "nextToken" => {
                if v.parse::<SandboxId>().is_err() {
                    return Err(E2bError::invalid(
                        "nextToken",
                        format!("{v:?} is not a token of this node"),
                    ));
                }
                out.after = Some(v.clone());
            }
            "order" => {
                out.desc = match v.as_str() {
                    "asc" => false,
                    "desc" => true,
                    _ => return Err(E2bError::invalid("order", "asc or desc")),
                }
            }
            // Filters this node has nothing to filter by: every sandbox matches.
            "startedAfter" | "template" => {}
            other => {
                return Err(E2bError::invalid(
                    other,
                    format!("unknown query parameter {other:?}"),
                ))
            }
        }
    }
    Ok(out)
}

async fn list(app: Arc<App>, q: ListQuery) -> E2bResult<Response> {
    let rt = app.runtime.clone();
    let mut all = blocking(move || Ok(rt.list())).await?;
    // Sorted by start (then id), as E2B orders; the token is the last id shown.
    all.sort_by(|a, b| (a.created_at_ms, a.id.as_str()).cmp(&(b.created_at_ms, b.id.as_str())));
    if q.desc {
        all.reverse();
    }
    let start = match &q.after {
        Some(t) => all
            .iter()
            .position(|i| i.id.as_str() == t)
            .map_or(all.len(), |p| p + 1),
        None => 0,
    };
    let mut page: Vec<&SandboxInfo> = all[start..]
        .iter()
        .filter(|i| {
            q.states.contains(&i.state)
                && q.metadata
                    .iter()
                    .all(|(k, v)| metadata_of(i).get(k) == Some(v))
        })
        .take(q.limit + 1)
        .collect();
    let next = if page.len() > q.limit {
        page.truncate(q.limit);
        page.last().map(|i| i.id.to_string())
    } else {
        None
    };
    let items: Vec<Value> = page.into_iter().map(listed).collect();
    let mut r = Json(items).into_response();
    if let Some(n) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        r.headers_mut().insert("x-next-token", n);
    }
    Ok(r)
}

async fn list_v1(State(app): State<Arc<App>>, RawQuery(q): RawQuery) -> E2bResult<Response> {
    list(app, list_query(q.as_deref(), false)?).await
}

async fn list_v2(State(app): State<Arc<App>>, RawQuery(q): RawQuery) -> E2bResult<Response> {
    list(app, list_query(q.as_deref(), true)?).await
}

async fn detail(State(app): State<Arc<App>>, Path(id): Path<String>) -> E2bResult<Json<Value>> {
    let id = sandbox_id(&id)?;
    let i = info_of(&app, &id).await?;
    let mut v = listed(&i);
    v["envdAccessToken"] = json!(auth::token_of(&app, &i));
    Ok(Json(v))
}

async fn kill(State(app): State<Arc<App>>, Path(id): Path<String>) -> E2bResult<StatusCode> {
    let id = sandbox_id(&id)?;
    info_of(&app, &id).await?;
    let rt = app.runtime.clone();
    blocking(move || rt.destroy(&id).map_err(Into::into)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct TimeoutBody {
    timeout: i64,
}

async fn set_timeout(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> E2bResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let t: TimeoutBody = body(&raw)?;
    let ttl = timeout_field(Some(t.timeout), "timeout")?;
    let i = info_of(&app, &id).await?;
    if i.state == SandboxState::Paused {
        // A paused sandbox keeps no deadline; the new timeout counts from its resume.
        return Ok(StatusCode::NO_CONTENT);
    }
    let rt = app.runtime.clone();
    blocking(move || rt.set_ttl(&id, ttl).map_err(Into::into)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct RefreshBody {
    duration: Option<i64>,
}

/// Keep-alive: the deadline moves to `duration` (default: the sandbox's timeout) from now,
/// never closer than it was.
async fn refresh(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> E2bResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let r: RefreshBody = body(&raw)?;
    let i = info_of(&app, &id).await?;
    let secs = timeout_field(r.duration, "duration")?.unwrap_or_else(|| stored_timeout(&i));
    let now = now_ms();
    if i.expires_at_ms.is_some_and(|e| e < now + secs * 1000) {
        let rt = app.runtime.clone();
        blocking(move || rt.set_ttl(&id, Some(secs)).map_err(Into::into)).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

fn stored_timeout(i: &SandboxInfo) -> u64 {
    i.spec
        .labels
        .get(TIMEOUT_LABEL)
        .and_then(|t| t.parse().ok())
        .unwrap_or(DEFAULT_TIMEOUT)
}

/// Pause to the store: the processes stop, the memory is kept in the store, the deadline goes
/// (a paused E2B sandbox does not time out). 409 when already paused.
async fn pause(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> E2bResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let _: Value = body(&raw)?;
    let i = info_of(&app, &id).await?;
    if i.state == SandboxState::Paused {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ));
    }
    pause_to_store(&app, &i).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Pauses a running sandbox to the store and drops its deadline; a failure leaves it as it was,
/// its deadline included.
async fn pause_to_store(app: &Arc<App>, i: &SandboxInfo) -> E2bResult<()> {
    // The deadline goes first: a sandbox paused to the store takes no more changes.
    let rt = app.runtime.clone();
    let id = i.id.clone();
    blocking(move || rt.set_ttl(&id, None).map_err(Into::into)).await?;
    if let Err(e) = crate::api::pause::pause_any(app, &i.id).await {
        let left = i
            .expires_at_ms
            .map(|t| (t.saturating_sub(now_ms()) / 1000).max(1));
        let rt = app.runtime.clone();
        let id = i.id.clone();
        let _ = blocking(move || rt.set_ttl(&id, left).map_err(Into::into)).await;
        return Err(e.into());
    }
    Ok(())
}

/// E2B's `autoPause` (the SDK's `lifecycle={"on_timeout": "pause"}`): a sandbox made with it is
/// paused to the store when its timeout comes, not killed, and `connect` resumes it. groved's
/// reaper calls this just before it destroys what expired; a sandbox whose pause fails is killed
/// then, as without the option, and the failure logged.
pub async fn pause_due(app: &Arc<App>) {
    let rt = app.runtime.clone();
    let Ok(all) = blocking(move || Ok(rt.list())).await else {
        return;
    };
    let now = now_ms();
    let due = all.into_iter().filter(|i| {
        i.state == SandboxState::Running
            && i.spec.labels.contains_key(AUTO_PAUSE_LABEL)
            && i.expires_at_ms.is_some_and(|t| t <= now)
    });
    for i in due {
        match pause_to_store(app, &i).await {
            Ok(()) => tracing::info!(sandbox = %i.id, "timeout: paused (autoPause)"),
            Err(e) => {
                tracing::warn!(sandbox = %i.id, "timeout: autoPause failed, so it is killed: {}", e.message);
                let rt = app.runtime.clone();
                let id = i.id.clone();
                let _ = blocking(move || rt.expire(&id).map_err(Into::into)).await;
            }
        }
    }
}

#[derive(Deserialize)]
struct ConnectBody {
    timeout: Option<i64>,
}

/// Connect (and the older resume): a paused sandbox is resumed, and the deadline set to
/// `timeout` (default: the sandbox's own) from now; a running one keeps a later deadline.
async fn connect(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> E2bResult<Response> {
    let id = sandbox_id(&id)?;
    let c: ConnectBody = body(&raw)?;
    let given = timeout_field(c.timeout, "timeout")?;
    let i = info_of(&app, &id).await?;
    let secs = given.unwrap_or_else(|| stored_timeout(&i));
    let was_paused = i.state == SandboxState::Paused;
    if was_paused {
        // A sandbox reads paused while its pause still parks it: wait that out, as every other
        // request that needs it running does, rather than answer 409 to the SDK's connect.
        crate::api::pause::awake(&app, &id).await?;
    }
    let keep = !was_paused && i.expires_at_ms.is_some_and(|e| e >= now_ms() + secs * 1000);
    let rt = app.runtime.clone();
    let id2 = id.clone();
    let info = if keep {
        info_of(&app, &id).await?
    } else {
        blocking(move || rt.set_ttl(&id2, Some(secs)).map_err(Into::into)).await?
    };
    let status = if was_paused {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(created(&app, &info))).into_response())
}

#[derive(Deserialize)]
struct ForkBody {
    timeout: Option<i64>,
    count: Option<i64>,
}

/// Fork: a snapshot of the running sandbox (it keeps running), then `count` sandboxes restored
/// from it, each with the source's metadata and an access token of its own.
async fn fork(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> E2bResult<Response> {
    let id = sandbox_id(&id)?;
    let f: ForkBody = body(&raw)?;
    let count = match f.count {
        None => 1,
        Some(n) if (1..=i64::from(MAX_FORKS)).contains(&n) => n as u32,
        Some(n) => {
            return Err(E2bError::invalid(
                "count",
                format!("{n}: must be 1..={MAX_FORKS}"),
            ))
        }
    };
    let given = timeout_field(f.timeout, "timeout")?;
    let i = info_of(&app, &id).await?;
    if i.state == SandboxState::Paused {
        crate::api::pause::awake(&app, &id).await?;
    }
    let snaps = app.snapshots().map_err(E2bError::from)?;
    let secs = given.unwrap_or_else(|| stored_timeout(&i));
    // Each branch's token is its own (a keyed hash of its id): the mark is all it takes.
    let mut labels = BTreeMap::new();
    labels.insert(SECURE_LABEL.to_string(), "true".into());
    labels.insert(TIMEOUT_LABEL.to_string(), secs.to_string());
    let results = blocking(move || {
        let snap = snaps.snapshot(
            &id,
            &SnapshotRequest {
                name: None,
                stop: false,
                durable: false,
                ttl_secs: None,
            },
        )?;
        let req = ForkRequest {
            count,
            labels,
            ttl_secs: Some(secs),
            hostname_prefix: None,
            queue_timeout_ms: None,
        };
        let made = snaps.fork(&snap.name, &req);
        // The snapshot was only the means: the forks hold what they need of it.
        if let Err(e) = snaps.delete(&snap.name) {
            tracing::warn!(snapshot = %snap.name, "removing a fork's snapshot: {}", crate::error::chain(&e));
        }
        Ok(crate::error::api_each(made?))
    })
    .await?;
    let out: Vec<Value> = results
        .into_iter()
        .map(|r| match r {
            Ok(i) => json!({"sandbox": created(&app, &i)}),
            Err(e) => {
                let e = E2bError::from(e);
                json!({"error": {"code": e.status.as_u16(), "message": e.message}})
            }
        })
        .collect();
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

#[derive(Deserialize)]
struct SnapshotBody {
    name: Option<String>,
}

/// A snapshot of the running sandbox; its name is a template new sandboxes are made from.
async fn snapshot(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> E2bResult<Response> {
    let id = sandbox_id(&id)?;
    let s: SnapshotBody = body(&raw)?;
    if let Some(n) = &s.name {
        crate::backend::check_new_snapshot_name("name", n)
            .map_err(|e| E2bError::from(crate::error::ApiError::from(e)))?;
    }
    let i = info_of(&app, &id).await?;
    if i.state == SandboxState::Paused {
        crate::api::pause::awake(&app, &id).await?;
    }
    let snaps = app.snapshots().map_err(E2bError::from)?;
    let snap = blocking(move || {
        Ok(snaps.snapshot(
            &id,
            &SnapshotRequest {
                name: s.name,
                stop: false,
                durable: false,
                ttl_secs: None,
            },
        )?)
    })
    .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"snapshotID": snap.name, "names": [snap.name]})),
    )
        .into_response())
}

async fn list_snapshots(State(app): State<Arc<App>>, RawQuery(q): RawQuery) -> E2bResult<Response> {
    let pairs = crate::request_parse::query_pairs(q.as_deref()).map_err(E2bError::from)?;
    let (mut source, mut name, mut limit, mut after) = (None, None, 100usize, None);
    for (k, v) in pairs {
        match k.as_str() {
            "sandboxID" => source = Some(v),
            "name" => name = Some(v),
            "limit" => {
                limit = match v.parse::<usize>() {
                    Ok(n) if (1..=1000).contains(&n) => n,
                    _ => {
                        return Err(E2bError::invalid(
                            "limit",
                            format!("{v:?}: must be 1..=1000"),
                        ))
                    }
                }
            }
            "nextToken" => after = Some(v),
            other => {
                return Err(E2bError::invalid(
                    other,
                    format!("unknown query parameter {other:?}"),
                ))
            }
        }
    }
    let Some(snaps) = app.snapshots.clone() else {
        return Ok(Json(Vec::<Value>::new()).into_response());
    };
    let mut all = blocking(move || Ok(snaps.list()?)).await?;
    all.sort_by(|a, b| a.name.cmp(&b.name));
    let mut page: Vec<_> = all
        .into_iter()
        .filter(|s| {
            source
                .as_deref()
                .is_none_or(|x| s.source_sandbox.as_deref() == Some(x))
                && name.as_deref().is_none_or(|x| s.name == x)
                && after.as_deref().is_none_or(|a| s.name.as_str() > a)
        })
        .take(limit + 1)
        .collect();
    let next = if page.len() > limit {
        page.truncate(limit);
        page.last().map(|s| s.name.clone())
    } else {
        None
    };
    let items: Vec<Value> = page
        .iter()
        .map(|s| json!({"snapshotID": s.name, "names": [s.name]}))
        .collect();
    let mut r = Json(items).into_response();
    if let Some(n) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        r.headers_mut().insert("x-next-token", n);
    }
    Ok(r)
}

/// E2B deletes a snapshot as a template; templates that are images are not deleted here.
async fn delete_snapshot(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
) -> E2bResult<StatusCode> {
    let Some(snap) = snapshot_named(&app, &name).await? else {
        return Err(E2bError::not_found(format!("snapshot '{name}' not found")));
    };
    let snaps = app.snapshots().map_err(E2bError::from)?;
    blocking(move || Ok(snaps.delete(&snap)?)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// One sample, now: Grove keeps no history of a sandbox's usage.
async fn metrics(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> E2bResult<Json<Vec<Value>>> {
    let id = sandbox_id(&id)?;
    for (k, v) in crate::request_parse::query_pairs(q.as_deref()).map_err(E2bError::from)? {
        match k.as_str() {
            "start" | "end" => {
                v.parse::<i64>()
                    .map_err(|_| E2bError::invalid(&k, format!("{v:?} is not a unix time")))?;
            }
            other => {
                return Err(E2bError::invalid(
                    other,
                    format!("unknown query parameter {other:?}"),
                ))
            }
        }
    }
    let i = info_of(&app, &id).await?;
    if i.state == SandboxState::Paused {
        return Ok(Json(Vec::new()));
    }
    let rt = app.runtime.clone();
    let u = blocking(move || rt.usage(&id).map_err(Into::into)).await?;
    let limits = i.spec.limits.unwrap_or_default();
    let now = now_ms();
    let age_us = now.saturating_sub(i.created_at_ms).max(1) * 1000;
    let cpus = f64::from(limits.cpu_millis) / 1000.0;
    let pct = (u.cpu_usec as f64 / age_us as f64 / cpus.max(0.001) * 100.0).min(100.0);
    Ok(Json(vec![json!({
        "timestamp": rfc3339(now),
        "timestampUnix": now / 1000,
        "cpuCount": (limits.cpu_millis / 1000).max(1),
        "cpuUsedPct": pct,
        "memUsed": u.memory_bytes,
        "memTotal": limits.memory_mb << 20,
        "memCache": 0,
        "diskUsed": u.disk_bytes,
        "diskTotal": limits.disk_mb << 20,
    })]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_renders_civil_time() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn list_query_decodes_the_sdks_metadata_filter() {
        // What the SDK sends for metadata {"a b": "c&d", "k": "v"}.
        let q = list_query(
            Some("metadata=a%252520b%3Dc%252526d%26k%3Dv&state=paused&limit=5"),
            true,
        )
        .unwrap();
        assert_eq!(
            q.metadata,
            vec![
                ("a b".to_string(), "c&d".to_string()),
                ("k".into(), "v".into())
            ]
        );
        assert_eq!(q.states, vec![SandboxState::Paused]);
        assert_eq!(q.limit, 5);
        assert!(list_query(Some("state=gone"), true).is_err());
        assert!(list_query(Some("limit=0"), true).is_err());
    }
}
