//! Device allowlist: a sandbox opens only the harmless character devices /dev holds (null, zero,
//! full, random, urandom, its controlling tty, its own devpts), whatever nodes it finds or makes.
//! v1: the devices controller (`devices.deny a`, then the allows). v2: a
//! BPF_PROG_TYPE_CGROUP_DEVICE program on the sandbox's cgroup2 dir, loaded once per process.
//! Making nodes (`m`) stays allowed, as in the OCI defaults: without CAP_MKNOD a sandbox cannot,
//! and setup's own mknods of /dev happen after it joined its cgroups.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::OnceLock;

use super::{CgroupError, CgroupFs, Controller, Result};
use crate::sys::{self, BpfInsn as Insn};
use crate::types::Limits;

/// Character devices (major, minor; None: any minor) a sandbox may read and write: the OCI
/// default allowlist less /dev/console (5:1), which in a sandbox would be the host's console.
/// 5:2 and 136:* resolve to the devpts instance beside the node, i.e. the sandbox's own.
pub const ALLOWED_CHAR_DEVICES: &[(u32, Option<u32>)] = &[
    (1, Some(3)), // null
    (1, Some(5)), // zero
    (1, Some(7)), // full
    (1, Some(8)), // random
    (1, Some(9)), // urandom
    (5, Some(0)), // tty: the caller's own controlling terminal
    (5, Some(2)), // ptmx
    (136, None),  // pts/*
];

pub struct Devices;

/// The v1 rules, in the order written: deny all, then the allows.
pub fn v1_rules() -> Vec<String> {
    let mut r = vec!["c *:* m".to_string(), "b *:* m".to_string()];
    for (major, minor) in ALLOWED_CHAR_DEVICES {
        let minor = minor.map_or("*".to_string(), |m| m.to_string());
        r.push(format!("c {major}:{minor} rwm"));
    }
    r
}

impl Controller for Devices {
    fn v1_name(&self) -> &'static str {
        "devices"
    }
    fn apply_v1(&self, fs: &dyn CgroupFs, dir: &Path, _l: &Limits) -> Result<()> {
        let deny = dir.join("devices.deny");
        fs.write(&deny, "a")
            .map_err(|e| CgroupError::new("write", &deny, e))?;
        let allow = dir.join("devices.allow");
        for rule in v1_rules() {
            fs.write(&allow, &rule)
                .map_err(|e| CgroupError::new("write", &allow, e))?;
        }
        Ok(())
    }
    fn apply_v2(&self, fs: &dyn CgroupFs, dir: &Path, _l: &Limits) -> Result<()> {
        fs.attach_device_filter(dir)
            .map_err(|e| CgroupError::new("attach device filter", dir, e))
    }
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: dst | (src << 4),
        off,
        imm,
    }
}

// Opcodes (linux/bpf.h, bpf_common.h).
const LDX_W: u8 = 0x61; // BPF_LDX | BPF_MEM | BPF_W
const AND_K: u8 = 0x57; // BPF_ALU64 | BPF_AND | BPF_K
const RSH_K: u8 = 0x77; // BPF_ALU64 | BPF_RSH | BPF_K
const MOV_K: u8 = 0xb7; // BPF_ALU64 | BPF_MOV | BPF_K
const JEQ_K: u8 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const JNE_K: u8 = 0x55; // BPF_JMP | BPF_JNE | BPF_K
const JA: u8 = 0x05; // BPF_JMP | BPF_JA
const EXIT: u8 = 0x95; // BPF_JMP | BPF_EXIT

const DEVCG_DEV_CHAR: i32 = 2;
const DEVCG_ACC_MKNOD: i32 = 1;

/// The device program: struct bpf_cgroup_dev_ctx { u32 access_type (access << 16 | type);
/// u32 major; u32 minor; } in r1; returns 1 to allow, 0 to refuse (EPERM).
fn device_program() -> Vec<Insn> {
    let mut p = vec![
        insn(LDX_W, 2, 1, 0, 0),
        insn(LDX_W, 3, 1, 0, 0),
        insn(AND_K, 2, 0, 0, 0xffff), // r2: type
        insn(RSH_K, 3, 0, 0, 16),     // r3: access
        insn(LDX_W, 4, 1, 4, 0),      // r4: major
        insn(LDX_W, 5, 1, 8, 0),      // r5: minor
    ];
    let (mut to_allow, mut to_deny) = (vec![p.len()], vec![]);
    p.push(insn(JEQ_K, 3, 0, 0, DEVCG_ACC_MKNOD));
    to_deny.push(p.len());
    p.push(insn(JNE_K, 2, 0, 0, DEVCG_DEV_CHAR));
    for &(major, minor) in ALLOWED_CHAR_DEVICES {
        match minor {
            Some(minor) => {
                p.push(insn(JNE_K, 4, 0, 2, major as i32));
                p.push(insn(JNE_K, 5, 0, 1, minor as i32));
            }
            None => p.push(insn(JNE_K, 4, 0, 1, major as i32)),
        }
        to_allow.push(p.len());
        p.push(insn(JA, 0, 0, 0, 0));
    }
    let deny = p.len();
    p.extend([insn(MOV_K, 0, 0, 0, 0), insn(EXIT, 0, 0, 0, 0)]);
    let allow = p.len();
    p.extend([insn(MOV_K, 0, 0, 0, 1), insn(EXIT, 0, 0, 0, 0)]);
    for (jumps, target) in [(to_allow, allow), (to_deny, deny)] {
        for i in jumps {
            p[i].off = (target - i - 1) as i16;
        }
    }
    p
}

const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
/// Programs of ancestors (e.g. systemd's) keep running too; all must allow.
const BPF_F_ALLOW_MULTI: u32 = 2;

fn load_program() -> io::Result<OwnedFd> {
    let mut name = [0u8; 16];
    name[..13].copy_from_slice(b"grove_devices");
    sys::bpf_prog_load(BPF_PROG_TYPE_CGROUP_DEVICE, &device_program(), c"GPL", name)
}

/// Attaches the device program to the cgroup2 dir `dir`; it stays attached until the cgroup is
/// removed. The program is loaded on first use and shared by every sandbox of this process.
pub fn attach_device_filter(dir: &Path) -> io::Result<()> {
    static PROG: OnceLock<std::result::Result<OwnedFd, i32>> = OnceLock::new();
    let prog = PROG
        .get_or_init(|| load_program().map_err(|e| e.raw_os_error().unwrap_or(libc::EIO)))
        .as_ref()
        .map_err(|&errno| io::Error::from_raw_os_error(errno))?;
    let cg = std::fs::File::open(dir)?;
    sys::bpf_prog_attach(
        cg.as_fd(),
        prog.as_fd(),
        BPF_CGROUP_DEVICE,
        BPF_F_ALLOW_MULTI,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the program the way the kernel would, on one (type, access, major, minor).
    fn run(prog: &[Insn], ty: i32, access: i32, major: u32, minor: u32) -> i64 {
        let ctx = [((access << 16) | ty) as u32, major, minor];
        let mut r = [0i64; 11];
        let mut pc = 0usize;
        loop {
            let i = prog[pc];
            let (dst, src) = ((i.regs & 0xf) as usize, (i.regs >> 4) as usize);
            pc += 1;
            let jump = |cond: bool, pc: &mut usize| {
                if cond {
                    *pc = (*pc as i64 + i64::from(i.off)) as usize;
                }
            };
            match i.code {
                LDX_W => {
                    assert_eq!(src, 1);
                    r[dst] = i64::from(ctx[i.off as usize / 4]);
                }
                AND_K => r[dst] &= i64::from(i.imm),
                RSH_K => r[dst] >>= i.imm,
                MOV_K => r[dst] = i64::from(i.imm),
                JEQ_K => jump(r[dst] == i64::from(i.imm), &mut pc),
                JNE_K => jump(r[dst] != i64::from(i.imm), &mut pc),
                JA => jump(true, &mut pc),
                EXIT => return r[0],
                c => panic!("opcode {c:#x}"),
            }
        }
    }

    #[test]
    fn device_program_allows_only_the_list() {
        let p = device_program();
        let (blk, chr) = (1, DEVCG_DEV_CHAR);
        let rw = 2 | 4;
        for (major, minor) in [(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 2)] {
            assert_eq!(run(&p, chr, rw, major, minor), 1, "{major}:{minor}");
        }
        assert_eq!(run(&p, chr, rw, 136, 7), 1);
        for (major, minor) in [(10, 232), (10, 126), (1, 11), (10, 237), (10, 229), (4, 1)] {
            assert_eq!(run(&p, chr, rw, major, minor), 0, "{major}:{minor}");
            assert_eq!(run(&p, chr, 2, major, minor), 0, "{major}:{minor} read");
        }
        assert_eq!(run(&p, chr, rw, 5, 1), 0, "console");
        assert_eq!(run(&p, chr, rw, 1, 1), 0, "mem");
        assert_eq!(run(&p, blk, rw, 7, 0), 0, "loop0");
        assert_eq!(
            run(&p, blk, 2, 1, 3),
            0,
            "a block device numbered like null"
        );
        assert_eq!(
            run(&p, blk, DEVCG_ACC_MKNOD, 7, 0),
            1,
            "mknod is CAP_MKNOD's to refuse"
        );
    }

    #[test]
    fn v1_rules_match_the_list() {
        let r = v1_rules();
        assert_eq!(r[..2], ["c *:* m", "b *:* m"]);
        assert!(r.contains(&"c 136:* rwm".to_string()));
        assert!(r.contains(&"c 1:3 rwm".to_string()));
        assert_eq!(r.len(), 2 + ALLOWED_CHAR_DEVICES.len());
    }
}
