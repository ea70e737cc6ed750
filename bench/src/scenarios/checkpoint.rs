//! Checkpoint, restore and fork of python3 with a 256 MiB random heap, an open file and an HTTP server:
//! Grove snapshot/fork vs raw CRIU dump/restore and podman container checkpoint/restore (runc + CRIU 4.1).
//! Each round: fresh workload → first checkpoint → touch 5 % of the heap → second checkpoint; then restore
//! N copies concurrently and time until every copy answers.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::Ctx;
use crate::cleanup::{self, Guard};
use crate::peers::{self, PeerEnv};
use crate::plot::{self, Series};
use crate::progress;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::util;
use crate::workload;

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
    /// (fraction of heap pages dirtied, bytes the next checkpoint added).
    dirty: Vec<(f64, u64)>,
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
            .map(|(fr, b)| (fr * 100.0, mib(*b)))
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
    for (frac, bytes) in &f.dirty {
        let key = k(
            DIRTY_BYTES,
            &format!("{}, {:.0} % dirtied", heap_param(p.heap), frac * 100.0),
            "MiB",
        );
        res.push(Measurement::value(&key, name, is_grove, mib(*bytes)));
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

// ---------------------------------------------------------------- Grove

fn grove_rounds(ctx: &Ctx, p: &Params, s: &crate::grove::GroveSnapshots) -> Figures {
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
            workload::touch(sb.init_pid, *frac)?;
            let x = s.snapshot(&sb, &format!("grove-bench-{tag}-sweep-{i}"))?;
            f.dirty.push((*frac, x.bytes_added));
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

// ---------------------------------------------------------------- raw CRIU

/// The workload in its own pid + net namespaces (python is pid 1 and a session leader there).
pub(super) struct RawWorkload {
    unshare: Child,
    pub pid: i32,
}

impl Drop for RawWorkload {
    fn drop(&mut self) {
        // SAFETY: kill on a pid we started; SIGKILL to a pid-ns init ends the whole namespace.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
    }
}

pub(super) fn start_raw(heap: u64, state: &Path) -> Result<RawWorkload> {
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
        pid = std::fs::read_to_string(format!("/proc/{upid}/task/{upid}/children"))
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse().ok()))
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

fn criu_log_errors(log: &Path) -> String {
    let s = std::fs::read_to_string(log).unwrap_or_default();
    let errs: Vec<&str> = s
        .lines()
        .filter(|l| l.starts_with("Error") && !l.contains("RLIMIT_NOFILE"))
        .take(4)
        .collect();
    errs.join(" / ")
}

pub(super) fn criu_dump(criu: &Path, pid: i32, dir: &Path) -> Result<f64> {
    std::fs::create_dir_all(dir)?;
    let mut c = Command::new(criu);
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
pub(super) fn criu_restore_n(criu: &Path, dir: &Path, n: usize, tag: &str) -> Result<Vec<i32>> {
    let results: Vec<Result<i32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|k| {
                s.spawn(move || -> Result<i32> {
                    let pidfile = dir.join(format!("pid-{tag}-{k}"));
                    let log = format!("restore-{tag}-{k}.log");
                    let mut c = Command::new(criu);
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

pub(super) fn kill_all(pids: &[i32]) {
    for &p in pids {
        // SAFETY: pids of namespace inits this bench restored.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
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

fn raw_criu_rounds(ctx: &Ctx, p: &Params) -> Figures {
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
            workload::touch(w.pid, *frac)?;
            let d = dir.join(format!("sweep-{i}"));
            criu_dump(&ctx.criu, w.pid, &d)?;
            f.dirty.push((*frac, workload::dir_bytes(&d)));
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

// ---------------------------------------------------------------- podman

fn podman_rounds(ctx: &Ctx, p: &Params) -> Figures {
    let mut f = Figures::default();
    if let Err(e) = podman_inner(ctx, p, &mut f) {
        f.error = Some(format!("{e:#}"));
    }
    f
}

struct Podman<'a> {
    env: &'a PeerEnv,
    path: String,
}

impl Podman<'_> {
    fn cmd(&self) -> Command {
        let mut c = self.env.podman();
        c.env("PATH", &self.path);
        c
    }
    fn pid(&self, name: &str) -> Result<i32> {
        let s = util::output(self.cmd().args(["inspect", "-f", "{{.State.Pid}}", name]))?;
        s.trim()
            .parse()
            .with_context(|| format!("podman pid of {name}: {s:?}"))
    }
    fn rm(&self, names: &[String]) {
        for n in names {
            let _ = self.cmd().args(["rm", "-f", "-t", "0", n]).output();
        }
    }
}

fn podman_inner(ctx: &Ctx, p: &Params, f: &mut Figures) -> Result<()> {
    util::which("runc").context(
        "runc not installed (podman checkpoint needs it: Debian's crun is built without CRIU)",
    )?;
    let env = PeerEnv::prepare(&ctx.image, &ctx.work, true)?;
    if let Some(why) = env.unavailable(peers::Kind::Podman) {
        bail!(why);
    }
    let _hugetlb = peers::hugetlb_workaround().unwrap_or(None);
    // runc finds CRIU on PATH: put the CRIU >= 4.1 wrapper first.
    let bin = ctx.fresh_dir("criu-bin")?;
    std::os::unix::fs::symlink(&ctx.criu, bin.join("criu"))?;
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let pm = Podman { env: &env, path };
    let _sweep = Guard::new("podman checkpoint containers", {
        let conf = env.containers_conf.clone();
        move || {
            let f = format!("label={}", peers::PODMAN_LABEL);
            let mut c = Command::new("podman");
            c.env("CONTAINERS_CONF", &conf);
            let ids = util::output(c.args(["ps", "-aq", "--filter", &f])).unwrap_or_default();
            for id in ids.split_whitespace() {
                let mut c = Command::new("podman");
                let _ = c
                    .env("CONTAINERS_CONF", &conf)
                    .args(["rm", "-f", "-t", "0", id])
                    .output();
            }
            Ok(())
        }
    });
    let dir = ctx.fresh_dir("podman-ckpt")?;
    let mut last: Option<PathBuf> = None;
    for round in 0..p.rounds {
        cleanup::check()?;
        let name = peers::unique_name("ckpt");
        let mut c = pm.cmd();
        c.args([
            "run",
            "-d",
            "--runtime",
            "runc",
            "--network",
            "none",
            "--label",
            peers::PODMAN_LABEL,
            "--name",
            &name,
        ]);
        c.arg(peers::PODMAN_IMAGE)
            .arg("python3")
            .args(workload::args(p.heap, "/tmp/grove-bench-state"));
        let r = util::run(&mut c).and_then(|_| {
            let pid = pm.pid(&name)?;
            workload::wait_ready(pid, p.heap, Duration::from_secs(120))?;
            let a = dir.join(format!("r{round}-a.tar"));
            let ms1 = checkpoint(&pm, &name, &a)?;
            let pages = workload::touch(pid, TOUCH)?;
            let b = dir.join(format!("r{round}-b.tar"));
            let ms2 = checkpoint(&pm, &name, &b)?;
            let (b1, b2) = (std::fs::metadata(&a)?.len(), std::fs::metadata(&b)?.len());
            f.first_ms.push(ms1);
            f.second_ms.push(ms2);
            f.first_mib.push(mib(b1));
            f.second_mib.push(mib(b2));
            f.ratio.push(b2 as f64 / (pages * 4096) as f64);
            let _ = std::fs::remove_file(&a);
            if let Some(old) = last.replace(b) {
                let _ = std::fs::remove_file(old);
            }
            Ok(())
        });
        pm.rm(std::slice::from_ref(&name));
        r?;
    }
    let tar = last.ok_or_else(|| anyhow!("no checkpoint"))?;
    for &n in &p.branches {
        let mut v = Vec::new();
        for _ in 0..p.fork_reps {
            cleanup::check()?;
            let names: Vec<String> = (0..n).map(|_| peers::unique_name("restore")).collect();
            let t = Instant::now();
            let r = restore_n(&pm, &tar, &names).and_then(|pids| all_answer(&pids, p.heap));
            let ms = util::ms_since(t);
            pm.rm(&names);
            r?;
            v.push(ms);
        }
        f.fork_ms.push((n, v));
    }
    Ok(())
}

fn checkpoint(pm: &Podman<'_>, name: &str, tar: &Path) -> Result<f64> {
    let mut c = pm.cmd();
    c.args([
        "container",
        "checkpoint",
        "--leave-running",
        "--compress",
        "none",
        "--export",
    ])
    .arg(tar)
    .arg(name);
    util::run(&mut c)
}

fn restore_n(pm: &Podman<'_>, tar: &Path, names: &[String]) -> Result<Vec<i32>> {
    let rs: Vec<Result<i32>> = std::thread::scope(|s| {
        let hs: Vec<_> = names
            .iter()
            .map(|n| {
                s.spawn(move || -> Result<i32> {
                    let mut c = pm.cmd();
                    c.args(["container", "restore", "--import"])
                        .arg(tar)
                        .args(["--name", n]);
                    util::run(&mut c)?;
                    pm.pid(n)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("panicked"))))
            .collect()
    });
    rs.into_iter().collect()
}
