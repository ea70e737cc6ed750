//! The HTTP API under /v1 (see groved/openapi.yaml).

mod build;
mod exec;
pub(crate) mod files;
mod images;
mod images_pull;
mod live;
mod node;
pub(crate) mod pause;
mod pools;
mod pull;
mod sandboxes;
pub mod sessions;
mod snapshots;
pub(crate) mod swerex;

pub use sandboxes::build_spec;
pub(crate) use sandboxes::check_labels;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::Router;
use grove_runtime::SandboxId;

use crate::app::App;
use crate::error::{ApiError, ApiResult};
use crate::metrics::Op;

/// The API router. `api_key`: when set, every request must carry `Authorization: Bearer <key>` (TCP listeners).
pub fn router(app: Arc<App>, api_key: Option<String>) -> Router {
    let idem = || middleware::from_fn_with_state(app.clone(), crate::idempotency::layer);
    let v1 = Router::new()
        .route(
            "/sandboxes",
            post(sandboxes::create)
                .route_layer(idem())
                .get(sandboxes::list),
        )
        .route("/sandboxes/delete", post(sandboxes::batch_delete))
        .route(
            "/sandboxes/{id}",
            delete(sandboxes::delete)
                .route_layer(idem())
                .get(sandboxes::get),
        )
        .route("/sandboxes/{id}/ttl", put(sandboxes::set_ttl))
        .route("/sandboxes/{id}/usage", get(sandboxes::usage))
        .route("/sandboxes/{id}/pause", post(pause::pause))
        .route("/sandboxes/{id}/resume", post(pause::resume))
        .route("/sandboxes/{id}/exec", post(exec::exec).route_layer(idem()))
        .route("/sandboxes/{id}/exec/stream", post(exec::exec_stream))
        .route(
            "/sandboxes/{id}/processes",
            post(exec::start).route_layer(idem()).get(exec::processes),
        )
        .route("/sandboxes/{id}/processes/{pid}/signal", post(exec::signal))
        // Terminals and kept processes' streams and stdin (api/live.rs).
        .route("/sandboxes/{id}/processes/{pid}/stream", get(live::connect))
        .route("/sandboxes/{id}/processes/{pid}/stdin", post(live::stdin))
        .route("/sandboxes/{id}/pty", post(live::create))
        .route("/sandboxes/{id}/pty/{pid}", delete(live::kill))
        .route("/sandboxes/{id}/pty/{pid}/input", post(live::input))
        .route("/sandboxes/{id}/pty/{pid}/resize", post(live::resize))
        .route("/sandboxes/{id}/files", get(files::read).put(files::write))
        .route("/sandboxes/{id}/files/list", get(files::list))
        .route(
            "/sandboxes/{id}/archive",
            get(files::download).put(files::upload),
        )
        // Shell sessions (issue 23).
        .route(
            "/sandboxes/{id}/sessions",
            post(sessions::create).get(sessions::list),
        )
        .route(
            "/sandboxes/{id}/sessions/{name}",
            get(sessions::get).delete(sessions::close),
        )
        .route("/sandboxes/{id}/sessions/{name}/run", post(sessions::run))
        .route(
            "/sandboxes/{id}/sessions/{name}/interrupt",
            post(sessions::interrupt),
        )
        .route(
            "/sandboxes/{id}/snapshot",
            post(snapshots::create).route_layer(idem()),
        )
        .route("/snapshots", get(snapshots::list))
        .route("/snapshots/import", post(snapshots::import))
        .route(
            "/snapshots/{name}",
            get(snapshots::get).delete(snapshots::delete),
        )
        .route(
            "/snapshots/{name}/fork",
            post(snapshots::fork).route_layer(idem()),
        )
        .route(
            "/snapshots/{name}/export",
            get(snapshots::export).post(snapshots::export_delta),
        )
        .route("/snapshots/{name}/objects", get(snapshots::objects))
        .route("/snapshots/missing", post(snapshots::missing))
        .route("/snapshots/gc", post(snapshots::gc))
        .route("/snapshots/pull", post(pull::pull))
        .route("/images", get(images::list).post(images::import))
        .route(
            "/images/{name}",
            get(images::inspect).delete(images::delete),
        )
        // Registry pulls (issue 20).
        .route("/images/pull", post(images_pull::pull))
        .route("/images/{name}/tar", put(images::import_tar))
        // Builds from Dockerfiles (h8).
        .route("/images/build", post(build::build))
        .route("/images/build-cache/prune", post(build::prune_cache))
        .route("/pools", get(pools::get_pools).put(pools::put_pools))
        .route("/jobs", get(pools::get_jobs).put(pools::put_jobs))
        .route("/node", get(node::node))
        .route("/node/residue", get(node::residue))
        .route("/node/gc", post(node::gc))
        .route("/node/fsck", post(node::fsck))
        .route("/health", get(node::health))
        .route("/events", get(node::events))
        // SWE-ReX's remote runtime protocol, per sandbox (api/swerex).
        .nest("/sandboxes/{id}/swerex", swerex::routes());
    let mut r = Router::new()
        .nest("/v1", v1)
        .route("/metrics", get(node::metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(app.clone(), observe))
        // Only extractors that buffer (JSON) are held to it; streamed bodies are not.
        .layer(DefaultBodyLimit::max(crate::app::MAX_JSON_BODY));
    if let Some(key) = api_key {
        r = r.layer(middleware::from_fn(move |req: Request, next: Next| {
            let key = key.clone();
            async move { auth(&key, req, next).await }
        }));
    }
    r.with_state(app)
}

async fn not_found() -> ApiError {
    ApiError::not_found("no_route", "no such endpoint")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "method not allowed on this endpoint",
    )
}

async fn auth(key: &str, req: Request, next: Next) -> Response {
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // SWE-ReX's client sends the key as X-API-Key; only its routes take it.
    let rex = || {
        swerex::is_swerex_path(req.uri().path())
            .then(|| req.headers().get(swerex::API_KEY_HEADER))
            .flatten()
            .and_then(|v| v.to_str().ok())
    };
    let given = bearer.or_else(rex).unwrap_or("");
    // Compare in time independent of where the first difference is.
    let same = given.len() == key.len()
        && given
            .bytes()
            .zip(key.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if same {
        next.run(req).await
    } else {
        let mut r = ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong API key",
        )
        .into_response();
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        r
    }
}

/// Refuses new work while draining and counts every request by route template.
async fn observe(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "other".into());
    let method = req.method().clone();
    let resp = if app.draining() && !matches!(route.as_str(), "/v1/health" | "/metrics") {
        ApiError::unavailable("groved is shutting down").into_response()
    } else {
        next.run(req).await
    };
    app.metrics
        .request(&route, method.as_str(), resp.status().as_u16());
    resp
}

/// Parses a sandbox id from the path.
pub(crate) fn sandbox_id(s: &str) -> ApiResult<SandboxId> {
    s.parse().map_err(|_| {
        ApiError::bad_request(
            "invalid_id",
            "id",
            format!("{s:?} is not a sandbox id (sb- and 12 hex chars)"),
        )
    })
}

/// Times `f`, counting a failure under the error's code.
pub(crate) async fn timed<T>(
    app: &App,
    op: Op,
    f: impl std::future::Future<Output = ApiResult<T>>,
) -> ApiResult<T> {
    let t = Instant::now();
    let r = f.await;
    match &r {
        Ok(_) => app.metrics.observe(op, t.elapsed()),
        Err(e) => app.metrics.failure(op.name(), &e.code),
    }
    r
}

/// Checks a path inside a sandbox: absolute, no `..`, no NUL. The runtime checks again after resolving links.
pub(crate) fn sandbox_path(p: Option<&str>) -> ApiResult<String> {
    let p = p.ok_or_else(|| {
        ApiError::bad_request("invalid_path", "path", "query parameter path is required")
    })?;
    if !p.starts_with('/') {
        return Err(ApiError::bad_request(
            "invalid_path",
            "path",
            format!("{p:?} is not absolute"),
        ));
    }
    if p.contains('\0') || p.split('/').any(|c| c == "..") {
        return Err(ApiError::bad_request(
            "invalid_path",
            "path",
            format!("{p:?} escapes (.. or NUL)"),
        ));
    }
    Ok(p.to_string())
}
