//! Admission: the node's capacity, what live sandboxes hold, and reserve/release of a sandbox's
//! limits. A create that does not fit fails before anything is made.

use std::path::{Path, PathBuf};
use std::sync::{OnceLock, Weak};

use parking_lot::Mutex;

use crate::error::Error;
use crate::runtime::Runtime;
use crate::types::{Capacity, CapacityOverrides, Limits, Resources};

/// The disk as admission sees it, read at each reservation: free space moves with everything
/// else on the filesystem (images, the store, snapshots), so a figure taken at start-up goes
/// stale. A seam, so tests can give the numbers.
pub trait DiskSpace: Send + Sync {
    /// MB free to unprivileged writers (statvfs `f_bavail`) where sandboxes write; None: unknown.
    fn free_mb(&self) -> Option<u64>;
    /// MB the admitted sandboxes have written so far: already gone from `free_mb`, and no
    /// longer owed from their quotas.
    fn written_mb(&self) -> u64;
}

/// The runtime's disk: the filesystem of its state dir, and what its sandboxes' roots hold.
pub(crate) struct RuntimeDisk {
    pub dir: PathBuf,
    pub rt: Weak<Runtime>,
}

impl DiskSpace for RuntimeDisk {
    fn free_mb(&self) -> Option<u64> {
        statvfs_of(&self.dir).map(|s| (s.blocks_available() * s.fragment_size()) >> 20)
    }

    fn written_mb(&self) -> u64 {
        let Some(rt) = self.rt.upgrade() else {
            return 0;
        };
        // Not under the sandboxes lock: a root's usage may be a call to its file server.
        let live = rt.registry.live();
        live.iter().map(|(s, _)| s.root.usage().bytes).sum::<u64>() >> 20
    }
}

/// CPU quota is a ceiling, not a reservation: the node admits this many times its cores.
pub const CPU_OVERCOMMIT: u64 = 16;
pub const DEFAULT_MAX_SANDBOXES: u64 = 4096;
pub const DEFAULT_MEMORY_RESERVE_MB: u64 = 1024;

pub struct Admission {
    total: Resources,
    allocated: Mutex<Resources>,
    /// Disk admitted on free space (see `reserve`); without it, on `total.disk_mb` alone.
    disk: OnceLock<LiveDisk>,
}

struct LiveDisk {
    space: Box<dyn DiskSpace>,
    /// The operator set `capacity.disk_mb`: that cap holds as well.
    capped: bool,
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

/// The filesystem that holds (or will hold) `dir`: its nearest existing ancestor's.
fn statvfs_of(dir: &Path) -> Option<nix::sys::statvfs::Statvfs> {
    dir.ancestors()
        .find_map(|d| nix::sys::statvfs::statvfs(d).ok())
}

/// Size of the filesystem that holds `dir`: no quota larger than this can ever be met.
fn disk_size_mb(dir: &Path) -> u64 {
    statvfs_of(dir)
        .map(|s| (s.blocks() * s.fragment_size()) >> 20)
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
        .map(|d| disk_size_mb(d))
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
            disk: OnceLock::new(),
        }
    }

    /// Admits disk on `space` from now on. `capped`: `total.disk_mb` is the operator's cap and
    /// is checked too; otherwise it is the filesystem's size and only free space counts.
    pub fn set_disk(&self, space: Box<dyn DiskSpace>, capped: bool) {
        let _ = self.disk.set(LiveDisk { space, capped });
    }

    /// MB a new quota can still have: free space less what admitted sandboxes may still write
    /// (their quotas less what they wrote). `allocated`: the quotas admitted. None: not known.
    fn disk_room(&self, allocated: u64, extra: u64) -> Option<u64> {
        let d = self.disk.get()?;
        let free = d.space.free_mb()?;
        // Roomy enough without asking what they wrote (that may be a call per sandbox).
        if free >= allocated.saturating_add(extra) {
            return Some(free - allocated);
        }
        let owed = allocated.saturating_sub(d.space.written_mb());
        Some(free.saturating_sub(owed))
    }

    /// Reserves `l` or fails with CapacityExceeded naming the first resource that does not fit,
    /// or InsufficientStorage when the disk lacks free space for its quota.
    pub fn reserve(&self, l: &Limits) -> Result<(), Error> {
        let want = demand(l);
        // Measured before the lock (a usage probe may be slow); the check under the lock uses
        // the quotas admitted by then, so racing reservations only make it stricter.
        let seen = self.allocated.lock().disk_mb;
        let room = self.disk_room(seen, want.disk_mb);
        let live = self.disk.get().is_some() && room.is_some();
        let capped = self.disk.get().is_none_or(|d| d.capped) || !live;
        let mut alloc = self.allocated.lock();
        if let Some(room) = room {
            let room = room.saturating_sub(alloc.disk_mb.saturating_sub(seen));
            if want.disk_mb > room {
                return Err(Error::InsufficientStorage {
                    field: "limits.disk_mb".into(),
                    requested_mb: want.disk_mb,
                    available_mb: room,
                });
            }
        }
        for ((name, total), ((_, used), (_, req))) in fields(&self.total)
            .into_iter()
            .zip(fields(&alloc).into_iter().zip(fields(&want)))
        {
            if name == "disk_mb" && !capped {
                continue;
            }
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
        let mut allocatable = add(&self.total, &alloc, false);
        if let Some(room) = self.disk_room(alloc.disk_mb, 0) {
            let capped = self.disk.get().is_some_and(|d| d.capped);
            allocatable.disk_mb = if capped {
                room.min(allocatable.disk_mb)
            } else {
                room
            };
        }
        Capacity {
            total: self.total,
            allocated: alloc,
            allocatable,
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
        let made = disk_size_mb(tmp.path());
        let later = disk_size_mb(&tmp.path().join("state/not/yet"));
        assert!(made > 0, "a tempdir's filesystem has a size");
        assert_eq!(later, made);
    }

    /// Free space and what sandboxes wrote, set by the test.
    struct Fake(std::sync::Arc<Mutex<(u64, u64)>>);

    impl DiskSpace for Fake {
        fn free_mb(&self) -> Option<u64> {
            Some(self.0.lock().0)
        }
        fn written_mb(&self) -> u64 {
            self.0.lock().1
        }
    }

    fn disk_only(disk_mb: u64) -> Limits {
        Limits {
            cpu_millis: 100,
            memory_mb: 1,
            pids: 1,
            open_files: 1,
            disk_mb,
        }
    }

    #[test]
    fn disk_is_admitted_on_free_space_less_what_admitted_sandboxes_may_still_write() {
        let total = Resources {
            cpu_millis: 1 << 20,
            memory_mb: 1 << 20,
            pids: 1 << 20,
            open_files: 1 << 20,
            // The filesystem's size: far more than is free.
            disk_mb: 1000,
            sandboxes: 100,
        };
        let numbers = std::sync::Arc::new(Mutex::new((300, 0)));
        let a = Admission::new(total);
        a.set_disk(Box::new(Fake(numbers.clone())), false);
        let refused = |r: Result<(), Error>| match r {
            Err(Error::InsufficientStorage {
                field,
                requested_mb,
                available_mb,
            }) => (field, requested_mb, available_mb),
            other => panic!("expected InsufficientStorage, got {other:?}"),
        };
        // 300 MB free: a 400 MB quota fits the filesystem's size but not its free space.
        assert_eq!(
            refused(a.reserve(&disk_only(400))),
            ("limits.disk_mb".to_string(), 400, 300)
        );
        a.reserve(&disk_only(200)).unwrap();
        // The first sandbox may still write 200 MB of the 300 free.
        assert_eq!(refused(a.reserve(&disk_only(150))).2, 100);
        // It wrote 120 MB: 180 free, of which it may still take 80.
        *numbers.lock() = (180, 120);
        a.reserve(&disk_only(100)).unwrap();
        assert_eq!(a.capacity().allocatable.disk_mb, 0);
        // Something else filled the disk: nothing more fits, whatever the quotas say.
        *numbers.lock() = (10, 120);
        assert_eq!(refused(a.reserve(&disk_only(20))).2, 0);
        a.release(&disk_only(200));
        a.release(&disk_only(100));
        *numbers.lock() = (300, 0);
        a.reserve(&disk_only(300)).unwrap();
    }

    #[test]
    fn an_operators_disk_cap_still_holds() {
        let total = Resources {
            cpu_millis: 1 << 20,
            memory_mb: 1 << 20,
            pids: 1 << 20,
            open_files: 1 << 20,
            disk_mb: 100,
            sandboxes: 100,
        };
        let a = Admission::new(total);
        a.set_disk(
            Box::new(Fake(std::sync::Arc::new(Mutex::new((5000, 0))))),
            true,
        );
        a.reserve(&disk_only(80)).unwrap();
        assert!(matches!(
            a.reserve(&disk_only(80)),
            Err(Error::CapacityExceeded { .. })
        ));
    }
}
