//! Privilege reduction applied to sandbox pid 1 before it execs the init server: capability bounding
//! set, rlimits, no_new_privs and the seccomp filter. Everything exec'd later inherits them.

use std::collections::BTreeMap;

use seccompiler::{
    BackendError, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

/// Docker's default capability set less CAP_MKNOD (CAP_* numbers): a sandbox makes no device
/// nodes; /dev's few are made by setup before the bounding set is dropped.
pub const KEEP_CAPS: &[u32] = &[
    0,  // CHOWN
    1,  // DAC_OVERRIDE
    3,  // FOWNER
    4,  // FSETID
    5,  // KILL
    6,  // SETGID
    7,  // SETUID
    8,  // SETPCAP
    10, // NET_BIND_SERVICE
    13, // NET_RAW
    18, // SYS_CHROOT
    29, // AUDIT_WRITE
    31, // SETFCAP
];

/// Syscalls a sandbox may make with any arguments: Docker's default profile (moby
/// profiles/seccomp/default.json) for x86_64 with the capabilities above, less `io_uring_*` and
/// `name_to_handle_at` (refused here before the allowlist, and still refused). Everything else
/// gets EPERM, or ENOSYS past [`LAST_KNOWN_SYSCALL`] (see [`abi_filter`]).
pub const ALLOWED_SYSCALLS: &[i64] = &[
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_access,
    libc::SYS_alarm,
    libc::SYS_bind,
    libc::SYS_brk,
    libc::SYS_capget,
    libc::SYS_capset,
    libc::SYS_chdir,
    libc::SYS_chmod,
    libc::SYS_chown,
    libc::SYS_clock_getres,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_close,
    libc::SYS_close_range,
    libc::SYS_connect,
    libc::SYS_copy_file_range,
    libc::SYS_creat,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_epoll_create,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_ctl_old,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_wait_old,
    libc::SYS_eventfd,
    libc::SYS_eventfd2,
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_fadvise64,
    libc::SYS_fallocate,
    libc::SYS_fanotify_mark,
    libc::SYS_fchdir,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_fchown,
    libc::SYS_fchownat,
    libc::SYS_fcntl,
    libc::SYS_fdatasync,
    libc::SYS_fgetxattr,
    libc::SYS_flistxattr,
    libc::SYS_flock,
    libc::SYS_fork,
    libc::SYS_fremovexattr,
    libc::SYS_fsetxattr,
    libc::SYS_fstat,
    libc::SYS_fstatfs,
    libc::SYS_fsync,
    libc::SYS_ftruncate,
    libc::SYS_futex,
    libc::SYS_futex_waitv,
    libc::SYS_futimesat,
    libc::SYS_getcpu,
    libc::SYS_getcwd,
    libc::SYS_getdents,
    libc::SYS_getdents64,
    libc::SYS_getegid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getgroups,
    libc::SYS_getitimer,
    libc::SYS_getpeername,
    libc::SYS_getpgid,
    libc::SYS_getpgrp,
    libc::SYS_getpid,
    libc::SYS_getppid,
    libc::SYS_getpriority,
    libc::SYS_getrandom,
    libc::SYS_getresgid,
    libc::SYS_getresuid,
    libc::SYS_getrlimit,
    libc::SYS_get_robust_list,
    libc::SYS_getrusage,
    libc::SYS_getsid,
    libc::SYS_getsockname,
    libc::SYS_getsockopt,
    libc::SYS_get_thread_area,
    libc::SYS_gettid,
    libc::SYS_gettimeofday,
    libc::SYS_getuid,
    libc::SYS_getxattr,
    libc::SYS_inotify_add_watch,
    libc::SYS_inotify_init,
    libc::SYS_inotify_init1,
    libc::SYS_inotify_rm_watch,
    libc::SYS_io_cancel,
    libc::SYS_ioctl,
    libc::SYS_io_destroy,
    libc::SYS_io_getevents,
    libc::SYS_ioprio_get,
    libc::SYS_ioprio_set,
    libc::SYS_io_setup,
    libc::SYS_io_submit,
    libc::SYS_kill,
    libc::SYS_landlock_add_rule,
    libc::SYS_landlock_create_ruleset,
    libc::SYS_landlock_restrict_self,
    libc::SYS_lchown,
    libc::SYS_lgetxattr,
    libc::SYS_link,
    libc::SYS_linkat,
    libc::SYS_listen,
    libc::SYS_listxattr,
    libc::SYS_llistxattr,
    libc::SYS_lremovexattr,
    libc::SYS_lseek,
    libc::SYS_lsetxattr,
    libc::SYS_lstat,
    libc::SYS_madvise,
    libc::SYS_membarrier,
    libc::SYS_memfd_create,
    libc::SYS_memfd_secret,
    libc::SYS_mincore,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_mknod,
    libc::SYS_mknodat,
    libc::SYS_mlock,
    libc::SYS_mlock2,
    libc::SYS_mlockall,
    libc::SYS_mmap,
    libc::SYS_mprotect,
    libc::SYS_mq_getsetattr,
    libc::SYS_mq_notify,
    libc::SYS_mq_open,
    libc::SYS_mq_timedreceive,
    libc::SYS_mq_timedsend,
    libc::SYS_mq_unlink,
    libc::SYS_mremap,
    libc::SYS_msgctl,
    libc::SYS_msgget,
    libc::SYS_msgrcv,
    libc::SYS_msgsnd,
    libc::SYS_msync,
    libc::SYS_munlock,
    libc::SYS_munlockall,
    libc::SYS_munmap,
    libc::SYS_nanosleep,
    libc::SYS_newfstatat,
    libc::SYS_open,
    libc::SYS_openat,
    libc::SYS_openat2,
    libc::SYS_pause,
    libc::SYS_pidfd_open,
    libc::SYS_pidfd_send_signal,
    libc::SYS_pipe,
    libc::SYS_pipe2,
    libc::SYS_pkey_alloc,
    libc::SYS_pkey_free,
    libc::SYS_pkey_mprotect,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_prctl,
    libc::SYS_pread64,
    libc::SYS_preadv,
    libc::SYS_preadv2,
    libc::SYS_prlimit64,
    libc::SYS_process_mrelease,
    libc::SYS_pselect6,
    libc::SYS_pwrite64,
    libc::SYS_pwritev,
    libc::SYS_pwritev2,
    libc::SYS_read,
    libc::SYS_readahead,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_readv,
    libc::SYS_recvfrom,
    libc::SYS_recvmmsg,
    libc::SYS_recvmsg,
    libc::SYS_remap_file_pages,
    libc::SYS_removexattr,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_restart_syscall,
    libc::SYS_rmdir,
    libc::SYS_rseq,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigpending,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigqueueinfo,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigsuspend,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_rt_tgsigqueueinfo,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_getattr,
    libc::SYS_sched_getparam,
    libc::SYS_sched_get_priority_max,
    libc::SYS_sched_get_priority_min,
    libc::SYS_sched_getscheduler,
    libc::SYS_sched_rr_get_interval,
    libc::SYS_sched_setaffinity,
    libc::SYS_sched_setattr,
    libc::SYS_sched_setparam,
    libc::SYS_sched_setscheduler,
    libc::SYS_sched_yield,
    libc::SYS_seccomp,
    libc::SYS_select,
    libc::SYS_semctl,
    libc::SYS_semget,
    libc::SYS_semop,
    libc::SYS_semtimedop,
    libc::SYS_sendfile,
    libc::SYS_sendmmsg,
    libc::SYS_sendmsg,
    libc::SYS_sendto,
    libc::SYS_setfsgid,
    libc::SYS_setfsuid,
    libc::SYS_setgid,
    libc::SYS_setgroups,
    libc::SYS_setitimer,
    libc::SYS_setpgid,
    libc::SYS_setpriority,
    libc::SYS_setregid,
    libc::SYS_setresgid,
    libc::SYS_setresuid,
    libc::SYS_setreuid,
    libc::SYS_setrlimit,
    libc::SYS_set_robust_list,
    libc::SYS_setsid,
    libc::SYS_setsockopt,
    libc::SYS_set_thread_area,
    libc::SYS_set_tid_address,
    libc::SYS_setuid,
    libc::SYS_setxattr,
    libc::SYS_shmat,
    libc::SYS_shmctl,
    libc::SYS_shmdt,
    libc::SYS_shmget,
    libc::SYS_shutdown,
    libc::SYS_sigaltstack,
    libc::SYS_signalfd,
    libc::SYS_signalfd4,
    libc::SYS_socketpair,
    libc::SYS_splice,
    libc::SYS_stat,
    libc::SYS_statfs,
    libc::SYS_statx,
    libc::SYS_symlink,
    libc::SYS_symlinkat,
    libc::SYS_sync,
    libc::SYS_sync_file_range,
    libc::SYS_syncfs,
    libc::SYS_sysinfo,
    libc::SYS_tee,
    libc::SYS_tgkill,
    libc::SYS_time,
    libc::SYS_timer_create,
    libc::SYS_timer_delete,
    libc::SYS_timer_getoverrun,
    libc::SYS_timer_gettime,
    libc::SYS_timer_settime,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_gettime,
    libc::SYS_timerfd_settime,
    libc::SYS_times,
    libc::SYS_tkill,
    libc::SYS_truncate,
    libc::SYS_umask,
    libc::SYS_uname,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_utime,
    libc::SYS_utimensat,
    libc::SYS_utimes,
    libc::SYS_vfork,
    libc::SYS_vmsplice,
    libc::SYS_wait4,
    libc::SYS_waitid,
    libc::SYS_write,
    libc::SYS_writev,
    333, // io_pgetevents (no libc constant)
    // Docker allows these from kernel 4.8 on, where seccomp re-checks a tracee's changed calls.
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    // x86_64 only; chroot with the CAP_SYS_CHROOT kept above.
    libc::SYS_arch_prctl,
    libc::SYS_modify_ldt,
    libc::SYS_chroot,
    // Newer than Docker's list and no more than variants of calls on it (a libc that knows them
    // would get EPERM and not fall back).
    451, // cachestat
    452, // fchmodat2
    453, // map_shadow_stack
    454, // futex_wake
    455, // futex_wait
    456, // futex_requeue
    462, // mseal
    463, // setxattrat
    464, // getxattrat
    465, // listxattrat
    466, // removexattrat
    468, // file_getattr
    469, // file_setattr
];

/// The highest x86_64 syscall number this list was written against (file_setattr, Linux 6.17).
/// Higher numbers get ENOSYS, as from a kernel that lacks them, so that a libc probing a call newer
/// than this list falls back (EPERM would read as a real refusal), as runc does.
pub const LAST_KNOWN_SYSCALL: u32 = 469;

/// Namespace flags refused in clone(2): NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID,
/// NEWNET (Docker's 0x7E020000).
const CLONE_NS_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET) as u64;

/// socket(2) families refused outright: AF_PACKET (raw frames of the link) and AF_VSOCK (the
/// hypervisor's sockets).
pub const DENIED_FAMILIES: &[u64] = &[libc::AF_PACKET as u64, libc::AF_VSOCK as u64];

/// Socket types AF_INET/AF_INET6 may open (type & 0xf, past SOCK_NONBLOCK/SOCK_CLOEXEC): no
/// SOCK_RAW (forged packets) nor SOCK_PACKET. Ping works with SOCK_DGRAM ICMP sockets.
const INET_TYPES: &[u64] = &[
    libc::SOCK_STREAM as u64,
    libc::SOCK_DGRAM as u64,
    libc::SOCK_SEQPACKET as u64,
];

/// personality(2) values Docker allows: PER_LINUX, with UNAME26 and/or ADDR_NO_RANDOMIZE, and the
/// 0xffffffff query.
const PERSONALITIES: &[u64] = &[0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

/// Why pid 1 could not harden itself during setup.
#[derive(Debug, thiserror::Error)]
pub enum HardenError {
    #[error("drop capability {cap}: {error}")]
    DropCap { cap: u32, error: std::io::Error },
    /// `what`: the limit, as `RLIMIT_NOFILE=<n>` or `RLIMIT_CORE`.
    #[error("{what}: {errno}")]
    Rlimit {
        what: String,
        errno: nix::errno::Errno,
    },
    #[error("no_new_privs: {0}")]
    NoNewPrivs(nix::errno::Errno),
    #[error("build seccomp filter: {0}")]
    BuildFilter(BackendError),
    /// `which`: `seccomp` (the allowlist) or `abi`.
    #[error("install {which} filter: {error}")]
    InstallFilter {
        which: &'static str,
        error: seccompiler::Error,
    },
}

fn cond(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, BackendError> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value)
}

fn rule(conds: Vec<SeccompCondition>) -> Result<SeccompRule, BackendError> {
    SeccompRule::new(conds)
}

/// The allowlist: [`ALLOWED_SYSCALLS`] unconditionally; clone without namespace flags; socket
/// outside [`DENIED_FAMILIES`] and without raw inet sockets; personality with [`PERSONALITIES`].
/// Anything else: EPERM.
pub fn allow_filter() -> Result<BpfProgram, BackendError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = ALLOWED_SYSCALLS
        .iter()
        .map(|&nr| (nr, Vec::new()))
        .collect();
    // The kernel takes legacy clone's flags from the low 32 bits only.
    let clone = rule(vec![cond(0, SeccompCmpOp::MaskedEq(CLONE_NS_FLAGS), 0)?])?;
    rules.insert(libc::SYS_clone, vec![clone]);

    let (inet, inet6) = (libc::AF_INET as u64, libc::AF_INET6 as u64);
    let mut other = vec![];
    for fam in [inet, inet6].iter().chain(DENIED_FAMILIES) {
        other.push(cond(0, SeccompCmpOp::Ne, *fam)?);
    }
    let mut socket = vec![rule(other)?];
    for fam in [inet, inet6] {
        for &ty in INET_TYPES {
            socket.push(rule(vec![
                cond(0, SeccompCmpOp::Eq, fam)?,
                cond(1, SeccompCmpOp::MaskedEq(0xf), ty)?,
            ])?);
        }
    }
    rules.insert(libc::SYS_socket, socket);

    let personality = PERSONALITIES
        .iter()
        .map(|&v| rule(vec![cond(0, SeccompCmpOp::Eq, v)?]))
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_personality, personality);

    SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        TargetArch::x86_64,
    )?
    .try_into()
}

/// What the number-keyed allowlist cannot say, in one small hand-written filter:
/// - clone3 gets ENOSYS: its flags live in memory, out of a filter's reach, so libc falls back to
///   clone, whose flags the allowlist checks.
/// - every x32 call (number | 0x4000_0000) gets EPERM: x32 calls carry the x86_64 audit arch, so
///   rules keyed by x86_64 numbers would let `mount` or `unshare` through under their x32 numbers
///   on a kernel that enables the x32 ABI.
/// - numbers past [`LAST_KNOWN_SYSCALL`] get ENOSYS.
///
/// It is installed after the allowlist so that the kernel, which keeps the first of equally strict
/// answers starting from the newest filter, returns its ENOSYS rather than the allowlist's EPERM.
/// Other arches are the allowlist's to refuse (it kills the process).
pub fn abi_filter() -> BpfProgram {
    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    let op = |code: u32, k: u32, jt: u8, jf: u8| seccompiler::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    let load = |offset: u32| op(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, offset, 0, 0);
    let ret = |k: u32| op(libc::BPF_RET | libc::BPF_K, k, 0, 0);
    let jump =
        |test: u32, k: u32, jt: u8, jf: u8| op(libc::BPF_JMP | test | libc::BPF_K, k, jt, jf);
    // seccomp_data: nr at offset 0, arch at 4. Jump offsets count from the next instruction.
    vec![
        load(4),
        jump(libc::BPF_JEQ, AUDIT_ARCH_X86_64, 0, 4), // other arch: 6
        load(0),
        jump(libc::BPF_JGE, X32_SYSCALL_BIT, 3, 0), // x32: 7
        jump(libc::BPF_JEQ, libc::SYS_clone3 as u32, 3, 0), // clone3: 8
        jump(libc::BPF_JGT, LAST_KNOWN_SYSCALL, 2, 0), // unknown: 8
        ret(libc::SECCOMP_RET_ALLOW),
        ret(libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        ret(libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
    ]
}

/// Drops every capability outside KEEP_CAPS from the bounding set. After exec (as uid 0) the
/// process's permitted/effective sets equal the bounding set.
/// Drops every capability but [`KEEP_CAPS`] and `extra` (the spec's `cap_add`) from the bounding set.
pub fn drop_bounding_caps(extra: &[u32]) -> Result<(), HardenError> {
    for cap in 0..64u32 {
        if KEEP_CAPS.contains(&cap) || extra.contains(&cap) {
            continue;
        }
        if let Err(err) = crate::sys::capbset_drop(cap) {
            if err.raw_os_error() == Some(libc::EINVAL) {
                break; // past CAP_LAST_CAP
            }
            return Err(HardenError::DropCap { cap, error: err });
        }
    }
    let _ = crate::sys::clear_ambient_caps();
    Ok(())
}

pub fn set_rlimits(open_files: u64) -> Result<(), HardenError> {
    use nix::sys::resource::{setrlimit, Resource};
    let failed = |what: String| move |errno| HardenError::Rlimit { what, errno };
    setrlimit(Resource::RLIMIT_NOFILE, open_files, open_files)
        .map_err(failed(format!("RLIMIT_NOFILE={open_files}")))?;
    setrlimit(Resource::RLIMIT_CORE, 0, 0).map_err(failed("RLIMIT_CORE".into()))?;
    Ok(())
}

/// no_new_privs, then the seccomp filters.
pub fn lock_down() -> Result<(), HardenError> {
    let install = |which| move |error| HardenError::InstallFilter { which, error };
    nix::sys::prctl::set_no_new_privs().map_err(HardenError::NoNewPrivs)?;
    let allow = allow_filter().map_err(HardenError::BuildFilter)?;
    seccompiler::apply_filter(&allow).map_err(install("seccomp"))?;
    seccompiler::apply_filter(&abi_filter()).map_err(install("abi"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_build() {
        assert!(!allow_filter().unwrap().is_empty());
        assert_eq!(abi_filter().len(), 9);
    }

    #[test]
    fn harden_errors_read_as_before() {
        let e = HardenError::Rlimit {
            what: "RLIMIT_NOFILE=7".into(),
            errno: nix::errno::Errno::EPERM,
        };
        assert_eq!(
            e.to_string(),
            "RLIMIT_NOFILE=7: EPERM: Operation not permitted"
        );
        let e = HardenError::InstallFilter {
            which: "abi",
            error: seccompiler::Error::EmptyFilter,
        };
        assert!(e.to_string().starts_with("install abi filter: "), "{e}");
    }
}
