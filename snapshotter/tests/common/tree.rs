//! A small namespaced process tree for CRIU tests, built without the runtime: an overlayfs over
//! the Debian image under /run/grove-test-…, pid+mnt+net+uts+ipc namespaces, a setsid'd shell
//! loop as pid 1 that writes a counter, and a v1 freezer cgroup around it. Everything is removed
//! on drop.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub const IMAGE: &str = "/var/lib/grove/images/debian12";
const FREEZER: &str = "/sys/fs/cgroup/freezer";

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A unique name with "grove" in it, so residue checks find anything left behind.
pub fn unique(tag: &str) -> String {
    format!("{}{tag}-{}", prefix(), SEQ.fetch_add(1, Ordering::SeqCst))
}

/// The prefix of every name this test process makes (`grove-test-<pid>-`).
pub fn prefix() -> String {
    format!("grove-test-{}-", std::process::id())
}

/// Makes this test process a subreaper so restored (detached) trees are reaped by us.
pub fn become_subreaper() {
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
}

pub fn have_criu_prereqs() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root".into());
    }
    if !Path::new(IMAGE).join("bin/sh").exists() {
        return Some(format!("{IMAGE} missing"));
    }
    if !Path::new(FREEZER).exists() {
        return Some("no v1 freezer".into());
    }
    None
}

/// An overlayfs root under /run/<name>/root.
pub struct OverlayRoot {
    pub dir: PathBuf,
}

impl OverlayRoot {
    pub fn new(name: &str, upper_from: Option<&Path>) -> OverlayRoot {
        let dir = PathBuf::from("/run").join(name);
        for d in ["upper", "work", "root"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        if let Some(src) = upper_from {
            run(
                "cp",
                &[
                    "-a",
                    &format!("{}/.", src.display()),
                    &dir.join("upper").display().to_string(),
                ],
            );
        }
        let opts = format!(
            "lowerdir={IMAGE},upperdir={},workdir={}",
            dir.join("upper").display(),
            dir.join("work").display()
        );
        run(
            "mount",
            &[
                "-t",
                "overlay",
                "overlay",
                "-o",
                &opts,
                &dir.join("root").display().to_string(),
            ],
        );
        OverlayRoot { dir }
    }

    pub fn root(&self) -> PathBuf {
        self.dir.join("root")
    }
    pub fn upper(&self) -> PathBuf {
        self.dir.join("upper")
    }
}

impl Drop for OverlayRoot {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.root()).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A v1 freezer cgroup.
pub struct Freezer {
    pub rel: String,
}

impl Freezer {
    pub fn new(name: &str) -> Freezer {
        std::fs::create_dir(Path::new(FREEZER).join(name)).unwrap();
        Freezer {
            rel: name.to_string(),
        }
    }
    pub fn path(&self) -> PathBuf {
        Path::new(FREEZER).join(&self.rel)
    }
    pub fn set(&self, state: &str) {
        std::fs::write(self.path().join("freezer.state"), state).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.state() != state && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    pub fn state(&self) -> String {
        std::fs::read_to_string(self.path().join("freezer.state"))
            .unwrap()
            .trim()
            .to_string()
    }
    pub fn procs(&self) -> Vec<i32> {
        std::fs::read_to_string(self.path().join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
    /// Kills and reaps everything inside, then removes the cgroup.
    pub fn kill_all(&self) {
        self.set("THAWED");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let procs = self.procs();
            if procs.is_empty() || Instant::now() > deadline {
                break;
            }
            for p in procs {
                // SAFETY: plain kill(2) of a pid read from our own test cgroup.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            reap_children();
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Freezer {
    fn drop(&mut self) {
        self.kill_all();
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::remove_dir(self.path()).is_err() && Instant::now() < deadline {
            reap_children();
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A cgroup2 directory under the controller-less /sys/fs/cgroup/unified mount.
pub struct Unified {
    pub rel: String,
}

pub const UNIFIED: &str = "/sys/fs/cgroup/unified";

impl Unified {
    pub fn new(name: &str) -> Unified {
        std::fs::create_dir(Path::new(UNIFIED).join(name)).unwrap();
        Unified {
            rel: name.to_string(),
        }
    }
    pub fn path(&self) -> PathBuf {
        Path::new(UNIFIED).join(&self.rel)
    }
    pub fn freeze(&self, on: bool) {
        std::fs::write(
            self.path().join("cgroup.freeze"),
            if on { "1" } else { "0" },
        )
        .unwrap();
        let want = if on { "frozen 1" } else { "frozen 0" };
        wait_for(5, "cgroup2 freeze state", || {
            std::fs::read_to_string(self.path().join("cgroup.events"))
                .unwrap_or_default()
                .contains(want)
        });
    }
    pub fn frozen(&self) -> bool {
        std::fs::read_to_string(self.path().join("cgroup.freeze"))
            .unwrap_or_default()
            .trim()
            == "1"
    }
    pub fn procs(&self) -> Vec<i32> {
        std::fs::read_to_string(self.path().join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for Unified {
    fn drop(&mut self) {
        let _ = std::fs::write(self.path().join("cgroup.kill"), "1");
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::remove_dir(self.path()).is_err() && Instant::now() < deadline {
            reap_children();
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Reaps any of our exited children without blocking (restored trees reparent to us).
pub fn reap_children() {
    loop {
        let mut st = 0;
        // SAFETY: waitpid with WNOHANG on any child; `st` is a valid out pointer.
        let r = unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) };
        if r <= 0 {
            break;
        }
    }
}

/// The shell loop run as pid 1: bumps /tmp/counter every 50 ms.
pub const LOOP: &str = "i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.05; done";

/// The namespaced tree: its root, its freezer and the host pid of its pid 1.
pub struct TestTree {
    pub unified: Unified,
    pub freezer: Freezer,
    pub root: OverlayRoot,
    pub init_pid: i32,
}

impl TestTree {
    /// The counter loop in an overlayfs root.
    pub fn start() -> TestTree {
        let name = unique("tree");
        let root = OverlayRoot::new(&name, None);
        let (unified, freezer, init_pid) = spawn_tree(&name, &root.root(), LOOP, "tmp/counter");
        TestTree {
            unified,
            freezer,
            root,
            init_pid,
        }
    }

    pub fn counter(&self) -> u64 {
        read_counter(&self.root.root())
    }
}

impl Drop for TestTree {
    fn drop(&mut self) {
        self.freezer.kill_all();
    }
}

/// Starts `script` as a setsid'd pid 1 in new pid/mnt/net/uts/ipc namespaces pivoted into
/// `root` (already mounted), inside new v1-freezer and cgroup2 dirs named `name`. Returns once
/// `ready` (a path relative to the root) exists.
pub fn spawn_tree(name: &str, root: &Path, script: &str, ready: &str) -> (Unified, Freezer, i32) {
    let freezer = Freezer::new(name);
    let unified = Unified::new(name);
    // Scripts live in the sandbox root so no quoting crosses shells.
    std::fs::write(root.join("grove-loop.sh"), script).unwrap();
    std::fs::write(
        root.join("grove-pivot.sh"),
        "mount --make-rprivate / && pivot_root . mnt && cd / && mount -t proc proc /proc && \
         umount -l /mnt && ip link set lo up 2>/dev/null; \
         exec setsid sh -c \"$(cat /grove-loop.sh)\" </dev/null >/dev/null 2>&1\n",
    )
    .unwrap();
    let outer = format!(
        "echo $$ > {}/cgroup.procs && echo $$ > {}/cgroup.procs && \
         exec unshare -p -m -n -u -i -f sh ./grove-pivot.sh",
        freezer.path().display(),
        unified.path().display()
    );
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(outer)
        .current_dir(root)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    // Whatever started the tests may have left fds open without CLOEXEC; CRIU would see
    // them as files on host mounts.
    // SAFETY: only the async-signal-safe close_range syscall runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            grove_sys::fd::close_from(3);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let unshare_pid = child.id() as i32;
    let deadline = Instant::now() + Duration::from_secs(30);
    let init_pid = loop {
        if let Some(&pid) = grove_sys::proc::children(unshare_pid).first() {
            let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
            if exe.ends_with("dash") && root.join(ready).exists() {
                break pid;
            }
        }
        assert!(Instant::now() < deadline, "test tree did not start");
        if let Ok(Some(st)) = child.try_wait() {
            panic!("unshare exited early: {st}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // unshare stays as the tree's parent; it exits when pid 1 dies and is reaped via `child`.
    std::mem::forget(child);
    (unified, freezer, init_pid)
}

pub fn read_counter(root: &Path) -> u64 {
    std::fs::read_to_string(root.join("tmp/counter"))
        .unwrap_or_default()
        .trim()
        .parse()
        .unwrap_or(0)
}

/// Waits until `f` holds or panics after `secs`.
pub fn wait_for(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn run(cmd: &str, args: &[&str]) {
    let st = Command::new(cmd).args(args).status().unwrap();
    assert!(st.success(), "{cmd} {args:?}: {st}");
}

/// Mounts and processes (CRIU ones included) mentioning `tag` left on the host (should be
/// empty). Only `tag` counts: other engineers' sandboxes and CRIU runs share this machine.
pub fn host_residue(tag: &str) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(tag))
        .map(|l| format!("mount: {l}"))
        .collect();
    let me = std::process::id().to_string();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if e.file_name().to_string_lossy() == me {
            continue;
        }
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmd.contains(tag) {
            out.push(format!("process: {cmd}"));
        }
    }
    out
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Tests that check host-wide residue run one at a time.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Leaders of process groups below this process whose command line contains `needle` (a
/// lazy-pages daemon's shell or waiter: the group holds it and the daemon).
pub fn group_leaders_named(needle: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    // Fields after the parenthesized command: state, ppid, pgrp, ...
    let stat_of = |pid: i32| -> Option<(i32, i32)> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let mut rest = stat.rsplit(')').next()?.split_whitespace().skip(1);
        Some((rest.next()?.parse().ok()?, rest.next()?.parse().ok()?))
    };
    let below_me = |mut pid: i32| {
        while let Some((ppid, _)) = stat_of(pid) {
            if ppid == me {
                return true;
            }
            if ppid <= 1 {
                return false;
            }
            pid = ppid;
        }
        false
    };
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let leads = stat_of(pid).is_some_and(|(_, pgrp)| pgrp == pid);
        if leads && String::from_utf8_lossy(&cmd).contains(needle) && below_me(pid) {
            out.push(pid);
        }
    }
    out
}

pub fn signal_all(pids: &[i32], sig: i32) {
    for &p in pids {
        // SAFETY: plain kill(2) of processes this test started.
        unsafe { libc::kill(p, sig) };
    }
}

/// Threads that keep `n` CPUs busy until dropped (to starve low-priority work in a test).
pub struct BusyCpus {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl BusyCpus {
    pub fn start(n: usize) -> BusyCpus {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        BusyCpus { stop, threads }
    }
}

impl Drop for BusyCpus {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
