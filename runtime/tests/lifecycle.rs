//! create → exec → destroy, for real (root).

mod common;

use common::*;
use grove_runtime::SandboxState;

#[test]
fn create_exec_destroy() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let info = rt.create(spec()).expect("create");
    assert_eq!(info.state, SandboxState::Running);
    let id = info.id.clone();
    let r = sh(
        &rt,
        &id,
        "echo hello; echo err >&2; hostname; echo $$; exit 3",
    );
    assert_eq!(r.exit_code, Some(3), "{r:?}");
    let lines: Vec<String> = out(&r).lines().map(String::from).collect();
    assert_eq!(lines[0], "hello");
    assert_eq!(lines[1], id.to_string());
    assert_eq!(String::from_utf8_lossy(&r.stderr), "err\n");
    // The host's view of the sandbox root is reachable by root only (issue 24, break 7).
    let dir = rt.config().run_dir.join("sandboxes").join(id.as_str());
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&dir).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o700, "{}", dir.display());
    rt.destroy(&id).expect("destroy");
    assert_gone(&rt, &id);

    // A paused sandbox with a setsid'd double-forked daemon is destroyed completely too.
    let id = rt.create(spec()).expect("create").id;
    sh(&rt, &id, "setsid sh -c 'nohup sleep 1000 >/dev/null 2>&1 &' ; head -c 1000000 /dev/zero > /dev/shm/blob");
    rt.pause(&id).unwrap();
    rt.destroy(&id).expect("destroy paused");
    assert_gone(&rt, &id);
}

#[test]
fn pause_resume_ttl_usage_events() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let events = rt.subscribe();
    let mut s = spec();
    s.hostname = Some("box1".into());
    s.labels.insert("team".into(), "rl".into());
    let info = rt.create(s).unwrap();
    let id = info.id.clone();
    assert_eq!(out(&sh(&rt, &id, "hostname")), "box1");
    assert!(rt
        .list()
        .iter()
        .any(|i| i.id == id && i.spec.labels["team"] == "rl"));

    rt.pause(&id).unwrap();
    assert_eq!(rt.get(&id).unwrap().state, SandboxState::Paused);
    assert!(matches!(
        rt.exec(&id, grove_runtime::ExecRequest::argv(["true"])),
        Err(grove_runtime::Error::Conflict { .. })
    ));
    rt.resume(&id).unwrap();
    assert_eq!(out(&sh(&rt, &id, "echo back")), "back");

    sh(&rt, &id, "head -c 3000000 /dev/zero > /root/blob");
    let u = rt.usage(&id).unwrap();
    assert!(
        u.disk_bytes >= 3_000_000 && u.memory_bytes > 0 && u.pids >= 1,
        "{u:?}"
    );

    let view = rt.checkpoint_view(&id).unwrap();
    assert_eq!(view.init_pid, info.init_pid.unwrap());
    assert!(view.root_dir.join("root/blob").exists());
    assert_eq!(view.externals[0].sandbox_path, "/run/grove/init");
    assert!(view
        .cgroups
        .iter()
        .any(|(c, p)| c == "memory" && p.ends_with(id.as_str())));

    rt.set_ttl(&id, Some(1)).unwrap();
    assert!(rt.reap_expired().is_empty());
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert_eq!(rt.reap_expired(), vec![id.clone()]);
    let kinds: Vec<_> = events
        .try_iter()
        .filter(|e| e.sandbox == id)
        .map(|e| e.kind)
        .collect();
    use grove_runtime::EventKind::*;
    assert_eq!(kinds, [Created, Paused, Resumed, Expired]);
    assert_gone(&rt, &id);
}

/// create_restored adopts a process tree brought by someone else (here: a plain grove-init started
/// into the target the way CRIU would restore one).
#[test]
fn create_restored_adopts_a_tree() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let forward_before = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap();
    let mut s = spec();
    s.hostname = Some("branch-7".into());
    s.network = grove_runtime::NetworkPolicy::Egress { allow: vec![] };
    let info = rt
        .create_restored(s, &mut |t| {
            assert!(t
                .veth_host
                .as_deref()
                .is_some_and(|v| v.starts_with("grove")));
            start_init_into(t, "old-name")
        })
        .unwrap();
    assert_eq!(out(&sh(&rt, &info.id, "hostname")), "branch-7");
    let addr = info.address.clone().expect("egress address");
    assert!(
        out(&sh(&rt, &info.id, "cat /proc/net/fib_trie")).contains(&addr),
        "eth0 addressed"
    );
    assert_eq!(
        rt.checkpoint_view(&info.id).unwrap().veth_host,
        Some(format!("grove{}", &info.id.as_str()[3..13]))
    );
    rt.destroy(&info.id).unwrap();
    std::fs::write("/proc/sys/net/ipv4/ip_forward", forward_before).unwrap();
    assert_gone(&rt, &info.id);
}

#[test]
fn concurrent_cycles() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let rt = rt.clone();
            std::thread::spawn(move || {
                for _ in 0..10 {
                    let id = rt.create(spec()).expect("create").id;
                    let r = rt
                        .exec(&id, grove_runtime::ExecRequest::argv(["true"]))
                        .expect("exec");
                    assert_eq!(r.exit_code, Some(0));
                    rt.destroy(&id).expect("destroy");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let r = rt.residue();
    assert!(r.items.is_empty(), "{:#?}", r.items);
}

/// Issue 4: under load a destroy could answer OK while empty v1 `pids`/`cpu` dirs stayed listed.
/// The reaper's pass removes cgroup dirs no sandbox owns and leaves an owned sandbox alone.
/// A runtime of its own, so the planted dirs never show in the shared runtime's residue checks.
#[test]
fn reaper_sweeps_cgroup_dirs_no_sandbox_owns() {
    if !can_run() {
        return;
    }
    let roots = std::sync::Arc::new(grove_runtime::OverlayRoot::new(STATE_DIR));
    let rt = grove_runtime::Runtime::new(config("grove-rtest-sweep"), roots).expect("runtime");
    let live = rt.create(spec()).expect("create").id;
    let root = rt.config().cgroup_root.clone();
    let base = std::path::Path::new("/sys/fs/cgroup");
    let orphan = "sb-00000000f00d";
    let planted: Vec<std::path::PathBuf> = if base.join("cgroup.controllers").exists() {
        vec![base.join(&root).join(orphan)]
    } else {
        ["pids", "cpu"]
            .iter()
            .map(|c| base.join(c).join(&root).join(orphan))
            .collect()
    };
    for d in &planted {
        std::fs::create_dir(d).expect("plant an orphan cgroup dir");
    }
    let cgroup_items = |rt: &grove_runtime::Runtime| {
        rt.residue()
            .items
            .into_iter()
            .filter(|i| i.what.contains(orphan))
            .count()
    };
    assert_eq!(cgroup_items(&rt), planted.len(), "{:?}", rt.residue());
    rt.reap_expired();
    for d in &planted {
        assert!(!d.exists(), "{} survived the reaper", d.display());
    }
    assert_eq!(cgroup_items(&rt), 0);
    assert_eq!(out(&sh(&rt, &live, "echo alive")), "alive");
    rt.destroy(&live).expect("destroy");
    assert!(rt.residue().items.is_empty(), "{:?}", rt.residue());
    rt.shutdown();
}
