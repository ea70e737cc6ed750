//! Bad input gets the right error and leaves nothing behind; a failed create undoes its steps (root).

mod common;

use std::sync::Arc;

use common::*;
use grove_runtime::{
    EgressRule, Error, ExecRequest, Limits, NetworkPolicy, OverlayRoot, PortMapping, Runtime,
};

#[test]
fn bad_specs_are_refused_cleanly() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let before = rt.capacity().allocated;
    let mut s = spec();
    s.image = "no-such-image".into();
    assert!(matches!(rt.create(s), Err(Error::ImageNotFound { .. })));
    let mut s = spec();
    s.image = "../images/debian12".into();
    assert!(matches!(rt.create(s), Err(Error::ImageNotFound { .. })));

    for (field, l) in [
        (
            "limits.memory_mb",
            Limits {
                memory_mb: 0,
                ..Limits::default()
            },
        ),
        (
            "limits.cpu_millis",
            Limits {
                cpu_millis: 0,
                ..Limits::default()
            },
        ),
        (
            "limits.pids",
            Limits {
                pids: 0,
                ..Limits::default()
            },
        ),
        (
            "limits.pids",
            Limits {
                pids: u32::MAX,
                ..Limits::default()
            },
        ),
        (
            "limits.memory_mb",
            Limits {
                memory_mb: u64::MAX,
                ..Limits::default()
            },
        ),
        (
            "limits.open_files",
            Limits {
                open_files: 1,
                ..Limits::default()
            },
        ),
        (
            "limits.disk_mb",
            Limits {
                disk_mb: 0,
                ..Limits::default()
            },
        ),
    ] {
        let mut s = spec();
        s.limits = Some(l);
        let e = rt.create(s).unwrap_err();
        assert_eq!((e.code(), e.field()), ("invalid_spec", Some(field)), "{e}");
    }
    // Sane but more than the node has.
    let mut s = spec();
    s.limits = Some(Limits {
        memory_mb: 1 << 22,
        ..Limits::default()
    });
    let e = rt.create(s).unwrap_err();
    assert!(
        matches!(&e, Error::CapacityExceeded { resource, .. } if resource == "memory_mb"),
        "{e}"
    );

    for cidr in [
        "10.0.0.0",
        "10.0.0.1/8",
        "300.1.1.0/24",
        "10.0.0.0/40",
        "banana",
    ] {
        let mut s = spec();
        s.network = NetworkPolicy::Egress {
            allow: vec![EgressRule {
                cidr: cidr.into(),
                ports: vec![],
            }],
        };
        assert_eq!(
            rt.create(s).unwrap_err().field(),
            Some("network.allow.cidr"),
            "{cidr}"
        );
    }
    let mut s = spec();
    s.ports = vec![PortMapping {
        host_port: 8080,
        sandbox_port: 80,
    }];
    assert_eq!(rt.create(s).unwrap_err().field(), Some("ports"));
    let mut s = spec();
    s.hostname = Some("bad host!".into());
    assert_eq!(rt.create(s).unwrap_err().field(), Some("hostname"));
    let mut s = spec();
    s.workdir = Some("relative".into());
    assert_eq!(rt.create(s).unwrap_err().field(), Some("workdir"));
    assert!("sb-XYZ".parse::<grove_runtime::SandboxId>().is_err());

    // Verbs on a destroyed sandbox.
    let id = rt.create(spec()).unwrap().id;
    rt.destroy(&id).unwrap();
    assert!(matches!(
        rt.exec(&id, ExecRequest::argv(["true"])),
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(rt.destroy(&id), Err(Error::NotFound { .. })));
    assert!(matches!(rt.get(&id), Err(Error::NotFound { .. })));
    assert_eq!(
        rt.capacity().allocated,
        before,
        "admission released everything"
    );
    assert_gone(&rt, &id);
}

/// A runtime of its own whose init binary fails: every create fails after root, cgroups and the
/// spawn were done, and must leave nothing.
#[test]
fn failed_create_leaves_no_residue() {
    if !can_run() {
        return;
    }
    let mut cfg = config("grove-rtest-fail");
    cfg.init_binary = "/bin/false".into();
    let rt = Runtime::new(cfg, Arc::new(OverlayRoot::new(STATE_DIR))).unwrap();
    let events = rt.subscribe();
    for _ in 0..3 {
        let e = rt.create(spec()).unwrap_err();
        assert!(matches!(e, Error::Init { .. }), "{e}");
    }
    assert_eq!(
        events
            .try_iter()
            .filter(|e| e.kind == grove_runtime::EventKind::Failed)
            .count(),
        3
    );
    assert!(rt.residue().items.is_empty(), "{:?}", rt.residue());
    assert_eq!(rt.capacity().allocated, Default::default());
    assert!(std::fs::read_dir("/run/grove-rtest-fail/sandboxes")
        .unwrap()
        .next()
        .is_none());

    // Failing late: a restore that errors after root and cgroups exist.
    let mut calls = 0;
    let e = rt
        .create_restored(spec(), &mut |t| {
            calls += 1;
            assert!(
                t.root_dir.join("etc/debian_version").exists(),
                "root mounted before restore"
            );
            Err("criu said no".into())
        })
        .unwrap_err();
    assert!(matches!(e, Error::Restore { .. }) && calls == 1, "{e}");
    assert!(rt.residue().items.is_empty(), "{:?}", rt.residue());
    rt.shutdown();
    assert!(!std::path::Path::new("/run/grove-rtest-fail").exists());
    assert!(!std::path::Path::new("/sys/fs/cgroup/memory/grove-rtest-fail").exists());
}
