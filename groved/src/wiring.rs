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
    /// The `grove-fsd` serving nodefs roots (none with overlay roots).
    pub fsd: Option<Arc<nodefs::service::Client>>,
}

/// `in_process`: nodefs roots served by this process (a one-shot `grove run`), not by `grove-fsd`.
pub fn build(config: &Config, in_process: bool) -> anyhow::Result<Backend> {
    std::fs::create_dir_all(&config.state_dir)
        .with_context(|| format!("creating {}", config.state_dir.display()))?;
    lock_state_dir(config)?;
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
                fsd: None,
            })
        }
        RootKind::Nodefs => crate::nodefs_backend::build(config, in_process),
    }
}

/// One groved per state dir: a second must fail before its recovery touches the first one's sandboxes
/// (the store's own lock is grove-fsd's now, and both would reach the same fsd). Held until exit.
fn lock_state_dir(config: &Config) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd as _;
    let path = config.state_dir.join("groved.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        anyhow::bail!(
            "{} is locked: another groved uses {}",
            path.display(),
            config.state_dir.display()
        );
    }
    // The lock lives as long as the process.
    std::mem::forget(f);
    Ok(())
}

/// Sandboxes map grove-init from `<run_dir>/grove-init`, a private copy made at start: replacing the installed
/// binary (an upgrade, a rebuild) while sandboxes run would otherwise break their checkpoints, since CRIU
/// validates every mapped file at dump and restore. A copy with the same bytes is kept as it is.
fn private_init(config: &Config) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(&config.run_dir)
        .with_context(|| format!("creating {}", config.run_dir.display()))?;
    let dst = config.run_dir.join("grove-init");
    // Sandboxes adopted across a restart map the copy there: replacing it with the same bytes
    // would turn their mapping into a deleted file, which CRIU cannot checkpoint.
    if let (Ok(a), Ok(b)) = (std::fs::read(&config.init_binary), std::fs::read(&dst)) {
        if a == b {
            return Ok(dst);
        }
    }
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
