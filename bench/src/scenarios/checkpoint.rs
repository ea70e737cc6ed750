//! placeholder
use super::Ctx;
use crate::report::ScenarioResult;
use anyhow::Result;
pub const NAME: &str = "checkpoint";
pub const SNAPSHOT: &str = "snapshot";
pub const FIRST: &str = "first";
pub const SECOND_RATIO: &str = "second snapshot: store bytes added ÷ bytes touched";
pub const FORK: &str = "fork / restore, all running and answering";
pub fn run(_ctx: &Ctx, _res: &mut ScenarioResult) -> Result<()> {
    Ok(())
}
