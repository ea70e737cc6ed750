//! `grove-init --serve`: sandbox pid 1. Reaps zombies, forwards SIGTERM/SIGINT, and serves one request
//! per connection on the control socket. Single-threaded: one poll loop over the listener, a signalfd,
//! and each running exec's pipes.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::step::{io, sys, StepError};
use super::{live, procs, session, spawn, Failure};
use crate::proto::InitErrorKind::{NoProcess, Protocol, Refused};
use crate::proto::{self, ExecSpec, Reply, Request, KIND_STDERR, KIND_STDOUT, SOCKET_PATH};

/// A foreground exec bound to its client connection.
struct Exec {
    conn: UnixStream,
    pid: i32,
    stdin: Option<(OwnedFd, Vec<u8>, usize)>,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    argv: Vec<String>,
    deadline: Option<Instant>,
    started: Instant,
    timed_out: bool,
    status: Option<WaitStatus>,
    /// The client went away: the tree was killed, nothing more is sent.
    abandoned: bool,
}

pub fn main() -> ! {
    match serve() {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            println!("error {e}");
            std::process::exit(1)
        }
    }
}

/// Keeps the sandbox's processes (uid 0 without CAP_SYS_PTRACE) from ptracing their pid 1 to stop
/// it or inject an exit, and from opening its /proc files; the host's CRIU (which has
/// CAP_SYS_PTRACE) still can, and restores what is set here.
///
/// Outside a user namespace pid 1 is not dumpable (children get that back at execve). In one,
/// that would also shut out CRIU's check of a restored tree: a restored pid 1's memory belongs to
/// the host's user namespace (CRIU forked it), where the check, run as the namespace's root, holds
/// no capability. There pid 1 stays dumpable and keeps a saved gid unlike its effective one:
/// ptrace's id check needs a caller whose ids equal all of the target's, which no caller's can,
/// so it takes CAP_SYS_PTRACE over the namespace, which only the host's tools hold. execve gives
/// children saved ids equal to their effective ones again.
fn guard_from_ptrace() -> Result<(), StepError> {
    let map =
        std::fs::read_to_string("/proc/self/uid_map").map_err(io("read /proc/self/uid_map"))?;
    let host_ns = map.split_whitespace().eq(["0", "0", "4294967295"]);
    if host_ns {
        return nix::sys::prctl::set_dumpable(false).map_err(sys("PR_SET_DUMPABLE"));
    }
    let ids = nix::unistd::getresgid().map_err(sys("getresgid"))?;
    let saved = nix::unistd::Gid::from_raw(if ids.effective.as_raw() == NOGROUP {
        0
    } else {
        NOGROUP
    });
    nix::unistd::setresgid(ids.real, ids.effective, saved).map_err(sys("setresgid"))?;
    nix::sys::prctl::set_dumpable(true).map_err(sys("PR_SET_DUMPABLE"))
}

/// `nogroup`: the saved gid of a user-namespace pid 1 (see `guard_from_ptrace`).
const NOGROUP: u32 = 65534;

fn serve() -> Result<(), StepError> {
    guard_from_ptrace()?;
    // Writes to gone clients then fail with EPIPE.
    crate::sys::ignore_signal(libc::SIGPIPE).map_err(io("ignore SIGPIPE"))?;
    let mut mask = SigSet::empty();
    for s in [
        Signal::SIGCHLD,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
    ] {
        mask.add(s);
    }
    mask.thread_block().map_err(sys("block signals"))?;
    let sfd = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(sys("signalfd"))?;
    let _ = std::fs::remove_file(SOCKET_PATH);
    let listener = UnixListener::bind(SOCKET_PATH).map_err(io(format!("bind {SOCKET_PATH}")))?;
    listener.set_nonblocking(true).map_err(io("nonblocking"))?;

    // Detach stdout/stderr (the runtime's pipe, the host's /dev/null) first, then tell the
    // runtime we are up through a copy of the pipe closed at once: once it reads "ready" this
    // tree holds nothing of the host that a checkpoint would trip over.
    let mut ready = std::fs::File::from(
        std::io::stdout()
            .as_fd()
            .try_clone_to_owned()
            .map_err(io("dup stdout"))?,
    );
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        let _ = nix::unistd::dup2(null.as_raw_fd(), 1);
        let _ = nix::unistd::dup2(null.as_raw_fd(), 2);
    }
    let _ = ready.write_all(b"ready\n");
    drop(ready);

    let mut execs: HashMap<i32, Exec> = HashMap::new();
    let mut incoming: Vec<Incoming> = Vec::new();
    let mut sessions = session::Sessions::default();
    let mut live = live::Table::default();
    loop {
        let mut timeout = match (next_timeout(&execs), live.next_timeout()) {
            (a, b) if a < 0 || b < 0 => a.max(b),
            (a, b) => a.min(b),
        };
        if let Some(t) = sessions.timeout_ms() {
            timeout = if timeout < 0 { t } else { timeout.min(t) };
        }
        if !incoming.is_empty() && !(0..=1000).contains(&timeout) {
            timeout = 1000; // to drop connections that never send their request
        }
        let mut fds: Vec<libc::pollfd> = vec![
            pfd(listener.as_raw_fd(), libc::POLLIN),
            pfd(sfd.as_fd().as_raw_fd(), libc::POLLIN),
        ];
        for i in &incoming {
            fds.push(pfd(i.conn.as_raw_fd(), libc::POLLIN));
        }
        for e in execs.values() {
            if e.status.is_some() {
                continue;
            }
            fds.push(pfd(e.conn.as_raw_fd(), libc::POLLIN));
            for fd in [&e.stdout, &e.stderr].into_iter().flatten() {
                fds.push(pfd(fd.as_raw_fd(), libc::POLLIN));
            }
            if let Some((fd, ..)) = &e.stdin {
                fds.push(pfd(fd.as_raw_fd(), libc::POLLOUT));
            }
        }
        sessions.poll_fds(&mut fds);
        live.poll_fds(&mut fds);
        if crate::sys::poll(&mut fds, timeout).is_err() {
            continue; // EINTR
        }
        let ready: HashMap<RawFd, i16> = fds
            .iter()
            .filter(|p| p.revents != 0)
            .map(|p| (p.fd, p.revents))
            .collect();

        if ready.contains_key(&sfd.as_fd().as_raw_fd()) {
            handle_signals(&sfd, &mut execs, &mut sessions, &mut live);
        }
        if ready.contains_key(&listener.as_raw_fd()) {
            while let Ok((conn, _)) = listener.accept() {
                if conn.set_nonblocking(true).is_ok() {
                    incoming.push(Incoming {
                        conn,
                        buf: Vec::new(),
                        since: Instant::now(),
                    });
                }
            }
        }
        for (conn, frame) in read_requests(&mut incoming, &ready) {
            if let Some(e) = handle_conn(conn, frame, &mut sessions, &mut live) {
                execs.insert(e.pid, e);
            }
        }
        for e in execs.values_mut() {
            pump(e, &ready);
        }
        sessions.pump(&ready);
        live.pump(&ready);
        let now = Instant::now();
        for e in execs.values_mut() {
            if e.status.is_none() && !e.timed_out && e.deadline.is_some_and(|d| now >= d) {
                e.timed_out = true;
                procs::kill_tree(e.pid);
            }
        }
        let done: Vec<i32> = execs
            .iter()
            .filter(|(_, e)| e.status.is_some())
            .map(|(p, _)| *p)
            .collect();
        for pid in done {
            if let Some(e) = execs.remove(&pid) {
                finish(e, &mut live);
            }
        }
    }
}

/// A new connection whose request frame is still arriving (read without blocking the loop).
struct Incoming {
    conn: UnixStream,
    buf: Vec<u8>,
    since: Instant,
}

const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads what is available on new connections; returns those with a complete request frame.
/// Connections that close, send garbage lengths or stall past REQUEST_TIMEOUT are dropped.
fn read_requests(
    incoming: &mut Vec<Incoming>,
    ready: &HashMap<RawFd, i16>,
) -> Vec<(UnixStream, Vec<u8>)> {
    let mut done = Vec::new();
    let mut keep = Vec::new();
    for mut i in incoming.drain(..) {
        let mut alive = true;
        if ready.contains_key(&i.conn.as_raw_fd()) {
            let mut chunk = [0u8; 16 * 1024];
            loop {
                match i.conn.read(&mut chunk) {
                    Ok(0) => {
                        alive = false;
                        break;
                    }
                    Ok(n) => i.buf.extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        alive = false;
                        break;
                    }
                }
            }
        }
        let want = (i.buf.len() >= 4)
            .then(|| u32::from_be_bytes([i.buf[0], i.buf[1], i.buf[2], i.buf[3]]) as usize);
        match want {
            Some(len) if len == 0 || len > proto::MAX_FRAME => {}
            Some(len) if i.buf.len() >= 4 + len => done.push((i.conn, i.buf)),
            _ if alive && i.since.elapsed() < REQUEST_TIMEOUT => keep.push(i),
            _ => {}
        }
    }
    *incoming = keep;
    done
}

fn pfd(fd: RawFd, events: i16) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

fn next_timeout(execs: &HashMap<i32, Exec>) -> i32 {
    let now = Instant::now();
    execs
        .values()
        .filter(|e| !e.timed_out && e.status.is_none())
        .filter_map(|e| e.deadline)
        .map(|d| d.saturating_duration_since(now).as_millis().min(60_000) as i32 + 1)
        .min()
        .unwrap_or(-1)
}

fn handle_signals(
    sfd: &SignalFd,
    execs: &mut HashMap<i32, Exec>,
    sessions: &mut session::Sessions,
    live: &mut live::Table,
) {
    while let Ok(Some(info)) = sfd.read_signal() {
        let sig = info.ssi_signo as i32;
        if sig == libc::SIGTERM || sig == libc::SIGINT || sig == libc::SIGHUP {
            // From pid 1, kill(-1) reaches every other process of the namespace.
            if let Ok(sig) = Signal::try_from(sig) {
                let _ = nix::sys::signal::kill(Pid::from_raw(-1), sig);
            }
        }
    }
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => break,
            Ok(st) => {
                if let Some(pid) = st.pid() {
                    if let Some(e) = execs.get_mut(&pid.as_raw()) {
                        e.status = Some(st);
                    } else {
                        if !sessions.reaped(pid.as_raw(), st) {
                            live.reaped(pid.as_raw(), st);
                        }
                    }
                }
            }
        }
    }
}

fn send(conn: &mut UnixStream, kind: u8, payload: &[u8]) -> bool {
    proto::write_frame(conn, kind, payload).is_ok()
}

fn reply(conn: &mut UnixStream, r: &Reply) {
    let _ = conn.write_all(&proto::encode_json(r));
}

/// Reads the single request of a new connection and serves it; returns a started foreground exec.
fn handle_conn(
    mut conn: UnixStream,
    frame: Vec<u8>,
    sessions: &mut session::Sessions,
    live: &mut live::Table,
) -> Option<Exec> {
    let _ = conn.set_nonblocking(false);
    let req = match proto::read_frame(&mut &frame[..]) {
        Ok(Some((proto::KIND_JSON, body))) => {
            serde_json::from_slice::<Request>(&body).map_err(|e| e.to_string())
        }
        Ok(_) => Err("expected a JSON request frame".to_string()),
        Err(e) => Err(e.to_string()),
    };
    let req = match req {
        Ok(r) => r,
        Err(message) => {
            reply(&mut conn, &Failure::new(Protocol, message).into());
            return None;
        }
    };
    // Kept processes (background execs included) are served by the live table.
    let (mut conn, req) = match req {
        Request::Exec(spec) if spec.background => {
            live.start_background(conn, spec);
            return None;
        }
        req => live.handle(conn, req)?,
    };
    match req {
        Request::Ping => reply(&mut conn, &Reply::Ok),
        Request::Processes => reply(
            &mut conn,
            &Reply::Processes {
                list: procs::list(),
            },
        ),
        Request::Signal { pid, signal } => {
            let r = if pid <= 1 {
                Failure::new(Refused, format!("pid {pid} cannot be signalled")).into()
            } else {
                // A command started by exec leads its own session and group: signal the whole
                // group, so `sh -c 'server'` stops with its children instead of orphaning them.
                let target = match nix::unistd::getpgid(Some(Pid::from_raw(pid))) {
                    Ok(g) if g.as_raw() == pid => -pid,
                    _ => pid,
                };
                match crate::sys::kill(target, signal) {
                    Ok(()) => Reply::Ok,
                    Err(e) => {
                        let kind = match e.raw_os_error() {
                            Some(libc::ESRCH) => NoProcess,
                            _ => Refused,
                        };
                        Failure::new(kind, format!("kill {pid}: {e}")).into()
                    }
                }
            };
            reply(&mut conn, &r);
        }
        Request::Exec(spec) => return start_exec(conn, spec),
        r @ (Request::SessionCreate(_)
        | Request::SessionRun(_)
        | Request::SessionInterrupt { .. }
        | Request::SessionClose { .. }
        | Request::SessionList) => sessions.handle(conn, r),
        other => reply(
            &mut conn,
            &Failure::new(Protocol, format!("unexpected request {other:?}")).into(),
        ),
    }
    None
}

fn start_exec(mut conn: UnixStream, spec: ExecSpec) -> Option<Exec> {
    let started = Instant::now();
    let s = match spawn::spawn(&spawn::Opts::exec(&spec)) {
        Ok(s) => s,
        Err(f) => {
            reply(&mut conn, &f.into());
            return None;
        }
    };
    reply(
        &mut conn,
        &Reply::Started {
            pid: s.pid,
            log_path: None,
        },
    );
    let _ = conn.set_nonblocking(true);
    Some(Exec {
        conn,
        pid: s.pid,
        stdin: s.stdin.map(|fd| (fd, spec.stdin.unwrap_or_default(), 0)),
        stdout: s.stdout,
        stderr: s.stderr,
        argv: spec.argv,
        deadline: spec
            .timeout_ms
            .map(|ms| started + Duration::from_millis(ms)),
        started,
        timed_out: false,
        status: None,
        abandoned: false,
    })
}

/// Moves data for one exec: stdin out, stdout/stderr in (forwarded as frames), client hang-up.
fn pump(e: &mut Exec, ready: &HashMap<RawFd, i16>) {
    if let Some((fd, data, off)) = &mut e.stdin {
        if ready.contains_key(&fd.as_raw_fd()) || *off >= data.len() {
            loop {
                if *off >= data.len() {
                    e.stdin = None; // closes the pipe: EOF for the command
                    break;
                }
                match nix::unistd::write(&*fd, &data[*off..]) {
                    Ok(n) => *off += n,
                    Err(nix::errno::Errno::EAGAIN) => break,
                    Err(_) => {
                        e.stdin = None;
                        break;
                    }
                }
            }
        }
    }
    drain(e, ready, false);
    if ready.contains_key(&e.conn.as_raw_fd()) && e.status.is_none() && !e.abandoned {
        let mut buf = [0u8; 64];
        match e.conn.read(&mut buf) {
            Ok(0) => {
                e.abandoned = true;
                procs::kill_tree(e.pid);
            }
            Err(err) if err.kind() != std::io::ErrorKind::WouldBlock => {
                e.abandoned = true;
                procs::kill_tree(e.pid);
            }
            _ => {}
        }
    }
}

/// Reads available output; `all` drains until EAGAIN/EOF regardless of poll readiness.
fn drain(e: &mut Exec, ready: &HashMap<RawFd, i16>, all: bool) {
    let mut buf = vec![0u8; 64 * 1024];
    for (slot, kind) in [(&mut e.stdout, KIND_STDOUT), (&mut e.stderr, KIND_STDERR)] {
        let Some(fd) = slot.as_ref() else { continue };
        if !all && !ready.contains_key(&fd.as_raw_fd()) {
            continue;
        }
        loop {
            match nix::unistd::read(fd.as_raw_fd(), &mut buf) {
                Ok(0) => {
                    *slot = None;
                    break;
                }
                Ok(n) => {
                    if !e.abandoned && !send_blocking(&mut e.conn, kind, &buf[..n]) {
                        // Nobody reads the output any more: the command goes, as on a hang-up.
                        e.abandoned = true;
                        procs::kill_tree(e.pid);
                    }
                    if !all {
                        break;
                    }
                }
                Err(nix::errno::Errno::EINTR) => {}
                Err(_) => break, // EAGAIN: nothing more now
            }
        }
    }
}

/// Frames to the client are written blocking (the runtime reads continuously).
fn send_blocking(conn: &mut UnixStream, kind: u8, payload: &[u8]) -> bool {
    let _ = conn.set_nonblocking(false);
    let ok = send(conn, kind, payload);
    let _ = conn.set_nonblocking(true);
    ok
}

fn finish(mut e: Exec, live: &mut live::Table) {
    drain(&mut e, &HashMap::new(), true);
    // Children that outlive the command (`cmd &`) still hold its pipes: init reads on.
    live.read_on_leftover(
        e.pid,
        std::mem::take(&mut e.argv),
        e.status,
        e.stdout.take(),
        e.stderr.take(),
    );
    if e.abandoned {
        return;
    }
    let (exit_code, signal) = match e.status {
        Some(WaitStatus::Exited(_, c)) => (Some(c), None),
        Some(WaitStatus::Signaled(_, s, _)) => (None, Some(s as i32)),
        _ => (None, None),
    };
    let r = Reply::Exit {
        exit_code,
        signal,
        timed_out: e.timed_out,
        duration_ms: e.started.elapsed().as_millis() as u64,
    };
    let _ = e.conn.set_nonblocking(false);
    reply(&mut e.conn, &r);
}
