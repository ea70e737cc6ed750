//! `grove mount IMAGE DIR --commit NAME`: a writable nodefs view straight from a store, committed on Ctrl-C.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn mounted(dir: &std::path::Path) -> bool {
    let d = dir.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(d.as_str()))
}

#[test]
fn mount_write_commit() {
    let tmp = tempfile::Builder::new()
        .prefix("grove-mount-test-")
        .tempdir()
        .unwrap();
    let (state, run, src, mnt) = (
        tmp.path().join("state"),
        tmp.path().join("run"),
        tmp.path().join("src"),
        tmp.path().join("mnt"),
    );
    for d in [&state, &run, &src, &mnt] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(src.join("hello.txt"), "hello").unwrap();
    let base = {
        let store = nodefs::Store::open(&state.join("store")).unwrap();
        let id = store.import_dir(&src).unwrap();
        store.set_ref("small", &id).unwrap();
        id
    };
    let mut child = Command::new(common::grove_bin())
        .args(["mount", "small"])
        .arg(&mnt)
        .args(["--commit", "small-2", "--state-dir"])
        .arg(&state)
        .arg("--run-dir")
        .arg(&run)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !mounted(&mnt) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "grove mount did not mount"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "grove mount exited early"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        std::fs::read_to_string(mnt.join("hello.txt")).unwrap(),
        "hello"
    );
    std::fs::write(mnt.join("new.txt"), "written through the mount").unwrap();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(printed.starts_with("small-2 "), "{printed}");
    assert!(!mounted(&mnt), "still mounted after exit");
    assert_eq!(
        std::fs::read_dir(&mnt).unwrap().count(),
        0,
        "the mountpoint is empty again"
    );
    let store = nodefs::Store::open(&state.join("store")).unwrap();
    let committed = store.get_ref("small-2").unwrap().expect("committed ref");
    assert_ne!(committed, base);
    assert_eq!(
        printed.split_whitespace().nth(1),
        Some(committed.to_hex().as_str())
    );
    // The commit holds the new file: mount it read-only and look.
    let fs = nodefs::NodeFs::new(store.clone());
    let view = tmp.path().join("view");
    std::fs::create_dir_all(&view).unwrap();
    let opts = nodefs::MountOptions {
        quota_bytes: None,
        quota_inodes: None,
        upper_dir: tmp.path().join("view-upper"),
        read_only: true,
        passthrough: true,
        uring: true,
        id_shift: None,
    };
    let m = fs.mount(&committed, &view, opts).unwrap();
    let got = std::fs::read_to_string(view.join("new.txt"));
    m.unmount().unwrap();
    assert_eq!(got.unwrap(), "written through the mount");
}
