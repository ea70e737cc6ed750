//! One queue of a server's ring: a thread with its own io_uring serving one CPU's requests for
//! every ring mount of the server. Each mount has [`DEPTH`] entries here, slots of a slab whose
//! index is the commands' `user_data`; a request is served through its mount's `Dispatcher`
//! and answered in the same submission that fetches the entry's next request.
//!
//! Mounts attach by message (an eventfd the ring polls wakes the thread): the thread maps the
//! mount's entries and submits their REGISTER, so only this thread ever submits to its ring.
//! An entry ends with the completion that says its connection is gone (unmount, abort): its
//! mapping is freed then, never while the kernel may still write it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use fuser::ReplyTarget;
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use parking_lot::Mutex;

use super::abi::{CmdReq, CMD_COMMIT_AND_FETCH, CMD_REGISTER, OUT_HEADER_LEN};
use super::entry::{EntryBuf, ReplyRegion};
use super::{PoolStats, RingConn, RingError};

/// Entries per mount and queue. The queue's one thread serves requests one at a time, so a
/// second entry would only hold a second buffer: while the entry is being served the kernel
/// queues the CPU's next request and hands it over in the commit that answers this one.
pub(super) const DEPTH: usize = 1;

/// Submission queue size: the commits of one batch of completions, REGISTERs of an attach.
const SQ_ENTRIES: u32 = 64;
/// Completion queue size: every entry of every mount may complete at once (an unmount of
/// many); beyond it the kernel keeps overflowing completions itself.
const CQ_ENTRIES: u32 = 1024;

/// `user_data` of the wake-up poll on the queue's eventfd; entries use their slab index.
const WAKE: u64 = u64::MAX;

/// A payload buffer that carried more than this is given back to the kernel (MADV_DONTNEED)
/// once the queue has been idle for [`TRIM_AFTER`]: an idle sandbox's mount should not keep
/// the last large read or write resident on every CPU's queue.
const TRIM_OVER: usize = 64 << 10;
const TRIM_AFTER: Duration = Duration::from_secs(1);

/// What a queue is asked to do.
enum Msg {
    /// Map a mount's entries and REGISTER them under `qid` (the queue's own, or one the
    /// kernel must refuse); the outcome goes to `reply`.
    Attach {
        conn: Arc<RingConn>,
        qid: u16,
        payload_size: usize,
        reply: SyncSender<Result<(), RingError>>,
    },
    Stop,
}

/// The queue's mailbox.
struct Inbox {
    msgs: Mutex<(Vec<Msg>, bool)>,
    /// Written to wake the thread; its ring polls it.
    wake: OwnedFd,
}

impl Inbox {
    fn post(&self, m: Msg) -> Result<(), Msg> {
        {
            let mut g = self.msgs.lock();
            if g.1 {
                return Err(m);
            }
            g.0.push(m);
        }
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte write to the eventfd this inbox owns.
        let _ = unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        Ok(())
    }

    /// Reset the eventfd and take the messages.
    fn take(&self) -> Vec<Msg> {
        let mut b = [0u8; 8];
        // SAFETY: an 8-byte read from the (non-blocking) eventfd into a local buffer.
        let _ = unsafe { libc::read(self.wake.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
        std::mem::take(&mut self.msgs.lock().0)
    }

    /// No more messages: the thread is ending. Those not taken are dropped (their reply
    /// channels close).
    fn close(&self) {
        let left = {
            let mut g = self.msgs.lock();
            g.1 = true;
            std::mem::take(&mut g.0)
        };
        drop(left);
    }
}

/// The server's handle on one queue thread.
pub(super) struct QueueHandle {
    qid: u16,
    inbox: Arc<Inbox>,
    thread: Option<JoinHandle<()>>,
}

impl QueueHandle {
    /// Start the queue thread for CPU `qid`; returns once its ring is up.
    pub(super) fn start(
        qid: u16,
        stats: Arc<PoolStats>,
        broken: Arc<AtomicBool>,
    ) -> Result<QueueHandle, RingError> {
        let setup = |source| RingError::Setup { qid, source };
        // SAFETY: plain syscall; the fd is checked and owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(setup(io::Error::last_os_error()));
        }
        // SAFETY: a fresh fd nothing else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(fd) };
        let inbox = Arc::new(Inbox {
            msgs: Mutex::new((Vec::new(), false)),
            wake,
        });
        let (ready_tx, ready) = sync_channel(1);
        let thread_inbox = inbox.clone();
        let thread = std::thread::Builder::new()
            .name(format!("nodefs-uring{qid}"))
            .spawn(move || run(qid, thread_inbox, stats, broken, ready_tx))
            .map_err(setup)?;
        let mut h = QueueHandle {
            qid,
            inbox,
            thread: Some(thread),
        };
        match ready.recv() {
            Ok(Ok(())) => Ok(h),
            Ok(Err(e)) => {
                h.join();
                Err(setup(e))
            }
            Err(_) => {
                h.join();
                Err(setup(io::Error::other("queue thread ended")))
            }
        }
    }

    /// Ask the queue to map and register `conn`'s entries under `qid`; the outcome comes on
    /// `reply`.
    pub(super) fn attach(
        &self,
        conn: Arc<RingConn>,
        qid: u16,
        payload_size: usize,
        reply: SyncSender<Result<(), RingError>>,
    ) -> Result<(), RingError> {
        self.inbox
            .post(Msg::Attach {
                conn,
                qid,
                payload_size,
                reply,
            })
            .map_err(|_| RingError::Setup {
                qid: self.qid,
                source: io::Error::other("queue thread ended"),
            })
    }

    /// Make the kernel drop the ring for `conn`: a REGISTER naming a queue it does not have.
    /// Ok once it refused.
    pub(super) fn refuse(&self, conn: Arc<RingConn>, payload_size: usize) -> Result<(), ()> {
        let (tx, rx) = sync_channel(1);
        self.attach(conn, u16::MAX, payload_size, tx)
            .map_err(|_| ())?;
        match rx.recv() {
            Ok(Err(RingError::Register { .. })) => Ok(()),
            _ => Err(()),
        }
    }

    pub(super) fn stop(&self) {
        let _ = self.inbox.post(Msg::Stop);
    }

    pub(super) fn join(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A queue dropped without `RingPool`'s orderly stop (a pool whose start failed half-way)
/// still ends its thread: the thread holds the inbox, so nothing else would.
impl Drop for QueueHandle {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop();
            self.join();
        }
    }
}

/// One mount's entry on this queue.
struct Slot {
    conn: Arc<RingConn>,
    buf: EntryBuf,
    /// REGISTER submitted, outcome not yet reported to the mount.
    registering: bool,
    /// The largest payload (request or reply) since the buffer was last trimmed.
    used: usize,
}

type Ring = IoUring<squeue::Entry128, cqueue::Entry>;

struct Queue {
    qid: u16,
    inbox: Arc<Inbox>,
    stats: Arc<PoolStats>,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    /// Completions of the current batch (kept to reuse its allocation).
    done: Vec<(u64, i32)>,
    /// The wake-up poll completed: messages to take.
    woken: bool,
    /// A REGISTER of the attach in progress was refused (its errno).
    refused: Option<i32>,
    /// Slots whose payload buffer carried more than `TRIM_OVER` since their last trim.
    to_trim: Vec<usize>,
}

/// The queue thread: serve until told to stop. A failure of the queue's own ring (waiting on
/// it fails) cannot be told apart per mount: every mount with an entry here is aborted (no
/// request may wait on a queue nobody serves) and the server asks new mounts not to use the
/// ring.
fn run(
    qid: u16,
    inbox: Arc<Inbox>,
    stats: Arc<PoolStats>,
    broken: Arc<AtomicBool>,
    ready: SyncSender<io::Result<()>>,
) {
    pin_to_cpu(qid);
    let mut ring = match new_ring() {
        Ok(r) => r,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut q = Queue {
        qid,
        inbox,
        stats,
        slots: Vec::new(),
        free: Vec::new(),
        done: Vec::new(),
        woken: false,
        refused: None,
        to_trim: Vec::new(),
    };
    if let Err(e) = q.arm_wake(&mut ring) {
        let _ = ready.send(Err(io::Error::other(e.to_string())));
        return;
    }
    q.stats.threads.fetch_add(1, Ordering::Relaxed);
    let _ = ready.send(Ok(()));
    let failure = match q.serve(&mut ring) {
        Ok(()) => None,
        Err(e) => {
            broken.store(true, Ordering::Relaxed);
            tracing::error!(error = %e, "FUSE ring queue failed: aborting its mounts' connections");
            Some(e.to_string())
        }
    };
    // Once the ring is gone nobody serves this CPU's requests of the connections still
    // registered here (a mount detached lazily and still in use, when the server stops): they
    // are aborted, or their requests would wait forever.
    for s in q.slots.iter().flatten() {
        let why = failure
            .clone()
            .unwrap_or_else(|| "the server stopped its queues".into());
        s.conn.fail(RingError::Wait {
            qid,
            source: io::Error::other(why),
        });
    }
    q.inbox.close();
    drop(ring);
    // Entries still registered (a mount detached lazily and still in use, or aborted on
    // failure) may be written by the kernel until their commands are cancelled, which the
    // ring's closing does asynchronously: their memory is left mapped, not reused.
    let left = q.slots.iter().flatten().count();
    if left > 0 {
        tracing::warn!(
            qid,
            entries = left,
            "FUSE ring queue stopped with entries registered"
        );
    }
    for s in q.slots.drain(..).flatten() {
        std::mem::forget(s.buf);
        s.conn.entry_released();
        q.stats.entries.fetch_sub(1, Ordering::Relaxed);
    }
    q.stats.threads.fetch_sub(1, Ordering::Relaxed);
}

/// Runs the queue thread on the CPU whose requests it serves: a request then wakes its server
/// on the CPU the requester sleeps on, a switch on one core instead of a wake-up of another
/// (which in a VM means an idle vCPU's exit and an IPI each way, tens of µs per round trip).
/// A CPU the thread may not use (a cpuset) leaves it unpinned.
fn pin_to_cpu(qid: u16) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(qid as usize).is_ok() {
        if let Err(e) = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set) {
            tracing::debug!(qid, error = %e, "FUSE ring queue thread left unpinned");
        }
    }
}

fn new_ring() -> io::Result<Ring> {
    // One thread submits and reaps: the kernel runs completions' task work (copying a request
    // into an entry) only when it waits, in this thread. Older kernels lack the flags: a plain
    // ring then.
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_cqsize(CQ_ENTRIES)
        .build(SQ_ENTRIES)
        .or_else(|_| {
            IoUring::builder()
                .setup_cqsize(CQ_ENTRIES)
                .build(SQ_ENTRIES)
        })
}

/// `sqe` with its `len` field set (the io-uring crate's URING_CMD builder has no setter; the
/// kernel reads REGISTER's iovec count there).
fn with_len(sqe: squeue::Entry128, len: u32) -> squeue::Entry128 {
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: Entry128 is repr(C): the kernel's 64-byte io_uring_sqe, then 64 bytes of command,
    // all plain integers, so any bytes are a valid value; `len` is the u32 at offset 24 of
    // io_uring_sqe.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(sqe) };
    raw[24..28].copy_from_slice(&len.to_ne_bytes());
    // SAFETY: as above.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

/// Completions that mean the connection is going away (unmount, abort) or the ring's commands
/// were cancelled: the entry is done, not failed.
fn is_teardown(errno: i32) -> bool {
    matches!(
        errno,
        libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED | libc::ENODEV
    )
}

fn is_retry(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
    )
}

impl Queue {
    fn wait_err(&self, source: io::Error) -> RingError {
        RingError::Wait {
            qid: self.qid,
            source,
        }
    }

    fn serve(&mut self, ring: &mut Ring) -> Result<(), RingError> {
        loop {
            let r = if self.to_trim.is_empty() {
                ring.submit_and_wait(1)
            } else {
                // Submit first: a call that submits reports the count, not the timeout.
                match ring.submit() {
                    Ok(_) => {
                        let ts = types::Timespec::from(TRIM_AFTER);
                        let args = types::SubmitArgs::new().timespec(&ts);
                        ring.submitter().submit_with_args(1, &args)
                    }
                    Err(e) => Err(e),
                }
            };
            match r {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ETIME) => self.trim(),
                Err(e) if is_retry(&e) => {}
                Err(e) => return Err(self.wait_err(e)),
            }
            self.reap(ring)?;
            while std::mem::take(&mut self.woken) {
                self.arm_wake(ring)?;
                for m in self.inbox.take() {
                    match m {
                        Msg::Attach {
                            conn,
                            qid,
                            payload_size,
                            reply,
                        } => {
                            let r = self.attach(ring, conn, qid, payload_size)?;
                            let _ = reply.send(r);
                        }
                        Msg::Stop => return Ok(()),
                    }
                }
            }
        }
    }

    /// Give idle entries' large payload pages back (see `TRIM_OVER`). The kernel writes an
    /// entry only in this thread's own calls into it (task work runs when it waits), so none
    /// is being written now.
    fn trim(&mut self) {
        for i in self.to_trim.drain(..) {
            if let Some(s) = self.slots.get_mut(i).and_then(Option::as_mut) {
                s.buf.trim();
                s.used = 0;
            }
        }
    }

    fn push(&self, ring: &mut Ring, sqe: &squeue::Entry128) -> Result<(), RingError> {
        loop {
            // SAFETY: every command names an entry whose buffers stay mapped until the
            // command's final completion (see `release`).
            if unsafe { ring.submission().push(sqe) }.is_ok() {
                return Ok(());
            }
            match ring.submit() {
                Ok(_) => {}
                Err(e) if is_retry(&e) => {}
                Err(e) => return Err(self.wait_err(e)),
            }
        }
    }

    fn arm_wake(&self, ring: &mut Ring) -> Result<(), RingError> {
        let sqe = opcode::PollAdd::new(types::Fd(self.inbox.wake.as_raw_fd()), libc::POLLIN as u32)
            .build()
            .user_data(WAKE);
        self.push(ring, &sqe.into())
    }

    /// Handle every completion there is.
    fn reap(&mut self, ring: &mut Ring) -> Result<(), RingError> {
        loop {
            let mut done = std::mem::take(&mut self.done);
            done.clear();
            done.extend(ring.completion().map(|c| (c.user_data(), c.result())));
            if done.is_empty() {
                self.done = done;
                return Ok(());
            }
            for &(ud, res) in &done {
                if ud == WAKE {
                    self.woken = true;
                } else {
                    self.complete(ring, ud as usize, res)?;
                }
            }
            self.done = done;
        }
    }

    fn insert(&mut self, slot: Slot) -> usize {
        slot.conn.entry_added();
        self.stats.entries.fetch_add(1, Ordering::Relaxed);
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(slot);
                i
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        }
    }

    /// Free slot `i`: its command has completed for good (no kernel reference to its buffers).
    fn release(&mut self, i: usize) -> Option<Slot> {
        let s = self.slots.get_mut(i)?.take()?;
        self.free.push(i);
        self.stats.entries.fetch_sub(1, Ordering::Relaxed);
        s.conn.entry_released();
        Some(s)
    }

    /// Map `DEPTH` entries for `conn` and REGISTER them under `qid`. A refusal completes at
    /// once (no ring support, a queue id the kernel lacks, the switch turned off); an accepted
    /// REGISTER completes only with a request.
    fn attach(
        &mut self,
        ring: &mut Ring,
        conn: Arc<RingConn>,
        qid: u16,
        payload_size: usize,
    ) -> Result<Result<(), RingError>, RingError> {
        let mut ids = Vec::with_capacity(DEPTH);
        for _ in 0..DEPTH {
            match EntryBuf::new(payload_size) {
                Ok(buf) => ids.push(self.insert(Slot {
                    conn: conn.clone(),
                    buf,
                    registering: true,
                    used: 0,
                })),
                Err(source) => {
                    for i in ids {
                        self.release(i);
                    }
                    return Ok(Err(RingError::Setup {
                        qid: self.qid,
                        source,
                    }));
                }
            }
        }
        let fd = types::Fd(conn.fuse_fd.as_raw_fd());
        for &i in &ids {
            let addr = self.slots[i].as_ref().map_or(0, |s| s.buf.iovecs_addr());
            let sqe = with_len(
                opcode::UringCmd80::new(fd, CMD_REGISTER)
                    .cmd(
                        CmdReq {
                            qid,
                            ..Default::default()
                        }
                        .to_cmd_area(),
                    )
                    .addr(Some(addr))
                    .build(),
                2,
            )
            .user_data(i as u64);
            self.push(ring, &sqe)?;
        }
        loop {
            match ring.submit() {
                Ok(_) => break,
                Err(e) if is_retry(&e) => self.reap(ring)?,
                Err(e) => return Err(self.wait_err(e)),
            }
        }
        self.refused = None;
        // Refusals are posted by the submission itself.
        self.reap(ring)?;
        for &i in &ids {
            if let Some(s) = self.slots.get_mut(i).and_then(Option::as_mut) {
                s.registering = false;
            }
        }
        Ok(match self.refused.take() {
            None => Ok(()),
            Some(errno) => Err(RingError::Register {
                qid,
                source: io::Error::from_raw_os_error(errno),
            }),
        })
    }

    fn complete(&mut self, ring: &mut Ring, i: usize, res: i32) -> Result<(), RingError> {
        if res < 0 {
            let Some(s) = self.release(i) else {
                tracing::error!(
                    qid = self.qid,
                    entry = i,
                    "completion for no FUSE ring entry"
                );
                return Ok(());
            };
            if s.registering {
                self.refused.get_or_insert(-res);
            } else if !is_teardown(-res) {
                // This connection's command failed: its request would wait forever. Abort
                // that connection; every other mount's entries go on.
                s.conn.fail(RingError::Kernel {
                    qid: self.qid,
                    source: io::Error::from_raw_os_error(-res),
                });
            }
            return Ok(());
        }
        let Some(s) = self.slots.get_mut(i).and_then(Option::as_mut) else {
            tracing::error!(
                qid = self.qid,
                entry = i,
                "completion for no FUSE ring entry"
            );
            return Ok(());
        };
        s.registering = false;
        let (commit_id, used) = answer(self.qid, &s.conn, &s.buf);
        if used > TRIM_OVER && s.used <= TRIM_OVER {
            self.to_trim.push(i);
        }
        s.used = s.used.max(used);
        // The test knob names a queue the kernel does not have: it refuses the commit, and the
        // request it carried would wait forever if the failure were not handled.
        let qid = if s.conn.break_next_commit.swap(false, Ordering::Relaxed) {
            u16::MAX
        } else {
            self.qid
        };
        let sqe =
            opcode::UringCmd80::new(types::Fd(s.conn.fuse_fd.as_raw_fd()), CMD_COMMIT_AND_FETCH)
                .cmd(
                    CmdReq {
                        commit_id,
                        qid,
                        ..Default::default()
                    }
                    .to_cmd_area(),
                )
                .build()
                .user_data(i as u64);
        self.push(ring, &sqe)
    }
}

/// Serve the entry's request through its mount's filesystem; the reply (EIO when there is
/// none, the request is malformed or the handler panicked) is left in the entry. Returns the
/// id to commit it under and the payload bytes the request and reply used.
fn answer(qid: u16, conn: &RingConn, entry: &EntryBuf) -> (u64, usize) {
    conn.requests.fetch_add(1, Ordering::Relaxed);
    let (bytes, commit_id) = match entry.request() {
        Ok(r) => r,
        Err(m) => {
            tracing::warn!(qid, "malformed FUSE request on the ring: EIO");
            entry.reply_region().write_error(m.commit_id, libc::EIO);
            return (m.commit_id, 0);
        }
    };
    let request_len = bytes.len();
    // A request with a payload (a name, write data) lies where the reply's payload goes, and
    // the handler may still be reading it while it replies: such a reply waits in memory of
    // its own until dispatch has returned. The rest (READ above all) is written in place.
    let stage = entry.reply_len() > 0;
    let reply = Arc::new(EntryReply {
        state: Mutex::new(ReplyState::Open(entry.reply_region())),
        stage,
    });
    let target: Arc<dyn ReplyTarget> = reply.clone();
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| conn.dispatcher.dispatch(bytes, target)));
    match r {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(qid, error = %e, "FUSE request on the ring"),
        Err(_) => tracing::error!(qid, "FUSE handler panicked: EIO"),
    }
    // Take the region back: a reply arriving later is refused, not written into an entry
    // the kernel owns again.
    match std::mem::replace(&mut *reply.state.lock(), ReplyState::Closed) {
        ReplyState::Open(region) => region.write_error(commit_id, libc::EIO),
        ReplyState::Staged(region, bytes) => {
            let (head, data) = bytes.split_at(OUT_HEADER_LEN.min(bytes.len()));
            region.write(&[io::IoSlice::new(head), io::IoSlice::new(data)]);
        }
        ReplyState::Closed => {}
    }
    (commit_id, request_len.max(entry.reply_len()))
}

/// Where one request's reply goes: its entry, until the queue thread takes it back.
#[derive(Debug)]
struct EntryReply {
    state: Mutex<ReplyState>,
    /// Keep the reply in memory of its own until dispatch returns (see `answer`).
    stage: bool,
}

#[derive(Debug)]
enum ReplyState {
    /// No reply yet.
    Open(ReplyRegion),
    /// A reply (out header and payload, contiguous) to write once dispatch has returned.
    Staged(ReplyRegion, Vec<u8>),
    /// Replied in place, or taken back by the queue thread.
    Closed,
}

impl ReplyTarget for EntryReply {
    fn send(&self, reply: &[io::IoSlice<'_>]) -> io::Result<()> {
        let mut state = self.state.lock();
        match std::mem::replace(&mut *state, ReplyState::Closed) {
            ReplyState::Open(region) if self.stage => {
                let mut bytes = Vec::with_capacity(reply.iter().map(|s| s.len()).sum());
                for s in reply {
                    bytes.extend_from_slice(s);
                }
                *state = ReplyState::Staged(region, bytes);
                Ok(())
            }
            ReplyState::Open(region) => {
                region.write(reply);
                Ok(())
            }
            staged @ ReplyState::Staged(..) => {
                *state = staged;
                Err(io::Error::other("a second reply to one FUSE request"))
            }
            ReplyState::Closed => Err(io::Error::other("reply after its ring entry was committed")),
        }
    }
}
