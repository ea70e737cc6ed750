//! `Idempotency-Key`: the first response to a key is stored and replayed to every later request with that key.
//! A key reused for a different request is a 422. Responses that invite a retry (429, 503, 5xx) are not stored,
//! so a retry with the same key gets a fresh attempt.
//!
//! Keys survive a crash: each is journalled under `<state_dir>/idempotency/` (synced) before its request runs,
//! and again with its response; a restart reloads them. A request cut off by a crash has no response on record,
//! so its retry runs again — and finds what the first attempt made: the handlers that create sandboxes tag each
//! one with the key (label [`LABEL`], stored in the sandbox's own record) and create only what is missing.

use crate::events::now_ms;
use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{to_bytes, Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use grove_runtime::{Runtime, SandboxInfo};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::app::App;
use crate::error::ApiError;

const HEADER: &str = "idempotency-key";
const KEEP: Duration = Duration::from_secs(24 * 3600);
const MAX_KEYS: usize = 100_000;
const MAX_BODY: usize = 64 << 20;
/// The label that ties a sandbox to the Idempotency-Key of the request that made it (its value: [`Tag`]).
pub const LABEL: &str = "grove.idempotency-key";

/// What a handler learns of the request's key: the label value its sandboxes carry.
#[derive(Debug, Clone)]
pub struct Tag(pub String);

#[derive(Debug, Clone)]
struct Stored {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

#[derive(Debug)]
struct Entry {
    fingerprint: String,
    created_ms: u64,
    slot: tokio::sync::Mutex<Option<Stored>>,
}

/// A key on disk: its request's fingerprint and, once answered, the response.
#[derive(Debug, Serialize, Deserialize)]
struct Journal {
    key: String,
    fingerprint: String,
    created_ms: u64,
    response: Option<JournalResponse>,
}

#[derive(Debug, Serialize, Deserialize)]
struct JournalResponse {
    status: u16,
    headers: Vec<(String, String)>,
    /// Base64.
    body: String,
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("writing the idempotency journal {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Debug, Default)]
pub struct Idempotency {
    /// Where keys are journalled; None keeps them in memory only (no state dir).
    dir: Option<PathBuf>,
    entries: Mutex<HashMap<String, Arc<Entry>>>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The label value and journal file name of a key: its hash, so any key makes a valid name.
pub fn tag_of(key: &str) -> String {
    hex(&Sha256::digest(key.as_bytes())[..16])
}

fn expired(created_ms: u64) -> bool {
    now_ms().saturating_sub(created_ms) > KEEP.as_millis() as u64
}

impl Idempotency {
    /// Keys journalled in `dir` (made if missing), reloaded from a previous run; expired ones are dropped.
    pub fn open(dir: PathBuf) -> Idempotency {
        let mut entries = HashMap::new();
        if let Err(e) = std::fs::create_dir_all(&dir) {
            tracing::warn!(dir = %dir.display(), "idempotency journal: {e}");
        }
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = e.path();
            if path.extension().is_some_and(|x| x == "tmp") {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let j: Journal = match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
            {
                Ok(j) => j,
                Err(why) => {
                    tracing::warn!(file = %path.display(), "idempotency journal entry dropped: {why}");
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            if expired(j.created_ms) {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let stored = j.response.and_then(|r| {
                let mut headers = HeaderMap::new();
                for (k, v) in &r.headers {
                    let (Ok(k), Ok(v)) = (HeaderName::try_from(k), HeaderValue::try_from(v)) else {
                        continue;
                    };
                    headers.append(k, v);
                }
                Some(Stored {
                    status: StatusCode::from_u16(r.status).ok()?,
                    headers,
                    body: base64::engine::general_purpose::STANDARD
                        .decode(&r.body)
                        .ok()?
                        .into(),
                })
            });
            entries.insert(
                j.key,
                Arc::new(Entry {
                    fingerprint: j.fingerprint,
                    created_ms: j.created_ms,
                    slot: tokio::sync::Mutex::new(stored),
                }),
            );
        }
        Idempotency {
            dir: Some(dir),
            entries: Mutex::new(entries),
        }
    }

    fn entry(&self, key: &str, fingerprint: &str) -> Option<Arc<Entry>> {
        let mut map = self.entries.lock();
        if map.len() >= MAX_KEYS {
            map.retain(|k, e| {
                let keep = !expired(e.created_ms);
                if !keep {
                    if let Some(d) = &self.dir {
                        let _ = std::fs::remove_file(d.join(tag_of(k)));
                    }
                }
                keep
            });
        }
        let e = map.entry(key.to_string()).or_insert_with(|| {
            Arc::new(Entry {
                fingerprint: fingerprint.to_string(),
                created_ms: now_ms(),
                slot: Default::default(),
            })
        });
        (e.fingerprint == fingerprint).then(|| e.clone())
    }

    /// Writes the key's journal entry durably (temp file, fsync, rename, fsync of the dir).
    fn journal(
        &self,
        key: &str,
        entry: &Entry,
        response: Option<&Stored>,
    ) -> Result<(), JournalError> {
        let Some(dir) = &self.dir else { return Ok(()) };
        let j = Journal {
            key: key.to_string(),
            fingerprint: entry.fingerprint.clone(),
            created_ms: entry.created_ms,
            response: response.map(|s| JournalResponse {
                status: s.status.as_u16(),
                headers: s
                    .headers
                    .iter()
                    .filter_map(|(k, v)| Some((k.to_string(), v.to_str().ok()?.to_string())))
                    .collect(),
                body: base64::engine::general_purpose::STANDARD.encode(&s.body),
            }),
        };
        let path = dir.join(tag_of(key));
        let tmp = path.with_extension("tmp");
        let err = |source| JournalError::Write {
            path: path.clone(),
            source,
        };
        let bytes = serde_json::to_vec(&j).map_err(|e| err(e.into()))?;
        let mut f = std::fs::File::create(&tmp).map_err(err)?;
        f.write_all(&bytes)
            .and_then(|()| f.sync_all())
            .map_err(err)?;
        std::fs::rename(&tmp, &path).map_err(err)?;
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(err)
    }
}

/// The sandboxes an earlier attempt of the request tagged `tag` made (a retry after a crash finds them).
pub fn made_by(rt: &Runtime, tag: &str) -> Vec<SandboxInfo> {
    let mut made: Vec<SandboxInfo> = rt
        .list()
        .into_iter()
        .filter(|i| i.spec.labels.get(LABEL).is_some_and(|v| v == tag))
        .collect();
    made.sort_by_key(|i| (i.created_at_ms, i.id.to_string()));
    made
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
                return ApiError::body_too_large().into_response();
            }
            return ApiError::bad_request("invalid_body", "body", e.to_string()).into_response();
        }
    };
    let mut h = Sha256::new();
    for part in [
        parts.method.as_str().as_bytes(),
        parts.uri.path().as_bytes(),
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.update(&bytes);
    let fingerprint = hex(&h.finalize());
    let Some(entry) = app.idempotency.entry(&key, &fingerprint) else {
        return ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_key_reused",
            "this Idempotency-Key was first used for a different request",
        )
        .with_field("Idempotency-Key")
        .into_response();
    };
    // The rest runs on its own task: a client that hangs up mid-request (a killed connection) does not
    // cut the work short, and its retry with the same key waits for this answer instead of running again.
    let work = tokio::spawn(answer(app, key, entry, parts, bytes, next));
    match work.await {
        Ok(resp) => resp,
        Err(e) => ApiError::internal(format!("request task: {e}")).into_response(),
    }
}

/// The stored answer to `key`, or the request run (once) and its answer stored.
async fn answer(
    app: Arc<App>,
    key: String,
    entry: Arc<Entry>,
    mut parts: axum::http::request::Parts,
    bytes: Bytes,
    next: Next,
) -> Response {
    let mut slot = entry.slot.lock().await;
    if let Some(s) = slot.as_ref() {
        let mut resp = (s.status, s.headers.clone(), s.body.clone()).into_response();
        resp.headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
        return resp;
    }
    // On record before anything is made: a crash from here on leaves a key whose retry looks for
    // what this attempt made.
    let journal = {
        let (app, key, entry) = (app.clone(), key.clone(), entry.clone());
        tokio::task::spawn_blocking(move || app.idempotency.journal(&key, &entry, None)).await
    };
    match journal {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return crate::error::journal_error(&e).into_response(),
        Err(e) => return ApiError::internal(format!("journal task: {e}")).into_response(),
    }
    parts.extensions.insert(Tag(tag_of(&key)));
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
        let stored = Stored {
            status,
            headers: rparts.headers.clone(),
            body: body.clone(),
        };
        let journal = {
            let (app, key, entry, s) = (app.clone(), key.clone(), entry.clone(), stored.clone());
            tokio::task::spawn_blocking(move || app.idempotency.journal(&key, &entry, Some(&s)))
                .await
        };
        // The work is done either way; without the record a retry finds what it made by the label.
        match journal {
            Ok(Err(e)) => tracing::warn!("{}", crate::error::chain(&e)),
            Err(e) => tracing::warn!("journal task: {e}"),
            Ok(Ok(())) => {}
        }
        *slot = Some(stored);
    }
    Response::from_parts(rparts, Body::from(body))
}

/// Where the journal lives under a state dir.
pub fn journal_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("idempotency")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_responses_survive_a_reopen() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("idem");
        let a = Idempotency::open(dir.clone());
        let e = a.entry("k1", "fp").unwrap();
        a.journal("k1", &e, None).unwrap();
        let e2 = a.entry("k2", "fp2").unwrap();
        let stored = Stored {
            status: StatusCode::CREATED,
            headers: HeaderMap::from_iter([(
                HeaderName::from_static("content-type"),
                HeaderValue::from_static("application/json"),
            )]),
            body: Bytes::from_static(b"{\"id\":1}"),
        };
        a.journal("k2", &e2, Some(&stored)).unwrap();
        drop(a);
        let b = Idempotency::open(dir);
        // In flight at the "crash": still bound to its request, no response.
        assert!(
            b.entry("k1", "other").is_none(),
            "a reused key stays refused"
        );
        let e = b.entry("k1", "fp").unwrap();
        assert!(e.slot.try_lock().unwrap().is_none());
        let e = b.entry("k2", "fp2").unwrap();
        let s = e.slot.try_lock().unwrap().clone().unwrap();
        assert_eq!(s.status, StatusCode::CREATED);
        assert_eq!(&s.body[..], b"{\"id\":1}");
        assert_eq!(s.headers["content-type"], "application/json");
    }
}
