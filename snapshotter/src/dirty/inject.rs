//! Making another process open a userfaultfd: system calls injected with ptrace.
//!
//! The sandbox's seccomp filter denies userfaultfd(2), and a uffd belongs to the mm of the
//! process that calls userfaultfd(2), so the call has to run in the target. groved seizes one
//! thread of the target (uffd is per mm: one thread serves the whole process) with
//! PTRACE_O_SUSPEND_SECCOMP, stops it with PTRACE_INTERRUPT, points its registers at a `syscall`
//! instruction of its vDSO (nothing is written into the target's memory), steps each call
//! through its syscall-entry and -exit stops, and puts every register back before detaching.
//!
//! Why the target's own state survives:
//! - The registers are restored exactly as the interrupt stop found them, including `orig_rax`
//!   and an `-ERESTART*` in `rax`. The stop was taken in get_signal(); our calls run with
//!   `orig_rax = -1` so the restart logic leaves them alone; PTRACE_DETACH sets TIF_SIGPENDING on
//!   the tracee (`__ptrace_unlink` → `ptrace_signal_wake_up`), so on its way back to user mode
//!   arch_do_signal_or_restart() sees the restored registers and restarts an interrupted syscall
//!   exactly as it would have without us.
//! - Every blockable signal is blocked while our calls run (PTRACE_SETSIGMASK, as CRIU's compel
//!   does), so no handler frame can be built on top of our registers; PTRACE_GETSIGMASK returns
//!   the saved mask when a ppoll-style call had a temporary one, and the restart re-installs it.
//!   SIGSTOP (unblockable, no handler) is passed through; SIGKILL needs no care.
//! - A task in group-stop is resumed only for our calls: on detach the kernel re-enters the
//!   group-stop (`__ptrace_unlink` reinstates JOBCTL_STOP_PENDING).
//!
//! All ptrace requests of one injection come from one thread spawned for it (a tracee belongs
//! to the thread that seized it), so `register` may be called from any thread.
//!
//! That thread runs in a process of its own, forked from groved for the injection, which hands
//! the uffd back over a socket. While the target's registers point at the gadget, its tracer's
//! death would let it run on from there (the kernel detaches a dead tracer's tracees as they
//! are), into the vDSO with our registers. The crash test SIGKILLs groved at random moments:
//! two of three 600-kill runs of it ended with a sandbox whose init had died while groved was
//! down; with the injection in a process of its own, none did (docs/crash-promises.md).
//! That process is not killed with groved: it finishes the injection, puts the registers back
//! and exits. Between fork and exit it only makes system calls, reads /proc and allocates
//! (glibc's malloc is usable in the child of a multithreaded fork); it takes no lock another
//! groved thread could have held.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::RecvTimeoutError;
use std::sync::OnceLock;
use std::time::Duration;

use super::sys::{self, Regs, WaitEvent};
use super::uffd::{read_maps, Vma};
use super::TrackError;

/// `syscall`.
const SYSCALL_INSN: [u8; 2] = [0x0f, 0x05];
/// PTRACE_EVENT_STOP in the high byte of a stop's status.
const EVENT_STOP: i32 = libc::PTRACE_EVENT_STOP;
/// A syscall-entry or -exit stop's signal with PTRACE_O_TRACESYSGOOD.
const SYSCALL_STOP: i32 = libc::SIGTRAP | 0x80;
/// The code segment of 64-bit user mode (__USER_CS).
const USER64_CS: u64 = 0x33;
/// How many unexpected stops (event stops, passed-through SIGSTOPs, signals delivered before the
/// interrupt took) one wait tolerates before it gives up: a bound, not a tuning knob.
const MAX_DETOURS: u32 = 64;

/// Offset of a `syscall` instruction in this kernel's vDSO image, found once in groved's own
/// vDSO (the image is the same for every 64-bit process of a kernel).
fn vdso_gadget_offset() -> Option<u64> {
    static OFFSET: OnceLock<Option<u64>> = OnceLock::new();
    *OFFSET.get_or_init(|| {
        let base = sys::own_vdso_base();
        if base == 0 {
            return None;
        }
        let maps = read_maps(std::process::id() as i32).ok()?;
        let vdso = maps.iter().find(|v| v.start == base)?;
        let image = read_mem(std::process::id() as i32, vdso.start, vdso.end - vdso.start).ok()?;
        find_syscall(&image).map(|off| off as u64)
    })
}

fn find_syscall(bytes: &[u8]) -> Option<usize> {
    bytes.windows(2).position(|w| w == SYSCALL_INSN)
}

fn read_mem(pid: i32, addr: u64, len: u64) -> std::io::Result<Vec<u8>> {
    let mem = File::open(format!("/proc/{pid}/mem"))?;
    let mut buf = vec![0u8; len as usize];
    mem.read_exact_at(&mut buf, addr)?;
    Ok(buf)
}

/// The address of a `syscall` instruction in `pid`'s vDSO.
fn gadget(pid: i32, maps: &[Vma]) -> Result<u64, TrackError> {
    let no_gadget = |reason: &str| TrackError::Unexpected {
        pid,
        what: format!("no syscall instruction to borrow: {reason}"),
    };
    let vdso = maps
        .iter()
        .find(|v| v.name == "[vdso]")
        .ok_or_else(|| no_gadget("the process has no [vdso]"))?;
    if let Some(off) = vdso_gadget_offset() {
        let at = vdso.start + off;
        if at + 2 <= vdso.end && read_mem(pid, at, 2).ok().as_deref() == Some(&SYSCALL_INSN[..]) {
            return Ok(at);
        }
    }
    // Not the image groved has (a 32-bit process, a process restored from another kernel):
    // scan the target's own.
    let image =
        read_mem(pid, vdso.start, vdso.end - vdso.start).map_err(|source| TrackError::Proc {
            pid,
            what: "mem",
            source,
        })?;
    find_syscall(&image)
        .map(|off| vdso.start + off as u64)
        .ok_or_else(|| no_gadget("none in its [vdso]"))
}

/// Fields of /proc/<pid>/task/<tid>/stat that the injection needs.
struct ProcInfo {
    state: char,
    ppid: i32,
}

fn proc_info(pid: i32, tid: i32) -> std::io::Result<ProcInfo> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat"))?;
    // "pid (comm) S ppid ...": comm may hold spaces and parentheses; the last ')' ends it.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| std::io::Error::other("malformed stat"))?;
    let mut fields = rest.split_whitespace();
    let state = fields.next().and_then(|s| s.chars().next()).unwrap_or('?');
    let ppid = fields.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok(ProcInfo { state, ppid })
}

fn is_dead(state: char) -> bool {
    matches!(state, 'Z' | 'X' | 'x')
}

/// The thread to seize: the thread-group leader, or (if the leader has exited while other
/// threads run on, a zombie that cannot run a syscall) the first live thread.
fn pick_thread(pid: i32) -> Result<(i32, ProcInfo), TrackError> {
    let proc_err = |source: std::io::Error| {
        if source.kind() == std::io::ErrorKind::NotFound {
            TrackError::Exited { pid }
        } else {
            TrackError::Proc {
                pid,
                what: "stat",
                source,
            }
        }
    };
    let leader = proc_info(pid, pid).map_err(proc_err)?;
    if !is_dead(leader.state) {
        return Ok((pid, leader));
    }
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).map_err(proc_err)?;
    for task in tasks.flatten() {
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if let Ok(info) = proc_info(pid, tid) {
            if !is_dead(info.state) {
                // A thread's stat gives its own parent field as the process's.
                return Ok((
                    tid,
                    ProcInfo {
                        ppid: leader.ppid,
                        ..info
                    },
                ));
            }
        }
    }
    Err(TrackError::NoMm {
        pid,
        state: leader.state,
    })
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    /// Seized or resumed: running (or about to stop).
    Running,
    /// In a ptrace stop this thread consumed.
    Stopped,
    /// Exited; nothing more to undo.
    Gone,
    Detached,
}

/// One seized thread. Dropping it before `finish` puts the thread back as found (if it is in a
/// stop) and detaches.
struct Tracee {
    pid: i32,
    tid: i32,
    state: State,
    /// Whether this process is the target's parent (then the leader's exit is left to our own
    /// reaper).
    parent: bool,
    saved: Option<Regs>,
    mask: Option<u64>,
}

impl Tracee {
    fn ptrace_err(&self, request: &'static str, source: std::io::Error) -> TrackError {
        if source.raw_os_error() == Some(libc::ESRCH) && !self.alive() {
            return TrackError::Exited { pid: self.pid };
        }
        TrackError::Ptrace {
            pid: self.pid,
            tid: self.tid,
            request,
            source,
        }
    }

    fn alive(&self) -> bool {
        proc_info(self.pid, self.tid).is_ok_and(|i| !is_dead(i.state))
    }

    fn seize(pid: i32, tid: i32, parent: bool) -> Result<Self, TrackError> {
        let options = libc::PTRACE_O_SUSPEND_SECCOMP | libc::PTRACE_O_TRACESYSGOOD;
        match sys::seize(tid, options) {
            Ok(()) => Ok(Tracee {
                pid,
                tid,
                state: State::Running,
                parent,
                saved: None,
                mask: None,
            }),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Err(TrackError::Exited { pid }),
            Err(source) => Err(TrackError::Ptrace {
                pid,
                tid,
                request: "PTRACE_SEIZE",
                source,
            }),
        }
    }

    /// Waits for the next stop: (signal, event). An exit ends it with `Exited` (reaped here
    /// unless this process is the parent).
    fn wait(&mut self) -> Result<(i32, i32), TrackError> {
        loop {
            let ev = sys::wait_peek(self.tid).map_err(|e| self.ptrace_err("waitid", e))?;
            match ev {
                WaitEvent::Stopped { .. } => {
                    if let WaitEvent::Stopped { status } =
                        sys::wait_take_stop(self.tid).map_err(|e| self.ptrace_err("waitid", e))?
                    {
                        self.state = State::Stopped;
                        return Ok((status & 0xff, (status >> 8) & 0xff));
                    }
                    // Killed between the two calls: look again.
                }
                WaitEvent::Exited => {
                    self.state = State::Gone;
                    // The tracer releases what it traced; only the exit of a thread-group leader
                    // whose parent we are is left to our own reaper (it reaps a child traced by
                    // its own thread group as any other).
                    if !self.parent || self.tid != self.pid {
                        let _ = sys::wait_take_exit(self.tid);
                    }
                    return Err(TrackError::Exited { pid: self.pid });
                }
                WaitEvent::Nothing => {}
            }
        }
    }

    fn resume_syscall(&mut self, sig: i32) -> Result<(), TrackError> {
        sys::resume_syscall(self.tid, sig).map_err(|e| self.ptrace_err("PTRACE_SYSCALL", e))?;
        self.state = State::Running;
        Ok(())
    }

    /// Stops the thread where it is (PTRACE_INTERRUPT) and saves its registers and signal mask,
    /// then blocks its signals.
    fn stop(&mut self) -> Result<(), TrackError> {
        sys::interrupt(self.tid).map_err(|e| self.ptrace_err("PTRACE_INTERRUPT", e))?;
        let mut detours = 0;
        loop {
            let (sig, event) = self.wait()?;
            if event == EVENT_STOP {
                // Our interrupt, or the group-stop of a stopped task (sig = its stop signal).
                break;
            }
            detours += 1;
            if detours > MAX_DETOURS {
                return Err(
                    self.unexpected(format!("no interrupt stop (last stop: {sig}/{event})"))
                );
            }
            // A signal-delivery-stop before the interrupt took: deliver it as the kernel was
            // about to (registers untouched); the pending interrupt stops the thread next.
            let pass = if sig == SYSCALL_STOP { 0 } else { sig };
            sys::resume_cont(self.tid, pass).map_err(|e| self.ptrace_err("PTRACE_CONT", e))?;
            self.state = State::Running;
        }
        let regs = sys::get_regs(self.tid).map_err(|e| self.ptrace_err("PTRACE_GETREGS", e))?;
        self.saved = Some(regs);
        if regs.cs != USER64_CS {
            // A 32-bit task: `syscall` would fault or take 32-bit numbers. (Dropping `self`
            // detaches; nothing was changed.)
            return Err(self.unexpected(format!("not a 64-bit task (cs {:#x})", regs.cs)));
        }
        let mask =
            sys::get_sigmask(self.tid).map_err(|e| self.ptrace_err("PTRACE_GETSIGMASK", e))?;
        self.mask = Some(mask);
        sys::set_sigmask(self.tid, !0).map_err(|e| self.ptrace_err("PTRACE_SETSIGMASK", e))?;
        Ok(())
    }

    fn unexpected(&self, what: String) -> TrackError {
        TrackError::Unexpected {
            pid: self.pid,
            what: format!("thread {}: {what}", self.tid),
        }
    }

    /// Waits for a syscall-entry or -exit stop, passing over event stops and SIGSTOPs.
    fn wait_syscall_stop(&mut self) -> Result<(), TrackError> {
        for _ in 0..MAX_DETOURS {
            let (sig, event) = self.wait()?;
            if event == 0 && sig == SYSCALL_STOP {
                return Ok(());
            }
            if event != 0 {
                // A group-stop or a late interrupt: taken in get_signal(), our registers stand.
                self.resume_syscall(0)?;
                continue;
            }
            if sig == libc::SIGSTOP {
                // Unblockable and handler-less: let it start the group-stop it asks for.
                self.resume_syscall(sig)?;
                continue;
            }
            // Everything else is blocked, so this signal was raised by our injected instruction
            // itself (a fault): drop it and give up (the drop restores the thread).
            return Err(self.unexpected(format!("signal {sig} while running an injected syscall")));
        }
        Err(self.unexpected("too many stops while running an injected syscall".into()))
    }

    /// Runs `nr(args)` in the thread from the `syscall` at `gadget`; returns its raw result.
    fn syscall(&mut self, gadget: u64, nr: i64, args: &[u64]) -> Result<i64, TrackError> {
        let saved = self.saved.expect("stop() saved the registers");
        let mut regs = saved;
        regs.rip = gadget;
        regs.rax = nr as u64;
        // Not "in a syscall": the kernel's restart logic must not touch our registers.
        regs.orig_rax = u64::MAX;
        let slots = [
            &mut regs.rdi,
            &mut regs.rsi,
            &mut regs.rdx,
            &mut regs.r10,
            &mut regs.r8,
            &mut regs.r9,
        ];
        for (slot, arg) in slots.into_iter().zip(args) {
            *slot = *arg;
        }
        sys::set_regs(self.tid, &regs).map_err(|e| self.ptrace_err("PTRACE_SETREGS", e))?;
        self.resume_syscall(0)?;
        self.wait_syscall_stop()?;
        let entry = sys::get_regs(self.tid).map_err(|e| self.ptrace_err("PTRACE_GETREGS", e))?;
        if entry.orig_rax != nr as u64 || entry.rip != gadget + 2 {
            return Err(self.unexpected(format!(
                "entered syscall {} at {:#x}, not {nr} at {:#x}",
                entry.orig_rax as i64,
                entry.rip,
                gadget + 2
            )));
        }
        self.resume_syscall(0)?;
        self.wait_syscall_stop()?;
        let exit = sys::get_regs(self.tid).map_err(|e| self.ptrace_err("PTRACE_GETREGS", e))?;
        Ok(exit.rax as i64)
    }

    /// Puts the registers and signal mask back and detaches (the thread must be stopped).
    fn restore_and_detach(&mut self) -> Result<(), TrackError> {
        if let Some(regs) = self.saved.take() {
            sys::set_regs(self.tid, &regs).map_err(|e| self.ptrace_err("PTRACE_SETREGS", e))?;
        }
        if let Some(mask) = self.mask.take() {
            sys::set_sigmask(self.tid, mask)
                .map_err(|e| self.ptrace_err("PTRACE_SETSIGMASK", e))?;
        }
        sys::detach(self.tid, 0).map_err(|e| self.ptrace_err("PTRACE_DETACH", e))?;
        self.state = State::Detached;
        Ok(())
    }

    fn finish(mut self) -> Result<(), TrackError> {
        self.restore_and_detach()
    }
}

impl Drop for Tracee {
    fn drop(&mut self) {
        match self.state {
            State::Gone | State::Detached => {}
            State::Stopped => {
                let _ = self.restore_and_detach();
            }
            State::Running => {
                // Only a failed wait leaves it running: stop it to be able to detach.
                if sys::interrupt(self.tid).is_ok() {
                    for _ in 0..MAX_DETOURS {
                        match self.wait() {
                            Ok((_, event)) if event == EVENT_STOP => {
                                let _ = self.restore_and_detach();
                                return;
                            }
                            Ok((sig, _)) => {
                                let pass = if sig == SYSCALL_STOP { 0 } else { sig };
                                if sys::resume_cont(self.tid, pass).is_err() {
                                    return;
                                }
                            }
                            Err(_) => return,
                        }
                    }
                }
            }
        }
    }
}

/// How long `open_uffd` waits for the injection. It takes well under a millisecond; a target
/// that cannot reach a ptrace stop (frozen by a v1 freezer cgroup, in an uninterruptible sleep)
/// holds it until it can.
pub(super) const INJECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Makes process `pid` (whose pidfd is `pidfd`) open a userfaultfd for its own mm, takes it into
/// this process, and closes it in the target again; all inside one seize/detach.
///
/// The injection runs on a thread of its own (ptrace requests must all come from the thread that
/// seized, whatever thread calls this), which the caller waits for at most [`INJECT_TIMEOUT`].
/// After a timeout that thread carries on: it waits for the target's stop, finishes the
/// injection, detaches and drops the uffd, so the target is never left traced.
pub(super) fn open_uffd(pid: i32, pidfd: BorrowedFd<'_>) -> Result<OwnedFd, TrackError> {
    let pidfd = pidfd
        .try_clone_to_owned()
        .map_err(|source| TrackError::Proc {
            pid,
            what: "pidfd",
            source,
        })?;
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name(format!("inject-{pid}"))
        .spawn(move || {
            let _ = tx.send(open_uffd_here(pid, pidfd.as_fd()));
        })
        .map_err(|source| TrackError::Proc {
            pid,
            what: "(a thread to inject from)",
            source,
        })?;
    match rx.recv_timeout(INJECT_TIMEOUT) {
        Ok(r) => r,
        Err(RecvTimeoutError::Timeout) => Err(TrackError::TimedOut {
            pid,
            after: INJECT_TIMEOUT,
        }),
        Err(RecvTimeoutError::Disconnected) => Err(TrackError::Unexpected {
            pid,
            what: "the injecting thread died".into(),
        }),
    }
}

fn open_uffd_here(pid: i32, pidfd: BorrowedFd<'_>) -> Result<OwnedFd, TrackError> {
    let (tid, info) = pick_thread(pid)?;
    let maps = read_maps(pid).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            TrackError::Exited { pid }
        } else {
            TrackError::Proc {
                pid,
                what: "maps",
                source,
            }
        }
    })?;
    if maps.is_empty() {
        // A zombie or a kernel thread: no mm to track.
        return Err(TrackError::NoMm {
            pid,
            state: info.state,
        });
    }
    let gadget = gadget(pid, &maps)?;
    in_own_process(pid, pidfd.as_raw_fd(), || {
        inject(pid, tid, info.ppid, gadget, pidfd)
    })
}

/// Runs `injection` in a process forked for it (see the module doc), which keeps only the
/// socket back and `pidfd` of groved's descriptors, and returns its outcome, the uffd passed
/// back with SCM_RIGHTS.
fn in_own_process(
    pid: i32,
    pidfd: RawFd,
    injection: impl FnOnce() -> Result<OwnedFd, TrackError>,
) -> Result<OwnedFd, TrackError> {
    let local = |what, source| TrackError::Proc { pid, what, source };
    let (ours, theirs) =
        UnixStream::pair().map_err(|e| local("(a socket to the injecting process)", e))?;
    match sys::fork().map_err(|e| local("(a process to inject from)", e))? {
        0 => {
            sys::close_all_but(&[theirs.as_raw_fd(), pidfd]);
            std::mem::forget(ours);
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(injection))
                .unwrap_or_else(|_| {
                    Err(TrackError::Unexpected {
                        pid,
                        what: "the injecting process panicked".into(),
                    })
                });
            let _ = report(&theirs, outcome);
            sys::exit_now()
        }
        child => {
            drop(theirs);
            let outcome = hear(&ours, pid);
            sys::reap(child);
            outcome
        }
    }
}

/// What the injecting process sends: `O` with the uffd, `X` (the target exited) or `E` and the
/// error's text.
fn report(to: &UnixStream, outcome: Result<OwnedFd, TrackError>) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let (text, fd) = match &outcome {
        Ok(fd) => (b"O".to_vec(), Some(fd.as_raw_fd())),
        Err(TrackError::Exited { .. }) => (b"X".to_vec(), None),
        Err(e) => (format!("E{}", chain(e)).into_bytes(), None),
    };
    let fds = fd.map(|f| [f]);
    let cmsgs: Vec<ControlMessage<'_>> = fds.iter().map(|f| ControlMessage::ScmRights(f)).collect();
    let iov = [std::io::IoSlice::new(&text)];
    sendmsg::<()>(to.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    Ok(())
}

/// The injecting process's outcome (see [`report`]); its death without one is `Unexpected`.
fn hear(from: &UnixStream, pid: i32) -> Result<OwnedFd, TrackError> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut buf = [0u8; 4096];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let (n, fd) = {
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        let msg = loop {
            match recvmsg::<()>(
                from.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Err(nix::errno::Errno::EINTR) => continue,
                other => break other,
            }
        }
        .map_err(|e| TrackError::Unexpected {
            pid,
            what: format!("no word from the injecting process: {e}"),
        })?;
        let fd = msg
            .cmsgs()
            .ok()
            .into_iter()
            .flatten()
            .find_map(|c| match c {
                ControlMessageOwned::ScmRights(fds) => fds.first().copied(),
                _ => None,
            });
        (msg.bytes, fd)
    };
    // SAFETY: SCM_RIGHTS installed this descriptor in this process just now; nothing else owns it.
    let fd = fd.map(|f| unsafe { OwnedFd::from_raw_fd(f) });
    match (buf[..n].first(), fd) {
        (Some(b'O'), Some(fd)) => Ok(fd),
        (Some(b'X'), _) => Err(TrackError::Exited { pid }),
        (Some(b'E'), _) => Err(TrackError::Unexpected {
            pid,
            what: String::from_utf8_lossy(&buf[1..n]).into_owned(),
        }),
        _ => Err(TrackError::Unexpected {
            pid,
            what: "the injecting process ended without a word".into(),
        }),
    }
}

/// An error with its sources, for the text the injecting process sends.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s = format!("{s}: {c}");
        cur = c.source();
    }
    s
}

/// The injection proper, in the injecting process: seize, run userfaultfd(2) in the target, take
/// the fd, close it there, put everything back, detach.
fn inject(
    pid: i32,
    tid: i32,
    ppid: i32,
    gadget: u64,
    pidfd: BorrowedFd<'_>,
) -> Result<OwnedFd, TrackError> {
    let parent = ppid == std::process::id() as i32;
    let mut t = Tracee::seize(pid, tid, parent)?;
    if !super::pidfd_alive(pidfd) {
        // The pid was reused between pidfd_open and the seize: not our process.
        return Err(TrackError::Exited { pid });
    }
    t.stop()?;

    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK | sys::UFFD_USER_MODE_ONLY;
    let fd = t.syscall(gadget, libc::SYS_userfaultfd, &[flags as u64])?;
    if fd < 0 {
        let errno = -fd as i32;
        t.finish()?;
        return Err(TrackError::Injected {
            pid,
            call: "userfaultfd",
            source: std::io::Error::from_raw_os_error(errno),
        });
    }
    let taken = sys::pidfd_getfd(pidfd, fd as i32);
    let closed = t.syscall(gadget, libc::SYS_close, &[fd as u64])?;
    t.finish()?;
    let uffd = taken.map_err(|source| TrackError::GetFd {
        pid,
        fd: fd as i32,
        source,
    })?;
    if closed < 0 {
        return Err(TrackError::Injected {
            pid,
            call: "close",
            source: std::io::Error::from_raw_os_error(-closed as i32),
        });
    }
    Ok(uffd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groved_own_vdso_has_a_syscall_instruction() {
        let off = vdso_gadget_offset().expect("a syscall instruction in the vDSO");
        let base = sys::own_vdso_base();
        let insn = read_mem(std::process::id() as i32, base + off, 2).unwrap();
        assert_eq!(insn, SYSCALL_INSN);
    }
}
