//! Privilege reduction applied to sandbox pid 1 before it execs the init server: capability bounding
//! set, rlimits, no_new_privs and the seccomp filter. Everything exec'd later inherits them.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Docker's default capability set (CAP_* numbers).
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
    27, // MKNOD
    29, // AUDIT_WRITE
    31, // SETFCAP
];

/// Syscalls refused with EPERM inside a sandbox.
pub const DENIED_SYSCALLS: &[i64] = &[
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_userfaultfd,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_reboot,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_clock_settime,
    libc::SYS_settimeofday,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_fsopen,
    libc::SYS_fsmount,
    libc::SYS_fsconfig,
    libc::SYS_fspick,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_mount_setattr,
    libc::SYS_lookup_dcookie,
    libc::SYS_syslog,
    libc::SYS_vhangup,
];

/// Namespace flags refused in clone(2).
const CLONE_NS_FLAGS: &[u64] = &[
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWCGROUP as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
];

/// The EPERM filter: the denied list plus clone(2) with any namespace flag.
pub fn deny_filter() -> Result<BpfProgram, String> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED_SYSCALLS.iter().map(|&nr| (nr, Vec::new())).collect();
    let clone_rules = CLONE_NS_FLAGS
        .iter()
        .map(|&flag| {
            let cond = SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(flag),
                flag,
            )?;
            SeccompRule::new(vec![cond])
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    rules.insert(libc::SYS_clone, clone_rules);
    SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        TargetArch::x86_64,
    )
    .map_err(|e| e.to_string())?
    .try_into()
    .map_err(|e: seccompiler::BackendError| e.to_string())
}

/// What the number-keyed deny filter cannot say, in one small hand-written filter:
/// - clone3 gets ENOSYS: its flags live in memory, out of a filter's reach, so libc falls back to
///   clone, whose flags the deny filter checks.
/// - every x32 call (number | 0x4000_0000) gets EPERM: x32 calls carry the x86_64 audit arch, so
///   rules keyed by x86_64 numbers would let `mount` or `unshare` through under their x32 numbers
///   on a kernel that enables the x32 ABI.
///
/// Other arches are the deny filter's to refuse.
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
        jump(libc::BPF_JEQ, AUDIT_ARCH_X86_64, 0, 3), // other arch: 5
        load(0),
        jump(libc::BPF_JGE, X32_SYSCALL_BIT, 2, 0), // x32: 6
        jump(libc::BPF_JEQ, libc::SYS_clone3 as u32, 2, 0), // clone3: 7
        ret(libc::SECCOMP_RET_ALLOW),
        ret(libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        ret(libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
    ]
}

/// Drops every capability outside KEEP_CAPS from the bounding set. After exec (as uid 0) the
/// process's permitted/effective sets equal the bounding set.
pub fn drop_bounding_caps() -> Result<(), String> {
    for cap in 0..64u32 {
        if KEEP_CAPS.contains(&cap) {
            continue;
        }
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINVAL) {
                break; // past CAP_LAST_CAP
            }
            return Err(format!("drop capability {cap}: {err}"));
        }
    }
    // SAFETY: prctl with integer arguments only.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    Ok(())
}

pub fn set_rlimits(open_files: u64) -> Result<(), String> {
    use nix::sys::resource::{setrlimit, Resource};
    setrlimit(Resource::RLIMIT_NOFILE, open_files, open_files)
        .map_err(|e| format!("RLIMIT_NOFILE={open_files}: {e}"))?;
    setrlimit(Resource::RLIMIT_CORE, 0, 0).map_err(|e| format!("RLIMIT_CORE: {e}"))?;
    Ok(())
}

/// no_new_privs, then the seccomp filters.
pub fn lock_down() -> Result<(), String> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(format!("no_new_privs: {}", std::io::Error::last_os_error()));
    }
    let deny = deny_filter().map_err(|e| format!("build seccomp filter: {e}"))?;
    seccompiler::apply_filter(&abi_filter()).map_err(|e| format!("install abi filter: {e}"))?;
    seccompiler::apply_filter(&deny).map_err(|e| format!("install seccomp filter: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_build() {
        assert!(!deny_filter().unwrap().is_empty());
        assert_eq!(abi_filter().len(), 8);
    }
}
