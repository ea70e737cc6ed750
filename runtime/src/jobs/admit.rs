//! The create path's admission: the job's turn and quota, then node capacity (evicting idle
//! pooled sandboxes first when the node is full); and the release that undoes it.

use std::sync::Arc;

use super::{check_name, JobStatus, JobsConfig, DEFAULT_JOB};
use crate::error::Error;
use crate::runtime::Runtime;
use crate::types::{Limits, SandboxSpec};

/// The job a spec belongs to (validated).
pub fn job_of(spec: &SandboxSpec) -> Result<&str, Error> {
    match &spec.job {
        None => Ok(DEFAULT_JOB),
        Some(j) => check_name(j).map(|()| j.as_str()),
    }
}

impl Runtime {
    /// Waits until `spec`'s job may have one more sandbox of `limits` and the node has room for
    /// it, then reserves both. Fails after the queue timeout (QueueTimeout, or CapacityExceeded
    /// when the timeout is 0).
    pub(crate) fn admit(&self, spec: &SandboxSpec, limits: &Limits) -> Result<(), Error> {
        let job = job_of(spec)?;
        let mut try_node = || self.reserve_evicting(limits);
        self.jobs.acquire(
            job,
            spec.priority,
            spec.queue_timeout_ms,
            limits,
            &mut try_node,
        )
    }

    /// Gives back what `admit` reserved.
    pub(crate) fn release(&self, spec: &SandboxSpec, limits: &Limits) {
        self.admission.release(limits);
        self.jobs
            .release(job_of(spec).unwrap_or(DEFAULT_JOB), limits);
    }

    fn reserve_evicting(&self, limits: &Limits) -> Result<(), Error> {
        loop {
            match self.admission.reserve(limits) {
                Err(Error::CapacityExceeded { .. } | Error::InsufficientStorage { .. })
                    if self.evict_pooled() =>
                {
                    continue
                }
                r => return r,
            }
        }
    }

    pub fn set_jobs(self: &Arc<Self>, config: JobsConfig) -> Result<(), Error> {
        self.jobs.configure(config)
    }

    pub fn jobs_config(&self) -> JobsConfig {
        self.jobs.config()
    }

    /// Every job seen or configured: what it holds, what waits, how long it waited.
    pub fn jobs(&self) -> Vec<JobStatus> {
        self.jobs.status()
    }
}
