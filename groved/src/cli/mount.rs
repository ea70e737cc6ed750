//! `grove mount IMAGE DIR [--commit NAME]`: a writable nodefs view of an image, served until Ctrl-C.

use std::path::PathBuf;

use super::{CliError, CliResult};

#[derive(clap::Args, Debug)]
pub struct MountArgs {
    pub image: String,
    pub dir: PathBuf,
    /// On exit, commit the writes as a new image with this name.
    #[arg(long)]
    pub commit: Option<String>,
    /// The store's state directory.
    #[arg(long, default_value = "/var/lib/grove")]
    pub state_dir: PathBuf,
}

pub fn run(_a: MountArgs) -> CliResult {
    Err(CliError::Other(
        "grove mount needs nodefs, which this build does not include yet".into(),
    ))
}
