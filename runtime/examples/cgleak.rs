//! Hunt for cgroup dirs left after destroy: W threads create → exec → destroy, checking the
//! sandbox's cgroup dirs right after each destroy and once more at the end.
//! `cargo run -p grove-runtime --example cgleak -- CYCLES WORKERS`

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use grove_runtime::{ExecRequest, Limits, OverlayRoot, Runtime, RuntimeConfig, SandboxSpec};

const ROOT: &str = "grove-cgleak";

fn dirs(id: &str) -> Vec<String> {
    ["memory", "pids", "cpu", "unified"]
        .iter()
        .map(|h| format!("/sys/fs/cgroup/{h}/{ROOT}/{id}"))
        .filter(|p| Path::new(p).exists())
        .collect()
}

fn main() {
    let a: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|s| s.parse().ok())
        .collect();
    let (cycles, workers) = (
        a.first().copied().unwrap_or(200),
        a.get(1).copied().unwrap_or(4),
    );
    let mut cfg = RuntimeConfig::default_paths();
    cfg.state_dir = "/var/lib/grove".into();
    cfg.run_dir = "/run/grove-cgleak".into();
    cfg.cgroup_root = ROOT.into();
    cfg.net_pool = "10.231.0.0/16".into();
    let rt = Runtime::new(cfg, Arc::new(OverlayRoot::new("/var/lib/grove"))).expect("runtime");
    let next = AtomicUsize::new(0);
    let leaks = parking_lot::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let c = next.fetch_add(1, Ordering::Relaxed);
                if c >= cycles {
                    break;
                }
                let mut spec = SandboxSpec::from_image("debian12");
                spec.limits = Some(Limits {
                    cpu_millis: 500,
                    memory_mb: 64,
                    pids: 64,
                    open_files: 256,
                    disk_mb: 64,
                });
                let info = match rt.create(spec) {
                    Ok(i) => i,
                    Err(e) => {
                        eprintln!("create: {e}");
                        continue;
                    }
                };
                let sh = match c % 3 {
                    0 => "f(){ f | f & }; f; sleep 0.2",
                    1 => "setsid nohup sleep 100000 >/dev/null 2>&1 </dev/null & true",
                    _ => "true",
                };
                let mut r = ExecRequest::shell(sh);
                r.timeout_ms = Some(5000);
                let _ = rt.exec(&info.id, r);
                if let Err(e) = rt.destroy(&info.id) {
                    eprintln!("destroy {}: {e}", info.id);
                }
                let left = dirs(info.id.as_str());
                if !left.is_empty() {
                    eprintln!("LEAK right after destroy (cycle {c}): {left:?}");
                }
                leaks.lock().push(info.id.to_string());
            });
        }
    });
    std::thread::sleep(std::time::Duration::from_secs(1));
    let ids = leaks.lock().clone();
    let mut n = 0;
    for id in &ids {
        let left = dirs(id);
        if !left.is_empty() {
            n += 1;
            eprintln!("LEAK at end: {left:?}");
        }
    }
    eprintln!(
        "{} cycles, {n} leaked; residue: {:?}",
        ids.len(),
        rt.residue()
    );
    rt.shutdown();
}
