//! Images in nodefs and snapshots through the snapshotter.

use anyhow::bail;

use crate::config::Config;
use crate::wiring::Backend;

pub fn build(_config: &Config) -> anyhow::Result<Backend> {
    bail!("the nodefs root provider is not wired yet; run with --root-provider overlay")
}
