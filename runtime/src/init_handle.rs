//! A held handle on a sandbox's init: a pidfd taken while its pid provably named that init.
//!
//! A bare pid can be reused once the init dies, and paths under `/proc/<pid>/root` are the
//! sandbox's to rewrite, so the runtime reaches a sandbox only through this handle: every access
//! opens what it needs first and then checks the pidfd still shows the init alive (a live process
//! keeps its pid, so what was opened through that pid was the init's). The control socket is
//! resolved inside the sandbox's root without following any symlink, and its peer must be the
//! init itself.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use nix::sys::stat::Mode;

use crate::proto;

#[derive(Debug, thiserror::Error)]
pub enum HandleError {
    #[error("init {pid} has exited")]
    Gone { pid: i32 },
    #[error("pid {pid} is not the sandbox's init any more (it started at {expected}, pid {pid} now at {found:?})")]
    Replaced {
        pid: i32,
        expected: u64,
        found: Option<u64>,
    },
    #[error("pid {pid} is not a child of this process: not the init just started")]
    NotOurs { pid: i32 },
    #[error("init {pid}'s control socket {} cannot be opened inside its root (replaced or a symlink): {source}", proto::SOCKET_PATH)]
    Socket {
        pid: i32,
        #[source]
        source: nix::Error,
    },
    #[error("init {pid}'s control socket is served by pid {peer}, not by init")]
    Impostor { pid: i32, peer: i32 },
    #[error("{context} of init {pid}")]
    Io {
        pid: i32,
        context: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl HandleError {
    /// The init is dead (or its pid is another process's): the sandbox has failed.
    pub fn init_gone(&self) -> bool {
        matches!(
            self,
            HandleError::Gone { .. } | HandleError::Replaced { .. }
        )
    }
}

/// A sandbox's init: its host pid, start time and a pidfd on it.
#[derive(Debug)]
pub struct InitHandle {
    pid: i32,
    start: u64,
    pidfd: OwnedFd,
}

/// (parent pid, start time) from /proc/<pid>/stat (fields 4 and 22).
fn stat_of(pid: i32) -> Option<(i32, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest: Vec<&str> = stat[stat.rfind(')')? + 2..].split(' ').collect();
    Some((rest.get(1)?.parse().ok()?, rest.get(19)?.parse().ok()?))
}

fn pidfd_open(pid: i32) -> Result<OwnedFd, HandleError> {
    grove_sys::process::pidfd_open(pid).map_err(|e| match e.raw_os_error() {
        Some(libc::ESRCH) => HandleError::Gone { pid },
        _ => HandleError::Io {
            pid,
            context: "pidfd_open",
            source: e,
        },
    })
}

impl InitHandle {
    /// The init just started (spawned or restored by CRIU, which leaves it to us, the
    /// subreaper): it must be our child, whose pid nobody else can reap and reuse.
    pub fn open_child(pid: i32) -> Result<InitHandle, HandleError> {
        let pidfd = pidfd_open(pid)?;
        let stat = stat_of(pid);
        let h = InitHandle {
            pid,
            start: stat.map(|s| s.1).unwrap_or(0),
            pidfd,
        };
        // Alive after the read: the stat was this process's.
        match stat {
            _ if !h.alive() => Err(HandleError::Gone { pid }),
            Some((ppid, _)) if ppid == std::process::id() as i32 => Ok(h),
            Some(_) => Err(HandleError::NotOurs { pid }),
            None => Err(HandleError::Gone { pid }),
        }
    }

    /// The init of a durable record (after a restart): `pid` must still be the process that
    /// started at `start`.
    pub fn adopt(pid: i32, start: u64) -> Result<InitHandle, HandleError> {
        let pidfd = pidfd_open(pid)?;
        let found = stat_of(pid).map(|s| s.1);
        let h = InitHandle { pid, start, pidfd };
        if !h.alive() {
            return Err(HandleError::Gone { pid });
        }
        if found != Some(start) {
            return Err(HandleError::Replaced {
                pid,
                expected: start,
                found,
            });
        }
        Ok(h)
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Start time (clock ticks since boot), for the durable record.
    pub fn start(&self) -> u64 {
        self.start
    }

    pub fn pidfd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    /// Whether the init still runs (a zombie does not: its pidfd is readable once it exits).
    pub fn alive(&self) -> bool {
        let mut fds = [PollFd::new(self.pidfd.as_fd(), PollFlags::POLLIN)];
        matches!(nix::poll::poll(&mut fds, PollTimeout::ZERO), Ok(0))
    }

    fn check_alive(&self) -> Result<(), HandleError> {
        if self.alive() {
            Ok(())
        } else {
            Err(HandleError::Gone { pid: self.pid })
        }
    }

    /// Opens `/proc/<pid>/<what>` and proves it was this init's.
    pub fn open_proc(&self, what: &'static str, flags: OFlag) -> Result<OwnedFd, HandleError> {
        let path = format!("/proc/{}/{what}", self.pid);
        let fd = nix::fcntl::open(path.as_str(), flags | OFlag::O_CLOEXEC, Mode::empty());
        self.check_alive()?;
        let fd = fd.map_err(|e| HandleError::Io {
            pid: self.pid,
            context: what,
            source: e.into(),
        })?;
        // SAFETY: a fresh descriptor owned here only.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// The sandbox's root directory as its init sees it (an O_PATH dirfd).
    pub fn root(&self) -> Result<OwnedFd, HandleError> {
        self.open_proc("root", OFlag::O_PATH | OFlag::O_DIRECTORY)
    }

    /// A connection to init's control socket: resolved inside the init's root with no symlink
    /// followed, connected through the opened inode, and its peer checked to be the init.
    pub fn connect(&self) -> Result<UnixStream, HandleError> {
        let res = self.connect_unchecked();
        // Alive after the peer check: the root was its, and the peer pid still names it.
        self.check_alive()?;
        let (stream, peer) = res?;
        if peer != self.pid {
            return Err(HandleError::Impostor {
                pid: self.pid,
                peer,
            });
        }
        Ok(stream)
    }

    fn connect_unchecked(&self) -> Result<(UnixStream, i32), HandleError> {
        let pid = self.pid;
        let path = format!("/proc/{pid}/root");
        let root = nix::fcntl::open(
            path.as_str(),
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| HandleError::Io {
            pid,
            context: "open root",
            source: e.into(),
        })?;
        // SAFETY: a fresh descriptor owned here only.
        let root = unsafe { OwnedFd::from_raw_fd(root) };
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
            .resolve(
                ResolveFlag::RESOLVE_IN_ROOT
                    | ResolveFlag::RESOLVE_NO_SYMLINKS
                    | ResolveFlag::RESOLVE_NO_MAGICLINKS,
            );
        let sock = nix::fcntl::openat2(
            root.as_raw_fd(),
            proto::SOCKET_PATH.trim_start_matches('/'),
            how,
        )
        .map_err(|source| HandleError::Socket { pid, source })?;
        // SAFETY: a fresh descriptor owned here only.
        let sock = unsafe { OwnedFd::from_raw_fd(sock) };
        let stream =
            UnixStream::connect(format!("/proc/self/fd/{}", sock.as_raw_fd())).map_err(|e| {
                HandleError::Socket {
                    pid,
                    source: nix::Error::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
                }
            })?;
        let cred = getsockopt(&stream, PeerCredentials).map_err(|e| HandleError::Io {
            pid,
            context: "SO_PEERCRED on the control socket",
            source: e.into(),
        })?;
        Ok((stream, cred.pid()))
    }

    /// SIGKILL through the pidfd (never another process with a reused pid).
    pub fn kill(&self) {
        let _ = grove_sys::process::pidfd_send_signal(self.pidfd.as_fd(), libc::SIGKILL);
    }

    /// Waits for the init to exit and reaps it if it is our child (ECHILD otherwise).
    pub fn reap(&self) {
        let _ = nix::sys::wait::waitid(
            nix::sys::wait::Id::PIDFd(self.pidfd.as_fd()),
            nix::sys::wait::WaitPidFlag::WEXITED,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_of_self_is_stable_and_of_nothing_is_none() {
        let me = std::process::id() as i32;
        let (ppid, t) = stat_of(me).expect("own stat");
        assert_eq!(ppid, nix::unistd::getppid().as_raw());
        assert_eq!(stat_of(me).map(|s| s.1), Some(t));
        assert_eq!(stat_of(i32::MAX), None);
    }

    #[test]
    fn a_child_is_ours_alive_then_gone_and_a_stranger_is_not() {
        let mut child = std::process::Command::new("sleep")
            .arg("100")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let h = InitHandle::open_child(pid).unwrap();
        assert!(h.alive());
        let again = InitHandle::adopt(pid, h.start()).unwrap();
        assert!(matches!(
            InitHandle::adopt(pid, h.start() + 1),
            Err(HandleError::Replaced { .. })
        ));
        assert!(h.root().is_ok());
        h.kill();
        h.reap();
        assert!(!again.alive());
        assert!(matches!(h.root(), Err(HandleError::Gone { .. })));
        assert!(matches!(h.connect(), Err(HandleError::Gone { .. })));
        assert!(child.wait().is_err(), "reaped through the pidfd already");
        // Pid 1 runs but is not our child.
        assert!(matches!(
            InitHandle::open_child(1),
            Err(HandleError::NotOurs { .. })
        ));
    }
}
