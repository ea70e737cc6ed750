//! A runtime on nodefs roots plus a snapshotter, private to one test binary, with everything
//! removed at the end (`Env::finish`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use grove_nodefs_root::NodefsRoot;
use grove_runtime::{ExecRequest, ExecResult, Runtime, RuntimeConfig, SandboxId, SandboxSpec};
use grove_snapshotter::{Snapshotter, SnapshotterConfig};
use nodefs::service::{FsService, Local};
use nodefs::{NodeFs, Store};

pub const IMAGE_DIR: &str = "/var/lib/grove/images/debian12";
pub const IMAGE: &str = "debian12";

/// Why these tests cannot run here, if they cannot.
pub fn missing_prereq() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root".into());
    }
    if !Path::new(IMAGE_DIR).join("bin/sh").exists() {
        return Some(format!("needs the base image {IMAGE_DIR}"));
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("needs /dev/fuse".into());
    }
    None
}

/// The test binary's serial lock, or None (having said why) when a prerequisite is missing.
/// Hold the guard for the whole test.
pub fn serial_with_prereqs() -> Option<std::sync::MutexGuard<'static, ()>> {
    let serial = super::tree::serial();
    if let Some(why) = missing_prereq() {
        super::capability_missing(&why);
        return None;
    }
    Some(serial)
}

/// grove-init from this workspace's target dir, built on demand (cargo builds only this crate's
/// own binaries for its tests).
pub fn init_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|d| d.parent()).unwrap().to_path_buf();
    let bin = profile_dir.join("grove-init");
    if !bin.exists() {
        let release = profile_dir.file_name().is_some_and(|n| n == "release");
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "-p", "grove-runtime", "--bin", "grove-init"]);
        if release {
            cmd.arg("--release");
        }
        let st = cmd
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .unwrap();
        assert!(st.success(), "building grove-init");
    }
    assert!(bin.exists(), "{} missing", bin.display());
    bin
}

pub struct Env {
    pub rt: Arc<Runtime>,
    pub snap: Arc<Snapshotter>,
    pub store: Arc<Store>,
    pub nodefs: Arc<NodeFs>,
    pub dir: PathBuf,
    pub run_dir: PathBuf,
    pub snap_cfg: SnapshotterConfig,
}

/// A runtime of `instance` on nodefs roots, its state under `dir`; upper layers in
/// `<dir>/state/uppers`.
fn runtime(instance: &str, dir: &Path, run_dir: &Path, svc: &Arc<dyn FsService>) -> Arc<Runtime> {
    let mut cfg = RuntimeConfig::default_paths();
    cfg.state_dir = dir.join("state");
    cfg.run_dir = run_dir.to_path_buf();
    cfg.cgroup_root = instance.to_string();
    cfg.init_binary = init_binary();
    cfg.net_pool = "10.213.0.0/16".into();
    let roots = NodefsRoot::new(svc.clone(), dir.join("state/uppers"));
    Runtime::new(cfg, Arc::new(roots)).unwrap()
}

impl Env {
    /// A second runtime over this one's dirs, as a restarted daemon makes (its start-up recovery
    /// runs); the caller shuts it down.
    pub fn restarted_runtime(&self, instance: &str) -> Arc<Runtime> {
        runtime(instance, &self.dir, &self.run_dir, &self.service())
    }

    pub fn new(instance: &str) -> Env {
        let dir = PathBuf::from(format!("/var/tmp/{instance}-{}", std::process::id()));
        let run_dir = PathBuf::from(format!("/run/{instance}"));
        std::fs::create_dir_all(&dir).unwrap();
        let store = Store::open(&dir.join("store")).unwrap();
        let image = store.import_dir(Path::new(IMAGE_DIR)).unwrap();
        store.set_ref(IMAGE, &image).unwrap();
        let nodefs = NodeFs::new(store.clone());
        let svc: Arc<dyn FsService> = Arc::new(Local::new(nodefs.clone()));
        let rt = runtime(instance, &dir, &run_dir, &svc);
        let snap_cfg = SnapshotterConfig {
            state_dir: dir.join("state"),
            run_dir: run_dir.clone(),
            criu: None,
            scratch_dir: None,
            image_cache_bytes: None,
            merge_fork_pages: true,
            lazy_pages: true,
            track_dirty_pages: true,
        };
        let snap = Snapshotter::new(snap_cfg.clone(), rt.clone(), svc).unwrap();
        Env {
            rt,
            snap,
            store,
            nodefs,
            dir,
            run_dir,
            snap_cfg,
        }
    }

    /// The in-process store service the runtime and snapshotter use.
    pub fn service(&self) -> Arc<dyn FsService> {
        Arc::new(Local::new(self.nodefs.clone()))
    }

    pub fn spec(&self) -> SandboxSpec {
        SandboxSpec::from_image(IMAGE)
    }

    pub fn sh(&self, id: &SandboxId, cmd: &str) -> ExecResult {
        let r = self.rt.exec(id, ExecRequest::shell(cmd)).expect("exec");
        assert_eq!(
            r.exit_code,
            Some(0),
            "{cmd}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        r
    }

    pub fn out(&self, id: &SandboxId, cmd: &str) -> String {
        String::from_utf8_lossy(&self.sh(id, cmd).stdout)
            .trim()
            .to_string()
    }

    /// Destroys every sandbox and snapshot (idempotent, never panics).
    fn teardown(&self) {
        for s in self.rt.list() {
            if let Err(e) = self.rt.destroy(&s.id) {
                eprintln!("teardown: destroy {}: {e}", s.id);
            }
        }
        for s in self.snap.list() {
            if let Err(e) = self.snap.delete(&s.id) {
                eprintln!("teardown: delete snapshot {}: {e}", s.id);
            }
        }
        self.rt.shutdown();
    }

    /// The runtime's residue report, keeping only items that persist: `residue()` also lists
    /// grove-init setup processes of other runtime instances on this machine (other engineers'
    /// tests), which last milliseconds. An item must show in every sample over ~2 s to count.
    pub fn residue(&self) -> Vec<grove_runtime::ResidueItem> {
        let key = |i: &grove_runtime::ResidueItem| format!("{} {}", i.kind, i.what);
        let mut items = self.rt.residue().items;
        for _ in 0..20 {
            if items.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
            let now: Vec<String> = self.rt.residue().items.iter().map(key).collect();
            items.retain(|i| now.contains(&key(i)));
        }
        items
    }

    /// Tears down, then asserts the runtime sees no residue and no mount, CRIU process, scratch
    /// or materialized image is left. Directories are removed on drop (also after a panic).
    pub fn finish(self) {
        self.teardown();
        let residue = self.residue();
        assert!(residue.is_empty(), "runtime residue: {residue:#?}");
        let mounts: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| {
                l.contains(self.run_dir.to_str().unwrap()) || l.contains(self.dir.to_str().unwrap())
            })
            .map(String::from)
            .collect();
        assert!(mounts.is_empty(), "mounts left: {mounts:#?}");
        let run_dir = self.run_dir.to_str().unwrap();
        // A lazy-pages daemon exits once its restored tree is gone: give it a moment.
        let mut left = Vec::new();
        for _ in 0..30 {
            left = crate::common::tree::host_residue(&format!("{run_dir}/"));
            if left.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        assert!(left.is_empty(), "mounts or processes (criu) left: {left:?}");
        // A destroyed sandbox's tracking base goes on the snapshotter's event thread.
        for sub in ["snapshots", "snapshot-work", "lazy-pages", "sandboxes"] {
            let listing = || -> Vec<_> {
                std::fs::read_dir(self.run_dir.join(sub))
                    .map(|d| d.flatten().map(|e| e.path()).collect())
                    .unwrap_or_default()
            };
            let mut left = listing();
            for _ in 0..30 {
                if left.is_empty() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
                left = listing();
            }
            assert!(left.is_empty(), "{sub} left: {left:?}");
        }
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        self.teardown();
        let _ = std::fs::remove_dir_all(&self.run_dir);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
