//! Raw CRIU's rounds of the checkpoint scenario: the workload in its own pid and network
//! namespaces, dumped with `criu dump --leave-running` and restored N times at once. The
//! workload and the dump/restore helpers are shared with `fork_memory`.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use grove_snapshotter::criu::Launch;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::{all_answer, mib, Figures, Params, DIRTY, TOUCH};
use crate::cleanup;
use crate::scenarios::Ctx;
use crate::util;
use crate::workload;

/// The workload in its own pid + net namespaces (python is pid 1 and a session leader there).
pub(in crate::scenarios) struct RawWorkload {
    unshare: Child,
    pub pid: i32,
}

impl Drop for RawWorkload {
    fn drop(&mut self) {
        // SIGKILL to a pid-ns init ends the whole namespace.
        let _ = kill(Pid::from_raw(self.pid), Signal::SIGKILL);
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
    }
}

pub(in crate::scenarios) fn start_raw(heap: u64, state: &Path) -> Result<RawWorkload> {
    let mut c = Command::new("unshare");
    c.args(["--fork", "--pid", "--net", "setsid", "python3"]);
    c.args(workload::args(heap, &state.to_string_lossy()));
    c.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    workload::close_inherited_fds(&mut c);
    let mut child = c.spawn().context("spawn unshare python3")?;
    let upid = child.id();
    let mut pid = 0;
    util::wait_until(Duration::from_secs(5), || {
        pid = grove_sys::proc::children(upid as i32)
            .first()
            .copied()
            .unwrap_or(0);
        pid > 0
    });
    if pid == 0 {
        let _ = child.kill();
        let _ = child.wait();
        bail!("unshare did not start python3");
    }
    Ok(RawWorkload {
        unshare: child,
        pid,
    })
}

/// Why CRIU failed, from its log: the snapshotter's reading of it (its `Error (` lines less the
/// known-harmless ones, else the log's tail), so the bench and groved explain a failure alike.
fn criu_log_errors(log: &Path) -> String {
    let s = std::fs::read_to_string(log).unwrap_or_default();
    grove_snapshotter::criu::log::error_lines(&s).join(" / ")
}

pub(in crate::scenarios) fn criu_dump(criu: &Path, pid: i32, dir: &Path) -> Result<f64> {
    std::fs::create_dir_all(dir)?;
    let mut c = Launch::of(criu).command();
    c.arg("dump")
        .arg("-t")
        .arg(pid.to_string())
        .arg("-D")
        .arg(dir);
    c.args([
        "--network-lock",
        "nftables",
        "--leave-running",
        "-o",
        "dump.log",
    ]);
    util::run(&mut c).map_err(|e| anyhow!("{e:#}; log: {}", criu_log_errors(&dir.join("dump.log"))))
}

/// Restores `n` copies concurrently; returns their host pids (killed by the caller).
pub(in crate::scenarios) fn criu_restore_n(
    criu: &Path,
    dir: &Path,
    n: usize,
    tag: &str,
) -> Result<Vec<i32>> {
    let results: Vec<Result<i32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|k| {
                s.spawn(move || -> Result<i32> {
                    let pidfile = dir.join(format!("pid-{tag}-{k}"));
                    let log = format!("restore-{tag}-{k}.log");
                    let mut c = Launch::of(criu).command();
                    c.arg("restore")
                        .arg("-D")
                        .arg(dir)
                        .arg("-d")
                        .arg("--pidfile")
                        .arg(&pidfile)
                        .args(["-o", &log]);
                    util::run(&mut c)
                        .map_err(|e| anyhow!("{e:#}; log: {}", criu_log_errors(&dir.join(&log))))?;
                    let pid = std::fs::read_to_string(&pidfile)?.trim().parse()?;
                    let _ = std::fs::remove_file(&pidfile);
                    Ok(pid)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("restore thread panicked")))
            })
            .collect()
    });
    let mut pids = Vec::new();
    let mut err = None;
    for r in results {
        match r {
            Ok(p) => pids.push(p),
            Err(e) => err = err.or(Some(e)),
        }
    }
    if let Some(e) = err {
        kill_all(&pids);
        return Err(e);
    }
    Ok(pids)
}

pub(in crate::scenarios) fn kill_all(pids: &[i32]) {
    for &p in pids {
        let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
    }
}
pub(super) fn raw_criu_rounds(ctx: &Ctx, p: &Params) -> Figures {
    let mut f = Figures::default();
    if let Err(e) = raw_inner(ctx, p, &mut f) {
        f.error = Some(format!("{e:#}"));
    }
    f
}

fn raw_inner(ctx: &Ctx, p: &Params, f: &mut Figures) -> Result<()> {
    if !ctx.criu.is_file() {
        bail!("CRIU not found at {}", ctx.criu.display());
    }
    let dir = ctx.fresh_dir("criu")?;
    let mut last = None;
    for round in 0..p.rounds {
        cleanup::check()?;
        let state = dir.join(format!("state-{round}"));
        let w = start_raw(p.heap, &state)?;
        workload::wait_ready(w.pid, p.heap, Duration::from_secs(120))?;
        let d1 = dir.join(format!("r{round}-a"));
        f.first_ms.push(criu_dump(&ctx.criu, w.pid, &d1)?);
        f.first_mib.push(mib(workload::dir_bytes(&d1)));
        let pages = workload::touch(w.pid, TOUCH)?;
        let d2 = dir.join(format!("r{round}-b"));
        f.second_ms.push(criu_dump(&ctx.criu, w.pid, &d2)?);
        let b2 = workload::dir_bytes(&d2);
        f.second_mib.push(mib(b2));
        f.ratio.push(b2 as f64 / (pages * 4096) as f64);
        let _ = std::fs::remove_dir_all(&d1);
        if let Some(old) = last.replace(d2) {
            let _ = std::fs::remove_dir_all(old);
        }
        // The restored copies need the open file as it was; keep the last round's workload file.
        drop(w);
    }
    {
        let w = start_raw(p.heap, &dir.join("state-sweep"))?;
        workload::wait_ready(w.pid, p.heap, Duration::from_secs(120))?;
        for (i, frac) in DIRTY.iter().enumerate() {
            cleanup::check()?;
            let pages = workload::touch(w.pid, *frac)?;
            let d = dir.join(format!("sweep-{i}"));
            let wall_ms = criu_dump(&ctx.criu, w.pid, &d)?;
            f.dirty.push(super::Dirtied {
                frac: *frac,
                pages,
                bytes: workload::dir_bytes(&d),
                wall_ms,
                frozen_ms: None,
            });
            let _ = std::fs::remove_dir_all(&d);
        }
    }
    let img = last.ok_or_else(|| anyhow!("no dump"))?;
    for &n in &p.branches {
        let mut v = Vec::new();
        for rep in 0..p.fork_reps {
            cleanup::check()?;
            let t = Instant::now();
            let pids = criu_restore_n(&ctx.criu, &img, n, &format!("{n}-{rep}"))?;
            let r = all_answer(&pids, p.heap);
            let ms = util::ms_since(t);
            kill_all(&pids);
            r?;
            v.push(ms);
        }
        f.fork_ms.push((n, v));
    }
    Ok(())
}
