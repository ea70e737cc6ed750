//! Soak: thousands of create → workload → destroy cycles through the HTTP API of a real groved, with
//! workloads that try to leave things behind (fork bombs at the pids limit, memory hogs OOM-killed,
//! `setsid nohup` daemons, /dev/shm fillers, listening sockets, file writes). groved's RSS and open fds
//! are sampled all along (CSV + SVG plots); at the end nothing may be left and both must be flat:
//! the last quarter's median within a few percent of the second quarter's (the first quarter is warm-up).
//! Not part of `--quick` (it runs for many minutes): `grove-bench --only soak [--soak-cycles N]`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use groved::client::{Client, ClientError};
use hyper::Method;
use serde_json::{json, Value};

use super::Ctx;
use crate::groved::Daemon;
use crate::plot::{self, Series};
use crate::progress;
use crate::report::{Better, Key, Measurement, ScenarioResult};
use crate::stats::median;

pub const NAME: &str = "soak";
/// Concurrent API clients (each runs whole cycles).
const CLIENTS: u64 = 4;
/// Samples over the run (plus one before the first cycle).
const SAMPLES: u64 = 100;
/// Flatness: last-quarter median RSS at most this much above the second quarter's.
const RSS_SLACK: f64 = 0.05;
/// Flatness: last-quarter median open fds at most this many above the second quarter's.
const FD_SLACK: f64 = 2.0;

/// One workload and how its result must look.
struct Workload {
    name: &'static str,
    shell: &'static str,
    expect: fn(&Value) -> bool,
}

fn exit_code(r: &Value) -> Option<i64> {
    r["exit_code"].as_i64()
}

const WORKLOADS: &[Workload] = &[
    Workload {
        name: "fork bomb at the pids limit",
        shell: "f() { f | f & }; f >/dev/null 2>&1 </dev/null; sleep 0.5; echo survived",
        expect: |r| r["timed_out"] == false,
    },
    Workload {
        name: "memory hog (OOM-killed)",
        shell: "python3 -c \"b = b'x' * (256 << 20)\"",
        expect: |r| exit_code(r) != Some(0),
    },
    Workload {
        name: "setsid nohup daemon",
        shell: "setsid nohup sleep 1000 >/dev/null 2>&1 </dev/null & echo started",
        expect: |r| exit_code(r) == Some(0),
    },
    Workload {
        name: "/dev/shm filler",
        shell: "head -c 16M /dev/zero >/dev/shm/fill && ls -l /dev/shm/fill",
        expect: |r| exit_code(r) == Some(0),
    },
    Workload {
        name: "listening socket",
        shell: "nohup python3 -c 'import socket, time; s = socket.socket(); \
                s.bind((\"127.0.0.1\", 8080)); s.listen(); time.sleep(1000)' \
                >/dev/null 2>&1 & sleep 0.3; echo listening",
        expect: |r| exit_code(r) == Some(0),
    },
    Workload {
        name: "file writes (API upload + shell)",
        shell: "for i in 1 2 3 4 5 6 7 8; do head -c 65536 /dev/urandom >/tmp/f$i; done; \
                wc -c </upload.bin",
        expect: |r| {
            exit_code(r) == Some(0) && r["stdout"].as_str().map(str::trim) == Some("1048576")
        },
    },
];

#[derive(Debug, Clone, Copy)]
struct Sample {
    cycle: u64,
    secs: f64,
    rss_kib: u64,
    fds: u64,
    /// The same of grove-fsd, the process serving the sandboxes' roots (0 when not found).
    fsd_rss_kib: u64,
    fsd_fds: u64,
}

/// Counters shared by the clients.
#[derive(Default)]
struct Tally {
    done: AtomicU64,
    unexpected: Mutex<Vec<String>>,
    errors: Mutex<Vec<String>>,
    samples: Mutex<Vec<Sample>>,
    /// Which workload each sandbox ran, to say what a leftover came from.
    workload_of: Mutex<HashMap<String, &'static str>>,
}

pub fn run(ctx: &Ctx, res: &mut ScenarioResult) -> Result<()> {
    let cycles = ctx
        .soak_cycles
        .unwrap_or(ctx.pick(120, 10_000))
        .max(CLIENTS);
    let mut daemon = Daemon::start(
        ctx,
        "soak",
        "10.217.0.0/16",
        "[capacity]\nsandboxes = 64\nmemory_reserve_mb = 0\n\
         [defaults]\ncpu_millis = 500\nmemory_mb = 64\npids = 32\nopen_files = 256\ndisk_mb = 64\n",
    )?;
    let client = Client::new(daemon.socket());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let tally = Arc::new(Tally::default());
    let start = Instant::now();
    let outcome = rt.block_on(drive(&daemon, &client, ctx, cycles, tally.clone(), start));
    let residue = rt.block_on(api_residue(&client));
    drop(rt);
    let stopped = daemon.stop();
    let wall = start.elapsed().as_secs_f64();
    let host_left = host_residue(&daemon);

    let samples = tally.samples.lock().unwrap().clone();
    write_csv(&ctx.out.join("soak.csv"), &samples)?;
    plot_samples(ctx, res, &samples)?;
    let done = tally.done.load(Ordering::SeqCst);
    let param = format!("{done} cycles, {CLIENTS} clients");
    res.push(Measurement::value(
        &Key::new(
            "cycles per second (create → workload → destroy)",
            &param,
            "1/s",
            Better::Higher,
        ),
        "grove (groved API)",
        true,
        done as f64 / wall,
    ));
    let metrics: [(&str, &str, Metric); 4] = [
        ("groved RSS, 2nd-quarter median", "MiB", |x| {
            x.rss_kib as f64 / 1024.0
        }),
        ("groved open fds, 2nd-quarter median", "fds", |x| {
            x.fds as f64
        }),
        ("grove-fsd RSS, 2nd-quarter median", "MiB", |x| {
            x.fsd_rss_kib as f64 / 1024.0
        }),
        ("grove-fsd open fds, 2nd-quarter median", "fds", |x| {
            x.fsd_fds as f64
        }),
    ];
    let mut growth = Vec::new();
    for (metric, unit, f) in metrics {
        let (q2, q4) = quarters(&samples, f);
        let grew = if unit == "MiB" {
            q4 > q2 * (1.0 + RSS_SLACK)
        } else {
            q4 > q2 + FD_SLACK
        };
        if grew || q2.is_nan() || q4.is_nan() {
            growth.push(format!("{metric}: {q2:.1} → last quarter {q4:.1} {unit}"));
        }
        res.push(Measurement::value(
            &Key::new(metric, &param, unit, Better::Lower),
            "grove (groved API)",
            true,
            q2,
        ));
        res.push(Measurement::value(
            &Key::new(&metric.replace("2nd", "last"), &param, unit, Better::Lower),
            "grove (groved API)",
            true,
            q4,
        ));
    }
    let unexpected = tally.unexpected.lock().unwrap().clone();
    let errors = tally.errors.lock().unwrap().clone();
    res.note(format!(
        "{done} cycles in {wall:.0} s; workloads in turn: {}; unexpected workload results: {}; API errors: {}",
        WORKLOADS.iter().map(|w| w.name).collect::<Vec<_>>().join(", "),
        unexpected.len(),
        errors.len()
    ));
    res.note(
        "samples of groved's and grove-fsd's VmRSS and /proc/<pid>/fd count: soak.csv".to_string(),
    );

    let mut failures = Vec::new();
    if let Err(e) = outcome {
        failures.push(format!("{e:#}"));
    }
    if let Err(e) = stopped {
        failures.push(format!("stopping groved: {e:#}"));
    }
    match residue {
        Ok(items) if items.is_empty() => {}
        Ok(items) => {
            let of = tally.workload_of.lock().unwrap();
            let items: Vec<String> = items
                .iter()
                .map(|i| {
                    let w = of
                        .iter()
                        .find(|(id, _)| i.contains(id.as_str()))
                        .map(|(_, w)| *w);
                    format!("{i} ({})", w.unwrap_or("?"))
                })
                .collect();
            failures.push(format!("groved reports residue: {}", items.join("; ")));
        }
        Err(e) => failures.push(format!("residue query: {e:#}")),
    }
    if !host_left.is_empty() {
        failures.push(format!("left on the host: {}", host_left.join("; ")));
    }
    for g in growth {
        failures.push(format!(
            "grew (or was not sampled) beyond {:.0} % / {FD_SLACK} fds: {g}",
            RSS_SLACK * 100.0
        ));
    }
    for (what, list) in [
        ("unexpected workload result", &unexpected),
        ("API error", &errors),
    ] {
        if let Some(first) = list.first() {
            failures.push(format!("{} {what}s, first: {first}", list.len()));
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        let log = ctx.out.join("soak-groved.log");
        if std::fs::copy(daemon.dir.join("groved.log"), &log).is_ok() {
            res.note(format!("groved's log: {}", log.display()));
        }
        bail!(failures.join(" | "))
    }
}

async fn drive(
    d: &Daemon,
    client: &Client,
    ctx: &Ctx,
    cycles: u64,
    tally: Arc<Tally>,
    start: Instant,
) -> Result<()> {
    let image = ctx.image.to_string_lossy().into_owned();
    progress::step(0.0, "soak: importing the base image into groved's store");
    client
        .call(
            Method::POST,
            "/v1/images",
            Some(&json!({"name": "base", "source": "dir", "path": image})),
        )
        .await
        .context("importing the base image")?;
    let fsd = fsd_pid(d).context("no grove-fsd serving this groved")?;
    tally
        .samples
        .lock()
        .unwrap()
        .push(sample_pids(d.pid(), fsd, 0, start)?);
    let every = (cycles / SAMPLES).max(1);
    let next = Arc::new(AtomicU64::new(0));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..CLIENTS {
        let (client, tally, next) = (client.clone(), tally.clone(), next.clone());
        let pid = d.pid();
        set.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= cycles || crate::cleanup::cancelled() {
                    return;
                }
                let w = &WORKLOADS[(i % WORKLOADS.len() as u64) as usize];
                match cycle(&client, w, &tally).await {
                    Ok(r) if (w.expect)(&r) => {}
                    Ok(r) => tally
                        .unexpected
                        .lock()
                        .unwrap()
                        .push(format!("cycle {i} {}: {r}", w.name)),
                    Err(e) => tally
                        .errors
                        .lock()
                        .unwrap()
                        .push(format!("cycle {i} {}: {e:#}", w.name)),
                }
                let n = tally.done.fetch_add(1, Ordering::SeqCst) + 1;
                if n % every == 0 || n == cycles {
                    if let Ok(s) = sample_pids(pid, fsd, n, start) {
                        tally.samples.lock().unwrap().push(s);
                    }
                    progress::step(
                        n as f64 / cycles as f64,
                        &format!("soak: {n}/{cycles} cycles"),
                    );
                }
            }
        });
    }
    while set.join_next().await.is_some() {}
    tally.samples.lock().unwrap().sort_by_key(|s| s.cycle);
    crate::cleanup::check()
}

fn sample_pids(groved: u32, fsd: u32, cycle: u64, start: Instant) -> Result<Sample> {
    let (rss_kib, fds) = rss_and_fds(groved)?;
    let (fsd_rss_kib, fsd_fds) = rss_and_fds(fsd)?;
    Ok(Sample {
        cycle,
        secs: start.elapsed().as_secs_f64(),
        rss_kib,
        fds,
        fsd_rss_kib,
        fsd_fds,
    })
}

/// VmRSS (KiB) and open fds of `pid`.
fn rss_and_fds(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow!("no VmRSS for {pid}"))?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64;
    Ok((rss_kib, fds))
}

/// The grove-fsd serving `d` (its command line names the socket in `d`'s run dir).
fn fsd_pid(d: &Daemon) -> Option<u32> {
    let run = d.dir.join("run");
    let run = run.to_string_lossy();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        (cmd.contains("grove-fsd") && cmd.contains(run.as_ref())).then_some(pid)
    })
}

/// One cycle: create, run the workload, destroy (always, even when the workload failed).
async fn cycle(c: &Client, w: &Workload, tally: &Tally) -> Result<Value> {
    let sb: Value = c
        .json(
            Method::POST,
            "/v1/sandboxes",
            Some(&json!({"image": "base", "labels": {"soak": "1"}})),
        )
        .await?;
    let id = sb["id"]
        .as_str()
        .ok_or_else(|| anyhow!("no id in {sb}"))?
        .to_string();
    tally.workload_of.lock().unwrap().insert(id.clone(), w.name);
    let r = workload(c, &id, w).await;
    let del = c
        .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .await;
    let r = r?;
    del.with_context(|| format!("deleting {id}"))?;
    Ok(r)
}

async fn workload(c: &Client, id: &str, w: &Workload) -> Result<Value> {
    if w.shell.contains("/upload.bin") {
        let body = hyper::body::Bytes::from(vec![7u8; 1 << 20]);
        let resp = c
            .send(
                Method::PUT,
                &format!("/v1/sandboxes/{id}/files?path=/upload.bin"),
                Some("application/octet-stream"),
                body,
            )
            .await?;
        groved::client::check(resp).await?;
    }
    let r: Value = c
        .json(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(&json!({"shell": w.shell, "timeout_ms": 20_000})),
        )
        .await
        .map_err(|e: ClientError| anyhow!(e))?;
    Ok(r)
}

pub(super) async fn api_residue(c: &Client) -> Result<Vec<String>> {
    let r: Value = c.json(Method::GET, "/v1/node/residue", None).await?;
    Ok(r["items"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|i| format!("{} {}", i["kind"], i["what"]))
                .collect()
        })
        .unwrap_or_default())
}

/// What the stopped daemon must not leave: its cgroup dirs, mounts under its dirs, its run dir.
pub(super) fn host_residue(d: &Daemon) -> Vec<String> {
    let mut left = Vec::new();
    if let Ok(hier) = std::fs::read_dir("/sys/fs/cgroup") {
        for h in hier.flatten() {
            let p = h.path().join(&d.cgroup_root);
            if p.exists() {
                left.push(format!("cgroup {}", p.display()));
            }
        }
    }
    let p = Path::new("/sys/fs/cgroup").join(&d.cgroup_root);
    if p.exists() {
        left.push(format!("cgroup {}", p.display()));
    }
    let dir = d.dir.to_string_lossy().into_owned();
    if let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") {
        for l in mi.lines() {
            if let Some(mp) = l.split(' ').nth(4) {
                if mp.starts_with(&dir) {
                    left.push(format!("mount {mp}"));
                }
            }
        }
    }
    if let Some(pid) = fsd_pid(d) {
        left.push(format!("grove-fsd still running (pid {pid})"));
    }
    if d.dir.join("run").exists() {
        let entries: Vec<String> = std::fs::read_dir(d.dir.join("run"))
            .map(|r| {
                r.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        left.push(format!(
            "run dir {} ({})",
            d.dir.join("run").display(),
            entries.join(", ")
        ));
    }
    left
}

/// One figure of a sample.
type Metric = fn(&Sample) -> f64;

/// Medians of `f` over the second and the last quarter of the samples (by cycle).
fn quarters(s: &[Sample], f: Metric) -> (f64, f64) {
    let last = s.last().map(|x| x.cycle).unwrap_or(0) as f64;
    let q = |lo: f64, hi: f64| {
        let v: Vec<f64> = s
            .iter()
            .filter(|x| (x.cycle as f64) > lo * last && (x.cycle as f64) <= hi * last)
            .map(f)
            .collect();
        median(&v).unwrap_or(f64::NAN)
    };
    (q(0.25, 0.5), q(0.75, 1.0))
}

fn write_csv(path: &Path, s: &[Sample]) -> Result<()> {
    let mut out = String::from("cycle,seconds,rss_kib,open_fds,fsd_rss_kib,fsd_open_fds\n");
    for x in s {
        let _ = writeln!(
            out,
            "{},{:.1},{},{},{},{}",
            x.cycle, x.secs, x.rss_kib, x.fds, x.fsd_rss_kib, x.fsd_fds
        );
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

fn plot_samples(ctx: &Ctx, res: &mut ScenarioResult, s: &[Sample]) -> Result<()> {
    let series = |name: &str, f: fn(&Sample) -> f64| Series {
        name: name.into(),
        points: s.iter().map(|x| (x.cycle as f64, f(x))).collect(),
    };
    let charts = [
        (
            "soak-rss.svg",
            "groved and grove-fsd resident memory over the soak",
            "RSS (MiB)",
            [
                series("groved VmRSS", |x| x.rss_kib as f64 / 1024.0),
                series("grove-fsd VmRSS", |x| x.fsd_rss_kib as f64 / 1024.0),
            ],
        ),
        (
            "soak-fds.svg",
            "groved and grove-fsd open file descriptors over the soak",
            "open fds",
            [
                series("groved /proc/<pid>/fd", |x| x.fds as f64),
                series("grove-fsd /proc/<pid>/fd", |x| x.fsd_fds as f64),
            ],
        ),
    ];
    for (file, title, y, ser) in charts {
        plot::line_chart(&ctx.out.join(file), title, "cycle", y, &ser, false)
            .map_err(|e| anyhow!("plot {file}: {e}"))?;
        res.plots.push(file.into());
    }
    Ok(())
}
