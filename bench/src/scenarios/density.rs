//! placeholder
use super::Ctx;
use crate::report::ScenarioResult;
use anyhow::Result;
pub const NAME: &str = "density";
pub const PER_SANDBOX: &str = "memory per idle sandbox";
pub fn run(_ctx: &Ctx, _res: &mut ScenarioResult) -> Result<()> {
    Ok(())
}
