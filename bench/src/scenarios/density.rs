//! Memory per idle sandbox (`sleep infinity`): MemAvailable drop ÷ sandboxes, ramping 100 → 500 → 2,000
//! (quick: 20). Grove (runtime library; its FUSE server, if any, runs in this process, so its share counts)
//! vs bwrap and crun.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, Result};
use grove_runtime::{Limits, SandboxId};

use super::Ctx;
use crate::cleanup;
use crate::grove::GroveRuntime;
use crate::peers::{Idle, Kind, PeerEnv};
use crate::plot::{self, Series};
use crate::progress;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::util;

pub const NAME: &str = "density";
pub const PER_SANDBOX: &str = "memory per idle sandbox (MemAvailable drop ÷ sandboxes)";

enum Handle {
    Peer(Idle),
    Grove(Arc<GroveRuntime>, SandboxId),
}

impl Handle {
    fn stop(self) -> Result<()> {
        match self {
            Handle::Peer(i) => i.stop(),
            Handle::Grove(g, id) => g.destroy(&id),
        }
    }
}

enum System {
    Grove(Arc<GroveRuntime>),
    Peer(Kind),
}

impl System {
    fn name(&self) -> String {
        match self {
            System::Grove(g) => g.label(),
            System::Peer(k) => k.name().into(),
        }
    }
    fn start(&self, env: &PeerEnv) -> Result<Handle> {
        match self {
            System::Peer(k) => Ok(Handle::Peer(env.start_idle(*k)?)),
            System::Grove(g) => {
                let limits = Limits {
                    cpu_millis: 100,
                    memory_mb: 16,
                    pids: 16,
                    open_files: 64,
                    disk_mb: 16,
                };
                let id = g.create(g.spec(Some(limits)))?;
                if let Err(e) = g.exec_background(&id, &["sleep", "infinity"]) {
                    let _ = g.destroy(&id);
                    return Err(e);
                }
                Ok(Handle::Grove(g.clone(), id))
            }
        }
    }
}

/// Stops every handle when dropped (also on error and Ctrl-C), a few at a time.
struct Fleet(Mutex<Vec<Handle>>);

impl Fleet {
    fn len(&self) -> usize {
        self.0.lock().map(|v| v.len()).unwrap_or(0)
    }
    fn stop_all(&self) -> Option<String> {
        let handles: Vec<Handle> =
            std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        let q = Mutex::new(handles);
        let first_err: Mutex<Option<String>> = Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| loop {
                    let h = q.lock().unwrap_or_else(|e| e.into_inner()).pop();
                    let Some(h) = h else { break };
                    if let Err(e) = h.stop() {
                        first_err
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .get_or_insert(format!("{e:#}"));
                    }
                });
            }
        });
        first_err.into_inner().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if let Some(e) = self.stop_all() {
            eprintln!("grove-bench: density teardown: {e}");
        }
    }
}

pub fn run(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    let levels: Vec<usize> = ctx.pick(vec![20], vec![100, 500, 2000]);
    let env = PeerEnv::prepare(&ctx.image, &ctx.work, false)?;
    let _hugetlb = crate::peers::hugetlb_workaround().unwrap_or(None);
    let mut systems = Vec::new();
    match ctx.grove.runtime() {
        Ok(g) => systems.push(System::Grove(g)),
        Err(r) => {
            for l in &levels {
                let k = Key::new(PER_SANDBOX, format!("{l} sandboxes"), "KiB", Better::Lower);
                res.push(Measurement::not_available(&k, "grove", &r));
            }
        }
    }
    for k in [Kind::Bwrap, Kind::Crun] {
        match env.unavailable(k) {
            None => systems.push(System::Peer(k)),
            Some(why) => {
                for l in &levels {
                    let key = Key::new(PER_SANDBOX, format!("{l} sandboxes"), "KiB", Better::Lower);
                    res.push(Measurement::failed(&key, k.name(), false, &why));
                }
            }
        }
    }
    res.note("Grove's admission capacity (cpu, memory, pids, sandbox count) is overridden for the bench so 2,000 small idle sandboxes (16 MiB, 16 pids each) are admitted: this measures memory, not admission.");
    res.note("MemAvailable is host-wide: other work on the machine moves it, so small counts are noisy; the largest count is the figure to quote. It is read with the free pages on the kernel's per-CPU lists counted in (MemFree leaves them out, and this kernel grows those lists to hundreds of MiB under churn).");
    let mut series = Vec::new();
    let n_sys = systems.len().max(1) as f64;
    for (si, sys) in systems.iter().enumerate() {
        let is_grove = matches!(sys, System::Grove(_));
        let fleet = Fleet(Mutex::new(Vec::new()));
        let before = settled_mem_available()?;
        let mut pts = Vec::new();
        for (li, &level) in levels.iter().enumerate() {
            let key = Key::new(
                PER_SANDBOX,
                format!("{level} sandboxes"),
                "KiB",
                Better::Lower,
            );
            progress::step(
                (si as f64 + li as f64 / levels.len() as f64) / n_sys,
                &format!("{}: ramping to {level} idle sandboxes", sys.name()),
            );
            if let Err(e) = ramp(sys, &env, &fleet, level) {
                res.push(Measurement::failed(
                    &key,
                    &sys.name(),
                    is_grove,
                    format!("at {} sandboxes: {e:#}", fleet.len()),
                ));
                break;
            }
            std::thread::sleep(Duration::from_millis(ctx.pick(500, 2000)));
            let now = settled_mem_available()?;
            // Signed: at small counts host noise can make it negative, and that is reported as measured.
            let per = (before as f64 - now as f64) / level as f64;
            pts.push((level as f64, per));
            res.push(Measurement::value(&key, &sys.name(), is_grove, per));
        }
        progress::step(
            (si as f64 + 1.0) / n_sys,
            &format!("{}: tearing down {} sandboxes", sys.name(), fleet.len()),
        );
        if let Some(e) = fleet.stop_all() {
            res.note(format!("{} teardown: {e}", sys.name()));
        }
        if matches!(sys, System::Peer(Kind::Crun)) {
            // crun delete on this hybrid v1 host sometimes leaves a container's cgroup dirs behind.
            let n = util::sweep_cgroups(&format!("grove-bench-{}-idle", std::process::id()));
            if n > 0 {
                res.note(format!(
                    "crun delete left {n} cgroup directories behind; the bench removed them"
                ));
            }
        }
        series.push(Series {
            name: sys.name(),
            points: pts,
        });
        cleanup::check()?;
    }
    let p = ctx.out.join("density.svg");
    if plot::line_chart(
        &p,
        "memory per idle sandbox",
        "sandboxes alive",
        "KiB per sandbox",
        &series,
        false,
    )
    .is_ok()
    {
        res.plots.push("density.svg".into());
    }
    Ok(())
}

/// Starts sandboxes (4 at a time) until the fleet holds `level`.
fn ramp(sys: &System, env: &PeerEnv, fleet: &Fleet, level: usize) -> Result<()> {
    let todo = AtomicUsize::new(level.saturating_sub(fleet.len()));
    let err: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                while todo
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
                {
                    if cleanup::cancelled() || err.lock().map(|e| e.is_some()).unwrap_or(true) {
                        return;
                    }
                    match sys.start(env) {
                        Ok(h) => fleet.0.lock().unwrap_or_else(|e| e.into_inner()).push(h),
                        Err(e) => {
                            err.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .get_or_insert(e);
                            return;
                        }
                    }
                }
            });
        }
    });
    cleanup::check()?;
    match err.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None if fleet.len() < level => Err(anyhow!("only {} of {level} started", fleet.len())),
        None => Ok(()),
    }
}

/// Median of three MemAvailable readings 100 ms apart (KiB).
pub(super) fn settled_mem_available() -> Result<u64> {
    let mut v = Vec::new();
    for _ in 0..3 {
        v.push(util::mem_available_kib()?);
        std::thread::sleep(Duration::from_millis(100));
    }
    v.sort_unstable();
    Ok(v[1])
}
