//! Idle reclaim: which running sandboxes have gone unused past their idle timeout. The runtime
//! can only destroy; pausing to the store needs the snapshotter, so the caller (groved's reaper)
//! applies the verdicts.

use crate::registry::SlotState;
use crate::runtime::Runtime;
use crate::sandbox::now_ms;
use crate::types::{IdlePolicy, OnIdle, SandboxId};

impl Runtime {
    /// The idle policy that applies to a sandbox: its own, else the node's default.
    pub fn idle_policy(&self, own: Option<IdlePolicy>) -> Option<IdlePolicy> {
        own.or(self.config.idle)
    }

    /// Running sandboxes with no exec, file access or CPU use (see `Activity::sample`) for at
    /// least their idle timeout, with what their policy says to do. Each call is one CPU sample
    /// per sandbox with a policy, so call it on a steady timer.
    pub fn idle_due(&self) -> Vec<(SandboxId, OnIdle)> {
        let now = now_ms();
        let live = self.registry.live();
        live.into_iter()
            .filter_map(|(sb, state)| {
                let policy = self.idle_policy(sb.spec.idle)?;
                if state != SlotState::Running {
                    return None;
                }
                let cpu = self.cgroups.usage(sb.id.as_str()).cpu_usec;
                let last = sb.activity.sample(cpu, now);
                let idle_ms = now.saturating_sub(last);
                (idle_ms >= policy.timeout_secs.saturating_mul(1000))
                    .then(|| (sb.id.clone(), policy.on_idle))
            })
            .collect()
    }

    /// Marks a sandbox used now (a request reached it through another path, e.g. a resume).
    pub fn touch(&self, id: &SandboxId) {
        if let Ok(sb) = self.sandbox(id) {
            sb.activity.touch();
        }
    }
}
