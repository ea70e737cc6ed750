//! `NodeFs`, the node's FUSE server, and its registry of mounts: mounting a view of a manifest,
//! committing it, unmounting it, and the mounts it forgets or removes because the kernel no
//! longer has them (or still has ones it does not serve). What it asks the kernel is in `kernel`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use fuser::Session;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::commit;
use super::fuse::{Fs, Shared, MAX_WRITE};
use super::kernel::{abort_connection, detach, enable_uring, nodefs_mountpoints, session_config};
use super::ring::{MountRing, RingPool, Transport};
use super::state::{Quota, State};
use crate::error::{io_err, Error};
use crate::id::ManifestId;
use crate::store::Store;

/// How to mount a view.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MountOptions {
    /// Byte limit for data this mount writes (ENOSPC beyond it).
    pub quota_bytes: Option<u64>,
    /// Limit on inodes this mount creates (ENOSPC beyond it).
    pub quota_inodes: Option<u64>,
    /// Per-mount scratch directory for the upper layer; must be absent or empty; removed on
    /// unmount.
    pub upper_dir: PathBuf,
    pub read_only: bool,
    /// Let the kernel read eligible files (executables, shared libraries, large files)
    /// straight from their whole-file objects through FUSE passthrough (default on; off
    /// serves every read from the server, for before/after measurements).
    /// [`ServerOptions::passthrough`] off turns it off for every mount of the server.
    /// Absent in a request from an older client: on.
    #[serde(default = "passthrough_default")]
    pub passthrough: bool,
    /// Serve the mount over FUSE io_uring where the server has the ring on
    /// ([`ServerOptions::uring`], on by default) and the kernel offers it; false reads
    /// requests from /dev/fuse whatever the server's setting. Absent in a request from an older
    /// client: true.
    #[serde(default = "uring_default")]
    pub uring: bool,
    /// Owners shifted into a sandbox's host id range (a sandbox in a user namespace); the
    /// store keeps image-space ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_shift: Option<super::IdShift>,
}

fn passthrough_default() -> bool {
    true
}

fn uring_default() -> bool {
    true
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            quota_bytes: None,
            quota_inodes: None,
            upper_dir: PathBuf::new(),
            read_only: false,
            passthrough: passthrough_default(),
            uring: uring_default(),
            id_shift: None,
        }
    }
}

/// What a mount uses against its quota.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Usage {
    /// Bytes counted against the quota: upper-layer data (4 KiB blocks written or copied
    /// up) plus `meta_bytes`.
    pub bytes: u64,
    /// Of `bytes`, what the mount's own inodes, names and xattrs cost (they are held in the
    /// server's memory, see `state::INODE_COST`).
    #[serde(default)]
    pub meta_bytes: u64,
    /// Inodes created by this mount and still alive.
    pub inodes: u64,
}

/// What holds for every mount of a server. The daemons' binaries take it from their environment
/// ([`ServerOptions::from_env`]); the library reads no environment of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerOptions {
    /// FUSE passthrough where a mount allows it (see [`MountOptions::passthrough`]).
    pub passthrough: bool,
    /// A cloned /dev/fuse fd per session thread (fuser's `clone_fd`), for measurements.
    pub clone_fd: bool,
    /// FUSE over io_uring where a mount allows it (see [`MountOptions::uring`]) and the kernel
    /// offers it. On by default: the server's mounts share one queue per CPU, so a mount's
    /// set-up costs what a /dev/fuse mount's does, and its requests skip the read and write
    /// on /dev/fuse (docs/nodefs-format.md, "FUSE transports", has the figures).
    pub uring: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            passthrough: true,
            clone_fd: false,
            uring: true,
        }
    }
}

impl ServerOptions {
    /// `NODEFS_NO_PASSTHROUGH` (set: passthrough off), `NODEFS_CLONE_FD` (set: on) and
    /// `NODEFS_URING` (`0`, `false`, `off` or `no`: every mount reads /dev/fuse; unset or
    /// anything else: mounts go over io_uring where the kernel offers it), for the daemons'
    /// binaries and the bench to call.
    pub fn from_env() -> ServerOptions {
        ServerOptions {
            passthrough: std::env::var_os("NODEFS_NO_PASSTHROUGH").is_none(),
            clone_fd: std::env::var_os("NODEFS_CLONE_FD").is_some(),
            uring: uring_from_env(std::env::var_os("NODEFS_URING").as_deref()),
        }
    }
}

/// Whether `NODEFS_URING`'s value leaves the ring on (absent: on).
fn uring_from_env(v: Option<&std::ffi::OsStr>) -> bool {
    v.and_then(|v| v.to_str()).is_none_or(|v| {
        !matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "false" | "off" | "no"
        )
    })
}

/// The node's FUSE server: any number of mounts, one multi-threaded session each.
pub struct NodeFs {
    store: Arc<Store>,
    options: ServerOptions,
    mounts: Mutex<Vec<Arc<Mount>>>,
    /// Whether the kernel offers FUSE over io_uring (and the options allow it).
    uring: bool,
    /// The FUSE-over-io_uring queues every ring mount of the server shares, started by the
    /// first (None: they could not start; mounts then read /dev/fuse).
    ring: OnceLock<Option<RingPool>>,
    /// The id of this server's first mount: lower ids are mounts of a server before it.
    first_id: u64,
    next_id: AtomicU64,
}

impl std::fmt::Debug for NodeFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeFs")
            .field("mounts", &self.mounts.lock().len())
            .finish()
    }
}

/// One mounted view.
pub struct Mount {
    id: u64,
    shared: Arc<Shared>,
    base: ManifestId,
    mountpoint: PathBuf,
    upper_dir: PathBuf,
    session: Mutex<Option<fuser::BackgroundSession>>,
    /// The mount's part of the server's FUSE-over-io_uring queues, when it uses them (or when
    /// some queues registered it before the kernel refused another: its entries go with the
    /// connection, and unmount waits for them).
    ring: Mutex<Option<MountRing>>,
    transport: Transport,
    owner: Weak<NodeFs>,
    last_commit: Mutex<Option<ManifestId>>,
    /// A commit made but not yet sealed (`Mount::commit_unsealed`), pinned.
    unsealed: Mutex<Option<ManifestId>>,
}

impl std::fmt::Debug for Mount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mount")
            .field("base", &self.base)
            .field("mountpoint", &self.mountpoint)
            .finish()
    }
}

/// How long an unmount waits for the ring queues to release the mount's entries (the kernel
/// completes them as the connection ends; far longer than that takes).
const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// Mount ids start at the clock's nanoseconds, so ids of one server never name a mount of the
/// server before it: a client holding the id of a mount whose server died gets "no such
/// mount" from the next server, not another sandbox's mount.
fn first_mount_id() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        .max(1)
}

impl NodeFs {
    pub fn new(store: Arc<Store>) -> Arc<NodeFs> {
        NodeFs::with_options(store, ServerOptions::default())
    }

    pub fn with_options(store: Arc<Store>, options: ServerOptions) -> Arc<NodeFs> {
        // fuser gives every session thread a 16 MiB zeroed request buffer. glibc's dynamic
        // mmap threshold can serve that from an arena and memset it (16 MiB resident per
        // thread); a fixed threshold keeps it on fresh, untouched mmap pages.
        static MALLOC_TUNED: std::sync::Once = std::sync::Once::new();
        MALLOC_TUNED.call_once(|| {
            crate::sys::set_mmap_threshold(1 << 20);
        });
        let first_id = first_mount_id();
        let uring = options.uring && enable_uring();
        Arc::new(NodeFs {
            store,
            options,
            mounts: Mutex::new(Vec::new()),
            uring,
            ring: OnceLock::new(),
            first_id,
            next_id: AtomicU64::new(first_id),
        })
    }

    /// The store this server reads from.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Mount a writable (unless `opts.read_only`) view of `base` at `mountpoint`.
    pub fn mount(
        self: &Arc<Self>,
        base: &ManifestId,
        mountpoint: &Path,
        opts: MountOptions,
    ) -> Result<Arc<Mount>, Error> {
        if !self.store.contains(base) {
            return Err(Error::UnknownManifest(*base));
        }
        let root = self.store.get_tree(base)?;
        let upper = &opts.upper_dir;
        if upper.as_os_str().is_empty() {
            return Err(Error::Mount {
                path: mountpoint.to_path_buf(),
                source: std::io::Error::other("upper_dir is required"),
            });
        }
        // An absent upper dir is made by the first write (`FileData::upper_file`): most
        // sandboxes write nothing to their root, and a mkdir + rmdir per mount is a share of
        // every create → destroy on a disk-backed run dir (issue 4).
        if upper.exists()
            && std::fs::read_dir(upper)
                .map_err(io_err(upper))?
                .next()
                .is_some()
        {
            return Err(Error::Mount {
                path: mountpoint.to_path_buf(),
                source: std::io::Error::other(format!(
                    "upper_dir {} is not empty",
                    upper.display()
                )),
            });
        }
        let quota = Quota {
            bytes: opts.quota_bytes,
            inodes: opts.quota_inodes,
            ..Default::default()
        };
        let mut state = State::new(self.store.clone(), *base, root.meta, upper.clone(), quota);
        state.id_shift = opts.id_shift;
        // The ring is asked for at INIT only where the server's queues run.
        let pool = (opts.uring && self.uring)
            .then(|| self.ring_pool())
            .flatten()
            .filter(|p| p.healthy());
        let shared = Arc::new(Shared::new(
            state,
            self.store.clone(),
            opts.read_only,
            opts.passthrough && self.options.passthrough,
            pool.is_some(),
        ));
        let config = session_config(opts.read_only, self.options.clone_fd);
        let cleanup = || {
            let _ = std::fs::remove_dir_all(upper);
        };
        let mut session = Session::new(Fs(shared.clone()), mountpoint, &config).map_err(|e| {
            cleanup();
            Error::Mount {
                path: mountpoint.to_path_buf(),
                source: e,
            }
        })?;
        let (ring, transport) = match pool {
            Some(p) => self.start_ring(p, &session, &shared, mountpoint),
            None => (None, Transport::DevFuse),
        };
        if transport == Transport::IoUring {
            // /dev/fuse now carries only FORGET and INTERRUPT: one reader is plenty.
            session.set_n_threads(1);
        }
        let bg = match session.spawn() {
            Ok(bg) => bg,
            Err(e) => {
                detach(mountpoint);
                if let Some(r) = ring {
                    r.wait_released(RELEASE_WAIT);
                }
                cleanup();
                return Err(Error::Mount {
                    path: mountpoint.to_path_buf(),
                    source: e,
                });
            }
        };
        self.store.pin(base);
        let m = Arc::new(Mount {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            shared,
            base: *base,
            mountpoint: mountpoint.to_path_buf(),
            upper_dir: upper.clone(),
            session: Mutex::new(Some(bg)),
            ring: Mutex::new(ring),
            transport,
            owner: Arc::downgrade(self),
            last_commit: Mutex::new(None),
            unsealed: Mutex::new(None),
        });
        self.mounts.lock().push(m.clone());
        Ok(m)
    }

    /// The server's ring queues, started by the first mount that asks (None: they cannot
    /// start, and mounts read /dev/fuse).
    fn ring_pool(&self) -> Option<&RingPool> {
        self.ring
            .get_or_init(|| match RingPool::start() {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::warn!(error = %e,
                        "FUSE over io_uring queues cannot start: mounts read /dev/fuse");
                    None
                }
            })
            .as_ref()
    }

    /// Entry mappings the server's ring queues hold (each mount has one per queue while it
    /// lives), for tests and diagnostics.
    pub fn ring_entries(&self) -> usize {
        self.ring
            .get()
            .and_then(Option::as_ref)
            .map_or(0, RingPool::entries)
    }

    /// Whether the server's mounts may use FUSE over io_uring: its options allow it and the
    /// kernel offers it (a mount still falls back to /dev/fuse if its queues cannot register).
    pub fn uring(&self) -> bool {
        self.uring
    }

    /// Test knob: the kernel refuses the next ring mount's registration on one queue, as a
    /// kernel without the ring would (the mount then falls back to /dev/fuse). Starts the
    /// queues if they are not running.
    #[cfg(feature = "test-knobs")]
    pub fn refuse_next_ring_register(&self) {
        if let Some(p) = self.ring_pool() {
            p.refuse_next_register();
        }
    }

    /// Threads serving the server's ring queues (one per possible CPU once the first ring
    /// mount started them, whatever the number of mounts).
    pub fn ring_threads(&self) -> usize {
        self.ring
            .get()
            .and_then(Option::as_ref)
            .map_or(0, RingPool::threads)
    }

    /// The mount's entries on the server's queues when its INIT took the ring, and the
    /// transport: /dev/fuse when the kernel offered no ring, or a queue could not register and
    /// the kernel dropped it (the entries other queues registered are then released when the
    /// connection ends).
    fn start_ring(
        &self,
        pool: &RingPool,
        session: &Session<Fs>,
        shared: &Arc<Shared>,
        mountpoint: &Path,
    ) -> (Option<MountRing>, Transport) {
        if !shared.uring.load(Ordering::Relaxed) {
            return (None, Transport::DevFuse);
        }
        // The connection to abort if the ring fails while the mount lives.
        let minor = std::ffi::CString::new(mountpoint.as_os_str().as_encoded_bytes())
            .ok()
            .and_then(|c| crate::sys::cached_dev_minor(&c).ok());
        let where_ = mountpoint.to_path_buf();
        let on_failure = Box::new(move || {
            // A request of this connection may now wait forever: say so loudly if it cannot
            // be ended.
            match minor {
                Some(m) if abort_connection(m) => {}
                _ => tracing::error!(mountpoint = %where_.display(), ?minor,
                    "FUSE ring failed and the connection could not be aborted: \
                     requests of the mount may hang until it is unmounted"),
            }
        });
        match pool.attach(session, Fs(shared.clone()), MAX_WRITE as usize, on_failure) {
            Ok(r) => (Some(r), Transport::IoUring),
            Err((e, r)) => {
                tracing::warn!(mountpoint = %mountpoint.display(), error = %e,
                    "FUSE over io_uring unavailable: serving the mount from /dev/fuse");
                (r, Transport::DevFuse)
            }
        }
    }

    /// Live mounts.
    pub fn mounts(&self) -> Vec<Arc<Mount>> {
        self.mounts.lock().clone()
    }

    /// Whether `id` names a mount of this server (served now or gone), not one of a server
    /// before it.
    pub fn is_own_id(&self, id: u64) -> bool {
        id >= self.first_id
    }

    /// The live mount with this id.
    pub fn find(&self, id: u64) -> Option<Arc<Mount>> {
        self.mounts.lock().iter().find(|m| m.id == id).cloned()
    }

    /// Forgets mounts someone else removed (a restarted daemon reclaiming a sandbox detaches its
    /// root): their sessions end, their pins and upper dirs go. Returns their mountpoints.
    pub fn forget_gone(&self) -> Vec<PathBuf> {
        let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") else {
            return Vec::new();
        };
        let live = nodefs_mountpoints(&mi);
        let gone: Vec<Arc<Mount>> = {
            let mut ms = self.mounts.lock();
            let (gone, keep) = std::mem::take(&mut *ms)
                .into_iter()
                .partition(|m| !live.iter().any(|l| same_path(&m.mountpoint, l)));
            *ms = keep;
            gone
        };
        gone.iter()
            .map(|m| {
                m.forget();
                m.mountpoint.clone()
            })
            .collect()
    }

    /// Remove nodefs mounts under `under` that this server does not serve (left by a
    /// crashed daemon): unmount, or detach and abort if busy. Returns their mountpoints.
    pub fn unmount_stale(&self, under: &Path) -> Result<Vec<PathBuf>, Error> {
        let mi = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(io_err("/proc/self/mountinfo"))?;
        let ours: Vec<PathBuf> = self
            .mounts
            .lock()
            .iter()
            .map(|m| m.mountpoint.clone())
            .collect();
        let mut stale: Vec<PathBuf> = nodefs_mountpoints(&mi)
            .into_iter()
            .filter(|mp| mp.starts_with(under) && !ours.iter().any(|o| same_path(o, mp)))
            .collect();
        // Deepest first.
        stale.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for mp in &stale {
            tracing::info!(mountpoint = %mp.display(), "removing a stale nodefs mount");
            detach(mp);
        }
        Ok(stale)
    }
}

fn same_path(a: &Path, b: &Path) -> bool {
    a == b || a.canonicalize().ok().as_deref() == Some(b)
}

impl Drop for NodeFs {
    fn drop(&mut self) {
        for m in std::mem::take(&mut *self.mounts.lock()) {
            let _ = m.unmount_inner();
        }
    }
}

impl Mount {
    /// Snapshot the current state as a manifest; writes are held off only while it runs.
    pub fn commit(&self) -> Result<ManifestId, Error> {
        let id = self.commit_unsealed()?;
        self.seal_commit(&id)?;
        Ok(id)
    }

    /// The part of a commit that must see the mount at one instant (a snapshot runs it with
    /// the sandbox frozen): the manifest of the mount as it is now, its new chunks appended to
    /// the store but not yet durable, pinned. [`Mount::seal_commit`] makes it durable and must
    /// come before the id is recorded anywhere; it may wait for the disk while the sandbox
    /// runs again (behind a large import's backlog that sync took 180-580 ms here).
    pub fn commit_unsealed(&self) -> Result<ManifestId, Error> {
        if self.session.lock().is_none() {
            return Err(Error::Unmounted(self.mountpoint.clone()));
        }
        self.flush_mapped_writes()?;
        let store = self.shared.store.clone();
        let _g = store.write_guard();
        let id = {
            let mut st = self.shared.state.lock();
            commit::commit(&mut st, &store)?
        };
        // Pinned before gc may run again: its chunks stay until it is sealed or replaced.
        store.pin(&id);
        if let Some(stale) = self.unsealed.lock().replace(id) {
            store.unpin(&stale);
        }
        Ok(id)
    }

    /// Makes the mount's pending commit `id` (from [`Mount::commit_unsealed`]) durable; later
    /// commits then build on it. Any other id is `UnknownManifest`.
    pub fn seal_commit(&self, id: &ManifestId) -> Result<(), Error> {
        if *self.unsealed.lock() != Some(*id) {
            return Err(Error::UnknownManifest(*id));
        }
        let store = &self.shared.store;
        let sealed = store.seal_manifest(id);
        let mut unsealed = self.unsealed.lock();
        if *unsealed != Some(*id) {
            // Replaced by a newer commit meanwhile, which unpinned this one.
            return Err(Error::UnknownManifest(*id));
        }
        *unsealed = None;
        if let Err(e) = sealed {
            store.unpin(id);
            return Err(e.into());
        }
        // Only now that its chunks are held by a sealed manifest may later commits build on
        // them.
        commit::start_from_commit(&mut self.shared.state.lock());
        if let Some(old) = self.last_commit.lock().replace(*id) {
            store.unpin(&old);
        }
        Ok(())
    }

    /// Have the kernel hand over the writes it still holds: those made through shared
    /// writable mappings sit in its page cache until written back (every other write reaches
    /// the server as it is made). Only a file open read-write can be mapped so, and such a
    /// file's pages are written back before its last RELEASE (`fuse_vma_close`; write-back
    /// holds the open), so each file the mount has open read-write is fsync'ed through a
    /// descriptor of the server's own, by file handle: the kernel answers that fsync only once
    /// the file's write-back requests are answered (`fuse_sync_writes`). syncfs would not do:
    /// it starts write-back but returns before the server has the data (FUSE's `sync_fs` waits
    /// only on virtiofs).
    fn flush_mapped_writes(&self) -> Result<(), Error> {
        use std::os::fd::AsFd;
        let files = self.shared.state.lock().open_rdwr_files();
        if files.is_empty() {
            return Ok(());
        }
        let dir = std::fs::File::open(&self.mountpoint).map_err(io_err(&self.mountpoint))?;
        let tid = nix::unistd::gettid().as_raw() as u32;
        self.shared.commit_flushers.lock().push(tid);
        let r = files.into_iter().try_for_each(|ino| {
            match crate::sys::open_fuse_inode(dir.as_fd(), ino) {
                Ok(fd) => std::fs::File::from(fd).sync_data(),
                // Closed (and so handed over) since the list was made.
                Err(e) if matches!(e.raw_os_error(), Some(libc::ESTALE | libc::ENOENT)) => Ok(()),
                Err(e) => Err(e),
            }
        });
        self.shared.commit_flushers.lock().retain(|t| *t != tid);
        r.map_err(io_err(&self.mountpoint))
    }

    pub fn base(&self) -> ManifestId {
        self.base
    }

    /// This server's id of the mount (unique for the server's lifetime).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// How the mount's requests reach the server, decided at mount.
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// Requests served over the io_uring queues (0 on the /dev/fuse transport).
    pub fn ring_requests(&self) -> u64 {
        self.ring.lock().as_ref().map_or(0, MountRing::requests)
    }

    /// Why the mount's ring stopped serving (its connection was then aborted), if it failed.
    pub fn ring_error(&self) -> Option<String> {
        self.ring.lock().as_ref().and_then(MountRing::error)
    }

    /// Test knob: make the kernel refuse the ring's next commit, as a broken queue would. The
    /// mount's connection is then aborted; the server and its other mounts go on.
    #[cfg(feature = "test-knobs")]
    pub fn break_ring(&self) {
        if let Some(r) = self.ring.lock().as_ref() {
            r.break_next_commit();
        }
    }

    /// The mount is already gone from the kernel: end the session without touching the
    /// mountpoint (it may hold something else now), drop pins and the upper dir.
    fn forget(&self) {
        let Some(bg) = self.session.lock().take() else {
            return;
        };
        // The queues release the mount's entries as the kernel completes them.
        if let Some(r) = self.ring.lock().take() {
            r.disarm();
        }
        std::thread::spawn(move || drop(bg.join()));
        self.release();
        let _ = std::fs::remove_dir_all(&self.upper_dir);
    }

    fn release(&self) {
        let store = &self.shared.store;
        store.unpin(&self.base);
        if let Some(c) = self.last_commit.lock().take() {
            store.unpin(&c);
        }
        if let Some(c) = self.unsealed.lock().take() {
            store.unpin(&c);
        }
    }

    pub fn usage(&self) -> Usage {
        let q = self.shared.state.lock().quota;
        Usage {
            bytes: q.used_bytes(),
            meta_bytes: q.used_meta,
            inodes: q.used_inodes,
        }
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmount (lazily and aborting the connection if busy), stop the session, remove the
    /// upper dir. Idempotent.
    pub fn unmount(&self) -> Result<(), Error> {
        let r = self.unmount_inner();
        if let Some(o) = self.owner.upgrade() {
            o.mounts.lock().retain(|m| m.id != self.id);
        }
        r
    }

    fn unmount_inner(&self) -> Result<(), Error> {
        let Some(bg) = self.session.lock().take() else {
            return Ok(());
        };
        let ring = self.ring.lock().take();
        if detach(&self.mountpoint) {
            if let Err(e) = bg.umount_and_join() {
                tracing::debug!(error = %e, "fuse session ended with an error");
            }
            if let Some(r) = &ring {
                r.disarm();
            }
            // The connection is gone: the kernel completes every queued command, and the
            // queues then unmap the mount's entries.
            if let Some(r) = ring {
                if !r.wait_released(RELEASE_WAIT) {
                    tracing::warn!(mountpoint = %self.mountpoint.display(),
                        "FUSE ring entries not released after unmount");
                }
            }
        } else {
            // Could not abort: the session ends when the last user lets go (and the queues
            // release the mount's entries then).
            tracing::warn!(mountpoint = %self.mountpoint.display(), "busy mount detached lazily");
            drop(ring);
            std::thread::spawn(move || drop(bg.join()));
        }
        self.release();
        match std::fs::remove_dir_all(&self.upper_dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(&self.upper_dir)(e)),
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = self.unmount_inner();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn nodefs_uring_switches_the_ring_off_only_when_it_says_so() {
        assert!(uring_from_env(None));
        assert!(uring_from_env(Some(OsStr::new("1"))));
        assert!(uring_from_env(Some(OsStr::new(""))));
        for off in ["0", "false", "OFF", "no"] {
            assert!(!uring_from_env(Some(OsStr::new(off))), "{off}");
        }
        assert!(ServerOptions::default().uring);
    }
}
