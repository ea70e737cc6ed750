//! The `Runtime`: sandbox lifecycle, exec, files, admission, reclaim.
//!
//! This file holds the `Runtime` itself: its construction over the host parts, its events, and
//! the lookups every request starts with (one look at the registry each). Each job is a file of
//! its own:
//! - `create`: admission and the steps of a build, each undoable;
//! - `reclaim`: undoing those steps; destroy, expiry, failing a sandbox, shutdown;
//! - `exec`: commands, processes and signals through init;
//! - `files_api`: the files API, through init's verified root;
//! - `freeze`: pause/resume (a frozen cgroup) and the snapshotter's freeze/thaw;
//! - `checkpoint`: what the snapshotter sees of a sandbox and where a restore lands;
//! - `sessions`: named shell sessions.

mod checkpoint;
mod create;
mod exec;
mod files_api;
mod freeze;
mod reclaim;
pub mod sessions;

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::admission::{self, Admission};
use crate::cgroup::CgroupBackend;
use crate::config::RuntimeConfig;
use crate::error::Error;
use crate::host::{HostParts, InitControl, InitStore, SandboxNet, Spawner};
use crate::init_watch::InitWatch;
use crate::jobs::Jobs;
use crate::pool::Pools;
use crate::record;
use crate::registry::{Registry, Slot, SlotState, TransitionError};
use crate::root::RootProvider;
use crate::sandbox::{now_ms, Sandbox};
use crate::types::*;
use crate::validate;

pub use checkpoint::{CheckpointView, ExternalMount, RestoreFn, RestoreTarget};

pub struct Runtime {
    pub(crate) config: RuntimeConfig,
    pub(crate) roots: Arc<dyn RootProvider>,
    pub(crate) cgroups: Arc<dyn CgroupBackend>,
    pub(crate) net: Arc<dyn SandboxNet>,
    pub(crate) spawner: Arc<dyn Spawner>,
    pub(crate) inits: Arc<dyn InitControl>,
    pub(crate) init_store: Arc<dyn InitStore>,
    pub(crate) admission: Admission,
    /// Every id this runtime knows and its state (creating, running, frozen, failed, destroying,
    /// parking, parked, restoring, lost): see `registry`. Lost ones are durable as well
    /// (`record::write_lost`) so a second restart still reports them.
    pub(crate) registry: Registry<Arc<Sandbox>>,
    /// Warm pools; their idle sandboxes have no slot (residue counts them as owned). Lock order:
    /// registry → pools.
    pub(crate) pools: Pools,
    pub(crate) jobs: Jobs,
    subscribers: Mutex<Vec<Sender<Event>>>,
    /// This instance's claim on its cgroup root (`residue::lock_instance`).
    /// Released by `shutdown`: a runtime that has shut down owns nothing any more.
    instance_lock: Mutex<Option<nix::fcntl::Flock<std::fs::File>>>,
    /// The thread that notices inits dying (set once `new` has adopted what it could).
    init_watch: std::sync::OnceLock<InitWatch>,
    /// Host id ranges of sandboxes in user namespaces.
    pub(crate) ids: crate::userns::IdAllocator,
}

fn io_err(context: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { context, source }
}

impl Runtime {
    /// Sets up the host side (cgroup parents, run dir), adopts the live sandboxes of a previous
    /// run of this instance and reclaims everything else it left (see `recover`).
    pub fn new(config: RuntimeConfig, roots: Arc<dyn RootProvider>) -> Result<Arc<Runtime>, Error> {
        let parts = HostParts::detect(&config)?;
        Self::with_parts(config, roots, parts)
    }

    /// `new` on the host parts given (the real ones, or a test's fakes).
    pub(crate) fn with_parts(
        config: RuntimeConfig,
        roots: Arc<dyn RootProvider>,
        parts: HostParts,
    ) -> Result<Arc<Runtime>, Error> {
        let HostParts {
            cgroups,
            net,
            spawner,
            inits,
            init_store,
        } = parts;
        if !config.cgroup_root.starts_with("grove")
            || !config
                .cgroup_root
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(Error::invalid(
                "cgroup_root",
                "must start with \"grove\" and be [A-Za-z0-9_-]",
            ));
        }
        if !config.init_binary.is_absolute() || !config.init_binary.is_file() {
            return Err(Error::invalid(
                "init_binary",
                format!("{} is not a file", config.init_binary.display()),
            ));
        }
        // Sandbox pid 1s are reparented to us when the setup process exits: reap them ourselves.
        let _ = nix::sys::prctl::set_child_subreaper(true);
        cgroups.prepare().map_err(|e| Error::Cgroup {
            path: e.path.clone(),
            source: e.source,
        })?;
        let instance_lock = crate::residue::lock_instance(&config.cgroup_root)?;
        let sb_dir = config.run_dir.join("sandboxes");
        std::fs::create_dir_all(&sb_dir).map_err(io_err(format!("create {}", sb_dir.display())))?;
        // From here on sandboxes bind the runtime's own copy, whose path reveals nothing.
        let mut config = config;
        config.init_binary = init_store
            .install(&config.run_dir, &config.init_binary)
            .map_err(io_err(format!(
                "copy {} to the init tmpfs",
                config.init_binary.display()
            )))?;
        let id_pool = config.id_pool();
        id_pool
            .check()
            .map_err(|e| Error::invalid("userns_pool", e.to_string()))?;
        // Disk for sandbox writes: root providers keep upper layers under the state dir.
        let total = admission::detect(&config.capacity, &[&config.state_dir]);
        let rt = Arc::new(Runtime {
            config,
            roots,
            cgroups,
            net,
            spawner,
            inits,
            init_store,
            admission: Admission::new(total),
            registry: Registry::default(),
            pools: Pools::default(),
            jobs: Jobs::default(),
            subscribers: Mutex::new(Vec::new()),
            instance_lock: Mutex::new(instance_lock),
            init_watch: std::sync::OnceLock::new(),
            ids: crate::userns::IdAllocator::new(id_pool),
        });
        rt.admission.set_disk(
            Box::new(admission::RuntimeDisk {
                dir: rt.config.state_dir.clone(),
                rt: Arc::downgrade(&rt),
            }),
            rt.config.capacity.disk_mb.is_some(),
        );
        rt.recover();
        let watch = InitWatch::start(Arc::downgrade(&rt))
            .map_err(io_err("start the init watcher".into()))?;
        let _ = rt.init_watch.set(watch);
        Ok(rt)
    }

    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    pub(crate) fn emit(&self, sandbox: &SandboxId, kind: EventKind, reason: Option<String>) {
        // Every sandbox that joins the live ones says so: its init is watched from now on.
        if matches!(kind, EventKind::Created | EventKind::Resumed) {
            if let Some(w) = self.init_watch.get() {
                w.nudge();
            }
        }
        let ev = Event {
            at_ms: now_ms(),
            sandbox: sandbox.clone(),
            kind,
            reason,
        };
        self.subscribers
            .lock()
            .retain(|s| s.send(ev.clone()).is_ok());
    }

    /// Where `id` stands (see `registry`): how groved tells a frozen sandbox from one parked in
    /// the store or in transit between the two. None: unknown.
    pub fn state_of(&self, id: &SandboxId) -> Option<SlotState> {
        self.registry.state(id)
    }

    /// A live sandbox (running, frozen or failed) and its state, as of one look.
    pub(crate) fn live(&self, id: &SandboxId) -> Result<(Arc<Sandbox>, SlotState), Error> {
        self.registry.peek(id, |slot| match slot {
            Some(Slot::Running(sb)) => Ok((sb.clone(), SlotState::Running)),
            Some(Slot::Frozen(sb)) => Ok((sb.clone(), SlotState::Frozen)),
            Some(Slot::Failed(sb)) => Ok((sb.clone(), SlotState::Failed)),
            Some(Slot::Parking(_) | Slot::Parked(_) | Slot::Restoring(_)) => Err(Error::Conflict {
                id: id.clone(),
                reason: "sandbox is paused to the store (nothing runs): resume it first, \
                         or run a command in it, which resumes it"
                    .into(),
            }),
            Some(Slot::Lost(lost)) => Err(Error::Conflict {
                id: id.clone(),
                reason: format!("sandbox failed: {}", lost.reason),
            }),
            Some(Slot::Creating | Slot::Destroying) | None => {
                Err(Error::NotFound { id: id.to_string() })
            }
        })
    }

    pub(crate) fn sandbox(&self, id: &SandboxId) -> Result<Arc<Sandbox>, Error> {
        self.live(id).map(|(sb, _)| sb)
    }

    /// How a live state reads in a refusal ("Paused", "Failed"), as the API shows it.
    fn shown(state: SlotState) -> String {
        state
            .shown()
            .map(|s| format!("{s:?}"))
            .unwrap_or_else(|| state.to_string())
    }

    pub(crate) fn running(&self, id: &SandboxId) -> Result<Arc<Sandbox>, Error> {
        let (sb, st) = self.live(id)?;
        if st != SlotState::Running {
            return Err(Error::Conflict {
                id: id.clone(),
                reason: format!("sandbox is {}, not running", Self::shown(st)),
            });
        }
        Ok(sb)
    }

    /// A transition refused because a request found the sandbox elsewhere than it expected.
    fn refused(id: &SandboxId, e: TransitionError) -> Error {
        match e.state() {
            None | Some(SlotState::Creating | SlotState::Destroying) => {
                Error::NotFound { id: id.to_string() }
            }
            Some(_) => Error::Conflict {
                id: id.clone(),
                reason: e.to_string(),
            },
        }
    }

    /// Rewrites a live sandbox's durable record (its state or TTL changed). Under the registry's
    /// lock, so it never races destroy's removal of the record (a destroy leaves `Running` or
    /// `Frozen` before it removes the record).
    fn persist(&self, sb: &Arc<Sandbox>) -> Result<(), Error> {
        self.registry.with(|slots| {
            let state = match slots.get(&sb.id) {
                Some(Slot::Running(s)) if Arc::ptr_eq(s, sb) => SandboxState::Running,
                Some(Slot::Frozen(s)) if Arc::ptr_eq(s, sb) => SandboxState::Paused,
                _ => return Ok(()),
            };
            record::write(&sb.dir, &sb.record(state))
                .map_err(io_err(format!("write the record of {}", sb.id)))
        })
    }

    /// One look at the registry: a sandbox moving between states is shown in one of them.
    pub fn get(&self, id: &SandboxId) -> Result<SandboxInfo, Error> {
        self.registry
            .get(id)
            .ok_or_else(|| Error::NotFound { id: id.to_string() })
    }

    pub fn list(&self) -> Vec<SandboxInfo> {
        self.registry.list()
    }

    pub fn set_ttl(&self, id: &SandboxId, ttl_secs: Option<u64>) -> Result<SandboxInfo, Error> {
        validate::ttl("ttl_secs", ttl_secs)?;
        let sb = self.sandbox(id)?;
        *sb.expires_at_ms.lock() = validate::expires_at(now_ms(), ttl_secs);
        self.persist(&sb)?;
        self.get(id)
    }

    /// What a sandbox uses now; one paused to the store runs nothing and holds no memory (zeros).
    pub fn usage(&self, id: &SandboxId) -> Result<Usage, Error> {
        let state = self.registry.state(id);
        if state.is_some_and(|s| s.in_transit() || s == SlotState::Parked) {
            return Ok(Usage::default());
        }
        let sb = self.sandbox(id)?;
        let cg = self.cgroups.usage(id.as_str());
        let disk = sb.root.usage();
        let (rx, tx) = sb
            .net
            .as_ref()
            .map(|l| self.net.counters(l))
            .unwrap_or((0, 0));
        Ok(Usage {
            cpu_usec: cg.cpu_usec,
            memory_bytes: cg.memory_bytes,
            pids: cg.pids,
            disk_bytes: disk.bytes,
            disk_inodes: disk.inodes,
            net_rx_bytes: rx,
            net_tx_bytes: tx,
        })
    }

    pub fn capacity(&self) -> Capacity {
        self.admission.capacity()
    }

    pub fn subscribe(&self) -> Receiver<Event> {
        let (tx, rx) = channel();
        self.subscribers.lock().push(tx);
        rx
    }
}

/// groved shares one Runtime across threads.
const _: fn() = || {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Runtime>();
};
