//! Checkpoint, restore and fork of python3 with a 256 MiB random heap, an open file and an HTTP server:
//! Grove snapshot/fork vs raw CRIU dump/restore and podman container checkpoint/restore (runc + CRIU 4.1).
//! Each round: fresh workload → first checkpoint → touch 5 % of the heap → second checkpoint; then restore
//! N copies concurrently and time until every copy answers.
//!
//! This file holds the scenario (its keys, what each system's figures become, the plots) and
//! what every peer shares; each peer's rounds are in a file of their own: `grove` (snapshot,
//! fork, pause to the store), `raw_criu` (dump and restore of a workload in its own
//! namespaces, also used by `fork_memory`) and `podman` (container checkpoint and restore,
//! runc).

mod grove;
mod podman;
mod raw_criu;

use std::time::Duration;

use anyhow::{anyhow, Result};

use super::Ctx;
use crate::plot::{self, Series};
use crate::progress;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::workload;

use grove::grove_rounds;
use podman::podman_rounds;
use raw_criu::raw_criu_rounds;
pub(super) use raw_criu::{criu_dump, criu_restore_n, kill_all, start_raw};

pub const NAME: &str = "checkpoint";
pub const SNAPSHOT: &str = "checkpoint (snapshot) time";
pub const BYTES: &str = "bytes written (Grove: added to the store)";
pub const FIRST: &str = "first";
pub const SECOND: &str = "second, after touching 5 % of the heap";
pub const SECOND_RATIO: &str = "second checkpoint: bytes added ÷ bytes touched";
pub const FORK: &str = "restore / fork: all copies running and answering";
pub const PAUSE: &str = "idle pause to the store and resume (Grove)";

const TOUCH: f64 = 0.05;
/// Fractions of heap pages dirtied before each checkpoint of the sweep.
const DIRTY: [f64; 3] = [0.01, 0.05, 0.25];
pub const DIRTY_BYTES: &str =
    "checkpoint bytes against the fraction of heap pages dirtied since the last";
pub const DIRTY_WALL: &str =
    "checkpoint wall time against the fraction of heap pages dirtied since the last";
pub const DIRTY_FROZEN: &str =
    "time frozen in a checkpoint against the fraction of heap pages dirtied since the last (Grove)";
pub const DIRTY_RATIO: &str =
    "checkpoint bytes added ÷ bytes dirtied, against the fraction of heap pages dirtied (Grove: store bytes)";
pub const SECOND_FROZEN: &str =
    "time frozen in the second checkpoint, after touching 5 % of the heap (Grove)";

/// One checkpoint of the dirtied-fraction sweep.
#[derive(Debug, Clone, Copy, Default)]
struct Dirtied {
    /// Fraction of heap pages dirtied since the previous checkpoint.
    frac: f64,
    /// Pages the workload dirtied.
    pages: u64,
    /// Bytes the checkpoint wrote (Grove: added to the store).
    bytes: u64,
    wall_ms: f64,
    /// Grove only: how long the sandbox was frozen.
    frozen_ms: Option<f64>,
}

struct Params {
    heap: u64,
    rounds: usize,
    branches: Vec<usize>,
    fork_reps: usize,
}

/// What each system records.
#[derive(Default)]
struct Figures {
    first_ms: Vec<f64>,
    second_ms: Vec<f64>,
    first_mib: Vec<f64>,
    second_mib: Vec<f64>,
    ratio: Vec<f64>,
    /// Grove: how long the sandbox was frozen (freeze → dump → commit → thaw) in each first snapshot.
    frozen_ms: Vec<f64>,
    /// Grove: from each first snapshot call until its images were in the store.
    durable_ms: Vec<f64>,
    fork_ms: Vec<(usize, Vec<f64>)>,
    /// Grove: how long the sandbox was frozen in each second snapshot.
    second_frozen_ms: Vec<f64>,
    /// The dirtied-fraction sweep.
    dirty: Vec<Dirtied>,
    /// Grove: pause to the store → resume until answering.
    pause: Option<crate::grove::PauseFigures>,
    error: Option<String>,
}

pub fn run(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    let p = Params {
        heap: ctx.pick(32u64 << 20, 256u64 << 20),
        rounds: ctx.pick(1, 3),
        branches: ctx.pick(vec![1, 2], vec![1, 2, 4, 8, 16]),
        fork_reps: ctx.pick(1, 3),
    };
    res.note(format!(
        "workload: python3 with {} MiB of random bytes on its heap, an open file and an HTTP server on an abstract unix socket in its network namespace ({} rounds; fork reps {})",
        p.heap >> 20,
        p.rounds,
        p.fork_reps
    ));
    res.note("TCP listeners cannot be dumped by CRIU 4.1.1 on this kernel (SO_PASSCRED/SO_PASSSEC getsockopt → EOPNOTSUPP on TCP sockets since Linux 6.16), so the server listens on an abstract unix socket: per-netns like loopback, dumped by every system alike.");
    res.note("raw CRIU and podman write full images every time (no soft-dirty tracking on this kernel), so their second checkpoint's bytes are a full dump.");
    let mut series = Vec::new();
    let mut dseries = Vec::new();

    // Grove.
    let grove_name;
    let snapshots = ctx.grove.snapshotter();
    let g = match &snapshots {
        Ok(s) => {
            grove_name = s.label();
            progress::step(0.0, "grove snapshot / fork");
            grove_rounds(ctx, &p, s)
        }
        Err(reason) => {
            grove_name = "grove".to_string();
            for (m, param, unit) in keys(&p) {
                res.push(Measurement::not_available(
                    &Key::new(m, param, &unit, Better::Lower),
                    "grove",
                    reason,
                ));
            }
            Figures {
                error: Some(String::new()),
                ..Default::default()
            }
        }
    };
    push_figures(res, &p, &grove_name, true, &g, &mut series, &mut dseries);

    progress::step(0.35, "raw CRIU dump / restore");
    let raw = raw_criu_rounds(ctx, &p);
    push_figures(res, &p, "raw CRIU", false, &raw, &mut series, &mut dseries);

    progress::step(0.65, "podman checkpoint / restore (runc)");
    let pod = podman_rounds(ctx, &p);
    push_figures(
        res,
        &p,
        "podman (runc)",
        false,
        &pod,
        &mut series,
        &mut dseries,
    );

    progress::step(
        0.8,
        "fork memory: grove with and without page merging, raw CRIU",
    );
    let counts = ctx.pick(vec![4], vec![8, 32]);
    super::fork_memory::run(ctx, res, p.heap, &counts, snapshots.as_ref().ok());

    if let Ok(s) = &snapshots {
        progress::step(
            0.9,
            "userns cost: grove snapshot / fork with and without a user namespace",
        );
        super::userns_checkpoint::run(res, s, p.heap, ctx.pick(1, 5), ctx.pick(2, 8));
    }

    let path = ctx.out.join("checkpoint-bytes-vs-dirtied.svg");
    let title = "checkpoint bytes against the fraction of the heap dirtied";
    if plot::line_chart(
        &path,
        title,
        "% of heap pages dirtied",
        "MiB written / added",
        &dseries,
        false,
    )
    .is_ok()
    {
        res.plots.push("checkpoint-bytes-vs-dirtied.svg".into());
    }
    let path = ctx.out.join("fork-time.svg");
    if plot::line_chart(
        &path,
        "time until all copies run and answer",
        "copies (branches)",
        "ms",
        &series,
        false,
    )
    .is_ok()
    {
        res.plots.push("fork-time.svg".into());
    }
    Ok(())
}

/// "256 MiB heap": figures depend on the heap, so quick runs never match the full run's promises.
pub fn heap_param(heap: u64) -> String {
    format!("{} MiB heap", heap >> 20)
}

fn par(p: &Params, what: &str) -> String {
    format!("{}, {what}", heap_param(p.heap))
}

fn keys(p: &Params) -> Vec<(&'static str, String, String)> {
    let mut v = vec![
        (SNAPSHOT, par(p, FIRST), "ms".to_string()),
        (SNAPSHOT, par(p, SECOND), "ms".to_string()),
        (BYTES, par(p, FIRST), "MiB".to_string()),
        (BYTES, par(p, SECOND), "MiB".to_string()),
        (SECOND_RATIO, heap_param(p.heap), "×".to_string()),
    ];
    for b in &p.branches {
        v.push((FORK, par(p, &format!("{b} branches")), "ms".to_string()));
    }
    v
}

fn push_figures(
    res: &mut ScenarioResult,
    p: &Params,
    name: &str,
    is_grove: bool,
    f: &Figures,
    series: &mut Vec<Series>,
    dirty_series: &mut Vec<Series>,
) {
    if !f.dirty.is_empty() {
        let pts = f
            .dirty
            .iter()
            .map(|d| (d.frac * 100.0, mib(d.bytes)))
            .collect();
        dirty_series.push(Series {
            name: name.into(),
            points: pts,
        });
    }
    if let Some(e) = &f.error {
        if e.is_empty() {
            return; // not available, already reported
        }
        if f.first_ms.is_empty() {
            for (m, param, unit) in keys(p) {
                res.push(Measurement::failed(
                    &Key::new(m, param, &unit, Better::Lower),
                    name,
                    is_grove,
                    e.clone(),
                ));
            }
            return;
        }
        res.note(format!("{name} stopped part-way: {e}"));
    }
    let k = |m: &str, param: &str, unit: &str| Key::new(m, param, unit, Better::Lower);
    res.push(Measurement::samples(
        &k(SNAPSHOT, &par(p, FIRST), "ms"),
        name,
        is_grove,
        &f.first_ms,
    ));
    res.push(Measurement::samples(
        &k(SNAPSHOT, &par(p, SECOND), "ms"),
        name,
        is_grove,
        &f.second_ms,
    ));
    res.push(Measurement::samples(
        &k(BYTES, &par(p, FIRST), "MiB"),
        name,
        is_grove,
        &f.first_mib,
    ));
    res.push(Measurement::samples(
        &k(BYTES, &par(p, SECOND), "MiB"),
        name,
        is_grove,
        &f.second_mib,
    ));
    res.push(Measurement::samples(
        &k(SECOND_RATIO, &heap_param(p.heap), "×"),
        name,
        is_grove,
        &f.ratio,
    ));
    if let Some(pf) = &f.pause {
        let pk =
            |what: &str, unit: &str| k(PAUSE, &format!("{}, {what}", heap_param(p.heap)), unit);
        res.push(Measurement::value(
            &pk("pause", "ms"),
            name,
            is_grove,
            pf.pause_ms,
        ));
        res.push(Measurement::value(
            &pk("resume until answering", "ms"),
            name,
            is_grove,
            pf.resume_ms,
        ));
        res.push(Measurement::value(
            &pk("memory charged before (0 while paused)", "MiB"),
            name,
            is_grove,
            mib(pf.charged_bytes),
        ));
        res.note(format!(
            "{name}: pause to the store freed its memory cgroup ({:.0} MiB charged before, cgroup gone while paused; MemAvailable rose {:.0} MiB, noisy on a shared machine); resume brought the workload back answering from its state",
            mib(pf.charged_bytes),
            mib(pf.freed_bytes)
        ));
    }
    if let Some(fz) = crate::stats::summarize(&f.frozen_ms) {
        res.note(format!("{name}: the sandbox was frozen {:.0} ms (median) of each first snapshot's wall time; the call returns once the snapshot is recorded and forkable", fz.p50));
    }
    if let Some(d) = crate::stats::summarize(&f.durable_ms) {
        res.note(format!("{name}: each first snapshot's images were in the content store (durable) {:.0} ms (median, p99 {:.0}) after the call began; they are stored in the background", d.p50, d.p99));
    }
    if !f.second_frozen_ms.is_empty() {
        res.push(Measurement::samples(
            &k(SECOND_FROZEN, &heap_param(p.heap), "ms"),
            name,
            is_grove,
            &f.second_frozen_ms,
        ));
    }
    for d in &f.dirty {
        let param = format!("{}, {:.0} % dirtied", heap_param(p.heap), d.frac * 100.0);
        res.push(Measurement::value(
            &k(DIRTY_BYTES, &param, "MiB"),
            name,
            is_grove,
            mib(d.bytes),
        ));
        res.push(Measurement::value(
            &k(DIRTY_WALL, &param, "ms"),
            name,
            is_grove,
            d.wall_ms,
        ));
        if let Some(fz) = d.frozen_ms {
            res.push(Measurement::value(
                &k(DIRTY_FROZEN, &param, "ms"),
                name,
                is_grove,
                fz,
            ));
        }
        if d.pages > 0 {
            res.push(Measurement::value(
                &k(DIRTY_RATIO, &param, "×"),
                name,
                is_grove,
                d.bytes as f64 / (d.pages * 4096) as f64,
            ));
        }
    }
    let mut pts = Vec::new();
    for b in &p.branches {
        let key = k(FORK, &par(p, &format!("{b} branches")), "ms");
        match f.fork_ms.iter().find(|(n, _)| n == b) {
            Some((_, s)) if !s.is_empty() => {
                if let Some(m) = crate::stats::median(s) {
                    pts.push((*b as f64, m));
                }
                res.push(Measurement::samples(&key, name, is_grove, s));
            }
            _ => res.push(Measurement::failed(
                &key,
                name,
                is_grove,
                f.error.clone().unwrap_or_else(|| "not run".into()),
            )),
        }
    }
    series.push(Series {
        name: name.into(),
        points: pts,
    });
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// Every copy answers (concurrently).
pub fn all_answer(pids: &[i32], heap: u64) -> Result<()> {
    let rs: Vec<Result<()>> = std::thread::scope(|s| {
        let hs: Vec<_> = pids
            .iter()
            .map(|&p| s.spawn(move || workload::wait_ready(p, heap, Duration::from_secs(60))))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("panicked"))))
            .collect()
    });
    rs.into_iter().collect()
}
