//! create → exec `true` → destroy on nodefs or overlay roots: sequential phases, then cycles/s
//! with C concurrent clients over a fixed window. A quick loop for profiling the lifecycle (the
//! quoted figures come from `grove-bench --only lifecycle`).
//! Run as root: `cargo run --release -p grove-snapshotter --example cycles -- [nodefs|overlay] [SECS] [C...]`
//! `... -- nodefs SECS burst N` instead makes N idle sandboxes and tears them down four at a time,
//! then lists the cgroup dirs left (the density teardown of issue 4). The image is imported into a
//! store under /var/tmp that is removed at the end. `GROVE_INIT_BINARY` picks the grove-init
//! (default: the one beside the example's directory); `CYCLES_RUN_DIR` the run dir (default
//! /run/grove-cycles-ex); `NODEFS_URING=0` puts the roots on /dev/fuse instead of FUSE io_uring.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grove_nodefs_root::NodefsRoot;
use grove_runtime::{ExecRequest, OverlayRoot, RootProvider, Runtime, RuntimeConfig, SandboxSpec};
use nodefs::{NodeFs, Store};

const IMAGE: &str = "/var/lib/grove/images/debian12";

fn store_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(format!("/var/tmp/grove-cycles-{}", std::process::id()))
}

fn roots(kind: &str) -> Arc<dyn RootProvider> {
    if kind == "overlay" {
        return Arc::new(OverlayRoot::new("/var/lib/grove"));
    }
    let store = Store::open(&store_dir()).expect("store");
    let id = store.import_dir(Path::new(IMAGE)).expect("import");
    store.set_ref("debian12", &id).expect("set_ref");
    let svc = Arc::new(nodefs::service::Local::new(NodeFs::with_options(
        store,
        nodefs::ServerOptions::from_env(),
    )));
    Arc::new(NodefsRoot::new(svc, store_dir().join("uppers")))
}

fn cycle(rt: &Runtime) -> [f64; 3] {
    let t0 = Instant::now();
    let info = rt
        .create(SandboxSpec::from_image("debian12"))
        .expect("create");
    let t1 = Instant::now();
    let r = rt
        .exec(&info.id, ExecRequest::argv(["true"]))
        .expect("exec");
    assert_eq!(r.exit_code, Some(0));
    let t2 = Instant::now();
    rt.destroy(&info.id).expect("destroy");
    let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
    [ms(t0, t1), ms(t1, t2), ms(t2, Instant::now())]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let kind = args.first().cloned().unwrap_or_else(|| "nodefs".into());
    let secs: f64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(4.0);
    let clients: Vec<usize> = args.iter().skip(2).filter_map(|s| s.parse().ok()).collect();
    let clients = if clients.is_empty() {
        vec![1, 2, 8]
    } else {
        clients
    };
    let mut cfg = RuntimeConfig::default_paths();
    if let Some(init) = std::env::var_os("GROVE_INIT_BINARY") {
        cfg.init_binary = init.into();
    }
    cfg.run_dir =
        std::env::var_os("CYCLES_RUN_DIR").map_or("/run/grove-cycles-ex".into(), Into::into);
    cfg.cgroup_root = "grove-cycles-ex".into();
    cfg.net_pool = "10.232.0.0/16".into();
    let rt = Runtime::new(cfg, roots(&kind)).expect("runtime");
    if let Some(n) = args
        .iter()
        .position(|a| a == "burst")
        .and_then(|i| args.get(i + 1))
    {
        burst(&rt, n.parse().expect("burst N"));
        rt.shutdown();
        drop(rt);
        let _ = std::fs::remove_dir_all(store_dir());
        return;
    }
    for _ in 0..3 {
        cycle(&rt);
    }
    let n = 40;
    let mut tot = Vec::new();
    let mut sum = [0f64; 3];
    for _ in 0..n {
        let p = cycle(&rt);
        tot.push(p.iter().sum::<f64>());
        for i in 0..3 {
            sum[i] += p[i];
        }
    }
    tot.sort_by(f64::total_cmp);
    println!(
        "{kind}: sequential p50 {:.1} ms; mean create {:.1} exec {:.1} destroy {:.1} ms",
        tot[n / 2],
        sum[0] / n as f64,
        sum[1] / n as f64,
        sum[2] / n as f64
    );
    for c in clients {
        let stop = AtomicBool::new(false);
        let done = AtomicUsize::new(0);
        let t = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..c {
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        cycle(&rt);
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
            std::thread::sleep(Duration::from_secs_f64(secs));
            stop.store(true, Ordering::Relaxed);
        });
        let d = done.load(Ordering::Relaxed);
        println!(
            "{kind}: {c} clients: {d} cycles in {:.2} s = {:.1}/s",
            t.elapsed().as_secs_f64(),
            d as f64 / t.elapsed().as_secs_f64()
        );
    }
    let left = rt.residue();
    rt.shutdown();
    drop(rt);
    let _ = std::fs::remove_dir_all(store_dir());
    assert!(left.items.is_empty(), "{left:?}");
}

/// Names under the sandbox cgroup parents, read from the directory listings.
fn listed_cgroups() -> Vec<String> {
    let mut v = Vec::new();
    for h in ["memory", "pids", "cpu", "unified"] {
        let p = format!("/sys/fs/cgroup/{h}/grove-cycles-ex");
        if let Ok(rd) = std::fs::read_dir(&p) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    v.push(format!("{h}/{}", e.file_name().to_string_lossy()));
                }
            }
        }
    }
    v
}

/// N sandboxes running `sleep infinity`, made by 4 threads, then destroyed by 4 threads; reports
/// the cgroup dirs still listed afterwards (the density teardown that left cpu/pids dirs).
fn burst(rt: &Runtime, n: usize) {
    let ids = parking_lot::Mutex::new(Vec::new());
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                while next.fetch_add(1, Ordering::Relaxed) < n {
                    let mut spec = SandboxSpec::from_image("debian12");
                    spec.limits = Some(grove_runtime::Limits {
                        cpu_millis: 10,
                        memory_mb: 16,
                        pids: 16,
                        open_files: 64,
                        disk_mb: 16,
                    });
                    let info = match rt.create(spec) {
                        Ok(i) => i,
                        Err(e) => {
                            eprintln!("create: {e} (tearing down what exists)");
                            next.store(n, Ordering::Relaxed);
                            break;
                        }
                    };
                    ids.lock().push(info.id.clone());
                    let mut r = ExecRequest::argv(["sleep", "infinity"]);
                    r.background = true;
                    if let Err(e) = rt.exec(&info.id, r) {
                        eprintln!("exec in {}: {e}", info.id);
                    }
                }
            });
        }
    });
    let t = Instant::now();
    let q = parking_lot::Mutex::new(ids.into_inner());
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| loop {
                let Some(id) = q.lock().pop() else { break };
                if let Err(e) = rt.destroy(&id) {
                    eprintln!("destroy {id}: {e}");
                }
            });
        }
    });
    let left = listed_cgroups();
    println!(
        "burst {n}: destroyed in {:.2} s; cgroup dirs still listed: {} {:?}",
        t.elapsed().as_secs_f64(),
        left.len(),
        &left[..left.len().min(8)]
    );
}
