//! Taking a sandbox down: `reclaim` undoes the parts of a failed create or a destroy, in reverse
//! order of making; destroy, expiry (TTL), failing a sandbox whose processes cannot go on, and
//! shutdown of the whole runtime.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Runtime;
use crate::error::Error;
use crate::record;
use crate::registry::SlotState;
use crate::root::RootMount;
use crate::sandbox::{now_ms, Parts, Sandbox};
use crate::types::*;

/// How long a shutdown waits for state changes under way (see `Runtime::wait_settled`): a
/// restore of a large snapshot or a pause to the store can take seconds.
const SHUTDOWN_SETTLE: Duration = Duration::from_secs(60);

impl Runtime {
    /// Removes everything in `parts`, in reverse order of making; every step is tried and verified.
    pub(crate) fn reclaim(&self, id: &SandboxId, parts: Parts) -> Result<(), Error> {
        let mut errors: Vec<String> = Vec::new();
        // A create that failed before learning its init's pid: find our children in the cgroup so
        // they are reaped below, not left as zombies.
        let orphans: Vec<i32> = match (parts.cgroups, parts.init_pid, &parts.init) {
            (true, None, None) => self.our_children_in(id.as_str()),
            _ => Vec::new(),
        };
        if parts.cgroups {
            if let Err(e) = self.cgroups.kill_all(id.as_str()) {
                errors.push(format!("kill: {e}"));
            }
        }
        for pid in orphans {
            let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        }
        if let Some(init) = &parts.init {
            if !parts.cgroups {
                init.kill();
            }
            // Reaps our child; an adopted init that is not ours is someone else's to reap.
            init.reap();
        } else if let Some(pid) = parts.init_pid {
            if !parts.cgroups {
                // This sandbox's init, our child (unreaped, so the pid is still its).
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            // Reap our (adopted) child; ECHILD when it was never ours.
            let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        }
        if let Some(lease) = &parts.net {
            if let Err(e) = self.net.teardown(lease) {
                errors.push(format!("network: {e}"));
            }
        }
        if parts.cgroups {
            if let Err(e) = self.cgroups.remove(id.as_str()) {
                errors.push(format!("cgroups: {e}"));
            }
        }
        if let Some(root) = &parts.root {
            if let Err(e) = root.unmount() {
                errors.push(format!("root: {e}"));
            }
        }
        if let Some(dir) = &parts.dir {
            if let Err(e) = crate::mounts::remove_dir_unless_mounted(dir) {
                errors.push(e.to_string());
            }
        }
        // Freed only once nothing of the sandbox holds host ids of the range any more.
        if let Some(ids) = parts.ids {
            if errors.is_empty() {
                self.ids.free(ids);
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(Error::Cleanup {
                id: id.clone(),
                reason: errors.join("; "),
            })
        }
    }

    /// Host pids in the sandbox's cgroup whose parent is this process.
    pub(crate) fn our_children_in(&self, id: &str) -> Vec<i32> {
        let me = std::process::id().to_string();
        let Some(procs) = self.cgroups.procs_files(id).into_iter().next() else {
            return Vec::new();
        };
        let text = std::fs::read_to_string(procs).unwrap_or_default();
        text.lines()
            .filter_map(|l| l.trim().parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                    s.rfind(')').and_then(|i| s[i + 2..].split(' ').nth(1)) == Some(me.as_str())
                })
            })
            .collect()
    }

    /// Kill every process (cgroup.kill), tear down network, cgroups and root, remove the run dir.
    /// A sandbox paused by `park` holds nothing on the host: destroy just forgets its id.
    pub fn destroy(&self, id: &SandboxId) -> Result<(), Error> {
        if self.forget_parked(id, EventKind::Destroyed)
            || self.forget_lost(id, EventKind::Destroyed)
        {
            return Ok(());
        }
        self.destroy_with(id, EventKind::Destroyed).map(|_| ())
    }

    /// Destroys a live sandbox as its time-to-live running out does (an `expired` event): for a
    /// caller that had a deadline of its own act first and fail (E2B's autoPause).
    pub fn expire(&self, id: &SandboxId) -> Result<(), Error> {
        self.destroy_with(id, EventKind::Expired).map(|_| ())
    }

    /// Reclaims a live sandbox (`Destroying`, then gone), or parks it when `kind` is `Paused`
    /// (`Parking`, then `Parked`: the id never leaves the registry, so no create can take it).
    /// A reclaim that fails forgets the id with a `failed` event.
    pub(crate) fn destroy_with(
        &self,
        id: &SandboxId,
        kind: EventKind,
    ) -> Result<Arc<Sandbox>, Error> {
        let parking = kind == EventKind::Paused;
        let taken = if parking {
            self.registry.park(id)
        } else {
            self.registry.destroy(id)
        };
        let sb = taken.map_err(|e| match e.state() {
            Some(SlotState::Failed) => Self::refused(id, e),
            _ => Error::NotFound { id: id.to_string() },
        })?;
        // Record gone first: a restart from here on finishes the destroy.
        if let Err(e) = record::discard(&sb.dir) {
            tracing::warn!(sandbox = %id, error = %e, "remove the durable record");
        }
        let parts = Parts::of(&sb);
        let res = self.reclaim(id, parts);
        self.release(&sb.spec, &sb.limits);
        let landed = match res {
            Ok(()) if parking => self.registry.parked(id).map(drop),
            _ => self.registry.finish(id),
        };
        if let Err(t) = landed {
            tracing::error!(sandbox = %id, error = %t, "slot of a destroy");
        }
        match &res {
            Ok(()) => self.emit(id, kind, None),
            Err(e) => self.emit(id, EventKind::Failed, Some(e.to_string())),
        }
        res.map(|()| sb)
    }

    /// Destroys sandboxes past their TTL and sweeps cgroup dirs no sandbox owns
    /// (`sweep_cgroups`); groved calls it on a timer.
    pub fn reap_expired(&self) -> Vec<SandboxId> {
        let now = now_ms();
        let live = [SlotState::Running, SlotState::Frozen, SlotState::Failed];
        let expired = self.registry.expired(&live, now);
        let reaped = expired
            .into_iter()
            .filter(|id| self.destroy_with(id, EventKind::Expired).is_ok())
            .chain(self.expire_parked(now))
            .chain(self.expire_lost(now))
            .collect();
        self.fail_lost_roots();
        self.sweep_cgroups();
        reaped
    }

    /// Marks `failed` the running or paused sandboxes whose root was lost with what served it
    /// (grove-fsd died): exec and files cannot work any more, and a client should hear so
    /// rather than find out from ENOTCONN. They stay listed until destroyed.
    fn fail_lost_roots(&self) {
        let live: Vec<(SandboxId, Arc<dyn RootMount>)> = self
            .registry
            .live()
            .into_iter()
            .map(|(s, _)| (s.id.clone(), s.root.clone()))
            .collect();
        if live.is_empty() {
            return;
        }
        for id in self.roots.lost(&live) {
            // Still live (a destroy moves it to `Destroying` before unmounting it).
            let Ok(sb) = self.sandbox(&id) else {
                continue;
            };
            self.mark_failed(
                &sb,
                "the server of its root filesystem (grove-fsd) exited: its files are gone".into(),
            );
        }
    }

    /// Marks a running or paused sandbox `failed` with `reason` (in a `failed` event) and kills
    /// its processes: what they run on is wrong (a lazy restore lost the rest of its memory).
    /// It stays listed until destroyed; a restart finds its init gone and reports it failed.
    pub fn fail(&self, id: &SandboxId, reason: &str) -> Result<(), Error> {
        let sb = self.sandbox(id)?;
        if self.mark_failed(&sb, reason.into()) {
            if let Err(e) = self.cgroups.kill_all(id.as_str()) {
                tracing::warn!(sandbox = %id, error = %e, "kill the processes of a failed sandbox");
            }
        }
        Ok(())
    }

    /// The one way into `failed` (the `Fail` transition): from running or frozen, for this very
    /// sandbox (not one restored under its id since), with a reason in the log and a `failed`
    /// event. Says whether it happened.
    pub(crate) fn mark_failed(&self, sb: &Arc<Sandbox>, reason: String) -> bool {
        if self.registry.fail(&sb.id, sb).is_err() {
            return false;
        }
        tracing::error!(sandbox = %sb.id, %reason, "marked failed");
        self.emit(&sb.id, EventKind::Failed, Some(reason));
        true
    }

    /// Destroys every sandbox, then removes the (empty) parent cgroup dirs and run dir, and gives
    /// up this instance's names (another runtime may take them from then on).
    pub fn shutdown(&self) {
        self.drain_pools();
        let deadline = Instant::now() + SHUTDOWN_SETTLE;
        let live = [SlotState::Running, SlotState::Frozen, SlotState::Failed];
        // Twice: a create that was under way ends running, and is destroyed in the second round.
        for _ in 0..2 {
            self.wait_settled(deadline);
            for id in self.registry.ids_in(&live) {
                if let Err(e) = self.destroy(&id) {
                    tracing::error!(sandbox = %id, error = %e, "destroy at shutdown failed");
                }
            }
        }
        for id in self.registry.ids_in(&[SlotState::Parked]) {
            self.forget_parked(&id, EventKind::Destroyed);
        }
        for id in self.registry.ids_in(&[SlotState::Lost]) {
            self.forget_lost(&id, EventKind::Destroyed);
        }
        let _ = std::fs::remove_dir(self.lost_dir());
        if self.registry.with(|slots| slots.on_host().next().is_none()) {
            self.cgroups.unprepare();
            self.init_store.remove(&self.config.run_dir);
            let _ = std::fs::remove_dir(self.config.run_dir.join("sandboxes"));
            let _ = std::fs::remove_dir(&self.config.run_dir);
        }
        self.instance_lock.lock().take();
    }

    /// Waits until no create, destroy, pause or restore is under way, or `deadline`. Work that a
    /// request or the reaper began on a blocking thread goes on after its caller was cancelled;
    /// a shutdown that did not wait would find its slot, skip it, and keep the instance's parts
    /// (cgroup parents, grove-init's tmpfs, the run dir) for a sandbox gone a moment later.
    fn wait_settled(&self, deadline: Instant) {
        let transient = [
            SlotState::Creating,
            SlotState::Destroying,
            SlotState::Parking,
            SlotState::Restoring,
        ];
        loop {
            let busy = self.registry.ids_in(&transient);
            if busy.is_empty() {
                return;
            }
            if Instant::now() >= deadline {
                tracing::error!(sandboxes = ?busy, "still changing state at shutdown; left as they are");
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
