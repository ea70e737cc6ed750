//! placeholder
use super::Ctx;
use crate::report::ScenarioResult;
use anyhow::Result;
pub const NAME: &str = "filesystem";
pub const OVERLAY: &str = "overlayfs";
pub const SEQ_READ: &str = "sequential read, cold";
pub const PY_IMPORT: &str = "cold python3 import";
pub const UNTAR: &str = "untar";
pub const FIND_STAT: &str = "find + stat, warm";
pub fn run(_ctx: &Ctx, _res: &mut ScenarioResult) -> Result<()> {
    Ok(())
}
