//! Named long-lived shells held by init (issue 23).
//!
//! Each session is an interactive shell (`bash -i` without a terminal: no job control, so its
//! background jobs ignore SIGINT) whose stdin, merged stdout+stderr and a status pipe at fd
//! [`STATUS_FD`] init holds. A run writes two lines to the shell:
//!
//! ```text
//! eval '<command, single-quote escaped>' </dev/null 62>&-
//! builtin printf '%s:%d\n' <nonce> "$?" >&62
//! ```
//!
//! The command runs in the shell itself (cd, export, aliases, functions and jobs carry), reads
//! /dev/null or the run's input file, and cannot see the status pipe; the run ends when its nonce
//! line arrives on that pipe, so no prompt is matched and output needs no trailing newline. An
//! interrupt is SIGINT to the shell's process group: an interactive shell abandons the line and
//! reads the status line next (`$?` = 130). A timeout escalates: SIGINT (and 100 ms later once
//! more to what the run started), then SIGKILL of what the run started, then of the shell (the
//! session is then dead). Nothing here blocks the poll loop:
//! pipes are non-blocking and every step is driven by readiness or a deadline.
//!
//! CRIU checkpoints init with its table and the shells: pipes inside the tree dump and restore,
//! and no client connection is held between runs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::signal::Signal;
use nix::sys::wait::WaitStatus;
use nix::unistd::{fork, ForkResult, Pid};

use super::{procs, Failure};
use crate::proto::{
    self, InitErrorKind, Reply, Request, SessionErrorKind, SessionRunSpec, SessionSpec,
    SessionStatus, KIND_STDOUT,
};
use crate::sandbox::now_ms;

/// Sessions one sandbox may hold at once.
pub const MAX_SESSIONS: usize = 32;
/// Longest command text of one run.
pub const MAX_COMMAND: usize = 1 << 20;
/// Largest `input` of one run (kept in /run, a 16 MiB tmpfs).
pub const MAX_INPUT: usize = 4 << 20;
/// The shell's end of the status pipe; high, so scripts using fds 3..9 never meet it.
const STATUS_FD: RawFd = 62;
/// Where run inputs are staged for the shell to redirect from.
const SESSION_DIR: &str = "/run/grove/sessions";
/// Between the steps of a timeout's escalation.
const GRACE: Duration = Duration::from_millis(1000);
/// After an interrupt, when the run's own processes get SIGINT once more: a child the shell had
/// forked but not yet exec'd took the first one with the shell's handler and lost it.
const REINTERRUPT: Duration = Duration::from_millis(100);
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Default)]
pub struct Sessions {
    map: BTreeMap<String, Session>,
}

struct Session {
    shell: String,
    bash: bool,
    pid: i32,
    created_ms: u64,
    /// Bytes still to write to the shell's stdin (non-blocking).
    pending: Vec<u8>,
    stdin: Option<OwnedFd>,
    out: Option<OwnedFd>,
    status: Option<OwnedFd>,
    status_buf: Vec<u8>,
    /// The nonce of the start-up line: output before it (shell banners) is dropped, and a
    /// run's lines wait in `held` until it came (so no run output is taken for a banner).
    ready_nonce: Option<String>,
    held: Vec<u8>,
    exit: Option<WaitStatus>,
    run: Option<Run>,
}

struct Run {
    conn: UnixStream,
    nonce: String,
    started: Instant,
    deadline: Option<Instant>,
    /// 0: none yet; 1: SIGINT sent; 2: what the run started was killed; 3: the shell was killed.
    stage: u8,
    next_step: Option<Instant>,
    /// When the run's own processes get their second SIGINT (stage 1; see [`REINTERRUPT`]).
    reinterrupt: Option<Instant>,
    timed_out: bool,
    interrupted: bool,
    /// The client went away: the run is wound down, nothing more is sent.
    abandoned: bool,
    input_path: Option<String>,
    /// Members of the shell's session when the run began (kept by escalation step 2).
    before: HashSet<i32>,
}

/// A refused session request: its kind, and the message for people.
type Refusal = (SessionErrorKind, String);

fn err(conn: &mut UnixStream, kind: SessionErrorKind, message: String) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.write_all(&proto::encode_json(&Reply::SessionError { kind, message }));
}

fn reply(conn: &mut UnixStream, r: &Reply) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.write_all(&proto::encode_json(r));
}

/// Session names: 1..=64 of `[A-Za-z0-9_.-]`, not starting with '.'.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// `s` as one single-quoted shell word.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn nonce() -> String {
    format!(
        "{:016x}{:016x}",
        rand::random::<u64>(),
        rand::random::<u64>()
    )
}

/// Signals the shell's process group (it leads its session, so the group is `pid`).
fn signal_group(pid: i32, sig: Signal) {
    let _ = nix::sys::signal::killpg(Pid::from_raw(pid), sig);
}

impl Sessions {
    /// Serves a session request; the connection is kept only by a run in progress.
    pub fn handle(&mut self, mut conn: UnixStream, req: Request) {
        match req {
            Request::SessionCreate(spec) => self.create(conn, spec),
            Request::SessionRun(spec) => self.run(conn, spec),
            Request::SessionInterrupt { name } => match self.map.get_mut(&name) {
                Some(s) if s.exit.is_none() => {
                    signal_group(s.pid, Signal::SIGINT);
                    if let Some(r) = &mut s.run {
                        r.interrupted = true;
                    }
                    reply(&mut conn, &Reply::Ok);
                }
                Some(s) => err(&mut conn, SessionErrorKind::Dead, s.dead_message(&name)),
                None => err(&mut conn, SessionErrorKind::NotFound, not_found(&name)),
            },
            Request::SessionClose { name } => match self.map.remove(&name) {
                Some(mut s) => {
                    s.close(&name);
                    reply(&mut conn, &Reply::Ok);
                }
                None => err(&mut conn, SessionErrorKind::NotFound, not_found(&name)),
            },
            Request::SessionList => {
                let list = self.map.iter().map(|(n, s)| s.status(n)).collect();
                reply(&mut conn, &Reply::Sessions { list });
            }
            _ => reply(
                &mut conn,
                &Failure::new(InitErrorKind::Protocol, "not a session request").into(),
            ),
        }
    }

    fn create(&mut self, mut conn: UnixStream, spec: SessionSpec) {
        if !valid_name(&spec.name) {
            let m = format!(
                "session name {:?}: 1 to 64 of A-Z a-z 0-9 _ . - (not starting with .)",
                spec.name
            );
            return err(&mut conn, SessionErrorKind::Invalid, m);
        }
        if self.map.contains_key(&spec.name) {
            let m = format!("session {:?} already exists", spec.name);
            return err(&mut conn, SessionErrorKind::Exists, m);
        }
        if self.map.len() >= MAX_SESSIONS {
            let m = format!("at most {MAX_SESSIONS} sessions per sandbox (close one first)");
            return err(&mut conn, SessionErrorKind::Limit, m);
        }
        match Session::spawn(&spec) {
            Ok(s) => {
                let st = s.status(&spec.name);
                self.map.insert(spec.name, s);
                reply(&mut conn, &Reply::Sessions { list: vec![st] });
            }
            Err((kind, m)) => err(&mut conn, kind, m),
        }
    }

    fn run(&mut self, mut conn: UnixStream, spec: SessionRunSpec) {
        let Some(s) = self.map.get_mut(&spec.name) else {
            return err(&mut conn, SessionErrorKind::NotFound, not_found(&spec.name));
        };
        if s.exit.is_some() {
            return err(
                &mut conn,
                SessionErrorKind::Dead,
                s.dead_message(&spec.name),
            );
        }
        if s.run.is_some() {
            let m = format!("session {:?} is running a command", spec.name);
            return err(&mut conn, SessionErrorKind::Busy, m);
        }
        let bad = if spec.command.contains('\0') {
            Some((
                SessionErrorKind::BadCommand,
                "the command contains a NUL byte".to_string(),
            ))
        } else if spec.command.len() > MAX_COMMAND {
            Some((
                SessionErrorKind::BadCommand,
                format!("the command is over {MAX_COMMAND} bytes"),
            ))
        } else if spec.input.as_ref().is_some_and(|i| i.len() > MAX_INPUT) {
            Some((
                SessionErrorKind::BadInput,
                format!("input is over {MAX_INPUT} bytes"),
            ))
        } else {
            None
        };
        if let Some((kind, m)) = bad {
            return err(&mut conn, kind, m);
        }
        let nonce = nonce();
        let input_path = match &spec.input {
            Some(data) => match stage_input(&nonce, data) {
                Ok(p) => Some(p),
                Err((kind, m)) => return err(&mut conn, kind, m),
            },
            None => None,
        };
        let stdin = input_path.as_deref().unwrap_or("/dev/null");
        let printf = if s.bash {
            "builtin printf"
        } else {
            "command printf"
        };
        let lines = if s.ready_nonce.is_some() {
            &mut s.held
        } else {
            &mut s.pending
        };
        lines.extend_from_slice(
            format!(
                "eval {} <{} {STATUS_FD}>&-\n{printf} '%s:%d\\n' {nonce} \"$?\" >&{STATUS_FD}\n",
                quote(&spec.command),
                quote(stdin)
            )
            .as_bytes(),
        );
        let started = Instant::now();
        let before = members(s.pid);
        let _ = conn.set_nonblocking(true);
        s.run = Some(Run {
            conn,
            nonce,
            started,
            deadline: spec
                .timeout_ms
                .map(|ms| started + Duration::from_millis(ms)),
            stage: 0,
            next_step: None,
            reinterrupt: None,
            timed_out: false,
            interrupted: false,
            abandoned: false,
            input_path,
            before,
        });
        s.write_pending();
    }

    /// The descriptors to poll for every session.
    pub fn poll_fds(&self, fds: &mut Vec<libc::pollfd>) {
        let pfd = |fd: RawFd, events: i16| libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        for s in self.map.values() {
            for fd in [&s.out, &s.status].into_iter().flatten() {
                fds.push(pfd(fd.as_raw_fd(), libc::POLLIN));
            }
            if let (Some(fd), false) = (&s.stdin, s.pending.is_empty()) {
                fds.push(pfd(fd.as_raw_fd(), libc::POLLOUT));
            }
            if let Some(r) = s.run.as_ref().filter(|r| !r.abandoned) {
                fds.push(pfd(r.conn.as_raw_fd(), libc::POLLIN));
            }
        }
    }

    /// Milliseconds until the next deadline, if any.
    pub fn timeout_ms(&self) -> Option<i32> {
        let now = Instant::now();
        self.map
            .values()
            .filter_map(|s| s.run.as_ref())
            .filter_map(|r| {
                r.reinterrupt
                    .or(r.next_step)
                    .or(r.deadline.filter(|_| r.stage == 0))
            })
            .map(|d| d.saturating_duration_since(now).as_millis().min(60_000) as i32 + 1)
            .min()
    }

    /// Moves data for every session and advances deadlines.
    pub fn pump(&mut self, ready: &HashMap<RawFd, i16>) {
        for (name, s) in self.map.iter_mut() {
            if s.stdin
                .as_ref()
                .is_some_and(|fd| ready.contains_key(&fd.as_raw_fd()))
            {
                s.write_pending();
            }
            if s.out
                .as_ref()
                .is_some_and(|fd| ready.contains_key(&fd.as_raw_fd()))
            {
                s.read_out(false);
            }
            if s.status
                .as_ref()
                .is_some_and(|fd| ready.contains_key(&fd.as_raw_fd()))
            {
                s.read_status();
            }
            s.watch_client(ready);
            s.step_deadlines();
            if s.exit.is_some() {
                s.end_with_death(name);
            }
        }
    }

    /// A reaped child: returns whether it was a session's shell.
    pub fn reaped(&mut self, pid: i32, st: WaitStatus) -> bool {
        let Some((name, s)) = self
            .map
            .iter_mut()
            .find(|(_, s)| s.pid == pid && s.exit.is_none())
        else {
            return false;
        };
        s.exit = Some(st);
        s.end_with_death(name);
        true
    }
}

fn not_found(name: &str) -> String {
    format!("no session {name:?} in this sandbox")
}

/// Pids in the session `sid` (the shell and everything it started that did not leave).
fn members(sid: i32) -> HashSet<i32> {
    procs::table()
        .into_iter()
        .filter(|&(_, _, s, _)| s == sid)
        .map(|(pid, ..)| pid)
        .collect()
}

fn stage_input(nonce: &str, data: &[u8]) -> Result<String, Refusal> {
    let failed = |path: &str, e: std::io::Error| {
        (
            SessionErrorKind::BadInput,
            format!("stage input at {path}: {e}"),
        )
    };
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let _ = std::fs::DirBuilder::new().mode(0o700).create(SESSION_DIR);
    let path = format!("{SESSION_DIR}/{nonce}.in");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| failed(&path, e))?;
    if let Err(e) = f.write_all(data) {
        let _ = std::fs::remove_file(&path);
        return Err(failed(&path, e));
    }
    Ok(path)
}

impl Session {
    fn status(&self, name: &str) -> SessionStatus {
        let (exit_code, signal) = exit_of(self.exit);
        SessionStatus {
            name: name.to_string(),
            shell: self.shell.clone(),
            pid: self.pid,
            alive: self.exit.is_none(),
            busy: self.run.is_some(),
            exit_code,
            signal,
            created_ms: self.created_ms,
        }
    }

    fn dead_message(&self, name: &str) -> String {
        match exit_of(self.exit) {
            (Some(c), _) => format!("session {name:?} is dead: its shell exited with status {c}"),
            (_, Some(s)) => format!("session {name:?} is dead: its shell was killed by signal {s}"),
            _ => format!("session {name:?} is dead"),
        }
    }

    fn spawn(spec: &SessionSpec) -> Result<Session, Refusal> {
        let shell = spec.shell.clone().unwrap_or_else(|| "bash".into());
        if shell.is_empty() || shell.contains(char::is_whitespace) {
            return Err((
                SessionErrorKind::BadShell,
                format!("shell {shell:?}: give one program (a path or a name in PATH)"),
            ));
        }
        let base = shell.rsplit('/').next().unwrap_or(&shell);
        let bash = base == "bash";
        let mut argv = vec![shell.clone()];
        if bash {
            argv.extend(["--norc", "--noprofile", "--noediting", "-i"].map(String::from));
        } else {
            argv.push("-i".into());
        }
        let mut env: BTreeMap<String, String> = [
            ("PATH", DEFAULT_PATH),
            ("HOME", "/root"),
            ("TERM", "dumb"),
            ("PS1", ""),
            ("PS2", ""),
            ("HISTFILE", "/dev/null"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        env.extend(spec.env.clone());
        let cstr = |s: &str| {
            CString::new(s).map_err(|_| (SessionErrorKind::Invalid, format!("NUL byte in {s:?}")))
        };
        let c_argv: Vec<CString> = argv.iter().map(|a| cstr(a)).collect::<Result<_, _>>()?;
        let envp: Vec<CString> = env
            .iter()
            .map(|(k, v)| cstr(&format!("{k}={v}")))
            .collect::<Result<_, _>>()?;
        let cwd = cstr(if spec.cwd.is_empty() { "/" } else { &spec.cwd })?;
        let candidates: Vec<CString> = if shell.contains('/') {
            vec![c_argv[0].clone()]
        } else {
            env["PATH"]
                .split(':')
                .filter(|d| !d.is_empty())
                .filter_map(|d| CString::new(format!("{d}/{shell}")).ok())
                .collect()
        };
        let pipe = || {
            nix::unistd::pipe2(OFlag::O_CLOEXEC)
                .map_err(|e| (SessionErrorKind::Invalid, format!("pipe: {e}")))
        };
        let (in_r, in_w) = pipe()?;
        let (out_r, out_w) = pipe()?;
        let (st_r, st_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        // SAFETY: init is single-threaded, so the child may run arbitrary code after fork.
        match unsafe { fork() }.map_err(|e| (SessionErrorKind::Invalid, format!("fork: {e}")))? {
            ForkResult::Child => {
                let e = child(
                    &c_argv,
                    &envp,
                    &cwd,
                    &candidates,
                    [in_r.as_raw_fd(), out_w.as_raw_fd(), st_w.as_raw_fd()],
                );
                let bytes = serde_json::to_vec(&e).unwrap_or_default();
                let _ = nix::unistd::write(&err_w, &bytes);
                grove_sys::process::exit_now(127)
            }
            ForkResult::Parent { child } => {
                drop((in_r, out_w, st_w, err_w));
                let mut msg = Vec::new();
                let mut f = std::fs::File::from(err_r);
                let _ = f.read_to_end(&mut msg);
                if !msg.is_empty() {
                    let _ = nix::sys::wait::waitpid(child, None);
                    return Err(serde_json::from_slice(&msg).unwrap_or_else(|_| {
                        let m = String::from_utf8_lossy(&msg).into_owned();
                        (SessionErrorKind::Invalid, m)
                    }));
                }
                for fd in [&in_w, &out_r, &st_r] {
                    let _ = nix::fcntl::fcntl(
                        fd.as_raw_fd(),
                        nix::fcntl::FcntlArg::F_SETFL(OFlag::O_NONBLOCK),
                    );
                }
                let ready = nonce();
                let setup = if bash {
                    "set +H +o history; unset PROMPT_COMMAND; PS0=; "
                } else {
                    ""
                };
                let printf = if bash {
                    "builtin printf"
                } else {
                    "command printf"
                };
                let mut s = Session {
                    shell,
                    bash,
                    pid: child.as_raw(),
                    created_ms: now_ms(),
                    pending: format!("{setup}{printf} '%s:%d\\n' {ready} \"$?\" >&{STATUS_FD}\n")
                        .into_bytes(),
                    stdin: Some(in_w),
                    out: Some(out_r),
                    status: Some(st_r),
                    status_buf: Vec::new(),
                    ready_nonce: Some(ready),
                    held: Vec::new(),
                    exit: None,
                    run: None,
                };
                s.write_pending();
                Ok(s)
            }
        }
    }

    fn write_pending(&mut self) {
        let Some(fd) = &self.stdin else {
            self.pending.clear();
            return;
        };
        let mut gone = false;
        while !self.pending.is_empty() {
            match nix::unistd::write(fd, &self.pending) {
                Ok(n) => {
                    self.pending.drain(..n);
                }
                Err(nix::errno::Errno::EINTR) => {}
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(_) => {
                    // The shell is gone; its reaping marks the session dead.
                    self.pending.clear();
                    gone = true;
                }
            }
        }
        if gone {
            self.stdin = None;
        }
    }

    /// Reads output: to the run's client while it is in progress (and the shell is past its
    /// start-up line), dropped otherwise. `all`: until the pipe is empty.
    fn read_out(&mut self, all: bool) {
        let Some(fd) = &self.out else { return };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match nix::unistd::read(fd.as_raw_fd(), &mut buf) {
                Ok(0) => {
                    self.out = None;
                    return;
                }
                Ok(n) => {
                    if self.ready_nonce.is_none() {
                        if let Some(r) = self.run.as_mut().filter(|r| !r.abandoned) {
                            let _ = r.conn.set_nonblocking(false);
                            let ok =
                                proto::write_frame(&mut r.conn, KIND_STDOUT, &buf[..n]).is_ok();
                            let _ = r.conn.set_nonblocking(true);
                            if !ok {
                                r.abandon();
                            }
                        }
                    }
                    if !all {
                        return;
                    }
                }
                Err(nix::errno::Errno::EINTR) => {}
                Err(_) => return,
            }
        }
    }

    fn read_status(&mut self) {
        let Some(fd) = &self.status else { return };
        let mut buf = [0u8; 4096];
        loop {
            match nix::unistd::read(fd.as_raw_fd(), &mut buf) {
                Ok(0) => {
                    self.status = None;
                    break;
                }
                Ok(n) => self.status_buf.extend_from_slice(&buf[..n]),
                Err(nix::errno::Errno::EINTR) => {}
                Err(_) => break,
            }
        }
        while let Some(i) = self.status_buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.status_buf.drain(..=i).collect();
            let line = String::from_utf8_lossy(&line[..i]).into_owned();
            let Some((nonce, code)) = line.split_once(':') else {
                continue;
            };
            // Everything the shell wrote before the status line belongs to the phase it ends.
            if self.ready_nonce.as_deref() == Some(nonce) {
                self.read_out(true);
                self.ready_nonce = None;
                self.pending.append(&mut self.held);
                self.write_pending();
            } else if self.run.as_ref().is_some_and(|r| r.nonce == nonce) {
                self.read_out(true);
                let code = code.trim().parse().ok();
                self.finish(Reply::SessionDone {
                    exit_code: code,
                    signal: None,
                    timed_out: false,
                    interrupted: false,
                    alive: true,
                    duration_ms: 0,
                });
            }
        }
        if self.status_buf.len() > 4096 {
            self.status_buf.clear(); // garbage without newlines: not ours
        }
    }

    /// Ends the run (if any) with `r`, filling in what the run knows.
    fn finish(&mut self, mut r: Reply) {
        let Some(mut run) = self.run.take() else {
            return;
        };
        if let Some(p) = &run.input_path {
            let _ = std::fs::remove_file(p);
        }
        if run.abandoned {
            return;
        }
        if let Reply::SessionDone {
            timed_out,
            interrupted,
            duration_ms,
            ..
        } = &mut r
        {
            *timed_out = run.timed_out;
            *interrupted = run.interrupted && !run.timed_out;
            *duration_ms = run.started.elapsed().as_millis() as u64;
        }
        reply(&mut run.conn, &r);
    }

    fn watch_client(&mut self, ready: &HashMap<RawFd, i16>) {
        let Some(r) = self.run.as_mut().filter(|r| !r.abandoned) else {
            return;
        };
        if !ready.contains_key(&r.conn.as_raw_fd()) {
            return;
        }
        let mut buf = [0u8; 64];
        match r.conn.read(&mut buf) {
            Ok(0) => r.abandon(),
            Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => r.abandon(),
            _ => {}
        }
    }

    fn step_deadlines(&mut self) {
        let pid = self.pid;
        let Some(r) = self.run.as_mut() else { return };
        let now = Instant::now();
        if r.stage == 0 && r.deadline.is_some_and(|d| now >= d) {
            r.timed_out = true;
            r.stage = 1;
            r.next_step = Some(now + GRACE);
            r.reinterrupt = Some(now + REINTERRUPT);
            signal_group(pid, Signal::SIGINT);
        } else if r.stage == 1 && r.reinterrupt.is_some_and(|d| now >= d) {
            // Only what this run started: the shell itself, reading its status line by now,
            // would abandon that line on a second SIGINT.
            r.reinterrupt = None;
            for p in members(pid) {
                if p != pid && !r.before.contains(&p) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(p),
                        nix::sys::signal::Signal::SIGINT,
                    );
                }
            }
        } else if r.next_step.is_some_and(|d| now >= d) {
            if r.stage == 1 {
                // The command ignores SIGINT: kill what this run started, keep older jobs.
                let before = std::mem::take(&mut r.before);
                for p in members(pid) {
                    if p != pid && !before.contains(&p) {
                        procs::kill_tree(p);
                    }
                }
                r.stage = 2;
                r.next_step = Some(now + GRACE);
            } else if r.stage == 2 {
                // The shell itself does not come back (a builtin loop with SIGINT trapped).
                procs::kill_tree(pid);
                r.stage = 3;
                r.next_step = None;
            }
        }
    }

    /// After the shell died: the run ends with its status, and what it left behind goes.
    fn end_with_death(&mut self, name: &str) {
        if self.stdin.is_none() && self.out.is_none() && self.status.is_none() && self.run.is_none()
        {
            return;
        }
        self.read_out(true);
        let (exit_code, signal) = exit_of(self.exit);
        self.finish(Reply::SessionDone {
            exit_code,
            signal,
            timed_out: false,
            interrupted: false,
            alive: false,
            duration_ms: 0,
        });
        let _ = name;
        procs::kill_tree(self.pid);
        self.stdin = None;
        self.out = None;
        self.status = None;
        self.pending.clear();
    }

    fn close(&mut self, name: &str) {
        if self.exit.is_none() {
            procs::kill_tree(self.pid);
        }
        if let Some(mut run) = self.run.take() {
            if let Some(p) = &run.input_path {
                let _ = std::fs::remove_file(p);
            }
            if !run.abandoned {
                err(
                    &mut run.conn,
                    SessionErrorKind::Dead,
                    format!("session {name:?} was closed during the run"),
                );
            }
        }
    }
}

impl Run {
    /// The client hung up: wind the command down as on a timeout, reply to nobody.
    fn abandon(&mut self) {
        self.abandoned = true;
        if self.stage == 0 {
            self.deadline = Some(Instant::now());
        }
    }
}

fn exit_of(st: Option<WaitStatus>) -> (Option<i32>, Option<i32>) {
    match st {
        Some(WaitStatus::Exited(_, c)) => (Some(c), None),
        Some(WaitStatus::Signaled(_, s, _)) => (None, Some(s as i32)),
        _ => (None, None),
    }
}

/// Runs in the forked child; returns only with what failed. `fds`: stdin, output, status.
fn child(
    argv: &[CString],
    envp: &[CString],
    cwd: &CString,
    candidates: &[CString],
    fds: [RawFd; 3],
) -> Refusal {
    super::spawn::default_signals();
    if let Err(e) = nix::unistd::setsid() {
        return (SessionErrorKind::Invalid, format!("setsid: {e}"));
    }
    // The shell's double-forked jobs stay below it, where close and the timeout escalation find
    // them.
    let _ = nix::sys::prctl::set_child_subreaper(true);
    let [stdin, out, status] = fds;
    for (from, to) in [(stdin, 0), (out, 1), (out, 2), (status, STATUS_FD)] {
        if let Err(e) = nix::unistd::dup2(from, to) {
            return (SessionErrorKind::Invalid, format!("dup2: {e}"));
        }
    }
    if status == STATUS_FD {
        // dup2 onto itself keeps close-on-exec: clear it, the shell must keep this one.
        let _ = nix::fcntl::fcntl(
            STATUS_FD,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
        );
    }
    if let Err(e) = nix::unistd::chdir(cwd.as_c_str()) {
        return (SessionErrorKind::BadCwd, format!("cwd {cwd:?}: {e}"));
    }
    let mut last = nix::errno::Errno::ENOENT;
    for c in candidates {
        match nix::unistd::execve(c, argv, envp) {
            Err(nix::errno::Errno::ENOENT) | Err(nix::errno::Errno::ENOTDIR) => {}
            Err(e) => last = e,
            Ok(never) => match never {},
        }
    }
    (
        SessionErrorKind::BadShell,
        format!("exec {:?}: {last}", argv[0]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_quoting() {
        assert!(valid_name("main"));
        assert!(valid_name("a.b-c_1"));
        for bad in ["", ".x", "a/b", "a b", "é", &"x".repeat(65)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
        assert_eq!(quote("it's"), r"'it'\''s'");
    }
}
