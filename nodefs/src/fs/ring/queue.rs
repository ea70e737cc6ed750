//! One queue of the ring: a thread with its own io_uring, `DEPTH` entries registered with the
//! kernel for one CPU's requests, serving each through the mount's `Dispatcher` and answering
//! it in the same submission that fetches the entry's next request.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;

use fuser::{Dispatcher, ReplyTarget};
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use parking_lot::Mutex;

use super::abi::{CmdReq, CMD_COMMIT_AND_FETCH, CMD_REGISTER};
use super::entry::{EntryBuf, ReplyRegion};
use super::{RingError, RingShared};
use crate::fs::fuse::Fs;

/// Entries per queue: one being served while the kernel fills the other. The server answers
/// synchronously on the queue's one thread, so more would only hold more buffer memory.
pub(super) const DEPTH: usize = 2;

/// What a queue thread needs.
pub(super) struct QueueSpec {
    pub qid: u16,
    pub payload_size: usize,
    /// A duplicate of the session's `/dev/fuse` fd: the commands are issued on it.
    pub fuse_fd: OwnedFd,
    pub dispatcher: Dispatcher<Fs>,
    pub shared: Arc<RingShared>,
    /// Registration's outcome, to the mount.
    pub ready: SyncSender<Result<(), RingError>>,
    /// The mount's decision once every queue reported: serve (true) or stop.
    pub go: Receiver<bool>,
}

/// The queue thread: register, wait for the go, serve until the connection goes away. A ring
/// that fails while the connection lives is reported to `shared` (which aborts the connection,
/// so no request waits on a queue nobody serves).
pub(super) fn run(spec: QueueSpec) {
    let QueueSpec {
        qid,
        payload_size,
        fuse_fd,
        dispatcher,
        shared,
        ready,
        go,
    } = spec;
    // Declared before the ring, so dropped after it: the kernel may write an entry until the
    // ring's commands are cancelled.
    let entries = match (0..DEPTH)
        .map(|_| EntryBuf::new(payload_size))
        .collect::<io::Result<Vec<_>>>()
    {
        Ok(e) => e,
        Err(e) => {
            let _ = ready.send(Err(RingError::Setup { qid, source: e }));
            return;
        }
    };
    let mut ring = match new_ring() {
        Ok(r) => r,
        Err(e) => {
            let _ = ready.send(Err(RingError::Setup { qid, source: e }));
            return;
        }
    };
    let fd = types::Fd(fuse_fd.as_raw_fd());
    if let Err(e) = register(&mut ring, fd, qid, &entries) {
        let _ = ready.send(Err(e));
        return;
    }
    let _ = ready.send(Ok(()));
    if go.recv() != Ok(true) {
        return;
    }
    let q = Queue {
        qid,
        fd,
        entries: &entries,
        dispatcher: &dispatcher,
        shared: &shared,
    };
    match q.serve(&mut ring) {
        Ok(()) => tracing::debug!(qid, "FUSE ring queue ended with its connection"),
        Err(e) => shared.fail(e),
    }
    drop(ring);
    drop(entries);
}

fn new_ring() -> io::Result<IoUring<squeue::Entry128, cqueue::Entry>> {
    // One thread submits and reaps: the kernel may run completions' task work only when it
    // waits (fewer interruptions). Older kernels lack the flags: a plain ring then.
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(DEPTH as u32)
        .or_else(|_| IoUring::builder().build(DEPTH as u32))
}

/// REGISTER every entry. A refusal completes at once (unsupported, a queue id the kernel
/// does not have, the ring disabled); an accepted one completes only with a request.
fn register(
    ring: &mut IoUring<squeue::Entry128, cqueue::Entry>,
    fd: types::Fd,
    qid: u16,
    entries: &[EntryBuf],
) -> Result<(), RingError> {
    for (i, e) in entries.iter().enumerate() {
        let sqe = with_len(
            opcode::UringCmd80::new(fd, CMD_REGISTER)
                .cmd(
                    CmdReq {
                        qid,
                        ..Default::default()
                    }
                    .to_cmd_area(),
                )
                .addr(Some(e.iovecs_addr()))
                .build(),
            2,
        )
        .user_data(i as u64);
        // SAFETY: the iovecs and buffers the command names live in `entries`, which the queue
        // thread drops only after the ring (whose drop cancels the command).
        unsafe { ring.submission().push(&sqe) }.map_err(|_| RingError::Register {
            qid,
            source: io::Error::other("submission queue full"),
        })?;
    }
    ring.submit()
        .map_err(|source| RingError::Register { qid, source })?;
    if let Some(c) = ring.completion().find(|c| c.result() < 0) {
        return Err(RingError::Register {
            qid,
            source: io::Error::from_raw_os_error(-c.result()),
        });
    }
    Ok(())
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

struct Queue<'a> {
    qid: u16,
    fd: types::Fd,
    entries: &'a [EntryBuf],
    dispatcher: &'a Dispatcher<Fs>,
    shared: &'a RingShared,
}

/// Completions that mean the connection is going away (unmount, abort) or the ring's commands
/// were cancelled: the entry is done, not failed.
fn is_teardown(errno: i32) -> bool {
    matches!(
        errno,
        libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED | libc::ENODEV
    )
}

impl Queue<'_> {
    fn serve(&self, ring: &mut IoUring<squeue::Entry128, cqueue::Entry>) -> Result<(), RingError> {
        let mut live = self.entries.len();
        let mut done = Vec::with_capacity(self.entries.len());
        while live > 0 {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(source) => {
                    return Err(RingError::Wait {
                        qid: self.qid,
                        source,
                    })
                }
            }
            done.clear();
            done.extend(
                ring.completion()
                    .map(|c| (c.user_data() as usize, c.result())),
            );
            for &(i, res) in &done {
                if res < 0 {
                    if is_teardown(-res) {
                        live -= 1;
                        continue;
                    }
                    return Err(RingError::Kernel {
                        qid: self.qid,
                        source: io::Error::from_raw_os_error(-res),
                    });
                }
                let entry = self.entries.get(i).ok_or(RingError::Wait {
                    qid: self.qid,
                    source: io::Error::other(format!("completion for unknown entry {i}")),
                })?;
                let commit_id = self.answer(entry);
                self.commit(ring, i, commit_id)?;
            }
        }
        Ok(())
    }

    /// Serve the entry's request through the filesystem; the reply (EIO when there is none,
    /// the request is malformed or the handler panicked) is left in the entry. Returns the id
    /// to commit it under.
    fn answer(&self, entry: &EntryBuf) -> u64 {
        self.shared.requests.fetch_add(1, Ordering::Relaxed);
        let (bytes, commit_id) = match entry.request() {
            Ok(r) => r,
            Err(m) => {
                tracing::warn!(qid = self.qid, "malformed FUSE request on the ring: EIO");
                entry.reply_region().write_error(m.commit_id, libc::EIO);
                return m.commit_id;
            }
        };
        let reply = Arc::new(EntryReply {
            region: Mutex::new(Some(entry.reply_region())),
        });
        let target: Arc<dyn ReplyTarget> = reply.clone();
        let r =
            std::panic::catch_unwind(AssertUnwindSafe(|| self.dispatcher.dispatch(bytes, target)));
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(qid = self.qid, error = %e, "FUSE request on the ring"),
            Err(_) => tracing::error!(qid = self.qid, "FUSE handler panicked: EIO"),
        }
        // Take the region back: a reply arriving later is refused, not written into an entry
        // the kernel owns again.
        if let Some(region) = reply.region.lock().take() {
            region.write_error(commit_id, libc::EIO);
        }
        commit_id
    }

    fn commit(
        &self,
        ring: &mut IoUring<squeue::Entry128, cqueue::Entry>,
        i: usize,
        commit_id: u64,
    ) -> Result<(), RingError> {
        // The test knob names a queue the kernel does not have: it refuses the commit, and the
        // request it carried would wait forever if the failure were not handled.
        let qid = if self.shared.break_next_commit.swap(false, Ordering::Relaxed) {
            u16::MAX
        } else {
            self.qid
        };
        let sqe = opcode::UringCmd80::new(self.fd, CMD_COMMIT_AND_FETCH)
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
        // SAFETY: the entry's buffers outlive the ring (see `run`); each entry has at most one
        // command in flight and the queue has room for all of them.
        unsafe { ring.submission().push(&sqe) }.map_err(|_| RingError::Wait {
            qid: self.qid,
            source: io::Error::other("submission queue full"),
        })
    }
}

/// Where one request's reply goes: its entry, until the queue thread takes it back.
#[derive(Debug)]
struct EntryReply {
    region: Mutex<Option<ReplyRegion>>,
}

impl ReplyTarget for EntryReply {
    fn send(&self, reply: &[io::IoSlice<'_>]) -> io::Result<()> {
        match self.region.lock().take() {
            Some(r) => {
                r.write(reply);
                Ok(())
            }
            None => Err(io::Error::other("reply after its ring entry was committed")),
        }
    }
}
