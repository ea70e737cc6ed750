//! A runtime that goes away without destroying its sandboxes (a crash) leaves them behind; the
//! next Runtime::new on the same config removes all of it (root).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use grove_runtime::{ExecRequest, NetworkPolicy, OverlayRoot, Runtime};

#[test]
fn new_runtime_cleans_a_crashed_runs_residue() {
    if !can_run() {
        return;
    }
    let forward_before = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap();
    let cfg = config("grove-rtest-crash");
    let rt = Runtime::new(cfg.clone(), Arc::new(OverlayRoot::new(STATE_DIR))).unwrap();
    let mut pids = Vec::new();
    for _ in 0..2 {
        let info = rt.create(spec()).unwrap();
        let mut bg = ExecRequest::shell("setsid sleep 1000 & sleep 1000");
        bg.background = true;
        rt.exec(&info.id, bg).unwrap();
        pids.push(info.init_pid.unwrap());
    }
    let mut s = spec();
    s.network = NetworkPolicy::Egress { allow: vec![] };
    let egress = rt.create(s);
    drop(rt); // no shutdown: everything stays, as after a crash

    let rt = Runtime::new(cfg, Arc::new(OverlayRoot::new(STATE_DIR))).unwrap();
    assert!(rt.residue().items.is_empty(), "{:#?}", rt.residue().items);
    for pid in pids {
        // The old inits were our children (subreaper): reap them, then they must be gone.
        let deadline = Instant::now() + Duration::from_secs(2);
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        while std::path::Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "init {pid} survived"
        );
    }
    if let Ok(info) = egress {
        let link = format!("grove{}", &info.id.as_str()[3..13]);
        assert!(!std::path::Path::new("/sys/class/net").join(link).exists());
    }
    rt.shutdown();
    std::fs::write("/proc/sys/net/ipv4/ip_forward", forward_before).unwrap();
    assert!(!std::path::Path::new("/run/grove-rtest-crash").exists());
}
