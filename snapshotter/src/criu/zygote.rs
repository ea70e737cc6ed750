//! One CRIU loaded once and forked for each restore and lazy-pages daemon (compat/criu-shim.c,
//! 11). Starting CRIU costs about 4.5 ms of CPU here, the kernel's exec and the loader
//! relocating its 22 libraries, twice in every branch of a fork; a fork of a loaded CRIU costs a
//! fraction of that. The zygote is CRIU held by the shim before its main, reading requests on a
//! socket only we hold; each request runs one CRIU process with its own arguments under a waiter
//! that reports its pid, then the CRIU's wait status, on a socket of the request's own, so
//! restores from several threads go on side by side.

use std::ffi::OsString;
use std::io::{IoSlice, Read as _};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt as _;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use nix::sys::socket::{self, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType};

use super::{Criu, Error};

/// `GROVE_CRIU_ZYGOTE` in groved's environment, to compare: `0`, every CRIU is started as a
/// process of its own; `restores`, lazy-pages daemons are started under a shell as before. By
/// default restores and daemons are both forked (CK-11 ≈ 200-214 ms against ≈ 233-258 with
/// restores only, docs/incremental-snapshots.md, "CRIU forked, not started").
pub(crate) const OFF_ENV: &str = "GROVE_CRIU_ZYGOTE";

/// Whether lazy-pages daemons are forked from the zygote (all but `GROVE_CRIU_ZYGOTE=restores`).
pub(crate) fn forks_lazy_daemons() -> bool {
    std::env::var_os(OFF_ENV).is_none_or(|v| v != "restores")
}
/// The variable that makes the shim a zygote, and the descriptor its socket is at.
pub(crate) const ENV: &str = "GROVE_ZYGOTE_FD";
pub(crate) const FD: RawFd = 4;
/// Request flags (the shim's ZYGOTE_MERGE, ZYGOTE_NETNS, ZYGOTE_LAZY).
const MERGE: u8 = 1;
const NETNS: u8 = 2;
const LAZY: u8 = 4;
/// What the shim reads of one request.
const MAX_REQUEST: usize = 65536;
/// How long a starting zygote may take to say it is ready.
const READY_WAIT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub(crate) enum ZygoteError {
    #[error("starting CRIU's zygote: {0}")]
    Start(std::io::Error),
    #[error("CRIU's zygote is gone: {0}")]
    Gone(std::io::Error),
    #[error("a request of {0} bytes is larger than the zygote reads")]
    TooLarge(usize),
    #[error("CRIU's zygote took the request but reported no status: {0}")]
    NoStatus(std::io::Error),
}

#[derive(Debug)]
pub(crate) struct Zygote {
    child: Child,
    control: UnixStream,
}

/// A request sent: its CRIU runs; [`Report::wait`] for its status.
#[derive(Debug)]
pub(crate) struct Report {
    stream: UnixStream,
    /// The waiter's pid, once read: it says it first.
    waiter: Option<u32>,
}

/// What a lazy-pages daemon's waiter needs besides CRIU's arguments (the shim's part 11).
#[derive(Clone, Copy)]
pub(crate) struct Lazy<'a> {
    /// Where it writes the daemon's exit status.
    pub status: &'a std::path::Path,
    /// The daemon's quiet wait (`GROVE_LAZY_QUIET_MS`).
    pub quiet_ms: u32,
}

impl Zygote {
    /// Starts `cmd` (CRIU with the shim preloaded, descriptors prepared by the caller but for
    /// ours, which it must place at [`FD`]) as the zygote; returns once it is ready.
    pub(crate) fn start(place: impl FnOnce(RawFd) -> Command) -> Result<Zygote, ZygoteError> {
        let (ours, theirs) = socket::socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| ZygoteError::Start(e.into()))?;
        let mut cmd = place(theirs.as_raw_fd());
        let child = cmd
            .env(ENV, FD.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(ZygoteError::Start)?;
        drop(theirs);
        let mut zygote = Zygote {
            child,
            control: UnixStream::from(ours),
        };
        zygote.wait_ready().map_err(ZygoteError::Start)?;
        Ok(zygote)
    }

    fn wait_ready(&mut self) -> std::io::Result<()> {
        self.control.set_read_timeout(Some(READY_WAIT))?;
        let mut said = [0u8; 1];
        self.control.read_exact(&mut said)?;
        if said != *b"r" {
            return Err(std::io::Error::other("it said something else"));
        }
        self.control.set_read_timeout(None)
    }

    /// Has CRIU run with `argv` (its first is the program's name), `netns` at
    /// [`super::NETNS_FD`], KSM merging its memory if `merge`, and as a lazy-pages daemon with
    /// its waiter in the shell's place if `lazy`.
    pub(crate) fn send(
        &self,
        argv: &[OsString],
        netns: Option<BorrowedFd<'_>>,
        merge: bool,
        lazy: Option<Lazy<'_>>,
    ) -> Result<Report, ZygoteError> {
        let flag = |on: bool, f: u8| if on { f } else { 0 };
        let mut msg =
            vec![flag(merge, MERGE) | flag(netns.is_some(), NETNS) | flag(lazy.is_some(), LAZY)];
        let lazy_args = lazy.map(|l| {
            [
                l.status.as_os_str().to_owned(),
                l.quiet_ms.to_string().into(),
            ]
        });
        for a in lazy_args.iter().flatten().chain(argv) {
            msg.extend_from_slice(a.as_bytes());
            msg.push(0);
        }
        if msg.len() > MAX_REQUEST {
            return Err(ZygoteError::TooLarge(msg.len()));
        }
        let (report, theirs) = UnixStream::pair().map_err(ZygoteError::Gone)?;
        let mut fds = vec![theirs.as_raw_fd()];
        fds.extend(netns.map(|f| f.as_raw_fd()));
        socket::sendmsg::<()>(
            self.control.as_raw_fd(),
            &[IoSlice::new(&msg)],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .map_err(|e| ZygoteError::Gone(e.into()))?;
        Ok(Report {
            stream: report,
            waiter: None,
        })
    }
}

impl Report {
    fn read_word(&mut self) -> Result<[u8; 4], ZygoteError> {
        let mut word = [0u8; 4];
        self.stream
            .read_exact(&mut word)
            .map_err(ZygoteError::NoStatus)?;
        Ok(word)
    }

    /// The waiter's pid: a lazy-pages daemon's process group.
    pub(crate) fn waiter(&mut self) -> Result<u32, ZygoteError> {
        if let Some(pid) = self.waiter {
            return Ok(pid);
        }
        let pid = u32::from_ne_bytes(self.read_word()?);
        self.waiter = Some(pid);
        Ok(pid)
    }

    /// Waits for the CRIU process to end.
    pub(crate) fn wait(mut self) -> Result<ExitStatus, ZygoteError> {
        self.waiter()?;
        Ok(ExitStatus::from_raw(i32::from_ne_bytes(self.read_word()?)))
    }

    /// Whether the CRIU process has ended, without waiting (after [`Report::waiter`]).
    pub(crate) fn has_ended(&self) -> bool {
        let mut peek = [0u8; 1];
        let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
        // A status waiting, or the waiter gone without one (0 bytes): it ended.
        !matches!(
            socket::recv(self.stream.as_raw_fd(), &mut peek, flags),
            Err(nix::errno::Errno::EAGAIN)
        )
    }
}

impl Drop for Zygote {
    /// Ends the zygote (the CRIU processes it started go on) and reaps it.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Criu {
    /// Runs CRIU with `args` forked from the zygote; None where there is none to fork from
    /// (see [`Criu::fork_criu`]): the caller starts CRIU itself then.
    pub(super) fn run_forked(
        &self,
        args: &[OsString],
        work_dir: &Path,
        netns: Option<BorrowedFd<'_>>,
        merge: bool,
    ) -> Option<Result<ExitStatus, Error>> {
        let report = match self.fork_criu(args, work_dir, netns, merge, None)? {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        Some(report.wait().map_err(|e| self.lost(e)))
    }

    /// Has the zygote (started, or started again, here) fork a CRIU with `args`; None where
    /// there is none to fork from (no shim, `GROVE_CRIU_ZYGOTE=0`, or it does not start).
    pub(super) fn fork_criu(
        &self,
        args: &[OsString],
        work_dir: &Path,
        netns: Option<BorrowedFd<'_>>,
        merge: bool,
        lazy: Option<Lazy<'_>>,
    ) -> Option<Result<Report, Error>> {
        self.shim.as_ref()?;
        if std::env::var_os(OFF_ENV).is_some_and(|v| v == "0")
            || self.zygote_failed.load(Ordering::Relaxed)
        {
            return None;
        }
        if let Err(e) = std::fs::create_dir_all(work_dir) {
            return Some(Err(Error::io(work_dir, e)));
        }
        let argv: Vec<OsString> = std::iter::once(self.binary.clone().into_os_string())
            .chain(args.iter().cloned())
            .collect();
        let mut held = self.zygote.lock();
        // A zygote found gone (killed, or it failed) is started again, once.
        for _ in 0..2 {
            let z = match held.as_ref() {
                Some(z) => z,
                None => held.insert(self.start_zygote()?),
            };
            match z.send(&argv, netns, merge, lazy) {
                Ok(r) => return Some(Ok(r)),
                Err(e) => {
                    tracing::warn!(error = %e, "CRIU's zygote");
                    *held = None;
                }
            }
        }
        None
    }

    /// A forked CRIU whose waiter reported nothing.
    pub(super) fn lost(&self, e: ZygoteError) -> Error {
        Error::Spawn {
            binary: self.binary.clone(),
            source: std::io::Error::other(e),
        }
    }

    fn start_zygote(&self) -> Option<Zygote> {
        let placed =
            |fd| self.prepare_placing(self.launch.command(), Some((fd, FD)), self.shim.as_ref());
        Zygote::start(placed)
            .inspect_err(|e| {
                tracing::warn!(error = %e, "restores and lazy-pages daemons start CRIU each");
                self.zygote_failed.store(true, Ordering::Relaxed);
            })
            .ok()
    }

    /// Ends the zygote (CRIU processes it started go on): a daemon stopping leaves no process.
    pub fn stop_zygote(&self) {
        self.zygote.lock().take();
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd as _;
    use std::os::unix::process::ExitStatusExt as _;
    use std::path::Path;
    use std::time::Instant;

    use super::*;
    use crate::criu::compat;

    /// The installed CRIU with the shim; None, said loudly, where either is missing.
    fn real_criu() -> Option<Criu> {
        let Ok(criu) = Criu::locate(None) else {
            grove_testkit::capability_missing("no usable CRIU");
            return None;
        };
        if criu.shim.is_none() {
            grove_testkit::capability_missing("the shim was not built (no C compiler)");
            return None;
        }
        Some(criu)
    }

    /// A zygote of `/bin/sh` (the shim makes any dynamic program one) with `shim` preloaded.
    fn sh_zygote(shim: &Path) -> Zygote {
        Zygote::start(|fd| {
            let mut cmd = Command::new("/bin/sh");
            cmd.env("LD_PRELOAD", shim);
            super::super::prepare_fds(&mut cmd, None, Some((fd, FD)));
            cmd
        })
        .unwrap()
    }

    fn sh(z: &Zygote, script: &str, netns: Option<BorrowedFd<'_>>, merge: bool) -> ExitStatus {
        let argv = ["sh", "-c", script].map(OsString::from);
        z.send(&argv, netns, merge, None).unwrap().wait().unwrap()
    }

    /// The descriptors, what is at NETNS_FD and whether KSM merges, of a process started by
    /// the zygote, read from here (a shell's own redirections come and go).
    fn inspect(
        z: &Zygote,
        dir: &Path,
        netns: Option<BorrowedFd<'_>>,
        merge: bool,
    ) -> (Vec<i32>, Option<std::path::PathBuf>, bool) {
        let pidfile = dir.join("pid");
        let _ = std::fs::remove_file(&pidfile);
        let script = format!("echo $$ > {}; exec sleep 30", pidfile.display());
        let argv = ["sh", "-c", &script].map(OsString::from);
        let report = z.send(&argv, netns, merge, None).unwrap();
        let t = Instant::now();
        let pid: i32 = loop {
            let comm = |p: &str| std::fs::read_to_string(format!("/proc/{p}/comm"));
            match std::fs::read_to_string(&pidfile) {
                Ok(p) if comm(p.trim()).is_ok_and(|c| c.trim() == "sleep") => {
                    break p.trim().parse().unwrap()
                }
                _ => assert!(t.elapsed() < Duration::from_secs(5), "it never ran"),
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        // The shim is preloaded into the sleep too: what its constructors open and close on
        // the way into main is not the zygote's (the list read at once had a 3 in it now and
        // then, under load). Read it once the sleep sleeps.
        let t = Instant::now();
        while !std::fs::read_to_string(format!("/proc/{pid}/wchan"))
            .is_ok_and(|w| w.contains("nanosleep"))
        {
            assert!(t.elapsed() < Duration::from_secs(5), "it never slept");
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut fds: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        fds.sort_unstable();
        let at_netns_fd =
            std::fs::read_link(format!("/proc/{pid}/fd/{}", super::super::NETNS_FD)).ok();
        let merging = crate::ksm::merges_any(pid);
        // SAFETY: kill(2) of the sleep started above, which this test waits for below.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        assert_eq!(report.wait().unwrap().signal(), Some(libc::SIGKILL));
        (fds, at_netns_fd, merging)
    }

    #[test]
    fn each_request_runs_with_its_arguments_descriptors_and_status() {
        let Some((dir, shim)) = compat::shim_in_temp_dir(compat::SHIM, "shim.so") else {
            return;
        };
        let z = sh_zygote(&shim);
        let out = dir.path().join("out");
        let read_out = || std::fs::read_to_string(&out).unwrap();
        assert_eq!(sh(&z, "exit 7", None, false).code(), Some(7));
        assert_eq!(sh(&z, "kill -9 $$", None, false).signal(), Some(9));
        // Its command line is its own (a restarted groved finds a predecessor's CRIU by it).
        let script = format!("tr '\\0' ' ' < /proc/$$/cmdline > {}", out.display());
        assert!(sh(&z, &script, None, false).success());
        assert_eq!(read_out(), format!("sh -c {script} "));
        // Descriptors: stdio, and the namespace at NETNS_FD; nothing of the zygote's or ours.
        let ns = std::fs::File::open("/proc/self/ns/net").unwrap();
        let own_ns = std::fs::read_link("/proc/self/ns/net").unwrap();
        let (fds, at_netns_fd, merging) = inspect(&z, dir.path(), Some(ns.as_fd()), false);
        assert_eq!(fds, [0, 1, 2, super::super::NETNS_FD]);
        assert_eq!(at_netns_fd, Some(own_ns));
        assert!(!merging);
        let (fds, _, merging) = inspect(&z, dir.path(), None, true);
        assert_eq!(fds, [0, 1, 2], "no namespace");
        assert!(merging, "asked to merge");
        // Side by side: four that sleep 0.3 s each end well within twice that.
        let t = Instant::now();
        std::thread::scope(|s| {
            let runs: Vec<_> = (0..4)
                .map(|i| {
                    s.spawn({
                        let z = &z;
                        move || sh(z, &format!("sleep 0.3; exit {i}"), None, false)
                    })
                })
                .collect();
            for (i, r) in runs.into_iter().enumerate() {
                assert_eq!(r.join().unwrap().code(), Some(i as i32));
            }
        });
        assert!(
            t.elapsed() < Duration::from_millis(600),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_malformed_request_runs_nothing_and_the_next_one_runs() {
        let Some((dir, shim)) = compat::shim_in_temp_dir(compat::SHIM, "shim.so") else {
            return;
        };
        let z = sh_zygote(&shim);
        let mark = dir.path().join("ran");
        let touch = format!("touch {}", mark.display());
        // It says a namespace comes with it, and none does.
        let (report, theirs) = UnixStream::pair().unwrap();
        let mut msg = vec![NETNS];
        for a in ["sh", "-c", &touch] {
            msg.extend_from_slice(a.as_bytes());
            msg.push(0);
        }
        socket::sendmsg::<()>(
            z.control.as_raw_fd(),
            &[IoSlice::new(&msg)],
            &[ControlMessage::ScmRights(&[theirs.as_raw_fd()])],
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .unwrap();
        drop(theirs);
        let report = Report {
            stream: report,
            waiter: None,
        };
        assert!(matches!(report.wait(), Err(ZygoteError::NoStatus(_))));
        assert!(!mark.exists(), "a malformed request ran");
        assert!(sh(&z, &touch, None, false).success());
        assert!(mark.exists());
    }

    /// Real CRIU: a restore's CRIU comes from the zygote; one killed is started again; a stop
    /// leaves no zygote.
    #[test]
    fn criu_runs_forked_from_its_zygote_and_a_lost_zygote_is_started_again() {
        let Some(criu) = real_criu() else {
            return;
        };
        let work = tempfile::tempdir().unwrap();
        let run = |args: &[&str]| {
            let args: Vec<OsString> = args.iter().map(OsString::from).collect();
            criu.run_forked(&args, work.path(), None, false)
                .expect("forked from the zygote")
                .unwrap()
        };
        let pid = || criu.zygote.lock().as_ref().map(|z| z.child.id());
        assert!(run(&["--version"]).success());
        assert_eq!(run(&["no-such-command"]).code(), Some(1));
        let first = pid().expect("a zygote");
        // SAFETY: kill(2) on the zygote, our child (reaped when it is dropped).
        unsafe { libc::kill(first as i32, libc::SIGKILL) };
        let t = Instant::now();
        while std::fs::read_to_string(format!("/proc/{first}/stat"))
            .is_ok_and(|s| !s.contains(") Z"))
        {
            assert!(t.elapsed() < Duration::from_secs(5));
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(run(&["--version"]).success());
        let second = pid().expect("a zygote again");
        assert_ne!(first, second);
        criu.stop_zygote();
        assert!(pid().is_none());
        assert!(
            !Path::new(&format!("/proc/{second}")).exists(),
            "the zygote is reaped"
        );
    }

    #[test]
    fn a_lazy_daemon_runs_in_its_waiters_group_which_records_its_status() {
        let Some((dir, shim)) = compat::shim_in_temp_dir(compat::SHIM, "shim.so") else {
            return;
        };
        let z = sh_zygote(&shim);
        let (status, out) = (dir.path().join("status"), dir.path().join("out"));
        let lazy = Lazy {
            status: &status,
            quiet_ms: 250,
        };
        let run = |script: &str| {
            let argv = ["sh", "-c", script].map(OsString::from);
            let mut report = z.send(&argv, None, false, Some(lazy)).unwrap();
            let waiter = report.waiter().unwrap();
            (waiter, report.wait().unwrap())
        };
        // Its quiet wait, its process group (field 5 of stat), its waiter's command line.
        let script = format!(
            "echo $GROVE_LAZY_QUIET_MS $(cut -d' ' -f5 /proc/$$/stat) > {o}; tr '\\0' ' ' < /proc/$PPID/cmdline >> {o}; exit 3",
            o = out.display()
        );
        let (waiter, st) = run(&script);
        assert_eq!(st.code(), Some(3));
        assert_eq!(std::fs::read_to_string(&status).unwrap(), "3\n");
        assert_eq!(
            std::fs::read_to_string(&out).unwrap(),
            format!(
                "250 {waiter}\n{} sh -c {script} ",
                crate::criu::LAZY_WRAPPER_NAME
            )
        );
        // Killed: as a shell's $? says it.
        let (_, st) = run("kill -9 $$");
        assert_eq!(st.signal(), Some(9));
        assert_eq!(std::fs::read_to_string(&status).unwrap(), "137\n");
    }

    /// Real CRIU: a lazy-pages daemon that fails at once (no images) is reported failed, and
    /// its status recorded as a shell's `$?`, whether the zygote forked it or (a zygote that
    /// could not start) a shell runs it.
    #[test]
    fn a_failing_lazy_daemon_is_reported_forked_or_under_a_shell() {
        let Some(criu) = real_criu() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        for forked in [false, true] {
            criu.zygote_failed.store(!forked, Ordering::Relaxed);
            let work = dir.path().join(format!("work-{forked}"));
            let r = criu.lazy_pages_forked(&dir.path().join("no-images"), &work, true);
            assert!(
                matches!(r, Err(Error::RestoreFailed { .. })),
                "forked {forked}: {r:?}"
            );
            let status = std::fs::read_to_string(work.join(super::super::LAZY_STATUS)).unwrap();
            assert_ne!(status.trim(), "0", "forked {forked}");
            assert!(status.trim().parse::<i32>().is_ok(), "{status:?}");
            assert_eq!(criu.zygote.lock().is_some(), forked);
        }
    }
}
