//! Density: N idle sandboxes alive at once (each its init + `sleep infinity`), the memory each
//! costs and the create rate, then everything torn down and checked for residue. The real figure
//! comes from bench/. Run as root:
//! `cargo run --release -p grove-runtime --example idle_mem -- [N] [--workers W] [--no-sleep]`
//!
//! Limits are small and the node's capacity is overridden, deliberately overcommitting memory:
//! limits are ceilings and these sandboxes sit idle. MemAvailable moves with whatever else runs on
//! the machine, so the sandboxes' own memory-cgroup charge and the kernel's slab/percpu/stack
//! growth are reported next to it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grove_runtime::{
    CapacityOverrides, ExecRequest, Limits, OverlayRoot, Runtime, RuntimeConfig, SandboxId,
    SandboxSpec,
};
use parking_lot::Mutex;

const CGROUP_ROOT: &str = "grove-idle";

/// `/proc/meminfo` fields in KiB.
fn meminfo(keys: &[&str]) -> Vec<u64> {
    let t = std::fs::read_to_string("/proc/meminfo").expect("meminfo");
    keys.iter()
        .map(|k| {
            t.lines()
                .find_map(|l| {
                    l.strip_prefix(k)?
                        .strip_prefix(':')?
                        .split_whitespace()
                        .next()?
                        .parse()
                        .ok()
                })
                .unwrap_or(0)
        })
        .collect()
}

/// Median of a few MemAvailable reads (free pages on per-CPU lists counted in), to damp other
/// jobs' swings.
fn mem_available_kb() -> u64 {
    let mut v: Vec<u64> = (0..5)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(200));
            grove_runtime::host_mem::available_kb().unwrap_or(0)
        })
        .collect();
    v.sort_unstable();
    v[2]
}

/// Kernel memory that grows with sandboxes: Slab + Percpu + KernelStack + PageTables (KiB).
fn kernel_kb() -> u64 {
    meminfo(&["Slab", "Percpu", "KernelStack", "PageTables"])
        .iter()
        .sum()
}

/// Memory charged to all sandboxes' cgroups together (v1 memory hierarchy, or v2).
fn charged_kb() -> u64 {
    [
        format!("/sys/fs/cgroup/memory/{CGROUP_ROOT}/memory.usage_in_bytes"),
        format!("/sys/fs/cgroup/{CGROUP_ROOT}/memory.current"),
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok())
    .unwrap_or(0)
        / 1024
}

fn main() {
    let mut n = 100usize;
    let mut workers = 2usize;
    let mut sleep = true;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--workers" => {
                workers = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--workers N")
            }
            "--no-sleep" => sleep = false,
            v => n = v.parse().expect("N"),
        }
    }
    let mut cfg = RuntimeConfig::default_paths();
    cfg.run_dir = "/run/grove-idle".into();
    cfg.cgroup_root = CGROUP_ROOT.into();
    let limits = Limits {
        memory_mb: 16,
        cpu_millis: 250,
        pids: 8,
        open_files: 64,
        disk_mb: 16,
    };
    let big = Some(1 << 40);
    cfg.capacity = CapacityOverrides {
        cpu_millis: big,
        memory_mb: big,
        pids: Some((n as u64 + 1) * u64::from(limits.pids)),
        open_files: big,
        disk_mb: big,
        sandboxes: Some(n as u64 + 1),
        memory_reserve_mb: None,
    };
    let rt = Runtime::new(cfg, Arc::new(OverlayRoot::new("/var/lib/grove"))).expect("runtime");
    let mut spec = SandboxSpec::from_image("debian12");
    spec.limits = Some(limits);

    let (avail0, kernel0) = (mem_available_kb(), kernel_kb());
    let ids: Mutex<Vec<SandboxId>> = Mutex::new(Vec::with_capacity(n));
    let next = AtomicUsize::new(0);
    let failure: Mutex<Option<String>> = Mutex::new(None);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..workers.max(1) {
            s.spawn(|| {
                while next.fetch_add(1, Ordering::Relaxed) < n && failure.lock().is_none() {
                    let made = rt.create(spec.clone()).map_err(|e| e.to_string());
                    let made = made.and_then(|info| {
                        ids.lock().push(info.id.clone());
                        if sleep {
                            let mut r = ExecRequest::argv(["sleep", "infinity"]);
                            r.background = true;
                            rt.exec(&info.id, r).map_err(|e| e.to_string())?;
                        }
                        Ok(())
                    });
                    if let Err(e) = made {
                        failure.lock().get_or_insert(e);
                    }
                }
            });
        }
    });
    let create_s = t0.elapsed().as_secs_f64();
    let alive = ids.lock().len();
    std::thread::sleep(Duration::from_secs(2));
    let (avail1, kernel1, charged) = (mem_available_kb(), kernel_kb(), charged_kb());
    let per = |kb: i64| kb as f64 / alive.max(1) as f64;
    println!(
        "{alive} idle sandboxes{} alive at once ({workers} workers): created in {create_s:.1}s = {:.0}/s",
        if sleep { " (init + sleep infinity)" } else { " (init only)" },
        alive as f64 / create_s
    );
    println!(
        "per sandbox: MemAvailable drop {:.0} KiB; charged to its cgroups {:.0} KiB; \
         kernel slab+percpu+stacks+pagetables {:.0} KiB",
        per(avail0 as i64 - avail1 as i64),
        per(charged as i64),
        per(kernel1 as i64 - kernel0 as i64)
    );
    if let Some(e) = failure.lock().as_ref() {
        println!("stopped at {alive}: {e}");
    }

    let t1 = Instant::now();
    let ids = ids.into_inner();
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..workers.max(1) {
            s.spawn(|| {
                while let Some(id) = ids.get(next.fetch_add(1, Ordering::Relaxed)) {
                    if let Err(e) = rt.destroy(id) {
                        eprintln!("destroy {id}: {e}");
                    }
                }
            });
        }
    });
    let destroy_s = t1.elapsed().as_secs_f64();
    rt.shutdown();
    std::thread::sleep(Duration::from_secs(2));
    let avail2 = mem_available_kb();
    let residue = rt.residue();
    println!(
        "destroyed all ({workers} workers) in {destroy_s:.1}s = {:.0}/s; MemAvailable before/alive/after (KiB): \
         {avail0} / {avail1} / {avail2}; residue: {} item(s)",
        alive as f64 / destroy_s,
        residue.items.len()
    );
    assert!(residue.items.is_empty(), "{:?}", residue.items);
    assert!(rt.list().is_empty(), "sandboxes left after shutdown");
    if failure.lock().is_some() {
        std::process::exit(1);
    }
}
