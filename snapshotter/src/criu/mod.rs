//! Driving the CRIU binary: locating it, probing kernel features once, dump and restore.

mod args;
pub(crate) mod compat;
mod early;
mod error;
mod launch;
pub mod log;
#[cfg(test)]
mod tmpfs_archive_tests;
mod zygote;

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub use args::{
    DumpOptions, PreDumpOptions, RestoreOptions, DUMP_LOG, LAZY_LOG, NETNS_FD, NETNS_KEY,
    PRE_DUMP_LOG, RESTORE_LOG,
};
pub use early::EarlyDump;
pub use error::Error;
pub use launch::Launch;

/// Where scripts/setup installs a CRIU that works on this kernel.
pub const DEFAULT_BINARY: &str = "/var/lib/grove/criu/criu";

/// Kernel features CRIU can use here; probed once per `Criu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    /// Soft-dirty tracking: pre-dump / `--track-mem` incremental dumps work.
    pub mem_dirty_track: bool,
    /// userfaultfd for non-cooperative processes: `--lazy-pages` restores work.
    pub lazy_pages: bool,
    /// No soft-dirty, but userfaultfd async write-protect and PAGEMAP_SCAN, and the shim that
    /// turns them into CRIU's soft-dirty: `--track-mem` dumps against the previous snapshot
    /// work where Grove arms the tracking (`crate::dirty`).
    pub uffd_wp: bool,
}

/// A located, checked CRIU binary.
#[derive(Debug)]
pub struct Criu {
    binary: PathBuf,
    /// How `binary` is started (without its wrapper where it is scripts/setup's).
    launch: launch::Launch,
    features: OnceLock<Features>,
    shim: Option<compat::Shim>,
    /// The shim's build for dumps tracked by userfaultfd write-protect.
    shim_uffd: Option<compat::Shim>,
    /// Where CRIU keeps its kernel-feature cache when /run is not a tmpfs (see the shim).
    kdat: Option<PathBuf>,
    /// The loaded CRIU that restores and lazy-pages daemons are forked from (`zygote`),
    /// started at the first; `zygote_failed` once it could not be started.
    zygote: parking_lot::Mutex<Option<zygote::Zygote>>,
    zygote_failed: std::sync::atomic::AtomicBool,
}

/// How long a dump or restore took.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub elapsed: Duration,
}

impl Criu {
    /// Finds CRIU: `explicit`, else [`DEFAULT_BINARY`], else `criu` on PATH;
    /// the first that exists and passes `criu check` wins.
    pub fn locate(explicit: Option<&Path>) -> Result<Criu, Error> {
        let mut tried = Vec::new();
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Some(p) = explicit {
            candidates.push(p.to_path_buf());
        } else {
            candidates.push(DEFAULT_BINARY.into());
            if let Some(path) = std::env::var_os("PATH") {
                candidates.extend(std::env::split_paths(&path).map(|d| d.join("criu")));
            }
        }
        for c in candidates {
            if !c.is_file() {
                tried.push(c);
                continue;
            }
            let criu = Criu {
                launch: launch::Launch::of(&c),
                binary: c.clone(),
                features: OnceLock::new(),
                shim: compat::Shim::load(),
                shim_uffd: compat::Shim::load_uffd(),
                kdat: compat::kdat_cache(),
                zygote: parking_lot::Mutex::new(None),
                zygote_failed: std::sync::atomic::AtomicBool::new(false),
            };
            match criu.check() {
                Ok(()) => return Ok(criu),
                Err(e) => {
                    tracing::warn!(binary = %c.display(), error = %e, "criu candidate rejected");
                    tried.push(c);
                }
            }
        }
        Err(Error::NotFound { tried })
    }

    /// Whether the socket-option compatibility shim is preloaded into CRIU.
    pub fn has_socket_shim(&self) -> bool {
        self.shim.is_some()
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    fn command(&self) -> Command {
        self.command_with(None)
    }

    /// A CRIU command that inherits `netns` at [`args::NETNS_FD`] (see `RestoreOptions`).
    fn command_with(&self, netns: Option<BorrowedFd<'_>>) -> Command {
        self.prepare(self.launch.command(), netns, self.shim.as_ref())
    }

    /// `cmd` (CRIU, or a shell around it) with CRIU's environment and descriptors.
    fn prepare(
        &self,
        cmd: Command,
        netns: Option<BorrowedFd<'_>>,
        shim: Option<&compat::Shim>,
    ) -> Command {
        let placed = netns.map(|f| (f.as_raw_fd(), args::NETNS_FD));
        self.prepare_placing(cmd, placed, shim)
    }

    /// [`Criu::prepare`], with `placed`'s fd inherited at its number.
    fn prepare_placing(
        &self,
        mut cmd: Command,
        placed: Option<(RawFd, RawFd)>,
        shim: Option<&compat::Shim>,
    ) -> Command {
        cmd.stdin(Stdio::null());
        // Only a dump that asks for it may have the shim answer conntrack or TCP diag dumps (a
        // restore's netfilter requests must reach the kernel), write plain tmpfs archives, or
        // wait to be started, whatever groved's own environment holds.
        for var in [
            compat::EMPTY_CONNTRACK_ENV,
            compat::EMPTY_TCP_DIAG_ENV,
            compat::PLAIN_TMPFS_ARCHIVES_ENV,
            compat::COALESCE_PAGE_WRITES_ENV,
            compat::READ_AHEAD_SMAPS_ENV,
            compat::ASYNC_PAGE_WRITES_ENV,
            compat::START_FD_ENV,
            compat::LAZY_QUIET_ENV,
            zygote::ENV,
        ] {
            cmd.env_remove(var);
        }
        let shim = shim.map(|s| s.raw());
        if shim.is_some() {
            cmd.env("LD_PRELOAD", compat::Shim::preload_path());
            if let Some(k) = &self.kdat {
                cmd.env(compat::KDAT_ENV, k);
            }
        }
        prepare_fds(&mut cmd, shim, placed);
        cmd
    }

    /// `criu check`: the binary runs and the kernel has what a plain dump/restore needs.
    pub fn check(&self) -> Result<(), Error> {
        let out = self
            .command()
            .arg("check")
            .output()
            .map_err(|source| Error::Spawn {
                binary: self.binary.clone(),
                source,
            })?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if out.status.success() && text.contains("Looks good") {
            Ok(())
        } else {
            Err(Error::CheckFailed {
                binary: self.binary.clone(),
                log_tail: log::error_lines(&text),
            })
        }
    }

    /// The kernel features, probed on first use with `criu check --feature`.
    pub fn features(&self) -> Features {
        *self.features.get_or_init(|| {
            let mem_dirty_track = self.has_feature("mem_dirty_track");
            let uffd_wp = !mem_dirty_track && self.shim_uffd.is_some() && {
                let probe = crate::dirty::supported();
                if let Err(e) = &probe {
                    tracing::info!(reason = %e, "no dirty-page tracking by userfaultfd write-protect");
                }
                probe.is_ok()
            };
            Features {
                mem_dirty_track,
                lazy_pages: self.has_feature("uffd-noncoop"),
                uffd_wp,
            }
        })
    }

    fn has_feature(&self, name: &str) -> bool {
        self.command()
            .args(["check", "--feature", name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    /// Checkpoints a process tree. On failure the error carries the log's `Error (` lines.
    pub fn dump(&self, opts: &DumpOptions) -> Result<Timing, Error> {
        let start = Instant::now();
        let cmd = self.dump_command(opts, None);
        let status = Self::run_cmd(cmd, &self.binary, &opts.to_args(), &opts.work_dir)?;
        dump_outcome(status, opts, start)
    }

    /// The shim a dump runs with, if it was built.
    fn dump_shim(&self, opts: &DumpOptions) -> Option<&compat::Shim> {
        match opts.uffd_wp {
            true => self.shim_uffd.as_ref(),
            false => self.shim.as_ref(),
        }
    }

    /// CRIU for `opts`'s dump, without its arguments; `start`, where given, is the read end of
    /// the pipe it waits on before its main (see [`EarlyDump`]).
    fn dump_command(&self, opts: &DumpOptions, start: Option<RawFd>) -> Command {
        let placed = start.map(|fd| (fd, compat::START_FD));
        let mut cmd = self.prepare_placing(self.launch.command(), placed, self.dump_shim(opts));
        if opts.uffd_wp {
            cmd.env(compat::UFFD_WP_ENV, "1");
            cmd.env(compat::EMPTY_TCP_DIAG_ENV, "1");
            // On unless groved runs with the variable at "0" (an A/B, or a way out).
            for on_unless_off in [
                compat::COALESCE_PAGE_WRITES_ENV,
                compat::READ_AHEAD_SMAPS_ENV,
                compat::ASYNC_PAGE_WRITES_ENV,
            ] {
                if std::env::var(on_unless_off).as_deref() != Ok("0") {
                    cmd.env(on_unless_off, "1");
                }
            }
        }
        if opts.skip_network_lock && opts.external_net.is_some() {
            cmd.env(compat::EMPTY_CONNTRACK_ENV, "1");
        }
        cmd.env(compat::PLAIN_TMPFS_ARCHIVES_ENV, "1");
        if start.is_some() {
            cmd.env(compat::START_FD_ENV, compat::START_FD.to_string());
        }
        cmd
    }

    /// Copies the tree's memory while it runs and arms soft-dirty tracking (see
    /// [`PreDumpOptions`]). Only where `features().mem_dirty_track`.
    pub fn pre_dump(&self, opts: &PreDumpOptions) -> Result<Timing, Error> {
        let start = Instant::now();
        std::fs::create_dir_all(&opts.images_dir).map_err(|e| Error::io(&opts.images_dir, e))?;
        let status = self.run(&opts.to_args(), &opts.work_dir)?;
        if status.success() {
            return Ok(Timing {
                elapsed: start.elapsed(),
            });
        }
        let log_tail = read_log(&opts.work_dir.join(PRE_DUMP_LOG));
        remove_staging_dirs(&opts.work_dir.join(PRE_DUMP_LOG));
        Err(Error::DumpFailed {
            pid: opts.pid,
            log_tail,
        })
    }

    /// Restores a tree detached (`-d`) and returns the host pid of its root task.
    pub fn restore(&self, opts: &RestoreOptions) -> Result<(i32, Timing), Error> {
        self.restore_in(opts, None)
    }

    /// [`Criu::restore`] joining `netns` (the fresh namespace an image with an external one
    /// needs; `opts.inherit_netns` must say so).
    pub fn restore_in(
        &self,
        opts: &RestoreOptions,
        netns: Option<BorrowedFd<'_>>,
    ) -> Result<(i32, Timing), Error> {
        let start = Instant::now();
        let args = opts.to_args();
        let status = match self.run_forked(&args, &opts.work_dir, netns, opts.merge_pages) {
            Some(status) => status?,
            None => {
                let mut cmd = self.command_with(netns);
                if opts.merge_pages {
                    use std::os::unix::process::CommandExt;
                    // SAFETY: the closure runs between fork and exec and only calls prctl,
                    // which is async-signal-safe and touches no memory of the parent.
                    unsafe {
                        cmd.pre_exec(crate::ksm::merge_this_process);
                    }
                }
                Self::run_cmd(cmd, &self.binary, &args, &opts.work_dir)?
            }
        };
        let dir = opts.images_dir.clone();
        if !status.success() {
            let log_tail = read_log(&opts.work_dir.join(RESTORE_LOG));
            remove_staging_dirs(&opts.work_dir.join(RESTORE_LOG));
            return Err(Error::RestoreFailed { dir, log_tail });
        }
        let pid = std::fs::read_to_string(&opts.pidfile)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .filter(|p| *p > 0)
            .ok_or_else(|| Error::Pidfile {
                dir,
                pidfile: opts.pidfile.clone(),
            })?;
        Ok((
            pid,
            Timing {
                elapsed: start.elapsed(),
            },
        ))
    }

    /// Starts a `criu lazy-pages` daemon serving `images_dir` to one `--lazy-pages` restore that
    /// uses the same `work_dir`; returns once it listens. The daemon exits by itself once every
    /// page has been copied into the restored tree (or the tree is gone); `LazyPages::reap_later`
    /// waits for it on a thread so it never lingers as a zombie.
    ///
    /// The restored tree's memory depends on the daemon until then, so the daemon must outlive
    /// a crash of groved: it runs in a process group of its own (a signal to groved's group
    /// spares it), under the zygote's waiter or a shell, which writes its exit status to
    /// [`LAZY_STATUS`] in `work_dir` (the next groved, not its parent, learns from that whether
    /// every page was delivered).
    pub fn lazy_pages(&self, images_dir: &Path, work_dir: &Path) -> Result<LazyPages, Error> {
        self.lazy_pages_forked(images_dir, work_dir, zygote::forks_lazy_daemons())
    }

    /// [`Criu::lazy_pages`], the daemon forked from the zygote if `fork` (and there is one).
    fn lazy_pages_forked(
        &self,
        images_dir: &Path,
        work_dir: &Path,
        fork: bool,
    ) -> Result<LazyPages, Error> {
        let args = args::lazy_pages_args(images_dir, work_dir);
        let status = work_dir.join(LAZY_STATUS);
        let lazy = zygote::Lazy {
            status: &status,
            quiet_ms: lazy_quiet_ms(),
        };
        let forked = match fork {
            true => self.fork_criu(&args, work_dir, None, false, Some(lazy)),
            false => None,
        };
        let mut daemon = match forked {
            Some(report) => {
                let mut report = report?;
                let pgid = report.waiter().map_err(|e| self.lost(e))?;
                LazyPages {
                    waiter: Waiter::Forked { pgid, report },
                }
            }
            None => self.lazy_pages_in_shell(&args, work_dir)?,
        };
        let socket = work_dir.join("lazy-pages.socket");
        let deadline = Instant::now() + Duration::from_secs(5);
        while !socket.exists() {
            if daemon.has_ended() {
                return Err(Error::RestoreFailed {
                    dir: images_dir.to_path_buf(),
                    log_tail: read_log(&work_dir.join(args::LAZY_LOG)),
                });
            }
            if Instant::now() > deadline {
                daemon.kill();
                return Err(Error::RestoreFailed {
                    dir: images_dir.to_path_buf(),
                    log_tail: vec!["lazy-pages daemon did not start listening".into()],
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(daemon)
    }

    /// The daemon under a shell that records its status (where no zygote forks it).
    fn lazy_pages_in_shell(
        &self,
        args: &[std::ffi::OsString],
        work_dir: &Path,
    ) -> Result<LazyPages, Error> {
        use std::os::unix::process::CommandExt;
        std::fs::create_dir_all(work_dir).map_err(|e| Error::io(work_dir, e))?;
        let mut cmd = self.prepare(Command::new("/bin/sh"), None, self.shim.as_ref());
        cmd.env(compat::LAZY_QUIET_ENV, lazy_quiet_ms().to_string());
        cmd.arg("-c")
            .arg(LAZY_WRAPPER)
            .arg(LAZY_WRAPPER_NAME)
            .arg(work_dir)
            .args(self.launch.argv())
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        let child = cmd.spawn().map_err(|source| Error::Spawn {
            binary: self.binary.clone(),
            source,
        })?;
        Ok(LazyPages {
            waiter: Waiter::Shell(child),
        })
    }

    fn run(
        &self,
        args: &[std::ffi::OsString],
        work_dir: &Path,
    ) -> Result<std::process::ExitStatus, Error> {
        self.run_with(args, work_dir, None)
    }

    fn run_with(
        &self,
        args: &[std::ffi::OsString],
        work_dir: &Path,
        netns: Option<BorrowedFd<'_>>,
    ) -> Result<std::process::ExitStatus, Error> {
        Self::run_cmd(self.command_with(netns), &self.binary, args, work_dir)
    }

    fn run_cmd(
        mut cmd: Command,
        binary: &Path,
        args: &[std::ffi::OsString],
        work_dir: &Path,
    ) -> Result<std::process::ExitStatus, Error> {
        std::fs::create_dir_all(work_dir).map_err(|e| Error::io(work_dir, e))?;
        cmd.args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|source| Error::Spawn {
                binary: binary.to_path_buf(),
                source,
            })
    }
}

/// How long a lazy-pages daemon's background copy waits for its tree to go without a fault
/// (compat/criu-shim.c, 10); `GROVE_LAZY_QUIET_MS` in groved's environment sets it (0: no wait).
/// The first branches of a fork then leave the cores to the restores of the next ones and to
/// answering: a fork of 8 answered in 377.6 ms instead of 476-597. A snapshot of a branch does
/// not wait for it (`lazy::LazyCopies::wait` tells the daemon to hurry); what waits is another
/// process's read of a page not copied yet (a debugger's, /proc/<pid>/mem), which fails until
/// then, and the branch's full share of memory (docs/incremental-snapshots.md, "Pages other
/// processes read").
const LAZY_QUIET_MS: u32 = 250;

/// The quiet wait of lazy-pages daemons started now ([`LAZY_QUIET_MS`] unless groved's
/// environment says otherwise).
pub fn lazy_quiet() -> Duration {
    Duration::from_millis(lazy_quiet_ms().into())
}

fn lazy_quiet_ms() -> u32 {
    std::env::var(compat::LAZY_QUIET_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(LAZY_QUIET_MS)
}

/// The shell around a `criu lazy-pages` daemon (`$1`: its work dir, then CRIU's command line):
/// runs it, records its exit status in the work dir, and exits with it.
const LAZY_WRAPPER: &str = r#"w=$1; shift; "$@"; s=$?; echo $s > "$w/lazy-pages.status"; exit $s"#;

/// `$0` of that shell: names a lazy-pages helper among processes (see [`is_lazy_helper`]).
pub const LAZY_WRAPPER_NAME: &str = "grove-lazy-pages";

/// Where the shell records the daemon's exit status, in its work dir.
pub const LAZY_STATUS: &str = "lazy-pages.status";

/// How the daemon that worked in `work_dir` ended, as its shell recorded it: Some(true) when it
/// exited 0 (every page delivered, or its tree gone), Some(false) when it failed or was killed,
/// None while it runs or when nothing was recorded (its shell was killed too).
pub fn lazy_status(work_dir: &Path) -> Option<bool> {
    let text = std::fs::read_to_string(work_dir.join(LAZY_STATUS)).ok()?;
    match text.trim() {
        "" => None,
        s => Some(s == "0"),
    }
}

/// Whether a process's NUL-separated command line is the shell of a lazy-pages daemon
/// working in `work_dir` (true) or the daemon itself (false); None when it is neither.
pub fn is_lazy_helper(cmdline: &[u8], work_dir: &Path) -> Option<bool> {
    use std::os::unix::ffi::OsStrExt;
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    let dir = work_dir.as_os_str().as_bytes();
    let serves = args.iter().any(|a| *a == b"lazy-pages")
        && args.windows(2).any(|w| w[0] == b"-W" && w[1] == dir);
    if !serves {
        return None;
    }
    let name = LAZY_WRAPPER_NAME.as_bytes();
    // A shell (`sh -c WRAPPER NAME …`), or a waiter the zygote forked (`NAME criu …`).
    let shell = args.get(1) == Some(&&b"-c"[..]) && args.get(3) == Some(&name);
    Some(shell || args.first() == Some(&name))
}

/// A running `criu lazy-pages` daemon, in its own process group with the process that records
/// its exit status: a shell, or its waiter where the zygote forked it.
#[derive(Debug)]
pub struct LazyPages {
    waiter: Waiter,
}

#[derive(Debug)]
enum Waiter {
    Shell(std::process::Child),
    Forked { pgid: u32, report: zygote::Report },
}

impl LazyPages {
    /// Stops the daemon now (the restore it was for failed).
    pub fn kill(self) {
        kill_group(self.pid());
        self.wait();
    }

    /// The shell's or waiter's pid, which is also the process group of it and the daemon.
    pub fn pid(&self) -> u32 {
        match &self.waiter {
            Waiter::Shell(child) => child.id(),
            Waiter::Forked { pgid, .. } => *pgid,
        }
    }

    fn has_ended(&mut self) -> bool {
        match &mut self.waiter {
            Waiter::Shell(child) => matches!(child.try_wait(), Ok(Some(_))),
            Waiter::Forked { report, .. } => report.has_ended(),
        }
    }

    /// Whether it exited successfully, once it has.
    fn wait(self) -> bool {
        match self.waiter {
            Waiter::Shell(mut child) => child.wait().is_ok_and(|s| s.success()),
            Waiter::Forked { report, .. } => report.wait().is_ok_and(|s| s.success()),
        }
    }

    /// Sets the daemon's niceness: its background copy then competes less with everything else.
    /// Meant for after the restore, which needs the daemon's answers at full priority.
    pub fn set_nice(&self, nice: i32) {
        set_group_nice(self.pid(), nice);
    }

    /// Lets the daemon finish copying pages; a thread waits for it, then runs `then` with
    /// whether it exited successfully (every page copied, or its tree gone).
    pub fn reap_later(self, then: impl FnOnce(bool) + Send + 'static) {
        std::thread::spawn(move || then(self.wait()));
    }
}

/// SIGKILL to the process group `pgid` (a lazy-pages shell and its daemon).
pub fn kill_group(pgid: u32) {
    signal_group(pgid, nix::sys::signal::Signal::SIGKILL);
}

/// `sig` to the process group `pgid`; never to our own group (0) or to every process (-1).
fn signal_group(pgid: u32, sig: nix::sys::signal::Signal) {
    let Ok(pgid) = i32::try_from(pgid) else {
        return;
    };
    if pgid > 1 {
        // At worst the group is gone already (ESRCH).
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), sig);
    }
}

/// Tells the lazy-pages daemon in the group `pgid` that its branch's memory is wanted whole:
/// SIGWINCH, which ends its wait for a quiet tree (compat/criu-shim.c, 10). The shell around it
/// ignores the signal, as does a daemon without the shim.
pub fn hurry_group(pgid: u32) {
    signal_group(pgid, nix::sys::signal::Signal::SIGWINCH);
}

/// Sets the niceness of every process in the group `pgid`.
pub fn set_group_nice(pgid: u32, nice: i32) {
    // At worst the group is gone already (ESRCH).
    let _ = grove_sys::sched::set_group_nice(pgid, nice);
}

/// Removes the /tmp staging dirs a failed or killed CRIU named in its log and left behind.
/// Only empty dirs go (remove_dir), and a finished CRIU no longer uses them.
/// What a dump's exit status means: its time from `start`, or its failure with CRIU's log.
fn dump_outcome(
    status: std::process::ExitStatus,
    opts: &DumpOptions,
    start: Instant,
) -> Result<Timing, Error> {
    if status.success() {
        return Ok(Timing {
            elapsed: start.elapsed(),
        });
    }
    let log_tail = read_log(&opts.work_dir.join(DUMP_LOG));
    remove_staging_dirs(&opts.work_dir.join(DUMP_LOG));
    if let Some(signal) = std::os::unix::process::ExitStatusExt::signal(&status) {
        Err(Error::DumpKilled {
            pid: opts.pid,
            signal,
            log_tail,
        })
    } else if log::is_external_socket(&log_tail) {
        Err(Error::ExternalSocket {
            pid: opts.pid,
            log_tail,
        })
    } else {
        Err(Error::DumpFailed {
            pid: opts.pid,
            log_tail,
        })
    }
}

pub(crate) fn remove_staging_dirs(log: &Path) {
    let Ok(text) = std::fs::read_to_string(log) else {
        return;
    };
    for d in log::staging_dirs(&text) {
        if std::fs::remove_dir(&d).is_ok() {
            tracing::info!(dir = %d.display(), "removed a staging dir CRIU left in /tmp");
        }
    }
}

fn read_log(path: &Path) -> Vec<String> {
    match std::fs::read_to_string(path) {
        Ok(text) => log::error_lines(&text),
        Err(e) => vec![format!("(no log at {}: {e})", path.display())],
    }
}

/// CRIU must not inherit the daemon's descriptors (FUSE sessions, sockets): it would dump or hold
/// them. Rust opens its own fds close-on-exec, but other code in the daemon may not. The shim,
/// if any, is passed on at `SHIM_FD` and a network namespace to join at `NETNS_FD`; nothing else.
fn prepare_fds(cmd: &mut Command, shim: Option<RawFd>, placed: Option<(RawFd, RawFd)>) {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    use nix::unistd::{close, dup2};
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec and only issues async-signal-safe syscalls
    // (fcntl, dup2, close, close_range) on plain integers; it touches no memory of the parent.
    unsafe {
        cmd.pre_exec(move || {
            // Park the placed fd above both targets first, so placing the shim cannot clobber it.
            let parked = match placed {
                Some((fd, at)) => Some((fcntl(fd, FcntlArg::F_DUPFD_CLOEXEC(64))?, at)),
                None => None,
            };
            match shim {
                // dup2 onto itself would keep close-on-exec set; clear it explicitly then.
                Some(fd) if fd == compat::SHIM_FD => {
                    fcntl(fd, FcntlArg::F_SETFD(FdFlag::empty()))?;
                }
                Some(fd) => {
                    dup2(fd, compat::SHIM_FD)?;
                }
                None => {
                    let _ = close(compat::SHIM_FD);
                }
            }
            let mut first_closed = compat::SHIM_FD as u32 + 1;
            if let Some((fd, at)) = parked {
                // Nothing inherited between the shim and the placed fd.
                for gap in compat::SHIM_FD + 1..at {
                    let _ = close(gap);
                }
                dup2(fd, at)?;
                let _ = close(fd);
                first_closed = at as u32 + 1;
            }
            grove_sys::fd::close_from(first_closed);
            Ok(())
        });
    }
}
