//! placeholder
use super::Ctx;
use crate::report::ScenarioResult;
use anyhow::Result;
pub const NAME: &str = "storage";
pub const REIMPORT: &str = "second import";
pub const CHAIN_RATIO: &str = "chain";
pub fn run(_ctx: &Ctx, _res: &mut ScenarioResult) -> Result<()> {
    Ok(())
}
