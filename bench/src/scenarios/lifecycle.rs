//! create → exec `true` → destroy: sequential latency and throughput at 1, 2, 8, 32 concurrent clients.
//! Grove (the runtime library directly) vs an `unshare` floor, bwrap, crun and podman on the same base image.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;

use super::Ctx;
use crate::cleanup;
use crate::grove::GroveRuntime;
use crate::hardening;
use crate::peers::{self, Kind, PeerEnv};
use crate::plot::{self, Series};
use crate::progress;
use crate::promises::Stat;
use crate::report::{Better, Key, Measurement, Outcome, ScenarioResult};
use crate::util;

pub const NAME: &str = "lifecycle";
pub const CYCLE: &str = "create → exec true → destroy";
pub const RATE: &str = "create → exec true → destroy throughput";
pub const LOADED: &str = "create → exec true → destroy latency under load";
pub const SEQ: &str = "sequential";
pub const CRUN: &str = "crun";
pub const HARDEN: &str = "hardening layer cost, each layer's step alone";
pub const HARDEN_SHARE: &str = "hardening layer cost ÷ the sequential cycle's p50";

const CONCURRENCY: [usize; 4] = [1, 2, 8, 32];

enum System {
    Grove(Arc<GroveRuntime>),
    /// The same runtime, each sandbox in a user namespace of its own (`userns`): the cost the
    /// 10 % budget of issue 24 is judged on (sequential cycles only).
    GroveUserns(Arc<GroveRuntime>),
    Peer(Kind),
}

impl System {
    fn name(&self) -> String {
        match self {
            System::Grove(g) => g.label(),
            System::GroveUserns(g) => format!("{} userns", g.label()),
            System::Peer(k) => k.name().into(),
        }
    }
    fn cycle(&self, env: &PeerEnv) -> Result<()> {
        match self {
            System::Grove(g) => g.cycle_true(),
            System::GroveUserns(g) => g.cycle_true_userns(),
            System::Peer(k) => env.cycle(*k),
        }
    }
}

pub fn run(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    let seq_key = Key::new(CYCLE, SEQ, "ms", Better::Lower);
    let kinds = [Kind::Unshare, Kind::Bwrap, Kind::Crun, Kind::Podman];
    progress::step(0.0, "preparing peers (OCI bundles, podman image)");
    let env = PeerEnv::prepare(&ctx.image, &ctx.work, true)?;
    let _podman_sweep = cleanup::Guard::new("podman containers", {
        let conf = env.containers_conf.clone();
        move || {
            let mut c = std::process::Command::new("podman");
            c.env("CONTAINERS_CONF", conf);
            let f = format!("label={}", peers::PODMAN_LABEL);
            let ids = util::output(c.args(["ps", "-aq", "--filter", &f])).unwrap_or_default();
            for id in ids.split_whitespace() {
                let _ = std::process::Command::new("podman")
                    .args(["rm", "-f", id])
                    .output();
            }
            Ok(())
        }
    });
    let hugetlb = peers::hugetlb_workaround();
    let _hugetlb = match hugetlb {
        Ok(g) => {
            if g.is_some() {
                res.note("hugetlb was on cgroup2 (crun refuses hybrid mode): bound to a temporary v1 hierarchy for the scenario, undone after");
            }
            g
        }
        Err(e) => {
            res.note(format!(
                "hugetlb workaround failed ({e:#}); crun/podman may fail"
            ));
            None
        }
    };

    let mut systems: Vec<System> = Vec::new();
    match ctx.grove.runtime() {
        Ok(g) => {
            res.note(format!(
                "Grove: the runtime library in-process, {}",
                g.describe()
            ));
            systems.push(System::Grove(g.clone()));
            systems.push(System::GroveUserns(g));
        }
        Err(reason) => {
            res.push(Measurement::not_available(&seq_key, "grove", &reason));
            for c in CONCURRENCY {
                let k = Key::new(RATE, format!("concurrency {c}"), "cycles/s", Better::Higher);
                res.push(Measurement::not_available(&k, "grove", &reason));
            }
        }
    }
    let mut failed_peers = Vec::new();
    for k in kinds {
        if let Some(why) = env.unavailable(k) {
            res.push(Measurement::failed(&seq_key, k.name(), false, &why));
            failed_peers.push(k);
        } else {
            systems.push(System::Peer(k));
        }
    }

    // Sequential latency.
    let n_seq = |s: &System| match s {
        System::Peer(Kind::Podman) => ctx.pick(4, 40),
        _ => ctx.pick(12, 200),
    };
    let total = systems.len() as f64 * (1.0 + CONCURRENCY.len() as f64);
    let mut done = 0.0;
    let mut cdf = Vec::new();
    for s in &systems {
        progress::step(
            done / total,
            &format!("{} sequential ({} cycles)", s.name(), n_seq(s)),
        );
        done += 1.0;
        // Two warm-up cycles (page cache, first-use costs) are not counted.
        let mut samples = Vec::new();
        let mut error = None;
        for i in 0..n_seq(s) + 2 {
            cleanup::check()?;
            let t = Instant::now();
            match s.cycle(&env) {
                Ok(()) if i >= 2 => samples.push(util::ms_since(t)),
                Ok(()) => {}
                Err(e) => {
                    error = Some(format!("{e:#}"));
                    break;
                }
            }
        }
        let is_grove = matches!(s, System::Grove(_) | System::GroveUserns(_));
        let m = match error {
            Some(e) => Measurement::failed(&seq_key, &s.name(), is_grove, e),
            None => Measurement::samples(&seq_key, &s.name(), is_grove, &samples),
        };
        if let Outcome::Samples { .. } = m.outcome {
            let mut sorted = samples.clone();
            sorted.sort_by(f64::total_cmp);
            let n = sorted.len() as f64;
            let pts = sorted
                .iter()
                .enumerate()
                .map(|(i, v)| (*v, 100.0 * (i as f64 + 1.0) / n));
            cdf.push(Series {
                name: s.name(),
                points: pts.collect(),
            });
        }
        res.push(m);
    }

    if systems.iter().any(|s| matches!(s, System::Grove(_))) {
        progress::step(done / total, "hardening layers, one at a time");
        hardening_rows(ctx, res, &seq_key);
    }

    // Throughput at each concurrency, over a fixed window (in-flight cycles finish and count).
    let window = Duration::from_secs_f64(ctx.pick(0.6, 4.0));
    let mut rate_series: Vec<Series> = Vec::new();
    let mut loaded: Vec<Measurement> = Vec::new();
    for s in &systems {
        if matches!(s, System::GroveUserns(_)) {
            continue;
        }
        let mut pts = Vec::new();
        for c in CONCURRENCY {
            cleanup::check()?;
            progress::step(done / total, &format!("{} at concurrency {c}", s.name()));
            done += 1.0;
            let key = Key::new(RATE, format!("concurrency {c}"), "cycles/s", Better::Higher);
            let is_grove = matches!(s, System::Grove(_));
            let (rate, errors, first, lat) = throughput(s, &env, c, window);
            let lkey = Key::new(LOADED, format!("concurrency {c}"), "ms", Better::Lower);
            loaded.push(Measurement::samples(&lkey, &s.name(), is_grove, &lat));
            let m = match (rate, first) {
                (Some(r), None) => Measurement::value(&key, &s.name(), is_grove, r),
                (Some(r), Some(e)) => {
                    res.note(format!(
                        "{} at concurrency {c}: {errors} failed cycles, first: {e}",
                        s.name()
                    ));
                    Measurement::value(&key, &s.name(), is_grove, r)
                }
                (None, e) => Measurement::failed(&key, &s.name(), is_grove, e.unwrap_or_default()),
            };
            if let Some(r) = m.headline() {
                pts.push((c as f64, r));
            }
            res.push(m);
        }
        rate_series.push(Series {
            name: s.name(),
            points: pts,
        });
    }
    for m in loaded {
        res.push(m);
    }
    for k in failed_peers {
        for c in CONCURRENCY {
            let key = Key::new(RATE, format!("concurrency {c}"), "cycles/s", Better::Higher);
            let why = env.unavailable(k).unwrap_or_default();
            res.push(Measurement::failed(&key, k.name(), false, why));
        }
    }

    let n = util::sweep_cgroups(&format!("grove-bench-{}-crun", std::process::id()));
    if n > 0 {
        res.note(format!(
            "crun delete left {n} cgroup directories behind; the bench removed them"
        ));
    }
    let p = ctx.out.join("lifecycle-latency-cdf.svg");
    if plot::line_chart(
        &p,
        "create → exec true → destroy, sequential: latency CDF",
        "ms",
        "% of cycles",
        &cdf,
        false,
    )
    .is_ok()
    {
        res.plots.push("lifecycle-latency-cdf.svg".into());
    }
    let p = ctx.out.join("lifecycle-throughput.svg");
    if plot::line_chart(
        &p,
        "cycles/s against concurrent clients",
        "concurrent clients",
        "cycles/s (log)",
        &rate_series,
        true,
    )
    .is_ok()
    {
        res.plots.push("lifecycle-throughput.svg".into());
    }
    Ok(())
}

/// Each hardening layer's own step (see [`crate::hardening`]), and its p50 as a share of Grove's
/// sequential cycle p50 in this run.
fn hardening_rows(ctx: &Ctx, res: &mut ScenarioResult, seq_key: &Key) {
    let cycle_us = res
        .grove(&seq_key.metric, &seq_key.param)
        .and_then(|m| m.stat(Stat::P50))
        .map(|ms| ms * 1000.0);
    let probe = match hardening::run(ctx.pick(20, 200)) {
        Ok(p) => p,
        Err(e) => {
            for row in hardening::ROWS {
                let k = Key::new(HARDEN, row, "µs", Better::Lower);
                res.push(Measurement::failed(&k, "grove", true, format!("{e:#}")));
            }
            return;
        }
    };
    for row in hardening::ROWS {
        let k = Key::new(HARDEN, row, "µs", Better::Lower);
        let m = match probe.get(row) {
            Some(Ok(v)) => Measurement::samples(&k, "grove", true, v),
            Some(Err(why)) => Measurement::not_available(&k, "grove", why),
            None => Measurement::failed(&k, "grove", true, "the probe did not report it"),
        };
        let share = m.stat(Stat::P50).zip(cycle_us).map(|(l, c)| 100.0 * l / c);
        res.push(m);
        if let Some(pct) = share {
            let k = Key::new(HARDEN_SHARE, row, "%", Better::Lower);
            res.push(Measurement::value(&k, "grove", true, pct));
        }
    }
    res.note(
        "hardening layers: each row times the runtime's own setup function for one layer \
         (harden::lock_down, harden::drop_bounding_caps, the devices controller's apply_v1, \
         cgroup::attach_device_filter, PR_SET_DUMPABLE) in a fresh single-threaded process, one \
         forked child per sample; \"added\" rows are paired differences against the same step \
         without the layer. nodev/nosuid are flags on mounts made anyway (no step of their own).",
    );
}

/// Cycles per second with `c` clients looping until `window` ends; in-flight cycles finish and count.
/// Returns (rate, failed cycles, first error). No rate when nothing succeeded.
fn throughput(
    s: &System,
    env: &PeerEnv,
    c: usize,
    window: Duration,
) -> (Option<f64>, usize, Option<String>, Vec<f64>) {
    let lat: Mutex<Vec<f64>> = Mutex::new(Vec::new());
    let ok = AtomicUsize::new(0);
    let failed = AtomicUsize::new(0);
    let first: Mutex<Option<String>> = Mutex::new(None);
    let t = Instant::now();
    std::thread::scope(|sc| {
        for _ in 0..c {
            sc.spawn(|| {
                while t.elapsed() < window && !cleanup::cancelled() {
                    let t1 = Instant::now();
                    match s.cycle(env) {
                        Ok(()) => {
                            ok.fetch_add(1, Ordering::Relaxed);
                            lat.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push(util::ms_since(t1));
                        }
                        Err(e) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            first
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .get_or_insert(format!("{e:#}"));
                            // A failing system fails fast; don't spin.
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                }
            });
        }
    });
    let secs = t.elapsed().as_secs_f64();
    let ok = ok.load(Ordering::Relaxed);
    let first = first.into_inner().unwrap_or_else(|e| e.into_inner());
    let rate = (ok > 0).then(|| ok as f64 / secs);
    let lat = lat.into_inner().unwrap_or_else(|e| e.into_inner());
    (rate, failed.load(Ordering::Relaxed), first, lat)
}
