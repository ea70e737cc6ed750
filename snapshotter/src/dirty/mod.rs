//! Dirty-page tracking without soft-dirty: which pages each process of a sandbox wrote since
//! the last snapshot, tracked from outside it with userfaultfd write-protect (async) and read with
//! PAGEMAP_SCAN.
//!
//! Why: this kernel has no `CONFIG_MEM_SOFT_DIRTY`, so CRIU cannot dump incrementally by itself.
//! userfaultfd's WP_ASYNC mode gives the same information: a write to a write-protected page is
//! resolved by the kernel alone (`do_wp_page` clears the pte's uffd-wp bit, no handler runs, so
//! writes the kernel makes for the process, read(2) into a buffer say, count too), and
//! PAGEMAP_SCAN reports every pte without that bit as PAGE_IS_WRITTEN.
//!
//! How: [`register`] makes the process open a userfaultfd (the call is injected with ptrace,
//! since the sandbox's seccomp filter denies it; see `inject`), takes the fd with
//! pidfd_getfd(2), closes it in the process again (CRIU cannot dump a task holding a uffd), and
//! registers every VMA for write-protect with `UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED`
//! from groved. [`Registration::arm`], run while the sandbox is frozen right after each dump,
//! write-protects every written page again with one PAGEMAP_SCAN + PM_SCAN_WP_MATCHING; pages
//! written after it read PAGE_IS_WRITTEN. Holes are left alone: the first touch of one makes a pte
//! without the uffd-wp bit, which reads written.
//!
//! Why it is safe (errs towards "written", never towards "clean"), as checked in Linux's source
//! (fs/proc/task_mmu.c, fs/userfaultfd.c, mm/userfaultfd.c, mm/memory.c; 6.7 onwards) and by
//! the tests here on 6.18:
//! - `pagemap_page_category` / `pagemap_thp_category` set PAGE_IS_WRITTEN for every present or
//!   swapped pte without the uffd-wp bit, whatever its VMA: memory never registered (a new
//!   mapping, a forked child, a process never registered) reads written.
//! - Only registered VMAs get uffd-wp bits: `pagemap_scan_test_walk` skips, under
//!   PM_SCAN_WP_MATCHING, every VMA that is not WP-async with markers (-EPERM instead only with
//!   PM_SCAN_CHECK_WPASYNC); fork clears the bit in a child whose VMA is not registered
//!   (`__copy_present_ptes`, `copy_nonpresent_pte`, `copy_huge_pmd`; a test checks it).
//! - Closing the uffd (dropping the [`Registration`]) unregisters every VMA and clears the bits
//!   (`userfaultfd_release_all` → `userfaultfd_clear_vma` → `uffd_wp_range(.., false)`). Every
//!   uffd here is close-on-exec; a child forked (not exec'd) from groved would keep one open,
//!   and the registration with it.
//! - A page written and then zapped (MADV_DONTNEED) is not present: it is a hole (zeroes), which
//!   a dump records as such.
//!
//! The ptrace injection and its own safety argument are in `inject`; the raw calls in `sys`.

#[cfg(target_arch = "x86_64")]
mod inject;
mod sys;
mod uffd;

#[cfg(test)]
mod tests;

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

pub(crate) use uffd::{register, supported, Registration};

/// Dirty-page tracking cannot work in this process or on this kernel.
#[derive(Clone, Debug, thiserror::Error)]
#[error("dirty-page tracking unsupported: {reason}")]
pub(crate) struct Unsupported {
    reason: String,
}

/// Why a process could not be registered, armed or scanned; every variant names the pid and the
/// step.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TrackError {
    #[error(transparent)]
    Unsupported(#[from] Unsupported),
    /// The process exited (before or while it was being registered or scanned).
    #[error("pid {pid}: the process is gone")]
    Exited { pid: i32 },
    /// A zombie or a kernel thread: no memory to track.
    #[error("pid {pid}: no memory to track (state {state})")]
    NoMm { pid: i32, state: char },
    #[error("pid {pid}: reading /proc/{pid}/{what}")]
    Proc {
        pid: i32,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    /// seize/inject: a ptrace request or wait failed.
    #[error("pid {pid}: seize/inject: {request} on thread {tid}")]
    Ptrace {
        pid: i32,
        tid: i32,
        request: &'static str,
        #[source]
        source: io::Error,
    },
    /// inject: the target did not reach a ptrace stop in time (frozen by a v1 freezer cgroup, in
    /// an uninterruptible sleep); the injection finishes on its own once it does.
    #[error("pid {pid}: inject: no ptrace stop within {after:?}")]
    TimedOut {
        pid: i32,
        after: std::time::Duration,
    },
    /// inject: the target stopped or ran in a way the injection does not expect.
    #[error("pid {pid}: inject: {what}")]
    Unexpected { pid: i32, what: String },
    /// inject: a system call run in the target failed there.
    #[error("pid {pid}: inject: {call} in the process")]
    Injected {
        pid: i32,
        call: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("pid {pid}: getfd: pidfd_getfd of its fd {fd}")]
    GetFd {
        pid: i32,
        fd: i32,
        #[source]
        source: io::Error,
    },
    #[error("pid {pid}: api: UFFDIO_API")]
    Api {
        pid: i32,
        #[source]
        source: io::Error,
    },
    #[error("pid {pid}: api: features {granted:#x} granted, {missing:#x} missing")]
    ApiFeatures {
        pid: i32,
        granted: u64,
        missing: u64,
    },
    #[error("pid {pid}: register: UFFDIO_REGISTER of {start:#x}-{end:#x}")]
    Register {
        pid: i32,
        start: u64,
        end: u64,
        #[source]
        source: io::Error,
    },
    #[error("pid {pid}: scan: PAGEMAP_SCAN")]
    Scan {
        pid: i32,
        #[source]
        source: io::Error,
    },
}

/// Whether the process of `pidfd` is alive: a pidfd polls readable once its process exited.
fn pidfd_alive(pidfd: BorrowedFd<'_>) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut fds = [PollFd::new(pidfd, PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::ZERO) {
        Ok(0) => true,
        Ok(_) => false,
        // Cannot tell: say gone, the safe answer for a caller about to trust the pid.
        Err(_) => {
            tracing::warn!(fd = pidfd.as_raw_fd(), "poll of a pidfd failed");
            false
        }
    }
}
