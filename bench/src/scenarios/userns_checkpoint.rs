//! What a user namespace costs a checkpoint: the same workload snapshotted and forked with and
//! without `userns`, side by side in one run. A userns sandbox's network namespace is dumped and
//! restored in full, its branches restore without lazy pages, and each branch's images get a
//! rewritten id map (docs/security.md); issue 24 turns userns on by default only if these and the
//! lifecycle figures stay within 10 % of the plain sandbox's.

use std::time::Duration;

use anyhow::Result;

use crate::grove::GroveSnapshots;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::{cleanup, workload};

const SNAPSHOT_FROZEN: &str = "userns cost: first snapshot, frozen";
const SNAPSHOT_WALL: &str = "userns cost: first snapshot, until forkable";
const FORK: &str = "userns cost: fork, all answering";

/// The two systems: plain Grove sandboxes, and the same in user namespaces.
const SYSTEMS: [(&str, bool); 2] = [("grove", false), ("grove userns", true)];

#[derive(Default)]
struct Figures {
    frozen_ms: Vec<f64>,
    wall_ms: Vec<f64>,
    fork_ms: Vec<f64>,
}

/// `reps` rounds per system of: start the workload, snapshot it, fork `branches` branches and
/// wait until each answers. Rounds alternate between the systems, so drift hits both alike.
pub(super) fn run(
    res: &mut ScenarioResult,
    s: &GroveSnapshots,
    heap: u64,
    reps: usize,
    branches: usize,
) {
    let mut figs: [Figures; 2] = Default::default();
    let mut error = None;
    'rounds: for rep in 0..reps {
        for (i, (_, userns)) in SYSTEMS.iter().enumerate() {
            if let Err(e) = round(s, heap, branches, *userns, rep, &mut figs[i]) {
                error = Some(format!("{}: {e:#}", SYSTEMS[i].0));
                break 'rounds;
            }
        }
    }
    let param = format!("{} MiB heap, {branches} branches", heap >> 20);
    for (i, (name, _)) in SYSTEMS.iter().enumerate() {
        let f = &figs[i];
        for (metric, samples) in [
            (SNAPSHOT_FROZEN, &f.frozen_ms),
            (SNAPSHOT_WALL, &f.wall_ms),
            (FORK, &f.fork_ms),
        ] {
            let key = Key::new(metric, param.clone(), "ms", Better::Lower);
            res.push(match (&error, samples.is_empty()) {
                (Some(e), true) => Measurement::failed(&key, name, true, e.clone()),
                _ => Measurement::samples(&key, name, true, samples),
            });
        }
    }
    if let Some(e) = error {
        res.note(format!("userns cost stopped part-way: {e}"));
    }
    let p50 = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let ratio = |a: &[f64], b: &[f64]| match (p50(a), p50(b)) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "n/a".into(),
    };
    let [plain, userns] = &figs;
    res.note(format!(
        "userns ÷ plain, p50 ({reps} rounds each, alternating): snapshot frozen {}, until forkable {}, fork of {branches} {}",
        ratio(&userns.frozen_ms, &plain.frozen_ms),
        ratio(&userns.wall_ms, &plain.wall_ms),
        ratio(&userns.fork_ms, &plain.fork_ms),
    ));
}

fn round(
    s: &GroveSnapshots,
    heap: u64,
    branches: usize,
    userns: bool,
    rep: usize,
    f: &mut Figures,
) -> Result<()> {
    cleanup::check()?;
    let sb = s.start_workload_as(heap, userns)?;
    workload::wait_ready(sb.init_pid, heap, Duration::from_secs(120))?;
    let name = format!("grove-bench-{}-userns-{userns}-{rep}", std::process::id());
    let snap = s.snapshot(&sb, &name)?;
    f.frozen_ms.push(snap.frozen_ms);
    f.wall_ms.push(snap.wall_ms);
    f.fork_ms.push(s.fork_and_answer(&snap.id, branches, heap)?);
    Ok(())
}
