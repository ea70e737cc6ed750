//! Snapshots: create from a sandbox, list, get, delete, fork, export, import; and the delta
//! transfer between nodes (the source lists a snapshot's objects, the receiver names those it
//! lacks, the source exports only those).

use std::collections::HashSet;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Extension, Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::sandboxes::{batch_response, check_labels, made_before, MAX_BATCH};
use super::{sandbox_id, timed};
use crate::app::{blocking, App};
use crate::backend::check_name;
use crate::error::{ApiError, ApiResult};
use crate::events::own;
use crate::idempotency::{self, Tag};
use crate::jsonx::{ApiJson, OptionalJson};
use crate::metrics::Op;
use crate::pipe::{ChanReader, ChanWriter};
use crate::wire::{
    DeltaExportRequest, ForkRequest, ObjectList, Snapshot, SnapshotList, SnapshotRequest,
};
use nodefs::ObjectId;

pub async fn create(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    OptionalJson(req): OptionalJson<SnapshotRequest>,
) -> ApiResult<(StatusCode, Json<Snapshot>)> {
    let id = sandbox_id(&id)?;
    if let Some(n) = &req.name {
        check_name("name", n)?;
    }
    let snaps = app.snapshots()?;
    let sid = id.clone();
    let snap = timed(
        &app,
        Op::Snapshot,
        blocking(move || snaps.snapshot(&sid, &req)),
    )
    .await?;
    app.emit(own(
        "snapshot_created",
        Some(id.to_string()),
        Some(snap.name.clone()),
        None,
    ));
    Ok((StatusCode::CREATED, Json(snap)))
}

pub async fn list(State(app): State<Arc<App>>) -> ApiResult<Json<SnapshotList>> {
    let snaps = app.snapshots()?;
    let items = blocking(move || snaps.list()).await?;
    Ok(Json(SnapshotList { items }))
}

pub async fn get(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
) -> ApiResult<Json<Snapshot>> {
    check_name("name", &name)?;
    let snaps = app.snapshots()?;
    Ok(Json(blocking(move || snaps.get(&name)).await?))
}

pub async fn delete(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    check_name("name", &name)?;
    let snaps = app.snapshots()?;
    let n = name.clone();
    blocking(move || snaps.delete(&n)).await?;
    app.emit(own("snapshot_deleted", None, Some(name), None));
    Ok(StatusCode::NO_CONTENT)
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
    crate::wire::check_ttl(req.ttl_secs)?;
    crate::wire::check_queue_timeout(req.queue_timeout_ms)?;
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
        results.extend(timed(&app, Op::Fork, blocking(move || snaps.fork(&n, &req))).await?);
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
    let ids = blocking(move || snaps.objects(&name)).await?;
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
    let lacking = blocking(move || snaps.missing(&ids)).await?;
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
        blocking(move || snaps.get(&name)).await?;
    }
    let (mut w, body) = ChanWriter::new();
    tokio::task::spawn_blocking(move || {
        let r = snaps.export(&name, only.as_ref(), &mut w).and_then(|()| {
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
    let snap = blocking(move || snaps.import(&mut reader)).await?;
    app.emit(own(
        "snapshot_imported",
        None,
        Some(snap.name.clone()),
        None,
    ));
    Ok((StatusCode::CREATED, Json(snap)))
}
