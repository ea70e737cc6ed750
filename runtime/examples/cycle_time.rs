//! Rough timing of create → exec `true` → destroy (the real benchmark lives in bench/).
//! Run as root: cargo run -p grove-runtime --example cycle_time -- [N] [CLIENTS]

use std::sync::Arc;
use std::time::Instant;

use grove_runtime::{ExecRequest, OverlayRoot, Runtime, RuntimeConfig, SandboxSpec};

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let mut cfg = RuntimeConfig::default_paths();
    cfg.run_dir = "/run/grove-cycle".into();
    cfg.cgroup_root = "grove-cycle".into();
    let exe = std::env::current_exe().expect("exe");
    cfg.init_binary = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .join("grove-init");
    let rt = Runtime::new(cfg, Arc::new(OverlayRoot::new("/var/lib/grove"))).expect("runtime");
    let clients: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    if clients > 1 {
        let t = Instant::now();
        let handles: Vec<_> = (0..clients)
            .map(|_| {
                let rt = rt.clone();
                std::thread::spawn(move || {
                    for _ in 0..n / clients {
                        let info = rt
                            .create(SandboxSpec::from_image("debian12"))
                            .expect("create");
                        rt.exec(&info.id, ExecRequest::argv(["true"]))
                            .expect("exec");
                        rt.destroy(&info.id).expect("destroy");
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("client");
        }
        let done = n / clients * clients;
        println!(
            "{clients} clients: {done} cycles in {:.2}s = {:.0}/s",
            t.elapsed().as_secs_f64(),
            done as f64 / t.elapsed().as_secs_f64()
        );
        assert!(rt.residue().items.is_empty(), "{:?}", rt.residue());
        rt.shutdown();
        return;
    }
    let mut times = Vec::new();
    let mut phases = [0f64; 3];
    for _ in 0..n {
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
        let t3 = Instant::now();
        phases[0] += (t1 - t0).as_secs_f64() * 1e3;
        phases[1] += (t2 - t1).as_secs_f64() * 1e3;
        phases[2] += (t3 - t2).as_secs_f64() * 1e3;
        times.push((t3 - t0).as_secs_f64() * 1e3);
    }
    times.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    let p = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
    println!(
        "n={n} p50={:.1}ms p90={:.1}ms max={:.1}ms; mean create={:.1} exec={:.1} destroy={:.1} ms",
        p(0.5),
        p(0.9),
        p(1.0),
        phases[0] / n as f64,
        phases[1] / n as f64,
        phases[2] / n as f64
    );
    assert!(rt.residue().items.is_empty(), "{:?}", rt.residue());
    rt.shutdown();
}
