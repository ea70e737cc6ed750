//! Shared daemon state handed to every handler.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use grove_runtime::Runtime;
use tokio::sync::watch;

use crate::backend::{Images, Snapshots};
use crate::config::Config;
use crate::error::{ApiError, ApiResult};
use crate::events::EventTx;
use crate::idempotency::Idempotency;
use crate::metrics::Metrics;

/// The largest request body read into memory (JSON bodies; an exec's stdin rides in one, base64).
/// Bulk data (files, tars, images, snapshots) streams and is not held to this.
pub const MAX_JSON_BODY: usize = 16 << 20;

pub struct App {
    pub config: Config,
    pub runtime: Arc<Runtime>,
    pub images: Arc<dyn Images>,
    /// The configs images came with (see [`crate::image_config`]).
    pub image_configs: crate::image_config::ImageConfigs,
    pub snapshots: Option<Arc<dyn Snapshots>>,
    /// The `grove-fsd` serving nodefs roots: told to stop when the sandboxes go with groved.
    pub fsd: Option<Arc<nodefs::service::Client>>,
    pub metrics: Metrics,
    pub idempotency: Idempotency,
    pub snapshot_ttls: crate::lifetimes::SnapshotTtls,
    pub events: EventTx,
    /// What the E2B endpoint's access tokens are derived with.
    pub e2b_tokens: crate::e2b::auth::TokenKey,
    draining: AtomicBool,
    /// Flips to true on shutdown; long-lived streams watch it and end.
    pub shutdown: watch::Sender<bool>,
}

impl App {
    pub fn new(
        config: Config,
        runtime: Arc<Runtime>,
        images: Arc<dyn Images>,
        snapshots: Option<Arc<dyn Snapshots>>,
        fsd: Option<Arc<nodefs::service::Client>>,
    ) -> Arc<App> {
        let events = crate::events::channel();
        crate::events::bridge(&runtime, events.clone());
        let idempotency = Idempotency::open(crate::idempotency::journal_dir(&config.state_dir));
        let snapshot_ttls = crate::lifetimes::SnapshotTtls::open(&config.state_dir);
        let image_configs = crate::image_config::ImageConfigs::new(&config.state_dir);
        let e2b_tokens = crate::e2b::auth::TokenKey::open(&config.state_dir);
        Arc::new(App {
            e2b_tokens,
            snapshot_ttls,
            image_configs,
            config,
            runtime,
            images,
            snapshots,
            fsd,
            metrics: Metrics::default(),
            idempotency,
            events,
            draining: AtomicBool::new(false),
            shutdown: watch::channel(false).0,
        })
    }

    pub fn snapshots(&self) -> ApiResult<Arc<dyn Snapshots>> {
        self.snapshots.clone().ok_or_else(|| {
            ApiError::new(
                axum::http::StatusCode::NOT_IMPLEMENTED,
                "unsupported",
                "snapshots need the nodefs root provider and CRIU on this node",
            )
        })
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Stops taking new work: new requests get 503, streams end.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
        let _ = self.shutdown.send(true);
    }

    pub fn emit(&self, e: crate::api_shapes::EventWire) {
        let _ = self.events.send(e);
    }
}

/// Runs blocking runtime work off the async threads.
pub async fn blocking<T, F>(f: F) -> ApiResult<T>
where
    T: Send + 'static,
    F: FnOnce() -> ApiResult<T> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("worker task failed: {e}")))?
}
