//! pids controller: caps fork bombs.

use std::path::Path;

use super::{CgroupError, CgroupFs, Controller, Result};
use crate::types::Limits;

pub struct Pids;

impl Controller for Pids {
    fn v1_name(&self) -> &'static str {
        "pids"
    }
    fn apply_v1(&self, fs: &dyn CgroupFs, dir: &Path, l: &Limits) -> Result<()> {
        self.apply_v2(fs, dir, l)
    }
    fn apply_v2(&self, fs: &dyn CgroupFs, dir: &Path, l: &Limits) -> Result<()> {
        let p = dir.join("pids.max");
        fs.write(&p, &l.pids.to_string())
            .map_err(|e| CgroupError::new("write", &p, e))
    }
}
