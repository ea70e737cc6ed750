//! groved and grove-fsd run in cgroups of their own with memory limits (issue 24, break 6): a real
//! groved is started, SIGKILLed and restarted (the next start takes the same cgroups over), then
//! stopped; its cgroups are gone after the stop and never reported as residue, also when the stop
//! comes the moment groved answers.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use groved::client::Client;
use hyper::Method;

use common::{fsd_of, groved_bin, init_binary, leftovers, rand_suffix, BASE_IMAGE_DIR};

const GROVED_MB: u64 = 700;
const FSD_MB: u64 = 600;

fn runnable() -> bool {
    let ok = nix::unistd::geteuid().is_root() && Path::new(BASE_IMAGE_DIR).join("bin/sh").exists();
    if !ok {
        common::capability_missing(&format!("needs root and the base image {BASE_IMAGE_DIR}"));
    }
    ok
}

fn start(dir: &Path) -> Child {
    start_with(dir, None)
}

/// `hooks`: groved's `GROVED_DEBUG_HOOKS` (test builds of groved have the hooks compiled in).
fn start_with(dir: &Path, hooks: Option<&str>) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("groved.log"))
        .unwrap();
    let mut child = Command::new(groved_bin())
        .arg("--config")
        .arg(dir.join("groved.toml"))
        .env("GROVE_INIT_BINARY", init_binary())
        .env_remove("INVOCATION_ID")
        .envs(hooks.map(|h| ("GROVED_DEBUG_HOOKS", h)))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawn groved");
    let t = Instant::now();
    while !Client::new(dir.join("run/groved.sock")).reachable() {
        if let Some(s) = child.try_wait().unwrap() {
            let log = std::fs::read_to_string(dir.join("groved.log")).unwrap_or_default();
            panic!("groved exited at start ({s}): {log}");
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "groved did not come up"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

/// The dir of `pid`'s memory cgroup, as the kernel has it (v1 memory hierarchy, or cgroup2).
fn memory_cgroup(pid: i32) -> PathBuf {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let rel = text
        .lines()
        .find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, ctrls, path) = (f.next()?, f.next()?, f.next()?);
            let hit = if v2 {
                ctrls.is_empty()
            } else {
                ctrls.split(',').any(|c| c == "memory")
            };
            hit.then(|| path.to_string())
        })
        .unwrap_or_else(|| panic!("no memory cgroup in {text}"));
    let mount = if v2 {
        "/sys/fs/cgroup"
    } else {
        "/sys/fs/cgroup/memory"
    };
    Path::new(mount).join(rel.trim_start_matches('/'))
}

fn limit_of(dir: &Path) -> u64 {
    let f = ["memory.max", "memory.limit_in_bytes"]
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no memory limit file in {}", dir.display()));
    std::fs::read_to_string(f).unwrap().trim().parse().unwrap()
}

fn assert_in_own_cgroups(groved: i32, fsd: i32, cgroup_root: &str) {
    let g = memory_cgroup(groved);
    assert!(
        g.ends_with(format!("{cgroup_root}/daemon/groved")),
        "groved is in {}",
        g.display()
    );
    assert_eq!(limit_of(&g), GROVED_MB << 20);
    let f = memory_cgroup(fsd);
    assert!(
        f.ends_with(format!("{cgroup_root}/daemon/fsd")),
        "grove-fsd is in {}",
        f.display()
    );
    assert_eq!(limit_of(&f), FSD_MB << 20);
}

#[test]
fn daemons_run_in_limited_cgroups_of_their_own() {
    if !runnable() {
        return;
    }
    let dir = PathBuf::from(format!("/tmp/grove-dcg-{}", rand_suffix()));
    let cgroup_root = format!("grove-d{}", &rand_suffix()[..6]);
    std::fs::create_dir_all(dir.join("state")).unwrap();
    let config = format!(
        r#"state_dir = "{state}"
run_dir = "{run}"
root_provider = "nodefs"
cgroup_root = "{cgroup_root}"
net_pool = "10.215.0.0/16"
daemon_memory_max_mb = {GROVED_MB}
fsd_memory_max_mb = {FSD_MB}
"#,
        state = dir.join("state").display(),
        run = dir.join("run").display(),
    );
    std::fs::write(dir.join("groved.toml"), config).unwrap();

    let mut child = start(&dir);
    let fsd = fsd_of(&dir);
    assert_eq!(fsd.len(), 1, "{fsd:?}");
    assert_in_own_cgroups(child.id() as i32, fsd[0], &cgroup_root);

    // A crash leaves both cgroups (grove-fsd lives on in its own); the next start takes them over.
    child.kill().unwrap();
    child.wait().unwrap();
    let mut child = start(&dir);
    assert_eq!(fsd_of(&dir), fsd, "the restart found the running grove-fsd");
    assert_in_own_cgroups(child.id() as i32, fsd[0], &cgroup_root);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = Client::new(dir.join("run/groved.sock"));
    let residue: serde_json::Value = rt
        .block_on(client.json(Method::GET, "/v1/node/residue", None))
        .unwrap();
    assert_eq!(residue["items"], serde_json::json!([]), "{residue}");

    // A clean stop removes them, and the cgroup root with them.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::SIGTERM,
    )
    .unwrap();
    assert!(child.wait().unwrap().success());
    let left = leftovers(&dir, &cgroup_root);
    assert!(left.is_empty(), "{left:?}");
    assert!(fsd_of(&dir).is_empty(), "grove-fsd outlived a clean stop");
    for ctrl in ["memory", "unified", ""] {
        let p = Path::new("/sys/fs/cgroup").join(ctrl).join(&cgroup_root);
        assert!(!p.exists(), "{} left", p.display());
    }

    // A SIGTERM the moment groved answers (a supervisor stopping it right after start) is an
    // orderly stop too: groved takes the signal before it binds its socket, so the default
    // action cannot kill it half-started with its grove-fsd and cgroups left behind. The debug
    // hook holds groved 300 ms between binding the socket and READY, where that used to happen.
    let mut child = start_with(&dir, Some("ready-delay-ms=300"));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::SIGTERM,
    )
    .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "a SIGTERM right after start: {status}");
    let left = leftovers(&dir, &cgroup_root);
    assert!(left.is_empty(), "{left:?}");
    assert!(
        fsd_of(&dir).is_empty(),
        "grove-fsd outlived a stop right after start"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
