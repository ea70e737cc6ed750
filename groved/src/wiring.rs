//! Builds the pieces groved serves: the content store and FUSE server (nodefs), the runtime over it, and the
//! snapshotter; or the runtime over plain overlayfs image directories.

use std::sync::Arc;

use anyhow::Context as _;
use grove_runtime::{OverlayRoot, Runtime};

use crate::backend::{Images, OverlayImages, Snapshots};
use crate::config::{Config, RootKind};

pub struct Backend {
    pub runtime: Arc<Runtime>,
    pub images: Arc<dyn Images>,
    pub snapshots: Option<Arc<dyn Snapshots>>,
}

pub fn build(config: &Config) -> anyhow::Result<Backend> {
    std::fs::create_dir_all(&config.state_dir)
        .with_context(|| format!("creating {}", config.state_dir.display()))?;
    match config.root {
        RootKind::Overlay => {
            let images = Arc::new(
                OverlayImages::new(&config.state_dir).context("opening the image directory")?,
            );
            let roots = Arc::new(OverlayRoot::new(&config.state_dir));
            let runtime =
                Runtime::new(config.runtime_config(), roots).context("starting the runtime")?;
            Ok(Backend {
                runtime,
                images,
                snapshots: None,
            })
        }
        RootKind::Nodefs => crate::nodefs_backend::build(config),
    }
}
