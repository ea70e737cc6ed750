//! The refill worker: one background thread that builds pooled sandboxes one at a time while no
//! foreground create is in flight or queued, and shrinks pools above their target.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::record;
use crate::runtime::Runtime;
use crate::sandbox::Parts;
use crate::types::SandboxSpec;

use super::{PoolKey, PoolStatus, PoolsConfig, Step};

/// How often the worker looks again when there is nothing to do (demand windows roll over).
const TICK: Duration = Duration::from_millis(100);
/// Longest `set_pools` waits for a build in flight.
const SETTLE: Duration = Duration::from_secs(30);
/// The refill thread's nice value. A claimed sandbox's first commands run while the next one
/// builds; at the default priority that build took a third of a core from them (5 ms of a 14 ms
/// first command, measured). The pooled init inherits it, and gets the foreground's at claim.
pub(crate) const REFILL_NICE: i32 = 19;

impl Runtime {
    /// Replaces the pool configuration and starts the refill worker if needed. Idle sandboxes of
    /// pools that are gone or smaller are destroyed before this returns.
    pub fn set_pools(self: &Arc<Self>, config: PoolsConfig) -> Result<(), Error> {
        config.validate()?;
        for p in &config.pools {
            if !self.roots.image_exists(&p.image) {
                return Err(Error::ImageNotFound {
                    image: p.image.clone(),
                });
            }
        }
        self.pools.configure(config, &self.config.defaults);
        self.start_refill();
        // A build in flight lands in its pool when done: wait for it so that pools which shrink
        // are at their new size on return.
        let t0 = Instant::now();
        loop {
            while let Step::Shrink(sb) = self.pools.next_step(true) {
                self.destroy_pooled_idle(sb);
            }
            if self.pools.filling_total() == 0 || t0.elapsed() > SETTLE {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn pools_config(&self) -> PoolsConfig {
        self.pools.config()
    }

    /// Every pool, configured or automatic, with the memory its idle sandboxes hold.
    pub fn pools(&self) -> Vec<PoolStatus> {
        self.pools
            .status()
            .into_iter()
            .map(|(mut s, ids)| {
                s.idle_memory_bytes = ids
                    .iter()
                    .map(|id| self.cgroups.usage(id.as_str()).memory_bytes)
                    .sum();
                s
            })
            .collect()
    }

    fn start_refill(self: &Arc<Self>) {
        let mut worker = self.pools.worker.lock();
        if worker.is_some() || self.pools.stop.load(Ordering::SeqCst) {
            return;
        }
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("grove-pool-refill".into())
            .spawn(move || refill_loop(weak));
        match spawned {
            Ok(h) => *worker = Some(h),
            Err(e) => tracing::error!(error = %e, "cannot start the pool refill thread"),
        }
    }

    /// Stops the worker and destroys every idle pooled sandbox (shutdown, or a stop that leaves
    /// the user's sandboxes running for the next start to adopt).
    pub fn drain_pools(&self) {
        self.pools.stop.store(true, Ordering::SeqCst);
        self.pools.wake.notify_all();
        let handle = self.pools.worker.lock().take();
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        // Out of the pools and reserved in one step, as `reserve_pooled` does for one.
        let all = self.registry.with(|slots| {
            let all = self.pools.take_all();
            for sb in &all {
                if let Err(e) = slots.reserve(&sb.id) {
                    tracing::error!(sandbox = %sb.id, error = %e, "a pooled sandbox's id is taken");
                }
            }
            all
        });
        for sb in all {
            self.destroy_pooled(&sb);
        }
    }

    fn destroy_pooled_idle(&self, sb: Arc<crate::sandbox::Sandbox>) {
        // Taken out of the pool by `next_step`: reserve its id while it is torn down.
        if let Some(sb) = self.reserve_pooled(|| Some(sb)) {
            self.destroy_pooled(&sb);
        }
    }

    /// One refill step; true if it did something (so the next one follows at once).
    fn refill_step(&self) -> bool {
        match self.pools.next_step(self.jobs.queued() > 0) {
            Step::Idle => false,
            Step::Shrink(sb) => {
                self.destroy_pooled_idle(sb);
                true
            }
            Step::Fill(key) => match self.fill_one(&key) {
                Ok(()) => true,
                Err(Error::CapacityExceeded { .. } | Error::InsufficientStorage { .. }) => false,
                Err(e) => {
                    tracing::warn!(image = %key.image, error = %e, "pool refill failed");
                    false
                }
            },
        }
    }

    /// Builds one sandbox for the pool of `key` (no job is charged: the pool is Grove's own).
    /// `next_step` counted it as filling; this uncounts it.
    fn fill_one(&self, key: &PoolKey) -> Result<(), Error> {
        if let Err(e) = self.admission.reserve(&key.limits) {
            self.pools.filling(key, -1);
            return Err(e);
        }
        let id = self.registry.reserve_fresh();
        let spec = SandboxSpec {
            limits: Some(key.limits),
            ..SandboxSpec::from_image(key.image.clone())
        };
        let started = Instant::now();
        let mut parts = Parts::default();
        let built = self
            .build(&id, &spec, &key.limits, None, None, &mut parts)
            .and_then(|sb| {
                // Pooled sandboxes are not adopted by a restart (nobody holds them): no record.
                record::discard(&sb.dir)
                    .map(|()| sb)
                    .map_err(|e| Error::io(format!("discard the record of {id}"), e))
            });
        self.pools.filling(key, -1);
        match built {
            Ok(sb) => {
                self.registry
                    .with(|slots| {
                        self.pools.add(key, sb, started.elapsed());
                        slots.abandon(&id)
                    })
                    .unwrap_or_else(
                        |e| tracing::error!(sandbox = %id, error = %e, "slot of a pool fill"),
                    );
                Ok(())
            }
            Err(e) => {
                if let Err(undo) = self.reclaim(&id, parts) {
                    tracing::error!(sandbox = %id, error = %undo, "undo of a failed pool fill is incomplete");
                }
                self.admission.release(&key.limits);
                if let Err(e) = self.registry.abandon(&id) {
                    tracing::error!(sandbox = %id, error = %e, "slot of a pool fill");
                }
                self.jobs.node_freed();
                Err(e)
            }
        }
    }
}

fn refill_loop(rt: Weak<Runtime>) {
    if let Err(e) = grove_sys::sched::set_nice(0, REFILL_NICE) {
        tracing::warn!(error = %e, "pool refills run at the foreground's priority");
    }
    loop {
        let Some(runtime) = rt.upgrade() else {
            return;
        };
        if runtime.pools.stop.load(Ordering::SeqCst) {
            return;
        }
        if runtime.refill_step() {
            continue;
        }
        let pools = &runtime.pools;
        let mut st = pools.state.lock();
        if !pools.stop.load(Ordering::SeqCst) {
            pools.wake.wait_for(&mut st, TICK);
        }
    }
}
