//! `Idempotency-Key`: the first response to a key is stored and replayed to every later request with that key.
//! A key reused for a different request is a 422. Responses that invite a retry (429, 503, 5xx) are not stored,
//! so a retry with the same key gets a fresh attempt.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{to_bytes, Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;

use crate::app::App;
use crate::error::ApiError;

const HEADER: &str = "idempotency-key";
const KEEP: Duration = Duration::from_secs(24 * 3600);
const MAX_KEYS: usize = 100_000;
const MAX_BODY: usize = 64 << 20;

#[derive(Debug, Clone)]
struct Stored {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

#[derive(Debug)]
struct Entry {
    fingerprint: u64,
    created: Instant,
    slot: tokio::sync::Mutex<Option<Stored>>,
}

#[derive(Debug, Default)]
pub struct Idempotency {
    entries: Mutex<HashMap<String, Arc<Entry>>>,
}

impl Idempotency {
    fn entry(&self, key: &str, fingerprint: u64) -> Option<Arc<Entry>> {
        let mut map = self.entries.lock();
        if map.len() >= MAX_KEYS {
            map.retain(|_, e| e.created.elapsed() < KEEP);
        }
        let e = map.entry(key.to_string()).or_insert_with(|| {
            Arc::new(Entry {
                fingerprint,
                created: Instant::now(),
                slot: Default::default(),
            })
        });
        (e.fingerprint == fingerprint).then(|| e.clone())
    }
}

/// Middleware for the routes that honour `Idempotency-Key`.
pub async fn layer(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let Some(key) = req.headers().get(HEADER).cloned() else {
        return next.run(req).await;
    };
    let key = match key.to_str() {
        Ok(k) if !k.is_empty() && k.len() <= 255 => k.to_string(),
        _ => {
            return ApiError::bad_request(
                "invalid_header",
                "Idempotency-Key",
                "must be 1-255 visible ASCII chars",
            )
            .into_response()
        }
    };
    let (parts, body) = req.into_parts();
    // These routes take JSON: held to the same cap as the JSON extractor, before it is buffered here.
    let bytes = match to_bytes(body, crate::app::MAX_JSON_BODY).await {
        Ok(b) => b,
        Err(e) => {
            let e = e.into_inner();
            if e.is::<http_body_util::LengthLimitError>() {
                return ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body_too_large",
                    format!(
                        "a JSON body may be at most {} bytes",
                        crate::app::MAX_JSON_BODY
                    ),
                )
                .with_field("body")
                .into_response();
            }
            return ApiError::bad_request("invalid_body", "body", e.to_string()).into_response();
        }
    };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (parts.method.as_str(), parts.uri.path(), &bytes[..]).hash(&mut h);
    let Some(entry) = app.idempotency.entry(&key, h.finish()) else {
        return ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_key_reused",
            "this Idempotency-Key was first used for a different request",
        )
        .with_field("Idempotency-Key")
        .into_response();
    };
    let mut slot = entry.slot.lock().await;
    if let Some(s) = slot.as_ref() {
        let mut resp = (s.status, s.headers.clone(), s.body.clone()).into_response();
        resp.headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
        return resp;
    }
    let resp = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    let (rparts, rbody) = resp.into_parts();
    let body = match to_bytes(rbody, MAX_BODY).await {
        Ok(b) => b,
        Err(e) => return ApiError::internal(format!("buffering response: {e}")).into_response(),
    };
    let status = rparts.status;
    if !(status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error()) {
        *slot = Some(Stored {
            status,
            headers: rparts.headers.clone(),
            body: body.clone(),
        });
    }
    Response::from_parts(rparts, Body::from(body))
}
