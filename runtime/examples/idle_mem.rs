//! Rough idle-sandbox memory: MemAvailable drop per sandbox over N idle sandboxes (the real figure
//! comes from bench/). Run as root: cargo run -p grove-runtime --example idle_mem -- [N]

use std::sync::Arc;

use grove_runtime::{Limits, OverlayRoot, Runtime, RuntimeConfig, SandboxSpec};

fn mem_available_kb() -> u64 {
    let t = std::fs::read_to_string("/proc/meminfo").expect("meminfo");
    t.lines()
        .find_map(|l| {
            l.strip_prefix("MemAvailable:")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .expect("MemAvailable")
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let mut cfg = RuntimeConfig::default_paths();
    cfg.run_dir = "/run/grove-idle".into();
    cfg.cgroup_root = "grove-idle".into();
    let exe = std::env::current_exe().expect("exe");
    cfg.init_binary = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .join("grove-init");
    let rt = Runtime::new(cfg, Arc::new(OverlayRoot::new("/var/lib/grove"))).expect("runtime");
    let before = mem_available_kb();
    let mut spec = SandboxSpec::from_image("debian12");
    spec.limits = Some(Limits {
        memory_mb: 64,
        cpu_millis: 100,
        disk_mb: 64,
        ..Limits::default()
    });
    for _ in 0..n {
        rt.create(spec.clone()).expect("create");
    }
    std::thread::sleep(std::time::Duration::from_secs(1));
    let after = mem_available_kb();
    println!(
        "{n} idle sandboxes: {} KiB MemAvailable drop each",
        (before.saturating_sub(after)) / n as u64
    );
    rt.shutdown();
    assert!(rt.residue().items.is_empty());
}
