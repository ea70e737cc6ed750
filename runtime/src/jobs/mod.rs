//! Jobs: every sandbox belongs to a job (a tenant label given at create). Per-job quotas, and a
//! queue that, when the node or a job is full, serves waiting creates fairly across jobs (weighted
//! by share) up to a timeout. Metrics per job: running, queued, time waited.

mod admit;
mod queue;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::types::Limits;

pub use admit::job_of;
pub use queue::Usage as JobUsage;
use queue::{Queue, Verdict};

/// A waiter that heard nothing looks again after this long.
const RECHECK: Duration = Duration::from_millis(500);

/// The job of a sandbox created without one.
pub const DEFAULT_JOB: &str = "default";

/// Share and quotas of one job. Unset quotas are unlimited (the node's capacity still applies).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JobPolicy {
    /// Relative weight when jobs compete for a full node (admissions follow the shares).
    pub share: u32,
    pub max_sandboxes: Option<u64>,
    pub max_cpu_millis: Option<u64>,
    pub max_memory_mb: Option<u64>,
}

impl Default for JobPolicy {
    fn default() -> Self {
        JobPolicy {
            share: 1,
            max_sandboxes: None,
            max_cpu_millis: None,
            max_memory_mb: None,
        }
    }
}

/// How long creates may wait, and the policy of each job (others get `default`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JobsConfig {
    /// 0: a create that does not fit fails at once (429); otherwise it queues this long.
    pub queue_timeout_ms: u64,
    pub default: JobPolicy,
    pub jobs: BTreeMap<String, JobPolicy>,
}

impl JobsConfig {
    pub fn policy(&self, job: &str) -> &JobPolicy {
        self.jobs.get(job).unwrap_or(&self.default)
    }

    pub fn validate(&self) -> Result<(), Error> {
        for (name, p) in
            std::iter::once((&DEFAULT_JOB.to_string(), &self.default)).chain(&self.jobs)
        {
            check_name(name)?;
            if p.share == 0 || p.share > 10_000 {
                return Err(Error::invalid(
                    &format!("jobs.{name}.share"),
                    format!("{} is outside 1..=10000", p.share),
                ));
            }
        }
        if self.queue_timeout_ms > 3_600_000 {
            return Err(Error::invalid(
                "queue_timeout_ms",
                "more than an hour is not a queue, it is a backlog",
            ));
        }
        Ok(())
    }
}

/// Job names: 1-64 chars of [A-Za-z0-9._-] (they become metric labels).
pub fn check_name(job: &str) -> Result<(), Error> {
    let ok = !job.is_empty()
        && job.len() <= 64
        && job
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(
            "job",
            format!("{job:?}: 1-64 chars of [A-Za-z0-9._-]"),
        ))
    }
}

/// What one job holds and how it has fared.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobStatus {
    pub job: String,
    pub policy: JobPolicy,
    pub usage: JobUsage,
    /// Creates waiting now.
    pub queued: u64,
    /// Creates admitted, and of those how many had to wait.
    pub admitted: u64,
    pub waited: u64,
    /// Total and longest wait of admitted creates.
    pub wait_ms_total: u64,
    pub wait_ms_max: u64,
    /// Creates that gave up after the queue timeout.
    pub timed_out: u64,
}

/// The jobs' ledger and queue, shared by every create and destroy.
pub struct Jobs {
    state: Mutex<Queue>,
    changed: Condvar,
}

impl Default for Jobs {
    fn default() -> Self {
        Jobs {
            state: Mutex::new(Queue::new(JobsConfig::default())),
            changed: Condvar::new(),
        }
    }
}

impl Jobs {
    pub fn configure(&self, config: JobsConfig) -> Result<(), Error> {
        config.validate()?;
        self.state.lock().config = config;
        self.changed.notify_all();
        Ok(())
    }

    pub fn config(&self) -> JobsConfig {
        self.state.lock().config.clone()
    }

    pub fn status(&self) -> Vec<JobStatus> {
        self.state.lock().status()
    }

    /// Creates waiting now, all jobs together (the pool refill yields to them).
    pub fn queued(&self) -> usize {
        self.state.lock().waiting()
    }

    /// Admits one sandbox of `limits` for `job`: its quota must allow it and `try_node` (which
    /// reserves node capacity) must succeed. When either is full the create queues, served in
    /// fair order, until room appears or the queue timeout (`queue_timeout_ms`, else the
    /// configured one) passes. On Ok the job is charged.
    pub fn acquire(
        &self,
        job: &str,
        priority: i32,
        queue_timeout_ms: Option<u64>,
        limits: &Limits,
        try_node: &mut dyn FnMut() -> Result<(), Error>,
    ) -> Result<(), Error> {
        let started = Instant::now();
        let mut q = self.state.lock();
        q.check_fits_quota_ever(job, limits)?;
        let timeout_ms = queue_timeout_ms.unwrap_or(q.config.queue_timeout_ms);
        let deadline = started + Duration::from_millis(timeout_ms);
        let seq = q.enqueue(job, priority, *limits);
        let mut node_said: Option<Error> = None;
        loop {
            match q.verdict(seq) {
                Verdict::Try => {
                    q.begin_try(seq);
                    let r = parking_lot::MutexGuard::unlocked(&mut q, &mut *try_node);
                    match r {
                        Ok(()) => {
                            q.grant(seq, started.elapsed());
                            drop(q);
                            self.changed.notify_all();
                            return Ok(());
                        }
                        Err(e @ Error::CapacityExceeded { .. }) => {
                            q.node_full(seq);
                            node_said = Some(e);
                        }
                        Err(e) => {
                            q.abandon(seq, false);
                            drop(q);
                            self.changed.notify_all();
                            return Err(e);
                        }
                    }
                }
                Verdict::Wait { why, full } => {
                    let now = Instant::now();
                    // Waiting for a peer's attempt is not queueing: only a full node or quota
                    // times out (at once when the timeout is 0).
                    if now >= deadline && (full || timeout_ms > 0) {
                        q.abandon(seq, true);
                        let retry_after_secs = q.retry_after_secs();
                        drop(q);
                        self.changed.notify_all();
                        if let (0, Some(e), false) = (timeout_ms, node_said, why.contains("quota"))
                        {
                            return Err(e);
                        }
                        return Err(Error::QueueTimeout {
                            job: job.to_string(),
                            waited_ms: started.elapsed().as_millis() as u64,
                            reason: why,
                            retry_after_secs,
                        });
                    }
                    let until = deadline.max(now).min(now + RECHECK);
                    if self.changed.wait_until(&mut q, until).timed_out() && full {
                        // Nothing announced a release for a while: look again anyway.
                        q.bump();
                    }
                }
            }
        }
    }

    /// Admits at once or not at all: for a claim from a warm pool, whose node capacity is held
    /// already. False when the job's quota is full or other creates are queued (fair order).
    pub fn try_acquire_now(&self, job: &str, limits: &Limits) -> bool {
        let mut q = self.state.lock();
        if q.waiting() > 0 || !q.fits_quota(job, limits) {
            return false;
        }
        q.grant_direct(job, limits);
        true
    }

    /// Charges a sandbox adopted from a previous run to its job (no queueing: it exists).
    pub(crate) fn charge_adopted(&self, spec: &crate::types::SandboxSpec, limits: &Limits) {
        let job = admit::job_of(spec).unwrap_or(DEFAULT_JOB);
        self.state.lock().grant_direct(job, limits);
    }

    /// A sandbox of `job` is gone: uncharge it and let the queue try again.
    pub fn release(&self, job: &str, limits: &Limits) {
        self.state.lock().release(job, limits);
        self.changed.notify_all();
    }

    /// Node capacity was freed outside a job (a pooled sandbox evicted or destroyed).
    pub fn node_freed(&self) {
        self.state.lock().bump();
        self.changed.notify_all();
    }
}
