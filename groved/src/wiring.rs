//! Builds the pieces groved serves: the content store and FUSE server (nodefs), the runtime over it, and the
//! snapshotter; or the runtime over plain overlayfs image directories.

use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;
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
    let mut own = config.clone();
    own.init_binary = private_init(config)?;
    let config = &own;
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

/// Sandboxes map grove-init from `<run_dir>/grove-init`, a private copy made at start: replacing the installed
/// binary (an upgrade, a rebuild) while sandboxes run would otherwise break their checkpoints, since CRIU
/// validates every mapped file at dump and restore.
fn private_init(config: &Config) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(&config.run_dir)
        .with_context(|| format!("creating {}", config.run_dir.display()))?;
    let dst = config.run_dir.join("grove-init");
    let tmp = config
        .run_dir
        .join(format!(".grove-init.{}", std::process::id()));
    std::fs::copy(&config.init_binary, &tmp).with_context(|| {
        format!(
            "copying {} to {}",
            config.init_binary.display(),
            tmp.display()
        )
    })?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&tmp, &dst).with_context(|| format!("installing {}", dst.display()))?;
    Ok(dst)
}
