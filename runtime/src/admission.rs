//! Admission: the node's capacity, what live sandboxes hold, and reserve/release of a sandbox's
//! limits. A create that does not fit fails before anything is made.

use std::path::Path;

use parking_lot::Mutex;

use crate::error::Error;
use crate::types::{Capacity, CapacityOverrides, Limits, Resources};

/// CPU quota is a ceiling, not a reservation: the node admits this many times its cores.
pub const CPU_OVERCOMMIT: u64 = 16;
pub const DEFAULT_MAX_SANDBOXES: u64 = 4096;
pub const DEFAULT_MEMORY_RESERVE_MB: u64 = 1024;

pub struct Admission {
    total: Resources,
    allocated: Mutex<Resources>,
}

fn read_num(path: &str) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn mem_total_mb() -> u64 {
    crate::host_mem::meminfo_kb("MemTotal").unwrap_or(0) / 1024
}

/// Free space of the filesystem that holds (or will hold) `dir`: its nearest existing ancestor's.
fn disk_free_mb(dir: &Path) -> u64 {
    dir.ancestors()
        .find_map(|d| nix::sys::statvfs::statvfs(d).ok())
        .map(|s| (s.blocks_available() * s.fragment_size()) >> 20)
        .unwrap_or(0)
}

/// The node's capacity, detected, with overrides applied.
pub fn detect(o: &CapacityOverrides, disk_dirs: &[&Path]) -> Resources {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get() as u64)
        .unwrap_or(1);
    let reserve = o.memory_reserve_mb.unwrap_or(DEFAULT_MEMORY_RESERVE_MB);
    let pid_max = read_num("/proc/sys/kernel/pid_max").unwrap_or(32768);
    let threads_max = read_num("/proc/sys/kernel/threads-max").unwrap_or(pid_max);
    let file_max = read_num("/proc/sys/fs/file-max").unwrap_or(1 << 20);
    let disk = disk_dirs
        .iter()
        .map(|d| disk_free_mb(d))
        .filter(|&m| m > 0)
        .min()
        .unwrap_or(0);
    Resources {
        cpu_millis: o.cpu_millis.unwrap_or(cpus * 1000 * CPU_OVERCOMMIT),
        memory_mb: o
            .memory_mb
            .unwrap_or(mem_total_mb().saturating_sub(reserve)),
        // Keep a tenth of the pid and file tables for the host.
        pids: o.pids.unwrap_or(pid_max.min(threads_max) * 9 / 10),
        open_files: o.open_files.unwrap_or(file_max.min(1 << 40) * 9 / 10),
        disk_mb: o.disk_mb.unwrap_or(disk),
        sandboxes: o.sandboxes.unwrap_or(DEFAULT_MAX_SANDBOXES),
    }
}

pub fn demand(l: &Limits) -> Resources {
    Resources {
        cpu_millis: u64::from(l.cpu_millis),
        memory_mb: l.memory_mb,
        pids: u64::from(l.pids),
        open_files: u64::from(l.open_files),
        disk_mb: l.disk_mb,
        sandboxes: 1,
    }
}

fn fields(r: &Resources) -> [(&'static str, u64); 6] {
    [
        ("sandboxes", r.sandboxes),
        ("memory_mb", r.memory_mb),
        ("cpu_millis", r.cpu_millis),
        ("pids", r.pids),
        ("open_files", r.open_files),
        ("disk_mb", r.disk_mb),
    ]
}

impl Admission {
    pub fn new(total: Resources) -> Self {
        Admission {
            total,
            allocated: Mutex::new(Resources::default()),
        }
    }

    /// Reserves `l` or fails with CapacityExceeded naming the first resource that does not fit.
    pub fn reserve(&self, l: &Limits) -> Result<(), Error> {
        let want = demand(l);
        let mut alloc = self.allocated.lock();
        for ((name, total), ((_, used), (_, req))) in fields(&self.total)
            .into_iter()
            .zip(fields(&alloc).into_iter().zip(fields(&want)))
        {
            let available = total.saturating_sub(used);
            if req > available {
                return Err(Error::CapacityExceeded {
                    resource: name.into(),
                    requested: req,
                    available,
                });
            }
        }
        *alloc = add(&alloc, &want, true);
        Ok(())
    }

    /// Counts `l` as allocated without checking: a sandbox adopted at start-up already exists.
    pub fn claim(&self, l: &Limits) {
        let mut alloc = self.allocated.lock();
        *alloc = add(&alloc, &demand(l), true);
    }

    pub fn release(&self, l: &Limits) {
        let mut alloc = self.allocated.lock();
        *alloc = add(&alloc, &demand(l), false);
    }

    pub fn capacity(&self) -> Capacity {
        let alloc = *self.allocated.lock();
        Capacity {
            total: self.total,
            allocated: alloc,
            allocatable: add(&self.total, &alloc, false),
        }
    }
}

fn add(a: &Resources, b: &Resources, plus: bool) -> Resources {
    let f = |x: u64, y: u64| {
        if plus {
            x.saturating_add(y)
        } else {
            x.saturating_sub(y)
        }
    };
    Resources {
        cpu_millis: f(a.cpu_millis, b.cpu_millis),
        memory_mb: f(a.memory_mb, b.memory_mb),
        pids: f(a.pids, b.pids),
        open_files: f(a.open_files, b.open_files),
        disk_mb: f(a.disk_mb, b.disk_mb),
        sandboxes: f(a.sandboxes, b.sandboxes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_until_full_then_release() {
        let total = Resources {
            cpu_millis: 4000,
            memory_mb: 1000,
            pids: 1000,
            open_files: 10_000,
            disk_mb: 10_000,
            sandboxes: 10,
        };
        let a = Admission::new(total);
        let l = Limits {
            cpu_millis: 1000,
            memory_mb: 400,
            pids: 100,
            open_files: 100,
            disk_mb: 100,
        };
        a.reserve(&l).unwrap();
        a.reserve(&l).unwrap();
        match a.reserve(&l) {
            Err(Error::CapacityExceeded {
                resource,
                requested,
                available,
            }) => {
                assert_eq!(
                    (resource.as_str(), requested, available),
                    ("memory_mb", 400, 200)
                );
            }
            other => panic!("expected CapacityExceeded, got {other:?}"),
        }
        a.release(&l);
        a.reserve(&l).unwrap();
        assert_eq!(a.capacity().allocated.memory_mb, 800);
    }

    #[test]
    fn disk_of_a_dir_not_made_yet_is_its_filesystems() {
        let tmp = tempfile::tempdir().unwrap();
        let made = disk_free_mb(tmp.path());
        let later = disk_free_mb(&tmp.path().join("state/not/yet"));
        assert!(made > 0, "a tempdir has free space");
        // Same filesystem; other writers may move it a little between the two calls.
        assert!(later.abs_diff(made) <= made / 100 + 16, "{later} vs {made}");
    }
}
