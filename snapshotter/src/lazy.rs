//! Branches whose memory a `criu lazy-pages` daemon is still copying in.
//!
//! A lazy restore lets a branch run before its memory is all there: pages it touches are served
//! on demand, the rest are copied in the background. Until that copy ends the branch's address
//! space has holes that only the daemon can fill, so a dump then would record them as absent
//! (a wrong snapshot, silently). `LazyCopies` tracks each branch's daemon so that a snapshot or
//! pause of the branch first waits for it.
//!
//! A daemon outlives a crash of groved (see `Criu::lazy_pages`): its branch would read zeros
//! wherever pages were still missing had it died with groved. The next groved adopts each one
//! left in [`LAZY_DIR`] ([`LazyCopies::adopt`]): it lets it finish and tracks it like its own;
//! a branch whose daemon failed or was lost meanwhile is marked failed, never left running.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grove_runtime::{Runtime, SandboxId, SandboxState};
use parking_lot::{Condvar, Mutex};

use crate::criu;
use crate::error::Error;

/// Where lazy restores work, next to (not in) the scratch dir emptied at start: one dir per
/// branch, `<sandbox id>-<ms>`, holding the daemon's socket, log and exit status.
pub const LAZY_DIR: &str = "lazy-pages";

/// Niceness of the daemons' background copy, set once their restore is done (start-up and the
/// restore's own exchanges with the daemon run at normal priority, so a loaded machine cannot
/// starve a restore): eight branches restoring at once finish sooner when the daemons yield the
/// CPU to the restores (8 × 256 MiB forks: 642 ms at nice 0, 547 ms at nice 19 on 2 vCPUs).
/// A snapshot that waits on a daemon raises it back to 0.
pub const DAEMON_NICE: i32 = 19;

/// How often a waiting snapshot tells a daemon again not to wait for a quiet tree.
const HURRY_AGAIN: Duration = Duration::from_millis(100);

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

    /// Whether any daemon is still copying.
    pub fn any(&self) -> bool {
        !self.live.lock().is_empty()
    }

    /// Whether a daemon is still copying into `sandbox`.
    #[cfg(test)]
    pub fn copying(&self, sandbox: &SandboxId) -> bool {
        self.live.lock().contains_key(sandbox)
    }

    /// At an orderly stop: waits (up to `limit`) for the daemons of branches that are no longer
    /// running (destroyed: their daemons exit at once) to end, so their dirs are gone too.
    pub fn settle(&self, runtime: &Runtime, limit: Duration) {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let ending = self.live.lock().keys().any(|id| {
                !runtime
                    .get(id)
                    .is_ok_and(|i| i.state == SandboxState::Running)
            });
            if !ending {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits (up to `limit`) until no daemon is copying into `sandbox`, raising the daemon's
    /// priority meanwhile and telling it not to wait for a quiet tree. Err if it failed (the
    /// branch's memory is incomplete) or is still at it.
    pub fn wait(&self, sandbox: &SandboxId, limit: Duration) -> Result<(), Error> {
        let Some(copy) = self.live.lock().get(sandbox).cloned() else {
            return Ok(());
        };
        criu::set_group_nice(copy.pid, 0);
        let deadline = Instant::now() + limit;
        let mut outcome = copy.outcome.lock();
        while *outcome == Outcome::Copying && Instant::now() < deadline {
            // Again and again: a signal that came before the daemon's handler was set is lost.
            criu::hurry_group(copy.pid);
            let until = deadline.min(Instant::now() + HURRY_AGAIN);
            copy.ended.wait_until(&mut outcome, until);
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

impl LazyCopies {
    /// After a restart, before the API serves: the daemons a predecessor left under `root`. A
    /// daemon of a branch that runs is let finish and tracked (a snapshot of the branch waits
    /// for it); a branch whose daemon failed, or died with nothing recorded, has holes in its
    /// memory and is marked failed. Daemons of branches that are gone are stopped. Each dir
    /// goes once its daemon has ended.
    pub fn adopt(self: &Arc<Self>, root: &Path, runtime: &Arc<Runtime>) {
        let Ok(entries) = std::fs::read_dir(root) else {
            return;
        };
        let dirs: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        if dirs.is_empty() {
            return;
        }
        let procs = processes();
        for dir in dirs {
            let (shell, others) = helpers_in(&procs, &dir);
            let id = branch_of(&dir);
            let running = id.as_ref().is_some_and(|id| {
                runtime
                    .get(id)
                    .is_ok_and(|i| i.state == SandboxState::Running)
            });
            let (Some(id), true) = (id, running) else {
                // No branch to serve (its create never finished, or it was not adopted).
                stop(shell, &others);
                remove_work_dir(&dir);
                continue;
            };
            match (criu::lazy_status(&dir), shell) {
                (Some(true), _) => {
                    tracing::info!(sandbox = %id, "a predecessor's lazy restore completed");
                    remove_work_dir(&dir);
                }
                (Some(false), _) => {
                    fail_branch(
                        runtime,
                        &id,
                        "the lazy restore of its memory failed while groved was down",
                    );
                    remove_work_dir(&dir);
                }
                (None, Some(pid)) => {
                    tracing::warn!(sandbox = %id, pid, "adopting a predecessor's lazy-pages daemon");
                    let ended = self.start(&id, pid);
                    let runtime = runtime.clone();
                    std::thread::spawn(move || {
                        wait_exit(pid, &dir);
                        let ok = criu::lazy_status(&dir) == Some(true);
                        if !ok {
                            fail_branch(&runtime, &id, "the lazy restore of its memory failed");
                        }
                        remove_work_dir(&dir);
                        ended(ok);
                    });
                }
                (None, None) => {
                    // The shell was killed: whatever the daemon still delivers, nobody can tell
                    // whether it delivered everything.
                    stop(None, &others);
                    fail_branch(
                        runtime,
                        &id,
                        "the daemon serving its memory (criu lazy-pages) was lost before every page was delivered",
                    );
                    remove_work_dir(&dir);
                }
            }
        }
    }
}

/// A branch whose memory has holes: marked failed (its processes killed, an event), never left
/// running on pages that read as zeros. Nothing to do if it is not running (a branch destroyed
/// mid-copy also ends its daemon with an error).
pub(crate) fn fail_branch(runtime: &Runtime, id: &SandboxId, reason: &str) {
    if !runtime
        .get(id)
        .is_ok_and(|i| i.state == SandboxState::Running)
    {
        return;
    }
    tracing::error!(sandbox = %id, reason, "marking the branch failed");
    if let Err(e) = runtime.fail(id, reason) {
        tracing::error!(sandbox = %id, error = %e, "mark a branch with lost memory failed");
    }
}

/// Kills a lazy-pages shell's process group and the other processes of a daemon (in a group
/// whose shell is gone).
fn stop(shell: Option<u32>, others: &[u32]) {
    if let Some(pgid) = shell {
        criu::kill_group(pgid);
    }
    for &pid in others {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// The sandbox a lazy work dir (`<sandbox id>-<ms>`) is for.
fn branch_of(dir: &Path) -> Option<SandboxId> {
    let name = dir.file_name()?.to_str()?;
    name.rsplit_once('-')?.0.parse().ok()
}

/// A lazy work dir with what CRIU left in /tmp for it.
pub(crate) fn remove_work_dir(dir: &Path) {
    criu::remove_staging_dirs(&dir.join(criu::RESTORE_LOG));
    let _ = std::fs::remove_dir_all(dir);
}

/// (pid, command line) of every process on the host.
fn processes() -> Vec<(u32, Vec<u8>)> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse().ok()?;
            Some((pid, std::fs::read(e.path().join("cmdline")).ok()?))
        })
        .collect()
}

/// The lazy-pages shell working in `dir`, and any other of its processes (the daemon).
fn helpers_in(procs: &[(u32, Vec<u8>)], dir: &Path) -> (Option<u32>, Vec<u32>) {
    let (mut shell, mut others) = (None, Vec::new());
    for (pid, cmd) in procs {
        match criu::is_lazy_helper(cmd, dir) {
            Some(true) => shell = Some(*pid),
            Some(false) => others.push(*pid),
            None => {}
        }
    }
    (shell, others)
}

/// Blocks until the lazy-pages shell `pid` (not our child) of `dir` has exited.
fn wait_exit(pid: u32, dir: &Path) {
    let Ok(fd) = grove_sys::process::pidfd_open(pid as i32) else {
        return; // gone already
    };
    // The pid may have been reused between the scan and the open: then ours is gone.
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    if criu::is_lazy_helper(&cmd, dir) != Some(true) {
        return;
    }
    loop {
        let mut fds = [nix::poll::PollFd::new(
            fd.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
            Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(pid, error = %e, "poll a lazy-pages daemon; watching /proc instead");
                while std::path::Path::new(&format!("/proc/{pid}")).exists() && !is_zombie(pid) {
                    std::thread::sleep(Duration::from_millis(100));
                }
                return;
            }
        }
    }
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s.get(i + 2..i + 3))
            .is_some_and(|st| st == "Z")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> SandboxId {
        s.parse().unwrap()
    }

    #[test]
    fn helpers_status_and_branch_are_read_from_their_work_dir() {
        let dir = std::env::temp_dir().join(format!("grove-lazy-unit-{}", std::process::id()));
        let work = dir.join("sb-00000000004a-1796160221947");
        std::fs::create_dir_all(&work).unwrap();
        assert_eq!(branch_of(&work), Some(id("sb-00000000004a")));
        assert_eq!(branch_of(&dir.join("junk")), None);
        assert_eq!(criu::lazy_status(&work), None, "still running");
        for (text, want) in [("0\n", Some(true)), ("137\n", Some(false)), ("", None)] {
            std::fs::write(work.join(criu::LAZY_STATUS), text).unwrap();
            assert_eq!(criu::lazy_status(&work), want, "{text:?}");
        }
        let w = work.to_str().unwrap();
        let shell = format!(
            "/bin/sh\0-c\0script\0grove-lazy-pages\0{w}\0/x/criu\0lazy-pages\0-D\0/i\0-W\0{w}\0"
        );
        let daemon = format!("/x/ld.so\0/x/criu\0lazy-pages\0-D\0/i\0-W\0{w}\0-v4\0");
        let restore = format!("/x/criu\0restore\0--lazy-pages\0-W\0{w}\0");
        let other = format!("/x/criu\0lazy-pages\0-W\0{w}-2\0");
        let waiter = format!("grove-lazy-pages\0/x/criu\0lazy-pages\0-D\0/i\0-W\0{w}\0");
        let forked = format!("/x/criu\0lazy-pages\0-D\0/i\0-W\0{w}\0");
        assert_eq!(criu::is_lazy_helper(shell.as_bytes(), &work), Some(true));
        assert_eq!(criu::is_lazy_helper(waiter.as_bytes(), &work), Some(true));
        assert_eq!(criu::is_lazy_helper(daemon.as_bytes(), &work), Some(false));
        assert_eq!(criu::is_lazy_helper(forked.as_bytes(), &work), Some(false));
        assert_eq!(criu::is_lazy_helper(restore.as_bytes(), &work), None);
        assert_eq!(criu::is_lazy_helper(other.as_bytes(), &work), None);
        std::fs::remove_dir_all(&dir).unwrap();
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

    /// A stand-in for a lazy-pages daemon with the shim preloaded: 50 background chunks, each
    /// after a poll that does not wait (so, asked to, waits for a quiet tree: 10 s here).
    const DAEMON: &str = r#"
import select, time
ep = select.epoll()
for _ in range(50):
    ep.poll(0)
    time.sleep(0.001)
"#;

    /// A snapshot waiting on a daemon that waits for a quiet tree hurries it (SIGWINCH to its
    /// group, through the shim), so the wait ends long before the tree would have been quiet.
    #[test]
    fn a_waiting_snapshot_hurries_the_daemon() {
        use std::os::unix::process::CommandExt;
        let Some((_dir, shim)) = criu::compat::shim_in_temp_dir(criu::compat::SHIM, "criu-shim.so")
        else {
            return;
        };
        // Its shell, as in a real daemon's group, must let the signal pass.
        let mut child = std::process::Command::new("/bin/sh")
            .args([
                "-c",
                "python3 -c \"$1\"; exit $?",
                "grove-lazy-pages",
                DAEMON,
            ])
            .env("LD_PRELOAD", &shim)
            .env(criu::compat::LAZY_QUIET_ENV, "10000")
            .process_group(0)
            .spawn()
            .unwrap();
        let lc = Arc::new(LazyCopies::default());
        let sb = id("sb-00000000005a");
        let end = lc.start(&sb, child.id());
        let waiter = std::thread::spawn(move || end(child.wait().unwrap().success()));
        let waited = lc.wait(&sb, Duration::from_secs(5));
        waiter.join().unwrap();
        waited.expect("the daemon ended well within the 10 s it would have waited");
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
