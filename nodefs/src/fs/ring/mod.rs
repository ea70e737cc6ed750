//! FUSE over io_uring (kernel 6.14+): the transport a mount uses where the kernel offers it.
//!
//! A server has one queue per possible CPU (`RingPool`), started by its first ring mount and
//! shared by all of them: a thread with its own io_uring. After a mount's INIT (over
//! `/dev/fuse`, answered with `FUSE_OVER_IO_URING`), every queue maps [`queue::DEPTH`] entries
//! for the mount (a header block and a payload buffer of the connection's largest request) and
//! REGISTERs them on the mount's `/dev/fuse` fd; a command's `user_data` is the entry's slot in
//! the queue's slab, which names the mount. The kernel routes a request to the queue of the CPU
//! that issued it, copies it into an available entry of that connection and completes the
//! entry's command; the queue thread runs it through the mount's `Filesystem` (fuser's
//! `Dispatcher`, see `vendor/fuser/README.md`), writes the reply into the entry and commits it
//! with the command that fetches the entry's next request: one submission per request, no read
//! or write on `/dev/fuse`. FORGET and INTERRUPT still arrive on `/dev/fuse`.
//!
//! A REGISTER the kernel refuses makes it drop the ring for that connection (requests go to
//! `/dev/fuse` readers): the mount falls back. A command of a mount that fails later, while its
//! connection lives, would leave a request waiting forever, so that connection is aborted: its
//! requests fail, the sandbox using it sees errors, and the queues go on serving every other
//! mount. A mount's entries are unmapped when the kernel completes them as its connection goes
//! away. Design notes: docs/nodefs-format.md, "FUSE transports".

mod abi;
mod entry;
mod queue;

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::time::Duration;

use fuser::Dispatcher;
use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use super::fuse::Fs;

/// How a mount's FUSE requests reach the server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Transport {
    /// Each request read from and answered by a write to `/dev/fuse`.
    #[default]
    DevFuse,
    /// FUSE over io_uring: per-CPU queues of registered buffers.
    IoUring,
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Transport::DevFuse => "/dev/fuse",
            Transport::IoUring => "io_uring",
        })
    }
}

/// Why a ring could not start, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("FUSE ring queue {qid}: setting up: {source}")]
    Setup {
        qid: u16,
        #[source]
        source: io::Error,
    },
    #[error("FUSE ring queue {qid}: the kernel refused the registration: {source}")]
    Register {
        qid: u16,
        #[source]
        source: io::Error,
    },
    #[error("FUSE ring queue {qid}: waiting for completions: {source}")]
    Wait {
        qid: u16,
        #[source]
        source: io::Error,
    },
    #[error("FUSE ring queue {qid}: the kernel failed a command: {source}")]
    Kernel {
        qid: u16,
        #[source]
        source: io::Error,
    },
    #[error("cannot tell how many CPUs the kernel has queues for: {0}")]
    Cpus(#[source] io::Error),
}

/// One mount's connection as the shared queues see it: where its commands go, the filesystem
/// that serves its requests, and how many of its entries the queues hold.
pub(super) struct RingConn {
    /// A duplicate of the session's `/dev/fuse` fd: the mount's commands are issued on it.
    fuse_fd: OwnedFd,
    /// The mount's filesystem behind fuser's dispatch, shared by every queue.
    dispatcher: Dispatcher<Fs>,
    /// Requests served over the ring.
    requests: AtomicU64,
    /// The first failure, once a command of this connection failed.
    error: Mutex<Option<String>>,
    /// Test knob: the next commit names a queue the kernel lacks.
    break_next_commit: AtomicBool,
    /// Called once, on the first failure: aborts the connection.
    on_failure: Box<dyn Fn() + Send + Sync>,
    /// Cleared once the connection is gone (unmounted, or gone from the kernel): a late
    /// failure must not abort whatever connection has its device minor by then.
    armed: AtomicBool,
    /// Entries the queues hold for this connection (registered or being registered).
    entries: Mutex<usize>,
    released: Condvar,
}

impl RingConn {
    fn fail(&self, e: RingError) {
        tracing::error!(error = %e, "FUSE ring failed: aborting the mount's connection");
        let first = {
            let mut err = self.error.lock();
            let first = err.is_none();
            err.get_or_insert_with(|| e.to_string());
            first
        };
        if first && self.armed.load(Ordering::Acquire) {
            (self.on_failure)();
        }
    }

    fn entry_added(&self) {
        *self.entries.lock() += 1;
    }

    fn entry_released(&self) {
        let mut n = self.entries.lock();
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.released.notify_all();
        }
    }
}

/// What a server's queues hold, for tests and diagnostics.
#[derive(Debug, Default)]
pub(super) struct PoolStats {
    /// Entry mappings alive (registered, being registered or served).
    entries: AtomicUsize,
    /// Queue threads running.
    threads: AtomicUsize,
}

/// A server's FUSE-over-io_uring queues: one thread with its own io_uring per possible CPU,
/// shared by every ring mount of the server. A mount's set-up is a message to each queue
/// (map the mount's entries, submit their REGISTER); its requests are served by the queue of
/// the CPU they were made on.
pub(super) struct RingPool {
    queues: Vec<queue::QueueHandle>,
    stats: Arc<PoolStats>,
    /// A queue thread ended on a failure of its own io_uring: new mounts do not ask for the
    /// ring.
    broken: Arc<AtomicBool>,
    /// Test knob: the next attach registers on the last queue under a queue id the kernel
    /// lacks, so the kernel refuses it and drops the ring for that connection.
    refuse_next: AtomicBool,
}

impl std::fmt::Debug for RingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingPool")
            .field("queues", &self.queues.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl RingPool {
    /// Start one queue per possible CPU. All started, or none (`Err`).
    pub(super) fn start() -> Result<RingPool, RingError> {
        let n = possible_cpus().map_err(RingError::Cpus)?;
        let stats = Arc::new(PoolStats::default());
        let broken = Arc::new(AtomicBool::new(false));
        let mut queues = Vec::with_capacity(n);
        for qid in 0..n as u16 {
            // Dropping `queues` on an early return stops the queues started so far.
            queues.push(queue::QueueHandle::start(
                qid,
                stats.clone(),
                broken.clone(),
            )?);
        }
        Ok(RingPool {
            queues,
            stats,
            broken,
            refuse_next: AtomicBool::new(false),
        })
    }

    /// Whether new mounts may ask the kernel for the ring (every queue is serving).
    pub(super) fn healthy(&self) -> bool {
        !self.broken.load(Ordering::Relaxed)
    }

    /// Register `session`'s connection with every queue, its requests served through `fs`.
    /// All queues registered, or none serve (`Err`; the kernel then sends the connection's
    /// requests to `/dev/fuse`, and the entries some queues did register stay until the
    /// connection ends: the `MountRing` that comes with the error waits for them). `on_failure`
    /// runs if a command of the connection fails later.
    pub(super) fn attach(
        &self,
        session: &fuser::Session<Fs>,
        fs: Fs,
        payload_size: usize,
        on_failure: Box<dyn Fn() + Send + Sync>,
    ) -> Result<MountRing, (RingError, Option<MountRing>)> {
        let setup = |source| (RingError::Setup { qid: 0, source }, None);
        let conn = Arc::new(RingConn {
            fuse_fd: session.as_fd().try_clone_to_owned().map_err(setup)?,
            dispatcher: session.dispatcher(fs, "uring".into()),
            requests: AtomicU64::new(0),
            error: Mutex::new(None),
            break_next_commit: AtomicBool::new(false),
            on_failure,
            armed: AtomicBool::new(true),
            entries: Mutex::new(0),
            released: Condvar::new(),
        });
        let (tx, rx) = sync_channel(self.queues.len());
        let mut asked = 0;
        let mut refused = None;
        let refuse_last = self.refuse_next.swap(false, Ordering::Relaxed);
        for (qid, q) in self.queues.iter().enumerate() {
            let qid = if refuse_last && qid + 1 == self.queues.len() {
                u16::MAX
            } else {
                qid as u16
            };
            match q.attach(conn.clone(), qid, payload_size, tx.clone()) {
                Ok(()) => asked += 1,
                Err(e) => {
                    refused.get_or_insert(e);
                }
            }
        }
        drop(tx);
        for _ in 0..asked {
            match rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    refused.get_or_insert(e);
                }
                Err(_) => {
                    refused.get_or_insert(RingError::Setup {
                        qid: 0,
                        source: io::Error::other("queue thread ended"),
                    });
                }
            }
        }
        let Some(e) = refused else {
            return Ok(MountRing { conn });
        };
        // The kernel drops the ring for the connection only when a REGISTER is refused: if
        // none was (a queue could not even try), make one that must be, or requests would wait
        // for a ring that never becomes ready.
        if !matches!(e, RingError::Register { .. })
            && !self
                .queues
                .iter()
                .any(|q| q.refuse(conn.clone(), payload_size).is_ok())
        {
            conn.fail(RingError::Setup {
                qid: 0,
                source: io::Error::other("no queue could register or refuse the connection"),
            });
        }
        Err((e, Some(MountRing { conn })))
    }

    /// Test knob: the kernel refuses the next mount's REGISTER on one queue (see
    /// `refuse_next`).
    #[cfg(feature = "test-knobs")]
    pub(super) fn refuse_next_register(&self) {
        self.refuse_next.store(true, Ordering::Relaxed);
    }

    /// Entry mappings the queues hold now, over every mount.
    pub(super) fn entries(&self) -> usize {
        self.stats.entries.load(Ordering::Relaxed)
    }

    /// Queue threads running.
    pub(super) fn threads(&self) -> usize {
        self.stats.threads.load(Ordering::Relaxed)
    }
}

impl Drop for RingPool {
    fn drop(&mut self) {
        for q in &self.queues {
            q.stop();
        }
        for q in &mut self.queues {
            q.join();
        }
    }
}

/// A mount's part of the shared queues.
pub(super) struct MountRing {
    conn: Arc<RingConn>,
}

impl MountRing {
    /// Requests the ring has served for the mount.
    pub(super) fn requests(&self) -> u64 {
        self.conn.requests.load(Ordering::Relaxed)
    }

    /// Why the mount's ring stopped serving, if it failed.
    pub(super) fn error(&self) -> Option<String> {
        self.conn.error.lock().clone()
    }

    /// Test knob: make the kernel refuse the mount's next commit, as a broken queue would.
    #[cfg(feature = "test-knobs")]
    pub(super) fn break_next_commit(&self) {
        self.conn.break_next_commit.store(true, Ordering::Relaxed);
    }

    /// The mount's connection is gone: a failure from now on aborts nothing.
    pub(super) fn disarm(&self) {
        self.conn.armed.store(false, Ordering::Release);
    }

    /// Wait until the queues released every entry of the mount (the kernel completes them
    /// when the connection goes away), at most `timeout`. Whether they did.
    pub(super) fn wait_released(&self, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut n = self.conn.entries.lock();
        while *n > 0 {
            if self.conn.released.wait_until(&mut n, deadline).timed_out() {
                return *n == 0;
            }
        }
        true
    }
}

/// How many CPUs the kernel may run (`num_possible_cpus()`): the ring has a queue for each and
/// serves only once every one has an entry.
fn possible_cpus() -> io::Result<usize> {
    let s = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    parse_cpu_list(s.trim()).ok_or_else(|| io::Error::other(format!("unparsable CPU list {s:?}")))
}

/// The number of CPUs in a kernel CPU list ("0-3,6").
fn parse_cpu_list(s: &str) -> Option<usize> {
    s.split(',')
        .map(|r| match r.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?);
                b.checked_sub(a).map(|d| d + 1)
            }
            None => r.parse::<usize>().ok().map(|_| 1),
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_count_their_cpus() {
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("0-1"), Some(2));
        assert_eq!(parse_cpu_list("0-3,6,8-9"), Some(7));
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn transports_serialize_by_name() {
        assert_eq!(
            serde_json::to_string(&Transport::IoUring).unwrap(),
            "\"io_uring\""
        );
        assert_eq!(
            serde_json::from_str::<Transport>("\"dev_fuse\"").unwrap(),
            Transport::DevFuse
        );
    }
}
