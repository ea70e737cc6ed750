//! The compatibility shim preloaded into CRIU (see compat/criu-shim.c): without it CRIU 4.1 cannot
//! dump TCP/UDP sockets on kernels >= 6.16, nor restore a tree with a dead session leader (the
//! root task then fails to re-enter its own mount namespace). Held in a memfd so no file is left on disk;
//! the child gets it at fd [`SHIM_FD`] and loads it through /proc/self/fd. The shim also moves
//! CRIU's kernel-feature cache to a tmpfs where /run is none (see [`kdat_cache`]).

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use std::path::{Path, PathBuf};

pub(crate) const SHIM: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/criu-shim.so"));
/// The build with the userfaultfd write-protect part (see compat/criu-shim.c, 4).
const SHIM_UFFD: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/criu-shim-uffd.so"));

/// The fd number the shim has in the CRIU process.
pub const SHIM_FD: RawFd = 3;

#[derive(Debug)]
pub struct Shim {
    fd: OwnedFd,
}

impl Shim {
    /// None when the shim was not built (no C compiler at build time).
    pub fn load() -> Option<Shim> {
        Self::load_bytes(SHIM)
    }

    /// The build for dumps of sandboxes tracked by userfaultfd write-protect.
    pub fn load_uffd() -> Option<Shim> {
        Self::load_bytes(SHIM_UFFD)
    }

    fn load_bytes(bytes: &[u8]) -> Option<Shim> {
        if bytes.is_empty() {
            return None;
        }
        let fd = match memfd_create(c"grove-criu-shim", MemFdCreateFlag::MFD_CLOEXEC) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!(error = %std::io::Error::from(e), "memfd for the criu shim");
                return None;
            }
        };
        let mut f = std::fs::File::from(fd);
        if let Err(e) = f.write_all(bytes) {
            tracing::warn!(error = %e, "writing the criu shim");
            return None;
        }
        Some(Shim { fd: f.into() })
    }

    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The LD_PRELOAD value for the child.
    pub fn preload_path() -> String {
        format!("/proc/self/fd/{SHIM_FD}")
    }
}

/// Set to "1" for a dump whose sandbox Grove tracks with userfaultfd write-protect: the shim
/// then answers CRIU's soft-dirty questions from the tracking (see compat/criu-shim.c, 4).
pub const UFFD_WP_ENV: &str = "GROVE_UFFD_WP";

/// Set to "1" for a dump that opens no netfilter socket but CRIU's conntrack dumps: the shim
/// then answers those itself where the namespace's table is empty (compat/criu-shim.c, 5).
pub const EMPTY_CONNTRACK_ENV: &str = "GROVE_EMPTY_CONNTRACK";

/// Set to "1" for a dump: the shim then has CRIU's tmpfs archives written without gzip, and
/// restores read either kind (compat/criu-shim.c, 6).
pub const PLAIN_TMPFS_ARCHIVES_ENV: &str = "GROVE_PLAIN_TMPFS_ARCHIVES";

/// Set to "1" for a dump with the userfaultfd build: the shim then answers TCP sock_diag dumps
/// of a namespace with no TCP socket itself (compat/criu-shim.c, 9).
pub const EMPTY_TCP_DIAG_ENV: &str = "GROVE_EMPTY_TCP_DIAG";

/// Milliseconds a lazy-pages daemon's background copy waits for the restored tree to go without
/// a fault (compat/criu-shim.c, 10); 0: it does not wait.
pub const LAZY_QUIET_ENV: &str = "GROVE_LAZY_QUIET_MS";

/// Names the fd a dump's CRIU, started before the freeze, waits on before its main
/// (compat/criu-shim.c, 8; see `criu::EarlyDump`).
pub const START_FD_ENV: &str = "GROVE_START_FD";

/// Where that fd is in the CRIU process (a dump inherits no network namespace fd).
pub const START_FD: RawFd = 5;

/// Set to "1" for a dump with the userfaultfd build: the shim then moves each pipe of pages
/// into its image with one splice instead of one per pagemap entry (compat/criu-shim.c, 7).
/// groved sets it on every tracked dump unless its own environment has it at "0".
pub const COALESCE_PAGE_WRITES_ENV: &str = "GROVE_COALESCE_PAGE_WRITES";

/// Set to "1" for a dump with the userfaultfd build that is started before the freeze: once
/// started, the shim reads the tree's smaps ahead of CRIU on a thread of its own
/// (compat/criu-shim.c, 14). groved sets it on every tracked dump unless its own environment
/// has it at "0".
pub const READ_AHEAD_SMAPS_ENV: &str = "GROVE_READ_AHEAD_SMAPS";

/// Set to "1" for a dump with the userfaultfd build and [`COALESCE_PAGE_WRITES_ENV`]: the
/// shim then writes each pipe of pages into its image on a thread of its own while CRIU goes
/// on, and CRIU's exit waits for it (compat/criu-shim.c, 15). groved sets it on every tracked
/// dump unless its own environment has it at "0".
pub const ASYNC_PAGE_WRITES_ENV: &str = "GROVE_ASYNC_PAGE_WRITES";

/// The variable through which the shim learns where the kernel-feature cache goes.
pub const KDAT_ENV: &str = "GROVE_CRIU_KDAT";

/// CRIU keeps its kernel-feature cache (`/run/criu.kdat`) only on a tmpfs, so that it never
/// outlives a reboot; without it every CRIU run probes the kernel again (about 30 ms on this
/// VM, for each dump, restore and lazy-pages daemon). None where /run is a tmpfs (CRIU's own
/// place works) or no tmpfs is at hand; else `/dev/shm/criu.kdat`.
pub fn kdat_cache() -> Option<PathBuf> {
    kdat_cache_for(Path::new("/run"), Path::new("/dev/shm"))
}

fn kdat_cache_for(run: &Path, shm: &Path) -> Option<PathBuf> {
    if is_tmpfs(run) || !is_tmpfs(shm) {
        return None;
    }
    Some(shm.join("criu.kdat"))
}

fn is_tmpfs(dir: &Path) -> bool {
    nix::sys::statfs::statfs(dir)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
}

/// CRIU's tar options for a tmpfs's archive and its extract (criu/filesystems.c), before
/// `--directory <dir>` (and the create's "."): what the shim's tests run tar with.
#[cfg(test)]
pub(crate) const CRIU_TAR_CREATE: [&str; 9] = [
    "--create",
    "--gzip",
    "--no-unquote",
    "--no-wildcards",
    "--one-file-system",
    "--check-links",
    "--preserve-permissions",
    "--sparse",
    "--numeric-owner",
];
#[cfg(test)]
pub(crate) const CRIU_TAR_EXTRACT: [&str; 4] =
    ["--extract", "--gzip", "--no-unquote", "--no-wildcards"];

/// For tests: `bytes` (a build of the shim) written to `name` in a fresh temp dir, kept while
/// the dir lives; None, said loudly, where the shim was not built (no C compiler).
#[cfg(test)]
pub(crate) fn shim_in_temp_dir(
    bytes: &[u8],
    name: &str,
) -> Option<(tempfile::TempDir, std::path::PathBuf)> {
    if bytes.is_empty() {
        grove_testkit::capability_missing("the shim was not built (no C compiler)");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let shim = dir.path().join(name);
    std::fs::write(&shim, bytes).unwrap();
    Some((dir, shim))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn kdat_cache_goes_to_a_tmpfs_only_where_run_is_none() {
        let disk = tempfile::tempdir_in("/var/tmp").unwrap();
        let shm = Path::new("/dev/shm");
        if !is_tmpfs(shm) || is_tmpfs(disk.path()) {
            grove_testkit::capability_missing("needs /dev/shm on a tmpfs and /var/tmp on disk");
            return;
        }
        assert_eq!(
            kdat_cache_for(disk.path(), shm),
            Some(shm.join("criu.kdat"))
        );
        assert_eq!(
            kdat_cache_for(shm, shm),
            None,
            "/run on tmpfs: CRIU's own place"
        );
        assert_eq!(
            kdat_cache_for(disk.path(), disk.path()),
            None,
            "no tmpfs at hand"
        );
    }

    /// A CRIU-shaped conntrack dump request, from a process with the shim preloaded; prints
    /// the socket's type (3 raw netlink, 5 the shim's seqpacket) and how many entries came.
    const CT_DUMP: &str = r#"
import socket, struct, sys
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)
kind = s.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
req = struct.pack("=IHHII", 20, (1 << 8) | 1, 0x301, 24680, 0) + struct.pack("=BBH", 0, 0, 0)
s.sendmsg([req], [], 0, (0, 0))
n = 0
while True:
    d = s.recv(65536)
    at, done = 0, False
    while at + 16 <= len(d):
        l, ty, fl, seq, pid = struct.unpack_from("=IHHII", d, at)
        if ty == 3:
            done = True
            break
        if ty == 2:
            sys.exit("netlink error %d" % struct.unpack_from("=i", d, at + 16)[0])
        n += 1
        at += (l + 3) & ~3
    if done:
        break
print(kind, n)
"#;

    /// Runs `python3 -c script args…` with `shim` preloaded and `env` set; its stdout, once it
    /// exited 0 (else the test fails with its stderr).
    fn python_with_shim(
        shim: &Path,
        script: &str,
        args: &[&OsStr],
        env: &[(&str, &str)],
    ) -> String {
        let out = std::process::Command::new("python3")
            .args(["-c", script])
            .args(args)
            .env("LD_PRELOAD", shim)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Words of the form `a/b`, as number pairs.
    fn pairs<T: std::str::FromStr>(text: &str) -> Vec<(T, T)>
    where
        T::Err: std::fmt::Debug,
    {
        text.split_whitespace()
            .map(|w| {
                let (a, b) = w.split_once('/').unwrap();
                (a.parse().unwrap(), b.parse().unwrap())
            })
            .collect()
    }

    fn ct_dump(shim: &Path, empty_conntrack: bool) -> (i32, usize) {
        let env: &[(&str, &str)] = match empty_conntrack {
            true => &[(EMPTY_CONNTRACK_ENV, "1")],
            false => &[],
        };
        let text = python_with_shim(shim, CT_DUMP, &[], env);
        let mut it = text.split_whitespace().map(|w| w.parse::<usize>().unwrap());
        (it.next().unwrap() as i32, it.next().unwrap())
    }

    /// The shim answers an empty namespace's conntrack dump itself, only when asked to, and
    /// passes a namespace with entries through to the kernel, which lists them.
    #[test]
    fn empty_conntrack_is_answered_without_the_kernel_and_only_when_empty() {
        let Some((_dir, shim)) = shim_in_temp_dir(SHIM, "criu-shim.so") else {
            return;
        };
        if !nix::unistd::geteuid().is_root() || !Path::new("/usr/sbin/nft").exists() {
            grove_testkit::capability_missing("needs root and nft for a conntrack entry");
            return;
        }
        let seen = std::thread::spawn(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            grove_sys::net::loopback_up().unwrap();
            let empty = (ct_dump(&shim, true), ct_dump(&shim, false));
            // A rule that matches on conntrack state turns conntrack on in this namespace; a
            // datagram over lo then makes an entry.
            let nft = std::process::Command::new("/usr/sbin/nft")
                .args([
                    "add table ip t; add chain ip t c { type filter hook output priority 0; }; \
                     add rule ip t c ct state new counter",
                ])
                .status()
                .unwrap();
            assert!(nft.success());
            let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            udp.send_to(b"x", udp.local_addr().unwrap()).unwrap();
            (empty, ct_dump(&shim, true))
        })
        .join()
        .unwrap();
        let ((asked, not_asked), with_entry) = seen;
        assert_eq!(
            asked,
            (libc::SOCK_SEQPACKET, 0),
            "empty, asked: the shim answers"
        );
        assert_eq!(
            not_asked,
            (libc::SOCK_RAW, 0),
            "not asked: the kernel answers"
        );
        assert_eq!(with_entry.0, libc::SOCK_RAW, "an entry: the kernel answers");
        assert!(with_entry.1 >= 1, "and lists it: {with_entry:?}");
    }

    /// CRIU's two tar commands for a tmpfs, run as CRIU runs them (execvp from a process with
    /// the shim preloaded: coreutils' `env` execs its command with execvp). `input` is tar's
    /// stdin, `output` its stdout.
    fn criu_tar(shim: &Path, args: &[&str], plain: bool, input: &Path, output: &Path) -> bool {
        let mut cmd = std::process::Command::new("env");
        cmd.arg("tar")
            .args(args)
            .env("LD_PRELOAD", shim)
            .stdin(std::fs::File::open(input).unwrap())
            .stdout(std::fs::File::create(output).unwrap())
            .stderr(std::process::Stdio::null());
        if plain {
            cmd.env(PLAIN_TMPFS_ARCHIVES_ENV, "1");
        }
        cmd.status().unwrap().success()
    }

    fn is_gzip(archive: &Path) -> bool {
        std::fs::read(archive).unwrap().starts_with(&[0x1f, 0x8b])
    }

    /// A dump that asks writes its tmpfs archive without gzip, one that does not writes gzip as
    /// CRIU asks; a restore extracts either, and only the shim makes the plain one extract.
    #[test]
    fn tmpfs_archives_are_plain_when_asked_and_either_kind_restores() {
        let Some((dir, shim)) = shim_in_temp_dir(SHIM, "criu-shim.so") else {
            return;
        };
        let src = dir.path().join("src");
        std::fs::create_dir_all(src.join("shm")).unwrap();
        std::fs::write(src.join("shm/segment"), b"kept across the snapshot").unwrap();
        std::os::unix::fs::symlink("shm/segment", src.join("link")).unwrap();
        let src_s = src.to_str().unwrap();
        let create: Vec<&str> = CRIU_TAR_CREATE
            .into_iter()
            .chain(["--directory", src_s, "."])
            .collect();
        let null = Path::new("/dev/null");
        let (plain, gz) = (dir.path().join("plain"), dir.path().join("gz"));
        assert!(criu_tar(&shim, &create, true, null, &plain));
        assert!(criu_tar(&shim, &create, false, null, &gz));
        assert!(!is_gzip(&plain), "asked: no gzip");
        assert!(is_gzip(&gz), "not asked: gzip, as CRIU asks");
        for (archive, with_shim) in [(&plain, true), (&gz, true), (&gz, false)] {
            let out = tempfile::tempdir_in(dir.path()).unwrap();
            let out_s = out.path().to_str().unwrap();
            let extract: Vec<&str> = CRIU_TAR_EXTRACT
                .into_iter()
                .chain(["--directory", out_s])
                .collect();
            let used = if with_shim {
                shim.clone()
            } else {
                PathBuf::new()
            };
            assert!(criu_tar(
                &used,
                &extract,
                false,
                archive,
                &dir.path().join("log")
            ));
            assert_eq!(
                std::fs::read(out.path().join("shm/segment")).unwrap(),
                b"kept across the snapshot"
            );
            assert_eq!(
                std::fs::read_link(out.path().join("link")).unwrap(),
                Path::new("shm/segment")
            );
        }
        let out = tempfile::tempdir_in(dir.path()).unwrap();
        let extract = [
            "--extract",
            "--gzip",
            "--directory",
            out.path().to_str().unwrap(),
        ];
        let log = dir.path().join("log");
        assert!(
            !criu_tar(Path::new(""), &extract, false, &plain, &log),
            "without the shim CRIU's extract cannot read a plain archive"
        );
    }

    /// CRIU's page writes as write_pages_loc makes them, from python3 with the uffd build
    /// preloaded: one pipe filled with a buffer's pages, then one splice per page into a
    /// "pages-N.img" opened through openat. Prints the image's size after the first splice,
    /// whether the image holds the pages in order, and the errno of a splice from another pipe
    /// while moved bytes are unclaimed and of the next one into the same image (0: none), and,
    /// asked, of a splice from an empty pipe into a fresh image (a plain one would wait).
    const PAGE_WRITES: &str = r#"
import errno, fcntl, os, sys
d = os.open(sys.argv[1], os.O_RDONLY)
img = os.open("pages-7.img", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, dir_fd=d)
r, w = os.pipe()
fcntl.fcntl(w, 1031, 1 << 20)
pages = [bytes([i]) * 4096 for i in range(200)]
os.write(w, b"".join(pages))
first = None
for p in pages:
    assert os.splice(r, img, 4096) == 4096
    first = first if first is not None else os.fstat(img).st_size
whole = open(os.path.join(sys.argv[1], "pages-7.img"), "rb").read() == b"".join(pages)
os.write(w, pages[0] + pages[1])
os.splice(r, img, 4096)
r2, w2 = os.pipe()
os.write(w2, pages[2])
def err(f):
    try:
        f()
        return 0
    except OSError as e:
        return e.errno
other = err(lambda: os.splice(r2, img, 4096))
after = err(lambda: os.splice(r, img, 4096))
empty = "-"
if len(sys.argv) > 2:
    img2 = os.open("pages-8.img", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=d)
    r3, w3 = os.pipe()
    empty = err(lambda: os.splice(r3, img2, 4096))
print(first, whole, other, after, empty)
"#;

    fn page_writes(shim: &Path, coalesce: bool) -> String {
        let dir = tempfile::tempdir().unwrap();
        let (args, env): (&[&OsStr], &[(&str, &str)]) = match coalesce {
            true => (
                &[dir.path().as_os_str(), OsStr::new("asked")],
                &[(COALESCE_PAGE_WRITES_ENV, "1")],
            ),
            false => (&[dir.path().as_os_str()], &[]),
        };
        python_with_shim(shim, PAGE_WRITES, args, env)
            .trim()
            .to_owned()
    }

    /// Asked, the first splice of a pipe moves all of it and the rest are answered from it:
    /// the image is the same bytes in the same order. A splice CRIU would never make then (from
    /// another pipe) fails, and so does every later one into that image, and one from an empty
    /// pipe fails instead of waiting. Not asked, each splice moves what it names (the control).
    #[test]
    fn a_pipe_of_pages_goes_to_its_image_in_one_splice_when_asked() {
        let Some((_dir, shim)) = shim_in_temp_dir(SHIM_UFFD, "criu-shim-uffd.so") else {
            return;
        };
        let eio = libc::EIO.to_string();
        assert_eq!(
            page_writes(&shim, true),
            format!("{} True {eio} {eio} {eio}", 200 * 4096)
        );
        assert_eq!(page_writes(&shim, false), "4096 True 0 0 -");
    }

    /// CRIU's PAGEMAP_SCAN (file pages and the zero page left out, soft-dirty asked) of three
    /// ranges of this python: a private anonymous mapping (pages written, read, untouched), a
    /// private file mapping (pages read, so file pages, and pages written, so copies) and the
    /// same file mapping's first 64 KiB. Each is asked through libc's ioctl (the shim's) and
    /// straight to the kernel as the shim passes it on (written or outside a registered VMA,
    /// for soft-dirty); prints, per range, whether both answers are the same regions and the
    /// pages they report.
    const CRIU_SCAN: &str = r#"
import ctypes, mmap, os, sys, tempfile
libc = ctypes.CDLL(None, use_errno=True)
P = 4096
class Arg(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("size flags start end walk_end vec vec_len "
        "max_pages inverted mask anyof ret").split()]
Region = ctypes.c_uint64 * 3
SCAN = 0xC0606610
WPALLOWED, WRITTEN, FILE, PRESENT, SWAPPED, PFNZERO, SOFT_DIRTY = 1, 2, 4, 8, 16, 32, 128
# As CRIU opens it: under a directory fd of the pid.
pm = os.open("pagemap", os.O_RDONLY, dir_fd=os.open("/proc/%d" % os.getpid(), os.O_RDONLY))
def scan(start, end, through_shim):
    vec = (Region * 4096)()
    ret = PRESENT | SWAPPED | SOFT_DIRTY
    if not through_shim:
        ret = PRESENT | SWAPPED | WRITTEN | WPALLOWED
    a = Arg(ctypes.sizeof(Arg), 0, start, end, 0, ctypes.addressof(vec), 4096, 0,
            PFNZERO | FILE, PFNZERO | FILE, PRESENT | SWAPPED, ret)
    if through_shim:
        n = libc.ioctl(pm, ctypes.c_ulong(SCAN), ctypes.byref(a))
    else:
        n = libc.syscall(16, pm, ctypes.c_ulong(SCAN), ctypes.byref(a))
    assert n >= 0, os.strerror(ctypes.get_errno())
    out = []
    for r in vec[:n]:
        c = r[2]
        if not through_shim:
            dirty = (c & WRITTEN) or not (c & WPALLOWED)
            c = (c & (PRESENT | SWAPPED)) | (SOFT_DIRTY if dirty else 0)
        out.append((r[0], r[1], c))
    return out
def both(start, end):
    got, want = scan(start, end, True), scan(start, end, False)
    return "%s/%d" % (got == want, sum((e - s) // P for s, e, _ in got))
n = 16 << 20
anon = mmap.mmap(-1, n, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, n // P, 3):
    anon[i * P] = 1
for i in range(1, n // P, 3):
    anon[i * P]
f = tempfile.TemporaryFile()
f.write(os.urandom(n))
f.flush()
filemap = mmap.mmap(f.fileno(), n, mmap.MAP_PRIVATE)
# Written first: a VMA's first copy-on-write drops the file pages mapped in it before.
for i in range(0, n // P, 5):
    filemap[i * P] = 7
for i in range(0, n // P, 2):
    filemap[i * P]
def addr(m):
    return ctypes.addressof(ctypes.c_char.from_buffer(m))
a, b = addr(anon), addr(filemap)
print(both(a, a + n), both(b, b + n), both(b, b + (64 << 10)))
"#;

    /// The shim answers CRIU's scans as the kernel would: in an anonymous mapping (where it
    /// leaves out the file-page question, part 13) the pages written (a third) and none of the
    /// read ones (the zero page); in a file mapping (where it must not) only the pages written
    /// (copies, a fifth), none of those only read; a range under 1 MiB as asked.
    #[test]
    fn criu_scans_are_answered_as_the_kernel_would() {
        let Some((_dir, shim)) = shim_in_temp_dir(SHIM_UFFD, "criu-shim-uffd.so") else {
            return;
        };
        let got = python_with_shim(&shim, CRIU_SCAN, &[], &[(UFFD_WP_ENV, "1")]);
        let pages: usize = (16 << 20) >> 12;
        assert_eq!(
            got.trim(),
            format!(
                "True/{} True/{} True/{}",
                pages.div_ceil(3),
                pages.div_ceil(5),
                16usize.div_ceil(5)
            )
        );
    }

    /// CRIU's page writes in two buffers (150 pages, then 50) into the image named by the first
    /// argument, opened under the directory of the second; prints how many threads the process
    /// has once they are made.
    const PAGE_WRITES_BESIDE: &str = r#"
import fcntl, os, sys
d = os.open(sys.argv[2], os.O_RDONLY)
img = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=d)
r, w = os.pipe()
fcntl.fcntl(w, 1031, 1 << 20)
pages = [bytes([i]) * 4096 for i in range(200)]
for batch in (pages[:150], pages[150:]):
    os.write(w, b"".join(batch))
    for p in batch:
        assert os.splice(r, img, 4096) == 4096
threads = len(os.listdir("/proc/self/task"))
os.close(img)
print(threads)
"#;

    /// (exit code, output, stderr) of [`PAGE_WRITES_BESIDE`] into `image` under `dir`.
    fn pages_beside(
        shim: &Path,
        dir: &Path,
        image: &str,
        asked: &str,
    ) -> (Option<i32>, String, String) {
        let out = std::process::Command::new(python_itself())
            .args(["-c", PAGE_WRITES_BESIDE, image])
            .arg(dir)
            .env("LD_PRELOAD", shim)
            .env(COALESCE_PAGE_WRITES_ENV, "1")
            .env(ASYNC_PAGE_WRITES_ENV, asked)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).trim().to_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Asked, the pages go into their image from a thread of the shim's (part 15), and the
    /// image is the same bytes in the same order once the process has exited; not asked, no
    /// thread, the same image. A write the thread cannot make (the image is /dev/full) fails
    /// the process at exit.
    #[test]
    fn pages_are_written_beside_criu_when_asked() {
        let Some((_dir, shim)) = shim_in_temp_dir(SHIM_UFFD, "criu-shim-uffd.so") else {
            return;
        };
        let want: Vec<u8> = (0..200u8).flat_map(|i| [i; 4096]).collect();
        for (asked, threads) in [("1", "2"), ("0", "1")] {
            let dir = tempfile::tempdir().unwrap();
            let got = pages_beside(&shim, dir.path(), "pages-7.img", asked);
            assert_eq!(
                (got.0, got.1.as_str()),
                (Some(0), threads),
                "asked {asked}: {}",
                got.2
            );
            let image = std::fs::read(dir.path().join("pages-7.img")).unwrap();
            assert!(
                image == want,
                "asked {asked}: the image is not the pages in order"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/dev/full", dir.path().join("pages-9.img")).unwrap();
        let (code, _, err) = pages_beside(&shim, dir.path(), "pages-9.img", "1");
        assert_eq!(code, Some(1), "a failed write must fail the process: {err}");
        assert!(
            err.contains("writing pages into their image failed"),
            "{err}"
        );
    }

    /// CRIU's page writes of a child's own pages (vmspliced by the child, as CRIU's parasite
    /// does: the pipe holds references to them) into the image named by the first argument,
    /// under the directory of the second; then, as compel does, a word of every page poked with
    /// ptrace and, 50 ms later, put back. Prints how many pages reached the image otherwise
    /// than they were when taken, and how many pages it holds.
    const POKED_PAGES: &str = r#"
import ctypes, fcntl, mmap, os, sys, termios, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.ptrace.restype = ctypes.c_long
N, CHUNK = 2048, 256
d = os.open(sys.argv[2], os.O_RDONLY)
# Synchronous writes: the writer thread takes a while over each batch, as on a busy host.
img = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_SYNC, 0o600, dir_fd=d)
r, w = os.pipe()
fcntl.fcntl(w, 1031, CHUNK * 4096)
ready_r, ready_w = os.pipe()
pid = os.fork()
if pid == 0:
    m = mmap.mmap(-1, N * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(N):
        m[i * 4096:(i + 1) * 4096] = bytes([65 + i % 26]) * 4096
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    os.write(ready_w, addr.to_bytes(8, "little"))
    for c in range(0, N, CHUNK):
        iov = (ctypes.c_size_t * 2)(addr + c * 4096, CHUNK * 4096)
        assert libc.vmsplice(w, iov, 1, 0) == CHUNK * 4096, ctypes.get_errno()
    time.sleep(60)
    os._exit(0)
addr = int.from_bytes(os.read(ready_r, 8), "little")
done = 0
while done < N * 4096:
    q = ctypes.c_int(0)
    while q.value < CHUNK * 4096:
        fcntl.ioctl(r, termios.FIONREAD, q)
    # As CRIU: a page asked for while the pipe holds more takes all it holds.
    assert os.splice(r, img, 4096) == 4096
    for _ in range(CHUNK - 1):
        assert os.splice(r, img, 4096) == 4096
    done += CHUNK * 4096
assert libc.ptrace(0x4206, pid, None, None) == 0, ctypes.get_errno()  # PTRACE_SEIZE
assert libc.ptrace(0x4207, pid, None, None) == 0, ctypes.get_errno()  # PTRACE_INTERRUPT
os.waitpid(pid, 0)
for poke in (b"XXXXXXXX", None):
    for i in range(N):
        word = poke or bytes([65 + i % 26]) * 8
        at = ctypes.c_void_p(addr + i * 4096)
        assert libc.ptrace(5, pid, at, int.from_bytes(word, "little")) == 0  # PTRACE_POKEDATA
    time.sleep(0.05)
libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
os.kill(pid, 9)
os.waitpid(pid, 0)
os.close(img)
image = open(os.path.join(sys.argv[2], sys.argv[1]), "rb").read()
bad = sum(image[i * 4096] != 65 + i % 26 for i in range(N))
print(bad, len(image) // 4096)
"#;

    /// Pages taken by the writer thread (part 15) and then poked by ptrace, as compel pokes its
    /// syscall instruction into a frozen process: the image holds them as they were when taken.
    /// (Without the shim's ptrace waiting for the writer, the pokes land in the pages the writer
    /// still holds, and the image shows them.) Not asked, the same.
    #[test]
    fn pages_taken_are_written_as_they_were_before_criu_pokes_them() {
        let Some((_dir, shim)) = shim_in_temp_dir(SHIM_UFFD, "criu-shim-uffd.so") else {
            return;
        };
        if !nix::unistd::geteuid().is_root() {
            grove_testkit::capability_missing("needs root to ptrace");
            return;
        }
        for asked in ["1", "0"] {
            let dir = tempfile::tempdir().unwrap();
            let out = std::process::Command::new(python_itself())
                .args(["-c", POKED_PAGES, "pages-3.img"])
                .arg(dir.path())
                .env("LD_PRELOAD", &shim)
                .env(COALESCE_PAGE_WRITES_ENV, "1")
                .env(ASYNC_PAGE_WRITES_ENV, asked)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "asked {asked}: {err}");
            assert_eq!(
                String::from_utf8_lossy(&out.stdout).trim(),
                "0 2048",
                "asked {asked}: pages poked after they were taken reached the image poked"
            );
        }
    }

    /// CRIU-shaped TCP sock_diag dumps (IPv4, then IPv6) from a process with the shim preloaded;
    /// prints each dump's entry count and the port id its NLMSG_DONE came from (0: not the
    /// kernel, which answers from our socket's). Arguments: `listen`, a TCP listener in the
    /// namespace dumped; `elsewhere`, as CRIU does it: the diag sockets made in a namespace of
    /// their own and the requests sent from the first one, which holds a listener.
    const TCP_DIAG: &str = r#"
import ctypes, os, socket, struct, sys
CLONE_NEWNET = 0x40000000
libc = ctypes.CDLL(None, use_errno=True)
keep = []
def listener():
    l = socket.socket()
    l.bind(("", 0))
    l.listen()
    keep.append(l)
if "elsewhere" in sys.argv:
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    listener()
    assert libc.unshare(CLONE_NEWNET) == 0, ctypes.get_errno()
if "listen" in sys.argv:
    listener()
socks = [socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4) for _ in range(2)]
if "elsewhere" in sys.argv:
    assert libc.setns(own, CLONE_NEWNET) == 0, ctypes.get_errno()
def dump(s, family):
    req = struct.pack("=BBBBI", family, 6, 0, 0, 0xffffffff) + bytes(48)
    s.sendmsg([struct.pack("=IHHII", 16 + len(req), 20, 0x301, 24680, 0) + req], [], 0, (0, 0))
    n = 0
    while True:
        d = s.recvmsg(65536)[0]
        at = 0
        while at + 16 <= len(d):
            l, ty, fl, seq, pid = struct.unpack_from("=IHHII", d, at)
            if ty == 3:
                assert seq == 24680, seq
                return "%d/%d" % (n, pid)
            if ty == 2:
                sys.exit("netlink error %d" % struct.unpack_from("=i", d, at + 16)[0])
            n += 1
            at += (l + 3) & ~3
print(dump(socks[0], socket.AF_INET), dump(socks[1], socket.AF_INET6))
"#;

    /// (entries, DONE's port id) for the IPv4 and IPv6 dumps.
    fn tcp_diag(shim: &Path, asked: bool, args: &[&str]) -> [(u32, u32); 2] {
        let args: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
        let env: &[(&str, &str)] = if asked {
            &[(EMPTY_TCP_DIAG_ENV, "1")]
        } else {
            &[]
        };
        let got = pairs(&python_with_shim(shim, TCP_DIAG, &args, env));
        [got[0], got[1]]
    }

    /// Asked, a namespace with no TCP socket has its TCP dumps answered by the shim (a DONE from
    /// port 0); not asked, or with a listener, the kernel answers (and lists the listener). The
    /// namespace that counts is the diag socket's, not the sender's, as when CRIU sends them.
    #[test]
    fn tcp_diag_of_a_namespace_without_tcp_is_answered_without_the_kernel() {
        let Some((_dir, shim)) = shim_in_temp_dir(SHIM_UFFD, "criu-shim-uffd.so") else {
            return;
        };
        if !nix::unistd::geteuid().is_root() {
            grove_testkit::capability_missing("needs root for a network namespace");
            return;
        }
        let [asked, not_asked, listening, elsewhere, elsewhere_listening] =
            std::thread::spawn(move || {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
                grove_sys::net::loopback_up().unwrap();
                [
                    tcp_diag(&shim, true, &[]),
                    tcp_diag(&shim, false, &[]),
                    tcp_diag(&shim, true, &["listen"]),
                    tcp_diag(&shim, true, &["elsewhere"]),
                    tcp_diag(&shim, true, &["elsewhere", "listen"]),
                ]
            })
            .join()
            .unwrap();
        assert_eq!(asked, [(0, 0), (0, 0)], "no TCP, asked: the shim answers");
        for (n, pid) in not_asked {
            assert_eq!(n, 0);
            assert_ne!(pid, 0, "not asked: the kernel answers");
        }
        assert_eq!(listening[0].0, 1, "a listener: the kernel lists it");
        assert_ne!(listening[0].1, 0);
        assert_ne!(listening[1].1, 0, "and answers IPv6 too: {listening:?}");
        assert_eq!(
            elsewhere,
            [(0, 0), (0, 0)],
            "the socket's namespace has no TCP (the sender's has a listener): the shim answers"
        );
        assert_eq!(
            elsewhere_listening[0].0, 1,
            "the socket's namespace has a listener: the kernel lists it ({elsewhere_listening:?})"
        );
        assert_ne!(elsewhere_listening[1].1, 0);
    }

    /// The python3 binary itself: `python3` on PATH may be a script that execs it (pyenv's),
    /// and a shim loaded into that script would start its thread there, not in python.
    fn python_itself() -> String {
        let out = std::process::Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    }

    /// A python3 held by the shim at `START_FD`: what it said, then its exit and output once
    /// `go` is sent (None: the socket is closed instead).
    fn held_start(shim: &Path, go: Option<&[u8]>) -> (Vec<u8>, bool, Option<i32>, String) {
        held_run(shim, "print('main ran')", &[], &[], go)
    }

    /// [`held_start`] of `script` with `args` and `env`.
    fn held_run(
        shim: &Path,
        script: &str,
        args: &[&str],
        env: &[(&str, &str)],
        go: Option<&[u8]>,
    ) -> (Vec<u8>, bool, Option<i32>, String) {
        use std::io::{Read, Write};
        use std::os::unix::net::UnixStream;
        use std::os::unix::process::CommandExt;
        let (mut ours, theirs) = UnixStream::pair().unwrap();
        let fd = theirs.as_raw_fd();
        let mut cmd = std::process::Command::new(python_itself());
        cmd.args(["-c", script])
            .args(args)
            .env("LD_PRELOAD", shim)
            .env(START_FD_ENV, START_FD.to_string())
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::piped());
        // SAFETY: between fork and exec, only fcntl and dup2 (async-signal-safe) on plain
        // integers.
        unsafe {
            cmd.pre_exec(move || {
                use nix::fcntl::{fcntl, FcntlArg, FdFlag};
                match fd == START_FD {
                    // dup2 onto itself would keep close-on-exec.
                    true => fcntl(fd, FcntlArg::F_SETFD(FdFlag::empty())).map(drop),
                    false => nix::unistd::dup2(fd, START_FD).map(drop),
                }
                .map_err(Into::into)
            });
        }
        let mut child = cmd.spawn().unwrap();
        drop(theirs);
        ours.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut said = vec![0u8; 1];
        ours.read_exact(&mut said).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        let held = child.try_wait().unwrap().is_none();
        if let Some(go) = go {
            ours.write_all(go).unwrap();
        }
        drop(ours);
        let out = child.wait_with_output().unwrap();
        (
            said,
            held,
            out.status.code(),
            String::from_utf8(out.stdout).unwrap(),
        )
    }

    /// The shim says "r" once loaded and holds the program before its main until "g"; closed
    /// instead, or sent anything else, it exits without running the program.
    #[test]
    fn a_held_start_runs_main_only_when_let_go() {
        if SHIM.is_empty() {
            grove_testkit::capability_missing("the shim was not built (no C compiler)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        for (name, bytes) in [("criu-shim.so", SHIM), ("criu-shim-uffd.so", SHIM_UFFD)] {
            let shim = dir.path().join(name);
            std::fs::write(&shim, bytes).unwrap();
            let (said, held, code, out) = held_start(&shim, Some(b"g"));
            assert_eq!((said.as_slice(), held), (&b"r"[..], true), "{name}");
            assert_eq!((code, out.as_str()), (Some(0), "main ran\n"), "{name}");
            for go in [None, Some(&b"x"[..])] {
                let (said, held, code, out) = held_start(&shim, go);
                assert_eq!((said.as_slice(), held), (&b"r"[..], true), "{name}");
                assert_eq!((code, out.as_str()), (Some(75), ""), "{name}: {go:?}");
            }
        }
    }

    /// A tree to dump: this python and a child that maps one file page more on SIGUSR1. Prints
    /// the child's pid once it waits for the signal.
    const TREE: &str = r#"
import mmap, os, signal, tempfile, time
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    keep = []
    def grow(*_):
        f = tempfile.TemporaryFile()
        f.write(b"x" * 4096)
        f.flush()
        keep.append((f, mmap.mmap(f.fileno(), 4096)))
        os.write(w, b"g")
    signal.signal(signal.SIGUSR1, grow)
    os.write(w, b"r")
    while True:
        signal.pause()
os.read(r, 1)
print(pid, flush=True)
time.sleep(60)
"#;

    /// CRIU's side, with `-t <root> <child>` as arguments: once let go, it waits, has the
    /// child map a page more, then opens the child's smaps twice as CRIU does (under a
    /// directory fd of the pid) and prints how many VMAs each listed.
    const SMAPS_TWICE: &str = r#"
import os, signal, sys, time
child = int(sys.argv[3])
time.sleep(0.3)
os.kill(child, signal.SIGUSR1)
time.sleep(0.3)
def vmas():
    d = os.open("/proc/%d" % child, os.O_RDONLY)
    fd = os.open("smaps", os.O_RDONLY, dir_fd=d)
    text = b""
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            break
        text += b
    os.close(fd)
    os.close(d)
    return text.count(b"VmFlags")
print(vmas(), vmas())
"#;

    /// Asked, the shim reads the tree's smaps once let go (part 14): CRIU's first open of the
    /// child's smaps is what it was then, without the page the child mapped since; the second
    /// is the kernel's. Not asked, both are the kernel's.
    #[test]
    fn smaps_are_read_ahead_once_let_go() {
        let Some((_dir, shim)) = shim_in_temp_dir(SHIM_UFFD, "criu-shim-uffd.so") else {
            return;
        };
        let mut tree = std::process::Command::new("python3")
            .args(["-c", TREE])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(tree.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let child: i32 = line.trim().parse().unwrap();
        let root = tree.id().to_string();
        let counts = |asked: &str| {
            let env = [(READ_AHEAD_SMAPS_ENV, asked), (UFFD_WP_ENV, "1")];
            let args = ["-t", root.as_str(), &child.to_string()];
            let (_, _, code, out) = held_run(&shim, SMAPS_TWICE, &args, &env, Some(b"g"));
            assert_eq!(code, Some(0), "{out}");
            let got: Vec<usize> = out.split_whitespace().map(|w| w.parse().unwrap()).collect();
            (got[0], got[1])
        };
        let (not_asked, asked) = (counts("0"), counts("1"));
        let _ =
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(child), nix::sys::signal::SIGKILL);
        let _ = tree.kill();
        let _ = tree.wait();
        assert_eq!(not_asked.0, not_asked.1, "not asked: the kernel's, twice");
        assert_eq!(
            asked,
            (not_asked.1, not_asked.1 + 1),
            "asked: what it was when let go, then the kernel's (a page more since)"
        );
    }

    /// Polls that do not wait, as a lazy-pages daemon makes them between background copies,
    /// from a process with the shim preloaded: how long each took (ms) with no event, the
    /// first one, one right after, one with an event ready, and one right after that event.
    const QUIET_POLLS: &str = r#"
import os, select, time
r, w = os.pipe()
ep = select.epoll()
ep.register(r, select.EPOLLIN)
def took(f):
    t = time.monotonic()
    got = f()
    return round((time.monotonic() - t) * 1000), len(got)
first = took(lambda: ep.poll(0))
after = took(lambda: ep.poll(0))
os.write(w, b"x")
event = took(lambda: ep.poll(0))
os.read(r, 1)
after_event = took(lambda: ep.poll(0))
print(*("%d/%d" % x for x in (first, after, event, after_event)))
"#;

    fn quiet_polls(shim: &Path, quiet_ms: Option<&str>) -> Vec<(u64, u64)> {
        let env: Vec<(&str, &str)> = quiet_ms
            .map(|ms| (LAZY_QUIET_ENV, ms))
            .into_iter()
            .collect();
        pairs(&python_with_shim(shim, QUIET_POLLS, &[], &env))
    }

    /// Asked, a poll that would not wait waits until the process has gone that long without an
    /// event; an event ready is returned at once, and restarts the wait. Not asked (or asked
    /// with something that is not a number of ms), no poll waits.
    #[test]
    fn background_polls_wait_for_a_quiet_tree_when_asked() {
        let Some((_dir, shim)) = shim_in_temp_dir(SHIM, "criu-shim.so") else {
            return;
        };
        let polls = quiet_polls(&shim, Some("300"));
        let [first, after, event, after_event] = polls[..] else {
            panic!("{polls:?}")
        };
        assert!(
            (290..1000).contains(&first.0) && first.1 == 0,
            "first: {polls:?}"
        );
        assert!(after.0 < 100 && after.1 == 0, "quiet by then: {polls:?}");
        assert!(event.0 < 100 && event.1 == 1, "an event at once: {polls:?}");
        assert!(
            (290..1000).contains(&after_event.0) && after_event.1 == 0,
            "then quiet again: {polls:?}"
        );
        for quiet in [None, Some("soon")] {
            let polls = quiet_polls(&shim, quiet);
            assert!(polls.iter().all(|p| p.0 < 100), "{quiet:?}: {polls:?}");
        }
    }

    /// A waiting poll with SIGWINCH sent to the poller 200 ms in, then one more poll.
    const HURRIED_POLLS: &str = r#"
import os, select, signal, threading, time
r, w = os.pipe()
ep = select.epoll()
ep.register(r, select.EPOLLIN)
main = threading.get_ident()
threading.Timer(0.2, lambda: signal.pthread_kill(main, signal.SIGWINCH)).start()
def took(f):
    t = time.monotonic()
    got = f()
    return round((time.monotonic() - t) * 1000), len(got)
print(*("%d/%d" % x for x in (took(lambda: ep.poll(0)), took(lambda: ep.poll(0)))))
"#;

    /// SIGWINCH (a snapshot of the branch wants its memory whole) ends a waiting poll at once,
    /// and no poll waits after it, however quiet the tree.
    #[test]
    fn a_hurried_daemon_waits_no_more() {
        let Some((_dir, shim)) = shim_in_temp_dir(SHIM, "criu-shim.so") else {
            return;
        };
        let env = [(LAZY_QUIET_ENV, "5000")];
        let polls: Vec<(u64, u64)> = pairs(&python_with_shim(&shim, HURRIED_POLLS, &[], &env));
        let [hurried, after] = polls[..] else {
            panic!("{polls:?}")
        };
        assert!(
            (190..1000).contains(&hurried.0) && hurried.1 == 0,
            "hurried: {polls:?}"
        );
        assert!(after.0 < 100 && after.1 == 0, "no wait after: {polls:?}");
    }
}
