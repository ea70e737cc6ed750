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
