//! The E2B-compatible endpoint: E2B's REST control plane and its in-sandbox daemon ("envd")
//! protocol on one TCP address (`--e2b-listen`, config key `e2b_listen`), HTTP/1.1 and cleartext
//! HTTP/2 (prior knowledge) on the same port. Requests carrying `E2b-Sandbox-Id` are sandbox
//! traffic (envd: `/files`, `/health`, the Connect services `filesystem.Filesystem` and
//! `process.Process`); the rest is the control plane. Everything maps onto groved's own
//! machinery (the runtime, the snapshotter), so there is no second lifecycle here.

pub mod auth;
pub mod connect;
pub mod control;
pub mod error;
pub mod files;
pub mod filesystem;
pub mod process;
pub mod proto;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Router;
use grove_runtime::{SandboxId, SandboxInfo, SandboxState};
use parking_lot::RwLock;
use tower::ServiceExt as _;

use crate::app::App;
use connect::{Code, ConnectError, Ctx, Services};
use error::{E2bError, E2bResult};

/// The port envd listens on inside an E2B sandbox; the SDK sends it as `E2b-Sandbox-Port`.
pub const ENVD_PORT: u16 = 49983;
/// The envd version reported to the SDK (it refuses sandboxes older than 0.1.0, and gates
/// features on newer versions).
pub const ENVD_VERSION: &str = "0.5.7";

/// Hooks other modules register Connect services with (the process service registers
/// `process.Process` here); called once when the endpoint starts.
pub type Register = fn(&mut Services);

static EXTRA_SERVICES: RwLock<Vec<Register>> = RwLock::new(Vec::new());

/// Adds a service registration to every E2B endpoint started after this call.
pub fn register(f: Register) {
    EXTRA_SERVICES.write().push(f);
}

/// State of one endpoint.
pub struct E2b {
    pub app: Arc<App>,
    control: Router,
    services: Services,
}

/// The endpoint's router: sandbox traffic by header, the control plane otherwise.
pub fn router(app: Arc<App>) -> Router {
    let mut services = Services::default();
    filesystem::register(&mut services);
    process::register(&mut services);
    for f in EXTRA_SERVICES.read().iter() {
        f(&mut services);
    }
    let st = Arc::new(E2b {
        control: control::router(app.clone()),
        app,
        services,
    });
    Router::new().fallback(entry).with_state(st)
}

/// Serves the endpoint on `listener` until `stop` flips.
pub async fn serve(
    app: Arc<App>,
    listener: tokio::net::TcpListener,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let router = router(app);
    axum::serve(crate::server::no_delay(listener), router)
        .with_graceful_shutdown(async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await
}

async fn entry(State(st): State<Arc<E2b>>, req: Request) -> Response {
    let route = if req.headers().contains_key("e2b-sandbox-id") {
        "e2b:sandbox"
    } else {
        "e2b:control"
    };
    let method = req.method().clone();
    let resp = if st.app.draining() {
        E2bError::new(StatusCode::SERVICE_UNAVAILABLE, "groved is shutting down").into_response()
    } else if route == "e2b:sandbox" {
        sandbox_request(&st, req).await
    } else {
        match st.control.clone().oneshot(req).await {
            Ok(r) => r,
            Err(never) => match never {},
        }
    };
    st.app
        .metrics
        .request(route, method.as_str(), resp.status().as_u16());
    resp
}

/// The message E2B's SDK reads as "the sandbox is gone" (SandboxNotRunningException).
fn gone(id: &str) -> String {
    format!("The sandbox {id} was not found")
}

/// A request to a sandbox's envd: authenticated by the sandbox's access token, then served.
async fn sandbox_request(st: &Arc<E2b>, req: Request) -> Response {
    let rpc =
        req.uri().path().starts_with("/filesystem.") || req.uri().path().starts_with("/process.");
    let fail = |e: E2bError| -> Response {
        if rpc {
            let code = match e.status.as_u16() {
                401 => Code::Unauthenticated,
                404 | 502 => Code::Unavailable,
                400 => Code::InvalidArgument,
                _ => Code::Internal,
            };
            connect_error_response(ConnectError::new(code, e.message))
        } else {
            e.into_response()
        }
    };
    let info = match target(st, req.headers()).await {
        Ok(i) => i,
        Err(e) => return fail(e),
    };
    if let Err(e) = auth::sandbox(&st.app, &info, req.headers()) {
        return fail(e);
    }
    // Traffic wakes a paused sandbox (E2B's auto-resume), once the caller is known to hold it.
    if info.state == SandboxState::Paused {
        if let Err(e) = crate::api::pause::awake(&st.app, &info.id).await {
            return fail(e.into());
        }
    }
    let path = req.uri().path().to_string();
    match path.as_str() {
        "/health" => StatusCode::NO_CONTENT.into_response(),
        "/files" => files::handle(st.app.clone(), info, req).await,
        p if st.services.has(p) => {
            let timeout = match connect::timeout_of(req.headers()) {
                Ok(t) => t,
                Err(e) => return connect_error_response(e),
            };
            let ctx = Ctx {
                app: st.app.clone(),
                sandbox: info.id.clone(),
                headers: req.headers().clone(),
                timeout,
            };
            st.services.handle(ctx, req).await
        }
        _ if rpc => connect_error_response(ConnectError::new(
            Code::Unimplemented,
            format!("no method {path}"),
        )),
        _ => E2bError::not_found(format!("no envd route {path}")).into_response(),
    }
}

fn connect_error_response(e: ConnectError) -> Response {
    (
        e.code.http_status(),
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        serde_json::json!({"code": e.code.as_str(), "message": e.message}).to_string(),
    )
        .into_response()
}

/// The sandbox a request is for, from `E2b-Sandbox-Id` (and `E2b-Sandbox-Port`, which must be
/// envd's: other ports of a sandbox are not served here).
async fn target(st: &Arc<E2b>, h: &axum::http::HeaderMap) -> E2bResult<SandboxInfo> {
    let raw = h
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if let Some(p) = h.get("e2b-sandbox-port") {
        let port = p.to_str().ok().and_then(|s| s.parse::<u16>().ok());
        if port != Some(ENVD_PORT) {
            return Err(E2bError::new(
                StatusCode::BAD_GATEWAY,
                format!(
                    "E2b-Sandbox-Port {p:?}: only envd's port {ENVD_PORT} is served by this node"
                ),
            ));
        }
    }
    let id: SandboxId = raw
        .parse()
        .map_err(|_| E2bError::new(StatusCode::BAD_GATEWAY, gone(raw)))?;
    let rt = st.app.runtime.clone();
    let info = {
        let id = id.clone();
        crate::app::blocking(move || Ok(rt.get(&id).ok())).await
    }
    .map_err(E2bError::from)?
    .ok_or_else(|| E2bError::new(StatusCode::BAD_GATEWAY, gone(raw)))?;
    match info.state {
        SandboxState::Running | SandboxState::Paused => Ok(info),
        _ => Err(E2bError::new(StatusCode::BAD_GATEWAY, gone(raw))),
    }
}
