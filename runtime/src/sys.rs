//! The runtime's system calls that `nix` does not wrap (bpf, capability bounding set, terminal
//! ioctls, signal dispositions by number, poll over raw `pollfd`s, a superblock reconfigured
//! through the new mount API): one place for their unsafe blocks. What more than one crate needs lives in `grove_sys`; everything else goes through nix.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn check(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// One eBPF instruction (struct bpf_insn).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BpfInsn {
    pub code: u8,
    /// dst in the low nibble, src in the high one.
    pub regs: u8,
    pub off: i16,
    pub imm: i32,
}

/// The leading fields of union bpf_attr for BPF_PROG_LOAD (the kernel zero-fills the rest).
#[repr(C)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
}

/// union bpf_attr for BPF_PROG_ATTACH.
#[repr(C)]
struct ProgAttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;

/// bpf(BPF_PROG_LOAD): loads `insns` as a program of `prog_type`.
pub fn bpf_prog_load(
    prog_type: u32,
    insns: &[BpfInsn],
    license: &CStr,
    name: [u8; 16],
) -> io::Result<OwnedFd> {
    let attr = ProgLoadAttr {
        prog_type,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 0,
        log_size: 0,
        log_buf: 0,
        kern_version: 0,
        prog_flags: 0,
        prog_name: name,
    };
    // SAFETY: attr is a properly laid out bpf_attr prefix whose pointers (insns, license)
    // outlive the call; the kernel copies them and returns a new fd or -1.
    let fd = check(unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_LOAD,
            &attr as *const ProgLoadAttr,
            std::mem::size_of::<ProgLoadAttr>(),
        )
    })?;
    // SAFETY: fd is a fresh descriptor the kernel just gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// bpf(BPF_PROG_ATTACH): attaches `prog` to `target` (a cgroup directory) as `attach_type`.
pub fn bpf_prog_attach(
    target: BorrowedFd<'_>,
    prog: BorrowedFd<'_>,
    attach_type: u32,
    flags: u32,
) -> io::Result<()> {
    let attr = ProgAttachAttr {
        target_fd: target.as_raw_fd() as u32,
        attach_bpf_fd: prog.as_raw_fd() as u32,
        attach_type,
        attach_flags: flags,
    };
    // SAFETY: attr is a properly laid out bpf_attr for BPF_PROG_ATTACH naming two open fds.
    check(unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_ATTACH,
            &attr as *const ProgAttachAttr,
            std::mem::size_of::<ProgAttachAttr>(),
        )
    })?;
    Ok(())
}

/// Drops capability `cap` from the calling thread's bounding set. EINVAL: past CAP_LAST_CAP.
pub fn capbset_drop(cap: u32) -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) };
    check(rc.into()).map(drop)
}

/// Clears the calling thread's ambient capabilities.
pub fn clear_ambient_caps() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    check(rc.into()).map(drop)
}

nix::ioctl_write_ptr_bad!(tiocswinsz, libc::TIOCSWINSZ, libc::winsize);
nix::ioctl_write_int_bad!(tiocsctty, libc::TIOCSCTTY);

/// TIOCSWINSZ: sets the size of the terminal `fd` (the kernel sends SIGWINCH to its foreground
/// group).
pub fn set_winsize(fd: BorrowedFd<'_>, ws: &libc::winsize) -> nix::Result<()> {
    // SAFETY: TIOCSWINSZ reads one winsize through a valid pointer from an open descriptor.
    unsafe { tiocswinsz(fd.as_raw_fd(), ws) }.map(drop)
}

/// TIOCSCTTY: makes the terminal `fd` the calling process's controlling terminal (it must lead
/// a session that has none).
pub fn set_controlling_tty(fd: RawFd) -> nix::Result<()> {
    // SAFETY: TIOCSCTTY takes an integer argument; no memory is passed.
    unsafe { tiocsctty(fd, 0) }.map(drop)
}

/// Ignores signal number `sig`.
pub fn ignore_signal(sig: i32) -> io::Result<()> {
    set_disposition(sig, libc::SIG_IGN)
}

/// Gives signal number `sig` its default action back. Async-signal-safe: for a forked child.
pub fn default_signal(sig: i32) -> io::Result<()> {
    set_disposition(sig, libc::SIG_DFL)
}

/// By number, so real-time signals too (nix's `Signal` does not name them); SIG_IGN or SIG_DFL
/// only, never a handler.
fn set_disposition(sig: i32, disposition: libc::sighandler_t) -> io::Result<()> {
    // SAFETY: signal(2) with SIG_IGN or SIG_DFL runs none of our code when the signal comes.
    if unsafe { libc::signal(sig, disposition) } == libc::SIG_ERR {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// kill(2) by number: real-time signals too, and 0 (is `pid` there?). A negative `pid` names a
/// process group, -1 every process the caller may signal.
pub fn kill(pid: i32, sig: i32) -> io::Result<()> {
    // SAFETY: kill(2) takes plain integers and passes no memory.
    if unsafe { libc::kill(pid, sig) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// poll(2) over raw `pollfd`s (the init's loop builds its set from many owners each round);
/// returns how many have events.
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<usize> {
    // SAFETY: fds is a valid, correctly sized array of pollfd for the duration of the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    check(n.into()).map(|n| n as usize)
}

/// fspick(2) flag, and fsconfig(2) commands (linux/mount.h; libc has the syscall numbers only).
const FSPICK_CLOEXEC: libc::c_uint = 1;
const FSCONFIG_SET_FLAG: libc::c_uint = 0;
const FSCONFIG_CMD_RECONFIGURE: libc::c_uint = 7;

/// Reconfigures the superblock of the filesystem mounted at `mountpoint` with exactly the
/// parameter flags `flags` (fspick, one fsconfig per flag, then a reconfigure). Unlike a
/// `mount -o remount`, the mount's own attributes (nosuid, noexec, ...) are left as they are.
/// A flag the filesystem does not know fails the call before anything changes.
pub fn reconfigure_superblock(mountpoint: &Path, flags: &[&str]) -> io::Result<()> {
    let path = CString::new(mountpoint.as_os_str().as_bytes())?;
    // SAFETY: fspick reads one NUL-terminated path that outlives the call; the descriptor it
    // returns is owned right below.
    let fd = check(unsafe {
        libc::syscall(
            libc::SYS_fspick,
            libc::AT_FDCWD,
            path.as_ptr(),
            FSPICK_CLOEXEC,
        )
    })?;
    // SAFETY: fd is a descriptor fspick just opened, owned by nothing else.
    let fs = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    for flag in flags {
        let key = CString::new(*flag)?;
        // SAFETY: FSCONFIG_SET_FLAG reads one NUL-terminated key that outlives the call; the
        // value must be NULL and aux 0.
        check(unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                fs.as_raw_fd(),
                FSCONFIG_SET_FLAG,
                key.as_ptr(),
                std::ptr::null::<libc::c_char>(),
                0,
            )
        })?;
    }
    // SAFETY: FSCONFIG_CMD_RECONFIGURE takes no key, value or aux.
    check(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_CMD_RECONFIGURE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_char>(),
            0,
        )
    })?;
    Ok(())
}
