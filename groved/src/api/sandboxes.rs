//! Sandbox lifecycle: create (from an image or a snapshot, batches), get, list, delete, ttl, usage.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Extension, Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt as _;
use grove_runtime::{Limits, SandboxInfo, SandboxSpec, SandboxState, Usage};

use super::{sandbox_id, timed};
use crate::api_shapes::{
    idle_from_wire, network_from_wire, ports_from_wire, BatchDeleteRequest, BatchDeleteResponse,
    BatchItem, BatchResponse, CreateSandboxRequest, DeleteResult, ForkRequest, Sandbox,
    SandboxList, TtlRequest,
};
use crate::app::{blocking, App};
use crate::error::{api_each, ApiError, ApiResult};
use crate::idempotency::{self, Tag};
use crate::metrics::Op;
use crate::request_parse::{query_one, query_pairs, ApiJson};

/// Most sandboxes one request may create.
pub const MAX_BATCH: u32 = 1024;
/// Creates of one batch run this many at a time.
const BATCH_PARALLEL: usize = 4;

pub async fn create(
    State(app): State<Arc<App>>,
    tag: Option<Extension<Tag>>,
    ApiJson(mut req): ApiJson<CreateSandboxRequest>,
) -> ApiResult<Response> {
    if let Some(n) = req.count {
        if n == 0 || n > MAX_BATCH {
            return Err(ApiError::invalid(
                "count",
                format!("must be 1..={MAX_BATCH}, got {n}"),
            ));
        }
    }
    // 0: no expiry, even on a node with a default TTL; unset: the node's default.
    // A fork keeps its source's TTL unless given one (0 included: the fork passes it on).
    if req.snapshot.is_none() {
        req.ttl_secs = match req.ttl_secs {
            Some(0) => None,
            None => app.config.default_ttl_secs,
            t => t,
        };
    }
    crate::api_shapes::check_ttl(req.ttl_secs.filter(|t| *t > 0))?;
    crate::api_shapes::check_queue_timeout(req.queue_timeout_ms)?;
    check_labels("labels", &req.labels)?;
    let tag = tag.map(|Extension(Tag(t))| t);
    if let Some(t) = &tag {
        req.labels.insert(idempotency::LABEL.into(), t.clone());
    }
    match (&req.image, &req.snapshot) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "snapshot",
            "give either image or snapshot, not both",
        )),
        (None, None) => Err(ApiError::invalid("image", "give an image or a snapshot")),
        (None, Some(snap)) => from_snapshot(app, snap.clone(), req, tag).await,
        (Some(_), None) => from_image(app, req, tag).await,
    }
}

async fn from_image(
    app: Arc<App>,
    req: CreateSandboxRequest,
    tag: Option<String>,
) -> ApiResult<Response> {
    let mut spec = build_spec(&req, &app.config.defaults)?;
    let configs = app.image_configs.clone();
    let spec =
        blocking(move || configs.apply(&spec.image.clone(), &mut spec).map(|_| spec)).await?;
    let rt = app.runtime.clone();
    let total = blocking(move || Ok(rt.capacity().total)).await?;
    if let Some(l) = &spec.limits {
        fits_node(l, &total)?;
    }
    let made = made_before(&app, tag).await?;
    let Some(count) = req.count else {
        let info = match made.into_iter().next() {
            Some(i) => i,
            None => create_one(&app, spec).await?,
        };
        return Ok((StatusCode::CREATED, Json(Sandbox::from(&info))).into_response());
    };
    let todo = (count as usize).saturating_sub(made.len());
    let mut results: Vec<ApiResult<SandboxInfo>> = made.into_iter().map(Ok).collect();
    results.extend(
        futures::stream::iter(0..todo)
            .map(|_| create_one(&app, spec.clone()))
            .buffered(BATCH_PARALLEL)
            .collect::<Vec<_>>()
            .await,
    );
    batch_response(results)
}

/// What an earlier attempt of this request (same Idempotency-Key, cut off by a crash) made: a
/// retry makes only the rest.
pub(crate) async fn made_before(
    app: &Arc<App>,
    tag: Option<String>,
) -> ApiResult<Vec<SandboxInfo>> {
    let Some(tag) = tag else {
        return Ok(Vec::new());
    };
    let rt = app.runtime.clone();
    blocking(move || Ok(idempotency::made_by(&rt, &tag))).await
}

async fn create_one(app: &Arc<App>, spec: SandboxSpec) -> ApiResult<SandboxInfo> {
    let rt = app.runtime.clone();
    timed(
        app,
        Op::Create,
        blocking(move || rt.create(spec).map_err(ApiError::from)),
    )
    .await
}

async fn from_snapshot(
    app: Arc<App>,
    name: String,
    req: CreateSandboxRequest,
    tag: Option<String>,
) -> ApiResult<Response> {
    let not_for_snapshots = [
        ("limits", req.limits.is_some()),
        ("env", !req.env.is_empty()),
        ("workdir", req.workdir.is_some()),
        ("network", req.network.is_some()),
        ("ports", !req.ports.is_empty()),
        ("job", req.job.is_some()),
        ("priority", req.priority.is_some()),
    ];
    if let Some((field, _)) = not_for_snapshots.iter().find(|(_, given)| *given) {
        return Err(ApiError::invalid(
            field,
            "is fixed by the snapshot (a fork keeps its job); only count, labels, ttl_secs and hostname apply",
        ));
    }
    let snaps = app.snapshots()?;
    let mut fork = ForkRequest {
        count: req.count.unwrap_or(1),
        labels: req.labels.clone(),
        ttl_secs: req.ttl_secs,
        hostname_prefix: req.hostname.clone(),
        queue_timeout_ms: req.queue_timeout_ms,
    };
    let single = req.count.is_none();
    let op = if fork.count == 1 {
        Op::Restore
    } else {
        Op::Fork
    };
    let made = made_before(&app, tag).await?;
    fork.count = fork.count.saturating_sub(made.len() as u32);
    let mut results: Vec<ApiResult<SandboxInfo>> = made.into_iter().map(Ok).collect();
    if fork.count > 0 {
        results.extend(
            timed(
                &app,
                op,
                blocking(move || Ok(api_each(snaps.fork(&name, &fork)?))),
            )
            .await?,
        );
    }
    if single {
        let info = results
            .into_iter()
            .next()
            .unwrap_or_else(|| Err(ApiError::internal("fork returned nothing")))?;
        return Ok((StatusCode::CREATED, Json(Sandbox::from(&info))).into_response());
    }
    batch_response(results)
}

/// 201 with one result per sandbox; when every one failed, the first failure itself (so 429 keeps Retry-After).
pub(crate) fn batch_response(results: Vec<ApiResult<SandboxInfo>>) -> ApiResult<Response> {
    if let Some(Err(first)) = results.first() {
        if results.iter().all(Result::is_err) {
            return Err(first.clone());
        }
    }
    let results = results
        .into_iter()
        .map(|r| match r {
            Ok(i) => BatchItem {
                sandbox: Some(Sandbox::from(&i)),
                error: None,
            },
            Err(e) => BatchItem {
                sandbox: None,
                error: Some(e.body()),
            },
        })
        .collect();
    Ok((StatusCode::CREATED, Json(BatchResponse { results })).into_response())
}

/// The runtime spec for a create request, limits filled from `defaults`.
pub fn build_spec(req: &CreateSandboxRequest, defaults: &Limits) -> ApiResult<SandboxSpec> {
    let network = match &req.network {
        Some(n) => network_from_wire(n).map_err(|(field, why)| ApiError::invalid(&field, why))?,
        None => Default::default(),
    };
    for k in req.env.keys() {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(ApiError::invalid(
                &format!("env.{k}"),
                "names are non-empty, without '=' or NUL",
            ));
        }
    }
    if let Some(w) = &req.workdir {
        if !w.starts_with('/') {
            return Err(ApiError::invalid(
                "workdir",
                format!("{w:?} is not absolute"),
            ));
        }
    }
    if let Some(h) = &req.hostname {
        let ok = !h.is_empty()
            && h.len() <= 63
            && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
        if !ok {
            return Err(ApiError::invalid(
                "hostname",
                format!("{h:?}: 1-63 chars of [A-Za-z0-9-]"),
            ));
        }
    }
    if let Some(job) = &req.job {
        grove_runtime::jobs::check_name(job).map_err(ApiError::from)?;
    }
    for (i, p) in req.ports.iter().enumerate() {
        if p.host_port == 0 || p.sandbox_port == 0 {
            return Err(ApiError::invalid(
                &format!("ports[{i}]"),
                "port 0 is not a port",
            ));
        }
    }
    if req.on_idle.is_some() && req.idle_timeout_secs.is_none() {
        return Err(ApiError::invalid(
            "idle_timeout_secs",
            "on_idle needs idle_timeout_secs",
        ));
    }
    let idle = idle_from_wire(req.idle_timeout_secs, req.on_idle.as_deref())
        .map_err(|(field, why)| ApiError::invalid(field, why))?;
    let mut cap_add = Vec::with_capacity(req.cap_add.len());
    for (i, name) in req.cap_add.iter().enumerate() {
        let cap = grove_runtime::Capability::parse(name).ok_or_else(|| {
            ApiError::invalid(
                &format!("cap_add[{i}]"),
                "only MKNOD may be added; every other capability outside the default set stays dropped",
            )
        })?;
        if !cap_add.contains(&cap) {
            cap_add.push(cap);
        }
    }
    Ok(SandboxSpec {
        image: req.image.clone().unwrap_or_default(),
        limits: Some(req.limits.unwrap_or_default().fill(defaults)),
        env: req.env.clone(),
        workdir: req.workdir.clone(),
        hostname: req.hostname.clone(),
        network,
        ports: ports_from_wire(&req.ports),
        ttl_secs: req.ttl_secs,
        labels: req.labels.clone(),
        idle,
        job: req.job.clone(),
        priority: req.priority.unwrap_or(0),
        queue_timeout_ms: req.queue_timeout_ms,
        cap_add,
        userns: req.userns,
    })
}

/// A limit larger than the whole node can never be met: that is bad input (422), not a full node (429).
fn fits_node(l: &Limits, total: &grove_runtime::Resources) -> ApiResult<()> {
    let checks = [
        (
            "limits.cpu_millis",
            u64::from(l.cpu_millis),
            total.cpu_millis,
        ),
        ("limits.memory_mb", l.memory_mb, total.memory_mb),
        ("limits.pids", u64::from(l.pids), total.pids),
        (
            "limits.open_files",
            u64::from(l.open_files),
            total.open_files,
        ),
        ("limits.disk_mb", l.disk_mb, total.disk_mb),
    ];
    for (field, want, have) in checks {
        if have > 0 && want > have {
            return Err(ApiError::invalid(
                field,
                format!("{want} is more than this node has in all ({have})"),
            ));
        }
    }
    Ok(())
}

pub(crate) fn check_labels(field: &str, labels: &BTreeMap<String, String>) -> ApiResult<()> {
    for (k, v) in labels {
        if k == idempotency::LABEL {
            return Err(ApiError::invalid(
                &format!("{field}.{k}"),
                "is set by groved from the request's Idempotency-Key",
            ));
        }
        let ok = !k.is_empty()
            && k.len() <= 63
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b));
        if !ok {
            return Err(ApiError::invalid(
                &format!("{field}.{k}"),
                "label keys: 1-63 chars of [A-Za-z0-9._/-]",
            ));
        }
        if v.len() > 256 {
            return Err(ApiError::invalid(
                &format!("{field}.{k}"),
                "label values are at most 256 bytes",
            ));
        }
    }
    Ok(())
}

pub async fn get(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Json<Sandbox>> {
    let id = sandbox_id(&id)?;
    let rt = app.runtime.clone();
    let info = blocking(move || rt.get(&id).map_err(ApiError::from)).await?;
    Ok(Json(Sandbox::from(&info)))
}

fn parse_state(s: &str) -> ApiResult<SandboxState> {
    serde_json::from_value(serde_json::Value::String(s.to_string())).map_err(|_| {
        ApiError::bad_request(
            "invalid_query",
            "state",
            format!("{s:?} is not a sandbox state"),
        )
    })
}

/// GET /v1/sandboxes?state=running&label=k=v&limit=100&page_token=...
pub async fn list(
    State(app): State<Arc<App>>,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<SandboxList>> {
    let pairs = query_pairs(q.as_deref())?;
    let mut states = Vec::new();
    let mut labels = Vec::new();
    for (k, v) in &pairs {
        match k.as_str() {
            "state" => {
                for s in v.split(',').filter(|s| !s.is_empty()) {
                    states.push(parse_state(s)?);
                }
            }
            "label" => match v.split_once('=') {
                Some((lk, lv)) => labels.push((lk.to_string(), lv.to_string())),
                None => {
                    return Err(ApiError::bad_request(
                        "invalid_query",
                        "label",
                        format!("{v:?} is not key=value"),
                    ))
                }
            },
            "limit" | "page_token" => {}
            other => {
                return Err(ApiError::bad_request(
                    "invalid_query",
                    other,
                    format!("unknown query parameter {other:?}"),
                ))
            }
        }
    }
    let limit = match query_one(&pairs, "limit") {
        None => 100,
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=1000).contains(&n) => n,
            _ => {
                return Err(ApiError::bad_request(
                    "invalid_query",
                    "limit",
                    format!("{l:?}: must be 1..=1000"),
                ))
            }
        },
    };
    let after = query_one(&pairs, "page_token").map(str::to_string);
    let rt = app.runtime.clone();
    let mut all = blocking(move || Ok(rt.list())).await?;
    all.sort_by(|a, b| a.id.cmp(&b.id));
    let matching = all.iter().filter(|i| {
        (states.is_empty() || states.contains(&i.state))
            && labels.iter().all(|(k, v)| i.spec.labels.get(k) == Some(v))
            && after.as_deref().is_none_or(|a| i.id.as_str() > a)
    });
    let mut items: Vec<Sandbox> = matching.take(limit + 1).map(Sandbox::from).collect();
    let next_page_token = if items.len() > limit {
        items.truncate(limit);
        items.last().map(|s| s.id.clone())
    } else {
        None
    };
    Ok(Json(SandboxList {
        items,
        next_page_token,
    }))
}

pub async fn delete(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<StatusCode> {
    let id = sandbox_id(&id)?;
    let rt = app.runtime.clone();
    blocking(move || rt.destroy(&id).map_err(ApiError::from))
        .await
        .inspect_err(|e| app.metrics.failure("delete", &e.code))?;
    Ok(StatusCode::NO_CONTENT)
}

/// POST /v1/sandboxes/delete: by ids and/or labels, one result per sandbox.
pub async fn batch_delete(
    State(app): State<Arc<App>>,
    ApiJson(req): ApiJson<BatchDeleteRequest>,
) -> ApiResult<Json<BatchDeleteResponse>> {
    if req.ids.is_empty() && req.labels.is_empty() && req.job.is_none() {
        return Err(ApiError::invalid("ids", "give ids, labels or job"));
    }
    check_labels("labels", &req.labels)?;
    if let Some(j) = &req.job {
        grove_runtime::jobs::check_name(j).map_err(ApiError::from)?;
    }
    let rt = app.runtime.clone();
    let results = blocking(move || {
        let mut targets: Vec<String> = req.ids.clone();
        if !req.labels.is_empty() || req.job.is_some() {
            for i in rt.list() {
                let job = i.spec.job.as_deref().unwrap_or("default");
                if req
                    .labels
                    .iter()
                    .all(|(k, v)| i.spec.labels.get(k) == Some(v))
                    && req.job.as_deref().is_none_or(|j| j == job)
                    && !targets.contains(&i.id.to_string())
                {
                    targets.push(i.id.to_string());
                }
            }
        }
        let results = targets
            .into_iter()
            .map(|id| {
                let r = sandbox_id(&id).and_then(|sid| rt.destroy(&sid).map_err(ApiError::from));
                DeleteResult {
                    id,
                    deleted: r.is_ok(),
                    error: r.err().map(|e| e.body()),
                }
            })
            .collect::<Vec<DeleteResult>>();
        Ok(results)
    })
    .await?;
    let deleted = results.iter().filter(|r| r.deleted).count();
    Ok(Json(BatchDeleteResponse { results, deleted }))
}

pub async fn set_ttl(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<TtlRequest>,
) -> ApiResult<Json<Sandbox>> {
    let id = sandbox_id(&id)?;
    crate::api_shapes::check_ttl(req.ttl_secs)?;
    let rt = app.runtime.clone();
    let info = blocking(move || rt.set_ttl(&id, req.ttl_secs).map_err(ApiError::from)).await?;
    Ok(Json(Sandbox::from(&info)))
}

pub async fn usage(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Json<Usage>> {
    let id = sandbox_id(&id)?;
    let rt = app.runtime.clone();
    Ok(Json(
        blocking(move || rt.usage(&id).map_err(ApiError::from)).await?,
    ))
}
