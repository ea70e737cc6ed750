//! The `Snapshotter`: snapshot a running sandbox into the store, fork snapshots into branches,
//! list/get/delete them and move them between nodes. This file holds its state, construction and
//! start-up clean-up; `capture` takes snapshots, `restore` forks and restores them, `index` keeps
//! the records and refs.

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
use crate::record::{self, MemoryDump, RecordDir, SnapshotInfo};
use crate::{cgroups, netns, plan, userns_images};

mod capture;
mod index;
mod restore;
mod tracking;
mod whole;

pub(crate) use index::Pin;
pub(crate) use tracking::{has_parent, make_whole};

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
    /// Snapshots after a sandbox's first dump only the pages written since its last snapshot,
    /// where the kernel lacks soft-dirty but has userfaultfd write-protect (`tracking.rs`).
    pub track_dirty_pages: bool,
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
    /// Dirty-page tracking by userfaultfd write-protect, per sandbox (`tracking.rs`).
    tracking: Arc<tracking::Tracking>,
    /// `SnapshotterConfig::track_dirty_pages` (used where the kernel can, `tracks_dirty_pages`).
    track_dirty_pages: bool,
    /// Incremental images being made whole, which forks and imports wait for (`whole.rs`).
    whole: Arc<whole::Wholes>,
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
    pub memory_dump: MemoryDump,
    /// Why a dump was full where the kernel could have tracked dirty pages.
    pub full_dump_reason: Option<String>,
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
        // Probed now, not inside the first snapshot or pause (a pause at a sandbox's timeout
        // must not pay two `criu check` runs; an e2b auto-pause test missed its deadline so).
        criu.features();
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
            tracking: Arc::default(),
            track_dirty_pages: cfg.track_dirty_pages,
            whole: Arc::default(),
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
        self.criu.stop_zygote();
        self.merger.stop();
        if let Some(y) = &self.cgroup_yard {
            y.remove();
        }
        self.tracking.forget_all();
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

    pub(crate) fn store(&self) -> &Arc<dyn FsService> {
        &self.store
    }
}
