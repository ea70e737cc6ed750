//! Taking a snapshot: freeze, CRIU dump (leaving the tree running), commit of the root, thaw,
//! the commit made durable, and the record that makes it forkable.

use grove_runtime::criu_leftovers;

use super::tracking;
use super::*;

impl Snapshotter {
    /// Snapshots a running sandbox: freeze → CRIU dump (leave running) → nodefs commit → thaw
    /// → commit synced → durable record → returned, forkable from the dumped images; they go
    /// into the store in the background (`durable.rs`) unless `opts.durable` asks to wait. Any
    /// failure before the record thaws and leaves the source as it was; no scratch is left
    /// behind.
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
            memory_dump: cap.memory_dump,
            full_dump_reason: cap.full_dump_reason.clone(),
        };
        // The dumped images become the materialized copy forks restore from, and the source
        // of the background import.
        let images = self.cache.take(&info.id, &cap.images_dir)?;
        // Forks and the import wait for an incremental dump to be made whole; it happens
        // after this call returns, while the sandbox runs.
        let incremental = tracking::has_parent(&images);
        if incremental {
            self.whole.begin(&info.id);
        }
        if let Err(e) = self.commit_pending(&info, &cap.fs_root) {
            self.whole.forget(&info.id);
            self.cache.drop_snapshot(&info.id);
            return Err(e);
        }
        // The next dump is incremental against these images, once whole.
        if self.tracks_dirty_pages() {
            let dir = self.work_root.join(format!("base-{sandbox}"));
            self.tracking
                .based_on(sandbox, &info.id, &images, !incremental, dir);
        }
        if incremental {
            let (tracking, source, id) = (self.tracking.clone(), sandbox.clone(), info.id.clone());
            self.whole.start(&info.id, images.clone(), move || {
                tracking.whole_now(&source, &id)
            });
        }
        drop(cap);
        self.queue_import(&info.id);
        tracing::info!(
            snapshot = %info.id, %sandbox, frozen_ms = info.dump_ms,
            memory_dump = info.memory_dump.as_str(), full_dump_reason = info.full_dump_reason.as_deref(),
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
        // Userfaultfd write-protect tracking (where the kernel lacks soft-dirty): processes not
        // yet registered are registered now, while the sandbox runs; the dump is incremental
        // against the base, if there is one.
        let uffd = self.tracks_dirty_pages();
        let whole = |id: &str| self.whole.wait(id);
        let mut tracked = uffd.then(|| {
            self.tracking
                .prepare(sandbox, view.init_pid, !was_frozen, &whole)
        });
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
            // Decided once frozen, below.
            skip_network_lock: false,
            track_mem: uffd,
            prev_images_dir: tracked.as_ref().and_then(|t| t.base.clone()),
            uffd_wp: uffd,
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
        let mut base = base;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let _ = std::fs::remove_dir_all(&images_dir);
            std::fs::create_dir_all(&images_dir).map_err(|e| Error::io(&images_dir, e))?;
            let opts_with = |freeze_cgroup| criu::DumpOptions {
                freeze_cgroup,
                skip_network_lock: view.veth_host.is_none() && self.tcp_quiet(sandbox, &view),
                ..plan::dump(base.clone(), pre.as_ref())
            };
            // CRIU starts while the sandbox runs, with the freezer and network lock as they
            // would be now; once frozen, options that differ drop it for one started then (see
            // `criu::EarlyDump`).
            let early = self.start_dump_early(sandbox, &opts_with(cgroups::freezer(&view.cgroups)));
            let t0 = Instant::now();
            if !was_frozen {
                self.runtime.freeze(sandbox)?;
            }
            let opts = opts_with(cgroups::frozen(&view.cgroups));
            let early = early.filter(|e| {
                let same = e.options() == &opts;
                if !same {
                    tracing::debug!(%sandbox, "the dump's options changed once frozen; CRIU starts again");
                }
                same
            });
            let frozen = self.dump_and_commit(sandbox, &opts, early, mount, pre.as_ref());
            let thaw = |ok: bool| {
                if was_frozen || (ok && keep_frozen) {
                    Ok(())
                } else {
                    self.runtime.thaw(sandbox)
                }
            };
            let dump_ms = t0.elapsed().as_millis() as u64;
            let broken = match &frozen {
                Err(e) => broken_by(e, view.init_pid),
                Ok(_) => None,
            };
            if let (Err(e), Some(why)) = (&frozen, &broken) {
                let _ = thaw(false);
                self.fail_broken(sandbox, why, e);
            }
            match frozen {
                Err(e) if broken.is_some() => return Err(e),
                Ok(fs_root) => {
                    thaw(true)?;
                    // Durable only now, with the sandbox running again: the sync may wait
                    // behind other writes to the store (an earlier snapshot's images).
                    mount.seal(&fs_root.0).map_err(Error::Commit)?;
                    // What a lazily restored branch touches first, and what `ps` in it reads
                    // of its other processes, restored without a fault each (`eager.rs`).
                    if let Err(e) = crate::eager::mark(&images_dir) {
                        tracing::warn!(%sandbox, error = %e, "marking small areas and argument pages eager");
                    }
                    let memory_dump = if pre.is_some() {
                        MemoryDump::SoftDirty
                    } else if let Some(base) = &opts.prev_images_dir {
                        // The unwritten pages are the base's: the images carry links to it
                        // until they are made whole (`Snapshotter::make_whole_later`).
                        tracking::nest_base(&images_dir, base)
                            .map_err(|e| Error::io(&images_dir, e))?;
                        MemoryDump::UffdWp
                    } else {
                        MemoryDump::Full
                    };
                    let full_dump_reason = match memory_dump {
                        MemoryDump::Full if uffd => tracked.and_then(|t| t.why_full),
                        _ => None,
                    };
                    return Ok(Capture {
                        sandbox: sandbox.clone(),
                        spec: view.spec.clone(),
                        fs_root,
                        images_dir,
                        dump_ms,
                        memory_dump,
                        full_dump_reason,
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
                Err(e) if base.prev_images_dir.is_some() && attempt < DUMP_ATTEMPTS => {
                    // An incremental dump failed: try once more in full rather than fail the
                    // snapshot on tracking trouble (a full dump needs no base).
                    thaw(false)?;
                    tracing::warn!(%sandbox, error = %e, "incremental dump failed; dumping in full");
                    let why = format!("the incremental dump failed: {}", chain(&e));
                    self.tracking.doubt(sandbox, &why);
                    base.prev_images_dir = None;
                    if let Some(t) = tracked.as_mut() {
                        t.base = None;
                        t.why_full = Some(why);
                    }
                }
                Err(e) => {
                    thaw(false)?;
                    return Err(self.conflict_or(sandbox, e));
                }
            }
        }
    }

    /// The frozen part: dump the tree (leaving it running) and commit its root (made durable
    /// after the thaw, see `capture`). The commit runs beside CRIU, on a thread of its own:
    /// nothing changes the root while the sandbox is frozen, CRIU only reads it, and grove-fsd
    /// commits on the other core (≈ 1-2 ms of the frozen window here). A commit whose dump
    /// failed is never sealed; the mount's next commit replaces it.
    fn dump_and_commit(
        &self,
        sandbox: &SandboxId,
        opts: &criu::DumpOptions,
        early: Option<criu::EarlyDump>,
        mount: &dyn CommitRoot,
        pre: Option<&criu::PreDumpOptions>,
    ) -> Result<ManifestId, Error> {
        std::thread::scope(|s| {
            let commit = s.spawn(|| mount.commit_unsealed());
            let dumped = self.dump_frozen(sandbox, opts, early, pre);
            let committed = commit
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            dumped?;
            Ok(nodefs::ObjectId(committed.map_err(Error::Commit)?))
        })
    }

    /// Marks a sandbox a failed dump left broken (`broken_by`) failed: its processes killed, an
    /// event saying `why`; never left running.
    fn fail_broken(&self, sandbox: &SandboxId, why: &str, dump: &Error) {
        tracing::error!(%sandbox, reason = why, dump_error = %chain(dump), "marking the sandbox failed");
        if let Err(e) = self.runtime.fail(sandbox, why) {
            tracing::error!(%sandbox, error = %e, "mark a sandbox a failed dump left broken failed");
        }
    }

    /// CRIU's dump and what follows it while still frozen.
    fn dump_frozen(
        &self,
        sandbox: &SandboxId,
        opts: &criu::DumpOptions,
        early: Option<criu::EarlyDump>,
        pre: Option<&criu::PreDumpOptions>,
    ) -> Result<(), Error> {
        match early {
            Some(started) => started.go()?,
            None => self.criu.dump(opts)?,
        };
        if opts.uffd_wp {
            // Still frozen: from here on, a page written reads as written again, so the next
            // dump holds what was written after this one.
            let t0 = Instant::now();
            let written = self.tracking.arm(sandbox);
            tracing::debug!(%sandbox, written, arm_us = t0.elapsed().as_micros() as u64, "pages write-protected");
        }
        if !opts.cgroup_controllers.is_empty() {
            cgroups::write_dumped_list(&opts.images_dir, &opts.cgroup_controllers)
                .map_err(|e| Error::io(&opts.images_dir, e))?;
        }
        if let Some(p) = pre {
            plan::nest_parent(&opts.images_dir, &p.images_dir)
                .map_err(|e| Error::io(&opts.images_dir, e))?;
        }
        Ok(())
    }

    /// The dump's CRIU, started before the freeze; None where it cannot be (no shim to hold
    /// it, or its start failed: then it starts once frozen, as before).
    fn start_dump_early(
        &self,
        sandbox: &SandboxId,
        opts: &criu::DumpOptions,
    ) -> Option<criu::EarlyDump> {
        match self.criu.start_dump_early(opts)? {
            Ok(started) => Some(started),
            Err(e) => {
                tracing::warn!(%sandbox, error = %e, "starting the dump's criu early; starting it frozen");
                None
            }
        }
    }

    /// Whether the frozen sandbox's loopback-only network has no TCP connection that a kernel
    /// timer could move while CRIU dumps it (see `DumpOptions::skip_network_lock`). If it
    /// cannot tell, the dump takes the lock.
    fn tcp_quiet(&self, sandbox: &SandboxId, view: &grove_runtime::CheckpointView) -> bool {
        netns::tcp_quiet(view.init_pid).unwrap_or_else(|e| {
            tracing::debug!(%sandbox, error = %e, "sock_diag of the sandbox's network; dumping with the network lock");
            false
        })
    }

    /// The sandbox is gone: its tracking (uffds, base images) goes with it.
    pub(crate) fn forget_tracking(&self, sandbox: &SandboxId) {
        self.tracking.forget(sandbox);
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

/// An error and its sources, one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut at = e.source();
    while let Some(c) = at {
        s.push_str(": ");
        s.push_str(&c.to_string());
        at = c.source();
    }
    s
}

/// Why a failed dump left the tree under `init_pid` broken, if it did. A CRIU that exits with an
/// error has cured every process it seized; one killed part-way (by the OOM killer, a crash)
/// has not: a process may hold its code (the next snapshots would carry it, and where it sits
/// in the vDSO they do not restore) or run on into its parasite and die of a trap once thawed
/// (`grove_runtime::criu_leftovers`). Which processes it had reached is not known, so the whole
/// sandbox counts as broken; CRIU's code found after any other failure is proof as well.
fn broken_by(dump: &Error, init_pid: i32) -> Option<String> {
    let left = criu_leftovers::find_in(grove_sys::proc::tree(init_pid));
    let killed = match dump {
        Error::Criu(criu::Error::DumpKilled { signal, .. }) => Some(*signal),
        _ => None,
    };
    match (killed, left) {
        (Some(signal), Some(left)) => Some(format!(
            "its checkpoint's CRIU was killed part-way (signal {signal}) and left {left}"
        )),
        (Some(signal), None) => Some(format!(
            "its checkpoint's CRIU was killed part-way (signal {signal}): its processes may hold \
             CRIU's code"
        )),
        (None, Some(left)) => Some(format!("a checkpoint that failed part-way left {left}")),
        (None, None) => None,
    }
}
