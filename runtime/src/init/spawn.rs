//! Starting a command from init: fork, new session, subreaper, stdio wiring, PATH lookup, exec.

use std::ffi::CString;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use nix::fcntl::OFlag;
use nix::sys::signal::{sigprocmask, SigSet, SigmaskHow};
use nix::unistd::{fork, ForkResult};

use std::collections::BTreeMap;

use super::{pty, user, Failure};
use crate::proto::InitErrorKind::{BadCwd, BadExec, Spawn};
use crate::proto::{ExecSpec, PtySize};

pub struct Spawned {
    pub pid: i32,
    pub stdin: Option<OwnedFd>,
    pub stdout: Option<OwnedFd>,
    pub stderr: Option<OwnedFd>,
    /// The pty master, when the command runs on a terminal (its stdin and output both).
    pub pty: Option<OwnedFd>,
}

/// What to start and how to wire it.
pub struct Opts<'a> {
    pub argv: &'a [String],
    pub env: &'a BTreeMap<String, String>,
    pub cwd: &'a str,
    pub user: Option<&'a str>,
    /// An unknown user name runs as root.
    pub user_or_root: bool,
    /// A stdin pipe (otherwise /dev/null).
    pub stdin: bool,
    /// On a new terminal of this size instead of pipes.
    pub pty: Option<PtySize>,
}

impl<'a> Opts<'a> {
    pub fn exec(spec: &'a ExecSpec) -> Self {
        Opts {
            argv: &spec.argv,
            env: &spec.env,
            cwd: &spec.cwd,
            user: spec.user.as_deref(),
            user_or_root: false,
            stdin: spec.stdin.is_some(),
            pty: None,
        }
    }
}

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

fn pipe() -> Result<(OwnedFd, OwnedFd), Failure> {
    nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| Failure::errno(Spawn, "pipe", e))
}

fn set_nonblocking(fd: &OwnedFd) {
    let _ = nix::fcntl::fcntl(
        fd.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFL(OFlag::O_NONBLOCK),
    );
}

/// Starts a command. Exec failures (missing binary, bad cwd, unknown user) are reported as Err,
/// not as an exit code.
pub fn spawn(o: &Opts<'_>) -> Result<Spawned, Failure> {
    if o.argv.is_empty() {
        return Err(Failure::new(Spawn, "empty argv"));
    }
    let creds = match o.user.map(user::resolve).transpose() {
        Err(user::UserError::NoSuchUser(_)) if o.user_or_root => None,
        r => r?,
    };
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOME".into(), "/root".into()),
        (
            "TERM".into(),
            if o.pty.is_some() {
                "xterm-256color"
            } else {
                "xterm"
            }
            .into(),
        ),
    ];
    let user_env = creds.as_ref().map(user::Creds::env).unwrap_or_default();
    for (k, v) in user_env.iter().map(|(k, v)| (k, v)).chain(o.env.iter()) {
        env.retain(|(ek, _)| ek != k);
        env.push((k.clone(), v.clone()));
    }
    let path_var = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let cstr =
        |s: &str| CString::new(s).map_err(|_| Failure::new(Spawn, format!("NUL byte in {s:?}")));
    let argv: Vec<CString> = o.argv.iter().map(|a| cstr(a)).collect::<Result<_, _>>()?;
    let envp: Vec<CString> = env
        .iter()
        .map(|(k, v)| cstr(&format!("{k}={v}")))
        .collect::<Result<_, _>>()?;
    let home = creds.as_ref().map_or("/", |c| c.home.as_str());
    let cwd = cstr(if o.cwd.is_empty() { home } else { o.cwd })?;
    let candidates: Vec<CString> = if o.argv[0].contains('/') {
        vec![argv[0].clone()]
    } else {
        path_var
            .split(':')
            .filter(|d| !d.is_empty())
            .filter_map(|d| CString::new(format!("{d}/{}", o.argv[0])).ok())
            .collect()
    };

    let pair = o.pty.map(pty::open).transpose()?;
    let (in_r, in_w) = if o.stdin && pair.is_none() {
        let (r, w) = pipe()?;
        (Some(r), Some(w))
    } else {
        (None, None)
    };
    let (out_r, out_w, err_r, err_w) = if pair.is_some() {
        (None, None, None, None)
    } else {
        let (a, b) = pipe()?;
        let (c, d) = pipe()?;
        (Some(a), Some(b), Some(c), Some(d))
    };
    let (status_r, status_w) = pipe()?;
    let devnull = cstr("/dev/null")?;

    // SAFETY: init is single-threaded, so the child may run arbitrary code after fork.
    match unsafe { fork() }.map_err(|e| Failure::errno(Spawn, "fork", e))? {
        ForkResult::Child => {
            let err = child(ChildArgs {
                argv: &argv,
                envp: &envp,
                cwd: &cwd,
                candidates: &candidates,
                stdin: in_r.as_ref().map(AsRawFd::as_raw_fd),
                stdout: out_w.as_ref().map(AsRawFd::as_raw_fd),
                stderr: err_w.as_ref().map(AsRawFd::as_raw_fd),
                pty: pair.as_ref().map(|p| p.slave.as_raw_fd()),
                creds: creds.as_ref(),
                devnull: &devnull,
            });
            let _ = nix::unistd::write(&status_w, &err.encode());
            grove_sys::process::exit_now(127)
        }
        ForkResult::Parent { child } => {
            let master = pair.map(|p| p.master); // the slave closes here
            drop((in_r, out_w, err_w, status_w));
            // EOF on the CLOEXEC status pipe = exec succeeded; bytes = the child's failure.
            let mut msg = Vec::new();
            let mut f = std::fs::File::from(status_r);
            let _ = f.read_to_end(&mut msg);
            if !msg.is_empty() {
                let _ = nix::sys::wait::waitpid(child, None);
                return Err(Failure::decode(&msg));
            }
            for fd in [&in_w, &out_r, &err_r].into_iter().flatten() {
                set_nonblocking(fd);
            }
            Ok(Spawned {
                pid: child.as_raw(),
                stdin: in_w,
                stdout: out_r,
                stderr: err_r,
                pty: master,
            })
        }
    }
}

struct ChildArgs<'a> {
    argv: &'a [CString],
    envp: &'a [CString],
    cwd: &'a CString,
    candidates: &'a [CString],
    stdin: Option<RawFd>,
    stdout: Option<RawFd>,
    stderr: Option<RawFd>,
    pty: Option<RawFd>,
    creds: Option<&'a user::Creds>,
    devnull: &'a CString,
}

/// In a forked child before exec: no signal blocked, every one at its default. An ignored
/// signal survives exec, and what groved inherited reaches init (a groved started from a
/// background job of a shell ignores SIGINT and SIGQUIT): without this, every command would.
pub(crate) fn default_signals() {
    let _ = sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
    for sig in 1..=libc::SIGRTMAX() {
        if sig != libc::SIGKILL && sig != libc::SIGSTOP {
            let _ = crate::sys::default_signal(sig);
        }
    }
}

/// Runs in the forked child; returns only with what failed.
fn child(a: ChildArgs<'_>) -> Failure {
    default_signals();
    if let Err(e) = nix::unistd::setsid() {
        return Failure::errno(Spawn, "setsid", e);
    }
    // The command becomes a subreaper so that its double-forked descendants stay in its subtree
    // (the timeout kill walks that subtree).
    let _ = nix::sys::prctl::set_child_subreaper(true);
    if let Some(slave) = a.pty {
        if let Err(e) = pty::attach_child(slave) {
            return e;
        }
    } else {
        let stdin = match a.stdin {
            Some(fd) => fd,
            None => match nix::fcntl::open(
                a.devnull.as_c_str(),
                OFlag::O_RDWR,
                nix::sys::stat::Mode::empty(),
            ) {
                Ok(fd) => fd,
                Err(e) => return Failure::errno(Spawn, "open /dev/null", e),
            },
        };
        let (stdout, stderr) = (a.stdout.unwrap_or(2), a.stderr.unwrap_or(2));
        for (from, to) in [(stdin, 0), (stdout, 1), (stderr, 2)] {
            if let Err(e) = nix::unistd::dup2(from, to) {
                return Failure::errno(Spawn, "dup2", e);
            }
        }
    }
    // The new ids before chdir and exec, so both are checked as the user.
    if let Some(c) = a.creds {
        if let Err(e) = user::drop_to(c) {
            return e;
        }
    }
    if let Err(e) = nix::unistd::chdir(a.cwd.as_c_str()) {
        return Failure::errno(BadCwd, format_args!("cwd {:?}", a.cwd), e);
    }
    let mut last = nix::errno::Errno::ENOENT;
    for c in a.candidates {
        match nix::unistd::execve(c, a.argv, a.envp) {
            Err(nix::errno::Errno::ENOENT) | Err(nix::errno::Errno::ENOTDIR) => {}
            Err(e) => last = e,
            Ok(never) => match never {},
        }
    }
    Failure::errno(BadExec, format_args!("exec {:?}", a.argv[0]), last)
}
