//! Fork branches share their clean pages through kernel samepage merging (KSM).
//!
//! N branches restored from one snapshot start with N private copies of every page, identical
//! until a branch writes one. CRIU restores a branch with `PR_SET_MEMORY_MERGE` set on itself
//! (see `criu::RestoreOptions::merge_pages`): the flag passes to every task CRIU forks, so each
//! VMA of the restored tree is mergeable from birth, and ksmd folds identical pages into one
//! copy-on-write page. A write to a merged page gives the writer a private copy again, so a
//! branch never sees another's writes: merging changes where pages live, not what they hold.
//!
//! ksmd scans 100 pages per 20 ms by default (≈ 20 MB/s), far too slow for 8 × 256 MiB, and
//! its knobs are host-wide. While branches settle a [`Boost`] raises its rate; the last boost
//! on the host to end puts back what the first one found (two groveds on one host, or a crashed
//! one, coordinate through lock files in [`KSM_DIR`]). Once settled, ksmd is back at its old
//! rate (off, by default): merged pages stay merged, and nothing scans between forks.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};

/// ksmd's knobs and counters.
const SYSFS: &str = "/sys/kernel/mm/ksm";

/// Host-wide (as ksmd is): `state.lock` serialises boosts starting and ending, `users.lock` is
/// held shared by every boost alive, `saved` keeps the knobs as the first boost found them.
pub const KSM_DIR: &str = "/run/grove-ksm";

/// ksmd's rate while boosted: pages per batch, and the pause between batches. Measured here: one
/// core merges ≈ 80k pages/s, so ksmd is CPU-bound at this rate, not sleeping.
const BOOST_PAGES: u64 = 4000;
const BOOST_SLEEP_MS: u64 = 1;

/// Merging needs two passes over a page (the first finds its twin in the unstable tree, the
/// second settles it in the stable one), and the scan under way when the last fork was made (or
/// the last lazily restored page arrived) may have passed that page's address already, so it
/// counts for nothing: a boost lasts at least this many full scans after that, and then until a
/// full scan finds the memory settled (see [`Tally::settled_since`]).
const SETTLE_SCANS: u64 = 3;

/// A boost never lasts longer than this after the last fork, whatever ksmd does.
const MAX_BOOST: Duration = Duration::from_secs(120);

/// Ticks without a page scanned (ksmd boosted, not paused, no pages arriving) after which a
/// boost ends: ksmd scans nothing once no mergeable memory is left (every branch destroyed
/// before it settled), so no full scan completes and nothing would ever say it settled.
const IDLE_TICKS: u32 = 10;

/// The knobs a boost changes, as text read from and written back to sysfs.
const KNOBS: [&str; 3] = ["run", "pages_to_scan", "sleep_millisecs"];

/// Whether this kernel can merge a restored tree: ksmd exists and `PR_SET_MEMORY_MERGE` (6.4+)
/// is known (`PR_GET_MEMORY_MERGE` answers instead of failing with EINVAL).
pub fn available() -> bool {
    if !Path::new(SYSFS).join("run").exists() {
        return false;
    }
    crate::sys::memory_merge().is_ok()
}

fn knob(name: &str) -> io::Result<String> {
    Ok(std::fs::read_to_string(Path::new(SYSFS).join(name))?
        .trim()
        .to_string())
}

fn set_knob(name: &str, value: &str) -> io::Result<()> {
    std::fs::write(Path::new(SYSFS).join(name), value)
}

fn counter(name: &str) -> u64 {
    knob(name).ok().and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// ksmd's count of completed passes over all mergeable memory.
fn full_scans() -> u64 {
    counter("full_scans")
}

/// What ksmd holds at the end of a full scan.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Tally {
    /// Pages that are one shared page with others (`pages_sharing`).
    sharing: u64,
    /// Pages it knows: shared, sharing, and unique ones it keeps checking.
    known: u64,
}

impl Tally {
    fn now() -> Tally {
        let sharing = counter("pages_sharing");
        Tally {
            sharing,
            known: sharing + counter("pages_shared") + counter("pages_unshared"),
        }
    }

    /// Neither count grew by more than 1 % over a full scan since `prev`. A lazily restored
    /// branch's memory arrives while ksmd scans (its pages count once present), so a scan that
    /// merely completed says nothing; one that found no more memory and merged no more does.
    fn settled_since(&self, prev: &Tally) -> bool {
        let grew = |now: u64, then: u64| now.saturating_sub(then) * 100 > then.max(1);
        !grew(self.sharing, prev.sharing) && !grew(self.known, prev.known)
    }
}

fn lock_file(dir: &Path, name: &str) -> io::Result<File> {
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .mode(0o600)
        .open(dir.join(name))
}

fn flock(file: File, arg: FlockArg) -> io::Result<Flock<File>> {
    Flock::lock(file, arg).map_err(|(_, e)| io::Error::from(e))
}

/// ksmd at its boosted rate for as long as this lives (see the module doc).
pub struct Boost {
    dir: PathBuf,
    /// Shared lock on `users.lock`: this boost is alive.
    user: Option<Flock<File>>,
}

impl Boost {
    pub fn start() -> io::Result<Boost> {
        Self::start_in(Path::new(KSM_DIR))
    }

    fn start_in(dir: &Path) -> io::Result<Boost> {
        std::fs::create_dir_all(dir)?;
        let state = flock(lock_file(dir, "state.lock")?, FlockArg::LockExclusive)?;
        let saved = dir.join("saved");
        if !saved.exists() {
            let now = KNOBS.map(|k| knob(k).unwrap_or_default()).join(" ");
            let tmp = dir.join("saved.tmp");
            std::fs::write(&tmp, now)?;
            std::fs::rename(&tmp, &saved)?;
        }
        boosted()?;
        let user = flock(lock_file(dir, "users.lock")?, FlockArg::LockShared)?;
        drop(state);
        Ok(Boost {
            dir: dir.to_path_buf(),
            user: Some(user),
        })
    }

    /// Stops ksmd (`run` 0: what it merged stays merged) while `paused`, else boosts it again.
    /// Host-wide, like the boost: a pause is short (a fork's restores, see [`Hold`]).
    fn pause(&self, paused: bool) -> io::Result<()> {
        let _state = flock(lock_file(&self.dir, "state.lock")?, FlockArg::LockExclusive)?;
        if paused {
            return set_knob("run", "0");
        }
        boosted()
    }
}

/// ksmd at the boosted rate, running.
fn boosted() -> io::Result<()> {
    set_knob("pages_to_scan", &BOOST_PAGES.to_string())?;
    set_knob("sleep_millisecs", &BOOST_SLEEP_MS.to_string())?;
    set_knob("run", "1")
}

impl Drop for Boost {
    fn drop(&mut self) {
        if let Err(e) = end(&self.dir, self.user.take()) {
            tracing::warn!("ending a ksmd boost: {e}");
        }
    }
}

/// Puts ksmd's knobs back as `saved` has them when no boost is alive any more; `mine` is the
/// caller's own shared lock, if it holds one. Also what a start-up runs, for a crashed boost.
fn end(dir: &Path, mine: Option<Flock<File>>) -> io::Result<()> {
    let saved = dir.join("saved");
    if !saved.exists() && mine.is_none() {
        return Ok(());
    }
    let _state = flock(lock_file(dir, "state.lock")?, FlockArg::LockExclusive)?;
    drop(mine);
    let users = lock_file(dir, "users.lock")?;
    if Flock::lock(users, FlockArg::LockExclusiveNonblock).is_err() {
        return Ok(()); // another boost is alive: the last one restores
    }
    let Ok(text) = std::fs::read_to_string(&saved) else {
        return Ok(());
    };
    let values: Vec<&str> = text.split_whitespace().collect();
    if values.len() == KNOBS.len() {
        // The rate first, then `run`: a run of 0 stops ksmd and keeps what it merged.
        for i in [1, 2, 0] {
            set_knob(KNOBS[i], values[i])?;
        }
    }
    std::fs::remove_file(&saved)
}

/// Whether a boost is alive on this host (its saved knobs are on disk until the last one ends):
/// until then ksmd may still be merging, whatever the memory did in the last seconds.
pub fn boosting() -> bool {
    Path::new(KSM_DIR).join("saved").exists()
}

/// After a crash: a boost that died with its daemon leaves ksmd fast; put it back.
pub fn recover() {
    if let Err(e) = end(Path::new(KSM_DIR), None) {
        tracing::warn!("restoring ksmd's knobs after a crashed boost: {e}");
    }
}

/// Keeps ksmd boosted while forks' branches settle: one thread per snapshotter, alive from the
/// first fork until [`SETTLE_SCANS`] full scans after the last one.
#[derive(Default)]
pub struct Merger {
    state: Arc<Mutex<MergerState>>,
}

/// Whether pages are still on their way into branches (lazy restores copying): their memory
/// cannot have settled yet, whatever a scan found.
pub type Arriving = Arc<dyn Fn() -> bool + Send + Sync>;

#[derive(Default)]
struct MergerState {
    /// A boost thread is running.
    active: bool,
    /// ksmd's full scans when the last fork was noted.
    scans_at_last_fork: u64,
    /// The last fork's.
    arriving: Option<Arriving>,
    /// Forks restoring branches now ([`Merger::hold`]).
    forking: u32,
    /// After the last of them, ksmd stays at its own rate until then.
    held_until: Option<Instant>,
    /// When the last fork was noted ([`MAX_BOOST`] counts from it).
    last_fork: Option<Instant>,
    /// The snapshotter is closing: a running boost ends now.
    stopping: bool,
    /// Boost threads that have not yet put ksmd's knobs back (one, or two while one ends).
    threads: u32,
}

impl MergerState {
    fn held(&self) -> bool {
        self.forking > 0 || self.held_until.is_some_and(|t| Instant::now() < t)
    }
}

/// While this lives, and for its `after` once dropped, no boost runs: ksmd, CPU-bound when
/// boosted, leaves the cores to a fork's restores and to its branches' first answers. It has
/// little to merge by then: lazily restored pages arrive after their tree's quiet wait
/// (`criu::lazy_quiet`), and a boost from an earlier fork picks up where it was.
pub struct Hold {
    state: Arc<Mutex<MergerState>>,
    after: Duration,
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.forking = st.forking.saturating_sub(1);
        let until = Instant::now() + self.after;
        st.held_until = Some(st.held_until.map_or(until, |t| t.max(until)));
    }
}

impl Merger {
    /// A fork is starting: see [`Hold`].
    pub fn hold(&self, after: Duration) -> Hold {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).forking += 1;
        Hold {
            state: self.state.clone(),
            after,
        }
    }

    /// Ends a running boost and waits (briefly) until ksmd's knobs are back: a process that
    /// exits with a boost alive leaves them boosted until the next boost on the host.
    pub fn stop(&self) {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stopping = true;
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.state.lock().unwrap_or_else(|p| p.into_inner()).threads > 0
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(HOLD_TICK_MS / 5));
        }
    }

    /// A fork's branches were restored mergeable: boost ksmd until they settle, which they do
    /// not while `arriving` says so.
    pub fn after_fork(&self, arriving: Arriving) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.scans_at_last_fork = full_scans();
        st.arriving = Some(arriving);
        st.last_fork = Some(Instant::now());
        if st.active {
            return;
        }
        st.active = true;
        st.threads += 1;
        let state = self.state.clone();
        let spawned = std::thread::Builder::new()
            .name("ksm-boost".into())
            .spawn(move || {
                boost_until_settled(&state);
                state.lock().unwrap_or_else(|p| p.into_inner()).threads -= 1;
            });
        if let Err(e) = spawned {
            tracing::warn!("starting the ksmd boost thread: {e}");
            st.active = false;
            st.threads -= 1;
        }
    }
}

fn boost_until_settled(state: &Mutex<MergerState>) {
    let boost = Boost::start();
    if let Err(e) = &boost {
        tracing::warn!("boosting ksmd for a fork's branches: {e}");
    }
    let (mut scans, mut tally) = (full_scans(), Tally::now());
    let mut paused = false;
    let mut idle = Idle::default();
    loop {
        let held = state.lock().unwrap_or_else(|p| p.into_inner()).held();
        if let (Ok(b), true) = (&boost, held != paused) {
            if let Err(e) = b.pause(held) {
                tracing::warn!("pausing or resuming a ksmd boost: {e}");
            }
            paused = held;
        }
        std::thread::sleep(Duration::from_millis(HOLD_TICK_MS));
        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
        let mut settled = false;
        let now_scans = full_scans();
        // Pages still arriving, or a hold: as if the fork were now (a scan that ended before
        // they came says nothing of them).
        let arriving = st.arriving.as_ref().is_some_and(|a| a());
        if paused || arriving {
            st.scans_at_last_fork = now_scans;
        }
        let nothing_to_scan = idle.saw(scan_progress(), !paused && !arriving);
        if now_scans != scans {
            let now = Tally::now();
            settled = !paused
                && now_scans >= st.scans_at_last_fork + SETTLE_SCANS
                && now.settled_since(&tally);
            (scans, tally) = (now_scans, now);
        }
        let too_long = st.last_fork.is_none_or(|t| t.elapsed() > MAX_BOOST);
        if boost.is_err() || settled || nothing_to_scan || too_long || st.stopping {
            st.active = false;
            break;
        }
    }
    drop(boost);
}

/// How often the boost thread looks at the scans and at a [`Hold`].
const HOLD_TICK_MS: u64 = 50;

/// Pages ksmd has looked at so far, scanned or skipped (`smart_scan`).
fn scan_progress() -> u64 {
    counter("pages_scanned") + counter("pages_skipped")
}

/// Counts ticks in a row in which ksmd scanned nothing (see [`IDLE_TICKS`]).
#[derive(Default)]
struct Idle {
    last: Option<u64>,
    ticks: u32,
}

impl Idle {
    /// One tick's progress; `counting` is false while ksmd is paused or pages are arriving.
    /// True once ksmd has been idle for [`IDLE_TICKS`] counted ticks in a row.
    fn saw(&mut self, progress: u64, counting: bool) -> bool {
        let still = self.last == Some(progress);
        self.last = Some(progress);
        self.ticks = if still && counting { self.ticks + 1 } else { 0 };
        self.ticks >= IDLE_TICKS
    }
}

/// Whether process `pid` has every VMA mergeable (`PR_SET_MEMORY_MERGE`), as its
/// `/proc/<pid>/ksm_stat` says.
pub fn merges_any(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/ksm_stat"))
        .map(|s| s.lines().any(|l| l.trim() == "ksm_merge_any: yes"))
        .unwrap_or(false)
}

/// Sets `PR_SET_MEMORY_MERGE` on the calling process: for CRIU's restore, between fork and exec.
pub fn merge_this_process() -> io::Result<()> {
    crate::sys::set_memory_merge()
}

#[cfg(test)]
mod tests {
    use super::{Idle, Merger, Tally, IDLE_TICKS};
    use std::time::Duration;

    #[test]
    fn a_hold_lasts_while_forks_restore_and_its_after_once_the_last_ends() {
        let m = Merger::default();
        let held = || m.state.lock().unwrap().held();
        assert!(!held());
        let (a, b) = (
            m.hold(Duration::from_millis(200)),
            m.hold(Duration::from_millis(0)),
        );
        assert!(held());
        drop(a);
        assert!(held(), "b still restoring");
        drop(b);
        assert!(held(), "a's 200 ms after: the longer one counts");
        std::thread::sleep(Duration::from_millis(250));
        assert!(!held());
    }

    #[test]
    fn a_boost_ends_once_ksmd_has_had_nothing_to_scan_for_a_while() {
        let mut idle = Idle::default();
        assert!(
            !idle.saw(100, true),
            "the first tick has nothing to compare"
        );
        for _ in 1..IDLE_TICKS {
            assert!(!idle.saw(100, true));
        }
        assert!(
            idle.saw(100, true),
            "{IDLE_TICKS} ticks without a page scanned"
        );
        let mut idle = Idle::default();
        for i in 0..3 * IDLE_TICKS {
            assert!(!idle.saw(100 + u64::from(i), true), "scanning");
        }
        for _ in 0..IDLE_TICKS - 1 {
            assert!(!idle.saw(500, true));
        }
        assert!(!idle.saw(500, false), "paused, or pages arriving: not idle");
        for _ in 0..IDLE_TICKS - 1 {
            assert!(!idle.saw(500, true), "counting starts over");
        }
        assert!(idle.saw(500, true));
    }

    #[test]
    fn a_scan_that_found_more_memory_or_merged_more_is_not_settled() {
        let t = |sharing, known| Tally { sharing, known };
        assert!(t(1000, 5000).settled_since(&t(1000, 5000)));
        assert!(t(1005, 5040).settled_since(&t(1000, 5000)), "under 1 %");
        assert!(
            !t(1100, 5000).settled_since(&t(1000, 5000)),
            "merged 10 % more"
        );
        assert!(
            !t(1000, 9000).settled_since(&t(1000, 5000)),
            "lazy pages arrived"
        );
        assert!(!t(500, 500).settled_since(&t(0, 0)), "nothing known before");
        assert!(t(0, 0).settled_since(&t(0, 0)));
        assert!(
            t(10, 100).settled_since(&t(900, 9000)),
            "branches went away"
        );
    }
}
