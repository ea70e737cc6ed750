//! Pause and resume. `POST /pause` freezes the cgroup (memory kept); `POST /pause?to=store` and
//! the idle reaper pause to the store (nodefs + CRIU): the processes stop and the memory is
//! freed. A sandbox that cannot be checkpointed (egress network) or a node without snapshots
//! freezes instead. Either way the next exec or file request resumes a paused sandbox
//! transparently (only slower).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::Json;
use grove_runtime::{OnIdle, Runtime, SandboxId, SandboxInfo, SlotState};

use super::{sandbox_id, timed};
use crate::api_shapes::Sandbox;
use crate::app::{blocking, App};
use crate::error::{ApiError, ApiResult};
use crate::metrics::Op;
use crate::request_parse::{query_one, query_pairs};

/// How long a request waits for a pause or resume of the same sandbox by someone else.
const WAIT_OTHER: Duration = Duration::from_secs(30);

pub async fn pause(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<Sandbox>> {
    let id = sandbox_id(&id)?;
    let pairs = query_pairs(q.as_deref())?;
    let to_store = match query_one(&pairs, "to") {
        None | Some("memory") => false,
        Some("store") => true,
        Some(other) => {
            return Err(ApiError::bad_request(
                "invalid_query",
                "to",
                format!("{other:?}: memory or store"),
            ))
        }
    };
    let info = if to_store {
        pause_any(&app, &id).await?
    } else {
        let (rt, id) = (app.runtime.clone(), id.clone());
        timed(
            &app,
            Op::Pause,
            blocking(move || rt.pause(&id).map_err(Into::into)),
        )
        .await?
    };
    Ok(Json(Sandbox::from(&info)))
}

pub async fn resume(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    let id = sandbox_id(&id)?;
    let info = resume_any(&app, &id).await?;
    Ok(Json(Sandbox::from(&info)))
}

/// Pauses to the store when it can, else freezes.
pub(crate) async fn pause_any(app: &Arc<App>, id: &SandboxId) -> ApiResult<SandboxInfo> {
    let (rt, snaps, id) = (app.runtime.clone(), app.snapshots.clone(), id.clone());
    timed(
        app,
        Op::Pause,
        blocking(move || {
            if let Some(s) = &snaps {
                match s.pause(&id).map_err(ApiError::from) {
                    Err(e) if e.status == StatusCode::NOT_IMPLEMENTED => {
                        tracing::info!(sandbox = %id, reason = %e.message, "pause freezes instead");
                    }
                    other => return other,
                }
            }
            rt.pause(&id).map_err(Into::into)
        }),
    )
    .await
}

/// Resumes from the store or thaws, as the runtime says it was paused: parked in the store (or
/// moving in or out of it) is the snapshotter's to resume, frozen the runtime's.
pub(crate) async fn resume_any(app: &Arc<App>, id: &SandboxId) -> ApiResult<SandboxInfo> {
    let (rt, snaps, id) = (app.runtime.clone(), app.snapshots.clone(), id.clone());
    timed(
        app,
        Op::Resume,
        blocking(move || match (rt.state_of(&id), &snaps) {
            (Some(SlotState::Parking | SlotState::Parked | SlotState::Restoring), Some(s)) => {
                Ok(s.resume(&id)?)
            }
            _ => rt.resume(&id).map_err(Into::into),
        }),
    )
    .await
}

/// The runtime, with `id` running: a paused sandbox is resumed first (waiting out a pause or
/// resume someone else has in flight). Requests that work inside a sandbox go through here.
pub(crate) async fn awake(app: &Arc<App>, id: &SandboxId) -> ApiResult<Arc<Runtime>> {
    let rt = app.runtime.clone();
    let deadline = tokio::time::Instant::now() + WAIT_OTHER;
    while let Some(state) = rt.state_of(id).filter(|s| s.is_paused()) {
        let waiting = tokio::time::Instant::now() < deadline;
        if state.in_transit() && waiting {
            // Someone else's pause or resume is moving it to or from the store: let it land.
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        match resume_any(app, id).await {
            Ok(_) => break,
            // Paused, but the snapshotter is busy with it for someone else (a pause still
            // dumping, a resume still fetching its images): wait for that one.
            Err(e) if e.status == StatusCode::CONFLICT && waiting => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e),
        }
    }
    // A failed sandbox has no working root or init to reach (409, as exec says).
    if matches!(rt.state_of(id), Some(SlotState::Failed | SlotState::Lost)) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("sandbox {id} is Failed, not running"),
        ));
    }
    Ok(rt)
}

/// One pass of idle reclaim: sandboxes idle past their policy are paused or destroyed.
pub(crate) async fn reclaim_idle(app: &Arc<App>) {
    let rt = app.runtime.clone();
    let due = match tokio::task::spawn_blocking(move || rt.idle_due()).await {
        Ok(due) => due,
        Err(e) => {
            tracing::error!("idle reaper: {e}");
            return;
        }
    };
    for (id, action) in due {
        let res = match action {
            OnIdle::Pause => pause_any(app, &id).await.map(|_| ()),
            OnIdle::Destroy => {
                let (rt, id) = (app.runtime.clone(), id.clone());
                blocking(move || rt.destroy(&id).map_err(Into::into)).await
            }
        };
        match res {
            Ok(()) => tracing::info!(sandbox = %id, ?action, "idle sandbox reclaimed"),
            Err(e) => {
                tracing::warn!(sandbox = %id, ?action, error = %e.message, "idle reclaim failed")
            }
        }
    }
}
