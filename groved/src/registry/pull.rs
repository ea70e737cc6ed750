//! A pull: resolve the reference to an image manifest (through an index to the platform asked
//! for), read its config, then stream each layer the store lacks from the wire into the store.
//!
//! Layers are kept by chain: `grove/layers/<chain>` names the tree of the image as of that
//! layer, `chain` hashing the layer digests from the bottom up. A pull starts from the deepest
//! chain the store holds, so a layer already pulled (by this image, an image sharing its
//! lower layers, or an interrupted pull of it) is not fetched again, and concurrent pulls wait
//! for each other's layer rather than fetching it twice.

use std::collections::{HashMap, HashSet};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use axum::http::{header, StatusCode};
use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use nodefs::service::FsService;
use nodefs::{LayerCompression, ManifestId};
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest as _, Sha256};
use tokio::sync::mpsc;

use super::http::{read_small, snippet, Registry};
use super::reference::{valid_digest, Reference};
use super::RegistriesConfig;
use crate::error::ApiError;
use crate::image_config::ImageConfig;

/// Under this prefix, one ref per layer chain (see the module doc).
pub const LAYER_REF_PREFIX: &str = "grove/layers/";
/// A blob body that sends nothing for this long is given up.
const BODY_IDLE: Duration = Duration::from_secs(60);
/// More layers than any real image has; a bound on a hostile manifest.
const MAX_LAYERS: usize = 256;
/// How often (bytes) a layer's progress is reported.
const PROGRESS_EVERY: u64 = 4 << 20;

const ACCEPT_MANIFESTS: &str = "application/vnd.oci.image.index.v1+json, \
    application/vnd.oci.image.manifest.v1+json, \
    application/vnd.docker.distribution.manifest.list.v2+json, \
    application/vnd.docker.distribution.manifest.v2+json";

#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("{field} {value:?}: {why}")]
    Invalid {
        field: &'static str,
        value: String,
        why: String,
    },
    #[error("{what} not found in {registry}")]
    NotFound { registry: String, what: String },
    #[error("{registry} refused access: {why}")]
    Denied { registry: String, why: String },
    #[error("cannot reach registry {registry}: {why}")]
    Unreachable { registry: String, why: String },
    #[error(
        "registry {registry} is not trusted: {why} (a registry behind a private CA needs its \
         certificate in [registries] ca_files; a plain-HTTP one, its host in insecure)"
    )]
    Untrusted { registry: String, why: String },
    #[error("registry {registry} sent a bad {what}: {why}")]
    Protocol {
        registry: String,
        what: String,
        why: String,
    },
    #[error(
        "{what} from {registry} does not match its digest {want} (its content hashes to {got})"
    )]
    Digest {
        registry: String,
        what: String,
        want: String,
        got: String,
    },
    #[error("{reference} has no image for platform {platform} (it has {have})")]
    NoPlatform {
        reference: String,
        platform: String,
        have: String,
    },
    #[error("{0}")]
    Api(ApiError),
}

impl From<PullError> for ApiError {
    fn from(e: PullError) -> ApiError {
        let msg = e.to_string();
        let (status, code, field) = match &e {
            PullError::Api(a) => return a.clone(),
            PullError::Invalid { field, .. } => {
                (StatusCode::UNPROCESSABLE_ENTITY, "invalid_spec", *field)
            }
            PullError::NotFound { .. } => (StatusCode::NOT_FOUND, "image_not_found", "reference"),
            PullError::Denied { .. } => (StatusCode::FORBIDDEN, "registry_denied", "reference"),
            PullError::Unreachable { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "registry_unreachable",
                "reference",
            ),
            PullError::Untrusted { .. } => {
                (StatusCode::BAD_GATEWAY, "registry_untrusted", "reference")
            }
            PullError::Protocol { .. } => (StatusCode::BAD_GATEWAY, "registry_error", "reference"),
            PullError::Digest { .. } => (StatusCode::BAD_GATEWAY, "digest_mismatch", "reference"),
            PullError::NoPlatform { .. } => (StatusCode::NOT_FOUND, "no_such_platform", "platform"),
        };
        ApiError::new(status, code, msg).with_field(field)
    }
}

/// `OS/ARCH[/VARIANT]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Platform {
    pub os: String,
    pub arch: String,
    pub variant: Option<String>,
}

impl Platform {
    pub fn parse(s: &str) -> Result<Platform, PullError> {
        let bad = |why: &str| PullError::Invalid {
            field: "platform",
            value: s.into(),
            why: why.into(),
        };
        let parts: Vec<&str> = s.split('/').collect();
        let ok = |p: &str| {
            !p.is_empty()
                && p.len() <= 32
                && p.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        };
        if !(2..=3).contains(&parts.len()) || !parts.iter().all(|p| ok(p)) {
            return Err(bad("is not OS/ARCH[/VARIANT] of [a-z0-9_]"));
        }
        Ok(Platform {
            os: parts[0].into(),
            arch: parts[1].into(),
            variant: parts.get(2).map(|v| v.to_string()),
        })
    }

    fn matches(&self, p: &Value) -> bool {
        p["os"].as_str() == Some(&self.os)
            && p["architecture"].as_str() == Some(&self.arch)
            && self
                .variant
                .as_ref()
                .is_none_or(|v| p["variant"].as_str() == Some(v))
    }
}

impl Default for Platform {
    fn default() -> Platform {
        Platform {
            os: "linux".into(),
            arch: "amd64".into(),
            variant: None,
        }
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.arch)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// Progress of a pull, as the API streams it.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum PullEvent {
    Resolved {
        reference: String,
        digest: String,
        layers: usize,
        bytes: u64,
    },
    Layer {
        digest: String,
        size: u64,
        /// In the store already: not fetched.
        cached: bool,
    },
    Progress {
        digest: String,
        bytes: u64,
        size: u64,
    },
    Done {
        image: Box<crate::api_shapes::Image>,
        layers_fetched: usize,
        bytes_fetched: u64,
    },
    Error {
        code: String,
        message: String,
        field: Option<String>,
    },
}

pub type Events = Option<mpsc::UnboundedSender<PullEvent>>;

fn emit(events: &Events, e: PullEvent) {
    if let Some(tx) = events {
        let _ = tx.send(e);
    }
}

#[derive(Debug, Clone)]
pub struct Layer {
    pub digest: String,
    pub size: u64,
    pub compression: LayerCompression,
}

/// An image manifest found and read: what is left is fetching its layers.
pub struct Resolved {
    registry: Registry,
    pub reference: Reference,
    pub digest: String,
    pub config: ImageConfig,
    pub layers: Vec<Layer>,
}

/// What [`fetch`] did.
#[derive(Default)]
pub struct Fetched {
    pub root: Option<ManifestId>,
    pub layers_fetched: usize,
    pub bytes_fetched: u64,
    /// Keeps `root` through gc until the image's ref names it.
    pub hold: Option<Pinned>,
}

/// A manifest pinned in the store (kept by gc) until dropped: the tree a pull builds on must
/// not be collected while the next layer is fetched, even if an image delete drops its ref.
pub struct Pinned {
    store: Arc<dyn FsService>,
    id: ManifestId,
}

impl Pinned {
    /// Pins `id` if the store still holds it whole; None if it does not (collected meanwhile).
    async fn take(store: &Arc<dyn FsService>, id: ManifestId) -> Result<Option<Pinned>, PullError> {
        let s = store.clone();
        blocking(move || {
            s.pin(&id).map_err(store_api)?;
            let pinned = Pinned { store: s, id };
            // A gc between reading the ref and pinning may have taken it.
            match pinned.store.lacking(&[id]).map_err(store_api)? {
                l if l.is_empty() => Ok(Some(pinned)),
                _ => Ok(None),
            }
        })
        .await
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.store.unpin(&self.id);
    }
}

fn endpoint(registry: &str) -> &str {
    if registry == "docker.io" {
        "registry-1.docker.io"
    } else {
        registry
    }
}

fn sha256_hex(b: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(b)))
}

/// Finds the image: the registry's mirrors in order, then the registry itself.
pub async fn resolve(
    cfg: Arc<RegistriesConfig>,
    r: &Reference,
    platform: &Platform,
) -> Result<Resolved, PullError> {
    let mut hosts: Vec<String> = cfg.mirrors.get(&r.registry).cloned().unwrap_or_default();
    hosts.push(endpoint(&r.registry).to_string());
    let mut last = None;
    for (i, host) in hosts.iter().enumerate() {
        let is_last = i + 1 == hosts.len();
        let reg = match Registry::new(cfg.clone(), host, &r.repository) {
            Ok(reg) => reg,
            Err(e) if !is_last => {
                tracing::warn!(mirror = %host, "skipping a mirror: {e}");
                last = Some(e);
                continue;
            }
            Err(e) => return Err(e),
        };
        match resolve_at(reg, r, platform).await {
            Ok(res) => return Ok(res),
            // A mirror that lacks the image or is down gives way to the next.
            Err(e) if !is_last => {
                tracing::warn!(mirror = %host, "mirror failed, trying the next: {e}");
                last = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| PullError::NotFound {
        registry: r.registry.clone(),
        what: r.to_string(),
    }))
}

async fn resolve_at(
    reg: Registry,
    r: &Reference,
    platform: &Platform,
) -> Result<Resolved, PullError> {
    let protocol = |what: &str, why: String| PullError::Protocol {
        registry: reg.host.clone(),
        what: what.into(),
        why,
    };
    let (mut doc, mut digest) = fetch_manifest(&reg, r, r.wanted(), r.digest.as_deref()).await?;
    // An index: the platform's manifest (one level; an index of indexes is not an image).
    if let Some(ms) = doc.get("manifests").and_then(Value::as_array) {
        let pick = ms
            .iter()
            .find(|m| platform.matches(&m["platform"]))
            .ok_or_else(|| PullError::NoPlatform {
                reference: r.to_string(),
                platform: platform.to_string(),
                have: ms
                    .iter()
                    .filter_map(|m| {
                        let p = &m["platform"];
                        Some(format!(
                            "{}/{}",
                            p["os"].as_str()?,
                            p["architecture"].as_str()?
                        ))
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        let d = pick["digest"]
            .as_str()
            .filter(|d| valid_digest(d))
            .ok_or_else(|| protocol("index", "an entry without a sha256 digest".into()))?
            .to_string();
        (doc, digest) = fetch_manifest(&reg, r, &d, Some(&d)).await?;
        if doc.get("manifests").is_some() {
            return Err(protocol("index", format!("{d} is an index, not an image")));
        }
    }
    if doc["schemaVersion"].as_i64() == Some(1) {
        return Err(protocol(
            "manifest",
            "Docker schema 1 manifests are not supported".into(),
        ));
    }
    let config_digest = doc["config"]["digest"]
        .as_str()
        .filter(|d| valid_digest(d))
        .ok_or_else(|| protocol("manifest", "no config with a sha256 digest".into()))?
        .to_string();
    let layers_v = doc["layers"]
        .as_array()
        .ok_or_else(|| protocol("manifest", "no layers list".into()))?;
    if layers_v.len() > MAX_LAYERS {
        return Err(protocol(
            "manifest",
            format!("{} layers (at most {MAX_LAYERS})", layers_v.len()),
        ));
    }
    let mut layers = Vec::with_capacity(layers_v.len());
    for (i, l) in layers_v.iter().enumerate() {
        let d = l["digest"]
            .as_str()
            .filter(|d| valid_digest(d))
            .ok_or_else(|| protocol("manifest", format!("layer {i} has no sha256 digest")))?;
        let media = l["mediaType"].as_str().unwrap_or("");
        let compression = LayerCompression::from_media_type(media).ok_or_else(|| {
            protocol(
                "manifest",
                format!("layer {d} has media type {media:?}, not a tar layer"),
            )
        })?;
        layers.push(Layer {
            digest: d.into(),
            size: l["size"].as_u64().unwrap_or(0),
            compression,
        });
    }
    let what = format!("config blob {config_digest}");
    let resp = reg.get(&format!("blobs/{config_digest}"), "").await?;
    let body = small_ok(&reg, resp, &what).await?;
    let got = sha256_hex(&body);
    if got != config_digest {
        return Err(PullError::Digest {
            registry: reg.host.clone(),
            what,
            want: config_digest,
            got,
        });
    }
    let cdoc: Value =
        serde_json::from_slice(&body).map_err(|e| protocol(&what, format!("not JSON: {e}")))?;
    let mut config =
        ImageConfig::from_oci(&cdoc).map_err(|why| protocol(&what, why.to_string()))?;
    config.source = Some(r.to_string());
    config.digest = Some(digest.clone());
    config.layers = layers.iter().map(|l| l.digest.clone()).collect();
    Ok(Resolved {
        registry: reg,
        reference: r.clone(),
        digest,
        config,
        layers,
    })
}

/// A small body of a 2xx answer; 404 and 401/403 become their errors.
async fn small_ok(
    reg: &Registry,
    resp: hyper::Response<Incoming>,
    what: &str,
) -> Result<Bytes, PullError> {
    let status = resp.status();
    let body = read_small(resp.into_body())
        .await
        .map_err(|why| PullError::Protocol {
            registry: reg.host.clone(),
            what: what.into(),
            why,
        })?;
    check_status(reg, status, &body, what)?;
    Ok(body)
}

fn check_status(
    reg: &Registry,
    status: StatusCode,
    body: &[u8],
    what: &str,
) -> Result<(), PullError> {
    if status.is_success() {
        return Ok(());
    }
    Err(status_error(reg, status, body, what))
}

/// The error a non-2xx answer about `what` stands for.
fn status_error(reg: &Registry, status: StatusCode, body: &[u8], what: &str) -> PullError {
    match status {
        StatusCode::NOT_FOUND => PullError::NotFound {
            registry: reg.host.clone(),
            what: what.into(),
        },
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => PullError::Denied {
            registry: reg.host.clone(),
            why: format!("{what}: {} {}", status.as_u16(), snippet(body)),
        },
        s if s.is_server_error() || s == StatusCode::TOO_MANY_REQUESTS => PullError::Unreachable {
            registry: reg.host.clone(),
            why: format!("{what}: {} {}", s.as_u16(), snippet(body)),
        },
        s => PullError::Protocol {
            registry: reg.host.clone(),
            what: what.into(),
            why: format!("answered {} {}", s.as_u16(), snippet(body)),
        },
    }
}

/// A manifest or index by tag or digest, its digest checked: against `want` when the
/// reference pins one, and against what the registry says it is.
async fn fetch_manifest(
    reg: &Registry,
    r: &Reference,
    wanted: &str,
    want: Option<&str>,
) -> Result<(Value, String), PullError> {
    let what = format!("manifest {}:{wanted}", r.repository);
    let resp = reg
        .get(&format!("manifests/{wanted}"), ACCEPT_MANIFESTS)
        .await?;
    let claimed = resp
        .headers()
        .get("docker-content-digest")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let ctype = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = small_ok(reg, resp, &what).await?;
    let got = sha256_hex(&body);
    for w in want
        .into_iter()
        .chain(claimed.as_deref().filter(|c| valid_digest(c)))
    {
        if w != got {
            return Err(PullError::Digest {
                registry: reg.host.clone(),
                what,
                want: w.into(),
                got,
            });
        }
    }
    let doc: Value = serde_json::from_slice(&body).map_err(|e| PullError::Protocol {
        registry: reg.host.clone(),
        what: what.clone(),
        why: format!("not JSON ({ctype}): {e}"),
    })?;
    if !doc.is_object() {
        return Err(PullError::Protocol {
            registry: reg.host.clone(),
            what,
            why: "not a JSON object".into(),
        });
    }
    Ok((doc, got))
}

/// One lock per layer chain: a second pull of the same layers waits, then finds them stored.
fn chain_lock(chain: &str) -> Arc<tokio::sync::Mutex<()>> {
    static LOCKS: LazyLock<parking_lot::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>> =
        LazyLock::new(Default::default);
    let mut m = LOCKS.lock();
    m.retain(|_, l| Arc::strong_count(l) > 1);
    m.entry(chain.to_string()).or_default().clone()
}

/// The chain ids of `layers` (digests, bottom first), one per layer.
pub fn chains(layers: &[String]) -> Vec<String> {
    let mut chain = String::new();
    layers
        .iter()
        .map(|d| {
            chain = hex::encode(Sha256::digest(format!("{chain} {d}")));
            chain.clone()
        })
        .collect()
}

/// A store failure is the node's, mapped where every backend error is.
fn store_api(e: nodefs::Error) -> PullError {
    PullError::Api(crate::backend::BackendError::Store(e).into())
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, PullError> + Send + 'static,
) -> Result<T, PullError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| PullError::Api(ApiError::internal(format!("worker task failed: {e}"))))?
}

/// Fetches the layers the store lacks, bottom up, each into the store as it streams; returns
/// the image's root.
pub async fn fetch(
    store: Arc<dyn FsService>,
    res: &Resolved,
    events: &Events,
) -> Result<Fetched, PullError> {
    emit(
        events,
        PullEvent::Resolved {
            reference: res.reference.to_string(),
            digest: res.digest.clone(),
            layers: res.layers.len(),
            bytes: res.layers.iter().map(|l| l.size).sum(),
        },
    );
    let digests: Vec<String> = res.layers.iter().map(|l| l.digest.clone()).collect();
    let mut out = Fetched::default();
    let mut base: Option<ManifestId> = None;
    let mut hold: Option<Pinned> = None;
    for (layer, chain) in res.layers.iter().zip(chains(&digests)) {
        let name = format!("{LAYER_REF_PREFIX}{chain}");
        let lock = chain_lock(&chain);
        let _held = lock.lock().await;
        let have = {
            let (store, name) = (store.clone(), name.clone());
            blocking(move || store.get_ref(&name).map_err(store_api)).await?
        };
        let pinned = match have {
            Some(id) => Pinned::take(&store, id).await?,
            None => None,
        };
        emit(
            events,
            PullEvent::Layer {
                digest: layer.digest.clone(),
                size: layer.size,
                cached: pinned.is_some(),
            },
        );
        if let Some(p) = pinned {
            base = Some(p.id);
            hold = Some(p);
            continue;
        }
        let what = format!("blob {}", layer.digest);
        let resp = res
            .registry
            .get(&format!("blobs/{}", layer.digest), "")
            .await?;
        if !resp.status().is_success() {
            let status = resp.status();
            let body = read_small(resp.into_body()).await.unwrap_or_default();
            return Err(status_error(&res.registry, status, &body, &what));
        }
        let counted = Arc::new(AtomicU64::new(0));
        let mut reader = BlobReader::spawn(
            resp.into_body(),
            layer.clone(),
            res.registry.host.clone(),
            counted.clone(),
            events.clone(),
        );
        let id = {
            let (store, layer, host) = (store.clone(), layer.clone(), res.registry.host.clone());
            blocking(move || {
                store
                    .apply_layer(
                        base.as_ref(),
                        layer.compression,
                        Some(&layer.digest),
                        &mut reader,
                    )
                    .map_err(|e| layer_err(&host, &layer.digest, e))
            })
            .await?
        };
        {
            let (store, name) = (store.clone(), name.clone());
            blocking(move || store.set_ref(&name, &id).map_err(store_api)).await?;
        }
        out.layers_fetched += 1;
        out.bytes_fetched += counted.load(Ordering::Relaxed);
        // The ref keeps it unless an image delete drops it meanwhile: the pin does regardless.
        hold = Pinned::take(&store, id).await?.or(hold);
        base = Some(id);
    }
    let root = match base {
        Some(b) => b,
        // No layers: an empty root.
        None => {
            blocking(move || {
                store
                    .apply_layer(None, LayerCompression::None, None, &mut io::empty())
                    .map_err(store_api)
            })
            .await?
        }
    };
    out.root = Some(root);
    out.hold = hold;
    Ok(out)
}

fn layer_err(host: &str, digest: &str, e: nodefs::Error) -> PullError {
    match e {
        nodefs::Error::BadLayer { why, .. } if why.contains("does not match") => {
            PullError::Digest {
                registry: host.into(),
                what: format!("blob {digest}"),
                want: digest.into(),
                got: "different content".into(),
            }
        }
        nodefs::Error::BadLayer { why, .. } => PullError::Protocol {
            registry: host.into(),
            what: format!("blob {digest}"),
            why,
        },
        nodefs::Error::BadStream(why) => PullError::Unreachable {
            registry: host.into(),
            why: format!("blob {digest}: {why}"),
        },
        other => store_api(other),
    }
}

/// A blocking reader over a blob's body, pumped by an async task that counts, reports
/// progress, and gives up on a body that stalls.
struct BlobReader {
    rx: mpsc::Receiver<io::Result<Bytes>>,
    cur: Bytes,
}

impl BlobReader {
    fn spawn(
        mut body: Incoming,
        layer: Layer,
        host: String,
        counted: Arc<AtomicU64>,
        events: Events,
    ) -> BlobReader {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let mut next_report = PROGRESS_EVERY;
            loop {
                let frame = match tokio::time::timeout(BODY_IDLE, body.frame()).await {
                    Ok(Some(Ok(f))) => f,
                    Ok(None) => break,
                    Ok(Some(Err(e))) => {
                        let n = counted.load(Ordering::Relaxed);
                        let why = format!(
                            "{host} broke off blob {} after {n} bytes: {}",
                            layer.digest,
                            crate::error::chain(&e)
                        );
                        let _ = tx.send(Err(io::Error::other(why))).await;
                        break;
                    }
                    Err(_) => {
                        let why = format!(
                            "{host} sent nothing of blob {} for {BODY_IDLE:?}",
                            layer.digest
                        );
                        let _ = tx.send(Err(io::Error::other(why))).await;
                        break;
                    }
                };
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                let n = counted.fetch_add(data.len() as u64, Ordering::Relaxed) + data.len() as u64;
                if n >= next_report {
                    next_report = n + PROGRESS_EVERY;
                    emit(
                        &events,
                        PullEvent::Progress {
                            digest: layer.digest.clone(),
                            bytes: n,
                            size: layer.size,
                        },
                    );
                }
                if tx.send(Ok(data)).await.is_err() {
                    break;
                }
            }
        });
        BlobReader {
            rx,
            cur: Bytes::new(),
        }
    }
}

impl io::Read for BlobReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(b)) => self.cur = b,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.cur.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        self.cur = self.cur.slice(n..);
        Ok(n)
    }
}

/// After an image made of `gone` (layer digests) is deleted: drops its layer refs that no
/// other image's layers (`keep`) reach, so gc can free their content. Layers an interrupted
/// pull kept are not touched: the next pull of that image starts from them.
pub fn sweep_layers(
    store: &dyn FsService,
    gone: &[String],
    keep: &[Vec<String>],
) -> Result<usize, nodefs::Error> {
    let keep: HashSet<String> = keep.iter().flat_map(|l| chains(l)).collect();
    let mut n = 0;
    for c in chains(gone) {
        if !keep.contains(&c) {
            store.delete_ref(&format!("{LAYER_REF_PREFIX}{c}"))?;
            n += 1;
        }
    }
    Ok(n)
}
