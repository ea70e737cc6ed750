//! What each hardening layer of a sandbox costs (issue 24): the runtime's own setup functions
//! for each layer, timed one layer at a time in a fresh single-threaded process
//! (`grove-bench --hardening-probe N`; seccomp and capability drops cannot be undone, so each
//! sample is a forked child of it). The lifecycle scenario runs the probe and reports the split
//! beside its create → exec → destroy figure.
//!
//! Layers with no step of their own are not rows: `nodev`/`nosuid`/`noexec` are flags on mounts
//! setup makes anyway (no added syscall), and the daemons' own cgroups are made once per daemon
//! start, not per sandbox.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use grove_runtime::cgroup::{self, CgroupFs, RealFs};
use grove_runtime::init::harden;
use grove_sys::process::exit_now;
use nix::sys::wait::waitpid;
use nix::unistd::{dup2, execve, fork, ForkResult};

/// The rows, in report order (also the JSON keys the probe prints).
pub const SECCOMP_SETUP: &str = "seccomp allowlist: build and install (no_new_privs, 2 filters)";
pub const SECCOMP_EXEC: &str = "seccomp allowlist: fork + exec true under it, added";
pub const CAPS: &str = "capabilities: drop the bounding set to the kept 13";
pub const DUMPABLE: &str = "init non-dumpable: prctl(PR_SET_DUMPABLE, 0)";
pub const DEVICES_V1: &str = "device allowlist, cgroup v1: devices dir + deny/allow rules + rmdir";
pub const DEVICES_BPF: &str = "device allowlist, cgroup2 BPF program: attach + rmdir, added";
pub const ROWS: [&str; 6] = [
    SECCOMP_SETUP,
    SECCOMP_EXEC,
    CAPS,
    DUMPABLE,
    DEVICES_V1,
    DEVICES_BPF,
];

/// Samples (µs) per row; a row that cannot be measured here carries the reason instead.
pub type Probe = BTreeMap<String, std::result::Result<Vec<f64>, String>>;

/// Runs the probe in a child process and parses what it prints.
pub fn run(n: usize) -> Result<Probe> {
    let exe = std::env::current_exe().context("the bench's own path")?;
    let out = std::process::Command::new(exe)
        .arg("--hardening-probe")
        .arg(n.to_string())
        .output()
        .context("starting the hardening probe")?;
    if !out.status.success() {
        bail!(
            "the hardening probe failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("the hardening probe's output")
}

/// The probe's body (`--hardening-probe N`): prints [`Probe`] as JSON.
pub fn probe_main(n: usize) -> Result<()> {
    let mut p = Probe::new();
    let in_child = |f: fn()| -> std::result::Result<Vec<f64>, String> {
        (0..n + 2)
            .map(|_| timed_in_child(f))
            .skip(2)
            .collect::<std::result::Result<_, _>>()
    };
    p.insert(
        SECCOMP_SETUP.into(),
        in_child(|| harden::lock_down().expect("lock_down")),
    );
    p.insert(
        SECCOMP_EXEC.into(),
        exec_added(n).map_err(|e| format!("{e:#}")),
    );
    p.insert(
        CAPS.into(),
        in_child(|| harden::drop_bounding_caps(&[]).expect("drop caps")),
    );
    p.insert(
        DUMPABLE.into(),
        in_child(|| nix::sys::prctl::set_dumpable(false).expect("PR_SET_DUMPABLE")),
    );
    let root = format!("grove-bench-{}-probe", std::process::id());
    p.insert(
        DEVICES_V1.into(),
        devices_v1(n, &root).map_err(|e| format!("{e:#}")),
    );
    p.insert(
        DEVICES_BPF.into(),
        devices_bpf(n, &root).map_err(|e| format!("{e:#}")),
    );
    crate::util::sweep_cgroups(&root);
    serde_json::to_writer(std::io::stdout(), &p)?;
    Ok(())
}

fn pipe() -> std::io::Result<(std::fs::File, std::fs::File)> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    Ok((r.into(), w.into()))
}

/// Forks; the child times `f` and sends the µs back, then exits. The probe is single-threaded, so
/// the child may allocate.
fn timed_in_child(f: fn()) -> std::result::Result<f64, String> {
    let (mut r, mut w) = pipe().map_err(|e| e.to_string())?;
    // SAFETY: this process has one thread; the child only runs `f` and exits.
    match unsafe { fork() }.map_err(|e| e.to_string())? {
        ForkResult::Child => {
            drop(r);
            let t = Instant::now();
            f();
            let us = t.elapsed().as_secs_f64() * 1e6;
            let _ = w.write_all(&us.to_le_bytes());
            exit_now(0)
        }
        ForkResult::Parent { child } => {
            drop(w);
            let mut b = [0u8; 8];
            let read = r.read_exact(&mut b);
            let _ = waitpid(child, None);
            read.map_err(|e| format!("the timed child died: {e}"))?;
            Ok(f64::from_le_bytes(b))
        }
    }
}

/// A forked helper that, per byte it reads, forks + execs `/bin/true`, waits and answers the µs;
/// `filtered`: it first installs the sandbox's seccomp filters (the exec'd `true` inherits them).
struct Helper {
    pid: i32,
    ask: std::fs::File,
    answer: std::fs::File,
}

impl Helper {
    fn start(filtered: bool) -> Result<Helper> {
        let (ask_r, ask_w) = pipe()?;
        let (ans_r, ans_w) = pipe()?;
        let path = CString::new("/bin/true")?;
        // SAFETY: single-threaded process; the child loops on its pipes and exits.
        match unsafe { fork() }.context("fork")? {
            ForkResult::Child => {
                drop((ask_w, ans_r));
                if filtered {
                    harden::lock_down().expect("lock_down");
                }
                helper_loop(&path, ask_r, ans_w);
                exit_now(0)
            }
            ForkResult::Parent { child } => Ok(Helper {
                pid: child.as_raw(),
                ask: ask_w,
                answer: ans_r,
            }),
        }
    }

    fn exec_once(&mut self) -> Result<f64> {
        self.ask.write_all(b"x")?;
        let mut b = [0u8; 8];
        self.answer
            .read_exact(&mut b)
            .context("the exec helper died")?;
        Ok(f64::from_le_bytes(b))
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(self.pid), None);
    }
}

fn helper_loop(path: &CString, mut ask: std::fs::File, mut answer: std::fs::File) {
    let argv = [path.as_c_str()];
    let envp: [&CStr; 0] = [];
    let null: OwnedFd = std::fs::File::open("/dev/null").expect("/dev/null").into();
    let mut b = [0u8; 1];
    while ask.read_exact(&mut b).is_ok() {
        let t = Instant::now();
        // SAFETY: the helper is single-threaded; the child only redirects stdio and execs.
        match unsafe { fork() } {
            Ok(ForkResult::Child) => {
                let _ = dup2(null.as_raw_fd(), 1);
                let _ = execve(path, &argv, &envp);
                exit_now(127)
            }
            Ok(ForkResult::Parent { child }) => {
                let _ = waitpid(child, None);
            }
            Err(_) => {}
        }
        let us = t.elapsed().as_secs_f64() * 1e6;
        if answer.write_all(&us.to_le_bytes()).is_err() {
            break;
        }
    }
}

/// fork + exec `true` under the filters minus without, paired call by call (alternating which
/// goes first), so drift on a loaded machine hits both sides alike.
fn exec_added(n: usize) -> Result<Vec<f64>> {
    let mut plain = Helper::start(false)?;
    let mut filtered = Helper::start(true)?;
    let mut added = Vec::with_capacity(n);
    for i in 0..n + 2 {
        let (a, b) = if i % 2 == 0 {
            let a = plain.exec_once()?;
            (a, filtered.exec_once()?)
        } else {
            let b = filtered.exec_once()?;
            (plain.exec_once()?, b)
        };
        if i >= 2 {
            added.push(b - a);
        }
    }
    Ok(added)
}

fn devices_controller() -> Box<dyn cgroup::Controller> {
    cgroup::controllers()
        .into_iter()
        .find(|c| c.v1_name() == "devices")
        .expect("the runtime has a devices controller")
}

/// The devices hierarchy's share of a sandbox: its dir, the rules the runtime writes, its rmdir.
fn devices_v1(n: usize, root: &str) -> Result<Vec<f64>> {
    let base = Path::new("/sys/fs/cgroup/devices");
    if !base.join("devices.allow").exists() {
        bail!("no cgroup v1 devices hierarchy on this host");
    }
    let parent = base.join(root);
    std::fs::create_dir(&parent).with_context(|| parent.display().to_string())?;
    let ctrl = devices_controller();
    let limits = grove_runtime::Limits::default();
    let mut v = Vec::with_capacity(n);
    for i in 0..n + 2 {
        let d = parent.join(format!("s{i}"));
        let t = Instant::now();
        RealFs.mkdir(&d)?;
        ctrl.apply_v1(&RealFs, &d, &limits)?;
        RealFs.rmdir(&d)?;
        if i >= 2 {
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    RealFs.rmdir(&parent)?;
    Ok(v)
}

/// The cgroup2 dir exists per sandbox anyway (kill, freeze, events): the program's cost is its
/// attach plus what it adds to the rmdir, paired against a mkdir + rmdir without it.
fn devices_bpf(n: usize, root: &str) -> Result<Vec<f64>> {
    let base = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.join("cgroup.controllers").exists())
        .context("no cgroup2 mount on this host")?;
    let parent = base.join(root);
    std::fs::create_dir(&parent).with_context(|| parent.display().to_string())?;
    let res = (|| {
        // The program loads once per process: the warm-up pays for it.
        let cycle = |d: &Path, attach: bool| -> Result<f64> {
            let t = Instant::now();
            RealFs.mkdir(d)?;
            if attach {
                cgroup::attach_device_filter(d).context("BPF_PROG_ATTACH")?;
            }
            RealFs.rmdir(d)?;
            Ok(t.elapsed().as_secs_f64() * 1e6)
        };
        let mut v = Vec::with_capacity(n);
        for i in 0..n + 2 {
            let (with, without) = (parent.join(format!("a{i}")), parent.join(format!("b{i}")));
            let (w, wo) = if i % 2 == 0 {
                let w = cycle(&with, true)?;
                (w, cycle(&without, false)?)
            } else {
                let wo = cycle(&without, false)?;
                (cycle(&with, true)?, wo)
            };
            if i >= 2 {
                v.push(w - wo);
            }
        }
        Ok(v)
    })();
    let _ = RealFs.rmdir(&parent);
    res
}
