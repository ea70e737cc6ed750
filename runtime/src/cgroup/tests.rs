//! Unit tests of both backends against an in-memory cgroupfs.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use super::*;

/// Dirs and files in memory; rmdir drops a dir with its (interface) files, like cgroupfs.
#[derive(Default)]
struct MemFs {
    dirs: Mutex<Vec<PathBuf>>,
    files: Mutex<BTreeMap<PathBuf, String>>,
    fail_write: Option<&'static str>,
    fail_rmdir: Option<&'static str>,
    /// rmdir of this dir reports success without removing it, `ghosts` times.
    ghost_rmdir: Option<&'static str>,
    ghosts: Mutex<u32>,
    /// Path lookups of this dir miss while it is still listed (a stale negative dentry): `stat`
    /// says gone and rmdir fails with ENOENT, `stale` times.
    stale_lookup: Option<&'static str>,
    stale: Mutex<u32>,
}

impl MemFs {
    /// One stale lookup of `p` used up, if `p` is the dir whose lookups miss.
    fn lookup_misses(&self, p: &Path) -> bool {
        if !self.stale_lookup.is_some_and(|f| p.ends_with(f)) {
            return false;
        }
        let mut left = self.stale.lock();
        *left > 0 && {
            *left -= 1;
            true
        }
    }
}

impl MemFs {
    fn with_dirs(dirs: &[&str]) -> Self {
        let fs = MemFs::default();
        fs.dirs.lock().extend(dirs.iter().map(PathBuf::from));
        fs
    }
    fn file(&self, p: &str) -> Option<String> {
        self.files.lock().get(Path::new(p)).cloned()
    }
}

impl CgroupFs for MemFs {
    fn mkdir(&self, p: &Path) -> io::Result<()> {
        let mut d = self.dirs.lock();
        if d.iter().any(|x| x == p) {
            return Err(io::ErrorKind::AlreadyExists.into());
        }
        if !d.iter().any(|x| Some(x.as_path()) == p.parent()) {
            return Err(io::ErrorKind::NotFound.into());
        }
        d.push(p.to_path_buf());
        Ok(())
    }
    fn rmdir(&self, p: &Path) -> io::Result<()> {
        if self.fail_rmdir.is_some_and(|f| p.ends_with(f)) {
            return Err(io::Error::from_raw_os_error(libc::EPERM));
        }
        if self.lookup_misses(p) {
            return Err(io::ErrorKind::NotFound.into());
        }
        if self.ghost_rmdir.is_some_and(|f| p.ends_with(f)) {
            let mut left = self.ghosts.lock();
            if *left > 0 {
                *left -= 1;
                return Ok(());
            }
        }
        let mut d = self.dirs.lock();
        // Like cgroupfs: a dir with child cgroups is busy.
        if d.iter().any(|x| x.parent() == Some(p)) {
            return Err(io::Error::from_raw_os_error(libc::EBUSY));
        }
        let before = d.len();
        d.retain(|x| x != p);
        if d.len() == before {
            return Err(io::ErrorKind::NotFound.into());
        }
        self.files.lock().retain(|f, _| f.parent() != Some(p));
        Ok(())
    }
    fn write(&self, p: &Path, v: &str) -> io::Result<()> {
        if self.fail_write.is_some_and(|f| p.ends_with(f)) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        if !self
            .dirs
            .lock()
            .iter()
            .any(|x| Some(x.as_path()) == p.parent())
        {
            return Err(io::ErrorKind::NotFound.into());
        }
        let mut files = self.files.lock();
        let f = files.entry(p.to_path_buf()).or_default();
        // devices.allow keeps each rule written, as the kernel's exception list does.
        if p.ends_with("devices.allow") && !f.is_empty() {
            f.push('\n');
            f.push_str(v);
        } else {
            *f = v.to_string();
        }
        Ok(())
    }
    fn read(&self, p: &Path) -> io::Result<String> {
        self.files
            .lock()
            .get(p)
            .cloned()
            .ok_or_else(|| io::ErrorKind::NotFound.into())
    }
    fn exists(&self, p: &Path) -> bool {
        if self.stale_lookup.is_some_and(|f| p.ends_with(f)) && *self.stale.lock() > 0 {
            return false;
        }
        self.dirs.lock().iter().any(|x| x == p) || self.files.lock().contains_key(p)
    }
    fn subdirs(&self, p: &Path) -> Vec<String> {
        let d = self.dirs.lock();
        d.iter()
            .filter(|x| x.parent() == Some(p))
            .filter_map(|x| Some(x.file_name()?.to_str()?.to_string()))
            .collect()
    }
    fn attach_device_filter(&self, p: &Path) -> io::Result<()> {
        if !self.dirs.lock().iter().any(|d| d == p) {
            return Err(io::ErrorKind::NotFound.into());
        }
        self.files
            .lock()
            .insert(p.join("<device program>"), "attached".into());
        Ok(())
    }
}

const LIMITS: Limits = Limits {
    cpu_millis: 500,
    memory_mb: 256,
    pids: 64,
    open_files: 1024,
    disk_mb: 100,
};
const V1_BASE: &[&str] = &[
    "/cg",
    "/cg/memory",
    "/cg/pids",
    "/cg/cpu",
    "/cg/devices",
    "/cg/unified",
];

fn v1(fs: &Arc<MemFs>) -> V1 {
    V1::new(
        fs.clone(),
        "/cg".into(),
        "grove",
        Some("/cg/unified".into()),
    )
}

#[test]
fn v1_create_writes_limits_and_remove_cleans() {
    let fs = Arc::new(MemFs::with_dirs(V1_BASE));
    let cg = v1(&fs);
    cg.prepare().unwrap();
    cg.prepare().unwrap(); // idempotent
    cg.create("sb-1", &LIMITS).unwrap();
    assert_eq!(
        fs.file("/cg/memory/grove/sb-1/memory.limit_in_bytes")
            .as_deref(),
        Some("268435456")
    );
    assert_eq!(
        fs.file("/cg/memory/grove/sb-1/memory.swappiness")
            .as_deref(),
        Some("0")
    );
    assert_eq!(
        fs.file("/cg/pids/grove/sb-1/pids.max").as_deref(),
        Some("64")
    );
    assert_eq!(
        fs.file("/cg/cpu/grove/sb-1/cpu.cfs_quota_us").as_deref(),
        Some("50000")
    );
    // Devices: deny all, then the allowlist; and the cgroup2 program on the unified dir.
    assert_eq!(
        fs.file("/cg/devices/grove/sb-1/devices.deny").as_deref(),
        Some("a")
    );
    assert_eq!(
        fs.file("/cg/devices/grove/sb-1/devices.allow"),
        Some(device_rules().join("\n"))
    );
    assert!(fs.file("/cg/unified/grove/sb-1/<device program>").is_some());
    assert_eq!(cg.procs_files("sb-1").len(), 5);
    assert_eq!(cg.existing(), vec!["sb-1".to_string()]);
    let criu = cg.criu_paths("sb-1");
    assert!(criu.contains(&("unified".into(), PathBuf::from("/grove/sb-1"))));
    assert!(criu.contains(&("devices".into(), PathBuf::from("/grove/sb-1"))));

    // Kill: cgroup.kill on the unified dir, then "populated 0" ends the wait.
    fs.files.lock().insert(
        "/cg/unified/grove/sb-1/cgroup.events".into(),
        "populated 0\nfrozen 0\n".into(),
    );
    cg.kill_all("sb-1").unwrap();
    assert_eq!(
        fs.file("/cg/unified/grove/sb-1/cgroup.kill").as_deref(),
        Some("1")
    );

    cg.remove("sb-1").unwrap();
    cg.remove("sb-1").unwrap(); // idempotent
    assert!(cg.existing().is_empty());
    assert!(cg.dirs("sb-1").is_empty());
    cg.unprepare();
    assert_eq!(fs.dirs.lock().len(), V1_BASE.len());
}

#[test]
fn v1_failed_create_removes_what_it_made() {
    let fs = Arc::new(MemFs {
        fail_write: Some("pids.max"),
        ..MemFs::with_dirs(V1_BASE)
    });
    let cg = v1(&fs);
    cg.prepare().unwrap();
    let e = cg.create("sb-2", &LIMITS).unwrap_err();
    assert!(e.path.ends_with("pids.max"), "{e}");
    assert!(
        cg.existing().is_empty(),
        "rolled back: {:?}",
        fs.dirs.lock()
    );
}

#[test]
fn v1_failed_device_rules_roll_back() {
    let fs = Arc::new(MemFs {
        fail_write: Some("devices.allow"),
        ..MemFs::with_dirs(V1_BASE)
    });
    let cg = v1(&fs);
    cg.prepare().unwrap();
    let e = cg.create("sb-8", &LIMITS).unwrap_err();
    assert!(e.path.ends_with("devices.allow"), "{e}");
    assert!(cg.existing().is_empty(), "{:?}", fs.dirs.lock());
}

#[test]
fn v2_create_freeze_kill() {
    let fs = Arc::new(MemFs::with_dirs(&["/cg"]));
    let cg = V2::new(fs.clone(), "/cg".into(), "grove");
    cg.prepare().unwrap();
    assert_eq!(
        fs.file("/cg/grove/cgroup.subtree_control").as_deref(),
        Some("+memory +pids +cpu")
    );
    cg.create("sb-3", &LIMITS).unwrap();
    assert_eq!(
        fs.file("/cg/grove/sb-3/memory.max").as_deref(),
        Some("268435456")
    );
    assert_eq!(
        fs.file("/cg/grove/sb-3/cpu.max").as_deref(),
        Some("50000 100000")
    );
    assert_eq!(fs.file("/cg/grove/sb-3/pids.max").as_deref(), Some("64"));
    assert!(fs.file("/cg/grove/sb-3/<device program>").is_some());
    fs.files.lock().insert(
        "/cg/grove/sb-3/cgroup.events".into(),
        "populated 1\nfrozen 1\n".into(),
    );
    cg.freeze("sb-3").unwrap();
    assert_eq!(
        fs.file("/cg/grove/sb-3/cgroup.freeze").as_deref(),
        Some("1")
    );
    fs.files.lock().insert(
        "/cg/grove/sb-3/cgroup.events".into(),
        "populated 0\nfrozen 0\n".into(),
    );
    cg.kill_all("sb-3").unwrap();
    cg.remove("sb-3").unwrap();
    assert!(cg.existing().is_empty());
}

#[test]
fn rmdir_all_removes_the_rest_when_one_dir_fails() {
    let mut fs = MemFs::with_dirs(&["/cg/a", "/cg/b", "/cg/c"]);
    fs.fail_rmdir = Some("b");
    let dirs: Vec<PathBuf> = ["/cg/a", "/cg/b", "/cg/c"]
        .iter()
        .map(PathBuf::from)
        .collect();
    let err = unified::rmdir_all(&fs, &dirs).expect_err("b cannot be removed");
    assert!(err.to_string().contains("rmdir"), "{err}");
    assert_eq!(*fs.dirs.lock(), vec![PathBuf::from("/cg/b")]);
}

#[test]
fn remove_does_not_believe_an_rmdir_that_left_the_dir() {
    let mut fs = MemFs::with_dirs(V1_BASE);
    fs.ghost_rmdir = Some("pids/grove/sb-4");
    *fs.ghosts.lock() = 2;
    let fs = Arc::new(fs);
    let cg = v1(&fs);
    cg.prepare().unwrap();
    cg.create("sb-4", &LIMITS).unwrap();
    cg.remove("sb-4").unwrap();
    assert_eq!(*fs.ghosts.lock(), 0, "rmdir retried until the dir was gone");
    assert!(cg.existing().is_empty(), "left: {:?}", cg.dirs("sb-4"));
}

/// The teardown race of the soak (issue 4): under load, a destroy answered OK while empty v1
/// `pids`/`cpu` dirs stayed listed; `stat` said they were gone. Only the listing is believed.
#[test]
fn remove_does_not_believe_a_lookup_that_misses_a_listed_dir() {
    let mut fs = MemFs::with_dirs(V1_BASE);
    fs.stale_lookup = Some("cpu/grove/sb-7");
    *fs.stale.lock() = 3;
    let fs = Arc::new(fs);
    let cg = v1(&fs);
    cg.prepare().unwrap();
    cg.create("sb-7", &LIMITS).unwrap();
    cg.remove("sb-7").unwrap();
    assert_eq!(
        *fs.stale.lock(),
        0,
        "rmdir retried while the dir was listed"
    );
    assert!(cg.existing().is_empty(), "left: {:?}", cg.dirs("sb-7"));
}

#[test]
fn dirs_lists_what_the_parent_holds() {
    let fs = Arc::new(MemFs::with_dirs(V1_BASE));
    let cg = v1(&fs);
    cg.prepare().unwrap();
    cg.create("sb-5", &LIMITS).unwrap();
    for d in ["/cg/memory/grove/sb-5", "/cg/unified/grove/sb-5"] {
        fs.rmdir(Path::new(d)).unwrap();
    }
    let left: Vec<PathBuf> = [
        "/cg/cpu/grove/sb-5",
        "/cg/devices/grove/sb-5",
        "/cg/pids/grove/sb-5",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    let mut got = cg.dirs("sb-5");
    got.sort();
    assert_eq!(got, left);
    assert_eq!(cg.existing(), vec!["sb-5".to_string()]);
}

#[test]
fn failed_create_undo_does_not_believe_an_rmdir_that_left_the_dir() {
    let mut fs = MemFs::with_dirs(V1_BASE);
    fs.fail_write = Some("cpu.cfs_quota_us");
    fs.ghost_rmdir = Some("pids/grove/sb-6");
    *fs.ghosts.lock() = 1;
    let fs = Arc::new(fs);
    let cg = v1(&fs);
    cg.prepare().unwrap();
    cg.create("sb-6", &LIMITS)
        .expect_err("cpu limit cannot be written");
    assert!(cg.existing().is_empty(), "left: {:?}", cg.dirs("sb-6"));
}

#[test]
fn v2_daemon_cgroups_are_limited_reused_and_never_sandboxes() {
    let fs = Arc::new(MemFs::with_dirs(&["/cg"]));
    let cg = V2::new(fs.clone(), "/cg".into(), "grove");
    cg.prepare().unwrap();
    let procs = cg.create_daemon("groved", 512).unwrap();
    assert_eq!(
        procs,
        vec![PathBuf::from("/cg/grove/daemon/groved/cgroup.procs")]
    );
    assert_eq!(
        fs.file("/cg/grove/daemon/cgroup.subtree_control")
            .as_deref(),
        Some("+memory")
    );
    assert_eq!(
        fs.file("/cg/grove/daemon/groved/memory.max").as_deref(),
        Some("536870912")
    );
    cg.create_daemon("fsd", 0).unwrap();
    assert_eq!(
        fs.file("/cg/grove/daemon/fsd/memory.max").as_deref(),
        Some("max")
    );
    // A restart after a crash finds them and takes them over, with the limit it is configured for.
    cg.create_daemon("groved", 256).unwrap();
    assert_eq!(
        fs.file("/cg/grove/daemon/groved/memory.max").as_deref(),
        Some("268435456")
    );
    // Not sandboxes: recovery's leftover sweep (which kills cgroups) and residue never see them.
    cg.create("sb-5", &LIMITS).unwrap();
    assert_eq!(cg.existing(), vec!["sb-5".to_string()]);
    cg.remove("sb-5").unwrap();
    cg.remove_daemons(&["groved", "fsd"]);
    cg.unprepare();
    assert_eq!(*fs.dirs.lock(), vec![PathBuf::from("/cg")]);
}

#[test]
fn v1_daemon_cgroups_live_in_the_memory_hierarchy() {
    let mut mem = MemFs::with_dirs(V1_BASE);
    // A grove-fsd kept running for the next groved: its cgroup stays, and the parents with it.
    mem.fail_rmdir = Some("daemon/fsd");
    let fs = Arc::new(mem);
    let cg = v1(&fs);
    cg.prepare().unwrap();
    let procs = cg.create_daemon("fsd", 100).unwrap();
    assert_eq!(
        procs,
        vec![PathBuf::from("/cg/memory/grove/daemon/fsd/cgroup.procs")]
    );
    assert_eq!(
        fs.file("/cg/memory/grove/daemon/fsd/memory.limit_in_bytes")
            .as_deref(),
        Some("104857600")
    );
    cg.create_daemon("groved", 0).unwrap();
    assert_eq!(
        fs.file("/cg/memory/grove/daemon/groved/memory.limit_in_bytes")
            .as_deref(),
        Some("-1")
    );
    assert!(cg.existing().is_empty());
    cg.remove_daemons(&["groved", "fsd"]);
    cg.unprepare();
    let dirs = fs.dirs.lock().clone();
    assert!(
        dirs.contains(&PathBuf::from("/cg/memory/grove/daemon/fsd")),
        "{dirs:?}"
    );
    assert!(
        !dirs.contains(&PathBuf::from("/cg/memory/grove/daemon/groved")),
        "{dirs:?}"
    );
    assert!(!dirs.contains(&PathBuf::from("/cg/pids/grove")), "{dirs:?}");
}
