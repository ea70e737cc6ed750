//! Incremental images made whole after the snapshot call returns (`tracking::make_whole`: the
//! base's pages copied in, ≈ 150 ms for a 256 MiB heap here), while the sandbox runs. Forks and
//! the import into the store wait for it at a gate per snapshot; nothing else reads the images.
//! A crash part-way leaves the nested parent in the images: the next start finishes the job
//! before it imports them (`durable.rs`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::tracking;

/// How long a fork or an import waits for images to be made whole.
const WAIT: Duration = Duration::from_secs(120);

#[derive(Default)]
pub(crate) struct Wholes {
    /// Snapshots whose images are being made whole, with the outcome once known.
    pending: Mutex<HashMap<String, Option<Result<(), String>>>>,
    ended: Condvar,
}

impl Wholes {
    /// Images of `id` are about to be made whole: waiters wait from now on.
    pub(crate) fn begin(&self, id: &str) {
        self.pending.lock().insert(id.to_string(), None);
    }

    /// The outcome for `id`; wakes its waiters. A failure stays for them to report (until the
    /// snapshot is deleted, [`Wholes::forget`]).
    pub(crate) fn end(&self, id: &str, outcome: Result<(), String>) {
        let mut p = self.pending.lock();
        match outcome {
            Ok(()) => {
                p.remove(id);
            }
            Err(e) => {
                if let Some(slot) = p.get_mut(id) {
                    *slot = Some(Err(e));
                }
            }
        }
        self.ended.notify_all();
    }

    /// Returns once the images of `id` are whole (at once for any other snapshot), or why they
    /// are not.
    pub(crate) fn wait(&self, id: &str) -> Result<(), String> {
        let deadline = Instant::now() + WAIT;
        let mut p = self.pending.lock();
        loop {
            match p.get(id) {
                None => return Ok(()),
                Some(Some(Err(e))) => return Err(e.clone()),
                Some(_) => {
                    if self.ended.wait_until(&mut p, deadline).timed_out() {
                        return Err(format!("not whole after {} s", WAIT.as_secs()));
                    }
                }
            }
        }
    }

    /// The snapshot is gone: nothing is kept for it.
    pub(crate) fn forget(&self, id: &str) {
        self.pending.lock().remove(id);
        self.ended.notify_all();
    }

    /// Makes the images of `id` whole on a thread of their own; `then` runs once they are,
    /// before any waiter is woken.
    pub(crate) fn start(
        self: &Arc<Self>,
        id: &str,
        images: PathBuf,
        then: impl FnOnce() + Send + 'static,
    ) {
        let (me, for_thread) = (self.clone(), id.to_string());
        let run = move || {
            let id = for_thread;
            let _ = grove_sys::sched::into_background();
            let t0 = Instant::now();
            let outcome = tracking::make_whole(&images).map_err(|e| e.to_string());
            match &outcome {
                Ok(pages) => tracing::debug!(
                    snapshot = %id, base_pages = pages,
                    ms = t0.elapsed().as_millis() as u64, "incremental images made whole"
                ),
                Err(e) => {
                    tracing::error!(snapshot = %id, error = %e, "incremental images not made whole")
                }
            }
            if outcome.is_ok() {
                then();
            }
            me.end(&id, outcome.map(|_| ()));
        };
        if let Err(e) = std::thread::Builder::new()
            .name("grove-snap-whole".into())
            .spawn(run)
        {
            self.end(id, Err(format!("no thread to make the images whole: {e}")));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiters_wait_for_the_outcome_and_others_do_not() {
        let w = Arc::new(Wholes::default());
        assert_eq!(w.wait("other"), Ok(()));
        w.begin("a");
        let w2 = w.clone();
        let t = std::thread::spawn(move || w2.wait("a"));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished(), "waits while pending");
        w.end("a", Ok(()));
        assert_eq!(t.join().unwrap(), Ok(()));
        w.begin("b");
        w.end("b", Err("disk full".into()));
        assert_eq!(w.wait("b"), Err("disk full".into()));
        w.forget("b");
        assert_eq!(w.wait("b"), Ok(()));
    }
}
