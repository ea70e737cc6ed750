//! Real processes, real kernel: a forked child that denies itself userfaultfd with seccomp (as a
//! sandbox does), serves commands over a pipe (write page N, mmap, madvise, fork, ...) using raw
//! system calls only, and is registered, armed and scanned from this process.

use std::collections::BTreeSet;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use super::sys::{PAGE_IS_PRESENT, PAGE_IS_SWAPPED, PAGE_IS_WPALLOWED, PAGE_IS_WRITTEN};
use super::uffd::page_regions;
use super::*;

const PAGE: u64 = 4096;

const OP_WRITE: u64 = 1;
const OP_MMAP: u64 = 2;
const OP_DONTNEED: u64 = 3;
const OP_FORK: u64 = 4;
const OP_READ: u64 = 5;
const OP_SLEEP: u64 = 6;
const OP_EXIT: u64 = 7;
const OP_SIGNALS: u64 = 8;
const OP_KERNEL_WRITE: u64 = 9;

/// SIGUSR1s the child's handler has run (the child's own copy of this static).
static SIGNALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

extern "C" fn on_usr1(_: libc::c_int) {
    SIGNALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

fn root() -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    grove_testkit::capability_missing("needs root (CAP_SYS_ADMIN, CAP_SYS_PTRACE)");
    false
}

/// A forked child running `child_main`.
struct Child {
    pid: i32,
    cmd: OwnedFd,
    resp: OwnedFd,
    /// Its region of `len` bytes, every page written once before it reported ready.
    base: u64,
    len: u64,
    others: Vec<i32>,
}

/// seccomp: userfaultfd(2) → EPERM, everything else allowed.
fn deny_userfaultfd() -> Vec<libc::sock_filter> {
    const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
    let stmt = |code: u32, k: u32| libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    let jeq = |k: u32, jt: u8, jf: u8| libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf,
        k,
    };
    vec![
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 4), // arch
        jeq(AUDIT_ARCH_X86_64, 0, 3),
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0), // nr
        jeq(libc::SYS_userfaultfd as u32, 0, 1),
        stmt(
            libc::BPF_RET | libc::BPF_K,
            libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
        ),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
    ]
}

fn write_all_raw(fd: RawFd, buf: &[u8]) -> bool {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: write(2) from a live slice's remaining bytes.
        let n = unsafe { libc::write(fd, buf[done..].as_ptr().cast(), buf.len() - done) };
        if n < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return false;
        }
        done += n as usize;
    }
    true
}

/// Reads exactly `buf.len()` bytes; counts the EINTRs the program would see (it must see none).
fn read_exact_raw(fd: RawFd, buf: &mut [u8], eintr: &mut u64) -> bool {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: read(2) into a live slice's remaining bytes.
        let n = unsafe { libc::read(fd, buf[done..].as_mut_ptr().cast(), buf.len() - done) };
        if n < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                *eintr += 1;
                continue;
            }
            return false;
        }
        if n == 0 {
            return false;
        }
        done += n as usize;
    }
    true
}

/// The child: raw system calls only (it was forked from a multithreaded test process, so no
/// allocation, no locks), then `_exit`.
fn child_main(cmd: RawFd, resp: RawFd, len: usize, prog: &libc::sock_fprog) -> ! {
    let exit = grove_sys::process::exit_now;
    // Descriptors inherited from the test process (a userfaultfd another test holds, say) would
    // keep that uffd alive past its Registration's drop and show in this child's fd table:
    // close all but the two pipes.
    let (lo, hi) = (cmd.min(resp) as u32, cmd.max(resp) as u32);
    for (first, last) in [
        (3, lo.wrapping_sub(1)),
        (lo + 1, hi - 1),
        (hi + 1, u32::MAX),
    ] {
        if first <= last {
            // SAFETY: close_range(2) with integers; this process uses none of those descriptors.
            unsafe { libc::syscall(libc::SYS_close_range, first, last, 0) };
        }
    }
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        exit(10);
    }
    // SAFETY: seccomp(2) reads the filter program `prog` points to, valid for this call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0,
            prog as *const libc::sock_fprog,
        )
    };
    if rc != 0 {
        exit(11);
    }
    // SAFETY: userfaultfd(2) with an integer flag; a descriptor it might return is left open.
    let r = unsafe { libc::syscall(libc::SYS_userfaultfd, super::sys::UFFD_USER_MODE_ONLY) };
    if r >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EPERM) {
        exit(12);
    }
    // A SIGUSR1 handler with SA_RESTART: a signal must never surface as EINTR, and a handler
    // frame built on injected registers would crash the child.
    // SAFETY: sigaction(2) with a zeroed struct naming a handler that only bumps an atomic.
    let rc = unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_usr1 as extern "C" fn(libc::c_int) as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut())
    };
    if rc != 0 {
        exit(16);
    }
    // SAFETY: a fresh private anonymous mapping.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        exit(13);
    }
    for off in (0..len).step_by(PAGE as usize) {
        // SAFETY: inside the mapping just made.
        unsafe { std::ptr::write_volatile((base as *mut u8).add(off), 1) };
    }
    let mut eintr = 0u64;
    let reply = |value: u64, eintr: u64| {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&value.to_ne_bytes());
        out[8..].copy_from_slice(&eintr.to_ne_bytes());
        if !write_all_raw(resp, &out) {
            exit(14);
        }
    };
    reply(base as u64, eintr);
    loop {
        let mut msg = [0u8; 24];
        if !read_exact_raw(cmd, &mut msg, &mut eintr) {
            exit(if eintr == 0 { 0 } else { 3 });
        }
        let word = |i: usize| u64::from_ne_bytes(msg[i * 8..i * 8 + 8].try_into().unwrap());
        let (op, a, b) = (word(0), word(1), word(2));
        let value = match op {
            OP_WRITE => {
                // SAFETY: the test sends addresses of pages this process has mapped writable.
                unsafe { std::ptr::write_volatile(a as *mut u8, b as u8) };
                0
            }
            OP_READ => {
                // SAFETY: the test sends addresses of pages this process has mapped.
                u64::from(unsafe { std::ptr::read_volatile(a as *const u8) })
            }
            OP_MMAP => {
                // SAFETY: a fresh private anonymous mapping.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        a as usize,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    )
                };
                p as u64
            }
            OP_DONTNEED => {
                // SAFETY: madvise(2) on a range of this process's own mapping.
                let rc = unsafe {
                    libc::madvise(a as *mut libc::c_void, b as usize, libc::MADV_DONTNEED)
                };
                rc as u64
            }
            OP_FORK => {
                // SAFETY: the grandchild only pauses until it is killed.
                let p = unsafe { libc::fork() };
                if p == 0 {
                    loop {
                        // SAFETY: pause(2) takes nothing.
                        unsafe { libc::pause() };
                    }
                }
                p as u64
            }
            OP_SLEEP => {
                let mut ts = libc::timespec {
                    tv_sec: (a / 1000) as libc::time_t,
                    tv_nsec: ((a % 1000) * 1_000_000) as libc::c_long,
                };
                // nanosleep(2) restarts through restart_syscall (ERESTART_RESTARTBLOCK) after a
                // stop, with the time left; an injection must not turn that into an early return.
                loop {
                    let mut rem = libc::timespec {
                        tv_sec: 0,
                        tv_nsec: 0,
                    };
                    // SAFETY: nanosleep(2) reads `ts` and writes `rem`, both live.
                    if unsafe { libc::nanosleep(&ts, &mut rem) } == 0 {
                        break 0;
                    }
                    if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                        break u64::MAX;
                    }
                    eintr += 1;
                    ts = rem;
                }
            }
            OP_SIGNALS => SIGNALS.load(std::sync::atomic::Ordering::Relaxed),
            OP_KERNEL_WRITE => {
                // The kernel writes the page (copy_to_user in read(2)), not user code.
                let mut p = [0 as libc::c_int; 2];
                // SAFETY: pipe(2) fills the two-int array; write(2) from and read(2) into live
                // memory (the test sends the address of a page this process has mapped
                // writable); close(2) of the two descriptors just made.
                unsafe {
                    if libc::pipe(p.as_mut_ptr()) != 0 {
                        exit(17);
                    }
                    let byte = 0x5au8;
                    libc::write(p[1], (&byte as *const u8).cast(), 1);
                    let n = libc::read(p[0], a as *mut libc::c_void, 1);
                    libc::close(p[0]);
                    libc::close(p[1]);
                    n as u64
                }
            }
            OP_EXIT => exit(if eintr == 0 { 0 } else { 3 }),
            _ => exit(15),
        };
        reply(value, eintr);
    }
}

impl Child {
    fn spawn(len: u64) -> Child {
        let filter = deny_userfaultfd();
        let prog = libc::sock_fprog {
            len: filter.len() as u16,
            filter: filter.as_ptr() as *mut libc::sock_filter,
        };
        let (cmd_r, cmd_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let (resp_r, resp_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        // SAFETY: the child runs `child_main`, which makes raw system calls only and never
        // returns.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                child_main(cmd_r.as_raw_fd(), resp_w.as_raw_fd(), len as usize, &prog)
            }
            nix::unistd::ForkResult::Parent { child } => {
                drop((cmd_r, resp_w));
                let mut c = Child {
                    pid: child.as_raw(),
                    cmd: cmd_w,
                    resp: resp_r,
                    base: 0,
                    len,
                    others: Vec::new(),
                };
                let (base, _) = c.read_reply();
                c.base = base;
                c
            }
        }
    }

    fn read_reply(&self) -> (u64, u64) {
        let mut buf = [0u8; 16];
        let mut eintr = 0;
        assert!(
            read_exact_raw(self.resp.as_raw_fd(), &mut buf, &mut eintr),
            "child {} stopped answering (exit status: {:?})",
            self.pid,
            nix::sys::wait::waitpid(
                nix::unistd::Pid::from_raw(self.pid),
                Some(nix::sys::wait::WaitPidFlag::WNOHANG)
            )
        );
        (
            u64::from_ne_bytes(buf[..8].try_into().unwrap()),
            u64::from_ne_bytes(buf[8..].try_into().unwrap()),
        )
    }

    fn send(&self, op: u64, a: u64, b: u64) {
        let mut msg = [0u8; 24];
        for (i, w) in [op, a, b].into_iter().enumerate() {
            msg[i * 8..i * 8 + 8].copy_from_slice(&w.to_ne_bytes());
        }
        assert!(write_all_raw(self.cmd.as_raw_fd(), &msg));
    }

    /// Runs one command; returns its value, asserting the child saw no EINTR.
    fn call(&self, op: u64, a: u64, b: u64) -> u64 {
        self.send(op, a, b);
        let (value, eintr) = self.read_reply();
        assert_eq!(eintr, 0, "the child's read(2) returned EINTR");
        value
    }

    fn page(&self, i: u64) -> u64 {
        assert!(i * PAGE < self.len);
        self.base + i * PAGE
    }

    fn write_pages(&self, pages: &BTreeSet<u64>) {
        for &p in pages {
            self.call(OP_WRITE, self.page(p), 7);
        }
    }

    fn fork(&mut self) -> i32 {
        let pid = self.call(OP_FORK, 0, 0) as i32;
        assert!(pid > 0);
        self.others.push(pid);
        pid
    }

    fn state(&self) -> char {
        proc_state(self.pid)
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        for &p in &self.others {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), nix::sys::signal::SIGKILL);
        }
        let pid = nix::unistd::Pid::from_raw(self.pid);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::SIGKILL);
        let _ = nix::sys::wait::waitpid(pid, None);
    }
}

fn proc_state(pid: i32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = stat.rsplit_once(')').unwrap().1;
    rest.trim_start().chars().next().unwrap()
}

/// Pages of `[start, end)` of process `pid` in runs matching the masks, as page indices from
/// `start`.
fn pages_of(pid: i32, start: u64, end: u64, mask: u64, anyof: u64) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    for r in page_regions(pid, start, end, mask, anyof, mask | anyof).unwrap() {
        for a in (r.start..r.end).step_by(PAGE as usize) {
            out.insert((a - start) / PAGE);
        }
    }
    out
}

/// Written pages of the child's region as page indices, from the registration's own listing.
fn written_in_region(reg: &Registration, c: &Child) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    for (s, e) in reg.written_ranges().unwrap() {
        let (s, e) = (s.max(c.base), e.min(c.base + c.len));
        for a in (s..e).step_by(PAGE as usize) {
            out.insert((a - c.base) / PAGE);
        }
    }
    out
}

/// `n` distinct page indices below `limit`, spread deterministically.
fn chosen(n: u64, limit: u64, seed: u64) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    let mut x = seed | 1;
    while (out.len() as u64) < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.insert(x % limit);
    }
    out
}

fn has_userfaultfd_fd(pid: i32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .any(|l| l.to_string_lossy().contains("userfaultfd"))
}

#[test]
fn supported_here() {
    if !root() {
        return;
    }
    supported().unwrap();
}

#[test]
fn tracks_exactly_the_pages_written() {
    if !root() {
        return;
    }
    let c = Child::spawn(64 << 20);
    let npages = c.len / PAGE;
    let reg = register(c.pid).unwrap();
    assert_eq!(reg.pid(), c.pid);
    assert!(reg.is_alive());
    assert!(
        reg.registered_bytes() >= c.len,
        "{}",
        reg.registered_bytes()
    );
    assert!(
        !has_userfaultfd_fd(c.pid),
        "the child still holds a userfaultfd"
    );

    // Registered, never armed: every present page reads written.
    assert_eq!(written_in_region(&reg, &c).len() as u64, npages);
    let first = reg.arm().unwrap();
    assert!(first >= npages, "first arm found {first} written pages");
    assert_eq!(reg.arm().unwrap(), 0, "nothing ran between two arms");
    assert_eq!(reg.written().unwrap(), 0);

    // Reads are not writes.
    for p in chosen(20, npages, 7) {
        assert_eq!(c.call(OP_READ, c.page(p), 0), 1);
    }
    assert!(written_in_region(&reg, &c).is_empty());

    let pages = chosen(300, npages, 42);
    c.write_pages(&pages);
    assert_eq!(written_in_region(&reg, &c), pages);
    let written = reg.written().unwrap();
    // The child's stack (its replies) is written too: a handful of pages outside the region.
    assert!(
        written >= pages.len() as u64 && written < pages.len() as u64 + 16,
        "written() = {written} for {} pages",
        pages.len()
    );
    assert_eq!(reg.arm().unwrap(), written);
    assert_eq!(reg.arm().unwrap(), 0);
    assert!(written_in_region(&reg, &c).is_empty());

    // A write by the kernel on the process's behalf (read(2) into the page) counts too: async
    // write-protect never calls the uffd handler, so UFFD_USER_MODE_ONLY does not matter.
    c.call(OP_KERNEL_WRITE, c.page(11), 0);
    assert_eq!(written_in_region(&reg, &c), [11].into());
    assert_eq!(c.call(OP_READ, c.page(11), 0), 0x5a);
    reg.arm().unwrap();

    // The same pages again, and one more round.
    c.write_pages(&pages);
    assert_eq!(written_in_region(&reg, &c), pages);
    reg.arm().unwrap();
    let more = chosen(5, npages, 99);
    c.write_pages(&more);
    assert_eq!(written_in_region(&reg, &c), more);
}

#[test]
fn unregistered_memory_reads_written() {
    if !root() {
        return;
    }
    let c = Child::spawn(8 << 20);
    let reg = register(c.pid).unwrap();
    reg.arm().unwrap();

    // A mapping made after registration is not registered: its present pages read written (a
    // read maps the zero page, which counts as present), arm does not protect them, and
    // written() (registered VMAs only) leaves them out.
    let len = 64 * PAGE;
    let fresh = c.call(OP_MMAP, len, 0);
    assert_ne!(fresh as i64, -1);
    let wrote: BTreeSet<u64> = [0, 3, 10, 63].into();
    let read: BTreeSet<u64> = [1, 20].into();
    for &p in &wrote {
        c.call(OP_WRITE, fresh + p * PAGE, 9);
    }
    for &p in &read {
        c.call(OP_READ, fresh + p * PAGE, 0);
    }
    let present = pages_of(
        c.pid,
        fresh,
        fresh + len,
        0,
        PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
    );
    let all: BTreeSet<u64> = wrote.union(&read).copied().collect();
    assert_eq!(present, all);
    let written_present = |c: &Child| {
        pages_of(
            c.pid,
            fresh,
            fresh + len,
            PAGE_IS_WRITTEN,
            PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
        )
    };
    assert_eq!(written_present(&c), all);
    assert!(pages_of(c.pid, fresh, fresh + len, PAGE_IS_WPALLOWED, 0).is_empty());
    reg.arm().unwrap();
    assert_eq!(written_present(&c), all);
    let in_fresh = reg
        .written_ranges()
        .unwrap()
        .into_iter()
        .filter(|&(s, e)| s < fresh + len && e > fresh)
        .count();
    assert_eq!(in_fresh, 0);

    // Dropping the registration unregisters and clears: the region reads written again.
    let npages = c.len / PAGE;
    assert!(pages_of(c.pid, c.base, c.base + c.len, PAGE_IS_WRITTEN, 0).is_empty());
    drop(reg);
    assert_eq!(
        pages_of(c.pid, c.base, c.base + c.len, PAGE_IS_WRITTEN, 0).len() as u64,
        npages
    );
    assert!(pages_of(c.pid, c.base, c.base + c.len, PAGE_IS_WPALLOWED, 0).is_empty());
}

#[test]
fn a_forked_child_was_never_registered() {
    if !root() {
        return;
    }
    let mut c = Child::spawn(16 << 20);
    let npages = c.len / PAGE;
    let reg = register(c.pid).unwrap();
    reg.arm().unwrap();
    let pages = chosen(10, npages, 5);
    c.write_pages(&pages);

    let grandchild = c.fork();
    // Its copy of the region: every page present and written, none write-protectable.
    let region = (c.base, c.base + c.len);
    assert_eq!(
        pages_of(grandchild, region.0, region.1, PAGE_IS_WRITTEN, 0).len() as u64,
        npages
    );
    assert!(pages_of(grandchild, region.0, region.1, PAGE_IS_WPALLOWED, 0).is_empty());
    // The child's own tracking is untouched by the fork, and its writes after it (copy on
    // write) are still seen.
    assert_eq!(written_in_region(&reg, &c), pages);
    reg.arm().unwrap();
    let after: BTreeSet<u64> = chosen(3, npages, 11);
    c.write_pages(&after);
    assert_eq!(written_in_region(&reg, &c), after);
}

#[test]
fn zapped_pages_are_not_counted() {
    if !root() {
        return;
    }
    let c = Child::spawn(8 << 20);
    let reg = register(c.pid).unwrap();
    reg.arm().unwrap();
    // Written 0..8, zapped 4..12: written and present = 0..4; 4..12 not present at all.
    let wrote: BTreeSet<u64> = (0..8).collect();
    c.write_pages(&wrote);
    assert_eq!(c.call(OP_DONTNEED, c.page(4), 8 * PAGE), 0);
    assert_eq!(written_in_region(&reg, &c), (0..4).collect());
    let present = pages_of(
        c.pid,
        c.page(0),
        c.page(16),
        0,
        PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
    );
    assert_eq!(present, (0..4).chain(12..16).collect());
    // Written again after the zap: a fresh page, written.
    c.call(OP_WRITE, c.page(6), 1);
    assert_eq!(written_in_region(&reg, &c), [0, 1, 2, 3, 6].into());
    // Armed over the holes, which arm leaves alone: the first touch of a hole, a write or a read
    // (the zero page), makes a pte without the uffd-wp bit, so both read written (the read is a
    // harmless false positive).
    // arm counts what written() counts (the 5 pages, and the child's stack).
    let before = reg.written().unwrap();
    assert!(before >= 5, "{before}");
    assert_eq!(reg.arm().unwrap(), before);
    c.call(OP_WRITE, c.page(9), 1);
    c.call(OP_READ, c.page(10), 0);
    assert_eq!(written_in_region(&reg, &c), [9, 10].into());
}

#[test]
fn a_blocked_read_goes_on_after_injection() {
    if !root() {
        return;
    }
    let c = Child::spawn(PAGE * 4);
    // The child sits in read(2) on its command pipe; let it get there.
    std::thread::sleep(Duration::from_millis(50));
    assert!(matches!(c.state(), 'S'), "child state {}", c.state());
    let reg = register(c.pid).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    // Restarted, not returned: still asleep in read, and its next read gets the command whole
    // (call() asserts it saw no EINTR).
    assert_eq!(c.state(), 'S');
    assert_eq!(c.call(OP_READ, c.page(1), 0), 1);
    assert!(reg.is_alive());
}

#[test]
fn a_stopped_process_stays_stopped() {
    if !root() {
        return;
    }
    let c = Child::spawn(PAGE * 4);
    let pid = nix::unistd::Pid::from_raw(c.pid);
    nix::sys::signal::kill(pid, nix::sys::signal::SIGSTOP).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while c.state() != 'T' {
        assert!(Instant::now() < deadline, "child never stopped");
        std::thread::sleep(Duration::from_millis(5));
    }
    let reg = register(c.pid).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(c.state(), 'T', "registration resumed a stopped process");
    nix::sys::signal::kill(pid, nix::sys::signal::SIGCONT).unwrap();
    assert_eq!(c.call(OP_READ, c.page(0), 0), 1);
    reg.arm().unwrap();
    c.call(OP_WRITE, c.page(2), 3);
    assert_eq!(written_in_region(&reg, &c), [2].into());
}

#[test]
fn gone_processes_fail_fast() {
    if !root() {
        return;
    }
    // Exited and reaped: no such pid.
    let c = Child::spawn(PAGE);
    let pid = c.pid;
    drop(c);
    let t = Instant::now();
    let e = register(pid).unwrap_err();
    assert!(matches!(e, TrackError::Exited { .. }), "{e:?}");
    assert!(t.elapsed() < Duration::from_secs(1));

    // A zombie (exited, not reaped): no memory.
    let c = Child::spawn(PAGE);
    c.send(OP_EXIT, 0, 0);
    let deadline = Instant::now() + Duration::from_secs(5);
    while c.state() != 'Z' {
        assert!(Instant::now() < deadline, "child never exited");
        std::thread::sleep(Duration::from_millis(5));
    }
    let t = Instant::now();
    let e = register(c.pid).unwrap_err();
    assert!(
        matches!(e, TrackError::NoMm { .. } | TrackError::Exited { .. }),
        "{e:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(1));
    println!("zombie: {e}");

    // Registered, then gone: is_alive says so and scans fail cleanly.
    let c = Child::spawn(PAGE * 4);
    let reg = register(c.pid).unwrap();
    drop(c);
    assert!(!reg.is_alive());
    assert!(matches!(reg.arm(), Err(TrackError::Exited { .. })));
    assert!(matches!(reg.written(), Err(TrackError::Exited { .. })));
}

#[test]
fn a_multithreaded_process_is_registered_through_its_leader() {
    if !root() {
        return;
    }
    // The leader blocks in join() (a futex wait); another thread serves the commands.
    let script = r#"
import ctypes, mmap, sys, threading
m = mmap.mmap(-1, 16 << 20)
c = ctypes.c_char.from_buffer(m)
addr = ctypes.addressof(c)
del c
for i in range(0, len(m), 4096):
    m[i] = 1
def serve():
    print(addr, flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[0] == "w":
            for p in words[1:]:
                m[int(p) * 4096] = 2
            print("done", flush=True)
        else:
            break
t = threading.Thread(target=serve)
t.start()
t.join()
"#;
    use std::io::{BufRead, Write};
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut stdin = child.stdin.take().unwrap();
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let base: u64 = line.trim().parse().unwrap();
    let len = 16u64 << 20;
    let pid = child.id() as i32;
    std::thread::sleep(Duration::from_millis(50));

    let reg = register(pid).unwrap();
    reg.arm().unwrap();
    writeln!(stdin, "w 1 7 300").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "done");
    let mut written = BTreeSet::new();
    for (s, e) in reg.written_ranges().unwrap() {
        for a in (s.max(base)..e.min(base + len)).step_by(PAGE as usize) {
            written.insert((a - base) / PAGE);
        }
    }
    assert_eq!(written, [1, 7, 300].into());
    writeln!(stdin, "q").unwrap();
    drop(stdin);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

#[test]
fn timing_on_256_mib() {
    if !root() {
        return;
    }
    let c = Child::spawn(256 << 20);
    let npages = c.len / PAGE;
    let t = Instant::now();
    let reg = register(c.pid).unwrap();
    let t_register = t.elapsed();
    let t = Instant::now();
    let first = reg.arm().unwrap();
    let t_first_arm = t.elapsed();
    let t = Instant::now();
    let clean = reg.arm().unwrap();
    let t_clean_arm = t.elapsed();
    let pages = chosen(npages / 20, npages, 3);
    c.write_pages(&pages);
    let t = Instant::now();
    let written = reg.written().unwrap();
    let t_written = t.elapsed();
    // Thousands of runs: the scans go through many batches of regions.
    assert_eq!(written_in_region(&reg, &c), pages);
    let t = Instant::now();
    let rearmed = reg.arm().unwrap();
    let t_rearm = t.elapsed();
    assert!(written >= pages.len() as u64 && rearmed == written);
    println!(
        "dirty tracking, 256 MiB target ({npages} pages): register {t_register:?} \
         ({} MiB registered, {} VMAs skipped); first arm {t_first_arm:?} ({first} pages); \
         arm with nothing written {t_clean_arm:?} ({clean}); written() with 5 % written \
         {t_written:?} ({written}); arm with 5 % written {t_rearm:?} ({rearmed})",
        reg.registered_bytes() >> 20,
        reg.skipped_vmas()
    );
}

#[test]
fn a_sleep_keeps_its_length() {
    if !root() {
        return;
    }
    let c = Child::spawn(PAGE * 4);
    let t = Instant::now();
    c.send(OP_SLEEP, 400, 0);
    std::thread::sleep(Duration::from_millis(100));
    let reg = register(c.pid).unwrap();
    let (rc, eintr) = c.read_reply();
    let slept = t.elapsed();
    assert_eq!((rc, eintr), (0, 0), "nanosleep in the child");
    assert!(slept >= Duration::from_millis(400), "slept {slept:?}");
    assert!(reg.is_alive());
}

#[test]
fn injection_under_a_signal_storm() {
    if !root() {
        return;
    }
    let c = Child::spawn(PAGE * 64);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pid = nix::unistd::Pid::from_raw(c.pid);
    let storm = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut sent = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if nix::sys::signal::kill(pid, nix::sys::signal::SIGUSR1).is_err() {
                    break;
                }
                sent += 1;
                std::thread::sleep(Duration::from_micros(20));
            }
            sent
        })
    };
    for round in 0..200u64 {
        let reg = register(c.pid).unwrap_or_else(|e| panic!("round {round}: {e:?}"));
        reg.arm().unwrap();
        let page = round % 64;
        c.call(OP_WRITE, c.page(page), 5);
        assert_eq!(written_in_region(&reg, &c), [page].into(), "round {round}");
        drop(reg);
        if has_userfaultfd_fd(c.pid) {
            let fds: Vec<_> = std::fs::read_dir(format!("/proc/{}/fd", c.pid))
                .unwrap()
                .flatten()
                .map(|e| (e.file_name(), std::fs::read_link(e.path()).ok()))
                .collect();
            panic!("round {round}: the child holds a userfaultfd: {fds:?}");
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = storm.join().unwrap();
    assert!(!has_userfaultfd_fd(c.pid));
    let handled = c.call(OP_SIGNALS, 0, 0);
    println!(
        "signal storm: {sent} SIGUSR1 sent, {handled} handled by the child, 200 registrations"
    );
    assert!(handled > 0);
}

/// A v1 freezer cgroup, removed on drop (after the processes in it are gone).
struct Freezer(std::path::PathBuf);

impl Freezer {
    fn set(&self, state: &str) {
        std::fs::write(self.0.join("freezer.state"), state).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::read_to_string(self.0.join("freezer.state"))
            .unwrap()
            .trim()
            != state
        {
            assert!(Instant::now() < deadline, "freezer never reached {state}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Freezer {
    fn drop(&mut self) {
        let _ = std::fs::write(self.0.join("freezer.state"), "THAWED");
        for _ in 0..500 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

#[test]
fn a_frozen_process_times_out_and_is_let_go() {
    if !root() {
        return;
    }
    // A task frozen by the v1 freezer sits in the refrigerator and takes no ptrace stop until it
    // is thawed.
    let root_dir = std::path::Path::new("/sys/fs/cgroup/freezer");
    if !root_dir.join("tasks").exists() {
        grove_testkit::capability_missing("needs the cgroup v1 freezer");
        return;
    }
    let cg = Freezer(root_dir.join(format!("grove-dirty-test-{}", std::process::id())));
    std::fs::create_dir(&cg.0).unwrap();
    let c = Child::spawn(PAGE * 4);
    std::fs::write(cg.0.join("cgroup.procs"), c.pid.to_string()).unwrap();
    cg.set("FROZEN");
    let t = Instant::now();
    let e = register(c.pid).unwrap_err();
    let took = t.elapsed();
    assert!(matches!(e, TrackError::TimedOut { .. }), "{e:?}");
    assert!(
        took < super::inject::INJECT_TIMEOUT + Duration::from_secs(1),
        "{took:?}"
    );
    // The injection waits in a process of its own, which a SIGKILL of its caller (groved) would
    // not take with it: the target's tracer is not a thread of this process but a child of it.
    let status = std::fs::read_to_string(format!("/proc/{}/status", c.pid)).unwrap();
    let field = |text: &str, name: &str| -> i32 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    let tracer = field(&status, "TracerPid:");
    assert_ne!(tracer, 0, "the target is traced while the injection waits");
    let tracer_status = std::fs::read_to_string(format!("/proc/{tracer}/status")).unwrap();
    let me = std::process::id() as i32;
    assert_ne!(
        field(&tracer_status, "Tgid:"),
        me,
        "the injection runs in this process"
    );
    assert_eq!(field(&tracer_status, "PPid:"), me, "{tracer_status}");
    cg.set("THAWED");
    // The injection finishes by itself: the child is let go, holds no userfaultfd, and works.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let status = std::fs::read_to_string(format!("/proc/{}/status", c.pid)).unwrap();
        let traced = status
            .lines()
            .any(|l| l.starts_with("TracerPid:") && l.split_whitespace().nth(1) != Some("0"));
        if !traced && !has_userfaultfd_fd(c.pid) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the child is still traced or holds a uffd"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(c.call(OP_READ, c.page(0), 0), 1);
    println!("frozen target: {e} after {took:?}");
    drop(c);
}
