//! Registering a process's memory for write-protect-async tracking, and reading and re-arming it
//! with PAGEMAP_SCAN.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::OnceLock;

use super::sys::{
    self, PageRegion, ScanArgs, PAGE_IS_PRESENT, PAGE_IS_SWAPPED, PAGE_IS_WPALLOWED,
    PAGE_IS_WRITTEN, PM_SCAN_WP_MATCHING, UFFDIO_REGISTER_MODE_WP, UFFD_FEATURE_WP_ASYNC,
    UFFD_FEATURE_WP_UNPOPULATED, UFFD_USER_MODE_ONLY,
};
use super::{TrackError, Unsupported};

const PAGE_SIZE: u64 = 4096;
const FEATURES: u64 = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED;
/// Regions per PAGEMAP_SCAN call. At most the kernel's own bounce buffer
/// (PAGEMAP_WALK_SIZE >> PAGE_SHIFT = 512): then the call stops early only when this buffer is
/// full, and `walk_end` is exact (with a larger buffer a call that fills the bounce buffer, goes
/// on and then ends normally reports a stale `walk_end`).
const SCAN_BATCH: usize = 512;
/// The top of a 4-level x86_64 user address space (TASK_SIZE_MAX).
const TASK_SIZE_4LEVEL: u64 = (1 << 47) - PAGE_SIZE;
/// The top with 5-level paging.
const TASK_SIZE_5LEVEL: u64 = (1 << 56) - PAGE_SIZE;

/// One line of /proc/<pid>/maps.
#[derive(Clone, Debug)]
pub(super) struct Vma {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) name: String,
}

/// The VMAs of process `pid`, from /proc/<pid>/maps (empty for a zombie or a kernel thread).
pub(super) fn read_maps(pid: i32) -> io::Result<Vec<Vma>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let mut vmas = Vec::new();
    for line in text.lines() {
        // "start-end perms offset dev inode [name]": the name is the rest, spaces and all.
        let mut parts = line.splitn(6, ' ');
        let range = parts.next().unwrap_or("");
        let name = parts.nth(4).unwrap_or("").trim_start().to_string();
        let Some((s, e)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) else {
            continue;
        };
        vmas.push(Vma { start, end, name });
    }
    Ok(vmas)
}

/// VMAs never registered: the kernel's special mappings, whose pages are no process memory that
/// CRIU dumps ([vvar], [vvar_vclock], [vdso]) or not a VMA at all ([vsyscall]). Unregistered
/// means "always written", so skipping one is never unsafe.
fn skip(vma: &Vma) -> bool {
    vma.name == "[vsyscall]" || vma.name == "[vdso]" || vma.name.starts_with("[vvar")
}

/// What the support probe found out.
#[derive(Debug)]
struct Probe {
    /// The end of the range PAGEMAP_SCAN walks: the top of the user address space.
    task_size: u64,
}

fn probe_cached() -> Result<&'static Probe, Unsupported> {
    static PROBE: OnceLock<Result<Probe, Unsupported>> = OnceLock::new();
    PROBE.get_or_init(probe).as_ref().map_err(Clone::clone)
}

/// Whether dirty-page tracking works here: probed once in this process (groved) with its own
/// userfaultfd, UFFDIO_API(WP_ASYNC | WP_UNPOPULATED), a registered page and PAGEMAP_SCAN on
/// /proc/self/pagemap; and whether this process may inject (CAP_SYS_ADMIN and CAP_SYS_PTRACE,
/// not under seccomp: PTRACE_O_SUSPEND_SECCOMP demands both).
pub(crate) fn supported() -> Result<(), Unsupported> {
    probe_cached().map(|_| ())
}

fn unsupported(reason: impl Into<String>) -> Unsupported {
    Unsupported {
        reason: reason.into(),
    }
}

fn probe() -> Result<Probe, Unsupported> {
    if !cfg!(target_arch = "x86_64") {
        return Err(unsupported(
            "syscall injection is implemented for x86_64 only",
        ));
    }
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| unsupported(format!("/proc/self/status: {e}")))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_string())
    };
    if field("Seccomp:").as_deref() != Some("0") {
        return Err(unsupported(
            "this process runs under seccomp, so PTRACE_O_SUSPEND_SECCOMP is refused",
        ));
    }
    let cap_eff = field("CapEff:")
        .and_then(|v| u64::from_str_radix(&v, 16).ok())
        .unwrap_or(0);
    const CAP_SYS_PTRACE: u32 = 19;
    const CAP_SYS_ADMIN: u32 = 21;
    for (bit, name) in [
        (CAP_SYS_PTRACE, "CAP_SYS_PTRACE"),
        (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"),
    ] {
        if cap_eff & (1 << bit) == 0 {
            return Err(unsupported(format!("this process lacks {name}")));
        }
    }

    let uffd = sys::userfaultfd(libc::O_CLOEXEC | libc::O_NONBLOCK | UFFD_USER_MODE_ONLY)
        .map_err(|e| unsupported(format!("userfaultfd(UFFD_USER_MODE_ONLY): {e}")))?;
    let granted = sys::uffdio_api(uffd.as_fd(), FEATURES)
        .map_err(|e| unsupported(format!("UFFDIO_API(WP_ASYNC|WP_UNPOPULATED): {e}")))?;
    if granted & FEATURES != FEATURES {
        return Err(unsupported(format!(
            "UFFDIO_API grants features {granted:#x}, without WP_ASYNC|WP_UNPOPULATED"
        )));
    }
    let mut page = crate::sys::Mapping::anon(PAGE_SIZE as usize)
        .map_err(|e| unsupported(format!("mmap: {e}")))?;
    page.touch(0, 1);
    sys::uffdio_register(
        uffd.as_fd(),
        page.start(),
        PAGE_SIZE,
        UFFDIO_REGISTER_MODE_WP,
    )
    .map_err(|e| unsupported(format!("UFFDIO_REGISTER(WP) of an anonymous page: {e}")))?;
    let pagemap = File::open("/proc/self/pagemap")
        .map_err(|e| unsupported(format!("/proc/self/pagemap: {e}")))?;
    // The top of the address space PAGEMAP_SCAN accepts (it checks the range with access_ok).
    let wp_vmas = |end: u64| {
        let args = ScanArgs {
            flags: 0,
            start: 0,
            end,
            category_mask: PAGE_IS_WPALLOWED,
            category_anyof_mask: 0,
            return_mask: PAGE_IS_WPALLOWED,
        };
        scan(&pagemap, &args, |_| {})
    };
    let task_size = match wp_vmas(TASK_SIZE_5LEVEL) {
        Ok(_) => TASK_SIZE_5LEVEL,
        Err(e) if e.raw_os_error() == Some(libc::EFAULT) => match wp_vmas(TASK_SIZE_4LEVEL) {
            Ok(_) => TASK_SIZE_4LEVEL,
            Err(e) => return Err(unsupported(format!("PAGEMAP_SCAN: {e}"))),
        },
        Err(e) => return Err(unsupported(format!("PAGEMAP_SCAN: {e}"))),
    };
    // The page was written before it was registered: written. Re-armed: clean. Written: written.
    let start = page.start();
    let one = |flags: u64| {
        let args = ScanArgs {
            flags,
            start,
            end: start + PAGE_SIZE,
            category_mask: PAGE_IS_WRITTEN,
            category_anyof_mask: 0,
            return_mask: PAGE_IS_WRITTEN,
        };
        scan(&pagemap, &args, |_| {}).map_err(|e| unsupported(format!("PAGEMAP_SCAN: {e}")))
    };
    let seen = (one(0)?, one(PM_SCAN_WP_MATCHING)?, one(0)?);
    page.touch(0, 2);
    let after_write = one(0)?;
    if seen != (1, 1, 0) || after_write != 1 {
        return Err(unsupported(format!(
            "PAGEMAP_SCAN on a write-protect-async page reads {seen:?} then {after_write}, not \
             (1, 1, 0) then 1"
        )));
    }
    Ok(Probe { task_size })
}

/// Runs PAGEMAP_SCAN over `args.start..args.end` in batches, handing each region to `each`;
/// returns the number of pages in all of them.
fn scan(pagemap: &File, args: &ScanArgs, mut each: impl FnMut(&PageRegion)) -> io::Result<u64> {
    let mut buf = [PageRegion::default(); SCAN_BATCH];
    let mut args = *args;
    let mut pages = 0;
    loop {
        let (n, walk_end) = sys::pagemap_scan(pagemap.as_fd(), &args, &mut buf)?;
        for r in &buf[..n] {
            pages += (r.end - r.start) / PAGE_SIZE;
            each(r);
        }
        // Fewer regions than room for: the walk reached the end. A full buffer: go on from where
        // the kernel stopped (see SCAN_BATCH for why walk_end can be trusted here).
        if n < buf.len() || walk_end >= args.end {
            return Ok(pages);
        }
        if walk_end <= args.start {
            return Err(io::Error::other(format!(
                "PAGEMAP_SCAN filled its buffer but stopped at {walk_end:#x}, not past {:#x}",
                args.start
            )));
        }
        args.start = walk_end;
    }
}

/// Makes process `pid` track its writes: it opens a userfaultfd (injected with ptrace, see
/// `inject`), which this process keeps, and every VMA of it is registered for write-protect
/// (async). Until the first `arm`, every present page reads written.
///
/// For a running process. One that cannot reach a ptrace stop (frozen) fails with `TimedOut`
/// after `inject::INJECT_TIMEOUT`, and is let go once it can. No other thread of this process
/// may wait for `pid` meanwhile (waitpid/waitid, by pidfd too: groved is the parent of a
/// sandbox's pid 1, and a parent that traces its child sees its ptrace stops): a stop consumed
/// there leaves the injection waiting until the process dies. A process already registered
/// (by a live `Registration`) registers nothing again: every VMA is skipped (EBUSY).
pub(crate) fn register(pid: i32) -> Result<Registration, TrackError> {
    let probe = probe_cached()?;
    let pidfd =
        grove_sys::process::pidfd_open(pid).map_err(|source| match source.raw_os_error() {
            Some(libc::ESRCH) => TrackError::Exited { pid },
            _ => TrackError::Proc {
                pid,
                what: "pidfd",
                source,
            },
        })?;
    let uffd = take_uffd(pid, &pidfd)?;
    let granted = sys::uffdio_api(uffd.as_fd(), FEATURES)
        .map_err(|source| TrackError::Api { pid, source })?;
    if granted & FEATURES != FEATURES {
        return Err(TrackError::ApiFeatures {
            pid,
            granted,
            missing: FEATURES & !granted,
        });
    }
    let maps = read_maps(pid).map_err(|source| TrackError::Proc {
        pid,
        what: "maps",
        source,
    })?;
    if !super::pidfd_alive(pidfd.as_fd()) {
        return Err(TrackError::Exited { pid });
    }
    let mut registered_bytes = 0;
    let mut skipped_vmas = 0;
    for vma in maps.iter().filter(|v| !skip(v)) {
        let len = vma.end - vma.start;
        match sys::uffdio_register(uffd.as_fd(), vma.start, len, UFFDIO_REGISTER_MODE_WP) {
            Ok(()) => registered_bytes += len,
            // EINVAL: a kind of memory uffd refuses (VM_DROPPABLE, ...) or a VMA unmapped since
            // maps was read; EPERM: not VM_MAYWRITE (a read-only shared file mapping); EBUSY:
            // another uffd owns it. Left unregistered, its pages always read written.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL | libc::EPERM | libc::EBUSY)
                ) =>
            {
                skipped_vmas += 1
            }
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                return Err(TrackError::Exited { pid })
            }
            Err(source) => {
                return Err(TrackError::Register {
                    pid,
                    start: vma.start,
                    end: vma.end,
                    source,
                })
            }
        }
    }
    Ok(Registration {
        pid,
        pidfd,
        _uffd: uffd,
        registered_bytes,
        skipped_vmas,
        task_size: probe.task_size,
    })
}

#[cfg(target_arch = "x86_64")]
fn take_uffd(pid: i32, pidfd: &OwnedFd) -> Result<OwnedFd, TrackError> {
    super::inject::open_uffd(pid, pidfd.as_fd())
}

#[cfg(not(target_arch = "x86_64"))]
fn take_uffd(_pid: i32, _pidfd: &OwnedFd) -> Result<OwnedFd, TrackError> {
    Err(unsupported("syscall injection is implemented for x86_64 only").into())
}

/// One process's write tracking. Dropping it closes the uffd: the kernel unregisters every VMA
/// and clears the uffd-wp bits (`userfaultfd_release_all` → `userfaultfd_clear_vma`), so every
/// page reads written again.
#[derive(Debug)]
pub(crate) struct Registration {
    pid: i32,
    pidfd: OwnedFd,
    /// Never read: held so that the registration lives exactly as long as this value.
    _uffd: OwnedFd,
    registered_bytes: u64,
    skipped_vmas: u32,
    task_size: u64,
}

impl Registration {
    #[cfg(test)]
    pub(crate) fn pid(&self) -> i32 {
        self.pid
    }

    /// Bytes of the VMAs registered (at registration time).
    pub(crate) fn registered_bytes(&self) -> u64 {
        self.registered_bytes
    }

    /// VMAs the kernel refused to register (they always read written).
    pub(crate) fn skipped_vmas(&self) -> u32 {
        self.skipped_vmas
    }

    /// Whether the process is still alive: its pidfd does not poll readable (readable = it
    /// exited), so a reused pid cannot be mistaken for it.
    pub(crate) fn is_alive(&self) -> bool {
        super::pidfd_alive(self.pidfd.as_fd())
    }

    /// The process's pagemap, opened now (so that it is the mm the process has now: one opened
    /// earlier would still show the mm it had before an exec) and checked to be our process.
    fn pagemap(&self) -> Result<File, TrackError> {
        let pid = self.pid;
        let f = File::open(format!("/proc/{pid}/pagemap")).map_err(|source| {
            if source.kind() == io::ErrorKind::NotFound || !self.is_alive() {
                TrackError::Exited { pid }
            } else {
                TrackError::Proc {
                    pid,
                    what: "pagemap",
                    source,
                }
            }
        })?;
        // Alive after the open: the pid was ours when it was opened.
        if !self.is_alive() {
            return Err(TrackError::Exited { pid });
        }
        Ok(f)
    }

    fn scan(&self, args: ScanArgs, each: impl FnMut(&PageRegion)) -> Result<u64, TrackError> {
        let pagemap = self.pagemap()?;
        scan(&pagemap, &args, each).map_err(|source| TrackError::Scan {
            pid: self.pid,
            source,
        })
    }

    /// Write-protects every page of the registered VMAs again (one PAGEMAP_SCAN with
    /// PM_SCAN_WP_MATCHING over the whole address space; unregistered VMAs are skipped by the
    /// kernel) and returns how many pages had been written since the last arm (or since
    /// registration). Meant for a frozen process, right after a dump.
    pub(crate) fn arm(&self) -> Result<u64, TrackError> {
        // WRITTEN and (PRESENT or SWAPPED), not WRITTEN alone: with category_mask == return_mask
        // == WRITTEN and nothing else, the kernel takes a fast path (pagemap_scan_pmd_entry) that
        // also matches none ptes of an allocated page table, counts them as written and puts a
        // uffd-wp marker in each. This way the count is exact, holes are left alone (their first
        // touch makes a pte without the uffd-wp bit: written), and it costs the same (measured:
        // 0.5-0.7 ms either way for 256 MiB with 5 % written).
        self.scan(
            ScanArgs {
                flags: PM_SCAN_WP_MATCHING,
                start: 0,
                end: self.task_size,
                category_mask: PAGE_IS_WRITTEN,
                category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
                return_mask: PAGE_IS_WRITTEN,
            },
            |_| {},
        )
    }

    fn written_args(&self) -> ScanArgs {
        ScanArgs {
            flags: 0,
            start: 0,
            end: self.task_size,
            category_mask: PAGE_IS_WRITTEN | PAGE_IS_WPALLOWED,
            category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
            return_mask: PAGE_IS_WRITTEN,
        }
    }

    /// Pages of the registered VMAs that are present or swapped and written since the last arm.
    /// Re-arms nothing.
    pub(crate) fn written(&self) -> Result<u64, TrackError> {
        self.scan(self.written_args(), |_| {})
    }

    /// The runs of pages `written` counts, as [start, end) address ranges.
    #[cfg(test)]
    pub(crate) fn written_ranges(&self) -> Result<Vec<(u64, u64)>, TrackError> {
        let mut out = Vec::new();
        self.scan(self.written_args(), |r| out.push((r.start, r.end)))?;
        Ok(out)
    }
}

/// PAGEMAP_SCAN of any process (registered or not) over `[start, end)`, without re-arming:
/// the regions whose categories contain all of `category_mask` and one of `anyof` (if not 0),
/// each with its categories masked by `return_mask`. For tests.
#[cfg(test)]
pub(crate) fn page_regions(
    pid: i32,
    start: u64,
    end: u64,
    category_mask: u64,
    anyof: u64,
    return_mask: u64,
) -> io::Result<Vec<PageRegion>> {
    let pagemap = File::open(format!("/proc/{pid}/pagemap"))?;
    let mut out = Vec::new();
    let args = ScanArgs {
        flags: 0,
        start,
        end,
        category_mask,
        category_anyof_mask: anyof,
        return_mask,
    };
    scan(&pagemap, &args, |r| out.push(*r))?;
    Ok(out)
}
