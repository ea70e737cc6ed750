//! Forks and restores: a snapshot's images materialized once, then restored N times
//! concurrently, each branch into fresh namespaces over a fresh view of the snapshot's root.

use super::*;

impl Snapshotter {
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
        // ksmd, boosted for an earlier fork, leaves the cores to these restores (`ksm::Hold`).
        let hold = merge.then(|| self.merger.hold(criu::lazy_quiet()));
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
            let lazy = self.lazy.clone();
            self.merger.after_fork(Arc::new(move || lazy.any()));
        }
        drop(hold);
        Ok(results)
    }

    /// The materialized images of a snapshot: in scratch space already, or exported from the
    /// store (durable snapshots only: a pending one's images are in scratch space until stored).
    pub(crate) fn images_of(&self, info: &SnapshotInfo) -> Result<PathBuf, Error> {
        self.wait_whole(&info.id)?;
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

    /// Makes whole, in the background, the images of `id` that a crash left incremental.
    pub(crate) fn whole_again(&self, id: &str, images: PathBuf) {
        self.whole.begin(id);
        // After a restart: no sandbox's tracking names these images.
        self.whole.start(id, images, || {});
    }

    /// Waits until the images of an incremental snapshot are whole (`whole.rs`).
    pub(crate) fn wait_whole(&self, id: &str) -> Result<(), Error> {
        self.whole.wait(id).map_err(|why| Error::Unsupported {
            what: format!("snapshot {id}: its incremental images could not be made whole: {why}"),
        })
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

    /// Whether snapshots after a sandbox's first dump only the pages written since its last full
    /// dump (`SnapshotterConfig::track_dirty_pages`, where the kernel can).
    /// The kernel probe ran once, at start-up (`Snapshotter::new`).
    pub fn tracks_dirty_pages(&self) -> bool {
        self.track_dirty_pages && self.criu.features().uffd_wp
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
