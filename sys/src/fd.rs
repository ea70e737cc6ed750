//! File descriptors.

/// Closes every descriptor numbered `from` or above. Async-signal-safe: for a child between fork
/// and exec, or a process that has just started. Whatever still holds one of those descriptors
/// (an `OwnedFd`, a `File`) must not use it afterwards: call it only where nothing does.
pub fn close_from(from: u32) {
    // SAFETY: close_range(2) takes plain integers and touches no memory of ours; the callers
    // own every descriptor in the range (see above).
    unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, 0u32) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// In a forked child, so the test binary's own descriptors stay open.
    #[test]
    fn closes_what_is_at_and_above_the_bound() {
        let f = std::fs::File::open("/dev/null").unwrap();
        let fd = f.as_raw_fd();
        // SAFETY: the child runs only async-signal-safe calls and leaves with _exit.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                close_from(fd as u32);
                let closed = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFD).is_err();
                crate::process::exit_now(if closed { 0 } else { 1 });
            }
            nix::unistd::ForkResult::Parent { child } => {
                let st = nix::sys::wait::waitpid(child, None).unwrap();
                assert_eq!(st, nix::sys::wait::WaitStatus::Exited(child, 0));
            }
        }
        drop(f);
    }
}
