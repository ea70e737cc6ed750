//! residue() reports only this instance's grove-init processes: another instance's in-flight (or
//! orphaned) setup process is not ours, one marked with our instance but no owned sandbox is.
//! Its own test binary: it plants a stray process that other tests' residue checks would see.

mod common;

use std::io::Read;
use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};

use common::*;

fn process_items(rt: &grove_runtime::Runtime, pid: i32) -> Vec<String> {
    rt.residue()
        .items
        .into_iter()
        .filter(|i| i.kind == "process" && i.what.starts_with(&format!("{pid} ")))
        .map(|i| i.what)
        .collect()
}

/// Starts `grove-init --setup --instance <instance> --sandbox <sandbox>` orphaned (its shell
/// exits), blocked reading a config from a pipe whose write end is returned.
fn orphan_setup(instance: &str, sandbox: &str) -> (i32, OwnedFd) {
    let (r, w) = nix::unistd::pipe().expect("pipe");
    let mut sh = Command::new("sh")
        .args([
            "-c",
            "exec 3<&0; \"$0\" --setup --instance \"$1\" --sandbox \"$2\" <&3 >/dev/null 2>&1 & echo $!",
            env!("CARGO_BIN_EXE_grove-init"),
            instance,
            sandbox,
        ])
        .stdin(Stdio::from(r))
        .stdout(Stdio::piped())
        .spawn()
        .expect("sh");
    let mut out = String::new();
    sh.stdout
        .take()
        .expect("piped")
        .read_to_string(&mut out)
        .expect("read pid");
    sh.wait().expect("sh");
    (out.trim().parse().expect("pid"), w)
}

fn kill(pid: i32) {
    // SAFETY: kill(2) with plain integers on a process this test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

#[test]
fn residue_claims_only_this_instances_setup_processes() {
    if !can_run() {
        return;
    }
    // Before rt(): the runtime makes this process a child subreaper; this orphan must go to pid 1,
    // as a setup process does when its runtime dies.
    let (other, other_w) = orphan_setup("grove-rtest-other", "sb-0000000000a1");
    let rt = rt();
    std::thread::sleep(std::time::Duration::from_millis(100));
    let stat = std::fs::read_to_string(format!("/proc/{other}/stat")).expect("stat");
    assert!(
        stat.contains("grove-init"),
        "the planted setup process is running: {stat}"
    );
    assert!(
        process_items(&rt, other).is_empty(),
        "another instance's setup process reported: {:?}",
        rt.residue()
    );

    // Marked with our instance, for a sandbox this runtime does not own: a leak of ours.
    let mut ours = Command::new(env!("CARGO_BIN_EXE_grove-init"))
        .args([
            "--setup",
            "--instance",
            &rt.config().cgroup_root,
            "--sandbox",
            "sb-0000000000b2",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    std::thread::sleep(std::time::Duration::from_millis(100));
    let found = process_items(&rt, ours.id() as i32);
    assert_eq!(found.len(), 1, "{:?}", rt.residue());
    assert!(found[0].contains("sb-0000000000b2"), "{found:?}");

    kill(other);
    drop(other_w);
    let _ = ours.kill();
    let _ = ours.wait();

    // A real sandbox still works and leaves nothing; its veth carries our instance's mark (the
    // nft table name), which is how residue() tells our links from another instance's.
    let forward_before = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").expect("fwd");
    let mut s = spec();
    s.network = grove_runtime::NetworkPolicy::Egress { allow: vec![] };
    let info = rt.create(s).expect("create");
    assert_eq!(out(&sh(&rt, &info.id, "echo ok")), "ok");
    let veth = rt
        .checkpoint_view(&info.id)
        .expect("view")
        .veth_host
        .expect("veth");
    let alias = std::fs::read_to_string(format!("/sys/class/net/{veth}/ifalias")).expect("alias");
    assert_eq!(alias.trim(), rt.config().cgroup_root.replace('-', "_"));
    rt.destroy(&info.id).expect("destroy");
    std::fs::write("/proc/sys/net/ipv4/ip_forward", forward_before).expect("fwd");
    assert_gone(&rt, &info.id);
}

/// Issue 25 item 8: two runtimes on one host (two groveds, each on its own state dir) never
/// touch each other's sandboxes: neither B's start-up sweep nor either reaper removes the other's
/// cgroups, processes, links or nft rules, each destroys only its own, and nothing is left at the
/// end. A third runtime on A's names is refused while A runs.
#[test]
fn two_instances_never_touch_each_others_sandboxes() {
    use grove_runtime::config::instance_for;
    use grove_runtime::{ExecRequest, NetworkPolicy, OverlayRoot, PortMapping, Runtime};
    use std::path::Path;
    use std::sync::Arc;

    if !can_run() {
        return;
    }
    let forward_before = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").expect("fwd");
    // The names a groved derives for two state dirs.
    let names = [
        instance_for(Path::new("/var/lib/grove-rtest-a")),
        instance_for(Path::new("/var/lib/grove-rtest-b")),
    ];
    assert!(names[0] != names[1] && !names.contains(&"grove".to_string()));
    let cfg = |name: &str, pool: &str| {
        let mut c = config(name);
        c.net_pool = pool.into();
        c
    };
    let (cfg_a, cfg_b) = (
        cfg(&names[0], "10.217.0.0/16"),
        cfg(&names[1], "10.218.0.0/16"),
    );
    let roots = || Arc::new(OverlayRoot::new(STATE_DIR));
    let a = Runtime::new(cfg_a.clone(), roots()).expect("runtime A");
    let a_plain = a.create(spec()).expect("create in A").id;
    let mut s = spec();
    s.network = NetworkPolicy::Egress { allow: vec![] };
    s.ports = vec![PortMapping {
        host_port: 31500,
        sandbox_port: 9000,
    }];
    let a_net = a.create(s).expect("egress create in A").id;
    for id in [&a_plain, &a_net] {
        let mut bg = ExecRequest::shell("sleep 1000");
        bg.background = true;
        a.exec(id, bg).expect("sleeper");
    }
    let alive = |id: &grove_runtime::SandboxId| out(&sh(&a, id, "pgrep -c sleep"));

    // B starts (its sweep of leftovers runs), makes its own, and both reapers pass.
    let b = Runtime::new(cfg_b.clone(), roots()).expect("runtime B");
    let mut s = spec();
    s.network = NetworkPolicy::Egress { allow: vec![] };
    let b_net = b.create(s).expect("egress create in B").id;
    b.reap_expired();
    a.reap_expired();
    for id in [&a_plain, &a_net] {
        assert_eq!(alive(id), "1", "A's {id} after B's start and both reapers");
    }
    assert_eq!(out(&sh(&b, &b_net, "echo up")), "up");
    // Neither reports the other's as its residue, nor their links and tables.
    assert!(a.residue().items.is_empty(), "{:#?}", a.residue().items);
    assert!(b.residue().items.is_empty(), "{:#?}", b.residue().items);
    let table = |c: &grove_runtime::RuntimeConfig| {
        Command::new("nft")
            .args(["list", "table", "inet", &c.cgroup_root.replace('-', "_")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("nft")
            .success()
    };
    assert!(table(&cfg_a) && table(&cfg_b));

    // A second runtime on A's names would take A's sandboxes for leftovers: refused.
    let Err(e) = Runtime::new(cfg_a.clone(), roots()) else {
        panic!("a second runtime on A's names started");
    };
    assert_eq!(e.field(), Some("cgroup_root"), "{e}");
    assert_eq!(alive(&a_plain), "1");

    // B's destroy and shutdown leave A's alone.
    b.destroy(&b_net).expect("destroy in B");
    assert!(matches!(
        b.destroy(&a_plain),
        Err(grove_runtime::Error::NotFound { .. })
    ));
    b.shutdown();
    assert_gone(&b, &b_net);
    assert!(!table(&cfg_b));
    for id in [&a_plain, &a_net] {
        assert_eq!(alive(id), "1", "A's {id} after B's shutdown");
    }
    assert!(table(&cfg_a));
    for id in [&a_plain, &a_net] {
        a.destroy(id).expect("destroy in A");
        assert_gone(&a, id);
    }
    a.shutdown();
    assert!(!table(&cfg_a));
    for c in [&cfg_a, &cfg_b] {
        assert!(!c.run_dir.exists(), "{} left", c.run_dir.display());
        for ctrl in ["memory", "pids", "cpu", "unified"] {
            let d = Path::new("/sys/fs/cgroup").join(ctrl).join(&c.cgroup_root);
            assert!(!d.exists(), "{} left", d.display());
        }
    }
    std::fs::write("/proc/sys/net/ipv4/ip_forward", forward_before).expect("fwd");
}
