//! The `Runtime`: sandbox lifecycle, exec, files, admission, reclaim.

use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::admission::{self, Admission};
use crate::cgroup::CgroupBackend;
use crate::client::{self, ClientError, ExecCancel};
use crate::config::RuntimeConfig;
use crate::error::Error;
use crate::files::Root;
use crate::host::{HostParts, InitControl, InitStore, SandboxNet, Spawner};
use crate::init_handle::{HandleError, InitHandle};
use crate::init_watch::InitWatch;
use crate::jobs::Jobs;
use crate::pool::Pools;
use crate::proto::{self, ExecSpec, InitErrorKind, SetupConfig};
use crate::record;
use crate::registry::{Registry, Slot, SlotState, TransitionError};
use crate::root::{DiskQuota, RootMount, RootProvider};
use crate::sandbox::{now_ms, Parts, Sandbox};
use crate::spawner::SpawnError;
use crate::types::*;
use crate::validate;

pub mod sessions;

/// A host path bind-mounted into the sandbox, which CRIU must be told about
/// (dump `--external mnt[<sandbox_path>]:<key>`, restore `--external mnt[<key>]:<host_path>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExternalMount {
    pub key: String,
    pub sandbox_path: String,
    pub host_path: PathBuf,
}

/// What the snapshotter needs to dump a sandbox.
#[derive(Clone)]
pub struct CheckpointView {
    pub id: SandboxId,
    pub init_pid: i32,
    pub spec: SandboxSpec,
    pub root_dir: PathBuf,
    /// (controller or "unified", cgroup path relative to the hierarchy root).
    pub cgroups: Vec<(String, PathBuf)>,
    pub externals: Vec<ExternalMount>,
    pub root: Arc<dyn RootMount>,
    /// Host end of the sandbox's veth (egress only): dump with `--external veth[eth0]:<it>`.
    pub veth_host: Option<String>,
}

impl std::fmt::Debug for CheckpointView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointView")
            .field("id", &self.id)
            .field("init_pid", &self.init_pid)
            .field("root_dir", &self.root_dir)
            .field("cgroups", &self.cgroups)
            .field("externals", &self.externals)
            .finish_non_exhaustive()
    }
}

/// Where a restored process tree must land.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RestoreTarget {
    pub id: SandboxId,
    pub root_dir: PathBuf,
    pub cgroups: Vec<(String, PathBuf)>,
    pub externals: Vec<ExternalMount>,
    pub hostname: String,
    /// Egress only: the host-end name the restored veth must get (`--external veth[eth0]:<it>`);
    /// the runtime then re-addresses both ends. Without a restored veth a fresh one is made.
    pub veth_host: Option<String>,
    /// A user-namespace sandbox's own host id range: the restored user namespace must map onto
    /// it, not onto the range of the sandbox that was dumped.
    pub ids: Option<crate::userns::IdRange>,
}

/// Callback that restores a process tree into a `RestoreTarget` and returns the host pid of its init.
pub type RestoreFn<'a> =
    dyn FnMut(&RestoreTarget) -> Result<i32, Box<dyn std::error::Error + Send + Sync>> + 'a;

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

/// What an init refusal means for the request, by its kind alone; None for a failure of init's own
/// (judged by the sandbox's state: destroyed, init gone, or an init error).
fn init_refusal(id: &SandboxId, kind: InitErrorKind, message: &str) -> Option<Error> {
    match kind {
        // The root's file server is gone (a lost grove-fsd not yet noticed): not the request's fault.
        InitErrorKind::RootGone => Some(Error::Unavailable {
            what: format!("the root filesystem of {id}"),
            reason: message.to_string(),
        }),
        k => k.spec_field().map(|field| Error::InvalidSpec {
            field: field.into(),
            reason: message.to_string(),
        }),
    }
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
            .map_err(|reason| Error::invalid("userns_pool", reason))?;
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

    /// A new sandbox: handed over from a warm pool when one holds its image and size, else built.
    pub fn create(&self, spec: SandboxSpec) -> Result<SandboxInfo, Error> {
        let _foreground = self.pools.foreground();
        // Before a pooled hand-over too, which would otherwise fail late and build cold.
        validate::spec(&spec)?;
        self.check_ports(&spec)?;
        if let Some(info) = self.claim_pooled(&spec)? {
            return Ok(info);
        }
        self.create_inner(spec, None, None)
    }

    /// Create a sandbox whose process tree is brought by `restore` (CRIU) instead of a fresh init: the
    /// runtime does admission, mounts the root from `spec.image`, makes the cgroups, calls `restore`
    /// (which returns the host pid of the restored init), then adopts it. Any failure undoes every step.
    pub fn create_restored(
        &self,
        spec: SandboxSpec,
        restore: &mut RestoreFn<'_>,
    ) -> Result<SandboxInfo, Error> {
        self.create_inner(spec, Some(restore), None)
    }

    /// `same_id`: re-create under this id (see `create_restored_as`) instead of a fresh one.
    pub(crate) fn create_inner(
        &self,
        spec: SandboxSpec,
        restore: Option<&mut RestoreFn<'_>>,
        same_id: Option<SandboxId>,
    ) -> Result<SandboxInfo, Error> {
        validate::spec(&spec)?;
        self.check_ports(&spec)?;
        if spec.userns && !self.roots.shifts_ids() {
            return Err(Error::invalid(
                "userns",
                "this node's root provider cannot show image owners through a user namespace \
                 (root_provider = \"nodefs\" can)",
            ));
        }
        let limits = spec.limits.unwrap_or(self.config.defaults);
        validate::limits(&limits)?;
        if !self.roots.image_exists(&spec.image) {
            return Err(Error::ImageNotFound {
                image: spec.image.clone(),
            });
        }
        self.admit(&spec, &limits)?;
        let (id, parked) = match same_id {
            None => (self.registry.reserve_fresh(), None),
            Some(id) => match self.registry.unpark(&id) {
                Ok(parked) => (id, Some(parked)),
                Err(e) => {
                    self.release(&spec, &limits);
                    return Err(Self::unpark_refused(&id, e));
                }
            },
        };
        let mut parts = Parts::default();
        let created_at = parked.as_ref().map(|p| p.created_at_ms);
        let res = self
            .build(&id, &spec, &limits, restore, created_at, &mut parts)
            .and_then(|sb| {
                let info = sb.info(SandboxState::Running);
                match parked {
                    Some(_) => self.registry.restored(&id, sb),
                    None => self.registry.create(&id, sb),
                }
                .map(|()| info)
                .map_err(|e| Self::refused(&id, e))
            });
        match res {
            Ok(info) => {
                let kind = if parked.is_some() {
                    EventKind::Resumed
                } else {
                    EventKind::Created
                };
                self.emit(&id, kind, None);
                Ok(info)
            }
            Err(e) => {
                if let Err(undo) = self.reclaim(&id, parts) {
                    tracing::error!(sandbox = %id, error = %undo, "undo of a failed create is incomplete");
                }
                self.release(&spec, &limits);
                // A restore that failed stays parked: the caller may retry it or destroy it.
                let back = match parked {
                    Some(_) => self.registry.restore_failed(&id),
                    None => self.registry.abandon(&id),
                };
                if let Err(t) = back {
                    tracing::error!(sandbox = %id, error = %t, "slot of a failed create");
                }
                self.emit(&id, EventKind::Failed, Some(e.to_string()));
                Err(e)
            }
        }
    }

    /// A restore under an id that is not parked: Conflict while it is live or moving, else
    /// NotFound (in particular when a destroy won the race against the resume).
    fn unpark_refused(id: &SandboxId, e: TransitionError) -> Error {
        match e.state() {
            None | Some(SlotState::Lost) => Error::NotFound { id: id.to_string() },
            Some(state) => Error::Conflict {
                id: id.clone(),
                reason: format!("sandbox exists ({state}); only a parked id can be restored as"),
            },
        }
    }

    /// Published host ports against the node's range and reserved ports, then whether the host
    /// has them free (a bind each, no command run): refused before anything is made.
    fn check_ports(&self, spec: &SandboxSpec) -> Result<(), Error> {
        validate::host_ports(
            &spec.ports,
            self.config.host_port_range,
            &self.config.reserved_ports,
        )?;
        self.net.check_ports(&spec.ports)
    }

    /// The steps of a create; each records what it made in `parts` so a failure can be undone.
    pub(crate) fn build(
        &self,
        id: &SandboxId,
        spec: &SandboxSpec,
        limits: &Limits,
        restore: Option<&mut RestoreFn<'_>>,
        created_at: Option<u64>,
        parts: &mut Parts,
    ) -> Result<Arc<Sandbox>, Error> {
        let dir = self.config.run_dir.join("sandboxes").join(id.as_str());
        // 0700: only root may walk into a sandbox's root from the host (the root providers mount
        // it nosuid,nodev as well).
        let mkdir = || {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new().mode(0o700).create(&dir)
        };
        let mut made = mkdir();
        if matches!(&made, Err(e) if e.kind() == std::io::ErrorKind::NotFound) {
            made = std::fs::create_dir_all(self.config.run_dir.join("sandboxes"))
                .and_then(|_| mkdir());
        }
        made.map_err(io_err(format!("create {}", dir.display())))?;
        parts.dir = Some(dir.clone());
        let ids = if spec.userns {
            let ids = self.ids.alloc().ok_or(Error::CapacityExceeded {
                resource: "user namespace id ranges".into(),
                requested: 1,
                available: 0,
            })?;
            parts.ids = Some(ids);
            // Sandbox root walks to its root during setup; other host users still cannot.
            std::os::unix::fs::chown(&dir, Some(ids.base), Some(ids.base))
                .map_err(io_err(format!("chown {}", dir.display())))?;
            Some(ids)
        } else {
            None
        };
        let root_dir = dir.join("root");
        std::fs::create_dir(&root_dir).map_err(io_err(format!("create {}", root_dir.display())))?;
        let quota = DiskQuota {
            bytes: Some(limits.disk_mb << 20),
            inodes: None,
        };
        let root: Arc<dyn RootMount> =
            Arc::from(
                self.roots
                    .mount_root(id, &spec.image, &root_dir, &quota, ids)?,
            );
        parts.root = Some(root.clone());
        self.cgroups
            .create(id.as_str(), limits)
            .map_err(|e| Error::Cgroup {
                path: e.path.clone(),
                source: e.source,
            })?;
        parts.cgroups = true;
        let hostname = spec.hostname.clone().unwrap_or_else(|| id.to_string());
        let mut restored = false;
        let init_err = |reason: String| Error::Init {
            id: id.clone(),
            reason,
        };
        let init_pid = match restore {
            None => {
                let cfg = SetupConfig {
                    root: root_dir.display().to_string(),
                    hostname: hostname.clone(),
                    cgroup_procs: self
                        .cgroups
                        .procs_files(id.as_str())
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect(),
                    init_binary: self.config.init_binary.display().to_string(),
                    tmp_size_mb: (limits.memory_mb / 2).max(8),
                    shm_size_mb: (limits.memory_mb / 4).max(4),
                    open_files: u64::from(limits.open_files),
                    new_netns: true,
                    extra_caps: spec.cap_add.iter().map(|c| c.number()).collect(),
                    userns: ids.is_some(),
                };
                self.spawner
                    .spawn_init(
                        &self.config.init_binary,
                        &cfg,
                        &self.config.cgroup_root,
                        id.as_str(),
                        ids,
                    )
                    .map_err(|e| {
                        if let SpawnError::Failed { pid: p, .. } = &e {
                            parts.init_pid = Some(*p);
                        }
                        Error::Init {
                            id: id.clone(),
                            reason: e.to_string(),
                        }
                    })?
            }
            Some(restore) => {
                restored = true;
                let target = RestoreTarget {
                    id: id.clone(),
                    root_dir: root_dir.clone(),
                    cgroups: self.cgroups.criu_paths(id.as_str()),
                    externals: self.externals(spec.userns),
                    hostname: hostname.clone(),
                    veth_host: matches!(spec.network, NetworkPolicy::Egress { .. })
                        .then(|| crate::network::host_if(id)),
                    ids,
                };
                let pid = restore(&target).map_err(|source| Error::Restore {
                    id: id.clone(),
                    source,
                })?;
                parts.init_pid = Some(pid);
                pid
            }
        };
        parts.init_pid = Some(init_pid);
        // Our child until we reap it, so its pid is still its own: held from here on.
        let init = Arc::new(
            InitHandle::open_child(init_pid).map_err(|e| init_err(format!("hold init: {e}")))?,
        );
        parts.init = Some(init.clone());
        if restored {
            self.inits
                .set_hostname(&init, &hostname)
                .map_err(|e| init_err(format!("set hostname: {e}")))?;
            self.inits
                .ping(&init, client::TIMEOUT)
                .map_err(|e| init_err(format!("restored init: {e}")))?;
        }
        let net = match &spec.network {
            NetworkPolicy::None => None,
            NetworkPolicy::Egress { allow } => {
                let lease = self
                    .net
                    .setup(id, init_pid, allow, &spec.ports)
                    .map_err(|e| e.into_error(id))?;
                parts.net = Some(lease.clone());
                Some(lease)
            }
        };
        let now = now_ms();
        let sb = Arc::new(Sandbox {
            id: id.clone(),
            spec: spec.clone(),
            limits: *limits,
            hostname,
            created_at_ms: created_at.unwrap_or(now),
            expires_at_ms: parking_lot::Mutex::new(validate::expires_at(now, spec.ttl_secs)),
            init,
            dir,
            root,
            net,
            activity: crate::sandbox::Activity::new(now),
            ids,
        });
        // The commit point of a create: from here a restart adopts the sandbox.
        record::write(&sb.dir, &sb.record(SandboxState::Running))
            .map_err(io_err(format!("write the record of {id}")))?;
        Ok(sb)
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

    /// One look at the registry: a sandbox moving between states is shown in one of them.
    pub fn get(&self, id: &SandboxId) -> Result<SandboxInfo, Error> {
        self.registry
            .get(id)
            .ok_or_else(|| Error::NotFound { id: id.to_string() })
    }

    pub fn list(&self) -> Vec<SandboxInfo> {
        self.registry.list()
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
        let parts = Parts {
            dir: Some(sb.dir.clone()),
            root: Some(sb.root.clone()),
            cgroups: true,
            init_pid: None,
            init: Some(sb.init.clone()),
            net: sb.net.clone(),
            ids: sb.ids,
        };
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

    pub fn set_ttl(&self, id: &SandboxId, ttl_secs: Option<u64>) -> Result<SandboxInfo, Error> {
        validate::ttl("ttl_secs", ttl_secs)?;
        let sb = self.sandbox(id)?;
        *sb.expires_at_ms.lock() = validate::expires_at(now_ms(), ttl_secs);
        self.persist(&sb)?;
        self.get(id)
    }

    pub fn exec(&self, id: &SandboxId, req: ExecRequest) -> Result<ExecResult, Error> {
        self.exec_stream(id, req, &mut |_| {})
    }

    pub fn exec_stream(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        on_output: &mut dyn FnMut(OutputChunk),
    ) -> Result<ExecResult, Error> {
        self.exec_stream_while(id, req, &mut |c| {
            on_output(c);
            true
        })
    }

    /// Like [`Runtime::exec_stream`]; when `on_output` returns false (nobody reads the output any more)
    /// the command is killed and this returns an error.
    pub fn exec_stream_while(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        on_output: &mut dyn FnMut(OutputChunk) -> bool,
    ) -> Result<ExecResult, Error> {
        self.exec_cancellable(id, req, &ExecCancel::default(), on_output)
    }

    /// Like [`Runtime::exec_stream_while`]; `cancel` ends the command from another thread (its
    /// caller went away). While it runs the sandbox counts as in use: idle reclaim leaves it be.
    pub fn exec_cancellable(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &ExecCancel,
        on_output: &mut dyn FnMut(OutputChunk) -> bool,
    ) -> Result<ExecResult, Error> {
        let sb = self.running(id)?;
        let _busy = sb.activity.busy();
        let argv = validate::exec_argv(&req)?;
        let mut env = sb.spec.env.clone();
        env.extend(req.env);
        let cwd = req
            .cwd
            .or_else(|| sb.spec.workdir.clone())
            .unwrap_or_else(|| "/".into());
        let max_keep = req
            .max_output_bytes
            .unwrap_or(crate::types::DEFAULT_MAX_OUTPUT) as usize;
        let spec = ExecSpec {
            argv,
            env,
            cwd,
            stdin: req.stdin,
            timeout_ms: req.timeout_ms,
            background: req.background,
            user: req.user,
        };
        client::exec(&sb.init, spec, max_keep, cancel, on_output)
            .map_err(|e| self.client_error(&sb, e))
    }

    pub(crate) fn client_error(&self, sb: &Arc<Sandbox>, e: ClientError) -> Error {
        let id = &sb.id;
        if let ClientError::Init { kind, message } = &e {
            if let Some(err) = init_refusal(id, *kind, message) {
                return err;
            }
        }
        match e {
            ClientError::Cancelled => Error::Cancelled { id: id.clone() },
            e if self.live(id).is_err() => Error::NotFound {
                id: format!("{id} (destroyed: {e})"),
            },
            ClientError::Connect(e) => self.unreachable(sb, e),
            // Init died during the request (the connection broke with it).
            _ if !sb.init.alive() => self.unreachable(sb, HandleError::Gone { pid: sb.init.pid() }),
            e => Error::Init {
                id: id.clone(),
                reason: e.to_string(),
            },
        }
    }

    pub fn processes(&self, id: &SandboxId) -> Result<Vec<ProcessInfo>, Error> {
        let sb = self.running(id)?;
        sb.activity.touch();
        let list = client::processes(&sb.init).map_err(|e| self.client_error(&sb, e))?;
        Ok(list
            .into_iter()
            .map(|p| ProcessInfo {
                pid: p.pid,
                argv: p.argv,
                running: p.running,
            })
            .collect())
    }

    pub fn signal(&self, id: &SandboxId, pid: i32, signal: i32) -> Result<(), Error> {
        if pid <= 1 {
            return Err(Error::invalid("pid", format!("{pid} cannot be signalled")));
        }
        if !(1..=64).contains(&signal) {
            return Err(Error::invalid(
                "signal",
                format!("{signal} is not a signal number"),
            ));
        }
        let sb = self.running(id)?;
        client::signal(&sb.init, pid, signal).map_err(|e| match e {
            // Whatever init refused (pid 1, a pid gone, kill's own failure), the pid is at fault.
            ClientError::Init { message, .. } => Error::invalid("pid", message),
            e => self.client_error(&sb, e),
        })
    }

    /// The root of a running or frozen sandbox, through its verified init handle only.
    fn root_of(&self, id: &SandboxId) -> Result<Root, Error> {
        let (sb, st) = self.live(id)?;
        if !matches!(st, SlotState::Running | SlotState::Frozen) {
            return Err(Error::Conflict {
                id: id.clone(),
                reason: format!(
                    "sandbox is {}: its files are not reachable",
                    Self::shown(st)
                ),
            });
        }
        sb.activity.touch();
        Root::open(&sb.init).map_err(|e| self.unreachable(&sb, e))
    }

    pub fn read_file(&self, id: &SandboxId, path: &str) -> Result<Vec<u8>, Error> {
        self.root_of(id)?.read(path)
    }

    /// A regular file of the sandbox opened for reading (anything else is refused), and its size:
    /// callers stream it rather than hold it.
    pub fn open_file(&self, id: &SandboxId, path: &str) -> Result<(std::fs::File, u64), Error> {
        self.root_of(id)?.open_read(path)
    }

    pub fn write_file(
        &self,
        id: &SandboxId,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
    ) -> Result<(), Error> {
        self.root_of(id)?.write(path, data, mode)
    }

    /// Streams `data` into a file of the sandbox; returns the bytes written.
    pub fn write_file_from(
        &self,
        id: &SandboxId,
        path: &str,
        data: &mut dyn std::io::Read,
        mode: Option<u32>,
    ) -> Result<u64, Error> {
        self.root_of(id)?.write_from(path, data, mode)
    }

    /// The sandbox's root for file operations beyond read/write/list (the E2B filesystem service).
    pub fn files(&self, id: &SandboxId) -> Result<crate::files::Root, Error> {
        self.root_of(id)
    }

    pub fn list_dir(&self, id: &SandboxId, path: &str) -> Result<Vec<DirEntry>, Error> {
        self.root_of(id)?.list(path)
    }

    pub fn upload_tar(
        &self,
        id: &SandboxId,
        dir: &str,
        tar: &mut dyn std::io::Read,
    ) -> Result<(), Error> {
        self.root_of(id)?.upload_tar(dir, tar)
    }

    pub fn download_tar(
        &self,
        id: &SandboxId,
        dir: &str,
        out: &mut dyn std::io::Write,
    ) -> Result<(), Error> {
        self.root_of(id)?.download_tar(dir, out)
    }

    /// Freezes the sandbox's cgroup: it keeps its memory. The snapshotter's pause (CRIU dump to
    /// the store, then `park`) is the one that frees it.
    pub fn pause(&self, id: &SandboxId) -> Result<SandboxInfo, Error> {
        let sb = self.running(id)?;
        self.freeze(id)?;
        self.registry
            .freeze(id, &sb)
            .map_err(|e| Self::refused(id, e))?;
        self.persist(&sb)?;
        self.emit(id, EventKind::Paused, None);
        Ok(sb.info(SandboxState::Paused))
    }

    pub fn resume(&self, id: &SandboxId) -> Result<SandboxInfo, Error> {
        let (sb, st) = self.live(id)?;
        if st != SlotState::Frozen {
            return Err(Error::Conflict {
                id: id.clone(),
                reason: "sandbox is not paused".into(),
            });
        }
        self.thaw(id)?;
        self.registry
            .thaw(id, &sb)
            .map_err(|e| Self::refused(id, e))?;
        self.persist(&sb)?;
        sb.activity.touch();
        self.emit(id, EventKind::Resumed, None);
        Ok(sb.info(SandboxState::Running))
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
        let live = [SlotState::Running, SlotState::Frozen, SlotState::Failed];
        for id in self.registry.ids_in(&live) {
            if let Err(e) = self.destroy(&id) {
                tracing::error!(sandbox = %id, error = %e, "destroy at shutdown failed");
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

    /// Host paths bind-mounted into a sandbox (declare them to CRIU): the init binary, and in a
    /// user namespace the host's device nodes in /dev (see `proto::DEV_NODES`).
    pub fn externals(&self, userns: bool) -> Vec<ExternalMount> {
        let init = ExternalMount {
            key: "grove-init".into(),
            sandbox_path: proto::INIT_PATH.into(),
            host_path: self.config.init_binary.clone(),
        };
        let devices = proto::DEV_NODES
            .iter()
            .filter(|_| userns)
            .map(|(name, _, _)| ExternalMount {
                key: format!("grove-dev-{name}"),
                sandbox_path: format!("/dev/{name}"),
                host_path: PathBuf::from(format!("/dev/{name}")),
            });
        std::iter::once(init).chain(devices).collect()
    }

    pub fn checkpoint_view(&self, id: &SandboxId) -> Result<CheckpointView, Error> {
        let sb = self.sandbox(id)?;
        if !sb.init.alive() {
            let pid = sb.init.pid();
            return Err(self.unreachable(&sb, HandleError::Gone { pid }));
        }
        Ok(CheckpointView {
            id: id.clone(),
            init_pid: sb.init.pid(),
            spec: sb.spec.clone(),
            root_dir: sb.root_dir(),
            cgroups: self.cgroups.criu_paths(id.as_str()),
            externals: self.externals(sb.spec.userns),
            root: sb.root.clone(),
            veth_host: sb.net.as_ref().map(|n| n.host_if.clone()),
        })
    }

    pub fn freeze(&self, id: &SandboxId) -> Result<(), Error> {
        self.sandbox(id)?;
        self.cgroups.freeze(id.as_str()).map_err(|e| Error::Cgroup {
            path: e.path.clone(),
            source: e.source,
        })
    }

    pub fn thaw(&self, id: &SandboxId) -> Result<(), Error> {
        self.sandbox(id)?;
        self.cgroups.thaw(id.as_str()).map_err(|e| Error::Cgroup {
            path: e.path.clone(),
            source: e.source,
        })
    }
}

/// groved shares one Runtime across threads.
const _: fn() = || {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Runtime>();
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_refusals_by_kind() {
        let id = SandboxId::generate();
        for (kind, field) in [
            (InitErrorKind::BadCwd, "cwd"),
            (InitErrorKind::BadExec, "argv"),
            (InitErrorKind::BadUser, "user"),
        ] {
            let e = init_refusal(&id, kind, "whatever the text").unwrap();
            assert_eq!(e.field(), Some(field), "{kind:?}: {e:?}");
            assert!(e.to_string().contains("whatever the text"), "{e}");
        }
        let gone = init_refusal(&id, InitErrorKind::RootGone, "cwd \"/x\": ENOTCONN").unwrap();
        assert!(matches!(gone, Error::Unavailable { .. }), "{gone:?}");
        // Init's own failures, and an older init's kindless refusals, whatever their text: judged
        // by the sandbox's state instead.
        for kind in [
            InitErrorKind::NoProcess,
            InitErrorKind::Refused,
            InitErrorKind::Protocol,
            InitErrorKind::Spawn,
            InitErrorKind::Other,
        ] {
            for text in [
                "cwd \"/x\": ENOENT",
                "exec \"x\": ENOENT",
                "user \"u\": x",
                "ENOTCONN",
            ] {
                assert!(init_refusal(&id, kind, text).is_none(), "{kind:?} {text:?}");
            }
        }
    }
}
