//! The `Snapshotter`: snapshot a running sandbox into the store, fork snapshots into branches,
//! list/get/delete them and move them between nodes.

use std::collections::{BTreeMap, HashSet};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grove_runtime::{CommitRoot, Runtime, SandboxId, SandboxInfo, SandboxState};
use nodefs::service::FsService;
use nodefs::ManifestId;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use crate::criu::{self, Criu};
use crate::durable::Imports;
use crate::error::Error;
use crate::images::{self, ImageCache};
use crate::ksm;
use crate::lazy::{self, LazyCopies};
use crate::record::{self, RecordDir, SnapshotInfo};
use crate::{cgroups, netns, plan, userns_images};

/// Dump attempts when a transient control connection is open at the freeze instant.
const DUMP_ATTEMPTS: u32 = 4;

/// How long a snapshot of a lazily restored branch waits for its memory to be complete.
const LAZY_WAIT: Duration = Duration::from_secs(120);

/// At most this many branches per fork call.
pub const MAX_FORK: u32 = 64;

/// Where the snapshotter keeps its files. `state_dir` and `run_dir` are the daemon's (records go
/// to `<state_dir>/snapshots`, materialized images to `<run_dir>/snapshots`).
#[derive(Debug, Clone)]
pub struct SnapshotterConfig {
    pub state_dir: PathBuf,
    pub run_dir: PathBuf,
    /// CRIU binary; None = /var/lib/grove/criu/criu, then `criu` on PATH.
    pub criu: Option<PathBuf>,
    /// Where dumps are written and images materialized for forks; None = `run_dir`. It should
    /// be a tmpfs (as /run is on systemd hosts): a snapshot of a 256 MiB heap then never
    /// waits on the disk's page cache or writeback, and restores read from memory.
    pub scratch_dir: Option<PathBuf>,
    /// Cap on the materialized images kept in scratch space (see `ImageCache`); None = a
    /// quarter of the machine's memory.
    pub image_cache_bytes: Option<u64>,
    /// Fork branches share their clean pages through ksmd (see `ksm.rs`), where the kernel can.
    pub merge_fork_pages: bool,
    /// Fork branches are restored with CRIU lazy pages (memory copied on demand and in the
    /// background after the branch runs), where the kernel allows.
    pub lazy_pages: bool,
}

/// A quarter of MemTotal (1 GiB if /proc/meminfo cannot be read).
fn default_image_cache_bytes() -> u64 {
    let kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .unwrap_or(4 << 20);
    kib * 1024 / 4
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SnapshotOptions {
    pub name: Option<String>,
    /// Destroy the source sandbox once the snapshot is committed.
    #[serde(default)]
    pub stop: bool,
    /// Return only once the images are in the content store (see `durable.rs`).
    #[serde(default)]
    pub durable: bool,
}

/// How long `SnapshotOptions::durable` waits for the images to be stored.
const DURABLE_WAIT: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ForkOptions {
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Unset: the source's TTL; 0: none.
    pub ttl_secs: Option<u64>,
    /// Branch i gets hostname `<prefix>-<i>`; None keeps the runtime's default per-sandbox name.
    pub hostname_prefix: Option<String>,
    /// How long each branch may wait for room (ms) instead of the node's queue timeout.
    #[serde(default)]
    pub queue_timeout_ms: Option<u64>,
}

/// Snapshots and forks of sandboxes.
pub struct Snapshotter {
    runtime: Arc<Runtime>,
    store: Arc<dyn FsService>,
    criu: Criu,
    records: RecordDir,
    pub(crate) index: RwLock<BTreeMap<String, SnapshotInfo>>,
    pub(crate) cache: ImageCache,
    /// Scratch space of dumps and restores in progress (emptied at start).
    work_root: PathBuf,
    /// Work dirs of lazy restores, whose daemons outlive a crash (see `lazy.rs`).
    lazy_root: PathBuf,
    /// CRIU's cgroup yard (symlinks, remade at each start).
    cgroup_yard: Option<cgroups::CgroupYard>,
    /// Sandboxes with a snapshot in progress.
    busy: Mutex<HashSet<SandboxId>>,
    lazy_pages: AtomicBool,
    /// Restore fork branches mergeable and boost ksmd while they settle (`ksm.rs`); false where
    /// the kernel has no KSM.
    merge_fork_pages: AtomicBool,
    merger: ksm::Merger,
    /// Branches whose memory is still being copied in by a lazy-pages daemon.
    lazy: Arc<LazyCopies>,
    pub(crate) imports: Imports,
}

impl std::fmt::Debug for Snapshotter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshotter")
            .field("criu", &self.criu)
            .field("snapshots", &self.index.read().len())
            .finish_non_exhaustive()
    }
}

/// Store refs that keep a snapshot's manifests alive across gc runs and restarts.
fn ref_names(id: &str) -> [String; 2] {
    [
        format!("grove/snapshots/{id}/fs"),
        format!("grove/snapshots/{id}/images"),
    ]
}
const REF_PREFIX: &str = "grove/snapshots/";

pub(crate) use grove_runtime::now_ms;

pub(crate) fn parse_manifest(hex: &str, what: &str) -> Result<ManifestId, Error> {
    hex.parse().map_err(|_| Error::InvalidInput {
        field: "snapshot",
        reason: format!("{what} {hex:?} is not a manifest id"),
    })
}

impl Snapshotter {
    /// The delta base for the images of a checkpoint of `source` (spec `spec`) taken at
    /// `at_ms`: the images of its latest earlier stored checkpoint (snapshot or pause), else of
    /// the snapshot it was forked from (see `images::import`). `except`: the checkpoint itself.
    pub(crate) fn images_base(
        &self,
        source: &str,
        spec: &grove_runtime::SandboxSpec,
        at_ms: u64,
        except: Option<&str>,
    ) -> Option<ManifestId> {
        let index = self.index.read();
        let own = index
            .values()
            .filter(|s| s.source == source && s.durable && Some(s.id.as_str()) != except)
            .filter(|s| s.created_at_ms <= at_ms)
            .max_by_key(|s| s.created_at_ms)
            .map(|s| s.images_root.clone());
        let hex = own.or_else(|| {
            let from = spec.labels.get("grove.snapshot")?;
            index
                .get(from)
                .filter(|s| s.durable)
                .map(|s| s.images_root.clone())
        })?;
        parse_manifest(&hex, "images root").ok()
    }
}

/// Empties the scratch dir a killed predecessor may have left. CRIU killed mid-restore leaves its
/// cgroup yard (`.criu.cgyard.*`, every cgroup hierarchy) mounted there: unmount everything under
/// it, deepest first, and remove nothing while a mount remains (never recurse into a cgroupfs).
fn reset_work_root(work_root: &Path) {
    let mounted = || -> Vec<PathBuf> {
        grove_runtime::mounts::mount_points()
            .unwrap_or_default()
            .into_iter()
            .filter(|m| m.starts_with(work_root))
            .collect()
    };
    let mut under = mounted();
    under.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    for m in &under {
        tracing::warn!(mount = %m.display(), "unmounting a predecessor's scratch mount");
        let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
    }
    if mounted().is_empty() {
        for log in criu_logs(work_root, 4) {
            crate::criu::remove_staging_dirs(&log);
        }
        let _ = std::fs::remove_dir_all(work_root);
    } else {
        tracing::error!(dir = %work_root.display(), "scratch dir still has mounts; left in place");
    }
}

/// CRIU logs (`*.log`) under `dir`, at most `depth` levels down, following no symlinks.
fn criu_logs(dir: &Path, depth: usize) -> Vec<PathBuf> {
    let mut logs = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return logs;
    };
    for e in entries.flatten() {
        let Ok(t) = e.file_type() else { continue };
        let p = e.path();
        if t.is_dir() && depth > 0 {
            logs.extend(criu_logs(&p, depth - 1));
        } else if t.is_file() && p.extension().is_some_and(|x| x == "log") {
            logs.push(p);
        }
    }
    logs
}

/// A dumped and committed sandbox: its root's manifest and CRIU's images in scratch space
/// (removed on drop unless moved away first).
pub(crate) struct Capture {
    pub sandbox: SandboxId,
    pub spec: grove_runtime::SandboxSpec,
    pub fs_root: ManifestId,
    pub images_dir: PathBuf,
    pub dump_ms: u64,
    /// Captured with `keep_frozen` from a running sandbox: thawed on drop unless `release`d.
    thaw_on_drop: bool,
    runtime: Arc<Runtime>,
    _scratch: Scratch,
}

impl Capture {
    /// The sandbox stays frozen after this capture is dropped (it is being parked).
    pub fn release(&mut self) {
        self.thaw_on_drop = false;
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if self.thaw_on_drop {
            if let Err(e) = self.runtime.thaw(&self.sandbox) {
                tracing::error!(sandbox = %self.sandbox, error = %e, "thaw after a failed pause");
            }
        }
    }
}

/// Where in the run dir the snapshotter keeps CRIU's cgroup yard (symlinks, remade at each start,
/// removed by [`Snapshotter::close`]).
const CGROUP_YARD_DIR: &str = "criu-cgroup-yard";

/// Removes a scratch directory when dropped (success or failure).
struct Scratch(PathBuf);
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Snapshotter {
    pub fn new(
        cfg: SnapshotterConfig,
        runtime: Arc<Runtime>,
        store: Arc<dyn FsService>,
    ) -> Result<Arc<Snapshotter>, Error> {
        let criu = Criu::locate(cfg.criu.as_deref())?;
        let records = RecordDir::open(cfg.state_dir.join("snapshots"))?;
        let scratch = cfg.scratch_dir.as_ref().unwrap_or(&cfg.run_dir);
        let work_root = scratch.join("snapshot-work");
        reset_work_root(&work_root);
        std::fs::create_dir_all(&work_root).map_err(|e| Error::io(&work_root, e))?;
        let lazy_root = scratch.join(lazy::LAZY_DIR);
        std::fs::create_dir_all(&lazy_root).map_err(|e| Error::io(&lazy_root, e))?;
        let cgroup_yard = cgroups::CgroupYard::make(&cfg.run_dir.join(CGROUP_YARD_DIR));
        if cfg.merge_fork_pages {
            ksm::recover();
        }
        let mut index = BTreeMap::new();
        for info in records.load_all()? {
            index.insert(info.id.clone(), info);
        }
        let s = Snapshotter {
            runtime,
            store,
            criu,
            records,
            index: RwLock::new(index),
            cache: ImageCache::new(
                scratch.join("snapshots"),
                cfg.image_cache_bytes
                    .unwrap_or_else(default_image_cache_bytes),
                images::MIN_IDLE,
            ),
            work_root,
            lazy_root,
            cgroup_yard,
            busy: Mutex::new(HashSet::new()),
            lazy_pages: AtomicBool::new(cfg.lazy_pages),
            merge_fork_pages: AtomicBool::new(cfg.merge_fork_pages && ksm::available()),
            merger: ksm::Merger::default(),
            lazy: Arc::default(),
            imports: Imports::default(),
        };
        // Before anything may snapshot a branch whose memory a predecessor's daemon still fills.
        s.lazy.adopt(&s.lazy_root, &s.runtime);
        s.drop_orphans();
        s.register_paused();
        let s = Arc::new(s);
        s.watch_parked();
        s.start_imports();
        Ok(s)
    }

    /// At an orderly stop: removes CRIU's cgroup yard, and the scratch and image-cache dirs when
    /// empty (the cache holds what pending imports still need otherwise).
    pub fn close(&self) {
        if let Some(y) = &self.cgroup_yard {
            y.remove();
        }
        let _ = std::fs::remove_dir(&self.work_root);
        // Daemons still copying keep theirs: the next start adopts them.
        self.lazy.settle(&self.runtime, Duration::from_secs(2));
        let _ = std::fs::remove_dir(&self.lazy_root);
        let _ = std::fs::remove_dir(self.cache.dir());
    }

    /// After a crash: refs of snapshots never recorded, and materialized images of deleted ones.
    fn drop_orphans(&self) {
        let index = self.index.read();
        if let Ok(refs) = self.store.refs() {
            for (name, _) in refs {
                let Some(rest) = name.strip_prefix(REF_PREFIX) else {
                    continue;
                };
                let id = rest.split('/').next().unwrap_or("");
                if !index.contains_key(id) {
                    let _ = self.store.delete_ref(&name);
                }
            }
        }
        self.cache.retain(&|id| index.contains_key(id));
    }

    pub fn criu(&self) -> &Criu {
        &self.criu
    }

    pub(crate) fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    /// Snapshots a running sandbox: freeze → CRIU dump (leave running) → nodefs commit → thaw
    /// → durable record → returned, forkable from the dumped images; they go into the store in
    /// the background (`durable.rs`) unless `opts.durable` asks to wait. Any failure before
    /// the record thaws and leaves the source as it was; no scratch is left behind.
    pub fn snapshot(
        &self,
        sandbox: &SandboxId,
        opts: SnapshotOptions,
    ) -> Result<SnapshotInfo, Error> {
        if let Some(n) = &opts.name {
            record::validate_name(n)?;
            self.check_name_free(n, None)?;
        }
        let _busy = self.claim(sandbox)?;
        let cap = self.capture(sandbox, false)?;
        let thawed = Instant::now();
        // Keep gc off the new root until its ref is written.
        let _pin = Pin::new(&*self.store, cap.fs_root)?;
        let fs_hex = cap.fs_root.to_hex();
        let at = now_ms();
        let info = SnapshotInfo {
            id: record::capture_id(&fs_hex, &cap.spec, sandbox.as_str(), at),
            root: None,
            name: opts.name,
            source: sandbox.to_string(),
            created_at_ms: at,
            fs_root: fs_hex,
            images_root: String::new(),
            spec: cap.spec.clone(),
            dump_ms: cap.dump_ms,
            bytes_added: 0,
            store_ms: 0,
            durable: false,
            paused: None,
        };
        // The dumped images become the materialized copy forks restore from, and the source
        // of the background import.
        self.cache.take(&info.id, &cap.images_dir)?;
        if let Err(e) = self.commit_pending(&info, &cap.fs_root) {
            self.cache.drop_snapshot(&info.id);
            return Err(e);
        }
        drop(cap);
        self.queue_import(&info.id);
        tracing::info!(
            snapshot = %info.id, %sandbox, frozen_ms = info.dump_ms,
            after_thaw_ms = thawed.elapsed().as_millis() as u64, "snapshot taken"
        );
        if opts.stop {
            self.runtime.destroy(sandbox)?;
        }
        if opts.durable {
            return self.wait_durable(&info.id, DURABLE_WAIT);
        }
        Ok(info)
    }

    /// Freeze → dump (leaving the tree in place) → commit the root → thaw, unless `keep_frozen`
    /// (then the caller owns the thaw, see `Capture::thaw`). On failure the sandbox is thawed
    /// and untouched.
    pub(crate) fn capture(&self, sandbox: &SandboxId, keep_frozen: bool) -> Result<Capture, Error> {
        let view = self.runtime.checkpoint_view(sandbox)?;
        if view.spec.userns && view.veth_host.is_some() {
            // Its dump succeeds, but CRIU cannot restore the veth into a branch's own user
            // namespace ("Unknown peer net namespace"): refused before a snapshot no fork can use.
            return Err(Error::Unsupported {
                what: format!(
                    "checkpoint of {sandbox}: egress networking in a user namespace is not \
                     checkpointed yet (sandboxes with network mode none are)"
                ),
            });
        }
        let mount = view.root.committer().ok_or_else(|| Error::Unsupported {
            what: format!("snapshot of {sandbox}: its root is not a nodefs mount"),
        })?;
        let was_frozen = self.runtime.get(sandbox)?.state == SandboxState::Paused;
        // A branch restored lazily has holes in its memory until its daemon is done.
        self.lazy.wait(sandbox, LAZY_WAIT)?;
        let scratch = Scratch(self.work_root.join(format!("dump-{sandbox}-{}", now_ms())));
        let images_dir = scratch.0.join(plan::IMAGES);
        let controllers = cgroups::own_controllers(view.init_pid, &view.cgroups);
        let base = criu::DumpOptions {
            pid: view.init_pid,
            images_dir: images_dir.clone(),
            work_dir: scratch.0.join(plan::LOGS),
            leave_running: true,
            external_mounts: view
                .externals
                .iter()
                .map(|e| (e.sandbox_path.clone(), e.key.clone()))
                .collect(),
            freeze_cgroup: None,
            cgroup_yard: self
                .cgroup_yard
                .as_ref()
                .and_then(|y| y.covering(&controllers)),
            cgroup_controllers: controllers,
            tcp_established: true,
            track_mem: false,
            prev_images_dir: None,
            // An egress sandbox's namespace holds its veth and is dumped in full. So is a user
            // namespace's: its branches must own theirs (sysfs mounts only where the mounter's
            // user namespace owns the network namespace), not join one made by the host.
            external_net: match (&view.veth_host, view.spec.userns) {
                (None, false) => Some(
                    netns::inode_of(view.init_pid)
                        .map_err(|e| Error::io(format!("/proc/{}/ns/net", view.init_pid), e))?,
                ),
                _ => None,
            },
        };
        // Soft-dirty kernels: copy memory while the sandbox runs; the frozen dump then writes
        // only what changed since. A failed pre-dump only costs the optimization.
        let mut pre =
            plan::pre_dump(self.criu.features(), was_frozen, &base, &scratch.0).filter(|p| {
                match self.criu.pre_dump(p) {
                    Ok(_) => true,
                    Err(e) => {
                        tracing::warn!(%sandbox, error = %e, "pre-dump failed; dumping in full");
                        let _ = std::fs::remove_dir_all(&p.images_dir);
                        false
                    }
                }
            });

        // A per-request control connection (an exec just finishing, a ping) may be open at the
        // freeze instant; CRIU then refuses the dump. Such connections close within
        // milliseconds, so retry a few times before reporting a conflict.
        let mut attempt = 0;
        loop {
            attempt += 1;
            let _ = std::fs::remove_dir_all(&images_dir);
            std::fs::create_dir_all(&images_dir).map_err(|e| Error::io(&images_dir, e))?;
            let t0 = Instant::now();
            if !was_frozen {
                self.runtime.freeze(sandbox)?;
            }
            let opts = criu::DumpOptions {
                freeze_cgroup: cgroups::frozen(&view.cgroups),
                ..plan::dump(base.clone(), pre.as_ref())
            };
            let frozen = self.dump_and_commit(&opts, mount, pre.as_ref());
            let thaw = |ok: bool| {
                if was_frozen || (ok && keep_frozen) {
                    Ok(())
                } else {
                    self.runtime.thaw(sandbox)
                }
            };
            let dump_ms = t0.elapsed().as_millis() as u64;
            match frozen {
                Ok(fs_root) => {
                    thaw(true)?;
                    return Ok(Capture {
                        sandbox: sandbox.clone(),
                        spec: view.spec.clone(),
                        fs_root,
                        images_dir,
                        dump_ms,
                        thaw_on_drop: keep_frozen && !was_frozen,
                        runtime: self.runtime.clone(),
                        _scratch: scratch,
                    });
                }
                Err(Error::Criu(criu::Error::ExternalSocket { .. })) if attempt < DUMP_ATTEMPTS => {
                    thaw(false)?;
                    // A failed dump may have reset the dirty bits the pre-dump relies on.
                    if let Some(p) = pre.take() {
                        let _ = std::fs::remove_dir_all(&p.images_dir);
                    }
                    tracing::debug!(%sandbox, attempt, "dump met an open connection; retrying");
                    std::thread::sleep(Duration::from_millis(20 * attempt as u64));
                }
                Err(e) => {
                    thaw(false)?;
                    return Err(self.conflict_or(sandbox, e));
                }
            }
        }
    }

    /// The frozen part: dump the tree (leaving it running), then commit its root.
    fn dump_and_commit(
        &self,
        opts: &criu::DumpOptions,
        mount: &dyn CommitRoot,
        pre: Option<&criu::PreDumpOptions>,
    ) -> Result<ManifestId, Error> {
        self.criu.dump(opts)?;
        if !opts.cgroup_controllers.is_empty() {
            cgroups::write_dumped_list(&opts.images_dir, &opts.cgroup_controllers)
                .map_err(|e| Error::io(&opts.images_dir, e))?;
        }
        if let Some(p) = pre {
            plan::nest_parent(&opts.images_dir, &p.images_dir)
                .map_err(|e| Error::io(&opts.images_dir, e))?;
        }
        Ok(nodefs::ObjectId(mount.commit().map_err(Error::Commit)?))
    }

    pub(crate) fn claim(&self, sandbox: &SandboxId) -> Result<BusyGuard<'_>, Error> {
        if !self.busy.lock().insert(sandbox.clone()) {
            return Err(Error::Conflict {
                sandbox: sandbox.to_string(),
                reason: "a snapshot of this sandbox is already in progress".into(),
            });
        }
        Ok(BusyGuard {
            set: &self.busy,
            id: sandbox.clone(),
        })
    }

    /// A dump that met a socket connected outside the sandbox is a state conflict (typically an
    /// exec in flight holds the control connection), not an internal failure.
    fn conflict_or(&self, sandbox: &SandboxId, e: Error) -> Error {
        match e {
            Error::Criu(criu::Error::ExternalSocket { log_tail, .. }) => Error::Conflict {
                sandbox: sandbox.to_string(),
                reason: format!(
                    "a connection from outside the sandbox is open (an exec in flight?); retry when it ends ({})",
                    log_tail.first().map(String::as_str).unwrap_or("")
                ),
            },
            Error::Criu(criu::Error::DumpFailed { ref log_tail, .. })
                if criu::log::is_rlimit_denied(log_tail) =>
            {
                Error::Unsupported {
                    what: format!(
                        "checkpointing sandbox {sandbox}: a process in it runs as another user, and \
                         CRIU reading its rlimits takes CAP_SYS_RESOURCE, which groved lacks ({})",
                        log_tail.first().map(String::as_str).unwrap_or("")
                    ),
                }
            }
            other => other,
        }
    }

    fn check_name_free(&self, name: &str, except: Option<&str>) -> Result<(), Error> {
        if let Some(other) = self
            .index
            .read()
            .values()
            .find(|s| s.name.as_deref() == Some(name))
        {
            if Some(other.id.as_str()) != except {
                return Err(Error::NameTaken {
                    name: name.into(),
                    id: other.id.clone(),
                });
            }
        }
        Ok(())
    }

    /// A snapshot whose images are not stored yet: the fs ref, then the record, then the index.
    fn commit_pending(&self, info: &SnapshotInfo, fs: &ManifestId) -> Result<(), Error> {
        let [fs_ref, _] = ref_names(&info.id);
        self.store.set_ref(&fs_ref, fs)?;
        if let Err(e) = self.records.write(info) {
            let _ = self.store.delete_ref(&fs_ref);
            return Err(e);
        }
        self.index.write().insert(info.id.clone(), info.clone());
        Ok(())
    }

    /// The images of a pending snapshot are stored: their ref, then the durable record.
    pub(crate) fn commit_images(
        &self,
        info: &SnapshotInfo,
        imgs: &ManifestId,
    ) -> Result<(), Error> {
        let [_, img_ref] = ref_names(&info.id);
        self.store.set_ref(&img_ref, imgs)?;
        self.records.write(info)?;
        self.index.write().insert(info.id.clone(), info.clone());
        Ok(())
    }

    /// Refs first (so gc keeps the data), then the record (the commit point), then the index.
    pub(crate) fn commit_record(
        &self,
        info: &SnapshotInfo,
        fs: &ManifestId,
        imgs: &ManifestId,
    ) -> Result<(), Error> {
        let [fs_ref, img_ref] = ref_names(&info.id);
        self.store.set_ref(&fs_ref, fs)?;
        self.store.set_ref(&img_ref, imgs)?;
        if let Err(e) = self.records.write(info) {
            let _ = self.store.delete_ref(&fs_ref);
            let _ = self.store.delete_ref(&img_ref);
            return Err(e);
        }
        self.index.write().insert(info.id.clone(), info.clone());
        Ok(())
    }

    /// Forks a snapshot into `count` new sandboxes, restored concurrently. The outer error is
    /// for bad input; each branch has its own result, and a failed branch leaves nothing.
    pub fn fork(
        &self,
        snapshot: &str,
        count: u32,
        opts: ForkOptions,
    ) -> Result<Vec<Result<SandboxInfo, Error>>, Error> {
        if count == 0 || count > MAX_FORK {
            return Err(Error::InvalidInput {
                field: "count",
                reason: format!("{count}: must be 1..={MAX_FORK}"),
            });
        }
        let info = self.get(snapshot)?;
        let images = self.images_of(&info)?;
        let merge = self.merge_fork_pages.load(Ordering::Relaxed);
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..count)
                .map(|i| {
                    let (info, images, opts) = (&info, &images, &opts);
                    s.spawn(move || self.fork_one(info, images, i, opts, merge))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::Unsupported {
                            what: "a fork branch thread panicked".into(),
                        })
                    })
                })
                .collect()
        });
        if merge && results.iter().any(Result::is_ok) {
            self.merger.after_fork();
        }
        Ok(results)
    }

    /// The materialized images of a snapshot: in scratch space already, or exported from the
    /// store (durable snapshots only: a pending one's images are in scratch space until stored).
    pub(crate) fn images_of(&self, info: &SnapshotInfo) -> Result<PathBuf, Error> {
        if let Some(dir) = self.cache.existing(&info.id) {
            return Ok(dir);
        }
        if !info.durable {
            return Err(Error::Unsupported {
                what: format!(
                    "snapshot {}: its images are neither stored nor in scratch space",
                    info.id
                ),
            });
        }
        let images_root = parse_manifest(&info.images_root, "images root")?;
        let dir = self.cache.get(&*self.store, &info.id, &images_root)?;
        self.trim_cache();
        Ok(dir)
    }

    /// Keeps the materialized images under their cap; only stored snapshots' copies go.
    pub(crate) fn trim_cache(&self) {
        let evicted = self
            .cache
            .trim(&|id| self.index.read().get(id).is_some_and(|s| s.durable));
        if !evicted.is_empty() {
            tracing::info!(
                count = evicted.len(),
                "materialized images evicted (cap reached)"
            );
        }
    }

    fn fork_one(
        &self,
        info: &SnapshotInfo,
        images: &Path,
        i: u32,
        opts: &ForkOptions,
        merge_pages: bool,
    ) -> Result<SandboxInfo, Error> {
        let mut spec = info.spec.clone();
        spec.image = info.fs_root.clone();
        spec.hostname = opts.hostname_prefix.as_ref().map(|p| format!("{p}-{i}"));
        spec.labels.extend(opts.labels.clone());
        spec.labels.insert("grove.snapshot".into(), info.id.clone());
        // 0: no expiry for the branch; unset: the source's TTL.
        spec.ttl_secs = match opts.ttl_secs {
            Some(0) => None,
            t => t.or(spec.ttl_secs),
        };
        spec.queue_timeout_ms = opts.queue_timeout_ms;
        self.restore_into(spec, images, None, merge_pages)
    }

    /// Creates a sandbox (fresh id, or `same_id` for a resume) whose tree CRIU restores from
    /// `images`.
    fn restore_into(
        &self,
        spec: grove_runtime::SandboxSpec,
        images: &Path,
        same_id: Option<&SandboxId>,
        merge_pages: bool,
    ) -> Result<SandboxInfo, Error> {
        // Lazy pages need a userfaultfd in the restored tasks, which a user namespace's root may
        // not open (unprivileged userfaultfd is off, and /dev/userfaultfd is the host's).
        let lazy = self.lazy_pages.load(Ordering::Relaxed)
            && self.criu.features().lazy_pages
            && !spec.userns;
        let inherit_netns = netns::is_external(images);
        let mut restore = |t: &grove_runtime::RestoreTarget| -> Result<i32, Box<dyn std::error::Error + Send + Sync>> {
            // A lazy restore's daemon may outlive us: its dir must survive a restart's reset.
            let work = if lazy {
                self.lazy_root.join(format!("{}-{}", t.id, now_ms()))
            } else {
                self.work_root.join(format!("restore-{}-{}", t.id, now_ms()))
            };
            // A user-namespace branch restores its own range: the images with the map rewritten,
            // inside the work dir, which lives as long as CRIU (and a lazy-pages daemon) needs it.
            let images = match t.ids {
                None => images.to_path_buf(),
                Some(ids) => {
                    let dir = work.join("images");
                    userns_images::remap(images, &dir, ids).map_err(|e| {
                        let _ = std::fs::remove_dir_all(&work);
                        Box::new(Error::io(&dir, e)) as Box<dyn std::error::Error + Send + Sync>
                    })?
                }
            };
            let opts = criu::RestoreOptions {
                images_dir: images.clone(),
                work_dir: work.clone(),
                root: t.root_dir.clone(),
                pidfile: work.join("restored.pid"),
                cgroup_roots: t.cgroups.clone(),
                external_mounts: t.externals.iter().map(|e| (e.key.clone(), e.host_path.clone())).collect(),
                tcp_established: true,
                lazy_pages: lazy,
                inherit_netns,
                cgroup_yard: self.cgroup_yard.as_ref().and_then(|y| y.for_images(&images)),
                merge_pages,
            };
            self.restore_one(&t.id, &opts).map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
        };
        match same_id {
            None => self.runtime.create_restored(spec, &mut restore),
            Some(id) => self
                .runtime
                .create_restored_as(id.clone(), spec, &mut restore),
        }
        .map_err(unwrap_restore_error)
    }

    /// `restore_into` under an existing (parked) id.
    pub(crate) fn restore_as(
        &self,
        id: &SandboxId,
        spec: grove_runtime::SandboxSpec,
        images: &Path,
    ) -> Result<SandboxInfo, Error> {
        self.restore_into(spec, images, Some(id), false)
    }

    /// One CRIU restore; with lazy pages, a `criu lazy-pages` daemon serves the memory and is
    /// reaped (and its work dir removed) once it has copied everything. A branch whose daemon
    /// fails while it runs has lost memory: it is destroyed.
    fn restore_one(&self, id: &SandboxId, opts: &criu::RestoreOptions) -> Result<i32, criu::Error> {
        let work = opts.work_dir.clone();
        let daemon = if opts.lazy_pages {
            match self.criu.lazy_pages(&opts.images_dir, &work) {
                Ok(d) => Some(d),
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&work);
                    return Err(e);
                }
            }
        } else {
            None
        };
        // The fresh namespace lives on in the restored tree; our fd goes after the restore.
        let ns = match opts.inherit_netns.then(netns::fresh_loopback).transpose() {
            Ok(ns) => ns,
            Err(e) => {
                if let Some(d) = daemon {
                    d.kill();
                }
                let _ = std::fs::remove_dir_all(&work);
                return Err(criu::Error::io(&work, e));
            }
        };
        let r = self
            .criu
            .restore_in(opts, ns.as_ref().map(|f| f.as_fd()))
            .map(|(pid, _)| pid);
        drop(ns);
        match (daemon, &r) {
            (Some(d), Ok(_)) => {
                d.set_nice(lazy::DAEMON_NICE);
                let ended = self.lazy.start(id, d.pid());
                let (runtime, id) = (self.runtime.clone(), id.clone());
                d.reap_later(move |ok| {
                    lazy::remove_work_dir(&work);
                    // A waiting snapshot learns of the failure only once the branch is failed.
                    if !ok {
                        lazy_failed(&runtime, &id);
                    }
                    ended(ok);
                })
            }
            (Some(d), Err(_)) => {
                d.kill();
                lazy::remove_work_dir(&work);
            }
            (None, _) => {
                let _ = std::fs::remove_dir_all(&work);
            }
        }
        r
    }

    /// Whether fork branches are restored mergeable (the config's `merge_fork_pages`, where the
    /// kernel has KSM).
    pub fn merges_fork_pages(&self) -> bool {
        self.merge_fork_pages.load(Ordering::Relaxed)
    }

    /// Turns fork page merging on or off from now on (the bench measures both in one run); on
    /// stays off where the kernel has no KSM.
    pub fn set_merge_fork_pages(&self, on: bool) {
        self.merge_fork_pages
            .store(on && ksm::available(), Ordering::Relaxed);
    }

    /// Turns lazy-pages restores (`SnapshotterConfig::lazy_pages`) on or off from now on. A test
    /// knob (feature `test-knobs`).
    #[cfg(any(test, feature = "test-knobs"))]
    pub fn set_lazy_pages(&self, on: bool) {
        self.lazy_pages.store(on, Ordering::Relaxed);
    }

    /// All snapshots, oldest first.
    pub fn list(&self) -> Vec<SnapshotInfo> {
        let mut v: Vec<_> = self
            .index
            .read()
            .values()
            .filter(|s| s.paused.is_none())
            .cloned()
            .collect();
        v.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        v
    }

    /// A snapshot by id (hex) or name; pause records are not snapshots.
    pub fn get(&self, snapshot: &str) -> Result<SnapshotInfo, Error> {
        let index = self.index.read();
        if let Some(s) = index.get(snapshot).filter(|s| s.paused.is_none()) {
            return Ok(s.clone());
        }
        index
            .values()
            .find(|s| s.name.as_deref() == Some(snapshot))
            .cloned()
            .ok_or_else(|| Error::NotFound {
                snapshot: snapshot.into(),
            })
    }

    /// Deletes the record, the refs and the materialized images. Chunks are freed by the next gc
    /// unless something else (a branch's root, another snapshot) still reaches them.
    pub fn delete(&self, snapshot: &str) -> Result<(), Error> {
        let info = self.get(snapshot)?;
        self.delete_by_id(&info.id)
    }

    /// Record, refs, materialized images, then the index entry: whoever sees it gone from the
    /// index sees nothing else of it either.
    pub(crate) fn delete_by_id(&self, id: &str) -> Result<(), Error> {
        let _commit = self.imports.commit.lock();
        self.records.remove(id)?;
        let refs = ref_names(id)
            .iter()
            .try_for_each(|r| self.store.delete_ref(r));
        self.cache.drop_snapshot(id);
        self.index.write().remove(id);
        Ok(refs?)
    }

    /// Manifests every snapshot needs: roots for the store's gc.
    pub fn live_manifests(&self) -> Vec<ManifestId> {
        self.index
            .read()
            .values()
            .flat_map(|s| [s.fs_root.parse().ok(), s.images_root.parse().ok()])
            .flatten()
            .collect()
    }

    pub(crate) fn store(&self) -> &Arc<dyn FsService> {
        &self.store
    }

    /// Records an imported snapshot (the transfer module verified it).
    pub(crate) fn record_imported(
        &self,
        info: SnapshotInfo,
        fs: &ManifestId,
        imgs: &ManifestId,
    ) -> Result<SnapshotInfo, Error> {
        if let Some(existing) = self.index.read().get(&info.id) {
            return Ok(existing.clone());
        }
        if let Some(n) = &info.name {
            self.check_name_free(n, None)?;
        }
        self.commit_record(&info, fs, imgs)?;
        Ok(info)
    }
}

/// Pins a manifest in the store (gc keeps it) while alive.
pub(crate) struct Pin<'a> {
    store: &'a dyn FsService,
    id: ManifestId,
}

impl<'a> Pin<'a> {
    pub(crate) fn new(store: &'a dyn FsService, id: ManifestId) -> Result<Pin<'a>, Error> {
        store.pin(&id)?;
        Ok(Pin { store, id })
    }
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        self.store.unpin(&self.id);
    }
}

pub(crate) struct BusyGuard<'a> {
    set: &'a Mutex<HashSet<SandboxId>>,
    id: SandboxId,
}
impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.set.lock().remove(&self.id);
    }
}

/// A lazy-pages daemon exited with an error (or was killed). If its branch is still running,
/// pages it never received would read as zeros: the branch is marked failed rather than left
/// running on wrong memory.
fn lazy_failed(runtime: &Runtime, id: &SandboxId) {
    lazy::fail_branch(
        runtime,
        id,
        "the daemon serving its memory (criu lazy-pages) failed before every page was delivered",
    );
}

/// The runtime wraps our restore error; give callers the typed CRIU error back.
fn unwrap_restore_error(e: grove_runtime::Error) -> Error {
    match e {
        grove_runtime::Error::Restore { id, source } => match source.downcast::<criu::Error>() {
            Ok(c) => Error::Criu(*c),
            Err(source) => Error::Runtime(grove_runtime::Error::Restore { id, source }),
        },
        other => Error::Runtime(other),
    }
}
