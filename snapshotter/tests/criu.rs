//! The CRIU layer against real CRIU, with a namespaced tree built here (no runtime involved).

mod common;

use std::time::Duration;

use common::tree::{self, Freezer, OverlayRoot, TestTree};
use grove_snapshotter::criu::{Criu, DumpOptions, Error, RestoreOptions};

fn setup() -> Option<(Criu, std::sync::MutexGuard<'static, ()>)> {
    let guard = tree::serial();
    if let Some(why) = tree::have_criu_prereqs() {
        common::capability_missing(&why);
        return None;
    }
    tree::become_subreaper();
    Some((
        Criu::locate(None).expect("criu is installed on this machine kind; locate must succeed"),
        guard,
    ))
}

#[test]
fn dump_then_restore_a_namespaced_tree() {
    let Some((criu, _serial)) = setup() else {
        return;
    };
    assert!(
        !criu.features().mem_dirty_track,
        "this kernel has no soft-dirty tracking"
    );
    let work = tempfile::Builder::new()
        .prefix("grove-test-criu")
        .tempdir()
        .unwrap();
    let images = work.path().join("images");
    std::fs::create_dir(&images).unwrap();
    {
        let t = TestTree::start();
        tree::wait_for(5, "counter > 2", || t.counter() > 2);
        // Freeze, dump leaving it running, copy the fs of the same instant, thaw.
        t.freezer.set("FROZEN");
        let at_dump = t.counter();
        criu.dump(&DumpOptions {
            pid: t.init_pid,
            images_dir: images.clone(),
            work_dir: work.path().join("dump-work"),
            leave_running: true,
            freeze_cgroup: Some(t.freezer.path()),
            tcp_established: true,
            ..Default::default()
        })
        .expect("dump");
        assert_eq!(
            t.freezer.state(),
            "FROZEN",
            "criu must leave a frozen cgroup frozen"
        );
        std::thread::sleep(Duration::from_millis(120));
        assert_eq!(t.counter(), at_dump, "the tree stays frozen until we thaw");
        let copy = OverlayRoot::new(&tree::unique("restored"), Some(&t.root.upper()));
        t.freezer.set("THAWED");
        tree::wait_for(5, "source runs on", || t.counter() > at_dump + 1);

        // Restore into the copied root and a fresh freezer cgroup.
        let cg = Freezer::new(&tree::unique("restored"));
        let (pid, _) = criu
            .restore(&RestoreOptions {
                images_dir: images.clone(),
                work_dir: work.path().join("restore-work"),
                root: copy.root(),
                pidfile: work.path().join("restore.pid"),
                cgroup_roots: vec![("freezer".into(), cg.rel.clone().into())],
                tcp_established: true,
                ..Default::default()
            })
            .expect("restore");
        assert!(
            cg.procs().contains(&pid),
            "restored init lands in the given cgroup"
        );
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let nspid = status.lines().find(|l| l.starts_with("NSpid:")).unwrap();
        assert!(
            nspid.trim_end().ends_with("\t1"),
            "restored init is pid 1 in its namespace: {nspid}"
        );
        // It continues from the dump instant, in its own root.
        let restored_start = tree::read_counter(&copy.root());
        assert!(restored_start >= at_dump && restored_start <= at_dump + 1);
        tree::wait_for(5, "restored tree counts on", || {
            tree::read_counter(&copy.root()) > at_dump + 2
        });
        cg.kill_all();
        drop(cg);
        drop(copy);
    }
    let left = tree::host_residue(&tree::prefix());
    assert!(left.is_empty(), "residue: {left:?}");
}

#[test]
fn restore_of_corrupt_images_is_a_typed_error_and_leaves_nothing() {
    let Some((criu, _serial)) = setup() else {
        return;
    };
    let work = tempfile::Builder::new()
        .prefix("grove-test-criu")
        .tempdir()
        .unwrap();
    let images = work.path().join("images");
    std::fs::create_dir(&images).unwrap();
    {
        let t = TestTree::start();
        t.unified.freeze(true);
        criu.dump(&DumpOptions {
            pid: t.init_pid,
            images_dir: images.clone(),
            work_dir: work.path().join("dump-work"),
            leave_running: true,
            freeze_cgroup: Some(t.unified.path()),
            ..Default::default()
        })
        .expect("dump");
        t.unified.freeze(false);
    }
    // Corrupt the process tree image.
    std::fs::write(images.join("pstree.img"), b"garbage, not a protobuf image").unwrap();
    let copy = OverlayRoot::new(&tree::unique("corrupt"), None);
    let cg = Freezer::new(&tree::unique("corrupt"));
    let err = criu
        .restore(&RestoreOptions {
            images_dir: images.clone(),
            work_dir: work.path().join("restore-work"),
            root: copy.root(),
            pidfile: work.path().join("restore.pid"),
            cgroup_roots: vec![("freezer".into(), cg.rel.clone().into())],
            ..Default::default()
        })
        .expect_err("restore of a corrupt image must fail");
    match &err {
        Error::RestoreFailed { dir, log_tail } => {
            assert_eq!(dir, &images);
            assert!(!log_tail.is_empty(), "error carries CRIU's log lines");
        }
        other => panic!("expected RestoreFailed, got {other:?}"),
    }
    assert!(cg.procs().is_empty(), "no half-restored process");
    drop(cg);
    drop(copy);
    let left = tree::host_residue(&tree::prefix());
    assert!(left.is_empty(), "residue: {left:?}");
}

/// Processes whose command line names `path`.
fn processes_naming(path: &std::path::Path) -> Vec<i32> {
    let needle = path.as_os_str().as_encoded_bytes();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle))
        })
        .collect()
}

/// A dump started before the freeze does nothing until let go: the tree runs on, no image or
/// log is written. Let go once frozen, it dumps that instant; dropped instead, its CRIU is gone
/// and has written nothing.
#[test]
fn a_dump_started_early_waits_to_be_let_go() {
    let Some((criu, _serial)) = setup() else {
        return;
    };
    let work = tempfile::Builder::new()
        .prefix("grove-test-criu")
        .tempdir()
        .unwrap();
    let t = TestTree::start();
    tree::wait_for(5, "counter > 2", || t.counter() > 2);
    let opts = |name: &str| {
        let images = work.path().join(name);
        std::fs::create_dir(&images).unwrap();
        DumpOptions {
            pid: t.init_pid,
            images_dir: images,
            work_dir: work.path().join(format!("{name}-work")),
            leave_running: true,
            freeze_cgroup: Some(t.freezer.path()),
            tcp_established: true,
            ..Default::default()
        }
    };
    let written = |o: &DumpOptions| {
        let images = std::fs::read_dir(&o.images_dir).unwrap().count();
        (images, o.work_dir.join("dump.log").exists())
    };

    let dropped = opts("dropped");
    let early = criu
        .start_dump_early(&dropped)
        .expect("the shim is built here")
        .expect("started");
    assert_eq!(
        processes_naming(&dropped.images_dir).len(),
        1,
        "its CRIU waits"
    );
    drop(early);
    assert!(
        processes_naming(&dropped.images_dir).is_empty(),
        "and is gone once dropped"
    );
    assert_eq!(written(&dropped), (0, false), "having written nothing");

    let let_go = opts("let-go");
    let early = criu
        .start_dump_early(&let_go)
        .expect("the shim is built here")
        .expect("started");
    let before = t.counter();
    tree::wait_for(5, "the tree runs while CRIU waits", || {
        t.counter() > before + 1
    });
    assert_eq!(
        written(&let_go),
        (0, false),
        "nothing written before it is let go"
    );
    t.freezer.set("FROZEN");
    early.go().expect("dump");
    assert_eq!(t.freezer.state(), "FROZEN", "left frozen");
    assert!(
        let_go.images_dir.join("inventory.img").exists(),
        "a whole dump"
    );
    assert!(written(&let_go).1, "with its log");
    t.freezer.set("THAWED");
}

#[test]
fn dump_of_a_missing_pid_is_a_typed_error() {
    let Some((criu, _serial)) = setup() else {
        return;
    };
    let work = tempfile::Builder::new()
        .prefix("grove-test-criu")
        .tempdir()
        .unwrap();
    let err = criu
        .dump(&DumpOptions {
            pid: 999_999,
            images_dir: work.path().to_path_buf(),
            work_dir: work.path().join("w"),
            ..Default::default()
        })
        .expect_err("no such pid");
    match err {
        Error::DumpFailed { pid, log_tail } => {
            assert_eq!(pid, 999_999);
            assert!(!log_tail.is_empty());
        }
        other => panic!("expected DumpFailed, got {other:?}"),
    }
}

#[test]
fn locate_rejects_a_binary_that_fails_check() {
    if let Some(why) = tree::have_criu_prereqs() {
        common::capability_missing(&why);
        return;
    }
    match Criu::locate(Some(std::path::Path::new("/bin/false"))) {
        Err(Error::NotFound { tried }) => {
            assert_eq!(tried, vec![std::path::PathBuf::from("/bin/false")])
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
}

/// The runtime freezes with cgroup2's cgroup.freeze: CRIU must seize such a tree and leave it
/// frozen, and restore must place tasks into a given cgroup2 dir.
#[test]
fn dump_of_a_cgroup2_frozen_tree_and_restore_into_cgroup2() {
    let Some((criu, _serial)) = setup() else {
        return;
    };
    let work = tempfile::Builder::new()
        .prefix("grove-test-criu")
        .tempdir()
        .unwrap();
    let images = work.path().join("images");
    std::fs::create_dir(&images).unwrap();
    {
        let t = TestTree::start();
        tree::wait_for(5, "counter > 1", || t.counter() > 1);
        t.unified.freeze(true);
        let at_dump = t.counter();
        criu.dump(&DumpOptions {
            pid: t.init_pid,
            images_dir: images.clone(),
            work_dir: work.path().join("dump-work"),
            leave_running: true,
            freeze_cgroup: Some(t.unified.path()),
            tcp_established: true,
            ..Default::default()
        })
        .expect("dump");
        assert!(
            t.unified.frozen(),
            "criu must leave a frozen cgroup2 frozen"
        );
        std::thread::sleep(Duration::from_millis(120));
        assert_eq!(t.counter(), at_dump);
        let copy = OverlayRoot::new(&tree::unique("restored2"), Some(&t.root.upper()));
        t.unified.freeze(false);
        tree::wait_for(5, "source runs on", || t.counter() > at_dump + 1);

        let name = tree::unique("restored2");
        let cg = Freezer::new(&name);
        let ucg = tree::Unified::new(&name);
        let (pid, _) = criu
            .restore(&RestoreOptions {
                images_dir: images.clone(),
                work_dir: work.path().join("restore-work"),
                root: copy.root(),
                pidfile: work.path().join("restore.pid"),
                cgroup_roots: vec![
                    ("freezer".into(), cg.rel.clone().into()),
                    ("unified".into(), ucg.rel.clone().into()),
                ],
                tcp_established: true,
                ..Default::default()
            })
            .expect("restore");
        assert!(
            cg.procs().contains(&pid),
            "restored init lands in the given v1 cgroup"
        );
        assert!(
            ucg.procs().contains(&pid),
            "restored init lands in the given cgroup2 dir; it is in {:?}; log: {}",
            std::fs::read_to_string(format!("/proc/{pid}/cgroup")),
            std::fs::read_to_string(work.path().join("restore-work/restore.log"))
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("cg") || l.contains("unified"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tree::wait_for(5, "restored tree counts on", || {
            tree::read_counter(&copy.root()) > at_dump + 2
        });
        drop(ucg);
        cg.kill_all();
        drop(cg);
        drop(copy);
    }
    let left = tree::host_residue(&tree::prefix());
    assert!(left.is_empty(), "residue: {left:?}");
}
