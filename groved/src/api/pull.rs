//! POST /v1/snapshots/pull: this node fetches a snapshot from a peer groved, asking only for the objects its own
//! store lacks (the peer's `/objects`, then its delta `/export`), so the bytes go node to node and not through
//! the client that asked.

use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, Method, Request, StatusCode};
use axum::Json;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::snapshots::parse_ids;
use crate::api_shapes::{DeltaExportRequest, ObjectList, PullRequest, PullResult};
use crate::app::{blocking, App};
use crate::backend::check_new_snapshot_name;
use crate::error::{ApiError, ApiResult, ErrorBody};
use crate::events::own;
use crate::pipe::ChanReader;
use crate::request_parse::ApiJson;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

pub async fn pull(
    State(app): State<Arc<App>>,
    ApiJson(req): ApiJson<PullRequest>,
) -> ApiResult<(StatusCode, Json<PullResult>)> {
    check_new_snapshot_name("name", &req.name)?;
    let addr = crate::config::peer_addr(&req.source)
        .map_err(|why| ApiError::invalid("source", format!("{:?}: {why}", req.source)))?;
    let base = format!("http://{addr}");
    let snaps = app.snapshots()?;
    {
        let (snaps, name) = (snaps.clone(), req.name.clone());
        if blocking(move || Ok(snaps.get(&name)?)).await.is_ok() {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "conflict",
                format!("snapshot {:?} is already on this node", req.name),
            ));
        }
    }
    // The node's own key never leaves it: a source gets the key the request gives for it, else the
    // one configured for that peer, else none.
    let key = req
        .source_api_key
        .clone()
        .or_else(|| app.config.peer_key(&addr).map(str::to_string));
    let peer = Peer::new(base, key);
    let path = format!("/v1/snapshots/{}", req.name);

    let listed: ObjectList = serde_json::from_slice(
        &peer
            .call(Method::GET, &format!("{path}/objects"), None)
            .await?
            .collect()
            .await
            .map_err(|e| peer.broken(&e))?
            .to_bytes(),
    )
    .map_err(|e| peer.broken(&e))?;
    let ids = parse_ids("objects", &listed.objects)?;
    let missing = {
        let snaps = snaps.clone();
        blocking(move || Ok(snaps.missing(&ids)?)).await?
    };
    let ask = DeltaExportRequest {
        missing: missing.iter().map(|i| i.to_hex()).collect(),
    };
    let body = serde_json::to_vec(&ask).map_err(|e| ApiError::internal(e.to_string()))?;
    let stream = peer
        .call(Method::POST, &format!("{path}/export"), Some(body))
        .await?;

    let received = Arc::new(AtomicU64::new(0));
    let mut reader = Counted {
        inner: ChanReader::spawn(Body::new(stream)),
        n: received.clone(),
    };
    let snap = blocking(move || Ok(snaps.import(&mut reader)?)).await?;
    app.emit(own(
        "snapshot_imported",
        None,
        Some(snap.name.clone()),
        None,
    ));
    Ok((
        StatusCode::CREATED,
        Json(PullResult {
            snapshot: snap,
            objects: listed.objects.len() as u64,
            objects_sent: missing.len() as u64,
            bytes_received: received.load(Ordering::Relaxed),
        }),
    ))
}

/// A peer groved over TCP with a bearer key.
struct Peer {
    base: String,
    key: Option<String>,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Peer {
    fn new(base: String, key: Option<String>) -> Peer {
        let mut conn = HttpConnector::new();
        conn.set_connect_timeout(Some(CONNECT_TIMEOUT));
        Peer {
            base,
            key,
            client: Client::builder(TokioExecutor::new()).build(conn),
        }
    }

    /// Sends a request; a non-2xx answer becomes an error that says it came from the peer (404 stays 404,
    /// anything else is 502).
    async fn call(
        &self,
        method: Method,
        path: &str,
        json: Option<Vec<u8>>,
    ) -> ApiResult<hyper::body::Incoming> {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        if let Some(k) = &self.key {
            b = b.header(header::AUTHORIZATION, format!("Bearer {k}"));
        }
        if json.is_some() {
            b = b.header(header::CONTENT_TYPE, "application/json");
        }
        let req = b
            .body(Full::new(Bytes::from(json.unwrap_or_default())))
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let resp = self.client.request(req).await.map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                "peer_unreachable",
                format!("cannot reach {}: {}", self.base, crate::error::chain(&e)),
            )
            .with_field("source")
        })?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp.into_body());
        }
        let text = resp
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let msg = serde_json::from_slice::<ErrorBody>(&text)
            .map(|e| format!("{}: {}", e.code, e.message))
            .unwrap_or_else(|_| String::from_utf8_lossy(&text).into_owned());
        let (ours, code) = if status == StatusCode::NOT_FOUND {
            (StatusCode::NOT_FOUND, "not_found")
        } else {
            (StatusCode::BAD_GATEWAY, "peer_error")
        };
        Err(ApiError::new(
            ours,
            code,
            format!("{} answered {}: {msg}", self.base, status.as_u16()),
        ))
    }

    fn broken(&self, e: &dyn std::fmt::Display) -> ApiError {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "peer_error",
            format!("{} sent a broken answer: {e}", self.base),
        )
    }
}

/// Counts the bytes read through it (what crossed the network).
struct Counted<R> {
    inner: R,
    n: Arc<AtomicU64>,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let k = self.inner.read(buf)?;
        self.n.fetch_add(k as u64, Ordering::Relaxed);
        Ok(k)
    }
}
