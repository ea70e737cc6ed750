//! POST /v1/images/pull: an image from an OCI registry into the store. The reference, the
//! credentials and the manifest are settled before anything streams, so those failures are
//! plain 4xx/5xx answers; with `Accept: text/event-stream` (or `?stream=true`) the layers'
//! progress then streams
//! as events (`progress`, then `done` or `error`), else the answer is the image (201).

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use nodefs::service::FsService;
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt as _;

use crate::api_shapes::Image;
use crate::app::{blocking, App};
use crate::backend::{check_new_image_name, BackendError};
use crate::error::{ApiError, ApiResult};
use crate::image_config::{with_config, ImageConfigs};
use crate::registry::pull::{self, Platform, PullEvent, Resolved};
use crate::registry::Reference;
use crate::request_parse::ApiJson;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImagePullRequest {
    /// `[REGISTRY/]REPOSITORY[:TAG][@DIGEST]`.
    pub reference: String,
    /// The image's name here (default: from the reference, e.g. `app-1.0`).
    pub name: Option<String>,
    /// `OS/ARCH[/VARIANT]` picked from an index (default linux/amd64).
    pub platform: Option<String>,
}

pub async fn pull(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
    ApiJson(req): ApiJson<ImagePullRequest>,
) -> ApiResult<Response> {
    let reference = Reference::parse(&req.reference)
        .map_err(|why| ApiError::invalid("reference", format!("{:?}: {why}", req.reference)))?;
    let name = req.name.clone().unwrap_or_else(|| reference.default_name());
    check_new_image_name("name", &name)?;
    let platform = match &req.platform {
        Some(p) => Platform::parse(p).map_err(ApiError::from)?,
        None => Platform::default(),
    };
    let store = app.images.store().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "unsupported",
            "pulls need the nodefs image store",
        )
    })?;
    vacant(store.clone(), &name).await?;
    let resolved = pull::resolve(app.config.registries.clone(), &reference, &platform).await?;
    let streaming = headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("text/event-stream"))
        || query
            .as_deref()
            .unwrap_or("")
            .split('&')
            .any(|kv| kv == "stream=true");
    let configs = app.image_configs.clone();
    if !streaming {
        let (img, _) = finish(store, configs, resolved, name, None).await?;
        return Ok((StatusCode::CREATED, Json(img)).into_response());
    }
    let (tx, rx) = mpsc::unbounded_channel();
    // The pull runs to its end even if the client goes: what it stored serves the next pull.
    tokio::spawn(async move {
        let events = Some(tx.clone());
        match finish(store, configs, resolved, name, events).await {
            Ok((image, f)) => {
                let _ = tx.send(PullEvent::Done {
                    image: Box::new(image),
                    layers_fetched: f.layers_fetched,
                    bytes_fetched: f.bytes_fetched,
                });
            }
            Err(e) => {
                let b = e.body();
                let _ = tx.send(PullEvent::Error {
                    code: b.code,
                    message: b.message,
                    field: b.field,
                });
            }
        }
    });
    let stream = UnboundedReceiverStream::new(rx).map(|e| {
        let kind = match &e {
            PullEvent::Done { .. } => "done",
            PullEvent::Error { .. } => "error",
            _ => "progress",
        };
        Ok::<_, Infallible>(
            Event::default()
                .event(kind)
                .json_data(&e)
                .unwrap_or_else(|_| Event::default().event(kind)),
        )
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

async fn vacant(store: Arc<dyn FsService>, name: &str) -> ApiResult<()> {
    let n = name.to_string();
    let taken = blocking(move || {
        store
            .get_ref(&n)
            .map(|r| r.is_some())
            .map_err(|e| ApiError::from(BackendError::Store(e)))
    })
    .await?;
    if taken {
        return Err(BackendError::Exists {
            what: "image",
            name: name.into(),
        }
        .into());
    }
    Ok(())
}

/// Fetches the layers and names the image, its config written first.
async fn finish(
    store: Arc<dyn FsService>,
    configs: ImageConfigs,
    resolved: Resolved,
    name: String,
    events: pull::Events,
) -> ApiResult<(Image, pull::Fetched)> {
    let fetched = pull::fetch(store.clone(), &resolved, &events).await?;
    let root = fetched
        .root
        .ok_or_else(|| ApiError::internal("a pull without a root"))?;
    let cfg = resolved.config.clone();
    let img = blocking(move || {
        with_config(&configs, &name, Some(&cfg), || {
            // Someone else made an image of this name meanwhile: theirs stays.
            if store.get_ref(&name).map_err(BackendError::Store)?.is_some() {
                return Err(BackendError::Exists {
                    what: "image",
                    name: name.clone(),
                }
                .into());
            }
            store.set_ref(&name, &root).map_err(BackendError::Store)?;
            Ok(Image {
                name: name.clone(),
                root: Some(root.to_hex()),
                size_bytes: store.manifest_bytes(&root).ok(),
                config: None,
            })
        })
    })
    .await?;
    Ok((img, fetched))
}
