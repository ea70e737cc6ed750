//! The filesystem seam for cgroup access.

use std::io;
use std::path::Path;

pub trait CgroupFs: Send + Sync {
    fn mkdir(&self, p: &Path) -> io::Result<()>;
    fn rmdir(&self, p: &Path) -> io::Result<()>;
    fn write(&self, p: &Path, v: &str) -> io::Result<()>;
    fn read(&self, p: &Path) -> io::Result<String>;
    fn exists(&self, p: &Path) -> bool;
    fn subdirs(&self, p: &Path) -> Vec<String>;
    /// Attaches the device allowlist program to the cgroup2 dir `p` (see `devices`).
    fn attach_device_filter(&self, p: &Path) -> io::Result<()>;
}

/// The real cgroupfs.
#[derive(Debug, Default)]
pub struct RealFs;

impl CgroupFs for RealFs {
    fn mkdir(&self, p: &Path) -> io::Result<()> {
        std::fs::create_dir(p)
    }
    fn rmdir(&self, p: &Path) -> io::Result<()> {
        std::fs::remove_dir(p)
    }
    fn write(&self, p: &Path, v: &str) -> io::Result<()> {
        std::fs::write(p, v)
    }
    fn read(&self, p: &Path) -> io::Result<String> {
        std::fs::read_to_string(p)
    }
    fn exists(&self, p: &Path) -> bool {
        p.exists()
    }
    fn subdirs(&self, p: &Path) -> Vec<String> {
        std::fs::read_dir(p)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
    fn attach_device_filter(&self, p: &Path) -> io::Result<()> {
        super::devices::attach_device_filter(p)
    }
}
