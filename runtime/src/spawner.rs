//! Runtime side of sandbox start: clones sandbox pid 1 straight into its new namespaces and
//! execs `grove-init --setup` there (the posix_spawn pattern: the child shares our memory and only
//! moves its stdio into place and execs, so nothing unsafe runs after a fork of this
//! multi-threaded process), hands it the setup config and waits for `ready`.

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::proto::{SetupConfig, OWNER_INSTANCE_ARG, OWNER_SANDBOX_ARG};

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
/// `sandbox` go on its argv so residue scans can tell whose it is.
pub fn spawn_init(
    init_binary: &Path,
    cfg: &SetupConfig,
    instance: &str,
    sandbox: &str,
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
    let pid = clone_exec(
        &argv,
        flags,
        [stdin_r.as_raw_fd(), stdout_w.as_raw_fd(), null.as_raw_fd()],
    )
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
        let mut pfd = libc::pollfd {
            fd: stdout.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32 + 1) };
        if n <= 0 {
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
}

/// clone(2) with `flags` plus CLONE_VM|CLONE_VFORK: the child runs on its own stack in our
/// memory until it execs `argv[0]` with `stdio` as fds 0-2 (we are suspended meanwhile), as
/// posix_spawn does. Signals stay blocked across the clone; the child resets handlers to the
/// default before unblocking, so none of ours runs in it. Returns the child's pid.
fn clone_exec(argv: &[CString], flags: i32, stdio: [RawFd; 3]) -> std::io::Result<i32> {
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
            flags | libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            &mut args as *mut ChildArgs as *mut libc::c_void,
        )
    };
    let err = std::io::Error::last_os_error();
    // SAFETY: restores this thread's signal mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &args.mask, std::ptr::null_mut()) };
    drop(stack);
    if pid < 0 {
        return Err(err);
    }
    Ok(pid)
}

extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: arg points at the parent's ChildArgs, alive while the parent is suspended; only
    // async-signal-safe syscalls run here, on this child's own stack.
    unsafe {
        let a = &*(arg as *const ChildArgs);
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
