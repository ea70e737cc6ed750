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
    /// The `grove-fsd` serving nodefs roots (none with overlay roots).
    pub fsd: Option<Arc<nodefs::service::Client>>,
}

/// `in_process`: nodefs roots served by this process (a one-shot `grove run`), not by `grove-fsd`.
pub fn build(config: &Config, in_process: bool) -> anyhow::Result<Backend> {
    std::fs::create_dir_all(&config.state_dir)
        .with_context(|| format!("creating {}", config.state_dir.display()))?;
    lock_state_dir(config)?;
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
                fsd: None,
            })
        }
        RootKind::Nodefs => crate::nodefs_backend::build(config, in_process),
    }
}

/// One groved per state dir: a second must fail before its recovery touches the first one's sandboxes
/// (the store's own lock is grove-fsd's now, and both would reach the same fsd). Held until exit.
fn lock_state_dir(config: &Config) -> anyhow::Result<()> {
    use nix::fcntl::{Flock, FlockArg};
    let path = config.state_dir.join("groved.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    let Ok(lock) = Flock::lock(f, FlockArg::LockExclusiveNonblock) else {
        anyhow::bail!(
            "{} is locked: another groved uses {}",
            path.display(),
            config.state_dir.display()
        );
    };
    // The lock lives as long as the process.
    std::mem::forget(lock);
    Ok(())
}
