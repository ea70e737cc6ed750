//! Soak: N create → exec → destroy cycles with hostile workloads mixed in (fork bombs, memory hogs,
//! `setsid nohup` daemons, a full /dev/shm, listening and connected sockets, egress sandboxes),
//! then asserts that nothing is left and that memory and open files are back where they started.
//!
//! Run as root:
//! `cargo run --release -p grove-runtime --example soak -- --cycles 10000 [--workers 2]
//!  [--root overlay] [--csv FILE] [--mem-tolerance-mb 256] [--files-tolerance 2000]`
//!
//! Host-wide figures (MemAvailable, /proc/sys/fs/file-nr) move with whatever else runs on the
//! machine, hence the tolerances; the process's own fds and the mounts are compared exactly.
//! MemAvailable is read with the free pages on the kernel's per-CPU lists added back (see
//! `grove_runtime::host_mem`): without them a run "lost" 200–500 MiB that no meminfo field held.

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use grove_runtime::{
    EgressRule, ExecRequest, Limits, NetworkPolicy, OverlayRoot, Runtime, RuntimeConfig,
    SandboxSpec,
};
use parking_lot::Mutex;

const IMAGE: &str = "debian12";
const STATE_DIR: &str = "/var/lib/grove";
const RUN_DIR: &str = "/run/grove-soak";
/// Heavy workloads are one cycle in this many each; the rest run `true`.
const EVERY: usize = 50;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    True,
    ForkBomb,
    MemHog,
    Daemons,
    FillShm,
    Sockets,
    Egress,
}

impl Kind {
    fn of(cycle: usize) -> Kind {
        match cycle % EVERY {
            1 => Kind::ForkBomb,
            2 => Kind::MemHog,
            3 => Kind::Daemons,
            4 => Kind::FillShm,
            5 => Kind::Sockets,
            6 => Kind::Egress,
            _ => Kind::True,
        }
    }

    fn exec(self) -> ExecRequest {
        let sh = |s: &str| {
            let mut r = ExecRequest::shell(s);
            r.timeout_ms = Some(10_000);
            r
        };
        match self {
            Kind::True => ExecRequest::argv(["true"]),
            // Left running while the sandbox is destroyed: reclaim must kill it mid-growth.
            Kind::ForkBomb => sh("f(){ f | f & }; f; sleep 0.3"),
            Kind::MemHog => sh("python3 -c \"b = b'x' * (256 << 20)\""),
            Kind::Daemons => sh("setsid nohup sleep 100000 >/dev/null 2>&1 </dev/null & \
                 setsid sh -c 'nohup sleep 100000 >/dev/null 2>&1 </dev/null &'; true"),
            Kind::FillShm => {
                sh("head -c 256M /dev/zero > /dev/shm/fill; ls -l /dev/shm >/dev/null")
            }
            Kind::Sockets | Kind::Egress => sh("nohup python3 -c \"import socket, time\n\
                 s = socket.socket(); s.bind(('127.0.0.1', 8080)); s.listen()\n\
                 c = socket.create_connection(('127.0.0.1', 8080)); a = s.accept()\n\
                 u = socket.socket(socket.AF_UNIX); u.bind('/tmp/soak.sock'); u.listen()\n\
                 time.sleep(100000)\" >/dev/null 2>&1 </dev/null & sleep 0.3"),
        }
    }

    fn spec(self) -> SandboxSpec {
        let mut spec = SandboxSpec::from_image(IMAGE);
        spec.limits = Some(Limits {
            cpu_millis: 500,
            memory_mb: 64,
            pids: 64,
            open_files: 256,
            disk_mb: 64,
        });
        if self == Kind::Egress {
            spec.network = NetworkPolicy::Egress {
                allow: vec![EgressRule {
                    cidr: "192.0.2.0/24".into(),
                    ports: vec![80],
                }],
            };
        }
        spec
    }
}

/// Host and process figures sampled after each cycle.
#[derive(Clone, Copy, Debug, Default)]
struct Sample {
    mem_available_kb: u64,
    rss_kb: u64,
    proc_fds: u64,
    host_files: u64,
    mounts: u64,
    /// Mounts under this soak's run dir (its sandboxes' roots, /run/grove-soak).
    own_mounts: u64,
    memcgs: u64,
    /// Unreclaimable slab + percpu (KiB): kernel memory a leak of namespaces/cgroups would grow.
    kernel_kb: u64,
    /// Charged to this instance's memory cgroup parent (KiB): what destroyed sandboxes still hold
    /// (page cache and kernel objects they were charged for, dying memcgs included).
    charged_kb: u64,
}

fn meminfo_field(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn sample() -> Sample {
    let mem = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let file_nr = std::fs::read_to_string("/proc/sys/fs/file-nr").unwrap_or_default();
    let cgroups = std::fs::read_to_string("/proc/cgroups").unwrap_or_default();
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    Sample {
        mem_available_kb: grove_runtime::host_mem::available_kb().unwrap_or(0),
        kernel_kb: meminfo_field(&mem, "SUnreclaim:") + meminfo_field(&mem, "Percpu:"),
        charged_kb: [
            "/sys/fs/cgroup/memory/grove-soak/memory.usage_in_bytes",
            "/sys/fs/cgroup/grove-soak/memory.current",
        ]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok())
        .unwrap_or(0)
            / 1024,
        rss_kb: meminfo_field(&status, "VmRSS:"),
        proc_fds: std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64),
        // file-nr: allocated, free (always 0 on modern kernels), max.
        host_files: file_nr
            .split_whitespace()
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
        mounts: mountinfo.lines().count() as u64,
        own_mounts: mountinfo
            .lines()
            .filter(|l| l.split(' ').nth(4).is_some_and(|m| m.starts_with(RUN_DIR)))
            .count() as u64,
        // /proc/cgroups: subsys hierarchy num_cgroups enabled; dying memcgs show up here.
        memcgs: cgroups
            .lines()
            .find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.first() == Some(&"memory")).then(|| f.get(2)?.parse().ok())?
            })
            .unwrap_or(0),
    }
}

fn load_avg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

struct Row {
    cycle: usize,
    worker: usize,
    kind: Kind,
    ms: f64,
    outcome: String,
    s: Sample,
}

struct Args {
    cycles: usize,
    workers: usize,
    csv: Option<String>,
    mem_tol_mb: u64,
    files_tol: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        cycles: 10_000,
        workers: 2,
        csv: None,
        mem_tol_mb: 256,
        files_tol: 2000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        let num = |v: String| v.parse::<u64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--cycles" => a.cycles = num(val()?)? as usize,
            "--workers" => a.workers = num(val()?)?.max(1) as usize,
            "--csv" => a.csv = Some(val()?),
            "--mem-tolerance-mb" => a.mem_tol_mb = num(val()?)?,
            "--files-tolerance" => a.files_tol = num(val()?)?,
            "--root" => {
                let r = val()?;
                if r != "overlay" {
                    return Err(format!(
                        "--root {r}: only `overlay` here (nodefs is plugged in by groved)"
                    ));
                }
            }
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    Ok(a)
}

fn cycle(rt: &Runtime, kind: Kind) -> Result<String, String> {
    let info = rt.create(kind.spec()).map_err(|e| format!("create: {e}"))?;
    let r = rt.exec(&info.id, kind.exec());
    let destroyed = rt.destroy(&info.id).map_err(|e| format!("destroy: {e}"));
    let r = r.map_err(|e| format!("exec: {e}"))?;
    destroyed?;
    Ok(match (r.exit_code, r.signal, r.timed_out) {
        (_, _, true) => "timed-out".into(),
        (Some(c), _, _) => format!("exit {c}"),
        (_, Some(s), _) => format!("signal {s}"),
        _ => "?".into(),
    })
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("soak: {e}");
            std::process::exit(2);
        }
    };
    let mut cfg = RuntimeConfig::default_paths();
    cfg.state_dir = STATE_DIR.into();
    cfg.run_dir = RUN_DIR.into();
    cfg.cgroup_root = "grove-soak".into();
    cfg.net_pool = "10.212.0.0/16".into();
    let rt = Runtime::new(cfg, Arc::new(OverlayRoot::new(STATE_DIR))).expect("runtime");

    // Warm-up: one cycle of each kind, so first-use caches (image dentries, python's pages, the
    // nft table's first creation) are in the baseline rather than counted as growth.
    for c in 0..EVERY.min(7) {
        if let Err(e) = cycle(&rt, Kind::of(c)) {
            eprintln!("soak: warm-up cycle {c} failed: {e}");
            std::process::exit(1);
        }
    }
    let before = sample();
    let load_before = load_avg();
    let next = AtomicUsize::new(0);
    let rows: Mutex<Vec<Row>> = Mutex::new(Vec::with_capacity(args.cycles));
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for worker in 0..args.workers {
            let (rt, next, rows, n) = (&rt, &next, &rows, args.cycles);
            s.spawn(move || loop {
                let c = next.fetch_add(1, Ordering::Relaxed);
                if c >= n {
                    break;
                }
                let kind = Kind::of(c);
                let t = Instant::now();
                let outcome = cycle(rt, kind).unwrap_or_else(|e| format!("ERROR {e}"));
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let s = sample();
                rows.lock().push(Row {
                    cycle: c,
                    worker,
                    kind,
                    ms,
                    outcome,
                    s,
                });
                if c % 1000 == 999 {
                    eprintln!(
                        "soak: {} cycles, {:.0}s, load {}",
                        c + 1,
                        t0.elapsed().as_secs_f64(),
                        load_avg()
                    );
                }
            });
        }
    });
    let wall = t0.elapsed().as_secs_f64();
    let load_after = load_avg();
    // Let the kernel finish what it does asynchronously (netns teardown, RCU-freed objects).
    std::thread::sleep(std::time::Duration::from_secs(2));
    let residue = rt.residue();
    let after = sample();
    let mut rows = rows.into_inner();
    rows.sort_by_key(|r| r.cycle);

    if let Some(path) = &args.csv {
        let mut f = std::fs::File::create(path).expect("csv");
        writeln!(f, "cycle,worker,kind,ms,outcome,mem_available_kb,rss_kb,proc_fds,host_files,mounts,own_mounts,memcgs,kernel_kb,charged_kb").expect("csv");
        for r in &rows {
            writeln!(
                f,
                "{},{},{:?},{:.2},{},{},{},{},{},{},{},{},{},{}",
                r.cycle,
                r.worker,
                r.kind,
                r.ms,
                r.outcome,
                r.s.mem_available_kb,
                r.s.rss_kb,
                r.s.proc_fds,
                r.s.host_files,
                r.s.mounts,
                r.s.own_mounts,
                r.s.memcgs,
                r.s.kernel_kb,
                r.s.charged_kb
            )
            .expect("csv");
        }
    }

    let mut ms: Vec<f64> = rows.iter().map(|r| r.ms).collect();
    ms.sort_by(|a, b| a.total_cmp(b));
    let p = |q: f64| {
        ms.get(((ms.len().max(1) - 1) as f64 * q) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    let errors: Vec<&Row> = rows
        .iter()
        .filter(|r| r.outcome.starts_with("ERROR"))
        .collect();
    println!(
        "soak: {} cycles ({} workers) in {wall:.1}s = {:.0}/s; load avg before {load_before}, after {load_after}",
        rows.len(),
        args.workers,
        rows.len() as f64 / wall
    );
    println!(
        "cycle latency ms: p50 {:.1}  p90 {:.1}  p99 {:.1}  max {:.1}",
        p(0.5),
        p(0.9),
        p(0.99),
        p(1.0)
    );
    for kind in [
        Kind::ForkBomb,
        Kind::MemHog,
        Kind::Daemons,
        Kind::FillShm,
        Kind::Sockets,
        Kind::Egress,
    ] {
        let of: Vec<&Row> = rows.iter().filter(|r| r.kind == kind).collect();
        let mut outcomes: Vec<&str> = of.iter().map(|r| r.outcome.as_str()).collect();
        outcomes.sort();
        outcomes.dedup();
        let mean = of.iter().map(|r| r.ms).sum::<f64>() / of.len().max(1) as f64;
        println!(
            "  {kind:?}: {} cycles, mean {mean:.1} ms, outcomes {outcomes:?}",
            of.len()
        );
    }
    let d = |a: u64, b: u64| b as i64 - a as i64;
    println!(
        "before → after: MemAvailable (per-CPU free lists counted in) {} → {} KiB ({:+} KiB); own RSS {} → {} KiB; own fds {} → {}; \
         host open files {} → {} ({:+}); host mounts {} → {}, under {RUN_DIR} {} → {}; \
         memory cgroups (host, incl. dying) {} → {}; kernel SUnreclaim+Percpu {} → {} KiB; \
         still charged to grove-soak's memory cgroup {} → {} KiB",
        before.mem_available_kb,
        after.mem_available_kb,
        d(before.mem_available_kb, after.mem_available_kb),
        before.rss_kb,
        after.rss_kb,
        before.proc_fds,
        after.proc_fds,
        before.host_files,
        after.host_files,
        d(before.host_files, after.host_files),
        before.mounts,
        after.mounts,
        before.own_mounts,
        after.own_mounts,
        before.memcgs,
        after.memcgs,
        before.kernel_kb,
        after.kernel_kb,
        before.charged_kb,
        after.charged_kb
    );
    // What the leftover charge is made of (v1): page cache vs kernel objects (reclaimable slab).
    let stat =
        std::fs::read_to_string("/sys/fs/cgroup/memory/grove-soak/memory.stat").unwrap_or_default();
    let kmem =
        std::fs::read_to_string("/sys/fs/cgroup/memory/grove-soak/memory.kmem.usage_in_bytes")
            .unwrap_or_default();
    if !stat.is_empty() {
        let f = |k: &str| meminfo_field(&stat, &format!("total_{k} ")) / 1024;
        println!(
            "leftover charge: page cache {} KiB (rss {}, shmem {}), kernel {} KiB",
            f("cache"),
            f("rss"),
            f("shmem"),
            kmem.trim().parse::<u64>().unwrap_or(0) / 1024
        );
    }
    println!(
        "residue: {} item(s) {:?}",
        residue.items.len(),
        residue.items
    );
    rt.shutdown();

    let mut failed = Vec::new();
    if !errors.is_empty() {
        failed.push(format!(
            "{} cycles failed, first: {} {}",
            errors.len(),
            errors[0].cycle,
            errors[0].outcome
        ));
    }
    if !residue.items.is_empty() {
        failed.push("residue is not empty".into());
    }
    if after.proc_fds > before.proc_fds {
        failed.push(format!("own fds {} → {}", before.proc_fds, after.proc_fds));
    }
    if after.own_mounts > 0 {
        failed.push(format!("{} mounts left under {RUN_DIR}", after.own_mounts));
    }
    if after.mem_available_kb + args.mem_tol_mb * 1024 < before.mem_available_kb {
        failed.push(format!(
            "MemAvailable fell by more than {} MiB",
            args.mem_tol_mb
        ));
    }
    if after.host_files > before.host_files + args.files_tol {
        failed.push(format!(
            "host open files grew by more than {}",
            args.files_tol
        ));
    }
    if after.charged_kb > before.charged_kb + 64 * 1024 {
        failed
            .push("memory still charged to the sandboxes' cgroups grew by more than 64 MiB".into());
    }
    if after.rss_kb > before.rss_kb + 64 * 1024 {
        failed.push("own RSS grew by more than 64 MiB".into());
    }
    if failed.is_empty() {
        println!(
            "soak: PASS (tolerances: MemAvailable {} MiB, host open files {}, own RSS and sandbox cgroup charge 64 MiB each; own fds exact, no mount under the run dir)",
            args.mem_tol_mb, args.files_tol
        );
    } else {
        println!("soak: FAIL: {}", failed.join("; "));
        std::process::exit(1);
    }
}
