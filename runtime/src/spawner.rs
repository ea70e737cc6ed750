//! Runtime side of sandbox start: clones sandbox pid 1 straight into its new namespaces and
//! execs `grove-init --setup` there (the posix_spawn pattern: the child shares our memory and only
//! moves its stdio into place and execs, so nothing unsafe runs after a fork of this
//! multi-threaded process), hands it the setup config and waits for `ready`.

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use crate::proto::{SetupConfig, OWNER_INSTANCE_ARG, OWNER_SANDBOX_ARG};
use crate::userns::IdRange;

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("start {path}")]
    Start {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Pid 1 (killed since) reported a failure, exited or timed out during setup.
    #[error("{reason}")]
    Failed { pid: i32, reason: SetupFailure },
}

/// How the setup handshake with pid 1 failed.
#[derive(Debug, thiserror::Error)]
pub enum SetupFailure {
    /// Pid 1's own words: its `error <message>` line (or any line that is not `ready`).
    #[error("{0}")]
    Reported(String),
    #[error("timed out waiting for sandbox init")]
    TimedOut,
    #[error("sandbox init (pid {pid}) exited during setup")]
    Exited { pid: i32 },
    #[error("read from sandbox init: {0}")]
    Read(std::io::Error),
}

const READY_TIMEOUT: Duration = Duration::from_secs(10);
const CHILD_STACK: usize = 64 * 1024;

/// Starts sandbox pid 1 and returns its host pid once its control socket listens. `instance` and
/// `sandbox` go on its argv so residue scans can tell whose it is. With `ids`, pid 1 starts in a
/// new user namespace too (owning all its other namespaces), mapped onto that host range.
pub fn spawn_init(
    init_binary: &Path,
    cfg: &SetupConfig,
    instance: &str,
    sandbox: &str,
    ids: Option<IdRange>,
) -> Result<i32, SpawnError> {
    let start_err = |source: std::io::Error| SpawnError::Start {
        path: init_binary.display().to_string(),
        source,
    };
    let argv: Vec<CString> = [
        init_binary.as_os_str().as_encoded_bytes(),
        b"--setup",
        OWNER_INSTANCE_ARG.as_bytes(),
        instance.as_bytes(),
        OWNER_SANDBOX_ARG.as_bytes(),
        sandbox.as_bytes(),
    ]
    .into_iter()
    .map(|a| CString::new(a).map_err(|e| start_err(std::io::Error::other(e))))
    .collect::<Result<_, _>>()?;
    let (stdin_r, stdin_w) = pipe().map_err(start_err)?;
    let (stdout_r, stdout_w) = pipe().map_err(start_err)?;
    let null: OwnedFd = std::fs::File::open("/dev/null").map_err(start_err)?.into();
    let mut flags =
        libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWUTS | libc::CLONE_NEWIPC;
    if cfg.new_netns {
        flags |= libc::CLONE_NEWNET;
    }
    let stdio = [stdin_r.as_raw_fd(), stdout_w.as_raw_fd(), null.as_raw_fd()];
    let pid = match ids {
        None => clone_exec(&argv, flags, stdio, None),
        Some(r) => clone_exec(
            &argv,
            flags | libc::CLONE_NEWUSER,
            stdio,
            Some(&|pid| prepare_userns(pid, r, cfg)),
        ),
    }
    .map_err(start_err)?;
    drop((stdin_r, stdout_w, null));
    let outcome = handshake(pid, cfg, stdin_w, stdout_r);
    outcome.map(|()| pid).map_err(|reason| {
        // Our child and its namespace's init: killing it ends everything it started.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        SpawnError::Failed { pid, reason }
    })
}

/// Sends the config and waits for `ready` or `error <message>`.
fn handshake(
    pid: i32,
    cfg: &SetupConfig,
    stdin: OwnedFd,
    stdout: OwnedFd,
) -> Result<(), SetupFailure> {
    let config = serde_json::to_vec(cfg).unwrap_or_default();
    // Dropped after writing: pid 1 reads the config to EOF.
    let _ = std::fs::File::from(stdin).write_all(&config);
    let mut stdout = std::fs::File::from(stdout);
    let mut text = String::new();
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(line_end) = text.find('\n') {
            let line: String = text.drain(..=line_end).collect();
            let line = line.trim_end();
            return match line {
                "ready" => Ok(()),
                _ => Err(SetupFailure::Reported(
                    line.strip_prefix("error ").unwrap_or(line).to_string(),
                )),
            };
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(SetupFailure::TimedOut);
        }
        let mut pfd = [PollFd::new(stdout.as_fd(), PollFlags::POLLIN)];
        let wait = PollTimeout::try_from(left.as_millis() + 1).unwrap_or(PollTimeout::MAX);
        if !matches!(poll(&mut pfd, wait), Ok(n) if n > 0) {
            continue;
        }
        let mut buf = [0u8; 512];
        match stdout.read(&mut buf) {
            Ok(0) => return Err(SetupFailure::Exited { pid }),
            Ok(n) => text.push_str(&String::from_utf8_lossy(&buf[..n])),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(SetupFailure::Read(e)),
        }
    }
}

/// What the runtime does for a pid 1 in a new user namespace before it may exec (an exec without
/// a uid 0 mapped would drop its capabilities): its id maps, and what it could not do itself
/// as an unprivileged host uid: joining its cgroups, and raising its open-files hard limit.
fn prepare_userns(pid: i32, ids: IdRange, cfg: &SetupConfig) -> std::io::Result<()> {
    let ctx = |what: String| {
        move |e: std::io::Error| std::io::Error::new(e.kind(), format!("{what}: {e}"))
    };
    for map in ["uid_map", "gid_map"] {
        let path = format!("/proc/{pid}/{map}");
        std::fs::write(&path, ids.map_line()).map_err(ctx(format!("write {path}")))?;
    }
    for procs in &cfg.cgroup_procs {
        std::fs::write(procs, pid.to_string()).map_err(ctx(format!("join cgroup {procs}")))?;
    }
    let n = cfg.open_files;
    let lim = libc::rlimit {
        rlim_cur: n,
        rlim_max: n,
    };
    // SAFETY: sets one limit of process `pid` from a valid struct; the old value is not asked for.
    if unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &lim, std::ptr::null_mut()) } != 0 {
        return Err(ctx(format!("prlimit RLIMIT_NOFILE={n}"))(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?)
}

/// What the clone child needs, prepared beforehand: it must not allocate.
struct ChildArgs {
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    stdio: [RawFd; 3],
    mask: libc::sigset_t,
    /// Read end of the gate the child waits on before anything else (-1: none); past it, the
    /// child is in a new user namespace whose maps are written and takes its root's ids.
    gate: RawFd,
}

/// Runs on the parent between clone and the child's exec (the child waits at its gate).
type Prepare<'a> = &'a dyn Fn(i32) -> std::io::Result<()>;

/// clone(2) with `flags` plus CLONE_VM|CLONE_VFORK: the child runs on its own stack in our
/// memory until it execs `argv[0]` with `stdio` as fds 0-2 (we are suspended meanwhile), as
/// posix_spawn does. Signals stay blocked across the clone; the child resets handlers to the
/// default before unblocking, so none of ours runs in it. Returns the child's pid.
///
/// With `prepare`, there is no CLONE_VFORK (we must act on the child before it execs): the child
/// first blocks reading a gate pipe, we run `prepare`, open the gate, and wait for the child's
/// exec (a close-on-exec pipe reaching EOF) before its stack may go. The child touches nothing of
/// ours but its stack while we run; we do nothing errno-sensitive once the gate is open.
fn clone_exec(
    argv: &[CString],
    flags: i32,
    stdio: [RawFd; 3],
    prepare: Option<Prepare<'_>>,
) -> std::io::Result<i32> {
    let gate = prepare.map(|_| pipe()).transpose()?;
    let exec_seen = prepare.map(|_| pipe()).transpose()?;
    let ptrs: Vec<*const libc::c_char> = argv
        .iter()
        .map(|a| a.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let envp: [*const libc::c_char; 1] = [std::ptr::null()];
    let mut stack = vec![0u8; CHILD_STACK];
    // SAFETY: sigset_t is plain data; sigfillset/pthread_sigmask fill and read it.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    let mut args = ChildArgs {
        path: ptrs[0],
        argv: ptrs.as_ptr(),
        envp: envp.as_ptr(),
        stdio,
        // SAFETY: as above.
        mask: unsafe { std::mem::zeroed() },
        gate: gate.as_ref().map_or(-1, |(r, _)| r.as_raw_fd()),
    };
    let vfork = if prepare.is_some() {
        0
    } else {
        libc::CLONE_VFORK
    };
    // SAFETY: blocks every signal in this thread and saves the old mask into args.mask.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut args.mask);
    }
    // The stack grows down from its 16-byte aligned top.
    let top = (stack.as_mut_ptr() as usize + CHILD_STACK) & !15;
    // SAFETY: the child runs child_main on `stack` with `args`, both alive until it has exec'd
    // or exited (CLONE_VFORK suspends us until then); child_main makes only raw syscalls.
    let pid = unsafe {
        libc::clone(
            child_main,
            top as *mut libc::c_void,
            flags | libc::CLONE_VM | vfork | libc::SIGCHLD,
            &mut args as *mut ChildArgs as *mut libc::c_void,
        )
    };
    let err = std::io::Error::last_os_error();
    // SAFETY: restores this thread's signal mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &args.mask, std::ptr::null_mut()) };
    if pid < 0 {
        return Err(err);
    }
    if let (Some(prepare), Some((gate_r, gate_w)), Some((seen_r, seen_w))) =
        (prepare, gate, exec_seen)
    {
        drop((gate_r, seen_w));
        let kill = || {
            let p = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGKILL);
            let _ = nix::sys::wait::waitpid(p, None);
        };
        if let Err(e) = prepare(pid) {
            // Closing the gate unopened makes the child exit; it is ours to reap.
            drop(gate_w);
            kill();
            return Err(e);
        }
        let mut gate_w = std::fs::File::from(gate_w);
        if let Err(e) = gate_w.write_all(b"g") {
            kill();
            return Err(e);
        }
        // EOF once the child has exec'd (or exited): only then is its stack free.
        let mut seen = std::fs::File::from(seen_r);
        let mut buf = [0u8; 1];
        while let Err(e) = seen.read(&mut buf) {
            if e.kind() != std::io::ErrorKind::Interrupted {
                // Not knowing whether it has exec'd, its stack may go only once it is dead.
                kill();
                return Err(e);
            }
        }
    }
    drop(stack);
    Ok(pid)
}

extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: arg points at the parent's ChildArgs, alive while the parent is suspended; only
    // async-signal-safe syscalls run here, on this child's own stack.
    unsafe {
        let a = &*(arg as *const ChildArgs);
        if a.gate >= 0 {
            let mut byte = 0u8;
            if libc::read(a.gate, &mut byte as *mut u8 as *mut libc::c_void, 1) != 1 {
                libc::_exit(125);
            }
            // Still host root's ids, unmapped in the new user namespace: become its root (host
            // uid `base`), so the exec keeps every capability there. Raw syscalls: libc's
            // wrappers would signal the threads of the process whose memory we share.
            let none: *const libc::gid_t = std::ptr::null();
            if libc::syscall(libc::SYS_setgroups, 0, none) != 0
                || libc::syscall(libc::SYS_setresgid, 0, 0, 0) != 0
                || libc::syscall(libc::SYS_setresuid, 0, 0, 0) != 0
            {
                libc::_exit(124);
            }
        }
        for (target, fd) in (0..).zip(a.stdio) {
            let ok = if fd == target {
                libc::fcntl(fd, libc::F_SETFD, 0) >= 0
            } else {
                libc::dup2(fd, target) >= 0
            };
            if !ok {
                libc::_exit(126);
            }
        }
        // Our handlers must not run in this copy: default them (the table is the child's own,
        // CLONE_SIGHAND is not set), then unblock as exec will.
        let mut sa: libc::sigaction = std::mem::zeroed();
        for sig in 1..libc::SIGRTMAX() {
            if libc::sigaction(sig, std::ptr::null(), &mut sa) == 0
                && sa.sa_sigaction != libc::SIG_DFL
                && sa.sa_sigaction != libc::SIG_IGN
            {
                sa.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
        libc::sigprocmask(libc::SIG_SETMASK, &a.mask, std::ptr::null_mut());
        libc::execve(a.path, a.argv, a.envp);
        libc::_exit(127)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SetupConfig {
        SetupConfig {
            root: "/r".into(),
            hostname: "h".into(),
            cgroup_procs: vec![],
            init_binary: "/i".into(),
            tmp_size_mb: 1,
            shm_size_mb: 1,
            open_files: 1,
            new_netns: false,
            extra_caps: vec![],
            userns: false,
        }
    }

    /// Runs the handshake against pid 1's side as `said` (then its stdout closes).
    fn handshake_with(said: &[u8]) -> Result<(), SetupFailure> {
        let (in_r, in_w) = pipe().unwrap();
        let (out_r, out_w) = pipe().unwrap();
        std::fs::File::from(out_w).write_all(said).unwrap();
        let r = handshake(42, &cfg(), in_w, out_r);
        let mut config = String::new();
        std::fs::File::from(in_r)
            .read_to_string(&mut config)
            .unwrap();
        assert!(config.contains("\"hostname\":\"h\""), "{config}");
        r
    }

    #[test]
    fn handshake_outcomes() {
        assert!(handshake_with(b"ready\n").is_ok());
        match handshake_with(b"error mount /proc: EPERM\nready\n") {
            Err(SetupFailure::Reported(m)) => assert_eq!(m, "mount /proc: EPERM"),
            r => panic!("{r:?}"),
        }
        match handshake_with(b"read") {
            Err(e @ SetupFailure::Exited { pid: 42 }) => {
                assert_eq!(e.to_string(), "sandbox init (pid 42) exited during setup")
            }
            r => panic!("{r:?}"),
        }
        let e = SpawnError::Failed {
            pid: 42,
            reason: SetupFailure::TimedOut,
        };
        assert_eq!(e.to_string(), "timed out waiting for sandbox init");
    }
}
