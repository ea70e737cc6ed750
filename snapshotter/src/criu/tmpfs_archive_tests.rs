//! The shim's tmpfs archives written and read without tar (compat/tmpfs-archive.c, part 12),
//! driven as CRIU drives them: `tar` run by execvp from a process with the shim preloaded. A
//! `tar` on PATH that always fails shows which archives never reached tar.

use std::ffi::OsStr;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::compat::{
    shim_in_temp_dir, CRIU_TAR_CREATE, CRIU_TAR_EXTRACT, PLAIN_TMPFS_ARCHIVES_ENV, SHIM,
};

/// CRIU's arguments for a tmpfs's archive, the directory given by path.
fn create_args(dir: &Path) -> Vec<&OsStr> {
    let mut a: Vec<&OsStr> = CRIU_TAR_CREATE.iter().map(OsStr::new).collect();
    a.extend([OsStr::new("--directory"), dir.as_os_str(), OsStr::new(".")]);
    a
}

fn extract_args(dir: &Path) -> Vec<&OsStr> {
    let mut a: Vec<&OsStr> = CRIU_TAR_EXTRACT.iter().map(OsStr::new).collect();
    a.extend([OsStr::new("--directory"), dir.as_os_str()]);
    a
}

struct Bench {
    /// The shim and the failing `tar`.
    _tools: tempfile::TempDir,
    /// Trees and archives, on a tmpfs as CRIU's are (a tiny file on ext4 may take no block).
    dir: tempfile::TempDir,
    shim: PathBuf,
    /// Holds a `tar` that exits 99: on PATH first, no archive can reach GNU tar.
    no_tar: PathBuf,
}

impl Bench {
    fn new() -> Option<Bench> {
        if !nix::unistd::geteuid().is_root() {
            grove_testkit::capability_missing(
                "tmpfs archive tests make device nodes and chown: root",
            );
            return None;
        }
        let (tools, shim) = shim_in_temp_dir(SHIM, "criu-shim.so")?;
        let no_tar = tools.path().join("no-tar");
        std::fs::create_dir(&no_tar).unwrap();
        std::fs::write(no_tar.join("tar"), "#!/bin/sh\nexit 99\n").unwrap();
        std::fs::set_permissions(no_tar.join("tar"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        Some(Bench {
            _tools: tools,
            dir,
            shim,
            no_tar,
        })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Runs CRIU's tar command through the shim; `with_tar`: GNU tar may be reached.
    fn tar(&self, args: &[&OsStr], input: &Path, output: &Path, with_tar: bool) -> Option<i32> {
        let mut cmd = Command::new("env");
        cmd.arg("tar")
            .args(args)
            .env("LD_PRELOAD", &self.shim)
            .env(PLAIN_TMPFS_ARCHIVES_ENV, "1")
            .stdin(std::fs::File::open(input).unwrap())
            .stdout(std::fs::File::create(output).unwrap())
            .stderr(Stdio::null());
        if !with_tar {
            let path = std::env::var_os("PATH").unwrap_or_default();
            let mut dirs = vec![self.no_tar.clone()];
            dirs.extend(std::env::split_paths(&path));
            cmd.env("PATH", std::env::join_paths(dirs).unwrap());
        }
        cmd.status().unwrap().code()
    }
}

/// One line per entry under `root` (the root itself included): what a restore must bring
/// back. Sockets are left out, as tar leaves them; mtimes in whole seconds, as tar keeps them.
fn tree(root: &Path) -> Vec<String> {
    fn walk(root: &Path, rel: &Path, out: &mut Vec<String>) {
        let p = root.join(rel);
        let m = std::fs::symlink_metadata(&p).unwrap();
        let ft = m.file_type();
        use std::os::unix::fs::FileTypeExt as _;
        if ft.is_socket() {
            return;
        }
        let what = if ft.is_dir() {
            "dir".to_string()
        } else if ft.is_symlink() {
            format!("link {}", std::fs::read_link(&p).unwrap().display())
        } else if ft.is_file() {
            format!(
                "file {}",
                blake3::hash(&std::fs::read(&p).unwrap()).to_hex()
            )
        } else if ft.is_char_device() || ft.is_block_device() {
            format!("dev {:x}", m.rdev())
        } else {
            "fifo".to_string()
        };
        // A link's own mode is not kept (it has none that counts); a directory's size counts
        // its entries, sockets too.
        let mode = if ft.is_symlink() { 0 } else { m.mode() };
        let size = if ft.is_dir() { 0 } else { m.size() };
        out.push(format!(
            "{} {what} {mode:o} {}:{} {} {}",
            rel.display(),
            m.uid(),
            m.gid(),
            m.mtime(),
            size
        ));
        if ft.is_dir() {
            let mut names: Vec<_> = std::fs::read_dir(&p)
                .unwrap()
                .flatten()
                .map(|e| e.file_name())
                .collect();
            names.sort();
            for n in names {
                walk(root, &rel.join(n), out);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, Path::new(""), &mut out);
    out
}

fn mkfifo(p: &Path) {
    nix::unistd::mkfifo(p, nix::sys::stat::Mode::from_bits_truncate(0o640)).unwrap();
}

/// What a sandbox's /dev, /tmp and /run hold, and more: every kind the archiver takes.
fn sandbox_like(src: &Path) {
    use nix::sys::stat::{mknod, Mode, SFlag};
    std::fs::create_dir_all(src.join("shm/sub")).unwrap();
    std::fs::set_permissions(src.join("shm"), std::fs::Permissions::from_mode(0o1777)).unwrap();
    std::fs::write(src.join("shm/segment"), b"kept across the snapshot").unwrap();
    std::fs::write(src.join("empty"), b"").unwrap();
    std::fs::write(src.join("one-block"), [7u8; 512]).unwrap();
    let big: Vec<u8> = (0..300_001u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(src.join("big"), &big).unwrap();
    std::fs::write(src.join("setuid"), b"#!/bin/sh\n").unwrap();
    std::fs::set_permissions(src.join("setuid"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    std::os::unix::fs::chown(src.join("shm/segment"), Some(1234), Some(5678)).unwrap();
    std::os::unix::fs::symlink("shm/segment", src.join("link")).unwrap();
    std::os::unix::fs::symlink("/proc/self/fd", src.join("fd")).unwrap();
    std::os::unix::fs::lchown(src.join("link"), Some(42), Some(43)).unwrap();
    mkfifo(&src.join("fifo"));
    mknod(
        &src.join("null"),
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(1, 3),
    )
    .unwrap();
    mknod(
        &src.join("loop"),
        SFlag::S_IFBLK,
        Mode::from_bits_truncate(0o600),
        nix::sys::stat::makedev(7, 0),
    )
    .unwrap();
    std::os::unix::net::UnixListener::bind(src.join("init.sock")).unwrap();
    // 50 + 1 + 50 + 1 + 50 bytes of directories and a file under them: ustar's prefix field.
    let deep = src
        .join("a".repeat(50))
        .join("b".repeat(50))
        .join("c".repeat(50));
    std::fs::create_dir_all(&deep).unwrap();
    std::fs::write(deep.join("f"), b"deep").unwrap();
    let old = nix::sys::time::TimeSpec::new(1_577_934_245, 0);
    nix::sys::stat::utimensat(
        None,
        &src.join("shm/sub"),
        &old,
        &old,
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .unwrap();
}

/// A tree of every kind the archiver takes is written without tar, and both GNU tar and the
/// shim without tar extract it to the same tree.
#[test]
fn archives_written_and_read_without_tar_are_what_gnu_tar_reads() {
    let Some(b) = Bench::new() else { return };
    let src = b.path("src");
    std::fs::create_dir(&src).unwrap();
    sandbox_like(&src);
    let archive = b.path("archive");
    let null = Path::new("/dev/null");
    assert_eq!(
        b.tar(&create_args(&src), null, &archive, false),
        Some(0),
        "written without tar"
    );
    let bytes = std::fs::read(&archive).unwrap();
    assert_eq!(&bytes[257..263], b"ustar\0", "a POSIX ustar archive");

    let by_gnu = b.path("by-gnu");
    std::fs::create_dir(&by_gnu).unwrap();
    let gnu = Command::new("tar")
        .args(["--extract", "--no-unquote", "--no-wildcards", "--directory"])
        .arg(&by_gnu)
        .stdin(std::fs::File::open(&archive).unwrap())
        .status()
        .unwrap();
    assert!(gnu.success());
    let by_shim = b.path("by-shim");
    std::fs::create_dir(&by_shim).unwrap();
    assert_eq!(
        b.tar(&extract_args(&by_shim), &archive, &b.path("log"), false),
        Some(0),
        "read without tar"
    );

    let want = tree(&src);
    assert!(want.iter().any(|l| l.starts_with("loop dev")), "{want:?}");
    assert!(
        !want.iter().any(|l| l.starts_with("init.sock")),
        "sockets are left out: {want:?}"
    );
    assert_eq!(tree(&by_gnu), want, "GNU tar reads what the shim wrote");
    assert_eq!(tree(&by_shim), want, "the shim reads what it wrote");

    // GNU tar's own plain archives (the images part 6 wrote) are read without tar too, but
    // for names over 100 bytes, which it writes with long-name headers that go to tar.
    let gnu_archive = b.path("gnu-archive");
    let short = b.path("short");
    std::fs::create_dir(&short).unwrap();
    assert!(Command::new("cp")
        .arg("-a")
        .arg(src.join("."))
        .arg(&short)
        .status()
        .unwrap()
        .success());
    std::fs::remove_dir_all(short.join("a".repeat(50))).unwrap();
    let created = Command::new("tar")
        .args(create_args(&short).into_iter().filter(|a| *a != "--gzip"))
        .stdout(std::fs::File::create(&gnu_archive).unwrap())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(created.success());
    let from_gnu = b.path("from-gnu");
    std::fs::create_dir(&from_gnu).unwrap();
    assert_eq!(
        b.tar(
            &extract_args(&from_gnu),
            &gnu_archive,
            &b.path("log"),
            false
        ),
        Some(0)
    );
    assert_eq!(tree(&from_gnu), tree(&short));
}

/// A hard link, a file with holes and a long link target go to GNU tar, whole: the shim's own
/// start is undone first. An archive with a long-name header is extracted by tar too.
#[test]
fn what_the_archiver_does_not_take_goes_to_tar_whole() {
    let Some(b) = Bench::new() else { return };
    let null = Path::new("/dev/null");
    type Make = fn(&Path);
    let cases: [(&str, Make); 3] = [
        ("hard link", |d| {
            std::fs::write(d.join("f"), b"x").unwrap();
            std::fs::hard_link(d.join("f"), d.join("g")).unwrap();
        }),
        ("holes", |d| {
            std::fs::File::create(d.join("sparse"))
                .unwrap()
                .set_len(1 << 20)
                .unwrap();
        }),
        ("long link target", |d| {
            std::os::unix::fs::symlink("t".repeat(150), d.join("l")).unwrap();
        }),
    ];
    for (what, make) in cases {
        let src = b.path(&format!("src-{}", what.replace(' ', "-")));
        std::fs::create_dir(&src).unwrap();
        // Beside the case, so the archiver has written something when it meets it.
        std::fs::write(src.join("plain"), b"plain").unwrap();
        make(&src);
        let archive = b.path("archive");
        assert_eq!(
            b.tar(&create_args(&src), null, &archive, false),
            Some(99),
            "{what}: tar was asked"
        );
        let left = std::fs::metadata(&archive).unwrap().len();
        assert_eq!(left, 0, "{what}: the shim's start was undone before tar");
        assert_eq!(
            b.tar(&create_args(&src), null, &archive, true),
            Some(0),
            "{what}"
        );
        let bytes = std::fs::read(&archive).unwrap();
        assert_eq!(
            &bytes[257..265],
            b"ustar  \0",
            "{what}: GNU tar's archive, from its first byte"
        );
        let out = b.path(&format!("out-{}", what.replace(' ', "-")));
        std::fs::create_dir(&out).unwrap();
        let code = b.tar(&extract_args(&out), &archive, &b.path("log"), true);
        assert_eq!(code, Some(0), "{what}");
        assert_eq!(tree(&out), tree(&src), "{what}");
    }
}

/// A ustar header (mode 0644, owner 0, mtime 1) for `name`, of `kind`, with `size` bytes.
fn header(name: &str, kind: u8, size: usize, link: &str) -> Vec<u8> {
    let mut h = vec![0u8; 512];
    h[..name.len()].copy_from_slice(name.as_bytes());
    let put =
        |h: &mut Vec<u8>, at: usize, s: String| h[at..at + s.len()].copy_from_slice(s.as_bytes());
    put(&mut h, 100, "0000644\0".into());
    put(&mut h, 108, "0000000\0".into());
    put(&mut h, 116, "0000000\0".into());
    put(&mut h, 124, format!("{size:011o}\0"));
    put(&mut h, 136, "00000000001\0".into());
    h[156] = kind;
    put(&mut h, 157, link.into());
    put(&mut h, 257, "ustar\0".into());
    put(&mut h, 263, "00".into());
    h[148..156].fill(b' ');
    let sum: u32 = h.iter().map(|b| *b as u32).sum();
    put(&mut h, 148, format!("{sum:06o}\0 "));
    h
}

fn archive_of(entries: &[(&str, u8, &[u8], &str)]) -> Vec<u8> {
    let mut a = Vec::new();
    for (name, kind, data, link) in entries {
        a.extend(header(name, *kind, data.len(), link));
        a.extend(*data);
        a.resize(a.len().div_ceil(512) * 512, 0);
    }
    a.resize(a.len() + 1024, 0);
    a
}

/// An archive naming a place outside its directory, by "..", by an absolute name or through a
/// link it made, is not extracted by the shim (and, here, by nothing else).
#[test]
fn an_extract_writes_nothing_outside_its_directory() {
    let Some(b) = Bench::new() else { return };
    let outside = b.path("outside");
    std::fs::create_dir(&outside).unwrap();
    let escape = outside.to_str().unwrap().to_string();
    let cases: [(&str, Vec<u8>); 3] = [
        (
            "dot-dot",
            archive_of(&[("./", b'5', b"", ""), ("../outside/f", b'0', b"x", "")]),
        ),
        (
            "absolute",
            archive_of(&[(&format!("{escape}/f"), b'0', b"x", "")]),
        ),
        (
            "through a link",
            archive_of(&[("./l", b'2', b"", &escape), ("./l/f", b'0', b"x", "")]),
        ),
    ];
    for (what, bytes) in cases {
        let archive = b.path("crafted");
        std::fs::write(&archive, &bytes).unwrap();
        let target = b.path("target");
        let _ = std::fs::remove_dir_all(&target);
        std::fs::create_dir(&target).unwrap();
        let code = b.tar(&extract_args(&target), &archive, &b.path("log"), false);
        assert_eq!(code, Some(99), "{what}: left to tar");
        assert!(
            !outside.join("f").exists(),
            "{what}: nothing written outside"
        );
    }
    // The same shape inside the directory is extracted.
    let fine = archive_of(&[
        ("./", b'5', b"", ""),
        ("./d", b'5', b"", ""),
        ("./d/f", b'0', b"x", ""),
    ]);
    let archive = b.path("crafted");
    std::fs::write(&archive, fine).unwrap();
    let target = b.path("target");
    let _ = std::fs::remove_dir_all(&target);
    std::fs::create_dir(&target).unwrap();
    assert_eq!(
        b.tar(&extract_args(&target), &archive, &b.path("log"), false),
        Some(0)
    );
    assert_eq!(std::fs::read(target.join("d/f")).unwrap(), b"x");
}
