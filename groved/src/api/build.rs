//! POST /v1/images/build: the body is the build context as a tar; the answer streams the build's
//! log as server-sent events (`step`, `output`, then `done` or `error`). What is wrong with the
//! request itself (name, parameters, the tar, the Dockerfile) is a 4xx before any step runs.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Once};

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::IntoResponse;
use grove_runtime::NetworkPolicy;
use tokio_stream::wrappers::ReceiverStream;

use crate::api_shapes::{network_from_wire, EgressRuleRequest, Image, NetworkRequest};
use crate::app::{blocking, App};
use crate::backend::check_name;
use crate::build::cache::{CacheError, Pruned};
use crate::build::engine::{BaseError, BuildError, Engine, Inputs, Progress};
use crate::build::{self, ImageConfig};
use crate::error::{chain, ApiError, ApiResult};
use crate::image_config::{with_config, ImageConfigs};
use crate::pipe::ChanReader;
use crate::registry::pull::{self, Platform};
use crate::registry::Reference;
use crate::request_parse::OptionalJson;

/// The build's parameters, from the query string (the body is the context).
struct Params {
    name: String,
    dockerfile: String,
    build_args: BTreeMap<String, String>,
    network: NetworkPolicy,
}

fn params(q: Vec<(String, String)>) -> ApiResult<Params> {
    let mut name = None;
    let mut dockerfile = "Dockerfile".to_string();
    let mut build_args = BTreeMap::new();
    let mut allow = Vec::new();
    for (k, v) in q {
        match k.as_str() {
            "name" => name = Some(v),
            "dockerfile" => {
                if v.is_empty() || v.contains('\0') || v.split('/').any(|c| c == "..") {
                    return Err(ApiError::invalid(
                        "dockerfile",
                        format!("{v:?} is not a path inside the context"),
                    ));
                }
                dockerfile = v;
            }
            "build_arg" => {
                let Some((a, b)) = v.split_once('=') else {
                    return Err(ApiError::invalid("build_arg", format!("{v:?} is not K=V")));
                };
                if a.is_empty() {
                    return Err(ApiError::invalid("build_arg", format!("{v:?}: empty name")));
                }
                build_args.insert(a.to_string(), b.to_string());
            }
            "allow" => allow.push(parse_allow(&v)?),
            other => {
                return Err(ApiError::invalid(
                    other,
                    format!("unknown parameter {other:?}"),
                ))
            }
        }
    }
    let name = name.ok_or_else(|| ApiError::invalid("name", "the image name is required"))?;
    crate::backend::check_new_image_name("name", &name)?;
    let network = if allow.is_empty() {
        NetworkPolicy::None
    } else {
        network_from_wire(&NetworkRequest {
            mode: "egress".into(),
            allow,
        })
        .map_err(|(f, why)| ApiError::invalid("allow", format!("{f}: {why}")))?
    };
    Ok(Params {
        name,
        dockerfile,
        build_args,
        network,
    })
}

/// `CIDR[:PORT,PORT...]`, as `grove create --allow` takes it.
fn parse_allow(a: &str) -> ApiResult<EgressRuleRequest> {
    let (cidr, ports) = match a.rsplit_once(':') {
        Some((c, p)) if !c.contains(':') || c.contains('/') => (c, Some(p)),
        _ => (a, None),
    };
    let ports = match ports {
        Some(p) => p
            .split(',')
            .map(|x| {
                x.parse::<u16>()
                    .map_err(|_| ApiError::invalid("allow", format!("{a:?}: bad port {x:?}")))
            })
            .collect::<ApiResult<Vec<_>>>()?,
        None => Vec::new(),
    };
    Ok(EgressRuleRequest {
        cidr: cidr.to_string(),
        ports,
    })
}

/// Stale views and sandboxes of builds that a crash interrupted go before this process's first.
static CLEAN_STALE: Once = Once::new();

fn engine(app: &App) -> ApiResult<Engine> {
    let store = app.images.store().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "unsupported",
            "builds need the nodefs image store",
        )
    })?;
    Ok(Engine {
        store,
        runtime: app.runtime.clone(),
        mounts: app.config.run_dir.join("build"),
        uppers: app.config.state_dir.join("build"),
        cache: build::cache::Index::new(&app.config.state_dir),
    })
}

/// `POST /v1/images/build-cache/prune` body (all optional): the config's policy unless given;
/// `all` empties the cache.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PruneRequest {
    all: bool,
    max_entries: Option<usize>,
    max_age_secs: Option<u64>,
}

/// Prunes the build step cache now; 409 while a build runs.
pub async fn prune_cache(
    State(app): State<Arc<App>>,
    OptionalJson(r): OptionalJson<PruneRequest>,
) -> ApiResult<axum::Json<Pruned>> {
    let mut policy = app.config.build_cache;
    if r.all {
        policy.max_entries = 0;
    }
    if let Some(n) = r.max_entries.filter(|_| !r.all) {
        policy.max_entries = n;
    }
    if let Some(s) = r.max_age_secs {
        policy.max_age_secs = s;
    }
    let eng = engine(&app)?;
    blocking(move || {
        eng.prune_cache(policy).map_err(|e| match e {
            CacheError::BuildRunning => {
                ApiError::new(StatusCode::CONFLICT, "build_running", e.to_string())
            }
            e => ApiError::internal(e.to_string()),
        })
    })
    .await
    .map(axum::Json)
}

pub async fn build(
    State(app): State<Arc<App>>,
    Query(q): Query<Vec<(String, String)>>,
    body: Body,
) -> ApiResult<impl IntoResponse> {
    let p = params(q)?;
    let eng = Arc::new(engine(&app)?);
    {
        let eng = eng.clone();
        blocking(move || {
            CLEAN_STALE.call_once(|| eng.clean_stale());
            Ok(())
        })
        .await?;
    }
    let active = eng.begin();
    // The context lands in a scratch directory that goes with the build, whatever happens.
    let ctx_parent = eng.uppers.clone();
    let ctx = blocking(move || {
        std::fs::create_dir_all(&ctx_parent)
            .map_err(|e| ApiError::internal(format!("{}: {e}", ctx_parent.display())))?;
        tempfile::Builder::new()
            .prefix("ctx-")
            .tempdir_in(&ctx_parent)
            .map_err(|e| ApiError::internal(format!("context scratch: {e}")))
    })
    .await?;
    let mut reader = ChanReader::spawn(body);
    let (ctx, df, ignore) = {
        let dockerfile = p.dockerfile.clone();
        blocking(move || {
            build::unpack_context(&mut reader, ctx.path())?;
            let df = build::read_dockerfile(ctx.path(), &dockerfile)?;
            let ignore = build::read_ignore(ctx.path());
            Ok((ctx, df, ignore))
        })
        .await?
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    let app2 = app.clone();
    let handle = tokio::runtime::Handle::current();
    let registries = app.config.registries.clone();
    tokio::task::spawn_blocking(move || {
        let send = |ev: Result<Event, axum::Error>| match ev {
            Ok(ev) => tx.blocking_send(Ok(ev)).is_ok(),
            Err(_) => true,
        };
        let (mut ran, mut cached) = (0usize, 0usize);
        let mut emit = |pr: Progress<'_>| match pr {
            Progress::Step {
                step,
                total,
                line,
                text,
                cached: c,
            } => {
                match c {
                    Some(true) => cached += 1,
                    Some(false) => ran += 1,
                    None => {}
                }
                send(Event::default().event("step").json_data(serde_json::json!({
                    "step": step, "total": total, "line": line,
                    "instruction": text, "cached": c,
                })))
            }
            Progress::Output { stderr, data } => send(Event::default().event("output").json_data(
                serde_json::json!({
                    "stream": if stderr { "stderr" } else { "stdout" },
                    "data": String::from_utf8_lossy(data),
                }),
            )),
        };
        let configs = app2.image_configs.clone();
        // A Grove image of that name, else a registry reference, pulled (its layers stay in the
        // store as the pull keeps them; the build needs no name for its base).
        let base = |name: &str| -> Result<(nodefs::ManifestId, Option<ImageConfig>), BaseError> {
            if check_name("from", name).is_ok() {
                match eng.store.get_ref(name) {
                    Ok(Some(id)) => {
                        let cfg = configs.get(name).map_err(BaseError::Config)?;
                        return Ok((id, cfg));
                    }
                    Ok(None) => {}
                    Err(error) => {
                        return Err(BaseError::Store {
                            name: name.into(),
                            error,
                        })
                    }
                }
            }
            let r = Reference::parse(name).map_err(|why| BaseError::NotAReference {
                name: name.into(),
                why,
            })?;
            let resolved = handle
                .block_on(pull::resolve(registries.clone(), &r, &Platform::default()))
                .map_err(|error| BaseError::Resolve {
                    name: name.into(),
                    error: Box::new(error),
                })?;
            let fetched = handle
                .block_on(pull::fetch(eng.store.clone(), &resolved, &None))
                .map_err(|error| BaseError::Fetch {
                    name: name.into(),
                    error: Box::new(error),
                })?;
            let root = fetched
                .root
                .ok_or_else(|| BaseError::NoRoot { name: name.into() })?;
            Ok((root, Some(resolved.config)))
        };
        let inputs = Inputs {
            context: ctx.path(),
            ignore: &ignore,
            build_args: &p.build_args,
            network: &p.network,
            base: &base,
        };
        let res = eng.build(&df, &inputs, &mut emit);
        let ev = match res {
            Ok((root, cfg)) => Some(match finish(&eng, &configs, &p.name, &root, &cfg) {
                Ok(img) => Event::default().event("done").json_data(serde_json::json!({
                    "image": img,
                    "steps_run": ran, "steps_cached": cached,
                })),
                Err(e) => Event::default().event("error").json_data(e.body()),
            }),
            Err(BuildError::Cancelled) => None,
            Err(e) => Some(Event::default().event("error").json_data(error_body(&e))),
        };
        // The scratch goes before the last event: a client that sees the end sees no residue.
        drop(ctx);
        drop(active);
        // The cache stays within its bound (another build under way: its end prunes).
        match eng.prune_cache(app2.config.build_cache) {
            Ok(p) if p.removed > 0 => {
                tracing::info!(removed = p.removed, kept = p.kept, "pruned the build cache")
            }
            Ok(_) | Err(CacheError::BuildRunning) => {}
            Err(e) => tracing::warn!("pruning the build cache: {e}"),
        }
        if let Some(Ok(ev)) = ev {
            let _ = tx.blocking_send(Ok(ev));
        }
    });
    Ok(Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default()))
}

/// The finished root becomes image `name` (replacing one of that name, as a tag moves).
/// Its config is written first (see [`with_config`]), so the image never lacks it.
fn finish(
    eng: &Engine,
    configs: &ImageConfigs,
    name: &str,
    root: &nodefs::ManifestId,
    cfg: &ImageConfig,
) -> ApiResult<Image> {
    // Where a base image came from is not where this one did.
    let mut cfg = cfg.clone();
    cfg.source = None;
    cfg.digest = None;
    cfg.layers.clear();
    with_config(configs, name, Some(&cfg), || {
        eng.store
            .set_ref(name, root)
            .map_err(|e| ApiError::internal(format!("naming the image: {}", chain(&e))))?;
        Ok(Image {
            name: name.to_string(),
            root: Some(root.to_hex()),
            size_bytes: eng.store.manifest_bytes(root).ok(),
            config: None,
        })
    })
}

fn error_body(e: &BuildError) -> serde_json::Value {
    let msg = e.to_string();
    let code = if msg.contains("os error 28") || msg.contains("No space left") {
        "insufficient_storage"
    } else {
        "build_failed"
    };
    let mut v = serde_json::json!({ "code": code, "message": msg, "field": "dockerfile" });
    match e {
        BuildError::Step { step, line, .. } => {
            v["step"] = (*step).into();
            v["line"] = (*line).into();
        }
        BuildError::Line { line, .. } => v["line"] = (*line).into(),
        BuildError::Cancelled => {}
    }
    v
}
