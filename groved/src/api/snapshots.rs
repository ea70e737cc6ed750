//! Snapshots: create from a sandbox, list, get, delete, fork, export, import; and the delta
//! transfer between nodes (the source lists a snapshot's objects, the receiver names those it
//! lacks, the source exports only those).

use std::collections::HashSet;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Extension, Path, RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::sandboxes::{batch_response, check_labels, made_before, MAX_BATCH};
use super::{sandbox_id, timed};
use crate::api_shapes::{
    DeltaExportRequest, ForkRequest, ObjectList, Snapshot, SnapshotGcRequest, SnapshotList,
    SnapshotRequest, SnapshotsDeleted,
};
use crate::app::{blocking, App};
use crate::backend::check_name;
use crate::error::{api_each, ApiError, ApiResult};
use crate::events::own;
use crate::idempotency::{self, Tag};
use crate::metrics::Op;
use crate::pipe::{ChanReader, ChanWriter};
use crate::request_parse::{query_one, query_pairs, ApiJson, OptionalJson};
use nodefs::ObjectId;

pub async fn create(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    OptionalJson(req): OptionalJson<SnapshotRequest>,
) -> ApiResult<(StatusCode, Json<Snapshot>)> {
    let id = sandbox_id(&id)?;
    if let Some(n) = &req.name {
        crate::backend::check_new_snapshot_name("name", n)?;
    }
    crate::api_shapes::check_ttl(req.ttl_secs.filter(|t| *t > 0))?;
    let ttl = req.ttl_secs.filter(|t| *t > 0);
    let snaps = app.snapshots()?;
    let sid = id.clone();
    let a = app.clone();
    let snap = timed(
        &app,
        Op::Snapshot,
        blocking(move || {
            let snap = snaps.snapshot(&sid, &req)?;
            if let Some(t) = ttl {
                let at = crate::lifetimes::now_ms().saturating_add(t.saturating_mul(1000));
                if let Err(e) = a.snapshot_ttls.set(&snap.id, Some(at)) {
                    // A snapshot whose TTL cannot be kept would outlive it: none is made.
                    let _ = snaps.delete(&snap.id);
                    let e = ApiError::from_cause(&e, ApiError::internal(crate::error::chain(&e)));
                    return Err(e);
                }
            }
            Ok(crate::lifetimes::decorate(&a, snap))
        }),
    )
    .await?;
    app.emit(own(
        "snapshot_created",
        Some(id.to_string()),
        Some(snap.name.clone()),
        snap.memory_dump
            .as_ref()
            .map(|m| match &snap.full_dump_reason {
                Some(why) => format!("memory dump: {m} ({why})"),
                None => format!("memory dump: {m}"),
            }),
    ));
    Ok((StatusCode::CREATED, Json(snap)))
}

pub async fn list(State(app): State<Arc<App>>) -> ApiResult<Json<SnapshotList>> {
    let snaps = app.snapshots()?;
    let items = blocking(move || Ok(snaps.list()?)).await?;
    let items = items
        .into_iter()
        .map(|s| crate::lifetimes::decorate(&app, s))
        .collect();
    Ok(Json(SnapshotList { items }))
}

pub async fn get(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
) -> ApiResult<Json<Snapshot>> {
    check_name("name", &name)?;
    let snaps = app.snapshots()?;
    let s = blocking(move || Ok(snaps.get(&name)?)).await?;
    Ok(Json(crate::lifetimes::decorate(&app, s)))
}

/// DELETE /v1/snapshots/{name}[?descendants=true]: with descendants, every snapshot below it goes
/// too (deepest first) and the answer names them.
pub async fn delete(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    check_name("name", &name)?;
    let pairs = query_pairs(q.as_deref())?;
    let descendants = match query_one(&pairs, "descendants") {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(ApiError::bad_request(
                "invalid_query",
                "descendants",
                format!("{other:?}: true or false"),
            ))
        }
    };
    let snaps = app.snapshots()?;
    let n = name.clone();
    if !descendants {
        let a = app.clone();
        blocking(move || {
            let id = snaps.get(&n)?.id;
            snaps.delete(&n)?;
            a.snapshot_ttls.forget(&[id]);
            Ok(())
        })
        .await?;
        app.emit(own("snapshot_deleted", None, Some(name), None));
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    let a = app.clone();
    let deleted = blocking(move || {
        let root = snaps.get(&n)?;
        let all = snaps.list()?;
        let mut deleted = Vec::new();
        let mut ids = Vec::new();
        for s in crate::lifetimes::with_descendants(&all, &root) {
            match snaps.delete(&s.id).map_err(ApiError::from) {
                Ok(()) => {}
                Err(e) if e.status == StatusCode::NOT_FOUND => continue,
                Err(e) => {
                    a.snapshot_ttls.forget(&ids);
                    return Err(e);
                }
            }
            a.emit(own("snapshot_deleted", None, Some(s.name.clone()), None));
            ids.push(s.id);
            deleted.push(s.name);
        }
        a.snapshot_ttls.forget(&ids);
        Ok(deleted)
    })
    .await?;
    let count = deleted.len();
    Ok(Json(SnapshotsDeleted {
        deleted,
        count,
        store: None,
    })
    .into_response())
}

/// POST /v1/snapshots/gc: deletes expired snapshots, and those carrying all of `labels`, that no live
/// sandbox was forked from and no kept snapshot descends from; then runs the content store's gc, so
/// their bytes are freed (`store` is its report).
pub async fn gc(
    State(app): State<Arc<App>>,
    OptionalJson(req): OptionalJson<SnapshotGcRequest>,
) -> ApiResult<Json<SnapshotsDeleted>> {
    check_labels("labels", &req.labels)?;
    let snaps = app.snapshots()?;
    let a = app.clone();
    let deleted = blocking(move || {
        let now = crate::lifetimes::now_ms();
        let candidates = snaps
            .list()?
            .into_iter()
            .map(|s| crate::lifetimes::decorate(&a, s))
            .filter(|s| {
                s.expires_at_ms.is_some_and(|t| t <= now)
                    || (!req.labels.is_empty()
                        && req.labels.iter().all(|(k, v)| s.labels.get(k) == Some(v)))
            })
            .map(|s| s.id)
            .collect();
        let sandboxes = a.runtime.list();
        crate::lifetimes::delete_unneeded(&a, &*snaps, &sandboxes, &candidates)
    })
    .await?;
    let images = app.images.clone();
    let store = blocking(move || Ok(images.gc()?)).await?;
    let count = deleted.len();
    Ok(Json(SnapshotsDeleted {
        deleted,
        count,
        store: Some(store),
    }))
}

pub async fn fork(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    tag: Option<Extension<Tag>>,
    ApiJson(mut req): ApiJson<ForkRequest>,
) -> ApiResult<Response> {
    check_name("name", &name)?;
    if req.count == 0 || req.count > MAX_BATCH {
        return Err(ApiError::invalid(
            "count",
            format!("must be 1..={MAX_BATCH}, got {}", req.count),
        ));
    }
    crate::api_shapes::check_ttl(req.ttl_secs.filter(|t| *t > 0))?;
    crate::api_shapes::check_queue_timeout(req.queue_timeout_ms)?;
    check_labels("labels", &req.labels)?;
    let snaps = app.snapshots()?;
    let tag = tag.map(|Extension(Tag(t))| t);
    if let Some(t) = &tag {
        req.labels.insert(idempotency::LABEL.into(), t.clone());
    }
    // A retry after a crash forks only the branches the first attempt did not make.
    let made = made_before(&app, tag).await?;
    req.count = req.count.saturating_sub(made.len() as u32);
    let mut results: Vec<ApiResult<_>> = made.into_iter().map(Ok).collect();
    if req.count > 0 {
        let n = name.clone();
        results.extend(
            timed(
                &app,
                Op::Fork,
                blocking(move || Ok(api_each(snaps.fork(&n, &req)?))),
            )
            .await?,
        );
    }
    let failed = results.iter().filter(|r| r.is_err()).count();
    let reason = (failed > 0).then(|| format!("{failed} of {} branches failed", results.len()));
    app.emit(own("forked", None, Some(name), reason));
    batch_response(results)
}

pub async fn export(State(app): State<Arc<App>>, Path(name): Path<String>) -> ApiResult<Response> {
    stream_export(app, name, None).await
}

/// POST /v1/snapshots/{name}/export: a delta carrying only the objects the receiver lacks.
pub async fn export_delta(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<DeltaExportRequest>,
) -> ApiResult<Response> {
    let only = parse_ids("missing", &req.missing)?.into_iter().collect();
    stream_export(app, name, Some(only)).await
}

/// GET /v1/snapshots/{name}/objects.
pub async fn objects(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
) -> ApiResult<Json<ObjectList>> {
    check_name("name", &name)?;
    let snaps = app.snapshots()?;
    let ids = blocking(move || Ok(snaps.objects(&name)?)).await?;
    Ok(Json(ObjectList {
        objects: ids.iter().map(|i| i.to_hex()).collect(),
    }))
}

/// POST /v1/snapshots/missing: which of the given objects this node lacks.
pub async fn missing(
    State(app): State<Arc<App>>,
    ApiJson(req): ApiJson<ObjectList>,
) -> ApiResult<Json<ObjectList>> {
    let ids = parse_ids("objects", &req.objects)?;
    let snaps = app.snapshots()?;
    let lacking = blocking(move || Ok(snaps.missing(&ids)?)).await?;
    Ok(Json(ObjectList {
        objects: lacking.iter().map(|i| i.to_hex()).collect(),
    }))
}

pub(crate) fn parse_ids(field: &str, hex: &[String]) -> ApiResult<Vec<ObjectId>> {
    hex.iter()
        .map(|h| {
            h.parse().map_err(|_| {
                ApiError::invalid(field, format!("{h:?} is not an object id (64 hex digits)"))
            })
        })
        .collect()
}

async fn stream_export(
    app: Arc<App>,
    name: String,
    only: Option<HashSet<ObjectId>>,
) -> ApiResult<Response> {
    check_name("name", &name)?;
    let snaps = app.snapshots()?;
    {
        let (snaps, name) = (snaps.clone(), name.clone());
        blocking(move || Ok(snaps.get(&name)?)).await?;
    }
    let (mut w, body) = ChanWriter::new();
    tokio::task::spawn_blocking(move || {
        let r = snaps
            .export(&name, only.as_ref(), &mut w)
            .map_err(ApiError::from)
            .and_then(|()| {
                std::io::Write::flush(&mut w).map_err(|e| ApiError::internal(e.to_string()))
            });
        if let Err(e) = r {
            tracing::warn!(snapshot = %name, "export failed mid-stream: {}", e.message);
            w.fail(e.message);
        }
    });
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response())
}

pub async fn import(
    State(app): State<Arc<App>>,
    body: Body,
) -> ApiResult<(StatusCode, Json<Snapshot>)> {
    let snaps = app.snapshots()?;
    let mut reader = ChanReader::spawn(body);
    let snap = blocking(move || Ok(snaps.import(&mut reader)?)).await?;
    app.emit(own(
        "snapshot_imported",
        None,
        Some(snap.name.clone()),
        None,
    ));
    Ok((
        StatusCode::CREATED,
        Json(crate::lifetimes::decorate(&app, snap)),
    ))
}
