//! Host-wide free memory as the examples compare it before and after a run.

/// Free pages parked on the page allocator's per-CPU lists, in KiB. MemFree (and so
/// MemAvailable) leaves them out, and recent kernels (6.18 here) grow those lists under allocation
/// churn: after a few thousand sandbox cycles they held 800 MiB of free memory on this 2-vCPU
/// VM, which read as a "drop" in MemAvailable with no owner in /proc/meminfo.
pub fn per_cpu_free_kb() -> u64 {
    let zoneinfo = std::fs::read_to_string("/proc/zoneinfo").unwrap_or_default();
    let pages: u64 = zoneinfo
        .lines()
        .filter_map(|l| l.trim().strip_prefix("count:")?.trim().parse::<u64>().ok())
        .sum();
    pages * (page_size() / 1024)
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as u64
    } else {
        4096
    }
}
