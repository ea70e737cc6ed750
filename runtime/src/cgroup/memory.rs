//! memory controller: a hard limit with swap off; the OOM killer acts inside the sandbox cgroup.

use std::path::Path;

use super::{CgroupError, CgroupFs, Controller, Result};
use crate::types::Limits;

pub struct Memory;

fn w(fs: &dyn CgroupFs, p: &Path, v: &str) -> Result<()> {
    fs.write(p, v).map_err(|e| CgroupError::new("write", p, e))
}

impl Controller for Memory {
    fn v1_name(&self) -> &'static str {
        "memory"
    }
    fn apply_v1(&self, fs: &dyn CgroupFs, dir: &Path, l: &Limits) -> Result<()> {
        let bytes = (l.memory_mb << 20).to_string();
        w(fs, &dir.join("memory.limit_in_bytes"), &bytes)?;
        let memsw = dir.join("memory.memsw.limit_in_bytes");
        if fs.exists(&memsw) {
            w(fs, &memsw, &bytes)?;
        }
        w(fs, &dir.join("memory.swappiness"), "0")
    }
    fn apply_v2(&self, fs: &dyn CgroupFs, dir: &Path, l: &Limits) -> Result<()> {
        w(
            fs,
            &dir.join("memory.max"),
            &(l.memory_mb << 20).to_string(),
        )?;
        let swap = dir.join("memory.swap.max");
        if fs.exists(&swap) {
            w(fs, &swap, "0")?;
        }
        Ok(())
    }
}
