//! The I/O mode of each inode's open files, kept consistent with the kernel's rules
//! (fs/fuse/iomode.c, 6.9+): an inode is either in cached mode (reads served by this
//! server) or in passthrough mode (reads go straight to one backing file). The kernel fails
//! an open with EIO when its reply breaks the mode in force: a cached open of an inode with
//! a backing file, a passthrough open while cached opens exist, or a passthrough open naming
//! a different backing file.
//!
//! Every open decides and replies under one lock per inode, and counts itself before the
//! reply leaves; a release uncounts itself when RELEASE arrives. The kernel counts an open
//! only after our reply and drops it before sending RELEASE, so what the kernel holds is
//! always a subset of what is counted here, and a decision that agrees with the counts
//! agrees with the kernel whatever order the openers wake up in.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

/// What an open gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Served by the server through the kernel's page cache of this mount.
    Cached,
    /// Reads go to the inode's backing file (an existing one, or a new one if none).
    Passthrough,
    /// A write open while passthrough readers exist: the kernel cannot mix the two.
    Busy,
}

/// Open files of one inode by mode, and the backing file its passthrough opens share.
#[derive(Debug)]
pub struct Mode<B> {
    pub cached: u32,
    pub passthrough: u32,
    /// Present exactly while `passthrough > 0`.
    pub backing: Option<B>,
}

impl<B> Default for Mode<B> {
    fn default() -> Self {
        Mode {
            cached: 0,
            passthrough: 0,
            backing: None,
        }
    }
}

impl<B> Mode<B> {
    /// The mode for a new open. `eligible`: the file may be passed through (read-only open
    /// of pristine base content that the policy wants passed through).
    pub fn decide(&self, write: bool, eligible: bool) -> Decision {
        if self.passthrough > 0 {
            // Every later open must pass through, and to the same (read-only) backing file.
            if write {
                Decision::Busy
            } else {
                Decision::Passthrough
            }
        } else if eligible && !write && self.cached == 0 {
            Decision::Passthrough
        } else {
            Decision::Cached
        }
    }

    fn idle(&self) -> bool {
        self.cached == 0 && self.passthrough == 0 && self.backing.is_none()
    }
}

struct Slot<B> {
    mode: Mutex<Mode<B>>,
    released: Condvar,
}

/// The per-inode modes of one mount; only inodes with open files have an entry.
pub struct OpenModes<B> {
    slots: Mutex<HashMap<u64, Arc<Slot<B>>>>,
}

impl<B> Default for OpenModes<B> {
    fn default() -> Self {
        OpenModes {
            slots: Mutex::new(HashMap::new()),
        }
    }
}

/// An inode's mode, locked.
pub struct Guard<'a, B> {
    mode: MutexGuard<'a, Mode<B>>,
    released: &'a Condvar,
}

impl<B> std::ops::Deref for Guard<'_, B> {
    type Target = Mode<B>;
    fn deref(&self) -> &Mode<B> {
        &self.mode
    }
}

impl<B> std::ops::DerefMut for Guard<'_, B> {
    fn deref_mut(&mut self) -> &mut Mode<B> {
        &mut self.mode
    }
}

impl<B> Guard<'_, B> {
    /// Wait (lock released meanwhile) up to `timeout` for passthrough opens to end: a
    /// RELEASE reaches the server only after the closing process's close() has returned.
    pub fn wait_passthrough_closed(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.mode.passthrough > 0 {
            if self
                .released
                .wait_until(&mut self.mode, deadline)
                .timed_out()
            {
                break;
            }
        }
    }

    /// Uncount one closed open; the backing file goes with the last passthrough one.
    pub fn release(&mut self, passthrough: bool) {
        if passthrough {
            self.mode.passthrough = self.mode.passthrough.saturating_sub(1);
            if self.mode.passthrough == 0 {
                self.mode.backing = None;
                self.released.notify_all();
            }
        } else {
            self.mode.cached = self.mode.cached.saturating_sub(1);
        }
    }
}

impl<B> OpenModes<B> {
    /// Run `f` with `ino`'s mode locked (decide, count and reply inside `f`).
    pub fn with<T>(&self, ino: u64, f: impl FnOnce(&mut Guard<'_, B>) -> T) -> T {
        let slot = self
            .slots
            .lock()
            .entry(ino)
            .or_insert_with(|| {
                Arc::new(Slot {
                    mode: Mutex::new(Mode::default()),
                    released: Condvar::new(),
                })
            })
            .clone();
        let (out, idle) = {
            let mut g = Guard {
                mode: slot.mode.lock(),
                released: &slot.released,
            };
            let out = f(&mut g);
            (out, g.idle())
        };
        if idle {
            let mut slots = self.slots.lock();
            // Nobody else holds the slot (new users clone it under this lock): drop it if
            // it is still idle.
            if Arc::strong_count(&slot) == 2 && slot.mode.lock().idle() {
                slots.remove(&ino);
            }
        }
        out
    }

    /// Inodes with open files (for tests and debugging).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(cached: u32, passthrough: u32) -> Mode<()> {
        Mode {
            cached,
            passthrough,
            backing: (passthrough > 0).then_some(()),
        }
    }

    #[test]
    fn decisions_follow_the_kernel_rules() {
        use Decision::*;
        // Fresh inode: eligible reads pass through, everything else is cached.
        assert_eq!(mode(0, 0).decide(false, true), Passthrough);
        assert_eq!(mode(0, 0).decide(false, false), Cached);
        assert_eq!(mode(0, 0).decide(true, true), Cached);
        // Cached opens exist: no passthrough (the kernel would say ETXTBSY).
        assert_eq!(mode(2, 0).decide(false, true), Cached);
        // Passthrough opens exist: every open must pass through (a cached one is EINVAL),
        // writers cannot.
        assert_eq!(mode(0, 1).decide(false, true), Passthrough);
        assert_eq!(mode(0, 1).decide(false, false), Passthrough);
        assert_eq!(mode(0, 1).decide(true, true), Busy);
    }

    #[test]
    fn slots_live_while_files_are_open() {
        let m: OpenModes<u32> = OpenModes::default();
        m.with(7, |g| {
            g.passthrough += 1;
            g.backing = Some(1);
        });
        m.with(7, |g| {
            g.passthrough += 1;
            assert_eq!(g.backing, Some(1));
        });
        m.with(8, |g| g.cached += 1);
        assert_eq!(m.len(), 2);
        m.with(7, |g| g.release(true));
        m.with(7, |g| assert_eq!(g.backing, Some(1)));
        m.with(7, |g| g.release(true));
        m.with(8, |g| g.release(false));
        assert_eq!(m.len(), 0);
        // An inode only asked about leaves nothing behind.
        m.with(9, |g| {
            assert_eq!(g.decide(false, true), Decision::Passthrough)
        });
        assert_eq!(m.len(), 0);
    }

    #[test]
    fn a_writer_waits_for_a_late_release() {
        let m: Arc<OpenModes<u32>> = Arc::new(OpenModes::default());
        m.with(1, |g| {
            g.passthrough = 1;
            g.backing = Some(3);
        });
        let m2 = m.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            m2.with(1, |g| g.release(true));
        });
        let d = m.with(1, |g| {
            g.wait_passthrough_closed(Duration::from_secs(5));
            g.decide(true, false)
        });
        t.join().unwrap();
        assert_eq!(d, Decision::Cached);
        // Without a release, the wait ends at the timeout and the writer is refused.
        m.with(1, |g| {
            g.passthrough = 1;
            g.backing = Some(3);
        });
        let t0 = Instant::now();
        let d = m.with(1, |g| {
            g.wait_passthrough_closed(Duration::from_millis(30));
            g.decide(true, false)
        });
        assert!(t0.elapsed() >= Duration::from_millis(30));
        assert_eq!(d, Decision::Busy);
    }
}
