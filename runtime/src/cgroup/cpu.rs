//! cpu controller: a CFS quota of `cpu_millis` per 100 ms period.

use std::path::Path;

use super::{CgroupError, CgroupFs, Controller, Result};
use crate::types::Limits;

pub struct Cpu;

const PERIOD_US: u64 = 100_000;

fn quota_us(l: &Limits) -> u64 {
    u64::from(l.cpu_millis) * PERIOD_US / 1000
}

impl Controller for Cpu {
    fn v1_name(&self) -> &'static str {
        "cpu"
    }
    fn apply_v1(&self, fs: &dyn CgroupFs, dir: &Path, l: &Limits) -> Result<()> {
        // The kernel's default period is 100 ms already; only the quota is written (one syscall less).
        let p = dir.join("cpu.cfs_quota_us");
        fs.write(&p, &quota_us(l).to_string())
            .map_err(|e| CgroupError::new("write", &p, e))
    }
    fn apply_v2(&self, fs: &dyn CgroupFs, dir: &Path, l: &Limits) -> Result<()> {
        let p = dir.join("cpu.max");
        fs.write(&p, &format!("{} {PERIOD_US}", quota_us(l)))
            .map_err(|e| CgroupError::new("write", &p, e))
    }
}
