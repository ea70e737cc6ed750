//! One live sandbox's record, and the parts a create has made so far (what reclaim undoes).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::init_handle::InitHandle;
use crate::network::NetLease;
use crate::record::SandboxRecord;
use crate::registry::Occupant;
use crate::root::RootMount;
use crate::types::{Limits, SandboxId, SandboxInfo, SandboxSpec, SandboxState};
use crate::userns::IdRange;

pub struct Sandbox {
    pub id: SandboxId,
    pub spec: SandboxSpec,
    pub limits: Limits,
    pub hostname: String,
    pub created_at_ms: u64,
    pub expires_at_ms: Mutex<Option<u64>>,
    /// The only way to the init (and through it to the root): never its bare pid.
    pub init: Arc<InitHandle>,
    pub dir: PathBuf,
    pub root: Arc<dyn RootMount>,
    pub net: Option<NetLease>,
    pub activity: Activity,
    /// The host id range of a sandbox in a user namespace.
    pub ids: Option<IdRange>,
}

/// When a sandbox was last used, for idle reclaim: requests touch it, and the reaper counts CPU
/// use seen between two of its samples as use too.
#[derive(Debug)]
pub struct Activity {
    last_ms: AtomicU64,
    cpu_usec: AtomicU64,
    sampled_ms: AtomicU64,
    /// Execs in flight: a sandbox running a command for a client is in use however quiet it is.
    busy: AtomicU64,
}

/// Holds a sandbox in use while it lives (see [`Activity::busy`]).
#[derive(Debug)]
pub struct Busy<'a>(&'a Activity);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::Relaxed);
        self.0.touch();
    }
}

impl Activity {
    pub fn new(now: u64) -> Activity {
        Activity {
            last_ms: AtomicU64::new(now),
            cpu_usec: AtomicU64::new(0),
            sampled_ms: AtomicU64::new(now),
            busy: AtomicU64::new(0),
        }
    }

    pub fn touch(&self) {
        self.last_ms.fetch_max(now_ms(), Ordering::Relaxed);
    }

    /// Marks the sandbox in use now and until the guard drops (an exec without a deadline may be
    /// quiet for hours; idle reclaim must not take the sandbox from under it).
    pub fn busy(&self) -> Busy<'_> {
        self.busy.fetch_add(1, Ordering::Relaxed);
        self.touch();
        Busy(self)
    }

    /// Feeds one CPU sample (cumulative µs) and returns when the sandbox was last used. Using
    /// more than 1 % of one CPU since the previous sample counts as use; the rest is noise
    /// (init's own bookkeeping).
    pub fn sample(&self, cpu_usec: u64, now: u64) -> u64 {
        let prev_cpu = self.cpu_usec.swap(cpu_usec, Ordering::Relaxed);
        let prev_ms = self.sampled_ms.swap(now, Ordering::Relaxed);
        let used = cpu_usec.saturating_sub(prev_cpu);
        let wall_usec = now.saturating_sub(prev_ms) * 1000;
        if used * 100 > wall_usec || self.busy.load(Ordering::Relaxed) > 0 {
            self.last_ms.fetch_max(now, Ordering::Relaxed);
        }
        self.last_ms.load(Ordering::Relaxed)
    }
}

/// The registry holds live sandboxes by `Arc`; its slot says their state.
impl Occupant for Arc<Sandbox> {
    fn info(&self, state: SandboxState) -> SandboxInfo {
        Sandbox::info(self, state)
    }

    fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(self, other)
    }

    fn expires_at_ms(&self) -> Option<u64> {
        *self.expires_at_ms.lock()
    }
}

impl Sandbox {
    /// Its info showing `state` (the registry's, which owns it).
    pub fn info(&self, state: SandboxState) -> SandboxInfo {
        SandboxInfo {
            id: self.id.clone(),
            state,
            spec: self.spec.clone(),
            created_at_ms: self.created_at_ms,
            expires_at_ms: *self.expires_at_ms.lock(),
            init_pid: Some(self.init.pid()),
            hostname: self.hostname.clone(),
            address: self.net.as_ref().map(|n| n.sandbox_addr.to_string()),
        }
    }

    /// The durable record; `state` is `Running` or `Paused` (frozen), the registry's.
    pub fn record(&self, state: SandboxState) -> SandboxRecord {
        SandboxRecord {
            id: self.id.clone(),
            spec: self.spec.clone(),
            limits: self.limits,
            hostname: self.hostname.clone(),
            created_at_ms: self.created_at_ms,
            expires_at_ms: *self.expires_at_ms.lock(),
            state,
            init_pid: self.init.pid(),
            init_start: self.init.start(),
            net: self.net.clone(),
            ids: self.ids,
        }
    }

    pub fn root_dir(&self) -> PathBuf {
        self.dir.join("root")
    }
}

/// What exists of a sandbox on the host; reclaim removes exactly these, in reverse order of making.
#[derive(Default)]
pub struct Parts {
    pub dir: Option<PathBuf>,
    pub root: Option<Arc<dyn RootMount>>,
    pub cgroups: bool,
    /// The init's pid when it failed during setup (our child, not reaped: the pid is its).
    pub init_pid: Option<i32>,
    pub init: Option<Arc<InitHandle>>,
    pub net: Option<NetLease>,
    /// A drawn id range, freed by reclaim.
    pub ids: Option<IdRange>,
}

impl Parts {
    /// Everything a live sandbox holds on the host, for its reclaim.
    pub(crate) fn of(sb: &Sandbox) -> Parts {
        Parts {
            dir: Some(sb.dir.clone()),
            root: Some(sb.root.clone()),
            cgroups: true,
            init_pid: None,
            init: Some(sb.init.clone()),
            net: sb.net.clone(),
            ids: sb.ids,
        }
    }
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::Activity;

    #[test]
    fn cpu_use_above_one_percent_counts_as_activity() {
        let a = Activity::new(1_000);
        // 10 s later, 50 ms of CPU: 0.5 %, init's noise; still last used at the start.
        a.sample(0, 1_000);
        assert_eq!(a.sample(50_000, 11_000), 1_000);
        // 200 ms of CPU in the next second: 20 %, in use now.
        assert_eq!(a.sample(250_000, 12_000), 12_000);
        // A request touch moves it forward, never back.
        a.touch();
        assert!(a.sample(250_000, 12_500) >= 12_000);
    }
}
