//! `grove-bench`: Grove's benchmarks side by side with the peers on the same machine in the same run.
//! Writes `report.md`, `results.json` and SVG plots to `--out`.

mod cleanup;
mod grove;
mod groved;
mod hardening;
mod http;
mod peers;
mod plot;
mod progress;
mod promises;
mod report;
mod scenarios;
mod stats;
mod util;
mod workload;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;

use report::{Report, ScenarioResult};

#[derive(Parser, Debug)]
#[command(
    name = "grove-bench",
    about = "Grove benchmarks, side by side with the peers"
)]
struct Args {
    /// Few iterations and small sizes (< 3 minutes): keeps the harness working in CI; not for quoting.
    #[arg(long)]
    quick: bool,
    /// Directory for report.md, results.json and the plots.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Run only these scenarios (comma-separated): lifecycle, checkpoint, filesystem, density, elastic,
    /// storage, images, soak, soak-full-disk (the soaks run only when named here).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Base image root the sandboxes and peers run on.
    #[arg(long, default_value = "/var/lib/grove/images/debian12")]
    image: PathBuf,
    /// CRIU >= 4.1 (Debian 12's 3.17 fails on this kernel).
    #[arg(long, default_value = "/var/lib/grove/criu/criu")]
    criu: PathBuf,
    /// Where this run's scratch directory is made (a fresh grove-bench-* dir, removed at the end).
    #[arg(long, default_value = "/var/tmp")]
    scratch: PathBuf,
    /// Cycles of the soak scenario (default 10,000; 120 with --quick).
    #[arg(long)]
    soak_cycles: Option<u64>,
    /// Size in MiB of the tmpfs that holds groved's state dir in soak-full-disk (default 256).
    #[arg(long)]
    state_fs_mb: Option<u64>,
    /// Internal: the lifecycle scenario's per-layer hardening probe (N samples per layer), run
    /// by the bench itself in a fresh single-threaded process.
    #[arg(long, hide = true)]
    hardening_probe: Option<usize>,
}

fn main() {
    let args = Args::parse();
    if let Some(n) = args.hardening_probe {
        if let Err(e) = hardening::probe_main(n) {
            eprintln!("grove-bench --hardening-probe: {e:#}");
            std::process::exit(2);
        }
        return;
    }
    match run(args) {
        Ok(failed) if !failed => {}
        Ok(_) => std::process::exit(1),
        Err(e) => {
            eprintln!("grove-bench: {e:#}");
            std::process::exit(2);
        }
    }
}

/// Runs the selected scenarios; returns whether anything is left behind or the harness broke.
fn run(args: Args) -> Result<bool> {
    if !nix::unistd::geteuid().is_root() {
        bail!("must run as root (namespaces, mounts, cgroups, CRIU)");
    }
    let all = scenarios::all();
    for o in &args.only {
        if !all.iter().any(|s| s.name == o) {
            let names: Vec<_> = all.iter().map(|s| s.name).collect();
            bail!("unknown scenario {o:?} (known: {})", names.join(", "));
        }
    }
    if !args.image.join("bin").is_dir() && !args.image.join("usr/bin").is_dir() {
        bail!(
            "base image root {} not found (run scripts/setup)",
            args.image.display()
        );
    }
    let selected: Vec<_> = all
        .into_iter()
        .filter(|s| {
            if args.only.is_empty() {
                !s.opt_in
            } else {
                args.only.iter().any(|o| o == s.name)
            }
        })
        .collect();
    std::fs::create_dir_all(&args.out).with_context(|| format!("create {}", args.out.display()))?;
    cleanup::install_signal_handlers();

    let work_dir = tempfile::Builder::new()
        .prefix("grove-bench-")
        .tempdir_in(&args.scratch)
        .with_context(|| format!("scratch dir in {}", args.scratch.display()))?;
    let work = work_dir.path().to_path_buf();
    let ctx = scenarios::Ctx {
        quick: args.quick,
        out: args.out.clone(),
        work: work.clone(),
        image: args.image.clone(),
        criu: args.criu.clone(),
        grove: grove::GroveEnv::new(&args.image, &work, &args.criu),
        soak_cycles: args.soak_cycles,
        state_fs_mb: args.state_fs_mb,
    };
    let mut rep = Report {
        started_utc: util::utc_now(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        quick: args.quick,
        host: host_description(),
        ..Default::default()
    };
    let est: f64 = selected
        .iter()
        .map(|s| if args.quick { s.est_quick } else { s.est_full })
        .sum();
    progress::start(est);
    for s in &selected {
        if cleanup::cancelled() {
            break;
        }
        progress::begin_scenario(s.name, if args.quick { s.est_quick } else { s.est_full });
        let t = Instant::now();
        let mut res = ScenarioResult::new(s.name, s.title);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (s.run)(&ctx, &mut res)));
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => res.error = Some(format!("{e:#}")),
            Err(_) => res.error = Some("panicked (see stderr)".into()),
        }
        res.seconds = t.elapsed().as_secs_f64();
        if let Some(e) = &res.error {
            eprintln!("grove-bench: scenario {} stopped: {e}", s.name);
        }
        progress::end_scenario();
        progress::step(1.0, &format!("done in {:.0} s", res.seconds));
        rep.scenarios.push(res);
        // Partial results survive a later crash.
        write_outputs(&args.out, &rep)?;
    }
    ctx.grove.shutdown();
    let grove_residue = ctx.grove.residue();
    drop(ctx);
    let scratch = work.clone();
    if let Err(e) = work_dir.close() {
        eprintln!("grove-bench: removing {}: {e}", scratch.display());
    }
    rep.finished_utc = util::utc_now();
    rep.promises = report::check_promises(&promises::all(), &rep.scenarios);
    sweep_peer_cgroups();
    rep.residue = residue(&scratch);
    rep.residue.extend(grove_residue);
    write_outputs(&args.out, &rep)?;
    eprintln!(
        "grove-bench: report in {}",
        args.out.join("report.md").display()
    );
    if !rep.residue.is_empty() {
        eprintln!(
            "grove-bench: RESIDUE left on the host:\n  {}",
            rep.residue.join("\n  ")
        );
    }
    if cleanup::cancelled() {
        bail!("interrupted (partial report written; cleanup done)");
    }
    Ok(!rep.residue.is_empty())
}

fn write_outputs(out: &std::path::Path, rep: &Report) -> Result<()> {
    std::fs::write(out.join("results.json"), serde_json::to_vec_pretty(rep)?)?;
    std::fs::write(out.join("report.md"), report::render(rep))?;
    Ok(())
}

fn host_description() -> String {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .next()
                .map(|l| l.split_whitespace().nth(1).unwrap_or("0").to_string())
        })
        .and_then(|k| k.parse::<u64>().ok())
        .map(|k| k / 1024 / 1024)
        .unwrap_or(0);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load = load
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ");
    // A host setting every peer's restores and creates feel (each task move into a cgroup),
    // which the bench's Grove stack then turns on, as groved does (runtime `cgroup::moves`).
    let moves = std::fs::read_to_string("/proc/self/mountinfo")
        .map(|m| grove_runtime::cgroup::moves::describe(&grove_runtime::cgroup::moves::state(&m)))
        .unwrap_or_default();
    format!(
        "Linux {}, {cpus} CPUs, {mem} GiB RAM, load at start {load}, cgroup2 at start: {moves}",
        kernel.trim()
    )
}

/// Under load `crun delete` can leave a container's (empty) cgroup dirs behind in some v1
/// hierarchies; they are this run's, so remove them before the residue check. A dir that still
/// holds a process is left for the check to report.
fn sweep_peer_cgroups() {
    // crun's containers only (peers::unique_name): Grove's own cgroup roots left behind are residue.
    let tag = format!("grove-bench-{}-crun-", std::process::id());
    let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") else {
        return;
    };
    for hierarchy in rd.flatten() {
        let Ok(sub) = std::fs::read_dir(hierarchy.path()) else {
            continue;
        };
        for e in sub.flatten() {
            if !e.file_name().to_string_lossy().starts_with(&tag) {
                continue;
            }
            for _ in 0..20 {
                match std::fs::remove_dir(e.path()) {
                    Err(err) if err.raw_os_error() == Some(libc::EBUSY) => {
                        std::thread::sleep(std::time::Duration::from_millis(50))
                    }
                    _ => break,
                }
            }
        }
    }
}

/// Everything of the bench's own still on the host: mounts, cgroups, podman containers, the scratch dir.
fn residue(scratch: &std::path::Path) -> Vec<String> {
    let mut r = Vec::new();
    let pid = std::process::id();
    let tag = format!("grove-bench-{pid}");
    if let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") {
        for l in mi.lines() {
            if l.contains("grove-bench") || l.contains(&scratch.display().to_string()) {
                r.push(format!("mount: {l}"));
            }
        }
    }
    if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
        for c in rd.flatten() {
            if let Ok(sub) = std::fs::read_dir(c.path()) {
                for e in sub.flatten() {
                    if e.file_name().to_string_lossy().starts_with(&tag) {
                        r.push(format!("cgroup: {}", e.path().display()));
                    }
                }
            }
        }
    }
    if scratch.exists() {
        r.push(format!("dir: {}", scratch.display()));
    }
    let filter = format!("label={}", peers::PODMAN_LABEL);
    if util::which("podman").is_some() {
        if let Ok(ids) = util::output(
            std::process::Command::new("podman").args(["ps", "-aq", "--filter", &filter]),
        ) {
            for id in ids.split_whitespace() {
                r.push(format!("podman container {id}"));
            }
        }
    }
    if let Ok(out) = util::output(std::process::Command::new("crun").arg("list").arg("-q")) {
        for id in out.split_whitespace().filter(|i| i.starts_with(&tag)) {
            r.push(format!("crun container {id}"));
        }
    }
    r
}
