//! Pseudo-terminals for processes started by init: the pair is made in the sandbox's own devpts
//! instance, the child takes the slave as its controlling terminal, init keeps the master.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use nix::fcntl::{FcntlArg, FdFlag, OFlag};

use super::Failure;
use crate::proto::InitErrorKind::{Other, Spawn};
use crate::proto::PtySize;

pub struct Pair {
    pub master: OwnedFd,
    pub slave: OwnedFd,
}

fn winsize(size: PtySize) -> libc::winsize {
    libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

/// Opens a pair of the given size; both ends close on exec (the child dups the slave onto 0-2).
pub fn open(size: PtySize) -> Result<Pair, Failure> {
    let ws = winsize(size);
    let p = nix::pty::openpty(Some(&ws), None).map_err(|e| Failure::errno(Spawn, "openpty", e))?;
    for fd in [&p.master, &p.slave] {
        nix::fcntl::fcntl(fd.as_raw_fd(), FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))
            .map_err(|e| Failure::errno(Spawn, "pty cloexec", e))?;
    }
    nix::fcntl::fcntl(p.master.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK))
        .map_err(|e| Failure::errno(Spawn, "pty nonblocking", e))?;
    Ok(Pair {
        master: p.master,
        slave: p.slave,
    })
}

/// Sets the terminal size (the kernel sends SIGWINCH to the foreground group).
pub fn resize(master: &OwnedFd, size: PtySize) -> Result<(), Failure> {
    let ws = winsize(size);
    crate::sys::set_winsize(master.as_fd(), &ws)
        .map_err(|e| Failure::new(Other, format!("resize: {}", std::io::Error::from(e))))
}

/// In the forked child after setsid(): the slave becomes the controlling terminal and stdio.
pub fn attach_child(slave: RawFd) -> Result<(), Failure> {
    if let Err(e) = crate::sys::set_controlling_tty(slave) {
        let e = std::io::Error::from(e);
        return Err(Failure::new(Spawn, format!("controlling tty: {e}")));
    }
    for to in 0..=2 {
        nix::unistd::dup2(slave, to).map_err(|e| Failure::errno(Spawn, "dup2 pty", e))?;
    }
    Ok(())
}
