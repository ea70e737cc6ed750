//! Elasticity: warm-pool claims against cold creates, a replayed bursty trace under three pool policies
//! (none, fixed, predictive), and two jobs with shares 3:1 saturating a small node.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use grove_runtime::{
    ExecRequest, JobPolicy, JobsConfig, Limits, PoolMode, PoolSpec, PoolsConfig, Runtime,
    RuntimeConfig, SandboxSpec,
};

use super::Ctx;
use crate::cleanup;
use crate::grove::GroveRuntime;
use crate::progress;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::util;

pub const NAME: &str = "elastic";
pub const WARM: &str = "warm-pool claim → exec true";
pub const COLD: &str = "cold create → exec true";
pub const CLAIM: &str = "warm-pool claim alone (create call returns)";
pub const SEQ: &str = "sequential";
pub const HIT_RATE: &str = "bursty trace: creates served from the pool";
pub const IDLE_MEM: &str = "bursty trace: memory held idle by the pool (time average)";
pub const TRACE_LAT: &str = "bursty trace: create → exec true";
pub const FAIR_RATIO: &str = "two jobs, shares 3:1, saturated node: throughput ratio";
pub const FAIR_RATE: &str = "two jobs, shares 3:1, saturated node: throughput";
pub const FAIR_WAIT: &str =
    "two jobs, shares 3:1, saturated node: create latency (queue wait + build)";

/// Pools are keyed by size: each part of the scenario uses its own so they never share sandboxes.
/// Disk is kept small: admission reserves it, and a pool of 100 default-sized (1 GiB) sandboxes would
/// not fit the free disk of a small test machine.
fn limits(memory_mb: u64) -> Limits {
    Limits {
        memory_mb,
        disk_mb: 64,
        ..Limits::default()
    }
}

fn spec(image: &str, l: Limits) -> SandboxSpec {
    SandboxSpec {
        limits: Some(l),
        ..SandboxSpec::from_image(image)
    }
}

fn pool(image: &str, l: Limits, mode: PoolMode, min: u32, max: u32) -> PoolsConfig {
    PoolsConfig {
        pools: vec![PoolSpec {
            image: image.into(),
            limits: Some(l),
            mode,
            min,
            max,
        }],
        ..Default::default()
    }
}

fn idle(rt: &Runtime) -> u32 {
    rt.pools().iter().map(|p| p.idle).sum()
}

fn create_exec(rt: &Runtime, s: SandboxSpec) -> Result<grove_runtime::SandboxId> {
    let id = rt.create(s).map_err(|e| anyhow!("create: {e}"))?.id;
    let r = rt.exec(&id, ExecRequest::argv(["true"]));
    match r {
        Ok(r) if r.exit_code == Some(0) => Ok(id),
        other => {
            let _ = rt.destroy(&id);
            Err(anyhow!("exec true: {other:?}"))
        }
    }
}

pub fn run(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    let g = match ctx.grove.runtime() {
        Ok(g) => g,
        Err(reason) => {
            let k = Key::new(WARM, SEQ, "ms", Better::Lower);
            res.push(Measurement::not_available(&k, "grove", &reason));
            return Ok(());
        }
    };
    res.note(format!(
        "load at start: {}",
        util::sh("uptime").unwrap_or_default().trim()
    ));
    let r1 = warm_claims(ctx, &g, res);
    let _ = g.rt.set_pools(PoolsConfig::default());
    r1?;
    let r2 = bursty_trace(ctx, &g, res);
    let _ = g.rt.set_pools(PoolsConfig::default());
    r2?;
    fairness(ctx, res)?;
    res.note(format!(
        "load at end: {}",
        util::sh("uptime").unwrap_or_default().trim()
    ));
    Ok(())
}

/// Claim → exec `true` from a full pool, then the same from no pool (a cold create), sequentially.
fn warm_claims(ctx: &Ctx, g: &GroveRuntime, res: &mut ScenarioResult) -> Result<()> {
    let n = ctx.pick(10, 100);
    let l = limits(72);
    let rt = &g.rt;
    progress::step(0.0, &format!("warm claims: filling a pool of {n}"));
    rt.set_pools(pool(&g.image, l, PoolMode::Fixed, n as u32, n as u32))
        .map_err(|e| anyhow!("set_pools: {e}"))?;
    if !util::wait_until(Duration::from_secs(120), || idle(rt) >= n as u32) {
        return Err(anyhow!(
            "pool of {n} not full after 120 s: {:?}",
            rt.pools()
        ));
    }
    let mut warm = Vec::new();
    let mut claim_only = Vec::new();
    let hits0: u64 = rt.pools().iter().map(|p| p.hits).sum();
    for _ in 0..n {
        cleanup::check()?;
        // Steady state: each claim finds the pool full (the refill of the previous one is done).
        util::wait_until(Duration::from_secs(10), || idle(rt) >= n as u32);
        let t = Instant::now();
        let id = rt
            .create(spec(&g.image, l))
            .map_err(|e| anyhow!("claim: {e}"))?
            .id;
        claim_only.push(util::ms_since(t));
        let r = rt.exec(&id, ExecRequest::argv(["true"]));
        warm.push(util::ms_since(t));
        let _ = rt.destroy(&id);
        if !matches!(&r, Ok(r) if r.exit_code == Some(0)) {
            return Err(anyhow!("exec true in a claimed sandbox: {r:?}"));
        }
    }
    let hits = rt.pools().iter().map(|p| p.hits).sum::<u64>() - hits0;
    rt.set_pools(PoolsConfig::default())
        .map_err(|e| anyhow!("set_pools: {e}"))?;
    progress::step(0.15, "cold creates for comparison");
    let mut cold = Vec::new();
    for _ in 0..n {
        cleanup::check()?;
        let t = Instant::now();
        let id = create_exec(rt, spec(&g.image, l))?;
        cold.push(util::ms_since(t));
        let _ = rt.destroy(&id);
    }
    let k = Key::new(WARM, SEQ, "ms", Better::Lower);
    res.push(Measurement::samples(&k, &g.label(), true, &warm));
    let k = Key::new(CLAIM, SEQ, "ms", Better::Lower);
    res.push(Measurement::samples(&k, &g.label(), true, &claim_only));
    let k = Key::new(COLD, SEQ, "ms", Better::Lower);
    res.push(Measurement::samples(
        &k,
        &format!("{}, no pool", g.label()),
        false,
        &cold,
    ));
    res.note(format!(
        "warm claims: {hits} of {n} served from the pool; each claim waits for the pool to be full again \
         (steady state), the cold creates run with no pool"
    ));
    Ok(())
}

/// The trace: `rollouts` bursts of `burst` creates by `clients` threads, each sandbox running `true` and
/// living `hold`, with `gap` of quiet between bursts.
struct Trace {
    rollouts: usize,
    burst: usize,
    clients: usize,
    hold: Duration,
    gap: Duration,
}

struct Replay {
    hit_rate: f64,
    idle_mib: f64,
    latencies: Vec<f64>,
    failures: usize,
}

fn bursty_trace(ctx: &Ctx, g: &GroveRuntime, res: &mut ScenarioResult) -> Result<()> {
    let trace = Trace {
        rollouts: ctx.pick(3, 8),
        burst: ctx.pick(8, 24),
        clients: ctx.pick(8, 24),
        hold: Duration::from_millis(ctx.pick(200, 500)),
        gap: Duration::from_millis(ctx.pick(2500, 5000)),
    };
    let l = limits(80);
    let fixed = (trace.burst / 2) as u32;
    let policies: [(String, bool, PoolsConfig); 3] = [
        ("no pool".into(), false, PoolsConfig::default()),
        (
            format!("fixed pool of {fixed}"),
            false,
            pool(&g.image, l, PoolMode::Fixed, fixed, fixed),
        ),
        (
            "predictive pool".into(),
            true,
            pool(
                &g.image,
                l,
                PoolMode::Predictive,
                0,
                (trace.burst * 2) as u32,
            ),
        ),
    ];
    res.note(format!(
        "bursty trace: {} rollouts, each a burst of {} creates by {} clients (create → exec true → live {} ms → \
         destroy), {} ms quiet between bursts; predictive pool: min 0, max {}, window 1 s, half-life 60 s, headroom 1.25",
        trace.rollouts,
        trace.burst,
        trace.clients,
        trace.hold.as_millis(),
        trace.gap.as_millis(),
        trace.burst * 2
    ));
    for (i, (name, is_grove, cfg)) in policies.into_iter().enumerate() {
        cleanup::check()?;
        progress::step(0.2 + 0.15 * i as f64, &format!("bursty trace, {name}"));
        g.rt.set_pools(cfg).map_err(|e| anyhow!("set_pools: {e}"))?;
        if name.starts_with("fixed") {
            util::wait_until(Duration::from_secs(60), || idle(&g.rt) >= fixed);
        }
        let r = replay(&g.rt, &g.image, l, &trace);
        g.rt.set_pools(PoolsConfig::default())
            .map_err(|e| anyhow!("set_pools: {e}"))?;
        let r = r?;
        if r.failures > 0 {
            res.note(format!(
                "bursty trace, {name}: {} creates failed",
                r.failures
            ));
        }
        let k = Key::new(HIT_RATE, "", "%", Better::Higher);
        res.push(Measurement::value(&k, &name, is_grove, r.hit_rate));
        let k = Key::new(IDLE_MEM, "", "MiB", Better::Lower);
        res.push(Measurement::value(&k, &name, is_grove, r.idle_mib));
        let k = Key::new(TRACE_LAT, "", "ms", Better::Lower);
        res.push(Measurement::samples(&k, &name, is_grove, &r.latencies));
    }
    Ok(())
}

fn replay(rt: &Arc<Runtime>, image: &str, l: Limits, t: &Trace) -> Result<Replay> {
    let stats = |rt: &Runtime| {
        rt.pools()
            .iter()
            .filter(|p| p.limits == l)
            .fold((0, 0), |(h, m), p| (h + p.hits, m + p.misses))
    };
    let (h0, m0) = stats(rt);
    let done = AtomicBool::new(false);
    let mem_samples: Mutex<Vec<f64>> = Mutex::new(Vec::new());
    let latencies: Mutex<Vec<f64>> = Mutex::new(Vec::new());
    let failures = AtomicU64::new(0);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            // Memory the pool holds idle, sampled every 100 ms over the whole replay.
            while !done.load(Ordering::Relaxed) {
                let b: u64 = rt.pools().iter().map(|p| p.idle_memory_bytes).sum();
                mem_samples
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(b as f64 / 1048576.0);
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        for _ in 0..t.rollouts {
            if cleanup::cancelled() {
                break;
            }
            let left = AtomicU64::new(t.burst as u64);
            std::thread::scope(|burst| {
                for _ in 0..t.clients {
                    burst.spawn(|| {
                        while left
                            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                            .is_ok()
                        {
                            let t0 = Instant::now();
                            match create_exec(rt, spec(image, l)) {
                                Ok(id) => {
                                    latencies
                                        .lock()
                                        .unwrap_or_else(|e| e.into_inner())
                                        .push(util::ms_since(t0));
                                    std::thread::sleep(t.hold);
                                    let _ = rt.destroy(&id);
                                }
                                Err(_) => {
                                    failures.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                    });
                }
            });
            std::thread::sleep(t.gap);
        }
        done.store(true, Ordering::Relaxed);
    });
    let (h1, m1) = stats(rt);
    let (hits, misses) = (h1 - h0, m1 - m0);
    let mem = mem_samples.into_inner().unwrap_or_else(|e| e.into_inner());
    Ok(Replay {
        hit_rate: if hits + misses == 0 {
            0.0
        } else {
            100.0 * hits as f64 / (hits + misses) as f64
        },
        idle_mib: mem.iter().sum::<f64>() / mem.len().max(1) as f64,
        latencies: latencies.into_inner().unwrap_or_else(|e| e.into_inner()),
        failures: failures.load(Ordering::Relaxed) as usize,
    })
}

/// A node of `SLOTS` sandboxes shared by two jobs, shares 3:1, each with more clients than slots looping
/// create → exec true → live → destroy: throughput per job and the latency of their creates.
fn fairness(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    const SLOTS: u64 = 6;
    const CLIENTS: usize = 6;
    let window = Duration::from_secs(ctx.pick(6, 30));
    let hold = Duration::from_millis(150);
    progress::step(0.7, "two jobs 3:1 on a node of 6 slots");
    let rt = small_node(ctx, SLOTS)?;
    let result = (|| -> Result<()> {
        let policy = |share| JobPolicy {
            share,
            ..Default::default()
        };
        rt.set_jobs(JobsConfig {
            queue_timeout_ms: 60_000,
            jobs: [
                ("big".to_string(), policy(3)),
                ("small".to_string(), policy(1)),
            ]
            .into(),
            ..Default::default()
        })
        .map_err(|e| anyhow!("set_jobs: {e}"))?;
        let image = ctx
            .image
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("debian12")
            .to_string();
        let t0 = Instant::now();
        let stop = AtomicBool::new(false);
        let per_job: Mutex<Vec<(String, u64, Vec<f64>)>> = Mutex::new(Vec::new());
        std::thread::scope(|sc| {
            for job in ["big", "small"] {
                for _ in 0..CLIENTS {
                    let (rt, image, stop, per_job) = (&rt, &image, &stop, &per_job);
                    sc.spawn(move || {
                        let mut done = 0u64;
                        let mut lat = Vec::new();
                        while !stop.load(Ordering::Relaxed) && !cleanup::cancelled() {
                            let s = SandboxSpec {
                                job: Some(job.into()),
                                ..spec(image, limits(64))
                            };
                            let t = Instant::now();
                            let Ok(id) = create_exec(rt, s) else {
                                std::thread::sleep(Duration::from_millis(20));
                                continue;
                            };
                            let admitted_in_window = t0.elapsed() < window;
                            lat.push(util::ms_since(t));
                            std::thread::sleep(hold);
                            let _ = rt.destroy(&id);
                            if admitted_in_window {
                                done += 1;
                            }
                        }
                        per_job.lock().unwrap_or_else(|e| e.into_inner()).push((
                            job.to_string(),
                            done,
                            lat,
                        ));
                    });
                }
            }
            std::thread::sleep(window);
            stop.store(true, Ordering::Relaxed);
        });
        let secs = window.as_secs_f64();
        let rows = per_job.into_inner().unwrap_or_else(|e| e.into_inner());
        let mut rate = [0.0f64; 2];
        for (i, job) in ["big", "small"].iter().enumerate() {
            let done: u64 = rows.iter().filter(|r| r.0 == *job).map(|r| r.1).sum();
            let lat: Vec<f64> = rows
                .iter()
                .filter(|r| r.0 == *job)
                .flat_map(|r| r.2.iter().copied())
                .collect();
            rate[i] = done as f64 / secs;
            let name = format!("job {job} (share {})", if i == 0 { 3 } else { 1 });
            let k = Key::new(FAIR_RATE, "", "cycles/s", Better::Higher);
            res.push(Measurement::value(&k, &name, i == 0, rate[i]));
            let k = Key::new(FAIR_WAIT, "", "ms", Better::Lower);
            res.push(Measurement::samples(&k, &name, i == 1, &lat));
        }
        let k = Key::new(FAIR_RATIO, "", "×", Better::Higher);
        if rate[1] > 0.0 {
            res.push(Measurement::value(&k, "grove", true, rate[0] / rate[1]));
        } else {
            res.push(Measurement::failed(
                &k,
                "grove",
                true,
                "the small job completed nothing",
            ));
        }
        let st = rt.jobs();
        for j in st.iter().filter(|j| j.job == "big" || j.job == "small") {
            res.note(format!(
                "job {}: admitted {}, {} of them queued first, longest wait {} ms, mean wait {:.0} ms, timed out {}",
                j.job,
                j.admitted,
                j.waited,
                j.wait_ms_max,
                j.wait_ms_total as f64 / j.waited.max(1) as f64,
                j.timed_out
            ));
        }
        res.note(format!(
            "fairness: a node of {SLOTS} sandbox slots, {CLIENTS} clients per job looping create → exec true → \
             live {} ms → destroy for {} s; throughput counts cycles admitted in the window",
            hold.as_millis(),
            window.as_secs()
        ));
        Ok(())
    })();
    rt.shutdown();
    result
}

/// A second, small runtime (own cgroups and run dir) over kernel overlayfs roots of the base image.
fn small_node(ctx: &Ctx, slots: u64) -> Result<Arc<Runtime>> {
    let name = ctx
        .image
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| anyhow!("image dir has no name"))?;
    let roots = crate::grove::overlay_roots(&ctx.image, name)?;
    let mut cfg = RuntimeConfig::default_paths();
    if let Some(p) = std::env::var_os("GROVE_INIT_BINARY") {
        cfg.init_binary = p.into();
    }
    let pid = std::process::id();
    cfg.state_dir = ctx.work.join("elastic-state");
    std::fs::create_dir_all(&cfg.state_dir)?;
    cfg.run_dir = format!("/run/grove-bench-{pid}-fair").into();
    cfg.cgroup_root = format!("grove-bench-{pid}-fair");
    cfg.net_pool = "10.218.0.0/16".into();
    cfg.capacity.sandboxes = Some(slots);
    cfg.capacity.memory_mb = Some(64 * 1024);
    cfg.capacity.cpu_millis = Some(10_000_000);
    Runtime::new(cfg, roots).map_err(|e| anyhow!("Runtime::new for the small node: {e}"))
}
