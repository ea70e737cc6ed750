//! Processes: leaving a forked child, and pidfds (a handle on one process that a reused pid
//! cannot redirect).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Ends the calling process at once: no exit handlers, no flushing. For a forked child, whose
/// handlers and buffers are copies of the parent's. Async-signal-safe.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit(2) takes an integer and does not return; it runs none of this process's
    // code, so nothing observes a half-done state.
    unsafe { libc::_exit(code) }
}

/// pidfd_open(2): a descriptor for process `pid`. ESRCH: there is none.
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) takes two integers; the result is checked before it is owned.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, owned here only.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// pidfd_send_signal(2) with no siginfo: signal `sig` to the process of `pidfd`, never to one
/// that reused its pid.
pub fn pidfd_send_signal(pidfd: BorrowedFd<'_>, sig: i32) -> io::Result<()> {
    // SAFETY: integers, an open pidfd and a null siginfo (the kernel fills in a default one).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_pidfd_signals_its_process_and_a_missing_pid_is_esrch() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let fd = pidfd_open(child.id() as i32).unwrap();
        pidfd_send_signal(fd.as_fd(), libc::SIGKILL).unwrap();
        let st = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(st.signal(), Some(libc::SIGKILL));
        let e = pidfd_open(i32::MAX).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESRCH));
    }
}
