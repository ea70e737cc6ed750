//! Shared setup for the runtime's root-only integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use grove_runtime::{
    ExecRequest, ExecResult, OverlayRoot, Runtime, RuntimeConfig, SandboxId, SandboxSpec,
};

pub const IMAGE: &str = "debian12";
pub const STATE_DIR: &str = "/var/lib/grove";

/// A config of its own (run dir, cgroup root, nft table, address pool) so these tests never touch
/// a groved running on the same machine.
pub fn config(instance: &str) -> RuntimeConfig {
    exclusive();
    let mut c = RuntimeConfig::default_paths();
    c.state_dir = PathBuf::from(STATE_DIR);
    c.run_dir = PathBuf::from(format!("/run/{instance}"));
    c.cgroup_root = instance.to_string();
    c.init_binary = PathBuf::from(env!("CARGO_BIN_EXE_grove-init"));
    c.net_pool = "10.211.0.0/16".into();
    c
}

/// Serializes test processes of this crate across the host (another `cargo test` of this crate,
/// e.g. a CI trial in another checkout, uses the same instance names: its runtime would clean up
/// ours at start and each would see the other's sandboxes). Held until the process exits.
fn exclusive() {
    static LOCK: OnceLock<Option<std::fs::File>> = OnceLock::new();
    LOCK.get_or_init(|| {
        let dir = std::fs::File::open(STATE_DIR).ok()?;
        // SAFETY: flock(2) on a descriptor owned by `dir`, which lives as long as the process.
        let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&dir), libc::LOCK_EX) };
        (rc == 0).then_some(dir)
    });
}

/// Whether the machine can run these tests at all; if not, says so loudly.
pub fn can_run() -> bool {
    let ok = nix::unistd::geteuid().is_root()
        && PathBuf::from(STATE_DIR)
            .join("images")
            .join(IMAGE)
            .join("bin/sh")
            .exists();
    if !ok {
        capability_missing(&format!(
            "needs root and the base image {STATE_DIR}/images/{IMAGE}"
        ));
    }
    ok
}

#[allow(unused_imports)] // not every test binary skips
pub use grove_testkit::capability_missing;

/// One runtime per test binary (tests in it run in parallel threads).
pub fn rt() -> Arc<Runtime> {
    static RT: OnceLock<Arc<Runtime>> = OnceLock::new();
    RT.get_or_init(|| {
        let roots = Arc::new(OverlayRoot::new(STATE_DIR));
        let rt = Runtime::new(config("grove-rtest"), roots).expect("runtime");
        // SAFETY: registering a plain extern "C" fn with no captured state.
        unsafe { libc::atexit(remove_parents) };
        rt
    })
    .clone()
}

/// At exit of the test binary: drop the (empty) parent cgroup dirs and run dir this instance made.
extern "C" fn remove_parents() {
    for ctrl in [
        "memory", "pids", "cpu", "cpuacct", "devices", "freezer", "unified",
    ] {
        let _ = std::fs::remove_dir(format!("/sys/fs/cgroup/{ctrl}/grove-rtest"));
    }
    // The runtime's init copy (its tmpfs): a runtime that is never shut down leaves it mounted.
    let _ = nix::mount::umount2("/run/grove-rtest/init", nix::mount::MntFlags::MNT_DETACH);
    let _ = std::fs::remove_dir("/run/grove-rtest/init");
    let _ = std::fs::remove_dir("/run/grove-rtest/sandboxes");
    let _ = std::fs::remove_dir("/run/grove-rtest");
}

pub fn spec() -> SandboxSpec {
    SandboxSpec::from_image(IMAGE)
}

pub fn sh(rt: &Runtime, id: &SandboxId, cmd: &str) -> ExecResult {
    rt.exec(id, ExecRequest::shell(cmd)).expect("exec")
}

pub fn out(r: &ExecResult) -> String {
    String::from_utf8_lossy(&r.stdout).trim().to_string()
}

/// Asserts nothing of `id` is left, and that the runtime reports no residue apart from other live
/// sandboxes (which residue() never lists).
pub fn assert_gone(rt: &Runtime, id: &SandboxId) {
    let r = rt.residue();
    assert!(r.items.is_empty(), "residue after {id}: {:#?}", r.items);
    let cg = rt.config().cgroup_root.clone();
    for ctrl in ["memory", "pids", "cpu", "devices", "unified"] {
        let d = PathBuf::from(format!("/sys/fs/cgroup/{ctrl}/{cg}/{id}"));
        assert!(!d.exists(), "{} left", d.display());
    }
    assert!(!rt
        .config()
        .run_dir
        .join("sandboxes")
        .join(id.as_str())
        .exists());
}

/// A restore stand-in for tests without CRIU: starts a plain grove-init into the target (its root
/// and cgroups) the way CRIU would restore one, and returns its host pid.
pub fn start_init_into(
    t: &grove_runtime::RestoreTarget,
    hostname: &str,
) -> Result<i32, Box<dyn std::error::Error + Send + Sync>> {
    let procs: Vec<String> = t
        .cgroups
        .iter()
        .map(|(c, p)| format!("/sys/fs/cgroup/{c}{}/cgroup.procs", p.display()))
        .collect();
    let cfg = grove_runtime::proto::SetupConfig {
        root: t.root_dir.display().to_string(),
        hostname: hostname.into(),
        cgroup_procs: procs,
        init_binary: t.externals[0].host_path.display().to_string(),
        tmp_size_mb: 16,
        shm_size_mb: 16,
        open_files: 1024,
        new_netns: true,
        extra_caps: Vec::new(),
        userns: false,
    };
    let init = &t.externals[0].host_path;
    Ok(grove_runtime::spawner::spawn_init(
        init,
        &cfg,
        "test-restore",
        t.id.as_str(),
        None,
    )?)
}
