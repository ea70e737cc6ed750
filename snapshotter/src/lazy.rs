//! Branches whose memory a `criu lazy-pages` daemon is still copying in.
//!
//! A lazy restore lets a branch run before its memory is all there: pages it touches are served
//! on demand, the rest are copied in the background. Until that copy ends the branch's address
//! space has holes that only the daemon can fill, so a dump then would record them as absent
//! (a wrong snapshot, silently). `LazyCopies` tracks each branch's daemon so that a snapshot or
//! pause of the branch first waits for it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use grove_runtime::SandboxId;
use parking_lot::{Condvar, Mutex};

use crate::error::Error;

/// Niceness of the daemons' background copy, set once their restore is done (start-up and the
/// restore's own exchanges with the daemon run at normal priority, so a loaded machine cannot
/// starve a restore): eight branches restoring at once finish sooner when the daemons yield the
/// CPU to the restores (8 × 256 MiB forks: 642 ms at nice 0, 547 ms at nice 19 on 2 vCPUs).
/// A snapshot that waits on a daemon raises it back to 0.
pub const DAEMON_NICE: i32 = 19;

/// How a daemon ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Copying,
    Done,
    Failed,
}

#[derive(Debug)]
struct Copy {
    pid: u32,
    outcome: Mutex<Outcome>,
    ended: Condvar,
}

#[derive(Debug, Default)]
pub struct LazyCopies {
    live: Mutex<HashMap<SandboxId, Arc<Copy>>>,
}

impl LazyCopies {
    /// Registers the daemon (pid `pid`) that is filling `sandbox`'s memory; the returned
    /// closure is to be called once with whether it exited successfully.
    pub fn start(self: &Arc<Self>, sandbox: &SandboxId, pid: u32) -> impl FnOnce(bool) + Send {
        let copy = Arc::new(Copy {
            pid,
            outcome: Mutex::new(Outcome::Copying),
            ended: Condvar::new(),
        });
        self.live.lock().insert(sandbox.clone(), copy.clone());
        let (me, id) = (self.clone(), sandbox.clone());
        move |ok| {
            // Unlisted before the waiters wake: once `wait` returns, the copy is gone.
            {
                let mut live = me.live.lock();
                if live.get(&id).is_some_and(|c| Arc::ptr_eq(c, &copy)) {
                    live.remove(&id);
                }
            }
            *copy.outcome.lock() = if ok { Outcome::Done } else { Outcome::Failed };
            copy.ended.notify_all();
        }
    }

    /// Whether a daemon is still copying into `sandbox`.
    #[cfg(test)]
    pub fn copying(&self, sandbox: &SandboxId) -> bool {
        self.live.lock().contains_key(sandbox)
    }

    /// Waits (up to `limit`) until no daemon is copying into `sandbox`, raising the daemon's
    /// priority meanwhile. Err if it failed (the branch's memory is incomplete) or is still at it.
    pub fn wait(&self, sandbox: &SandboxId, limit: Duration) -> Result<(), Error> {
        let Some(copy) = self.live.lock().get(sandbox).cloned() else {
            return Ok(());
        };
        // SAFETY: setpriority on a pid is a plain syscall; at worst the pid is gone (ESRCH).
        unsafe { libc::setpriority(libc::PRIO_PROCESS, copy.pid, 0) };
        let deadline = Instant::now() + limit;
        let mut outcome = copy.outcome.lock();
        while *outcome == Outcome::Copying {
            if copy.ended.wait_until(&mut outcome, deadline).timed_out() {
                break;
            }
        }
        match *outcome {
            Outcome::Done => Ok(()),
            Outcome::Copying => Err(Error::Conflict {
                sandbox: sandbox.to_string(),
                reason: format!(
                    "its memory is still being restored after {} s; retry later",
                    limit.as_secs()
                ),
            }),
            Outcome::Failed => Err(Error::Conflict {
                sandbox: sandbox.to_string(),
                reason: "the lazy restore of its memory failed; it cannot be checkpointed".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> SandboxId {
        s.parse().unwrap()
    }

    #[test]
    fn wait_returns_once_the_copy_ends() {
        let lc = Arc::new(LazyCopies::default());
        let sb = id("sb-00000000001a");
        // A pid that is surely not ours to renice: setpriority just fails.
        let end = lc.start(&sb, u32::MAX >> 1);
        assert!(lc.copying(&sb));
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            end(true);
        });
        let t0 = Instant::now();
        lc.wait(&sb, Duration::from_secs(5)).unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(40));
        assert!(!lc.copying(&sb));
        t.join().unwrap();
        lc.wait(&sb, Duration::from_millis(1)).unwrap();
    }

    #[test]
    fn a_failed_or_slow_copy_is_a_conflict() {
        let lc = Arc::new(LazyCopies::default());
        let (a, b) = (id("sb-00000000002a"), id("sb-00000000003a"));
        let end_a = lc.start(&a, u32::MAX >> 1);
        let _end_b = lc.start(&b, u32::MAX >> 1);
        let err = lc.wait(&b, Duration::from_millis(20)).unwrap_err();
        assert!(err.to_string().contains("still being restored"), "{err}");
        let waiter = {
            let lc = lc.clone();
            std::thread::spawn(move || lc.wait(&a, Duration::from_secs(5)))
        };
        std::thread::sleep(Duration::from_millis(20));
        end_a(false);
        let err = waiter.join().unwrap().unwrap_err();
        assert!(err.to_string().contains("failed"), "{err}");
    }
}
