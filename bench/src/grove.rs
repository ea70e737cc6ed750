//! Grove's side of the scenarios: a nodefs store with the base image imported, the runtime library
//! in-process over `NodefsRoot` (kernel overlayfs `OverlayRoot` if nodefs is not usable), and the
//! snapshotter. Opened once per run and probed with a real create → exec → destroy. When a piece is not
//! usable the reason is returned and the scenario reports "not available (<reason>)" — never a made-up
//! figure.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use grove_nodefs_root::NodefsRoot;
use grove_runtime::{
    CapacityOverrides, ExecRequest, Limits, OverlayRoot, RootProvider, Runtime, RuntimeConfig,
    SandboxId, SandboxSpec,
};
use grove_snapshotter::{ForkOptions, SnapshotOptions, Snapshotter, SnapshotterConfig};
use nodefs::{MountOptions, NodeFs, Store};

use crate::cleanup::Guard;
use crate::scenarios::filesystem::View;

/// The peer row of the filesystem scenario: the same nodefs mount with FUSE passthrough off.
pub const NODEFS_PT_OFF: &str = "nodefs, passthrough off";
/// A row of the filesystem scenario: the same nodefs mount with its requests read from /dev/fuse
/// instead of taken over FUSE io_uring (the ring's before), when the run's server uses the ring.
pub const NODEFS_DEV_FUSE: &str = "nodefs, /dev/fuse transport";
/// A row of the filesystem scenario: the same nodefs mount with its requests over FUSE io_uring,
/// on a server of its own, when the run's server does not use the ring (`NODEFS_URING=0`).
pub const NODEFS_URING: &str = "nodefs, io_uring transport";

/// Lazily opened Grove pieces shared by the scenarios of one run.
pub struct GroveEnv {
    image: PathBuf,
    work: PathBuf,
    criu: PathBuf,
    stack: OnceLock<Result<Arc<Stack>, String>>,
}

/// What was opened.
pub struct Stack {
    pub rt: Arc<GroveRuntime>,
    pub nodefs: Option<Arc<NodeFs>>,
    pub snap: Result<Arc<Snapshotter>, String>,
    /// Why sandboxes are not on nodefs, when they are not.
    pub nodefs_error: Option<String>,
    /// Grove-named host items present before this run made anything (other instances' own).
    pub baseline: Vec<String>,
}

impl GroveEnv {
    pub fn new(image: &Path, work: &Path, criu: &Path) -> Self {
        GroveEnv {
            image: image.into(),
            work: work.into(),
            criu: criu.into(),
            stack: OnceLock::new(),
        }
    }

    fn stack(&self) -> Result<Arc<Stack>, String> {
        self.stack
            .get_or_init(|| {
                open_stack(&self.image, &self.work, &self.criu)
                    .map(Arc::new)
                    .map_err(|e| format!("{e:#}"))
            })
            .clone()
    }

    /// The runtime, or why it is not usable.
    pub fn runtime(&self) -> Result<Arc<GroveRuntime>, String> {
        self.stack().map(|s| s.rt.clone())
    }

    /// Why sandbox roots are not nodefs (None when they are).
    pub fn nodefs_error(&self) -> Option<String> {
        match self.stack() {
            Ok(s) => s.nodefs_error.clone(),
            Err(e) => Some(e),
        }
    }

    /// Three writable nodefs views of `tree` (imported once into the run's store): Grove as it
    /// runs (FUSE passthrough on, requests over FUSE io_uring where the kernel offers it), then
    /// the same tree with passthrough off ([`NODEFS_PT_OFF`], passthrough's before) and over the
    /// other transport: /dev/fuse reads ([`NODEFS_DEV_FUSE`], the ring's before) or, when the
    /// run's server has the ring off, io_uring ([`NODEFS_URING`]). Or why not.
    pub fn nodefs_views(&self, tree: &Path, work: &Path) -> Result<Vec<View>, String> {
        let st = self.stack()?;
        let fs = st
            .nodefs
            .clone()
            .ok_or_else(|| st.nodefs_error.clone().unwrap_or_default())?;
        let t = Instant::now();
        let id = fs
            .store()
            .import_dir(tree)
            .map_err(|e| format!("nodefs import of the tree: {e}"))?;
        let import_ms = t.elapsed().as_secs_f64() * 1e3;
        let env_off = std::env::var_os("NODEFS_NO_PASSTHROUGH").is_some();
        let mut views = Vec::new();
        // (name, passthrough, io_uring, on a ring server of its own)
        let other = if fs.uring() {
            (NODEFS_DEV_FUSE, true, false, false)
        } else {
            (NODEFS_URING, true, true, true)
        };
        let variants = [
            ("nodefs", true, true, false),
            (NODEFS_PT_OFF, false, true, false),
            other,
        ];
        let ring_fs = nodefs::NodeFs::with_options(
            fs.store().clone(),
            nodefs::ServerOptions {
                uring: true,
                ..nodefs::ServerOptions::from_env()
            },
        );
        for (name, passthrough, uring, own_server) in variants {
            let server = if own_server {
                ring_fs.clone()
            } else {
                fs.clone()
            };
            let dir = tempfile::Builder::new()
                .prefix("fs-nodefs-")
                .tempdir_in(work)
                .map_err(|e| e.to_string())?
                .keep();
            let mnt = dir.join("mnt");
            std::fs::create_dir(&mnt).map_err(|e| e.to_string())?;
            let opts = MountOptions {
                upper_dir: dir.join("upper"),
                passthrough,
                uring,
                ..Default::default()
            };
            let m = server
                .mount(&id, &mnt, opts)
                .map_err(|e| format!("nodefs mount ({name}): {e}"))?;
            let transport = m.transport();
            let guard = Guard::new(format!("nodefs mount {}", mnt.display()), move || {
                let unmounted = m.unmount().map_err(|e| e.to_string());
                drop(server);
                unmounted
            });
            let is_grove = name == "nodefs";
            let note = if is_grove {
                Some(format!(
                    "nodefs: the tree imported into the store in {:.1} s, then mounted writable \
                     three times: \"nodefs\" (FUSE passthrough for executables, shared libraries \
                     and files of 64 MiB or more; requests over {transport}), \"{NODEFS_PT_OFF}\" \
                     (every read served by the server: the before of passthrough) and \
                     \"{}\" (the same mount over the other transport){}",
                    import_ms / 1e3,
                    other.0,
                    if env_off {
                        "; NODEFS_NO_PASSTHROUGH is set, so all run without passthrough"
                    } else {
                        ""
                    },
                ))
            } else if uring && transport == nodefs::Transport::DevFuse {
                Some(format!(
                    "this kernel offers no FUSE over io_uring: the \"{NODEFS_URING}\" row reads \
                     /dev/fuse too"
                ))
            } else {
                None
            };
            views.push(View {
                name: name.into(),
                is_grove,
                root: mnt.clone(),
                write_dir: mnt,
                _guard: Some(guard),
                note,
            });
        }
        Ok(views)
    }

    /// Grove's snapshot/fork path, or why it is not usable.
    pub fn snapshotter(&self) -> Result<GroveSnapshots, String> {
        let st = self.stack()?;
        let snap = st.snap.clone()?;
        Ok(GroveSnapshots {
            rt: st.rt.clone(),
            store: st.nodefs.as_ref().map(|n| n.store().clone()),
            snap,
            made: Mutex::new(Vec::new()),
        })
    }

    /// Shuts down what was opened (destroys every sandbox left).
    pub fn shutdown(&self) {
        if let Some(Ok(st)) = self.stack.get() {
            if let Ok(s) = &st.snap {
                for i in s.list() {
                    let _ = s.delete(&i.id);
                }
            }
            st.rt.rt.shutdown();
            // Then, as groved's stop does: the CRIU zygote ends, and a ksmd boost still alive
            // ends and puts ksmd's knobs back.
            if let Ok(s) = &st.snap {
                s.close();
            }
        }
    }

    /// Residue the runtime itself sees (mounts, cgroups, netns, ... it owns), re-checked over ~2 s:
    /// other runtime instances' short-lived setup processes show up for milliseconds.
    pub fn residue(&self) -> Vec<String> {
        let Some(Ok(st)) = self.stack.get() else {
            return Vec::new();
        };
        let mut items: Vec<String> = st.rt.rt.residue().items.iter().map(residue_key).collect();
        items.retain(|i| !st.baseline.contains(i));
        for _ in 0..30 {
            if items.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            let now: Vec<String> = st.rt.rt.residue().items.iter().map(residue_key).collect();
            items.retain(|i| now.contains(i));
        }
        items
    }
}

fn residue_key(i: &grove_runtime::ResidueItem) -> String {
    format!("grove residue {}: {}", i.kind, i.what)
}

fn open_stack(image_dir: &Path, work: &Path, criu: &Path) -> Result<Stack> {
    let name = image_dir
        .file_name()
        .and_then(|n| n.to_str())
        .context("image dir has no name")?
        .to_string();
    let pid = std::process::id();
    // As groved does at start by default (`favor_cgroup_moves`): Grove is measured as it runs.
    if let Err(e) = grove_runtime::cgroup::moves::favor_moves() {
        eprintln!("grove-bench: favordynmods stays off: {e}");
    }
    // Records and mountpoints: on a systemd node the run dir is /run/grove, a tmpfs; this machine
    // kind's /run is on disk, so the bench keeps it on a tmpfs as well. What sandboxes write (their
    // upper layers) stays on disk, under the state dir.
    let run_dir = crate::util::tmpfs_dir(&format!("grove-bench-{pid}-run"));
    let state_dir = work.join("grove-state");
    std::fs::create_dir_all(&state_dir)?;
    crate::progress::step(
        0.0,
        "grove: importing the base image into a fresh nodefs store",
    );
    let nodefs = (|| -> Result<Arc<NodeFs>> {
        let store =
            Store::open(&work.join("grove-store")).map_err(|e| anyhow!("Store::open: {e}"))?;
        let id = store
            .import_dir(image_dir)
            .map_err(|e| anyhow!("import {}: {e}", image_dir.display()))?;
        store
            .set_ref(&name, &id)
            .map_err(|e| anyhow!("set_ref: {e}"))?;
        Ok(NodeFs::with_options(
            store,
            nodefs::ServerOptions::from_env(),
        ))
    })();
    let (mut nodefs, mut nodefs_error) = match nodefs {
        Ok(n) => (Some(n), None),
        Err(e) => (None, Some(format!("{e:#}"))),
    };
    let mut rt = None;
    if let Some(fs) = &nodefs {
        let svc = Arc::new(nodefs::service::Local::new(fs.clone()));
        let roots: Arc<dyn RootProvider> = Arc::new(NodefsRoot::new(svc, state_dir.join("uppers")));
        match GroveRuntime::open(roots, &name, "nodefs", &run_dir, &state_dir) {
            Ok(r) => rt = Some(r),
            Err(e) => nodefs_error = Some(format!("runtime on nodefs roots: {e:#}")),
        }
    }
    let rt = match rt {
        Some(r) => r,
        None => {
            nodefs = None;
            let roots = overlay_roots(image_dir, &name)?;
            GroveRuntime::open(roots, &name, "overlayfs", &run_dir, &state_dir)?
        }
    };
    let rt = Arc::new(rt);
    let baseline = rt.rt.residue().items.iter().map(residue_key).collect();
    let snap = match &nodefs {
        None => Err(format!(
            "needs nodefs roots ({})",
            nodefs_error.clone().unwrap_or_default()
        )),
        Some(fs) => {
            let cfg = SnapshotterConfig {
                state_dir: state_dir.clone(),
                run_dir: run_dir.clone(),
                criu: Some(criu.into()),
                // /run is on disk on this machine kind; dumps and fork images go to a tmpfs,
                // as they do under /run/grove on a systemd host.
                scratch_dir: Some(rt.scratch_dir.clone()),
                image_cache_bytes: None,
                merge_fork_pages: true,
                lazy_pages: true,
                // As groved reads it: an A/B of the incremental path is one variable away.
                track_dirty_pages: std::env::var("GROVE_TRACK_DIRTY_PAGES").as_deref() != Ok("0"),
            };
            Snapshotter::new(
                cfg,
                rt.rt.clone(),
                Arc::new(nodefs::service::Local::new(fs.clone())),
            )
            .map_err(|e| format!("Snapshotter::new: {e}"))
        }
    };
    Ok(Stack {
        rt,
        nodefs,
        snap,
        nodefs_error,
        baseline,
    })
}

pub(crate) fn overlay_roots(image_dir: &Path, name: &str) -> Result<Arc<dyn RootProvider>> {
    let state = image_dir
        .parent()
        .filter(|p| p.file_name() == Some("images".as_ref()))
        .and_then(|p| p.parent())
        .context("image dir must be <state>/images/<name> for OverlayRoot")?;
    let roots: Arc<dyn RootProvider> = Arc::new(OverlayRoot::new(state));
    if !roots.image_exists(name) {
        bail!("OverlayRoot does not find image {name:?}");
    }
    Ok(roots)
}

/// The Grove runtime used by the bench.
pub struct GroveRuntime {
    pub rt: Arc<Runtime>,
    pub image: String,
    root_kind: &'static str,
    run_dir: PathBuf,
    /// The snapshotter's tmpfs scratch (dumps, fork images), removed with the runtime.
    pub scratch_dir: PathBuf,
    cgroup_root: String,
    /// How grove-init is linked, for the report (a static one starts sandboxes faster).
    init_linking: String,
}

impl GroveRuntime {
    fn open(
        roots: Arc<dyn RootProvider>,
        image: &str,
        root_kind: &'static str,
        run_dir: &Path,
        state_dir: &Path,
    ) -> Result<GroveRuntime> {
        let mut cfg = RuntimeConfig::default_paths();
        cfg.init_binary = crate::util::grove_init();
        if !cfg.init_binary.is_file() {
            bail!(
                "grove-init not found at {} (cargo build -p grove-runtime, or set GROVE_INIT_BINARY)",
                cfg.init_binary.display()
            );
        }
        cfg.state_dir = state_dir.into();
        cfg.run_dir = run_dir.into();
        cfg.cgroup_root = format!("grove-bench-{}", std::process::id());
        cfg.net_pool = "10.219.0.0/16".into();
        // The bench measures speed and density, not admission: let 2,000 small idle sandboxes in.
        cfg.capacity = CapacityOverrides {
            cpu_millis: Some(10_000_000),
            sandboxes: Some(4096),
            memory_mb: Some(64 * 1024),
            pids: Some(1_000_000),
            ..Default::default()
        };
        let cgroup_root = cfg.cgroup_root.clone();
        let init_linking = match crate::util::elf_interpreter(&cfg.init_binary) {
            Ok(None) => "statically linked".to_string(),
            Ok(Some(ld)) => format!(
                "dynamically linked ({ld}; scripts/build-init makes the static build nodes run)"
            ),
            Err(e) => format!("linking unknown ({e})"),
        };
        let rt = Runtime::new(cfg, roots).map_err(|e| anyhow!("Runtime::new: {e}"))?;
        let g = GroveRuntime {
            rt,
            image: image.into(),
            root_kind,
            run_dir: run_dir.into(),
            scratch_dir: format!("/dev/shm/grove-bench-{}", std::process::id()).into(),
            cgroup_root,
            init_linking,
        };
        g.cycle_true()
            .context("probe create → exec true → destroy")?;
        Ok(g)
    }

    /// "grove (nodefs root)" and the like.
    pub fn label(&self) -> String {
        format!("grove ({} root)", self.root_kind)
    }

    pub fn describe(&self) -> String {
        format!(
            "sandbox roots on {} (image {:?}), grove-init {}, run dir {} (a tmpfs, as /run/grove is \
             on a systemd node), upper layers on disk",
            self.root_kind,
            self.image,
            self.init_linking,
            self.run_dir.display()
        )
    }

    pub fn spec(&self, limits: Option<Limits>) -> SandboxSpec {
        let mut s = SandboxSpec::from_image(self.image.clone());
        s.limits = limits;
        s
    }

    pub fn create(&self, spec: SandboxSpec) -> Result<SandboxId> {
        Ok(self.rt.create(spec).map_err(|e| anyhow!("create: {e}"))?.id)
    }

    pub fn destroy(&self, id: &SandboxId) -> Result<()> {
        self.rt
            .destroy(id)
            .map_err(|e| anyhow!("destroy {id}: {e}"))
    }

    /// Runs argv to completion; fails unless it exits 0.
    pub fn exec_ok(&self, id: &SandboxId, argv: &[&str]) -> Result<Vec<u8>> {
        let r = self
            .rt
            .exec(id, ExecRequest::argv(argv.iter().copied()))
            .map_err(|e| anyhow!("exec: {e}"))?;
        if r.exit_code != Some(0) {
            bail!(
                "exec {argv:?}: exit {:?} signal {:?}: {}",
                r.exit_code,
                r.signal,
                String::from_utf8_lossy(&r.stderr).trim()
            );
        }
        Ok(r.stdout)
    }

    /// Starts argv in the background (it outlives the exec).
    pub fn exec_background(&self, id: &SandboxId, argv: &[&str]) -> Result<()> {
        let mut req = ExecRequest::argv(argv.iter().copied());
        req.background = true;
        self.rt
            .exec(id, req)
            .map_err(|e| anyhow!("exec background: {e}"))?;
        Ok(())
    }

    /// create → exec `true` → destroy.
    pub fn cycle_true(&self) -> Result<()> {
        let id = self.create(self.spec(None))?;
        let r = self.exec_ok(&id, &["true"]);
        let d = self.destroy(&id);
        r?;
        d
    }

    /// `cycle_true` with the sandbox in a user namespace of its own.
    pub fn cycle_true_userns(&self) -> Result<()> {
        let mut spec = self.spec(None);
        spec.userns = true;
        let id = self.create(spec)?;
        let r = self.exec_ok(&id, &["true"]);
        let d = self.destroy(&id);
        r?;
        d
    }

    pub fn init_pid(&self, id: &SandboxId) -> Option<i32> {
        self.rt.get(id).ok().and_then(|i| i.init_pid)
    }
}

impl Drop for GroveRuntime {
    fn drop(&mut self) {
        self.rt.shutdown();
        let _ = std::fs::remove_dir_all(&self.run_dir);
        let _ = std::fs::remove_dir_all(&self.scratch_dir);
        // Anything the runtime left was already captured by the residue check; leave the host clean.
        crate::util::sweep_cgroups(&self.cgroup_root);
    }
}

/// A sandbox running the checkpoint workload; destroyed on drop.
pub struct WorkloadSandbox {
    rt: Arc<GroveRuntime>,
    pub id: SandboxId,
    pub init_pid: i32,
}

impl Drop for WorkloadSandbox {
    fn drop(&mut self) {
        let _ = self.rt.destroy(&self.id);
    }
}

/// Grove snapshot and fork; the snapshots it made are deleted on drop.
pub struct GroveSnapshots {
    rt: Arc<GroveRuntime>,
    /// The content store the snapshots go to (for its size).
    pub store: Option<Arc<Store>>,
    snap: Arc<Snapshotter>,
    made: Mutex<Vec<String>>,
}

impl Drop for GroveSnapshots {
    fn drop(&mut self) {
        for id in self.made.lock().map(|v| v.clone()).unwrap_or_default() {
            let _ = self.snap.delete(&id);
        }
    }
}

/// One pause → resume of a workload sandbox.
pub struct PauseFigures {
    /// The sandbox's memory cgroup charge before the pause (nothing is charged while paused:
    /// the cgroup is gone).
    pub charged_bytes: u64,
    /// MemAvailable gained across the pause (noisy on a shared machine).
    pub freed_bytes: u64,
    pub pause_ms: f64,
    /// Resume until the workload answers again from its restored state.
    pub resume_ms: f64,
}

fn mem_available() -> u64 {
    grove_runtime::host_mem::available_kb().map_or(0, |kb| kb * 1024)
}

/// One snapshot's figures.
pub struct SnapFigures {
    pub id: String,
    pub wall_ms: f64,
    pub frozen_ms: f64,
    /// From the snapshot call until its images were in the store.
    pub durable_ms: f64,
    pub bytes_added: u64,
}

impl GroveSnapshots {
    pub fn label(&self) -> String {
        self.rt.label()
    }

    /// A sandbox running the workload in the background.
    pub fn start_workload(&self, heap: u64) -> Result<WorkloadSandbox> {
        self.start_workload_as(heap, false)
    }

    /// The same, in a user namespace of its own with `userns`.
    pub fn start_workload_as(&self, heap: u64, userns: bool) -> Result<WorkloadSandbox> {
        let mem = ((3 * heap) >> 20) + 512;
        let limits = Limits {
            memory_mb: mem,
            ..Limits::default()
        };
        let mut spec = self.rt.spec(Some(limits));
        spec.userns = userns;
        let id = self.rt.create(spec)?;
        let mut argv = vec!["python3".to_string()];
        argv.extend(crate::workload::args(heap, "/tmp/grove-bench-state"));
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let started = self.rt.exec_background(&id, &argv);
        match (started, self.rt.init_pid(&id)) {
            (Ok(()), Some(init_pid)) => Ok(WorkloadSandbox {
                rt: self.rt.clone(),
                id,
                init_pid,
            }),
            (r, _) => {
                let _ = self.rt.destroy(&id);
                r.and(Err(anyhow!("sandbox {id} has no init pid")))
            }
        }
    }

    /// Snapshot of a running sandbox (it keeps running).
    pub fn snapshot(&self, sb: &WorkloadSandbox, name: &str) -> Result<SnapFigures> {
        let t = Instant::now();
        let info = self
            .snap
            .snapshot(
                &sb.id,
                SnapshotOptions {
                    name: Some(name.into()),
                    ..Default::default()
                },
            )
            .map_err(|e| anyhow!("snapshot of {}: {e}", sb.id))?;
        let wall_ms = t.elapsed().as_secs_f64() * 1e3;
        self.made
            .lock()
            .map_err(|_| anyhow!("poisoned"))?
            .push(info.id.clone());
        let info = self.wait_durable(&info.id)?;
        Ok(SnapFigures {
            id: info.id,
            wall_ms,
            frozen_ms: info.dump_ms as f64,
            durable_ms: t.elapsed().as_secs_f64() * 1e3,
            bytes_added: info.bytes_added,
        })
    }

    /// Waits until a snapshot's images are in the store (they are stored in the background).
    pub fn wait_durable(&self, id: &str) -> Result<grove_snapshotter::SnapshotInfo> {
        self.snap
            .wait_durable(id, Duration::from_secs(300))
            .map_err(|e| anyhow!("snapshot {id} never became durable: {e}"))
    }

    /// Pauses a workload sandbox to the store, then resumes it and waits until it answers.
    pub fn pause_resume(&self, sb: &mut WorkloadSandbox, heap: u64) -> Result<PauseFigures> {
        let charged = self
            .rt
            .rt
            .usage(&sb.id)
            .map_err(|e| anyhow!("usage: {e}"))?;
        let avail_before = mem_available();
        let t = Instant::now();
        self.snap
            .pause(&sb.id)
            .map_err(|e| anyhow!("pause of {}: {e}", sb.id))?;
        let pause_ms = t.elapsed().as_secs_f64() * 1e3;
        let freed = mem_available().saturating_sub(avail_before);
        let t = Instant::now();
        let (info, _) = self
            .snap
            .resume(&sb.id)
            .map_err(|e| anyhow!("resume of {}: {e}", sb.id))?;
        sb.init_pid = info
            .init_pid
            .ok_or_else(|| anyhow!("resumed {} has no init pid", sb.id))?;
        crate::scenarios::checkpoint::all_answer(&[sb.init_pid], heap)?;
        Ok(PauseFigures {
            charged_bytes: charged.memory_bytes,
            freed_bytes: freed,
            pause_ms,
            resume_ms: t.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Deletes a snapshot this run made (its chunks stay until a gc).
    pub fn delete(&self, id: &str) -> Result<()> {
        self.snap
            .delete(id)
            .map_err(|e| anyhow!("delete snapshot {id}: {e}"))?;
        if let Ok(mut v) = self.made.lock() {
            v.retain(|m| m != id);
        }
        Ok(())
    }

    /// The snapshotter's scratch (dumps, materialized fork images).
    pub fn scratch_dir(&self) -> PathBuf {
        self.rt.scratch_dir.clone()
    }

    /// Grove's own residue view (mounts, cgroups, netns, processes it owns), as `GroveEnv::residue`.
    pub fn runtime_residue(&self) -> Vec<String> {
        self.rt.rt.residue().items.iter().map(residue_key).collect()
    }

    /// Fork branches restored mergeable by ksmd, or not (see `Snapshotter::set_merge_fork_pages`).
    pub fn set_merge_fork_pages(&self, on: bool) {
        self.snap.set_merge_fork_pages(on);
    }

    /// Forks `n` branches and keeps them (destroyed when the handles drop).
    pub fn fork_keep(&self, snap: &str, n: usize) -> Result<Vec<WorkloadSandbox>> {
        let results = self
            .snap
            .fork(snap, n as u32, ForkOptions::default())
            .map_err(|e| anyhow!("fork: {e}"))?;
        let mut kept = Vec::new();
        let mut err = None;
        for r in results {
            match r {
                Ok(info) => match info.init_pid {
                    Some(init_pid) => kept.push(WorkloadSandbox {
                        rt: self.rt.clone(),
                        id: info.id,
                        init_pid,
                    }),
                    None => {
                        let _ = self.rt.destroy(&info.id);
                        err = err.or(Some(anyhow!("branch {} has no init pid", info.id)));
                    }
                },
                Err(e) => err = err.or(Some(anyhow!("fork branch: {e}"))),
            }
        }
        match err {
            Some(e) => Err(e),
            None => Ok(kept),
        }
    }

    /// Forks `n` branches and waits until each answers; returns ms. Branches are destroyed after.
    pub fn fork_and_answer(&self, snap: &str, n: usize, heap: u64) -> Result<f64> {
        let t = Instant::now();
        let results = self
            .snap
            .fork(snap, n as u32, ForkOptions::default())
            .map_err(|e| anyhow!("fork: {e}"))?;
        let mut ids = Vec::new();
        let mut pids = Vec::new();
        let mut err = None;
        for r in results {
            match r {
                Ok(info) => {
                    ids.push(info.id.clone());
                    match info.init_pid {
                        Some(p) => pids.push(p),
                        None => err = err.or(Some(anyhow!("branch {} has no init pid", info.id))),
                    }
                }
                Err(e) => err = err.or(Some(anyhow!("fork branch: {e}"))),
            }
        }
        let answered = match err {
            Some(e) => Err(e),
            None => crate::scenarios::checkpoint::all_answer(&pids, heap),
        };
        let ms = t.elapsed().as_secs_f64() * 1e3;
        for id in &ids {
            let _ = self.rt.destroy(id);
        }
        answered.map(|()| ms)
    }
}
