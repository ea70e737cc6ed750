//! Claiming a pooled sandbox for a create: the hand-over that makes it the caller's.

use std::sync::Arc;

use crate::client;
use crate::error::Error;
use crate::jobs::job_of;
use crate::record;
use crate::runtime::Runtime;
use crate::sandbox::{now_ms, Parts, Sandbox};
use crate::types::{EventKind, NetworkPolicy, SandboxInfo, SandboxSpec, SandboxState};
use crate::validate;

use super::PoolKey;

impl Runtime {
    /// Serves a plain create from a warm pool of its image and size, if one holds a sandbox and
    /// the job may have one now. None: build it cold. The sandbox gets the request's hostname,
    /// network, env, labels and ttl; its id was never shown before, its root never written.
    pub(crate) fn claim_pooled(&self, spec: &SandboxSpec) -> Result<Option<SandboxInfo>, Error> {
        validate::spec(spec)?;
        if !spec.cap_add.is_empty() || spec.userns {
            // pooled sandboxes were set up with the default capabilities, in the host's userns
            return Ok(None);
        }
        let limits = spec.limits.unwrap_or(self.config.defaults);
        validate::limits(&limits)?;
        let job = job_of(spec)?;
        let key = PoolKey {
            image: spec.image.clone(),
            limits,
        };
        let Some(pooled) = self.reserve_pooled(|| self.pools.take(&key)) else {
            return Ok(None);
        };
        if !self.jobs.try_acquire_now(job, &limits) {
            self.registry.with(|slots| {
                if let Err(e) = slots.abandon(&pooled.id) {
                    tracing::error!(sandbox = %pooled.id, error = %e, "slot of a pooled sandbox");
                }
                self.pools.put_back(&key, pooled);
            });
            return Ok(None);
        }
        let id = pooled.id.clone();
        let claimed = self.hand_over(&pooled, spec).and_then(|sb| {
            let info = sb.info(SandboxState::Running);
            match self.registry.create(&id, sb.clone()) {
                Ok(()) => Ok(info),
                Err(e) => {
                    if let Some(lease) = &sb.net {
                        let _ = self.net.teardown(lease);
                    }
                    Err(Error::Conflict {
                        id: id.clone(),
                        reason: e.to_string(),
                    })
                }
            }
        });
        match claimed {
            Ok(info) => {
                self.emit(&id, EventKind::Created, None);
                Ok(Some(info))
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "pooled sandbox unusable; building one cold");
                self.jobs.release(job, &limits);
                self.destroy_pooled(&pooled);
                Ok(None)
            }
        }
    }

    /// The pooled sandbox, alive and dressed for `spec`, as a new record.
    fn hand_over(&self, pooled: &Sandbox, spec: &SandboxSpec) -> Result<Arc<Sandbox>, Error> {
        let id = &pooled.id;
        let init = &pooled.init;
        let init_err = |reason: String| Error::Init {
            id: id.clone(),
            reason,
        };
        self.inits
            .ping(init, client::TIMEOUT)
            .map_err(|e| init_err(format!("pooled init: {e}")))?;
        // Built at the refill's low priority: from now on it runs at the caller's, as a cold
        // one would (init is one thread, and what it starts inherits its priority).
        grove_sys::sched::nice(0)
            .and_then(|n| grove_sys::sched::set_nice(init.pid(), n))
            .map_err(|e| init_err(format!("set the priority of the pooled init: {e}")))?;
        let hostname = match &spec.hostname {
            Some(h) if *h != pooled.hostname => {
                self.inits
                    .set_hostname(init, h)
                    .map_err(|e| init_err(format!("set hostname: {e}")))?;
                h.clone()
            }
            _ => pooled.hostname.clone(),
        };
        let net = match &spec.network {
            NetworkPolicy::None => None,
            NetworkPolicy::Egress { allow } => Some(
                self.net
                    .setup(id, init.pid(), allow, &spec.ports)
                    .map_err(|e| e.into_error(id))?,
            ),
        };
        let now = now_ms();
        let sb = Arc::new(Sandbox {
            id: id.clone(),
            spec: spec.clone(),
            limits: pooled.limits,
            hostname,
            created_at_ms: now,
            expires_at_ms: parking_lot::Mutex::new(crate::validate::expires_at(now, spec.ttl_secs)),
            init: init.clone(),
            dir: pooled.dir.clone(),
            root: pooled.root.clone(),
            net,
            activity: crate::sandbox::Activity::new(now),
            ids: None,
        });
        // The commit point, as for a cold create: from here a restart adopts it.
        if let Err(e) = record::write(&sb.dir, &sb.record(SandboxState::Running)) {
            if let Some(lease) = &sb.net {
                let _ = self.net.teardown(lease);
            }
            return Err(Error::io(format!("write the record of {id}"), e));
        }
        Ok(sb)
    }

    /// Takes a pooled sandbox out of its pool with `take` and reserves its id (`Creating`) in
    /// one step, so residue never finds it in neither.
    pub(crate) fn reserve_pooled(
        &self,
        take: impl FnOnce() -> Option<Arc<Sandbox>>,
    ) -> Option<Arc<Sandbox>> {
        self.registry.with(|slots| {
            let sb = take()?;
            if let Err(e) = slots.reserve(&sb.id) {
                tracing::error!(sandbox = %sb.id, error = %e, "a pooled sandbox's id is taken");
            }
            Some(sb)
        })
    }

    /// Reclaims a pooled sandbox whose id is reserved (eviction, shrink, shutdown, failure).
    pub(crate) fn destroy_pooled(&self, sb: &Sandbox) {
        // Its network lease, if a hand-over made one, is torn down where that failed.
        let parts = Parts {
            net: None,
            ids: None,
            ..Parts::of(sb)
        };
        if let Err(e) = self.reclaim(&sb.id, parts) {
            tracing::error!(sandbox = %sb.id, error = %e, "reclaim of a pooled sandbox is incomplete");
        }
        self.admission.release(&sb.limits);
        if let Err(e) = self.registry.abandon(&sb.id) {
            tracing::error!(sandbox = %sb.id, error = %e, "slot of a pooled sandbox");
        }
        self.jobs.node_freed();
    }

    /// Evicts one idle pooled sandbox to make room for a foreground create; false if none.
    pub(crate) fn evict_pooled(&self) -> bool {
        let Some(victim) = self.reserve_pooled(|| self.pools.victim()) else {
            return false;
        };
        self.destroy_pooled(&victim);
        true
    }
}
