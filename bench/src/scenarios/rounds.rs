//! Repeated snapshot → fork 4 → destroy on one running workload: does anything grow round over round?
//! Each round touches 5 % of the heap, snapshots, forks 4 branches and waits until each answers,
//! destroys them and deletes the previous round's snapshot. Reported: per-round latency in the first and
//! last tenth of the rounds and their ratio, store bytes each round added (÷ the bytes touched), scratch
//! files and Grove residue at the end.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

use super::Ctx;
use crate::cleanup;
use crate::progress;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::workload;

pub const NAME: &str = "rounds";
pub const ROUND: &str = "snapshot → fork 4 → destroy, per round";
pub const GROWTH: &str = "per-round latency, last tenth ÷ first tenth of the rounds (p50s)";
pub const STORE: &str = "store bytes added per round ÷ bytes touched";
pub const RESIDUE: &str = "residue after the rounds (Grove items + scratch files)";

const TOUCH: f64 = 0.05;
const BRANCHES: usize = 4;

/// "100 rounds": figures depend on the count, so a quick run never matches a full-size promise.
pub fn rounds_param(rounds: usize) -> String {
    format!("{rounds} rounds")
}

pub fn run(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    let rounds = ctx.pick(3usize, 100);
    let heap = ctx.pick(32u64 << 20, 64u64 << 20);
    res.note(format!(
        "{rounds} rounds on one python3 workload with {} MiB of random heap, after one base snapshot: touch 5 % → snapshot → fork {BRANCHES} (all answering) → destroy the branches → delete the previous snapshot",
        heap >> 20
    ));
    let rp = rounds_param(rounds);
    let (first_p, last_p) = (format!("{rp}, first tenth"), format!("{rp}, last tenth"));
    let k = |m: &str, p: &str, u: &str| Key::new(m, p, u, Better::Lower);
    let keys = [
        k(ROUND, &first_p, "ms"),
        k(ROUND, &last_p, "ms"),
        k(GROWTH, &rp, "×"),
        k(STORE, &first_p, "×"),
        k(STORE, &last_p, "×"),
        k(RESIDUE, &rp, "items"),
    ];
    let s = match ctx.grove.snapshotter() {
        Ok(s) => s,
        Err(reason) => {
            for key in &keys {
                res.push(Measurement::not_available(key, "grove", &reason));
            }
            return Ok(());
        }
    };
    let name = s.label();
    let baseline = s.runtime_residue();
    let mut round_ms = Vec::with_capacity(rounds);
    let mut added = Vec::with_capacity(rounds);
    let sb = s.start_workload(heap)?;
    workload::wait_ready(sb.init_pid, heap, Duration::from_secs(120))?;
    let store = s.store.clone().ok_or_else(|| anyhow!("no nodefs store"))?;
    let tag = std::process::id();
    // The first snapshot stores the whole heap; the rounds measure what each adds after it.
    let mut prev = Some(
        s.snapshot(&sb, &format!("grove-bench-{tag}-round-base"))?
            .id,
    );
    for r in 0..rounds {
        cleanup::check()?;
        progress::step(
            r as f64 / rounds as f64,
            &format!("round {}/{rounds}", r + 1),
        );
        let pages = workload::touch(sb.init_pid, TOUCH)?;
        let before = store.stored_bytes();
        let t = Instant::now();
        let snap = s.snapshot(&sb, &format!("grove-bench-{tag}-round-{r}"))?;
        s.fork_and_answer(&snap.id, BRANCHES, heap)?;
        // The round ends once its snapshot is stored: its bytes then count in this round.
        s.wait_durable(&snap.id)?;
        round_ms.push(t.elapsed().as_secs_f64() * 1e3);
        added.push(store.stored_bytes().saturating_sub(before) as f64 / (pages * 4096) as f64);
        if let Some(old) = prev.replace(snap.id) {
            s.delete(&old)?;
        }
    }
    if let Some(last) = prev {
        s.delete(&last)?;
    }
    drop(sb);
    let tenth = (rounds / 10).max(1);
    let (first, last) = (&round_ms[..tenth], &round_ms[rounds - tenth..]);
    res.push(Measurement::samples(&keys[0], &name, true, first));
    res.push(Measurement::samples(&keys[1], &name, true, last));
    if let (Some(a), Some(b)) = (crate::stats::median(first), crate::stats::median(last)) {
        res.push(Measurement::value(&keys[2], &name, true, b / a));
    }
    res.push(Measurement::samples(&keys[3], &name, true, &added[..tenth]));
    res.push(Measurement::samples(
        &keys[4],
        &name,
        true,
        &added[rounds - tenth..],
    ));
    // The rounds' own items only: re-checked for ~2 s, other instances' short-lived setups fade.
    // So do scratch files: the workload's dirty-page tracking base goes when the snapshotter
    // sees its Destroyed event, a moment after the destroy returns.
    let mut items: Vec<String> = s
        .runtime_residue()
        .into_iter()
        .filter(|i| !baseline.contains(i))
        .collect();
    let mut scratch = scratch_files(&s);
    for _ in 0..20 {
        if items.is_empty() && scratch.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        let now = s.runtime_residue();
        items.retain(|i| now.contains(i));
        scratch = scratch_files(&s);
    }
    let left = (items.len() + scratch.len()) as f64;
    res.push(Measurement::value(&keys[5], &name, true, left));
    for i in items.iter().chain(&scratch).take(10) {
        res.note(format!("left after the rounds: {i}"));
    }
    Ok(())
}

/// Files left in the snapshotter's scratch (dumps in progress, materialized images): none once every
/// snapshot is deleted.
fn scratch_files(s: &crate::grove::GroveSnapshots) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![s.scratch_dir()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(p);
            } else {
                out.push(format!("scratch file {}", p.display()));
            }
        }
    }
    out
}
