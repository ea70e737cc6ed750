//! Start-up after a previous run of this instance (a crash, a `kill -9`, an upgrade): adopt every
//! sandbox whose durable record says it was created, whose init still runs and whose root the
//! provider can re-attach; reclaim everything else it left, with zero residue. A recorded
//! sandbox that cannot be adopted is reported `failed` (a `LostRecord`) until destroyed.
//!
//! "Adopt" means this one thing across the crates: a restarted process takes over what its
//! predecessor left live (a sandbox, its init, `InitHandle::adopt`; the snapshotter a
//! predecessor's lazy-pages daemons). Registering a record of something that is not running is
//! `register_*` (`Runtime::register_parked`), taking files into a cache `take_*`.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::criu_leftovers::{self, Leftover};
use crate::init_handle::{HandleError, InitHandle};
use crate::mounts;
use crate::network::host_if;
use crate::proto::setup_owner;
use crate::record::{self, LostRecord, SandboxRecord};
use crate::registry::SlotState;
use crate::residue::{cgroup_of, dir_names, host_processes, sandbox_of_cgroup};
use crate::runtime::Runtime;
use crate::sandbox::Sandbox;
use crate::types::{EventKind, NetworkPolicy, SandboxId, SandboxState};

/// Why a recorded sandbox was not adopted by a restarted runtime (its reason as a lost sandbox).
#[derive(Debug, thiserror::Error)]
enum AdoptError {
    /// The recorded init is gone, or its pid now belongs to another process.
    #[error("{0}")]
    Init(#[from] HandleError),
    #[error("making {} private: {error}", .dir.display())]
    Private { dir: PathBuf, error: std::io::Error },
    #[error("its root filesystem did not survive the restart")]
    RootLost,
    #[error("its link {0} is gone")]
    LinkGone(String),
    /// `why`: the ping's error with its sources.
    #[error("init {pid} does not answer: {why}")]
    NoAnswer { pid: i32, why: String },
    #[error("its user namespace id range from {0} is not free in this instance's pool")]
    Ids(u32),
    /// A dump's CRIU had to be killed part-way: its processes may hold CRIU's code and state.
    #[error("a checkpoint of it was cut short while groved was down")]
    DumpCutShort,
    #[error("{0}, left by a checkpoint cut short")]
    CriuLeftover(Leftover),
}

impl Runtime {
    pub(crate) fn lost_dir(&self) -> PathBuf {
        self.config.run_dir.join("lost")
    }

    /// Runs once in `Runtime::new`, before any create.
    pub(crate) fn recover(&self) {
        let cut_short = self.stop_strays();
        for lost in record::load_lost(&self.lost_dir()) {
            if let Err(e) = self.registry.lose(lost) {
                tracing::warn!(error = %e, "a failed record listed twice");
            }
        }
        let sandboxes = self.config.run_dir.join("sandboxes");
        let mut leftovers: HashSet<String> = self.cgroups.existing().into_iter().collect();
        let mut leases = Vec::new();
        for name in dir_names(&sandboxes) {
            let dir = sandboxes.join(&name);
            let adopted = match (name.parse::<SandboxId>(), record::read(&dir)) {
                (Ok(id), Ok(rec)) if rec.id == id => match self.adopt(rec.clone(), dir, &cut_short)
                {
                    Ok(sb) => Some((sb, rec.state == SandboxState::Paused)),
                    Err(e) => {
                        let reason = e.to_string();
                        tracing::warn!(sandbox = %id, %reason, "not adopted: reclaimed, reported failed");
                        self.mark_lost(rec, reason);
                        None
                    }
                },
                // No record: a create or a destroy was in flight.
                _ => None,
            };
            match adopted {
                Some((sb, frozen)) => {
                    leftovers.remove(sb.id.as_str());
                    if let (Some(lease), NetworkPolicy::Egress { allow }) =
                        (&sb.net, &sb.spec.network)
                    {
                        leases.push((lease.clone(), allow.clone()));
                    }
                    self.admission.claim(&sb.limits);
                    self.jobs.charge_adopted(&sb.spec, &sb.limits);
                    tracing::info!(sandbox = %sb.id, pid = sb.init.pid(), "adopted");
                    let id = sb.id.clone();
                    let slotted = self.registry.with(|slots| {
                        slots.adopt(&id, sb.clone())?;
                        if frozen {
                            slots.freeze(&id, &sb)?;
                        }
                        Ok::<(), crate::registry::TransitionError>(())
                    });
                    if let Err(e) = slotted {
                        tracing::error!(sandbox = %id, error = %e, "adopted sandbox has no slot");
                    }
                }
                None => {
                    leftovers.insert(name);
                }
            }
        }
        for id in &leftovers {
            self.clean_leftover(id);
        }
        // Upper layers on disk outlive a reboot that emptied the run dir: keep only the adopted.
        let adopted: HashSet<String> = self
            .registry
            .ids_in(&[SlotState::Running, SlotState::Frozen])
            .iter()
            .map(|id| id.to_string())
            .collect();
        for (id, dir) in self.roots.upper_dirs() {
            if !adopted.contains(&id) {
                match std::fs::remove_dir_all(&dir) {
                    Ok(()) => {
                        tracing::info!(sandbox = %id, dir = %dir.display(), "removed a leftover upper layer")
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %id, dir = %dir.display(), error = %e, "removing a leftover upper layer")
                    }
                }
            }
        }
        if let Err(e) = self.net.restore(&leases) {
            // The adopted egress sandboxes have no rules now: their traffic is dropped by nothing
            // and allowed by nothing; report them so an operator sees it.
            tracing::error!(error = %e, "restore the nft rules of adopted sandboxes");
        }
    }

    /// Processes a killed predecessor left working for it — a CRIU dump or restore (CRIU working
    /// in our run dir), a sandbox setup (its argv names our instance) — would race the cleanup, so
    /// they go first. Processes inside a sandbox cgroup are never touched here. A `criu
    /// lazy-pages` daemon is not stopped: the branch it serves reads zeros wherever it has not
    /// delivered a page yet; the snapshotter adopts it (or stops it if its branch is gone).
    ///
    /// A dump is let finish rather than killed: CRIU writes its code into the processes it
    /// seizes and takes it out only when it cures them (`criu_leftovers`). It needs nothing more
    /// from groved once let go, and its images are discarded with the scratch dir. One still
    /// running after [`PREDECESSOR_DUMP_WAIT`] is killed; the sandboxes it was dumping are
    /// returned, to be reported failed rather than adopted.
    fn stop_strays(&self) -> HashSet<SandboxId> {
        let run_dir = format!("{}/", self.config.run_dir.display());
        let mut killed = Vec::new();
        let mut dumps = Vec::new();
        for (pid, cmd) in host_processes() {
            let args: Vec<&[u8]> = cmd.split(|&b| b == 0).collect();
            let criu_here = args.iter().any(|a| a.ends_with(b"/criu") || *a == b"criu")
                && args.iter().any(|a| a.starts_with(run_dir.as_bytes()));
            let lazy = args.iter().any(|a| *a == b"lazy-pages");
            if criu_here && lazy {
                // Its branch is pinged below and faults on every page not yet delivered: the copy
                // runs at full priority from here on (it ran niced behind the forks).
                let _ = grove_sys::sched::set_nice(pid, 0);
            }
            let our_criu = criu_here && !lazy;
            let our_setup = setup_owner(&cmd).is_some_and(|(i, _)| i == self.config.cgroup_root);
            if !our_criu && !our_setup {
                continue;
            }
            if sandbox_of_cgroup(&cgroup_of(pid), &self.config.cgroup_root).is_some() {
                continue;
            }
            if our_criu && args.iter().any(|a| *a == b"dump") {
                tracing::warn!(pid, "letting a predecessor's dump finish");
                dumps.push((pid, self.dumped_sandbox(&args)));
                continue;
            }
            tracing::warn!(pid, cmd = %String::from_utf8_lossy(&cmd).replace('\0', " "), "stopping a predecessor's helper");
            kill9(pid);
            killed.push(pid);
        }
        let mut cut_short = HashSet::new();
        let deadline = Instant::now() + PREDECESSOR_DUMP_WAIT;
        for (pid, sandbox) in dumps {
            if !wait_gone(pid, deadline) {
                tracing::error!(pid, sandbox = ?sandbox, "a predecessor's dump did not finish: killed; its sandbox is failed");
                kill9(pid);
                killed.push(pid);
                cut_short.extend(sandbox);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        for pid in killed {
            wait_gone(pid, deadline);
        }
        cut_short
    }

    /// The sandbox whose tree a dump's CRIU (its arguments) was dumping: `-t <its init>`.
    fn dumped_sandbox(&self, args: &[&[u8]]) -> Option<SandboxId> {
        let at = args.iter().position(|a| *a == b"-t")?;
        let pid: i32 = std::str::from_utf8(args.get(at + 1)?).ok()?.parse().ok()?;
        sandbox_of_cgroup(&cgroup_of(pid), &self.config.cgroup_root)
    }

    /// A sandbox from its record, if its init is the same process and answers, and its root is
    /// still served. The reason otherwise.
    /// `cut_short`: sandboxes a predecessor's dump was killed in (`stop_strays`).
    fn adopt(
        &self,
        rec: SandboxRecord,
        dir: PathBuf,
        cut_short: &HashSet<SandboxId>,
    ) -> Result<Arc<Sandbox>, AdoptError> {
        if cut_short.contains(&rec.id) {
            return Err(AdoptError::DumpCutShort);
        }
        // The recorded pid must still be the process that started then (not a reused pid).
        let init = InitHandle::adopt(rec.init_pid, rec.init_start)?;
        // Run dirs made before they were private (0755) let host users reach the root's setuid files.
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(|error| AdoptError::Private {
                dir: dir.clone(),
                error,
            })?;
        let root = self
            .roots
            .reattach(&rec.id, &rec.spec.image, &dir.join("root"))
            .ok_or(AdoptError::RootLost)?;
        if let Some(net) = &rec.net {
            if !self.net.link_exists(&net.host_if) {
                return Err(AdoptError::LinkGone(net.host_if.clone()));
            }
        }
        // A CRIU killed part-way through a dump of it (not by us: by the OOM killer, say), looked
        // for while the tree is still frozen: thawed, a process in CRIU's parasite dies of a trap.
        if let Some(left) = criu_leftovers::find_in(grove_sys::proc::tree(rec.init_pid)) {
            return Err(AdoptError::CriuLeftover(left));
        }
        if rec.state == SandboxState::Running {
            // Recorded running but frozen: a snapshot was interrupted between freeze and thaw.
            let _ = self.cgroups.thaw(rec.id.as_str());
            // Generous: a lazily restored branch may first fault in pages a predecessor's
            // lazy-pages daemon is still delivering.
            self.inits
                .ping(&init, Duration::from_secs(5))
                .map_err(|e| {
                    let mut why = e.to_string();
                    let mut cur = std::error::Error::source(&e);
                    while let Some(c) = cur {
                        why = format!("{why}: {c}");
                        cur = c.source();
                    }
                    AdoptError::NoAnswer {
                        pid: rec.init_pid,
                        why,
                    }
                })?;
        }
        if let Some(ids) = rec.ids {
            if !self.ids.claim(ids) {
                return Err(AdoptError::Ids(ids.base));
            }
        }
        Ok(Arc::new(Sandbox {
            id: rec.id,
            spec: rec.spec,
            limits: rec.limits,
            hostname: rec.hostname,
            created_at_ms: rec.created_at_ms,
            expires_at_ms: Mutex::new(rec.expires_at_ms),
            init: Arc::new(init),
            dir,
            root: Arc::from(root),
            net: rec.net,
            activity: crate::sandbox::Activity::new(crate::sandbox::now_ms()),
            ids: rec.ids,
        }))
    }

    fn mark_lost(&self, rec: SandboxRecord, reason: String) {
        let lost = LostRecord {
            info: crate::types::SandboxInfo {
                id: rec.id.clone(),
                state: SandboxState::Failed,
                spec: rec.spec,
                created_at_ms: rec.created_at_ms,
                expires_at_ms: rec.expires_at_ms,
                init_pid: None,
                hostname: rec.hostname,
                address: None,
            },
            reason,
        };
        if let Err(e) = record::write_lost(&self.lost_dir(), &lost) {
            tracing::warn!(sandbox = %rec.id, error = %e, "persist the failed record");
        }
        if let Err(e) = self.registry.lose(lost) {
            tracing::warn!(sandbox = %rec.id, error = %e, "a failed sandbox listed twice");
        }
    }

    /// Drops a lost sandbox's record; false when `id` was not lost.
    pub(crate) fn forget_lost(&self, id: &SandboxId, kind: EventKind) -> bool {
        let gone = self.registry.forget_lost(id).is_ok();
        if gone {
            if let Err(e) = record::discard_lost(&self.lost_dir(), id) {
                tracing::warn!(sandbox = %id, error = %e, "remove the failed record");
            }
            self.emit(id, kind, None);
        }
        gone
    }

    /// Lost sandboxes past their time-to-live are forgotten (event `expired`).
    pub(crate) fn expire_lost(&self, now: u64) -> Vec<SandboxId> {
        let due = self.registry.expired(&[SlotState::Lost], now);
        due.into_iter()
            .filter(|id| self.forget_lost(id, EventKind::Expired))
            .collect()
    }

    /// Removes whatever a previous run left of sandbox `id` (by name: its processes, mounts, link,
    /// cgroups, run dir). Its nft rules go when `Network::restore` rebuilds the table.
    fn clean_leftover(&self, id: &str) {
        // Inits still our children (the same process restarted its runtime) must be reaped.
        let ours = self.our_children_in(id);
        if let Err(e) = self.cgroups.kill_all(id) {
            tracing::warn!(sandbox = %id, error = %e, "kill leftover processes");
        }
        for pid in ours {
            let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        }
        let dir = self.config.run_dir.join("sandboxes").join(id);
        let mut under: Vec<PathBuf> = mounts::mount_points()
            .unwrap_or_default()
            .into_iter()
            .filter(|m| m.starts_with(&dir))
            .collect();
        under.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
        for m in under {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
        if let Ok(sid) = id.parse::<SandboxId>() {
            self.net.remove_link(&host_if(&sid));
        }
        if let Err(e) = self.cgroups.remove(id) {
            tracing::warn!(sandbox = %id, error = %e, "remove leftover cgroups");
        }
        let still_mounted = mounts::mount_points()
            .unwrap_or_default()
            .iter()
            .any(|m| m.starts_with(&dir));
        if dir.exists() && !still_mounted {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// How long a restarted groved lets a dump its predecessor let go run to its end. Dumps take
/// well under a second per GiB of memory here; one still running this long is stuck.
const PREDECESSOR_DUMP_WAIT: Duration = Duration::from_secs(30);

fn kill9(pid: i32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// Waits until `pid` is gone (reaped if it is our child) or `deadline`; whether it is gone.
fn wait_gone(pid: i32, deadline: Instant) -> bool {
    let p = nix::unistd::Pid::from_raw(pid);
    loop {
        let _ = nix::sys::wait::waitpid(p, Some(nix::sys::wait::WaitPidFlag::WNOHANG));
        if !record::running(pid) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
