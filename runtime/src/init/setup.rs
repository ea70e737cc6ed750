//! `grove-init --setup`: started by the runtime as pid 1 of fresh mount, pid, net, uts and ipc
//! namespaces (see `spawner`), it joins the sandbox's cgroups, enters a cgroup namespace rooted
//! there, builds the sandbox's mount table, pivots into the root, hardens itself and re-execs the
//! init server from inside the sandbox (so its exe is visible to CRIU).
//!
//! Protocol on stdout (to the runtime): `ready` (from the server, once its socket listens) or
//! `error <message>`.

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::unix::fs::{symlink, DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use nix::unistd::{chdir, pivot_root, sethostname, setsid};

use super::harden;
use super::step::{io, sys, StepError};
use crate::proto::{SetupConfig, INIT_PATH, LOG_DIR, MASK_DIR};

/// Why setup failed. Its text is what grove-init sends the runtime (`error <text>` on stdout)
/// before it exits.
#[derive(Debug, thiserror::Error)]
enum SetupError {
    #[error(transparent)]
    Step(#[from] StepError),
    #[error("parse config: {0}")]
    Config(serde_json::Error),
    #[error("not pid 1 of a new pid namespace (the runtime starts grove-init --setup)")]
    NotPid1,
    #[error("{0}")]
    Harden(#[from] harden::HardenError),
    #[error("INIT_PATH has no parent")]
    InitPath,
    #[error("mount source is not UTF-8")]
    NotUtf8,
}

/// What a setup step returns.
type SetupResult<T> = Result<T, SetupError>;

/// Entry point of sandbox pid 1 before it execs the server; returns only by exiting.
pub fn main() -> ! {
    let e = match setup() {
        Ok(never) => match never {},
        Err(e) => e,
    };
    println!("error {e}");
    let _ = std::io::stdout().flush();
    std::process::exit(1)
}

fn setup() -> SetupResult<std::convert::Infallible> {
    grove_sys::fd::close_from(3);
    let mut raw = Vec::new();
    std::io::stdin()
        .read_to_end(&mut raw)
        .map_err(io("read config"))?;
    let cfg: SetupConfig = serde_json::from_slice(&raw).map_err(SetupError::Config)?;
    if std::process::id() != 1 {
        return Err(SetupError::NotPid1);
    }
    // "0" is the writer itself (a pid here would be read in this pid namespace). In a user
    // namespace the runtime has placed us already: the files are host root's.
    let join: &[String] = if cfg.userns { &[] } else { &cfg.cgroup_procs };
    for procs in join {
        std::fs::write(procs, "0").map_err(io(format!("join cgroup {procs}")))?;
    }
    unshare(CloneFlags::CLONE_NEWCGROUP).map_err(sys("unshare cgroup namespace"))?;
    stage2(&cfg)
}

fn mnt(
    src: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> SetupResult<()> {
    mount(src, target, fstype, flags, data).map_err(|errno| {
        let step = format!(
            "mount {} on {}",
            fstype.or(src).unwrap_or("-"),
            target.display()
        );
        StepError::Sys { step, errno }.into()
    })
}

fn ensure_dir(p: &Path, mode: u32) -> SetupResult<()> {
    if !p.is_dir() {
        std::fs::DirBuilder::new()
            .mode(mode)
            .recursive(true)
            .create(p)
            .map_err(io(format!("mkdir {}", p.display())))?;
    }
    Ok(())
}

const NOSUID_NODEV_NOEXEC: MsFlags = MsFlags::MS_NOSUID
    .union(MsFlags::MS_NODEV)
    .union(MsFlags::MS_NOEXEC);

/// Sandbox pid 1 before exec: returns only on error.
fn stage2(cfg: &SetupConfig) -> SetupResult<std::convert::Infallible> {
    mnt(
        None,
        Path::new("/"),
        None,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None,
    )?;
    let root = Path::new(&cfg.root);
    mnt(
        Some(&cfg.root),
        root,
        None,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None,
    )?;

    let proc_dir = root.join("proc");
    ensure_dir(&proc_dir, 0o555)?;
    mnt(
        Some("proc"),
        &proc_dir,
        Some("proc"),
        NOSUID_NODEV_NOEXEC,
        None,
    )?;

    setup_dev(root, cfg)?;

    let sysfs = root.join("sys");
    ensure_dir(&sysfs, 0o555)?;
    mnt(
        Some("sysfs"),
        &sysfs,
        Some("sysfs"),
        NOSUID_NODEV_NOEXEC | MsFlags::MS_RDONLY,
        None,
    )?;

    let tmp = root.join("tmp");
    ensure_dir(&tmp, 0o1777)?;
    let data = format!("mode=1777,size={}m", cfg.tmp_size_mb.max(1));
    mnt(
        Some("tmpfs"),
        &tmp,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(&data),
    )?;

    setup_run(root, cfg)?;
    mask_paths(root)?;

    chdir(root).map_err(sys("chdir root"))?;
    pivot_root(".", ".").map_err(sys("pivot_root"))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(sys("detach old root"))?;
    chdir("/").map_err(sys("chdir /"))?;

    sethostname(&cfg.hostname).map_err(sys("sethostname"))?;
    grove_sys::net::loopback_up().map_err(io("bring up lo"))?;
    setsid().map_err(sys("setsid"))?;

    // stdin -> /dev/null; stdout stays the pipe to the runtime until the server says ready.
    let null = std::fs::File::open("/dev/null").map_err(io("open /dev/null"))?;
    nix::unistd::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), 0).map_err(sys("dup2"))?;
    drop(null);
    grove_sys::fd::close_from(3);

    harden::set_rlimits(cfg.open_files)?;
    harden::drop_bounding_caps(&cfg.extra_caps)?;
    harden::lock_down()?;

    let path = CString::new(INIT_PATH).expect("no NUL");
    let argv = [
        CString::new("grove-init").expect("no NUL"),
        CString::new("--serve").expect("no NUL"),
    ];
    let env: [CString; 0] = [];
    let e = nix::unistd::execve(&path, &argv, &env).unwrap_err();
    Err(sys(format!("exec {INIT_PATH}"))(e).into())
}

/// /dev is a tmpfs without `nodev`: its nodes are made here with mknod and must open. The root
/// bind is not `nodev` yet either: with `nodev` or `nosuid` on it the snapshotter's `fork` test
/// (which races a lazy-pages daemon) failed far more often, not understood yet. What keeps other
/// device nodes shut, in /dev, the root or an upload, is that a sandbox cannot make them
/// (CAP_MKNOD is dropped, see `harden::KEEP_CAPS`) and its device allowlist (cgroup `devices`),
/// which refuses any device outside /dev's few wherever its node lies.
///
/// /dev/shm is a directory of this tmpfs, not a tmpfs of its own, and /dev's size is its nodes'
/// 64 KiB plus /dev/shm's budget. A mount fewer saves every CRIU dump and restore of the
/// sandbox one `tar --gzip` (5-10 ms each here: CRIU archives each tmpfs with its own tar), and a
/// superblock fewer saves every memory cgroup on the node a share of its shrinker state
/// (docs/architecture.md, "What an idle sandbox costs the kernel").
fn setup_dev(root: &Path, cfg: &SetupConfig) -> SetupResult<()> {
    let dev = root.join("dev");
    ensure_dir(&dev, 0o755)?;
    let data = format!("mode=755,size={}k", 64 + cfg.shm_size_mb.max(1) * 1024);
    mnt(
        Some("tmpfs"),
        &dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some(&data),
    )?;
    // Device nodes are made with mknod (not bind mounts from the host): CRIU then dumps /dev as plain
    // tmpfs content and needs no external-mount declarations for them. In a user namespace nodes
    // cannot be made (and would not open on its own tmpfs): the host's are bound instead.
    for (name, major, minor) in crate::proto::DEV_NODES {
        let p = dev.join(name);
        if cfg.userns {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(true)
                .write(true)
                .mode(0o666)
                .open(&p)
                .map_err(io(format!("create {}", p.display())))?;
            mnt(
                Some(&format!("/dev/{name}")),
                &p,
                None,
                MsFlags::MS_BIND,
                None,
            )?;
            continue;
        }
        mknod(
            &p,
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            makedev(major, minor),
        )
        .map_err(sys(format!("mknod {}", p.display())))?;
        // mknod honours the umask; make the mode exact.
        nix::sys::stat::fchmodat(
            None,
            &p,
            Mode::from_bits_truncate(0o666),
            nix::sys::stat::FchmodatFlags::FollowSymlink,
        )
        .map_err(sys(format!("chmod {}", p.display())))?;
    }
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
        ("core", "/proc/kcore"),
    ] {
        symlink(target, dev.join(link)).map_err(io(format!("symlink /dev/{link}")))?;
    }
    let pts = dev.join("pts");
    ensure_dir(&pts, 0o755)?;
    mnt(
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
    )?;
    let shm = dev.join("shm");
    ensure_dir(&shm, 0o1777)?;
    // mkdir honours the umask; make the mode exact (sticky, writable by all, as a tmpfs's own).
    nix::sys::stat::fchmodat(
        None,
        &shm,
        Mode::from_bits_truncate(0o1777),
        nix::sys::stat::FchmodatFlags::FollowSymlink,
    )
    .map_err(sys(format!("chmod {}", shm.display())))?;
    Ok(())
}

/// /run as a small tmpfs holding /run/grove (socket, logs) and the init binary's mount point.
fn setup_run(root: &Path, cfg: &SetupConfig) -> SetupResult<()> {
    let run = root.join("run");
    ensure_dir(&run, 0o755)?;
    mnt(
        Some("tmpfs"),
        &run,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=755,size=16m"),
    )?;
    ensure_dir(&run.join("lock"), 0o1777)?;
    let grove = root
        .join(INIT_PATH.trim_start_matches('/'))
        .parent()
        .map(Path::to_path_buf);
    let grove = grove.ok_or(SetupError::InitPath)?;
    ensure_dir(&grove, 0o700)?;
    ensure_dir(&root.join(LOG_DIR.trim_start_matches('/')), 0o700)?;
    let target = root.join(INIT_PATH.trim_start_matches('/'));
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o500)
        .open(&target)
        .map_err(io(format!("create {}", target.display())))?;
    mnt(
        Some(&cfg.init_binary),
        &target,
        None,
        MsFlags::MS_BIND,
        None,
    )?;
    mnt(
        None,
        &target,
        None,
        MsFlags::MS_BIND
            | MsFlags::MS_REMOUNT
            | MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV,
        None,
    )
}

/// Masks like runc's defaults.
fn mask_paths(root: &Path) -> SetupResult<()> {
    let null = root.join("dev/null");
    for f in [
        "proc/kcore",
        "proc/keys",
        "proc/timer_list",
        "proc/sched_debug",
        "proc/latency_stats",
        "proc/timer_stats",
    ] {
        let p = root.join(f);
        if p.exists() {
            mnt(
                Some(null.to_str().unwrap_or("/dev/null")),
                &p,
                None,
                MsFlags::MS_BIND,
                None,
            )?;
        }
    }
    // Directories are masked with a read-only bind of one empty directory in /run's tmpfs, not
    // with a tmpfs each as runc does: CRIU archives every tmpfs with tar (an exec or two each,
    // at every snapshot and every restore), while a bind of a dumped tmpfs costs it nothing.
    let empty = root.join(MASK_DIR.trim_start_matches('/'));
    ensure_dir(&empty, 0o555)?;
    for d in [
        "proc/acpi",
        "proc/scsi",
        "sys/firmware",
        "sys/devices/virtual/powercap",
    ] {
        let p = root.join(d);
        if p.is_dir() {
            bind_read_only(&empty, &p, MsFlags::empty())?;
        }
    }
    for ro in [
        "proc/bus",
        "proc/fs",
        "proc/irq",
        "proc/sys",
        "proc/sysrq-trigger",
    ] {
        let p = root.join(ro);
        if p.exists() {
            bind_read_only(&p, &p, MsFlags::MS_REC)?;
        }
    }
    Ok(())
}

/// Binds `src` on `target` (with `extra` flags, e.g. MS_REC), then makes the bind read-only,
/// nosuid, nodev and noexec: a bind mount takes those flags only on a remount.
fn bind_read_only(src: &Path, target: &Path, extra: MsFlags) -> SetupResult<()> {
    let src = src.to_str().ok_or(SetupError::NotUtf8)?;
    mnt(Some(src), target, None, MsFlags::MS_BIND | extra, None)?;
    mnt(
        None,
        target,
        None,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | NOSUID_NODEV_NOEXEC,
        None,
    )
}
