//! The raw system calls of dirty-page tracking, one place for their unsafe blocks: the ptrace
//! requests (the workspace builds `nix` without its `ptrace` feature), the injecting process's
//! fork(2), _exit(2) and waitpid(2), waitid(2), pidfd_getfd(2),
//! userfaultfd(2) and its ioctls, and the PAGEMAP_SCAN ioctl. The uffd and PAGEMAP_SCAN structs
//! are declared here by hand: Debian 12's headers and the `libc` crate (0.2.191) predate
//! PAGEMAP_SCAN (Linux 6.7) and have no userfaultfd types.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

// ---- userfaultfd: <linux/userfaultfd.h> ----

/// userfaultfd(2) flag: handle faults from user mode only; needs no CAP_SYS_PTRACE even with
/// vm.unprivileged_userfaultfd=0. Write-protect-async faults never reach the handler anyway.
pub(super) const UFFD_USER_MODE_ONLY: i32 = 1;
const UFFD_API: u64 = 0xAA;
/// Write-protect also none ptes (anonymous memory): without it PAGEMAP_SCAN does not treat an
/// anonymous VMA as write-protectable (`userfaultfd_wp_use_markers`). WP_ASYNC implies it.
pub(super) const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
/// A write to a write-protected page resolves in the kernel (clears the pte's uffd-wp bit) and
/// never waits for a handler.
pub(super) const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
pub(super) const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

const UFFDIO_API: libc::Ioctl =
    nix::request_code_readwrite!(0xAA, 0x3F, std::mem::size_of::<UffdioApi>());
const UFFDIO_REGISTER: libc::Ioctl =
    nix::request_code_readwrite!(0xAA, 0x00, std::mem::size_of::<UffdioRegister>());

// ---- PAGEMAP_SCAN: <linux/fs.h> (Linux 6.7) ----

pub(super) const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
pub(super) const PAGE_IS_WPALLOWED: u64 = 1 << 0;
pub(super) const PAGE_IS_WRITTEN: u64 = 1 << 1;
pub(super) const PAGE_IS_PRESENT: u64 = 1 << 3;
pub(super) const PAGE_IS_SWAPPED: u64 = 1 << 4;

/// One run of pages with the same categories, as PAGEMAP_SCAN reports it (`struct page_region`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PageRegion {
    pub(crate) start: u64,
    /// Exclusive.
    pub(crate) end: u64,
    pub(crate) categories: u64,
}

#[repr(C)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

const _: () = assert!(std::mem::size_of::<UffdioApi>() == 24);
const _: () = assert!(std::mem::size_of::<UffdioRegister>() == 32);
const _: () = assert!(std::mem::size_of::<PageRegion>() == 24);
const _: () = assert!(std::mem::size_of::<PmScanArg>() == 96);

const PAGEMAP_SCAN: libc::Ioctl =
    nix::request_code_readwrite!(b'f', 16, std::mem::size_of::<PmScanArg>());

/// What one PAGEMAP_SCAN call asks for (the kernel's `struct pm_scan_arg` less the buffer).
#[derive(Clone, Copy, Debug)]
pub(super) struct ScanArgs {
    pub(super) flags: u64,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) category_mask: u64,
    pub(super) category_anyof_mask: u64,
    pub(super) return_mask: u64,
}

/// ioctl(PAGEMAP_SCAN) on an open `/proc/<pid>/pagemap`: fills the front of `out` and returns
/// how many regions it filled and the `walk_end` the kernel wrote back.
pub(super) fn pagemap_scan(
    pagemap: BorrowedFd<'_>,
    args: &ScanArgs,
    out: &mut [PageRegion],
) -> io::Result<(usize, u64)> {
    let mut arg = PmScanArg {
        size: std::mem::size_of::<PmScanArg>() as u64,
        flags: args.flags,
        start: args.start,
        end: args.end,
        walk_end: 0,
        vec: out.as_mut_ptr() as u64,
        vec_len: out.len() as u64,
        max_pages: 0,
        category_inverted: 0,
        category_mask: args.category_mask,
        category_anyof_mask: args.category_anyof_mask,
        return_mask: args.return_mask,
    };
    // SAFETY: `arg` is a pm_scan_arg of the size it declares; its `vec` points to `out`, which is
    // writable for `vec_len` page_regions (the kernel writes at most that many) and outlives the
    // call. The kernel writes back only `walk_end` inside `arg`.
    let n = unsafe {
        libc::ioctl(
            pagemap.as_raw_fd(),
            PAGEMAP_SCAN,
            &mut arg as *mut PmScanArg,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((n as usize, arg.walk_end))
}

/// userfaultfd(2) in this process.
pub(super) fn userfaultfd(flags: i32) -> io::Result<OwnedFd> {
    // SAFETY: userfaultfd(2) takes one integer; the result is checked before it is owned.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, owned here only.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// UFFDIO_API handshake asking for `features`; returns the features the kernel reports.
pub(super) fn uffdio_api(uffd: BorrowedFd<'_>, features: u64) -> io::Result<u64> {
    let mut api = UffdioApi {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    // SAFETY: `api` is a valid, writable uffdio_api for the duration of the call.
    let rc = unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_API, &mut api as *mut UffdioApi) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(api.features)
}

/// UFFDIO_REGISTER of `[start, start + len)` in the uffd's mm (the process that created it,
/// whoever makes this call) with `mode`.
pub(super) fn uffdio_register(
    uffd: BorrowedFd<'_>,
    start: u64,
    len: u64,
    mode: u64,
) -> io::Result<()> {
    let mut reg = UffdioRegister {
        start,
        len,
        mode,
        ioctls: 0,
    };
    // SAFETY: `reg` is a valid, writable uffdio_register for the duration of the call; the range
    // is only a number to the kernel, which checks it against the uffd's mm.
    let rc = unsafe {
        libc::ioctl(
            uffd.as_raw_fd(),
            UFFDIO_REGISTER,
            &mut reg as *mut UffdioRegister,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// pidfd_getfd(2): a duplicate, in this process, of descriptor `fd` of the process of `pidfd`.
pub(super) fn pidfd_getfd(pidfd: BorrowedFd<'_>, fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: integers and an open pidfd; the result is checked before it is owned.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor, owned here only.
    Ok(unsafe { OwnedFd::from_raw_fd(r as RawFd) })
}

/// Where the kernel mapped this process's vDSO (getauxval(AT_SYSINFO_EHDR)); 0 if none.
pub(super) fn own_vdso_base() -> u64 {
    // SAFETY: getauxval(3) reads this process's auxiliary vector; it takes and returns integers.
    unsafe { libc::getauxval(libc::AT_SYSINFO_EHDR) }
}

// ---- the injecting process ----

/// fork(2): 0 in the child, the child's pid in the parent. The child of this multithreaded
/// process has only the calling thread: it must take no lock another thread may have held (see
/// `inject`'s module doc for what it does) and leave with [`exit_now`].
pub(super) fn fork() -> io::Result<i32> {
    // SAFETY: fork(2) takes no arguments; the child's restrictions are its caller's to keep.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(pid)
}

/// Closes every descriptor from 3 up but those in `keep` (close_range(2)): a forked child
/// keeps none of groved's (its instance lock, its listening sockets, other processes' uffds).
pub(super) fn close_all_but(keep: &[RawFd]) {
    let mut keep: Vec<u32> = keep
        .iter()
        .filter(|&&f| f >= 3)
        .map(|&f| f as u32)
        .collect();
    keep.sort_unstable();
    let mut from = 3u32;
    for k in keep {
        if k > from {
            // SAFETY: close_range(2) takes integers; descriptors in the range are closed.
            unsafe { libc::syscall(libc::SYS_close_range, from, k - 1, 0) };
        }
        from = k + 1;
    }
    // SAFETY: as above, up to the highest descriptor.
    unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, 0) };
}

/// _exit(2) from a forked child: no atexit handlers, no destructors of the parent's state.
pub(super) fn exit_now() -> ! {
    // SAFETY: _exit(2) ends the process at once; nothing runs after it.
    unsafe { libc::_exit(0) }
}

/// Waits for child `pid` to end (EINTR retried; a child someone else reaped is fine).
pub(super) fn reap(pid: i32) {
    loop {
        // SAFETY: waitpid(2) of our own child, status not wanted (a null pointer is allowed).
        let r = unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
        if r >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return;
        }
    }
}

// ---- ptrace(2) ----

/// The tracee's general registers (x86_64 `struct user_regs_struct`).
pub(super) type Regs = libc::user_regs_struct;

/// A ptrace request whose `addr` and `data` are integers, never pointers.
fn ptrace_int(request: libc::c_uint, tid: i32, addr: usize, data: usize) -> io::Result<()> {
    // SAFETY: every caller passes a request that reads `addr` and `data` as integers (a signal,
    // option bits, or nothing), so no memory is passed to the kernel.
    let rc = unsafe { libc::ptrace(request, tid, addr, data) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// PTRACE_SEIZE with `options`: attach without stopping the task.
pub(super) fn seize(tid: i32, options: i32) -> io::Result<()> {
    ptrace_int(libc::PTRACE_SEIZE, tid, 0, options as usize)
}

/// PTRACE_INTERRUPT: make a seized task enter a ptrace stop (PTRACE_EVENT_STOP).
pub(super) fn interrupt(tid: i32) -> io::Result<()> {
    ptrace_int(libc::PTRACE_INTERRUPT, tid, 0, 0)
}

/// PTRACE_SYSCALL: resume, stopping at the next syscall entry or exit; `sig` is delivered if the
/// task is in a signal-delivery-stop (0: none).
pub(super) fn resume_syscall(tid: i32, sig: i32) -> io::Result<()> {
    ptrace_int(libc::PTRACE_SYSCALL, tid, 0, sig as usize)
}

/// PTRACE_CONT with `sig` (0: none).
pub(super) fn resume_cont(tid: i32, sig: i32) -> io::Result<()> {
    ptrace_int(libc::PTRACE_CONT, tid, 0, sig as usize)
}

/// PTRACE_DETACH with `sig` (0: none).
pub(super) fn detach(tid: i32, sig: i32) -> io::Result<()> {
    ptrace_int(libc::PTRACE_DETACH, tid, 0, sig as usize)
}

/// PTRACE_GETREGS.
pub(super) fn get_regs(tid: i32) -> io::Result<Regs> {
    let mut regs = std::mem::MaybeUninit::<Regs>::zeroed();
    // SAFETY: PTRACE_GETREGS writes one user_regs_struct to `data`, which points to one.
    let rc = unsafe { libc::ptrace(libc::PTRACE_GETREGS, tid, 0usize, regs.as_mut_ptr()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: zero-initialised (a valid value for this plain-integer struct), then filled.
    Ok(unsafe { regs.assume_init() })
}

/// PTRACE_SETREGS.
pub(super) fn set_regs(tid: i32, regs: &Regs) -> io::Result<()> {
    // SAFETY: PTRACE_SETREGS reads one user_regs_struct from `data`, which points to one.
    let rc = unsafe { libc::ptrace(libc::PTRACE_SETREGS, tid, 0usize, regs as *const Regs) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The kernel's sigset_t: 64 signals on x86_64 (glibc's `sigset_t` is larger and is not what
/// PTRACE_[GS]ETSIGMASK take).
const KERNEL_SIGSET_SIZE: usize = 8;

/// PTRACE_GETSIGMASK: the task's blocked signals (the saved mask, if a ppoll/pselect-style
/// syscall has a temporary one installed).
pub(super) fn get_sigmask(tid: i32) -> io::Result<u64> {
    let mut mask = 0u64;
    // SAFETY: PTRACE_GETSIGMASK writes `addr` (8) bytes to `data`, which points to a u64.
    let rc = unsafe {
        libc::ptrace(
            libc::PTRACE_GETSIGMASK,
            tid,
            KERNEL_SIGSET_SIZE,
            &mut mask as *mut u64,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(mask)
}

/// PTRACE_SETSIGMASK (SIGKILL and SIGSTOP stay unblocked whatever `mask` says).
pub(super) fn set_sigmask(tid: i32, mask: u64) -> io::Result<()> {
    // SAFETY: PTRACE_SETSIGMASK reads `addr` (8) bytes from `data`, which points to a u64.
    let rc = unsafe {
        libc::ptrace(
            libc::PTRACE_SETSIGMASK,
            tid,
            KERNEL_SIGSET_SIZE,
            &mask as *const u64,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

// ---- waitid(2) ----

/// What waitid(2) reported for one task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WaitEvent {
    /// A ptrace stop; `status` is the kernel's exit_code: the signal in the low byte, a
    /// PTRACE_EVENT_* in the next (what waitpid's status shows shifted by 8).
    Stopped { status: i32 },
    /// Exited, killed or dumped core.
    Exited,
    /// Nothing to report (WNOHANG).
    Nothing,
}

fn waitid(tid: i32, options: i32) -> io::Result<WaitEvent> {
    loop {
        let mut info = std::mem::MaybeUninit::<libc::siginfo_t>::zeroed();
        // SAFETY: waitid(2) writes one siginfo_t to `infop`, which points to one (zeroed, so
        // si_pid reads 0 when WNOHANG finds nothing, as the man page documents).
        let rc =
            unsafe { libc::waitid(libc::P_PID, tid as libc::id_t, info.as_mut_ptr(), options) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        // SAFETY: zero-initialised, then filled by the kernel.
        let info = unsafe { info.assume_init() };
        // SAFETY: for SIGCHLD-style results (what waitid returns) si_pid and si_status are the
        // fields the kernel filled.
        let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
        if pid == 0 {
            return Ok(WaitEvent::Nothing);
        }
        return Ok(match info.si_code {
            libc::CLD_TRAPPED | libc::CLD_STOPPED => WaitEvent::Stopped { status },
            _ => WaitEvent::Exited,
        });
    }
}

/// Blocks until task `tid` (a tracee of this thread) has something to report, and says what,
/// without consuming it (WNOWAIT).
pub(super) fn wait_peek(tid: i32) -> io::Result<WaitEvent> {
    waitid(
        tid,
        libc::WEXITED | libc::WSTOPPED | libc::__WALL | libc::WNOWAIT,
    )
}

/// Consumes a pending ptrace stop of `tid`, never an exit.
pub(super) fn wait_take_stop(tid: i32) -> io::Result<WaitEvent> {
    waitid(tid, libc::WSTOPPED | libc::__WALL | libc::WNOHANG)
}

/// Consumes the exit of `tid` (a tracee this process is not the parent of: this ends the ptrace
/// link and lets the kernel notify the real parent).
pub(super) fn wait_take_exit(tid: i32) -> io::Result<WaitEvent> {
    waitid(tid, libc::WEXITED | libc::__WALL | libc::WNOHANG)
}

// ---- the probe's own page ----
