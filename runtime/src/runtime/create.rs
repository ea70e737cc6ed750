//! Making a sandbox: admission, then each step of a build (run dir, id range, root, cgroups,
//! init spawned or restored, network, durable record) recorded in `Parts`, so that a failure at
//! any step is undone by `reclaim` and leaves nothing behind.

use std::sync::Arc;

use super::{io_err, RestoreFn, RestoreTarget, Runtime};
use crate::client;
use crate::error::Error;
use crate::init_handle::InitHandle;
use crate::proto::SetupConfig;
use crate::record;
use crate::registry::{SlotState, TransitionError};
use crate::root::{DiskQuota, RootMount};
use crate::sandbox::{now_ms, Parts, Sandbox};
use crate::spawner::SpawnError;
use crate::types::*;
use crate::validate;

impl Runtime {
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
}
