//! Grove's rounds of the checkpoint scenario: snapshots of a running workload, the bytes each
//! adds against the fraction of the heap dirtied, a pause to the store and resume, and forks of
//! the last snapshot.

use std::time::Duration;

use anyhow::{anyhow, Result};

use super::{mib, Dirtied, Figures, Params, DIRTY, TOUCH};
use crate::cleanup;
use crate::scenarios::Ctx;
use crate::workload;

pub(super) fn grove_rounds(ctx: &Ctx, p: &Params, s: &crate::grove::GroveSnapshots) -> Figures {
    let mut f = Figures::default();
    if let Err(e) = grove_inner(ctx, p, s, &mut f) {
        f.error = Some(format!("{e:#}"));
    }
    f
}

fn grove_inner(
    _ctx: &Ctx,
    p: &Params,
    s: &crate::grove::GroveSnapshots,
    f: &mut Figures,
) -> Result<()> {
    let mut last_snap = None;
    for round in 0..p.rounds {
        cleanup::check()?;
        let sb = s.start_workload(p.heap)?;
        let pid = sb.init_pid;
        workload::wait_ready(pid, p.heap, Duration::from_secs(120))?;
        let tag = std::process::id();
        let a = s.snapshot(&sb, &format!("grove-bench-{tag}-r{round}-a"))?;
        let pages = workload::touch(pid, TOUCH)?;
        let b = s.snapshot(&sb, &format!("grove-bench-{tag}-r{round}-b"))?;
        f.first_ms.push(a.wall_ms);
        f.second_ms.push(b.wall_ms);
        f.frozen_ms.push(a.frozen_ms);
        f.second_frozen_ms.push(b.frozen_ms);
        f.durable_ms.push(a.durable_ms);
        f.first_mib.push(mib(a.bytes_added));
        f.second_mib.push(mib(b.bytes_added));
        f.ratio.push(b.bytes_added as f64 / (pages * 4096) as f64);
        last_snap = Some(b.id);
    }
    // Bytes against the dirtied fraction, on a fresh workload; then pause it to the store and
    // resume it.
    {
        let mut sb = s.start_workload(p.heap)?;
        workload::wait_ready(sb.init_pid, p.heap, Duration::from_secs(120))?;
        let tag = std::process::id();
        s.snapshot(&sb, &format!("grove-bench-{tag}-sweep-base"))?;
        for (i, frac) in DIRTY.iter().enumerate() {
            cleanup::check()?;
            let pages = workload::touch(sb.init_pid, *frac)?;
            let x = s.snapshot(&sb, &format!("grove-bench-{tag}-sweep-{i}"))?;
            f.dirty.push(Dirtied {
                frac: *frac,
                pages,
                bytes: x.bytes_added,
                wall_ms: x.wall_ms,
                frozen_ms: Some(x.frozen_ms),
            });
        }
        cleanup::check()?;
        f.pause = Some(s.pause_resume(&mut sb, p.heap)?);
    }
    let snap = last_snap.ok_or_else(|| anyhow!("no snapshot"))?;
    for &n in &p.branches {
        let mut v = Vec::new();
        for _ in 0..p.fork_reps {
            cleanup::check()?;
            v.push(s.fork_and_answer(&snap, n, p.heap)?);
        }
        f.fork_ms.push((n, v));
    }
    Ok(())
}
