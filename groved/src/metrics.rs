//! Prometheus text exposition, hand-rolled: a few histograms, counters and gauges. Labels never carry an id
//! (routes are the matched templates, failures are error codes).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use grove_runtime::{JobStatus, PoolStatus};
use parking_lot::Mutex;

/// The operations whose durations are histograms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Op {
    Create,
    Exec,
    Snapshot,
    Restore,
    Fork,
    Pause,
    Resume,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Create => "create",
            Op::Exec => "exec",
            Op::Snapshot => "snapshot",
            Op::Restore => "restore",
            Op::Fork => "fork",
            Op::Pause => "pause",
            Op::Resume => "resume",
        }
    }
    const ALL: [Op; 7] = [
        Op::Create,
        Op::Exec,
        Op::Snapshot,
        Op::Restore,
        Op::Fork,
        Op::Pause,
        Op::Resume,
    ];
}

const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

#[derive(Debug, Default)]
struct Inner {
    hist: BTreeMap<Op, Histogram>,
    failures: BTreeMap<(String, String), u64>,
    requests: BTreeMap<(String, String, u16), u64>,
}

#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    pub fn observe(&self, op: Op, d: Duration) {
        let secs = d.as_secs_f64();
        let mut g = self.inner.lock();
        let h = g.hist.entry(op).or_default();
        for (i, b) in BUCKETS.iter().enumerate() {
            if secs <= *b {
                h.counts[i] += 1;
            }
        }
        h.sum += secs;
        h.count += 1;
    }

    /// Counts a failed operation; `reason` is an error code, never free text.
    pub fn failure(&self, op: &str, reason: &str) {
        *self
            .inner
            .lock()
            .failures
            .entry((op.to_string(), reason.to_string()))
            .or_default() += 1;
    }

    pub fn request(&self, route: &str, method: &str, status: u16) {
        *self
            .inner
            .lock()
            .requests
            .entry((route.to_string(), method.to_string(), status))
            .or_default() += 1;
    }

    /// Renders everything, plus the given gauges (`name{labels}` → value).
    pub fn render(
        &self,
        sandboxes_by_state: &BTreeMap<String, u64>,
        gauges: &[(&str, &str, f64)],
    ) -> String {
        let g = self.inner.lock();
        let mut out = String::new();
        for op in Op::ALL {
            let name = format!("grove_{}_duration_seconds", op.name());
            let h = g.hist.get(&op).cloned().unwrap_or_default();
            let _ = writeln!(out, "# HELP {name} Duration of {} operations.", op.name());
            let _ = writeln!(out, "# TYPE {name} histogram");
            for (i, b) in BUCKETS.iter().enumerate() {
                let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", h.counts[i]);
            }
            let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(out, "{name}_sum {}", h.sum);
            let _ = writeln!(out, "{name}_count {}", h.count);
        }
        out.push_str("# HELP grove_sandboxes Sandboxes on this node by state.\n# TYPE grove_sandboxes gauge\n");
        for (state, n) in sandboxes_by_state {
            let _ = writeln!(out, "grove_sandboxes{{state=\"{state}\"}} {n}");
        }
        out.push_str("# HELP grove_failures_total Failed operations by reason.\n# TYPE grove_failures_total counter\n");
        for ((op, reason), n) in &g.failures {
            let _ = writeln!(
                out,
                "grove_failures_total{{op=\"{op}\",reason=\"{reason}\"}} {n}"
            );
        }
        out.push_str("# HELP grove_http_requests_total API requests by route and status.\n");
        out.push_str("# TYPE grove_http_requests_total counter\n");
        for ((route, method, status), n) in &g.requests {
            let _ = writeln!(out, "grove_http_requests_total{{route=\"{route}\",method=\"{method}\",code=\"{status}\"}} {n}");
        }
        let mut last = "";
        for (name, help, v) in gauges {
            let base = name.split('{').next().unwrap_or(name);
            if base != last {
                let _ = writeln!(out, "# HELP {base} {help}\n# TYPE {base} gauge");
                last = base;
            }
            let _ = writeln!(out, "{name} {v}");
        }
        out
    }
}

/// (name, type, help, value) of one metric family.
type Series<T> = (&'static str, &'static str, &'static str, fn(&T) -> f64);

/// Per-job and per-pool gauges and counters. Labels: job names (validated [A-Za-z0-9._-]) and pool
/// keys (image, memory, cpu), never a sandbox id.
pub fn render_elastic(jobs: &[JobStatus], pools: &[PoolStatus]) -> String {
    let mut out = String::new();
    let job_series: [Series<JobStatus>; 7] = [
        (
            "grove_job_running",
            "gauge",
            "Sandboxes the job holds.",
            |j| j.usage.sandboxes as f64,
        ),
        (
            "grove_job_memory_mb",
            "gauge",
            "Memory limits of the job's sandboxes.",
            |j| j.usage.memory_mb as f64,
        ),
        (
            "grove_job_queued",
            "gauge",
            "Creates of the job waiting for room.",
            |j| j.queued as f64,
        ),
        (
            "grove_job_admitted_total",
            "counter",
            "Creates admitted.",
            |j| j.admitted as f64,
        ),
        (
            "grove_job_queue_timeouts_total",
            "counter",
            "Creates that gave up after the queue timeout.",
            |j| j.timed_out as f64,
        ),
        (
            "grove_job_wait_seconds_total",
            "counter",
            "Time admitted creates spent queued.",
            |j| j.wait_ms_total as f64 / 1000.0,
        ),
        (
            "grove_job_wait_seconds_max",
            "gauge",
            "Longest time an admitted create spent queued.",
            |j| j.wait_ms_max as f64 / 1000.0,
        ),
    ];
    for (name, kind, help, value) in job_series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for j in jobs {
            let _ = writeln!(out, "{name}{{job=\"{}\"}} {}", j.job, value(j));
        }
    }
    let pool_series: [Series<PoolStatus>; 6] = [
        ("grove_pool_idle", "gauge", "Warm sandboxes ready.", |p| {
            f64::from(p.idle)
        }),
        (
            "grove_pool_target",
            "gauge",
            "The size the pool is heading for.",
            |p| f64::from(p.target),
        ),
        (
            "grove_pool_idle_memory_bytes",
            "gauge",
            "Memory the warm sandboxes hold.",
            |p| p.idle_memory_bytes as f64,
        ),
        (
            "grove_pool_demand_per_second",
            "gauge",
            "Creates of this size per second (decaying peak).",
            |p| p.demand_per_sec,
        ),
        (
            "grove_pool_hits_total",
            "counter",
            "Creates served from the pool.",
            |p| p.hits as f64,
        ),
        (
            "grove_pool_misses_total",
            "counter",
            "Creates of this size the pool could not serve.",
            |p| p.misses as f64,
        ),
    ];
    for (name, kind, help, value) in pool_series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for p in pools {
            let _ = writeln!(
                out,
                "{name}{{image=\"{}\",memory_mb=\"{}\",cpu_millis=\"{}\"}} {}",
                p.image,
                p.limits.memory_mb,
                p.limits.cpu_millis,
                value(p)
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.observe(Op::Exec, Duration::from_millis(3));
        m.observe(Op::Exec, Duration::from_secs(2));
        m.failure("create", "capacity_exceeded");
        let text = m.render(&BTreeMap::from([("running".to_string(), 2)]), &[]);
        assert!(
            text.contains("grove_exec_duration_seconds_bucket{le=\"0.005\"} 1"),
            "{text}"
        );
        assert!(text.contains("grove_exec_duration_seconds_bucket{le=\"2.5\"} 2"));
        assert!(text.contains("grove_exec_duration_seconds_count 2"));
        assert!(text.contains("grove_sandboxes{state=\"running\"} 2"));
        assert!(text.contains("grove_failures_total{op=\"create\",reason=\"capacity_exceeded\"} 1"));
    }
}
