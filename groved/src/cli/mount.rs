//! `grove mount IMAGE DIR [--commit NAME]`: a writable nodefs view of an image, served until Ctrl-C or SIGTERM,
//! straight from the store (no daemon; don't run it against a store a live groved has open).

use std::path::PathBuf;

use nodefs::{MountOptions, NodeFs, Store};
use tokio::signal::unix::{signal, SignalKind};

use super::{CliError, CliResult};
use crate::error::chain;

#[derive(clap::Args, Debug)]
pub struct MountArgs {
    pub image: String,
    pub dir: PathBuf,
    /// On exit, commit the writes as a new image with this name.
    #[arg(long)]
    pub commit: Option<String>,
    /// The state directory holding the store.
    #[arg(long, default_value = crate::config::DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// Where the mount's scratch (upper) layer goes.
    #[arg(long, default_value = crate::config::DEFAULT_RUN_DIR)]
    pub run_dir: PathBuf,
}

fn other(e: impl std::error::Error) -> CliError {
    CliError::Other(chain(&e))
}

pub async fn run(a: MountArgs) -> CliResult {
    if let Some(n) = &a.commit {
        crate::backend::check_name("commit", n).map_err(|e| CliError::Usage(e.to_string()))?;
    }
    if !a.dir.is_dir() {
        return Err(CliError::Usage(format!(
            "{} is not a directory",
            a.dir.display()
        )));
    }
    let state = a.state_dir.clone();
    let upper = a
        .run_dir
        .join("mounts")
        .join(format!("grove-mount-{}", std::process::id()));
    let (dir, image) = (a.dir.clone(), a.image.clone());
    let mounted = tokio::task::spawn_blocking(move || -> CliResult<_> {
        let store = Store::open(&state.join("store")).map_err(other)?;
        let base = store.resolve(&image).map_err(other)?;
        let fs = NodeFs::new(store.clone());
        let opts = MountOptions {
            quota_bytes: None,
            quota_inodes: None,
            upper_dir: upper,
            read_only: false,
            passthrough: true,
            uring: true,
            id_shift: None,
        };
        let m = fs.mount(&base, &dir, opts).map_err(other)?;
        Ok((store, fs, m))
    })
    .await
    .map_err(|e| CliError::Other(e.to_string()))??;
    eprintln!(
        "grove: {} mounted at {}; Ctrl-C to unmount",
        a.image,
        a.dir.display()
    );
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    let commit = a.commit.clone();
    tokio::task::spawn_blocking(move || -> CliResult {
        let (store, _fs, m) = mounted;
        let committed = match &commit {
            Some(name) => m.commit().map_err(other).and_then(|id| {
                store.set_ref(name, &id).map_err(other)?;
                Ok(Some((name.clone(), id)))
            }),
            None => Ok(None),
        };
        m.unmount().map_err(other)?;
        if let Some((name, id)) = committed? {
            println!("{name} {}", id.to_hex());
        }
        Ok(())
    })
    .await
    .map_err(|e| CliError::Other(e.to_string()))?
}
