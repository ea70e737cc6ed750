//! A runtime that goes away without destroying its sandboxes (a crash) leaves them running; the
//! next Runtime::new on the same config adopts those whose init and root survived (they keep
//! running and accept exec), reports the recorded ones it cannot adopt as failed, and reclaims
//! everything else, leaving no residue (root).

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use grove_runtime::{
    DiskQuota, Error, ExecRequest, NetworkPolicy, OverlayRoot, RootError, RootMount, RootProvider,
    Runtime, SandboxId, SandboxState,
};

/// Overlay roots that, like an in-process FUSE server, do not survive their runtime.
struct Unadoptable(OverlayRoot);

impl RootProvider for Unadoptable {
    fn mount_root(
        &self,
        id: &SandboxId,
        image: &str,
        target: &Path,
        disk: &DiskQuota,
        ids: Option<grove_runtime::userns::IdRange>,
    ) -> Result<Box<dyn RootMount>, RootError> {
        self.0.mount_root(id, image, target, disk, ids)
    }
    fn image_exists(&self, image: &str) -> bool {
        self.0.image_exists(image)
    }
}

fn egress_spec() -> grove_runtime::SandboxSpec {
    let mut s = spec();
    s.network = NetworkPolicy::Egress { allow: vec![] };
    s
}

fn sleeper(rt: &Runtime, id: &SandboxId) {
    let mut bg = ExecRequest::shell("setsid sleep 1000 & sleep 1000");
    bg.background = true;
    rt.exec(id, bg).unwrap();
}

/// Waits for `pid` (reaping it if it is our child) and asserts it is gone.
fn assert_dead(pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(2);
    let _ = nix::sys::wait::waitpid(
        nix::unistd::Pid::from_raw(pid),
        Some(nix::sys::wait::WaitPidFlag::WNOHANG),
    );
    while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        let _ = nix::sys::wait::waitpid(
            nix::unistd::Pid::from_raw(pid),
            Some(nix::sys::wait::WaitPidFlag::WNOHANG),
        );
    }
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "{pid} survived"
    );
}

fn link_of(id: &SandboxId) -> std::path::PathBuf {
    Path::new("/sys/class/net").join(format!("grove{}", &id.as_str()[3..13]))
}

#[test]
fn restart_adopts_live_sandboxes_and_reclaims_the_rest() {
    if !can_run() {
        return;
    }
    let forward_before = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap();
    let mut cfg = config("grove-rtest-adopt");
    cfg.net_pool = "10.212.0.0/16".into();
    let roots = || Arc::new(OverlayRoot::new(STATE_DIR));
    let rt = Runtime::new(cfg.clone(), roots()).unwrap();
    let live = rt.create(spec()).unwrap().id;
    sleeper(&rt, &live);
    rt.write_file(&live, "/tmp/kept", b"before", None).unwrap();
    let egress = rt.create(egress_spec()).unwrap();
    let dead = rt.create(spec()).unwrap();
    let dead_pid = dead.init_pid.unwrap();
    let half = rt.create(spec()).unwrap();
    let half_pid = half.init_pid.unwrap();
    // A dead init, and a create (or destroy) interrupted before its record was written.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(dead_pid),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    std::fs::remove_file(
        cfg.run_dir
            .join("sandboxes")
            .join(half.id.as_str())
            .join("sandbox.json"),
    )
    .unwrap();
    drop(rt); // no shutdown: everything stays, as after a crash
              // A run dir as runtimes made them before they were private.
    let live_dir = cfg.run_dir.join("sandboxes").join(live.as_str());
    let mode = |p: &Path| std::os::unix::fs::MetadataExt::mode(&std::fs::metadata(p).unwrap());
    std::fs::set_permissions(
        &live_dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();

    let rt = Runtime::new(cfg.clone(), roots()).unwrap();
    assert!(rt.residue().items.is_empty(), "{:#?}", rt.residue().items);
    assert_eq!(
        mode(&live_dir) & 0o777,
        0o700,
        "adopted run dir not made private"
    );
    // Adopted: running, its processes and files intact, exec works.
    assert_eq!(rt.get(&live).unwrap().state, SandboxState::Running);
    let ps = out(&sh(&rt, &live, "cat /tmp/kept; pgrep -c sleep"));
    assert_eq!(ps, "before2");
    assert_eq!(out(&sh(&rt, &egress.id, "echo up")), "up");
    assert!(link_of(&egress.id).exists());
    assert_eq!(rt.get(&egress.id).unwrap().address, egress.address);
    // The dead one is reported failed, and holds nothing.
    assert_eq!(rt.get(&dead.id).unwrap().state, SandboxState::Failed);
    assert!(matches!(
        rt.exec(&dead.id, ExecRequest::shell("true")),
        Err(Error::Conflict { .. })
    ));
    assert_dead(dead_pid);
    // The half-made one is gone without a trace.
    assert!(matches!(rt.get(&half.id), Err(Error::NotFound { .. })));
    assert_dead(half_pid);
    assert_eq!(rt.list().len(), 3);
    // A new egress sandbox gets its own address next to the adopted one.
    let second = rt.create(egress_spec()).unwrap();
    assert_ne!(second.address, egress.address);
    assert_eq!(out(&sh(&rt, &second.id, "echo up")), "up");

    // Still reported failed by a second restart; destroy forgets it.
    drop(rt);
    let rt = Runtime::new(cfg, roots()).unwrap();
    assert_eq!(rt.get(&dead.id).unwrap().state, SandboxState::Failed);
    for id in [&live, &egress.id, &dead.id, &second.id] {
        rt.destroy(id).unwrap();
    }
    assert!(rt.list().is_empty());
    assert!(rt.residue().items.is_empty(), "{:#?}", rt.residue().items);
    assert!(!link_of(&egress.id).exists());
    rt.shutdown();
    std::fs::write("/proc/sys/net/ipv4/ip_forward", forward_before).unwrap();
    assert!(!Path::new("/run/grove-rtest-adopt").exists());
}

#[test]
fn restart_reclaims_sandboxes_whose_roots_died_with_the_runtime() {
    if !can_run() {
        return;
    }
    let forward_before = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap();
    let cfg = config("grove-rtest-crash");
    let roots = || Arc::new(Unadoptable(OverlayRoot::new(STATE_DIR)));
    let rt = Runtime::new(cfg.clone(), roots()).unwrap();
    let mut made = Vec::new();
    for _ in 0..2 {
        let info = rt.create(spec()).unwrap();
        sleeper(&rt, &info.id);
        made.push(info);
    }
    made.push(rt.create(egress_spec()).unwrap());
    drop(rt);

    let rt = Runtime::new(cfg, roots()).unwrap();
    assert!(rt.residue().items.is_empty(), "{:#?}", rt.residue().items);
    for info in &made {
        assert_eq!(rt.get(&info.id).unwrap().state, SandboxState::Failed);
        assert_dead(info.init_pid.unwrap());
        assert!(!link_of(&info.id).exists());
        rt.destroy(&info.id).unwrap();
    }
    assert!(rt.list().is_empty());
    rt.shutdown();
    std::fs::write("/proc/sys/net/ipv4/ip_forward", forward_before).unwrap();
    assert!(!Path::new("/run/grove-rtest-crash").exists());
}
