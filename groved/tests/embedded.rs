//! `grove run` with no daemon: an embedded runtime for one command, leaving nothing behind.

mod common;

use std::process::Command;

#[test]
fn run_without_a_daemon() {
    let dir = tempfile::Builder::new()
        .prefix("grove-embedded-")
        .tempdir()
        .unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(state.join("images")).unwrap();
    std::os::unix::fs::symlink(common::BASE_IMAGE_DIR, state.join("images/debian12")).unwrap();
    let cgroup_root = format!("grove-e{:x}", std::process::id());
    let cfg = dir.path().join("groved.toml");
    std::fs::write(
        &cfg,
        format!(
            "state_dir = \"{}\"\nrun_dir = \"{}\"\nroot_provider = \"overlay\"\ncgroup_root = \"{cgroup_root}\"\n",
            state.display(),
            dir.path().join("run").display()
        ),
    )
    .unwrap();
    let out = Command::new(common::grove_bin())
        .args(["--socket", "/nonexistent/groved.sock", "--config"])
        .arg(&cfg)
        .args([
            "run",
            "debian12",
            "--",
            "sh",
            "-c",
            "echo embedded $(cat /etc/debian_version | cut -c1-2); exit 7",
        ])
        .env("GROVE_INIT_BINARY", common::init_binary())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "stderr: {stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "embedded 12\n");
    let left = common::leftovers(dir.path(), &cgroup_root);
    assert!(left.is_empty(), "{left:?}");
    // Bad usage without a daemon is still one line.
    let out = Command::new(common::grove_bin())
        .args(["--socket", "/nonexistent/groved.sock", "--config"])
        .arg(&cfg)
        .args(["run", "no-such-image", "--", "true"])
        .env("GROVE_INIT_BINARY", common::init_binary())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).lines().count(),
        1,
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(common::leftovers(dir.path(), &cgroup_root).is_empty());
}
