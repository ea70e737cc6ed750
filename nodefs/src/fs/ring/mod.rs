//! FUSE over io_uring (kernel 6.14+): the transport a mount uses where the kernel offers it.
//!
//! After INIT (over `/dev/fuse`, answered with `FUSE_OVER_IO_URING`), one queue per possible
//! CPU registers [`queue::DEPTH`] entries, each a header block and a payload buffer of the
//! connection's largest request. The kernel routes a request to the queue of the CPU that
//! issued it, copies it into an available entry and completes that entry's command; the queue
//! thread runs it through the same `Filesystem` as the `/dev/fuse` threads (fuser's
//! `Dispatcher`, see `vendor/fuser/README.md`), writes the reply into the entry and commits it
//! with the command that fetches the entry's next request: one submission per request, no
//! read or write on `/dev/fuse`. FORGET and INTERRUPT still arrive on `/dev/fuse`.
//!
//! A queue that cannot register makes the kernel drop the ring for that connection (requests
//! go to `/dev/fuse` readers): the mount falls back. A queue that fails later, while the
//! connection lives, would leave its CPU's requests waiting forever, so the connection is
//! aborted instead: its requests fail, the sandbox using it sees errors, and the server and its
//! other mounts go on. Design notes: docs/nodefs-format.md, "FUSE transports".

mod abi;
mod entry;
mod queue;

use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;
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

/// What the queues of one ring share with the mount.
pub(super) struct RingShared {
    /// Requests served over the ring.
    requests: AtomicU64,
    /// The first failure, once a queue failed.
    error: Mutex<Option<String>>,
    /// Test knob: the next commit names a queue the kernel lacks.
    break_next_commit: AtomicBool,
    /// Called once, on the first failure: aborts the connection.
    on_failure: Box<dyn Fn() + Send + Sync>,
}

impl RingShared {
    fn fail(&self, e: RingError) {
        tracing::error!(error = %e, "FUSE ring failed: aborting the mount's connection");
        let first = {
            let mut err = self.error.lock();
            let first = err.is_none();
            err.get_or_insert_with(|| e.to_string());
            first
        };
        if first {
            (self.on_failure)();
        }
    }
}

/// A mount's running ring: its queue threads.
pub(super) struct Ring {
    shared: Arc<RingShared>,
    threads: Vec<JoinHandle<()>>,
}

impl Ring {
    /// Register one queue per possible CPU on `session`'s connection, each serving requests
    /// through a `Fs` from `fs`. All queues registered, or none serve (`Err`; the kernel then
    /// sends requests to `/dev/fuse`). `on_failure` runs if a queue fails later.
    pub(super) fn start(
        session: &fuser::Session<Fs>,
        fs: impl Fn() -> Fs,
        payload_size: usize,
        on_failure: Box<dyn Fn() + Send + Sync>,
    ) -> Result<Ring, RingError> {
        let queues = possible_cpus().map_err(RingError::Cpus)?;
        let shared = Arc::new(RingShared {
            requests: AtomicU64::new(0),
            error: Mutex::new(None),
            break_next_commit: AtomicBool::new(false),
            on_failure,
        });
        let mut pending = Vec::with_capacity(queues);
        for qid in 0..queues as u16 {
            let setup = |source| RingError::Setup { qid, source };
            let fuse_fd = session.as_fd().try_clone_to_owned().map_err(setup)?;
            let (ready_tx, ready) = sync_channel(1);
            let (go, go_rx) = sync_channel(1);
            let spec = queue::QueueSpec {
                qid,
                payload_size,
                fuse_fd,
                dispatcher: session.dispatcher(fs(), format!("uring-{qid}")),
                shared: shared.clone(),
                ready: ready_tx,
                go: go_rx,
            };
            // Dropping `pending` on an early return closes every `go`: those threads stop.
            let thread = std::thread::Builder::new()
                .name(format!("nodefs-uring{qid}"))
                .spawn(move || queue::run(spec))
                .map_err(setup)?;
            pending.push((thread, ready, go));
        }
        let mut refused = None;
        for (_, ready, _) in &pending {
            let r = ready.recv().unwrap_or_else(|_| {
                Err(RingError::Setup {
                    qid: 0,
                    source: io::Error::other("queue thread ended"),
                })
            });
            if let Err(e) = r {
                refused.get_or_insert(e);
            }
        }
        let serve = refused.is_none();
        let threads = pending
            .into_iter()
            .map(|(thread, _, go)| {
                let _ = go.send(serve);
                thread
            })
            .collect::<Vec<_>>();
        match refused {
            None => Ok(Ring { shared, threads }),
            Some(e) => {
                for t in threads {
                    let _ = t.join();
                }
                Err(e)
            }
        }
    }

    /// Requests the ring has served.
    pub(super) fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::Relaxed)
    }

    /// Why the ring stopped serving, if it failed.
    pub(super) fn error(&self) -> Option<String> {
        self.shared.error.lock().clone()
    }

    /// Test knob: make the kernel refuse the next commit, as a broken queue would.
    #[cfg(feature = "test-knobs")]
    pub(super) fn break_next_commit(&self) {
        self.shared.break_next_commit.store(true, Ordering::Relaxed);
    }

    /// Wait for the queue threads (they end when the connection goes away).
    pub(super) fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
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
