//! `RealFs::wait_until` on a real cgroup2 `cgroup.events`: it wakes on the change itself.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use grove_runtime::cgroup::{CgroupFs, RealFs};

/// A cgroup2 hierarchy to work in: the host's unified mount (v1 hosts) or its root (v2 hosts).
fn cgroup2_root() -> Option<PathBuf> {
    ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.join("cgroup.events").exists() || p.join("cgroup.subtree_control").exists())
}

#[test]
fn wait_until_wakes_when_the_cgroup_empties() {
    let root = match cgroup2_root() {
        Some(r) if nix::unistd::geteuid().is_root() => r,
        _ => {
            grove_testkit::capability_missing("needs root and a cgroup2 hierarchy");
            return;
        }
    };
    let dir = root.join(format!("grove-test-events-{}", std::process::id()));
    let fs = RealFs;
    fs.mkdir(&dir).expect("mkdir");
    let mut child = std::process::Command::new("sleep")
        .arg("0.3")
        .spawn()
        .expect("spawn sleep");
    let moved = fs.write(&dir.join("cgroup.procs"), &child.id().to_string());
    let events = dir.join("cgroup.events");
    let empty = |t: &str| t.lines().any(|l| l == "populated 0");
    let start = Instant::now();
    let woke = moved.and_then(|_| fs.wait_until(&events, &empty, Duration::from_secs(5)));
    let took = start.elapsed();
    let _ = child.wait();
    let _ = fs.rmdir(&dir);
    assert!(woke.expect("wait_until"), "never saw populated 0");
    // The sleeper lives 0.3 s; the waiter wakes right after, not at a nap's or the timeout's end.
    assert!(
        took >= Duration::from_millis(250),
        "woke before the cgroup emptied: {took:?}"
    );
    assert!(took < Duration::from_millis(1000), "woke late: {took:?}");
    // A condition that never holds runs into the timeout and says so.
    fs.mkdir(&dir).expect("mkdir again");
    let never = fs.wait_until(
        &dir.join("cgroup.events"),
        &|_| false,
        Duration::from_millis(100),
    );
    let _ = fs.rmdir(&dir);
    assert!(!never.expect("wait_until"));
}
