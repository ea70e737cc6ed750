//! CPU priority of single tasks.
//!
//! Linux keeps the nice value per thread, and a thread or process cloned from a thread starts
//! with that thread's: a thread that builds in the background can yield the CPU to the
//! foreground, and what it starts yields with it until its nice value is set back.

use std::io;

/// The nice value of work that finishes a snapshot in the background (storing its images in
/// grove-fsd, making incremental ones whole in groved): it yields the CPU to the sandboxes'
/// own requests and to the next snapshot's frozen dump.
pub const BACKGROUND_NICE: i32 = 10;

/// Gives the calling thread [`BACKGROUND_NICE`]. Refused (a thread already nicer, without
/// CAP_SYS_NICE), it keeps its own: only the order of work changes, so callers may ignore it.
pub fn into_background() -> io::Result<()> {
    set_nice(0, BACKGROUND_NICE)
}

/// Sets the nice value of task `tid` (0: the calling thread). Lowering it needs CAP_SYS_NICE.
pub fn set_nice(tid: i32, nice: i32) -> io::Result<()> {
    let who = libc::id_t::try_from(tid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: setpriority(2) with plain integers; at worst the task is gone (ESRCH).
    if unsafe { libc::setpriority(libc::PRIO_PROCESS as _, who, nice) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets the nice value of every process in the group `pgid`; at worst the group is gone (ESRCH).
pub fn set_group_nice(pgid: u32, nice: i32) -> io::Result<()> {
    // SAFETY: setpriority(2) with plain integers.
    if unsafe { libc::setpriority(libc::PRIO_PGRP as _, pgid, nice) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The nice value of task `tid` (0: the calling thread).
pub fn nice(tid: i32) -> io::Result<i32> {
    let who = libc::id_t::try_from(tid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    // -1 is a nice value too: errno tells it from a failure.
    // SAFETY: errno is this thread's; clearing it is always allowed.
    unsafe { *libc::__errno_location() = 0 };
    // SAFETY: getpriority(2) with plain integers.
    let n = unsafe { libc::getpriority(libc::PRIO_PROCESS as _, who) };
    if n == -1 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(0) {
            return Err(e);
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_niced_alone_and_what_it_starts_inherits_it() {
        let ours = nice(0).unwrap();
        let (theirs, child) = std::thread::spawn(|| {
            set_nice(0, 19).unwrap();
            let child = std::thread::spawn(|| nice(0).unwrap()).join().unwrap();
            (nice(0).unwrap(), child)
        })
        .join()
        .unwrap();
        assert_eq!((theirs, child), (19, 19));
        assert_eq!(nice(0).unwrap(), ours, "the other threads keep theirs");
        assert!(set_nice(i32::MAX, 0).is_err(), "no such task");
    }
}
