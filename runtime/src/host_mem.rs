//! The host's memory as admission and the examples and benchmarks that measure Grove read it.

/// A `/proc/meminfo` field (`"MemTotal"`, `"MemAvailable"`, …) in KiB.
pub fn meminfo_kb(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines().find_map(|l| {
        l.strip_prefix(field)?
            .strip_prefix(':')?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// Free pages parked on the page allocator's per-CPU lists (`count:` of every pageset in
/// `/proc/zoneinfo`), in KiB. MemFree, and so MemAvailable, leaves them out, and recent kernels
/// (6.18 here) grow those lists under allocation churn: after a few thousand sandbox cycles they
/// held 800 MiB of free memory on a 2-vCPU VM, which read as a MemAvailable "drop" that no
/// meminfo field owned.
pub fn per_cpu_free_kb() -> u64 {
    let zoneinfo = std::fs::read_to_string("/proc/zoneinfo").unwrap_or_default();
    let pages: u64 = zoneinfo
        .lines()
        .filter_map(|l| l.trim().strip_prefix("count:")?.trim().parse::<u64>().ok())
        .sum();
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .unwrap_or(4096)
        .max(4096) as u64;
    pages * page / 1024
}

/// MemAvailable with the per-CPU free lists counted in ([`per_cpu_free_kb`]), in KiB: what a
/// before/after comparison of host memory should read.
pub fn available_kb() -> Option<u64> {
    Some(meminfo_kb("MemAvailable")? + per_cpu_free_kb())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_hosts_memory() {
        let total = meminfo_kb("MemTotal").expect("MemTotal");
        let avail = available_kb().expect("MemAvailable");
        assert!(total > 0 && avail > 0, "{total} {avail}");
        assert!(avail <= total + per_cpu_free_kb(), "{avail} vs {total}");
        assert_eq!(meminfo_kb("NoSuchField"), None);
    }
}
