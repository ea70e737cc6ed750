//! The node: capacity, labels, health, metrics, events, residue and store maintenance.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt as _;
use tokio_stream::wrappers::{errors::BroadcastStreamRecvError, BroadcastStream, WatchStream};

use crate::api_shapes::{Health, MaintenanceReport, Node, ResidueWire};
use crate::app::{blocking, App};
use crate::error::{ApiError, ApiResult};
use crate::request_parse::{query_one, query_pairs};

pub async fn node(State(app): State<Arc<App>>) -> ApiResult<Json<Node>> {
    let rt = app.runtime.clone();
    let (capacity, sandboxes) =
        blocking(move || Ok((rt.capacity(), rt.list().len() as u64))).await?;
    Ok(Json(Node {
        version: env!("CARGO_PKG_VERSION").into(),
        hostname: nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default(),
        labels: app.config.labels.clone(),
        capacity,
        sandboxes,
        snapshots_enabled: app.snapshots.is_some(),
        root_provider: app.images.kind().into(),
    }))
}

pub async fn health(State(app): State<Arc<App>>) -> Response {
    let draining = app.draining();
    let body = Json(Health {
        status: if draining { "draining" } else { "ok" }.into(),
        draining,
    });
    let status = if draining {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (status, body).into_response()
}

pub async fn metrics(State(app): State<Arc<App>>) -> ApiResult<Response> {
    let rt = app.runtime.clone();
    let (list, cap, jobs, pools) =
        blocking(move || Ok((rt.list(), rt.capacity(), rt.jobs(), rt.pools()))).await?;
    let mut by_state = BTreeMap::new();
    for s in ["creating", "running", "paused", "destroying", "failed"] {
        by_state.insert(s.to_string(), 0u64);
    }
    for i in &list {
        let s = serde_json::to_value(i.state)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        *by_state.entry(s).or_default() += 1;
    }
    let r = |name: &'static str, v: u64| {
        (
            name,
            "Node resources (total, allocated, allocatable).",
            v as f64,
        )
    };
    let gauges = [
        r("grove_node_memory_mb{kind=\"total\"}", cap.total.memory_mb),
        r(
            "grove_node_memory_mb{kind=\"allocated\"}",
            cap.allocated.memory_mb,
        ),
        r(
            "grove_node_memory_mb{kind=\"allocatable\"}",
            cap.allocatable.memory_mb,
        ),
        r(
            "grove_node_cpu_millis{kind=\"total\"}",
            cap.total.cpu_millis,
        ),
        r(
            "grove_node_cpu_millis{kind=\"allocated\"}",
            cap.allocated.cpu_millis,
        ),
        r(
            "grove_node_cpu_millis{kind=\"allocatable\"}",
            cap.allocatable.cpu_millis,
        ),
        r(
            "grove_node_sandbox_slots{kind=\"total\"}",
            cap.total.sandboxes,
        ),
        r(
            "grove_node_sandbox_slots{kind=\"allocatable\"}",
            cap.allocatable.sandboxes,
        ),
    ];
    let mut text = app.metrics.render(&by_state, &gauges);
    text.push_str(&crate::metrics::render_elastic(&jobs, &pools));
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

/// GET /v1/events[?sandbox=ID]: lifecycle events as SSE, each `event: <kind>` with the event as JSON data.
pub async fn events(
    State(app): State<Arc<App>>,
    RawQuery(q): RawQuery,
) -> ApiResult<impl IntoResponse> {
    let pairs = query_pairs(q.as_deref())?;
    if let Some((k, _)) = pairs.iter().find(|(k, _)| k != "sandbox") {
        return Err(ApiError::bad_request(
            "invalid_query",
            k,
            format!("unknown query parameter {k:?}"),
        ));
    }
    let only = query_one(&pairs, "sandbox").map(str::to_string);
    let stop = WatchStream::new(app.shutdown.subscribe()).filter(|s| futures::future::ready(*s));
    let stream = BroadcastStream::new(app.events.subscribe())
        .filter_map(move |e| {
            let out = match e {
                Ok(ev)
                    if only
                        .as_deref()
                        .is_none_or(|s| ev.sandbox.as_deref() == Some(s)) =>
                {
                    Event::default().event(ev.kind.clone()).json_data(&ev).ok()
                }
                Ok(_) => None,
                Err(BroadcastStreamRecvError::Lagged(n)) => Some(
                    Event::default()
                        .event("lagged")
                        .data(format!("{{\"missed\":{n}}}")),
                ),
            };
            futures::future::ready(out.map(Ok::<_, Infallible>))
        })
        .take_until(Box::pin(stop.into_future()));
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

pub async fn residue(State(app): State<Arc<App>>) -> ApiResult<Json<ResidueWire>> {
    let rt = app.runtime.clone();
    let r = blocking(move || Ok(rt.residue())).await?;
    Ok(Json(ResidueWire {
        clean: r.items.is_empty(),
        items: r.items,
    }))
}

pub async fn gc(State(app): State<Arc<App>>) -> ApiResult<Json<MaintenanceReport>> {
    let images = app.images.clone();
    let report = blocking(move || Ok(images.gc()?)).await?;
    Ok(Json(MaintenanceReport { ok: true, report }))
}

pub async fn fsck(State(app): State<Arc<App>>) -> ApiResult<Json<MaintenanceReport>> {
    let images = app.images.clone();
    let (ok, report) = blocking(move || Ok(images.fsck()?)).await?;
    Ok(Json(MaintenanceReport { ok, report }))
}
