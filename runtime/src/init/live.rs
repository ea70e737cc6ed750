//! Processes init keeps past the request that started them: background execs, terminals, E2B-style
//! processes, and what the children of a finished exec still write. Their output is read by init
//! (never left on a pipe nobody reads), kept in a bounded replay buffer, optionally appended to a
//! log, and streamed to every connection attached to them. Nothing here blocks: a slow reader
//! pauses reading from its process (the process then blocks on its own pipe), never init.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::wait::WaitStatus;

use super::{procs, pty, spawn, Failure};
use crate::proto::InitErrorKind::{self, NoProcess, Refused};
use crate::proto::{
    self, ExecSpec, LiveInfo, ProcSpec, Reply, Request, KIND_PTY, KIND_STDERR, KIND_STDOUT, LOG_DIR,
};

/// Output kept per process for a later connect.
const REPLAY_CAP: usize = 1 << 20;
/// Bytes queued for one connection before reading from its process pauses.
const SUB_CAP: usize = 1 << 20;
/// Bytes of stdin queued per process.
const STDIN_CAP: usize = 4 << 20;
/// Most bytes written to one log; the rest is read and dropped.
const LOG_CAP: u64 = 256 << 20;
/// Ended processes kept for connect/list, and for how long.
const KEEP_ENDED: usize = 64;
const ENDED_TTL: Duration = Duration::from_secs(600);

/// A connection streaming one process's output.
struct Sub {
    conn: UnixStream,
    out: VecDeque<u8>,
    /// The connection that started the process: its hang-up kills a process not kept.
    owner: bool,
    /// Close once `out` is flushed (the exit frame is queued).
    closing: bool,
    dead: bool,
}

struct Proc {
    info: LiveInfo,
    keep: bool,
    pty: Option<OwnedFd>,
    stdin: Option<OwnedFd>,
    stdin_q: VecDeque<u8>,
    close_stdin: bool,
    out: Option<OwnedFd>,
    err: Option<OwnedFd>,
    log: Option<(File, u64)>,
    log_path: Option<String>,
    replay: VecDeque<(u8, Vec<u8>)>,
    replay_bytes: usize,
    subs: Vec<Sub>,
    status: Option<WaitStatus>,
    deadline: Option<Instant>,
    timed_out: bool,
    started: Instant,
    ended: Option<Instant>,
}

#[derive(Default)]
pub struct Table {
    procs: BTreeMap<i32, Proc>,
}

fn reply(conn: &mut UnixStream, r: &Reply) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.write_all(&proto::encode_json(r));
}

/// A refusal of a request about a kept process.
fn err(kind: InitErrorKind, message: impl Into<String>) -> Reply {
    Failure::new(kind, message).into()
}

fn open_log(pid: i32) -> (Option<(File, u64)>, Option<String>) {
    let path = format!("{LOG_DIR}/{pid}.log");
    // No symlink followed: the log directory is init's, but a path in it must not lead elsewhere.
    let f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path);
    match f {
        Ok(f) => (Some((f, 0)), Some(path)),
        Err(_) => (None, None),
    }
}

impl Proc {
    fn new(pid: i32, spec: &ProcSpec, s: spawn::Spawned) -> Self {
        let (log, log_path) = if spec.log {
            open_log(pid)
        } else {
            (None, None)
        };
        let started = Instant::now();
        Proc {
            info: LiveInfo {
                pid,
                argv: spec.argv.clone(),
                env: spec.env.clone(),
                cwd: spec.cwd.clone(),
                tag: spec.tag.clone(),
                pty: s.pty.is_some(),
                running: true,
                exit_code: None,
                signal: None,
            },
            keep: spec.keep,
            pty: s.pty,
            stdin: s.stdin,
            stdin_q: VecDeque::new(),
            close_stdin: false,
            out: s.stdout,
            err: s.stderr,
            log,
            log_path,
            replay: VecDeque::new(),
            replay_bytes: 0,
            subs: Vec::new(),
            status: None,
            deadline: spec
                .timeout_ms
                .map(|ms| started + Duration::from_millis(ms)),
            timed_out: false,
            started,
            ended: None,
        }
    }

    fn paused(&self) -> bool {
        self.subs.iter().any(|s| s.out.len() > SUB_CAP)
    }

    fn output_fds(&self) -> impl Iterator<Item = (RawFd, u8)> + '_ {
        [
            (&self.pty, KIND_PTY),
            (&self.out, KIND_STDOUT),
            (&self.err, KIND_STDERR),
        ]
        .into_iter()
        .filter_map(|(fd, k)| fd.as_ref().map(|fd| (fd.as_raw_fd(), k)))
    }

    fn exit_frame(&self) -> Vec<u8> {
        proto::encode_json(&Reply::Exit {
            exit_code: self.info.exit_code,
            signal: self.info.signal,
            timed_out: self.timed_out,
            duration_ms: self.started.elapsed().as_millis() as u64,
        })
    }

    /// One chunk of output: to the log, the replay buffer and every attached connection.
    fn output(&mut self, kind: u8, data: &[u8]) {
        if let Some((f, n)) = &mut self.log {
            if *n < LOG_CAP {
                let take = data.len().min((LOG_CAP - *n) as usize);
                if f.write_all(&data[..take]).is_ok() {
                    *n += take as u64;
                }
            }
        }
        self.replay.push_back((kind, data.to_vec()));
        self.replay_bytes += data.len();
        while self.replay_bytes > REPLAY_CAP {
            match self.replay.pop_front() {
                Some((_, d)) => self.replay_bytes -= d.len(),
                None => break,
            }
        }
        if self.ended.is_none() {
            let frame = proto::encode(kind, data);
            for s in self.subs.iter_mut().filter(|s| !s.closing) {
                s.out.extend(&frame);
            }
        }
    }

    /// Reads what is there on the output fds (`all`: until EAGAIN, else a bounded amount).
    fn read_output(&mut self, ready: &HashMap<RawFd, i16>, all: bool) {
        let mut buf = vec![0u8; 64 * 1024];
        for kind in [KIND_PTY, KIND_STDOUT, KIND_STDERR] {
            for _ in 0..if all { usize::MAX } else { 4 } {
                let slot = match kind {
                    KIND_PTY => &self.pty,
                    KIND_STDOUT => &self.out,
                    _ => &self.err,
                };
                let Some(fd) = slot.as_ref().map(|f| f.as_raw_fd()) else {
                    break;
                };
                if !all && !ready.contains_key(&fd) {
                    break;
                }
                match nix::unistd::read(fd, &mut buf) {
                    Ok(0) | Err(nix::errno::Errno::EIO) => {
                        self.close_output(kind);
                        break;
                    }
                    Ok(n) => {
                        let data = buf[..n].to_vec();
                        self.output(kind, &data);
                    }
                    Err(nix::errno::Errno::EINTR) => {}
                    Err(nix::errno::Errno::EAGAIN) => break,
                    Err(_) => {
                        self.close_output(kind);
                        break;
                    }
                }
            }
        }
    }

    fn close_output(&mut self, kind: u8) {
        match kind {
            KIND_PTY => self.pty = None,
            KIND_STDOUT => self.out = None,
            _ => self.err = None,
        }
    }

    fn write_stdin(&mut self) {
        let fd = match (&self.pty, &self.stdin) {
            (Some(m), _) => m.as_fd(),
            (None, Some(w)) => w.as_fd(),
            (None, None) => {
                self.stdin_q.clear();
                return;
            }
        };
        let mut reader_gone = false;
        while !self.stdin_q.is_empty() {
            let (a, _) = self.stdin_q.as_slices();
            match nix::unistd::write(fd, a) {
                Ok(n) if n > 0 => {
                    self.stdin_q.drain(..n);
                }
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => return,
                // The reader is gone: nothing more will be taken.
                _ => {
                    reader_gone = true;
                    break;
                }
            }
        }
        if reader_gone {
            self.stdin_q.clear();
            self.stdin = None;
            return;
        }
        if self.close_stdin {
            self.stdin = None;
        }
    }

    fn pump_subs(&mut self, ready: &HashMap<RawFd, i16>) {
        for s in &mut self.subs {
            let fd = s.conn.as_raw_fd();
            if let Some(&ev) = ready.get(&fd) {
                if ev & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                    let mut b = [0u8; 512];
                    match s.conn.read(&mut b) {
                        Ok(0) => s.dead = true,
                        Ok(_) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => s.dead = true,
                    }
                }
            }
            while !s.dead && !s.out.is_empty() {
                let (a, _) = s.out.as_slices();
                match s.conn.write(a) {
                    Ok(0) => s.dead = true,
                    Ok(n) => {
                        s.out.drain(..n);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => s.dead = true,
                }
            }
            if s.closing && s.out.is_empty() {
                s.dead = true;
            }
        }
        let owner_gone = self.subs.iter().any(|s| s.dead && s.owner && !s.closing);
        self.subs.retain(|s| !s.dead);
        if owner_gone && !self.keep && self.status.is_none() {
            procs::kill_tree(self.info.pid);
        }
    }

    fn add_sub(&mut self, mut conn: UnixStream, owner: bool) {
        let _ = conn.set_nonblocking(true);
        let mut out = VecDeque::new();
        out.extend(proto::encode_json(&Reply::Started {
            pid: self.info.pid,
            log_path: self.log_path.clone(),
        }));
        if !owner {
            for (k, d) in &self.replay {
                out.extend(proto::encode(*k, d));
            }
        }
        let closing = self.ended.is_some();
        if closing {
            out.extend(self.exit_frame());
        }
        // A first write now: a short reply leaves at once.
        while !out.is_empty() {
            let (a, _) = out.as_slices();
            match conn.write(a) {
                Ok(n) if n > 0 => {
                    out.drain(..n);
                }
                _ => break,
            }
        }
        self.subs.push(Sub {
            conn,
            out,
            owner,
            closing,
            dead: false,
        });
    }

    /// After the exit status: output already there goes out first, then the exit frame.
    fn end(&mut self) {
        self.read_output(&HashMap::new(), true);
        let (code, sig) = match self.status {
            Some(WaitStatus::Exited(_, c)) => (Some(c), None),
            Some(WaitStatus::Signaled(_, s, _)) => (None, Some(s as i32)),
            _ => (None, None),
        };
        self.info.running = false;
        self.info.exit_code = code;
        self.info.signal = sig;
        let frame = self.exit_frame();
        self.ended = Some(Instant::now());
        for s in &mut self.subs {
            if !s.closing {
                s.out.extend(&frame);
                s.closing = true;
            }
        }
        // Stdin to a process that is gone.
        self.stdin = None;
        self.stdin_q.clear();
    }

    fn idle(&self) -> bool {
        self.ended.is_some() && self.subs.is_empty() && self.output_fds().next().is_none()
    }
}

impl Table {
    /// Adds this table's descriptors to the poll set.
    pub fn poll_fds(&self, fds: &mut Vec<libc::pollfd>) {
        let mut want: BTreeMap<RawFd, i16> = BTreeMap::new();
        for p in self.procs.values() {
            if !p.paused() {
                for (fd, _) in p.output_fds() {
                    *want.entry(fd).or_default() |= libc::POLLIN;
                }
            }
            if !p.stdin_q.is_empty() {
                if let Some(fd) = p.pty.as_ref().or(p.stdin.as_ref()) {
                    *want.entry(fd.as_raw_fd()).or_default() |= libc::POLLOUT;
                }
            }
            for s in &p.subs {
                let mut ev = libc::POLLIN;
                if !s.out.is_empty() {
                    ev |= libc::POLLOUT;
                }
                *want.entry(s.conn.as_raw_fd()).or_default() |= ev;
            }
        }
        fds.extend(want.into_iter().map(|(fd, events)| libc::pollfd {
            fd,
            events,
            revents: 0,
        }));
    }

    /// Milliseconds to the next deadline, or -1.
    pub fn next_timeout(&self) -> i32 {
        let now = Instant::now();
        self.procs
            .values()
            .filter(|p| p.status.is_none() && !p.timed_out)
            .filter_map(|p| p.deadline)
            .map(|d| d.saturating_duration_since(now).as_millis().min(60_000) as i32 + 1)
            .min()
            .unwrap_or(-1)
    }

    /// A reaped child: true when it was one of ours.
    pub fn reaped(&mut self, pid: i32, st: WaitStatus) -> bool {
        match self.procs.get_mut(&pid) {
            Some(p) if p.status.is_none() => {
                p.status = Some(st);
                true
            }
            _ => false,
        }
    }

    /// Moves data and ends what has exited; called once per loop turn.
    pub fn pump(&mut self, ready: &HashMap<RawFd, i16>) {
        let now = Instant::now();
        for p in self.procs.values_mut() {
            if !p.stdin_q.is_empty() || p.close_stdin {
                p.write_stdin();
            }
            if !p.paused() {
                p.read_output(ready, false);
            }
            if p.status.is_none() && !p.timed_out && p.deadline.is_some_and(|d| now >= d) {
                p.timed_out = true;
                procs::kill_tree(p.info.pid);
            }
            if p.status.is_some() && p.ended.is_none() {
                p.end();
            }
            p.pump_subs(ready);
        }
        let ended: Vec<i32> = self
            .procs
            .iter()
            .filter(|(_, p)| p.idle())
            .map(|(pid, _)| *pid)
            .collect();
        let excess = ended.len().saturating_sub(KEEP_ENDED);
        for (i, pid) in ended.into_iter().enumerate() {
            let old = self.procs[&pid]
                .ended
                .is_some_and(|t| t.elapsed() > ENDED_TTL);
            if i < excess || old {
                self.procs.remove(&pid);
            }
        }
    }

    /// Starts a kept process; with `attach` the connection streams it, otherwise it closes after
    /// `Started`.
    pub fn start(&mut self, mut conn: UnixStream, spec: ProcSpec) -> Option<i32> {
        let o = spawn::Opts {
            argv: &spec.argv,
            env: &spec.env,
            cwd: &spec.cwd,
            user: spec.user.as_deref(),
            user_or_root: spec.user_or_root,
            stdin: spec.stdin,
            pty: spec.pty,
        };
        let s = match spawn::spawn(&o) {
            Ok(s) => s,
            Err(f) => {
                reply(&mut conn, &f.into());
                return None;
            }
        };
        let pid = s.pid;
        let mut p = Proc::new(pid, &spec, s);
        if spec.attach {
            p.add_sub(conn, true);
        } else {
            reply(
                &mut conn,
                &Reply::Started {
                    pid,
                    log_path: p.log_path.clone(),
                },
            );
        }
        self.procs.insert(pid, p);
        Some(pid)
    }

    /// A background exec: a kept process whose output goes to its log, with the request's stdin
    /// written and then closed.
    pub fn start_background(&mut self, conn: UnixStream, spec: ExecSpec) {
        let stdin = spec.stdin.clone();
        let ps = ProcSpec {
            argv: spec.argv,
            env: spec.env,
            cwd: spec.cwd,
            user: spec.user,
            stdin: stdin.is_some(),
            keep: true,
            log: true,
            ..ProcSpec::default()
        };
        let pid = self.start(conn, ps);
        if let (Some(data), Some(pid)) = (stdin, pid) {
            if let Some(p) = self.procs.get_mut(&pid) {
                p.stdin_q.extend(data);
                p.close_stdin = true;
            }
        }
    }

    /// What a finished exec's children still write: read on into `LOG_DIR/<pid>.log` (and the
    /// replay buffer, for connect) until they close it.
    pub fn read_on_leftover(
        &mut self,
        pid: i32,
        argv: Vec<String>,
        status: Option<WaitStatus>,
        out: Option<OwnedFd>,
        err: Option<OwnedFd>,
    ) {
        if out.is_none() && err.is_none() {
            return;
        }
        let (log, log_path) = open_log(pid);
        let spec = ProcSpec {
            argv,
            keep: true,
            ..ProcSpec::default()
        };
        let s = spawn::Spawned {
            pid,
            stdin: None,
            stdout: out,
            stderr: err,
            pty: None,
        };
        let mut p = Proc::new(pid, &spec, s);
        p.log = log;
        p.log_path = log_path;
        p.status = status.or(Some(WaitStatus::Exited(nix::unistd::Pid::from_raw(pid), 0)));
        p.end();
        self.procs.insert(pid, p);
    }

    /// Serves the `Proc*` requests; returns the request back when it is not one of them.
    pub fn handle(&mut self, mut conn: UnixStream, req: Request) -> Option<(UnixStream, Request)> {
        let r = match req {
            Request::ProcStart(spec) => {
                self.start(conn, spec);
                return None;
            }
            Request::ProcConnect { pid } => {
                match self.procs.get_mut(&pid) {
                    Some(p) => p.add_sub(conn, false),
                    None => reply(&mut conn, &err(NoProcess, format!("no process {pid}"))),
                }
                return None;
            }
            Request::ProcList => Reply::Live {
                list: self.procs.values().map(|p| p.info.clone()).collect(),
            },
            Request::ProcInput { pid, data } => match self.running(pid) {
                Err(f) => f.into(),
                Ok(p) if p.pty.is_none() && (p.stdin.is_none() || p.close_stdin) => {
                    err(Refused, format!("stdin of process {pid} is not open"))
                }
                Ok(p) if p.stdin_q.len() + data.len() > STDIN_CAP => {
                    err(Refused, format!("stdin of process {pid}: too much queued"))
                }
                Ok(p) => {
                    p.stdin_q.extend(data);
                    p.write_stdin();
                    Reply::Ok
                }
            },
            Request::ProcCloseStdin { pid } => match self.running(pid) {
                Err(f) => f.into(),
                Ok(p) if p.pty.is_some() => err(
                    Refused,
                    format!("process {pid} runs on a terminal: send EOT (0x04)"),
                ),
                Ok(p) => {
                    p.close_stdin = true;
                    p.write_stdin();
                    Reply::Ok
                }
            },
            Request::ProcResize { pid, size } => match self.running(pid) {
                Err(f) => f.into(),
                Ok(p) => match &p.pty {
                    Some(m) if size.cols > 0 && size.rows > 0 => match pty::resize(m, size) {
                        Ok(()) => Reply::Ok,
                        Err(f) => f.into(),
                    },
                    Some(_) => err(Refused, "a terminal has at least one column and one row"),
                    None => err(Refused, format!("process {pid} has no terminal")),
                },
            },
            other => return Some((conn, other)),
        };
        reply(&mut conn, &r);
        None
    }

    fn running(&mut self, pid: i32) -> Result<&mut Proc, Failure> {
        match self.procs.get_mut(&pid) {
            Some(p) if p.ended.is_none() => Ok(p),
            Some(_) => Err(Failure::new(Refused, format!("process {pid} has ended"))),
            None => Err(Failure::new(NoProcess, format!("no process {pid}"))),
        }
    }
}
