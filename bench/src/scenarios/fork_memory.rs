//! Part of `checkpoint`: what N branches of one snapshot cost in memory. Each branch of the
//! checkpoint workload (python3, a random heap) dirties 1 % of its heap after the fork. The
//! figure is the branches' summed PSS (a page shared by k processes counts 1/k to each, so pages
//! ksmd merged count once) ÷ one copy (the source tree's PSS), read until it holds still, with
//! the time until it got there and ksmd's CPU meanwhile; the host's MemAvailable drop ÷ one copy
//! beside it (what the issue names, but host-wide: other work on the machine moves it). Grove
//! with page merging (ksmd folds the pages the branches share, `snapshotter/src/ksm.rs`), Grove
//! without, and raw CRIU restoring N copies of its own dump.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};

use super::checkpoint::{all_answer, criu_dump, criu_restore_n, kill_all, start_raw};
use super::Ctx;
use crate::cleanup;
use crate::grove::GroveSnapshots;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::util;
use crate::workload;

pub const MEMORY: &str =
    "fork: memory of the branches, each dirtying 1 % after the fork (summed PSS ÷ one copy)";
pub const HOST_DROP: &str =
    "fork: host MemAvailable drop with the branches settled ÷ one copy (noisy: host-wide)";
pub const SETTLE: &str = "fork: time from the fork until the branches' memory is at that level";
pub const KSMD_CPU: &str = "fork: ksmd CPU until the branches' memory settled";

/// Fraction of the heap each branch dirties after the fork.
const DIRTY: f64 = 0.01;

/// The branches' memory is settled when it moved less than this fraction over [`STABLE_FOR`].
const STABLE: f64 = 0.01;
const STABLE_FOR: Duration = Duration::from_secs(3);
const MAX_WAIT: Duration = Duration::from_secs(180);

pub fn branches_param(heap: u64, n: usize) -> String {
    format!("{} MiB heap, {n} branches", heap >> 20)
}

/// One system's reading for one branch count.
struct Reading {
    /// Settled summed PSS ÷ one copy.
    ratio: f64,
    /// The host's MemAvailable drop then ÷ one copy.
    host_ratio: f64,
    /// Seconds from the fork until the PSS was within [`STABLE`] of its settled level.
    settle_s: f64,
    ksmd_cpu_s: f64,
}

pub fn run(
    ctx: &Ctx,
    res: &mut ScenarioResult,
    heap: u64,
    counts: &[usize],
    grove: Option<&GroveSnapshots>,
) {
    res.note(format!("fork memory: each of N branches dirties {:.0} % of its heap after the fork; the figure is the branches' summed PSS (/proc/<pid>/smaps_rollup; a page shared by k processes counts 1/k to each), sampled every 250 ms until it moved < {:.0} % over {} s with no ksmd boost alive (ksmd merges nothing in its first pass over new pages), ÷ one copy (the source tree's PSS). The host's MemAvailable drop at that point, ÷ the same copy, is beside it: host-wide, so other work on the machine moves it. Grove merging: branches restored mergeable, ksmd boosted until they settle.", DIRTY * 100.0, STABLE * 100.0, STABLE_FOR.as_secs()));
    for &n in counts {
        let param = branches_param(heap, n);
        match grove {
            Some(g) => {
                for merge in [true, false] {
                    let name = if merge {
                        "grove (pages merged)"
                    } else {
                        "grove (no merging)"
                    };
                    if merge && !grove_snapshotter::ksm::available() {
                        res.push(Measurement::not_available(
                            &key(MEMORY, &param, "×"),
                            name,
                            "this kernel has no KSM",
                        ));
                        continue;
                    }
                    g.set_merge_fork_pages(merge);
                    push(res, &param, name, merge, grove_reading(g, heap, n));
                }
                g.set_merge_fork_pages(true);
            }
            None => res.push(Measurement::not_available(
                &key(MEMORY, &param, "×"),
                "grove",
                "no Grove snapshotter",
            )),
        }
        push(res, &param, "raw CRIU", false, raw_reading(ctx, heap, n));
    }
}

fn push(res: &mut ScenarioResult, param: &str, system: &str, is_grove: bool, r: Result<Reading>) {
    let figures = [
        (MEMORY, "×"),
        (HOST_DROP, "×"),
        (SETTLE, "s"),
        (KSMD_CPU, "s"),
    ];
    match r {
        Ok(r) => {
            for ((m, unit), v) in
                figures
                    .into_iter()
                    .zip([r.ratio, r.host_ratio, r.settle_s, r.ksmd_cpu_s])
            {
                res.push(Measurement::value(
                    &key(m, param, unit),
                    system,
                    is_grove,
                    v,
                ));
            }
        }
        Err(e) => {
            for (m, unit) in figures {
                res.push(Measurement::failed(
                    &key(m, param, unit),
                    system,
                    is_grove,
                    format!("{e:#}"),
                ));
            }
        }
    }
}

fn key(m: &str, param: &str, unit: &str) -> Key {
    Key::new(m, param, unit, Better::Lower)
}

fn grove_reading(g: &GroveSnapshots, heap: u64, n: usize) -> Result<Reading> {
    cleanup::check()?;
    let src = g.start_workload(heap)?;
    workload::wait_ready(src.init_pid, heap, Duration::from_secs(120))?;
    let one = tree_pss_kib(&[src.init_pid]) as f64;
    let snap = g.snapshot(
        &src,
        &format!("grove-bench-{}-forkmem-{n}", std::process::id()),
    )?;
    let base = super::density::settled_mem_available()?;
    let cpu0 = ksmd_cpu_s();
    let t = Instant::now();
    let branches = g.fork_keep(&snap.id, n)?;
    let pids: Vec<i32> = branches.iter().map(|b| b.init_pid).collect();
    all_answer(&pids, heap)?;
    for &p in &pids {
        workload::touch(p, DIRTY)?;
    }
    let r = settle(&pids, base, one, t, cpu0);
    drop(branches);
    drop(src);
    let _ = g.delete(&snap.id);
    r
}

fn raw_reading(ctx: &Ctx, heap: u64, n: usize) -> Result<Reading> {
    if !ctx.criu.is_file() {
        bail!("CRIU not found at {}", ctx.criu.display());
    }
    cleanup::check()?;
    let dir = ctx.fresh_dir(&format!("criu-forkmem-{n}"))?;
    let img = dir.join("images");
    let (one, base) = {
        let w = start_raw(heap, &dir.join("state"))?;
        workload::wait_ready(w.pid, heap, Duration::from_secs(120))?;
        let one = tree_pss_kib(&[w.pid]) as f64;
        criu_dump(&ctx.criu, w.pid, &img)?;
        drop(w);
        // The copies' baseline: the source is gone, so nothing of it counts.
        (one, super::density::settled_mem_available()?)
    };
    let cpu0 = ksmd_cpu_s();
    let t = Instant::now();
    let pids = criu_restore_n(&ctx.criu, &img, n, "forkmem")?;
    let r = all_answer(&pids, heap)
        .and_then(|()| {
            pids.iter()
                .try_for_each(|&p| workload::touch(p, DIRTY).map(drop))
        })
        .and_then(|()| settle(&pids, base, one, t, cpu0));
    kill_all(&pids);
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// Samples the branches' PSS until it holds still; it and the host's MemAvailable drop from
/// `base`, each ÷ `one` copy.
fn settle(pids: &[i32], base: u64, one_kib: f64, forked: Instant, cpu0: f64) -> Result<Reading> {
    let mut samples: Vec<(Instant, f64)> = Vec::new();
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let now = Instant::now();
        samples.push((now, tree_pss_kib(pids) as f64));
        let window = samples
            .iter()
            .filter(|(t, _)| now.duration_since(*t) <= STABLE_FOR)
            .map(|(_, v)| *v);
        let (lo, hi) = window.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
        let since = now.duration_since(forked);
        // ksmd merges nothing on its first pass over new pages (it only notes their checksums),
        // which for 32 branches outlasts the window: a boost still alive means not settled.
        let merging = grove_snapshotter::ksm::boosting();
        if since >= STABLE_FOR && hi - lo <= STABLE * hi && !merging || since > MAX_WAIT {
            break;
        }
    }
    let host_drop = base as f64 - util::mem_available_kib()? as f64;
    let settled = samples
        .last()
        .map(|(_, v)| *v)
        .ok_or_else(|| anyhow!("no sample"))?;
    let reached = samples
        .iter()
        .find(|(_, v)| (v - settled).abs() <= STABLE * settled)
        .map(|(t, _)| t.duration_since(forked).as_secs_f64())
        .unwrap_or(0.0);
    Ok(Reading {
        ratio: settled / one_kib,
        host_ratio: host_drop / one_kib,
        settle_s: reached,
        ksmd_cpu_s: ksmd_cpu_s() - cpu0,
    })
}

/// Summed PSS of `roots` and their descendants (KiB).
fn tree_pss_kib(roots: &[i32]) -> u64 {
    let mut total = 0;
    let mut todo = roots.to_vec();
    while let Some(p) = todo.pop() {
        let rollup = std::fs::read_to_string(format!("/proc/{p}/smaps_rollup")).unwrap_or_default();
        total += rollup
            .lines()
            .find_map(|l| l.strip_prefix("Pss:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0);
        todo.extend(grove_sys::proc::children(p));
    }
    total
}

/// User + system CPU seconds of the ksmd kernel thread (0 where there is none).
fn ksmd_cpu_s() -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    for e in dir.flatten() {
        let p = e.path();
        if std::fs::read_to_string(p.join("comm")).is_ok_and(|c| c.trim() == "ksmd") {
            return cpu_s(&p).unwrap_or(0.0);
        }
    }
    0.0
}

fn cpu_s(proc_dir: &Path) -> Option<f64> {
    let stat = std::fs::read_to_string(proc_dir.join("stat")).ok()?;
    let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok()?? as f64;
    Some(ticks / hz)
}
