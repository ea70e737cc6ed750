//! grove-fsd, the process serving every nodefs root, dies under live sandboxes (OOM kill, a bug).
//! Their roots are dead FUSE mounts then, and the new grove-fsd that the next request starts
//! knows nothing of them. Such a sandbox is reported `failed` (exec refused), destroying it
//! leaves nothing behind (no mount, no upper layer, no run dir), and the node keeps creating
//! sandboxes.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{daemon, leftovers_while_running};
use hyper::Method;
use serde_json::json;

/// Pids of the grove-fsd serving this test's daemon (found by its socket path on the command line).
fn fsd_pids(run_dir: &Path) -> Vec<i32> {
    let socket = run_dir.join("fsd.sock").display().to_string();
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_fsd = args.first().is_some_and(|a| a.ends_with(b"grove-fsd"));
        if is_fsd && args.contains(&socket.as_bytes()) {
            pids.push(pid);
        }
    }
    pids
}

fn mounted_under(dir: &Path) -> Vec<String> {
    let d = dir.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.split(' ').nth(4).is_some_and(|m| m.starts_with(&d)))
        .map(str::to_string)
        .collect()
}

#[test]
fn destroying_sandboxes_whose_fs_server_died_leaves_nothing() {
    let d = daemon();
    let run = d.dir.join("run");
    let id = d.create(json!({}));
    let out = d.exec(&id, "echo kept > /root/note && cat /root/note");
    assert_eq!(out["stdout"], "kept\n", "{out}");
    let root: PathBuf = run.join("sandboxes").join(&id).join("root");
    assert_eq!(mounted_under(&root).len(), 1, "the sandbox root is mounted");
    let upper = d.dir.join("state/uppers").join(&id);
    assert!(
        upper.is_dir(),
        "the write made an upper layer at {}",
        upper.display()
    );

    let pids = fsd_pids(&run);
    assert_eq!(pids.len(), 1, "one grove-fsd serves the daemon: {pids:?}");
    // SAFETY: kill(2) with plain integers, on the test daemon's own grove-fsd.
    assert_eq!(unsafe { libc::kill(pids[0], libc::SIGKILL) }, 0);
    let t = Instant::now();
    while Path::new(&format!("/proc/{}", pids[0])).exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "grove-fsd did not die"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // The reaper notices (one listing of the new server's mounts per tick) and says so.
    let t = Instant::now();
    loop {
        let got = d
            .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .expect(200)
            .json();
        if got["state"] == "failed" {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "not marked failed: {got}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let refused = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({ "shell": "true" })),
        )
        .expect_error(409, None);
    assert!(
        refused["message"].as_str().unwrap_or("").contains("Failed"),
        "{refused}"
    );
    d.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .expect(204);
    assert!(
        mounted_under(&root).is_empty(),
        "{:?}",
        mounted_under(&root)
    );
    assert!(!upper.exists(), "upper layer left at {}", upper.display());
    assert!(!run.join("sandboxes").join(&id).exists(), "run dir left");
    let residue = d.residue();
    assert_eq!(residue["items"], json!([]), "{residue}");
    assert!(
        leftovers_while_running(&d.dir, &d.cgroup_root).is_empty(),
        "{:?}",
        leftovers_while_running(&d.dir, &d.cgroup_root)
    );

    // A new grove-fsd serves the next sandbox.
    let again = d.create(json!({}));
    assert_eq!(d.exec(&again, "echo ok")["stdout"], "ok\n");
    d.delete(&again);
    assert_eq!(d.residue()["items"], json!([]));
}

/// groved stops its grove-fsd last when it stops; a snapshot's images still being stored then
/// (a background thread) used to find the server gone and start a new one, which outlived the
/// daemon (with its cgroup). A client that stopped its server starts none again.
#[test]
fn a_server_stopped_by_its_client_is_not_started_again() {
    let tmp = tempfile::Builder::new()
        .prefix("grove-fsd-stop")
        .tempdir()
        .unwrap();
    let run = tmp.path().join("run");
    let spawn = nodefs::service::Spawn {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_grove-fsd")),
        store: tmp.path().join("store"),
        log: run.join("fsd.log"),
        cgroup_procs: Vec::new(),
    };
    let c = nodefs::service::Client::start(&run.join("fsd.sock"), Some(spawn)).unwrap();
    assert_eq!(fsd_pids(&run).len(), 1, "started");
    c.shutdown().unwrap();
    let after = nodefs::service::FsService::refs(&c);
    let left = fsd_pids(&run);
    for pid in &left {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert!(left.is_empty(), "a grove-fsd was started again: {left:?}");
    let err = after.expect_err("a call after the shutdown");
    assert!(err.to_string().contains("stopped"), "{err}");
}
