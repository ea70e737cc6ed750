//! Bad input and failure paths: a corrupt image fails its branch with a typed error and leaves
//! nothing; a snapshot during an exec is refused with a conflict; export/import, including a
//! stream that lacks chunks the receiver does not have.

mod common;

use std::time::Duration;

use common::app::{self, ask};
use common::grove::{self, Env};
use grove_runtime::ExecRequest;
use grove_snapshotter::{criu, Error, ForkOptions, SnapshotOptions};

#[test]
fn failure_paths_leave_nothing_behind() {
    let Some(_serial) = grove::serial_with_prereqs() else {
        return;
    };
    common::tree::become_subreaper();
    let env = Env::new("grove-stest-fail");
    let src = env.rt.create(env.spec()).unwrap();
    app::start(&env, &src.id);
    assert_eq!(ask(&env, &src.id, "inc", 1)["counter"], 42);

    // A snapshot while an exec is in flight is refused with a conflict naming the reason, and
    // the source carries on untouched.
    let busy = std::thread::scope(|s| {
        let exec = s.spawn(|| {
            env.rt
                .exec(&src.id, ExecRequest::shell("sleep 2; echo done"))
                .unwrap()
        });
        std::thread::sleep(Duration::from_millis(400));
        let r = env.snap.snapshot(&src.id, SnapshotOptions::default());
        let out = exec.join().unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "done",
            "the exec completes"
        );
        r
    });
    match busy {
        Err(e @ Error::Conflict { .. }) => {
            assert_eq!(e.code(), "conflict");
            assert!(e.to_string().contains("exec"), "{e}");
        }
        other => panic!("expected Conflict, got {other:?}"),
    }
    assert!(
        env.snap.list().is_empty(),
        "a refused snapshot records nothing"
    );
    assert_eq!(ask(&env, &src.id, "inc", 2)["counter"], 43);

    let snap = env
        .snap
        .snapshot(
            &src.id,
            SnapshotOptions {
                name: Some("fail-test".into()),
                durable: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(snap.durable && snap.root.is_some() && snap.bytes_added > 0);
    match env.snap.snapshot(
        &src.id,
        SnapshotOptions {
            name: Some("fail-test".into()),
            ..Default::default()
        },
    ) {
        Err(e @ Error::NameTaken { .. }) => assert_eq!(e.code(), "conflict"),
        other => panic!("expected NameTaken, got {other:?}"),
    }
    for bad in [0, grove_snapshotter::MAX_FORK + 1] {
        assert!(matches!(
            env.snap.fork(&snap.id, bad, ForkOptions::default()),
            Err(Error::InvalidInput { .. })
        ));
    }

    // A good fork materializes the images; then corrupt them: the branch fails with CRIU's typed
    // error carrying its log lines, and no half branch is left.
    let ok = env
        .snap
        .fork(&snap.id, 1, ForkOptions::default())
        .unwrap()
        .remove(0)
        .unwrap();
    assert_eq!(ask(&env, &ok.id, "state", 3)["counter"], 43);
    env.rt.destroy(&ok.id).unwrap();
    let pstree = env
        .run_dir
        .join("snapshots")
        .join(&snap.id)
        .join("images/pstree.img");
    assert!(
        pstree.exists(),
        "materialized images at {}",
        pstree.display()
    );
    std::fs::write(&pstree, b"not a protobuf image").unwrap();
    let mut results = env.snap.fork(&snap.id, 2, ForkOptions::default()).unwrap();
    assert_eq!(results.len(), 2);
    for r in results.drain(..) {
        match r {
            Err(Error::Criu(criu::Error::RestoreFailed { log_tail, .. })) => {
                assert!(!log_tail.is_empty())
            }
            other => panic!("expected RestoreFailed, got {other:?}"),
        }
    }
    let live: Vec<_> = env.rt.list().into_iter().map(|s| s.id).collect();
    assert_eq!(
        live,
        vec![src.id.clone()],
        "failed branches leave no sandbox"
    );
    let residue = env.residue();
    assert!(
        residue.is_empty(),
        "residue after failed forks: {residue:#?}"
    );

    // Export; delete; gc drops the images' chunks; a stream claiming the receiver has every chunk
    // is refused; the full stream restores the snapshot, which forks again.
    let mut full = Vec::new();
    let n = env.snap.export(&snap.id, &mut full).unwrap();
    assert_eq!(n, full.len() as u64);
    let mut empty = Vec::new();
    env.snap
        .export_delta(&snap.id, Some(&Default::default()), &mut empty)
        .unwrap();
    assert!(empty.len() < full.len() / 10);
    env.snap.delete(&snap.id).unwrap();
    assert!(matches!(
        env.snap.get(&snap.id),
        Err(Error::NotFound { .. })
    ));
    assert!(
        !env.run_dir.join("snapshots").join(&snap.id).exists(),
        "materialized images dropped"
    );
    env.store.gc(&env.snap.live_manifests()).unwrap();
    match env.snap.import(&mut empty.as_slice()) {
        Err(e @ Error::BadStream { .. }) => assert!(e.to_string().contains("missing"), "{e}"),
        other => panic!("expected BadStream for missing chunks, got {other:?}"),
    }
    assert!(env.snap.list().is_empty());
    assert!(matches!(
        env.snap.import(&mut &b"GRVSNAP1garbage"[..]),
        Err(Error::BadStream { .. })
    ));
    let back = env.snap.import(&mut full.as_slice()).unwrap();
    assert_eq!(back, snap);
    let again = env
        .snap
        .fork("fail-test", 1, ForkOptions::default())
        .unwrap()
        .remove(0)
        .unwrap();
    assert_eq!(ask(&env, &again.id, "state", 4)["counter"], 43);

    // Records are durable: a new snapshotter on the same state (a daemon restart) sees the
    // snapshot, and drops store refs of snapshots that were never recorded (a crash mid-way).
    let orphan = format!("grove/snapshots/{}/fs", "e".repeat(64));
    env.store
        .set_ref(&orphan, &snap.fs_root.parse().unwrap())
        .unwrap();
    let restarted =
        grove_snapshotter::Snapshotter::new(env.snap_cfg.clone(), env.rt.clone(), env.service())
            .unwrap();
    assert_eq!(restarted.list(), env.snap.list());
    assert_eq!(
        env.store.get_ref(&orphan).unwrap(),
        None,
        "orphan ref dropped"
    );
    drop(restarted);

    // A daemon crash between a snapshot's return and the end of its background import: the
    // record says not durable; the next start imports the images again from scratch space and
    // the snapshot becomes durable with the same images. If scratch space lost them (a host
    // reboot), the snapshot is dropped at start rather than left unforkable.
    let crashed = |name: &str| {
        let s = env
            .snap
            .snapshot(
                &src.id,
                SnapshotOptions {
                    name: Some(name.into()),
                    ..Default::default()
                },
            )
            .unwrap();
        let done = env
            .snap
            .wait_durable(&s.id, Duration::from_secs(120))
            .unwrap();
        let record = env
            .snap_cfg
            .state_dir
            .join(format!("snapshots/{}.json", s.id));
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
        v["durable"] = false.into();
        v["images_root"] = "".into();
        v["root"] = serde_json::Value::Null;
        std::fs::write(&record, serde_json::to_vec(&v).unwrap()).unwrap();
        let images_ref = format!("grove/snapshots/{}/images", s.id);
        env.store.delete_ref(&images_ref).unwrap();
        (done, images_ref)
    };
    let (resumed, images_ref) = crashed("crash-mid-import");
    let (lost, _) = crashed("crash-and-reboot");
    std::fs::remove_dir_all(env.run_dir.join("snapshots").join(&lost.id)).unwrap();
    let restarted =
        grove_snapshotter::Snapshotter::new(env.snap_cfg.clone(), env.rt.clone(), env.service())
            .unwrap();
    let again = restarted
        .wait_durable(&resumed.id, Duration::from_secs(120))
        .unwrap();
    assert_eq!(again.images_root, resumed.images_root);
    assert_eq!(again.root, resumed.root);
    assert_eq!(
        env.store.get_ref(&images_ref).unwrap().map(|m| m.to_hex()),
        Some(resumed.images_root.clone()),
        "the images ref is written again"
    );
    assert!(matches!(
        restarted.get(&lost.id),
        Err(Error::NotFound { .. })
    ));
    drop(restarted);
    for id in [&resumed.id, &lost.id] {
        let _ = env.snap.delete(id);
    }

    // stop: the snapshot is committed, then the source is destroyed; it forks like any other.
    let before = ask(&env, &src.id, "inc", 5);
    let stopped = env
        .snap
        .snapshot(
            &src.id,
            SnapshotOptions {
                stop: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(matches!(
        env.rt.get(&src.id),
        Err(grove_runtime::Error::NotFound { .. })
    ));
    let b = env
        .snap
        .fork(&stopped.id, 1, ForkOptions::default())
        .unwrap()
        .remove(0)
        .unwrap();
    assert_eq!(ask(&env, &b.id, "state", 6)["counter"], before["counter"]);
    env.finish();
}

/// What a sandbox writes lives on disk in `<state_dir>/uppers/<id>`, made at its first write
/// and removed by destroy; a leftover one (a reboot emptied the run dir) is residue, and a
/// restarted runtime removes it.
#[test]
fn upper_layers_live_under_the_state_dir_and_leave_nothing() {
    let Some(_serial) = grove::serial_with_prereqs() else {
        return;
    };
    let instance = "grove-stest-uppers";
    let env = Env::new(instance);
    let uppers = env.dir.join("state/uppers");
    let id = env.rt.create(env.spec()).unwrap().id;
    let upper = uppers.join(id.as_str());
    assert!(
        !upper.exists(),
        "a sandbox that wrote nothing has no upper layer"
    );
    env.sh(&id, "echo written > /root/f");
    assert!(upper.is_dir(), "the first write made {}", upper.display());

    let stray = uppers.join("sb-00000000beef");
    std::fs::create_dir_all(stray.join("slots")).unwrap();
    let items = env.residue();
    assert!(
        items
            .iter()
            .any(|i| i.kind == "upper" && i.what == stray.display().to_string()),
        "the stray upper layer is residue: {items:#?}"
    );
    assert!(
        !items.iter().any(|i| i.what.contains(id.as_str())),
        "the live sandbox's is not: {items:#?}"
    );
    env.rt.destroy(&id).unwrap();
    assert!(!upper.exists(), "destroy removed {}", upper.display());

    // A runtime starting over the same state dir (a daemon restart, once the first has stopped)
    // removes the stray.
    env.rt.shutdown();
    let restarted = env.restarted_runtime(instance);
    assert!(!stray.exists(), "recovery removed {}", stray.display());
    restarted.shutdown();
    env.finish();
}
