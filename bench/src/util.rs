//! Small helpers: running commands with a clear error, timing, caches, meminfo, timestamps.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// Milliseconds since `t`.
pub fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Describes a command for error messages.
pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    if s.len() > 160 {
        s.truncate(160);
        s.push('…');
    }
    s
}

fn tail(bytes: &[u8], n: usize) -> String {
    let s = String::from_utf8_lossy(bytes);
    let s = s.trim();
    let start = match n {
        0 => s.len(),
        _ => s
            .char_indices()
            .rev()
            .nth(n - 1)
            .map(|(i, _)| i)
            .unwrap_or(0),
    };
    s[start..].trim().replace('\n', " / ")
}

/// Runs a command to completion (stdout discarded), failing with its stderr tail on a non-zero exit.
/// Returns its wall time in milliseconds.
pub fn run(cmd: &mut Command) -> Result<f64> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let t = Instant::now();
    let out = cmd
        .output()
        .with_context(|| format!("spawn {}", describe(cmd)))?;
    let ms = ms_since(t);
    if !out.status.success() {
        bail!(
            "`{}` failed ({}): {}",
            describe(cmd),
            out.status,
            tail(&out.stderr, 300)
        );
    }
    Ok(ms)
}

/// Runs a command and returns its stdout.
pub fn output(cmd: &mut Command) -> Result<String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = cmd
        .output()
        .with_context(|| format!("spawn {}", describe(cmd)))?;
    if !out.status.success() {
        bail!(
            "`{}` failed ({}): {}",
            describe(cmd),
            out.status,
            tail(&out.stderr, 300)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Shell convenience for set-up steps (never on a measured path).
pub fn sh(script: &str) -> Result<String> {
    output(Command::new("/bin/sh").arg("-c").arg(script))
}

/// Is `bin` on PATH?
pub fn which(bin: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(bin))
        .find(|p| p.is_file())
}

/// Writes dirty pages and drops the page, dentry and inode caches (for cold figures).
pub fn drop_caches() -> Result<()> {
    nix::unistd::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3").context("write /proc/sys/vm/drop_caches")
}

/// MemAvailable with the free pages on the kernel's per-CPU lists counted in, in KiB (see
/// [`grove_runtime::host_mem::per_cpu_free_kb`] for why).
pub fn mem_available_kib() -> Result<u64> {
    grove_runtime::host_mem::available_kb()
        .ok_or_else(|| anyhow!("no MemAvailable in /proc/meminfo"))
}

/// Lazily unmounts `path` if it is a mount point.
pub fn unmount(path: &Path) -> Result<(), String> {
    use nix::errno::Errno;
    if path.as_os_str().as_encoded_bytes().contains(&0) {
        return Err("path with NUL".into());
    }
    match nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH) {
        Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => Ok(()), // not mounted
        Err(e) => Err(format!(
            "umount {}: {}",
            path.display(),
            std::io::Error::from(e)
        )),
    }
}

/// Removes every cgroup directory (v1 hierarchies and cgroup2) whose name starts with `prefix`, children
/// first, retrying briefly while the kernel still counts exiting tasks. Returns how many it removed.
pub fn sweep_cgroups(prefix: &str) -> usize {
    fn remove_tree(dir: &Path, removed: &mut usize) {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    remove_tree(&e.path(), removed);
                }
            }
        }
        for _ in 0..20 {
            match std::fs::remove_dir(dir) {
                Ok(()) => {
                    *removed += 1;
                    return;
                }
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(_) => return,
            }
        }
    }
    let mut removed = 0;
    let Ok(ctrls) = std::fs::read_dir("/sys/fs/cgroup") else {
        return 0;
    };
    for c in ctrls.flatten() {
        let Ok(rd) = std::fs::read_dir(c.path()) else {
            continue;
        };
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with(prefix) {
                remove_tree(&e.path(), &mut removed);
            }
        }
    }
    removed
}

/// Polls `f` until it returns true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    loop {
        if f() {
            return true;
        }
        if t.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `YYYY-MM-DD HH:MM:SS` in UTC.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    utc_string(secs)
}

fn utc_string(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = groved::events::civil_date(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_string_known_dates() {
        assert_eq!(utc_string(0), "1970-01-01 00:00:00");
        assert_eq!(utc_string(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(utc_string(1_764_473_400), "2025-11-30 03:30:00");
    }

    #[test]
    fn run_reports_stderr_of_failures() {
        let e = run(Command::new("/bin/sh").args(["-c", "echo nope >&2; exit 3"])).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("nope") && s.contains("exit status: 3"), "{s}");
        assert!(run(&mut Command::new("true")).unwrap() >= 0.0);
    }

    #[test]
    fn tail_keeps_the_end() {
        assert_eq!(tail(b"abc\ndef", 3), "def");
        assert_eq!(tail(b"xy", 10), "xy");
    }
}

/// `/run/<name>` where /run is a tmpfs (systemd hosts), else `/dev/shm/<name>`.
pub fn tmpfs_dir(name: &str) -> std::path::PathBuf {
    use nix::sys::statfs::{statfs, TMPFS_MAGIC};
    let run_is_tmpfs = statfs("/run").is_ok_and(|s| s.filesystem_type() == TMPFS_MAGIC);
    std::path::Path::new(if run_is_tmpfs { "/run" } else { "/dev/shm" }).join(name)
}

/// The grove-init the sandboxes run: `$GROVE_INIT_BINARY`, else the static build beside
/// grove-bench (`scripts/build-init release`, what nodes install), else the plain one beside it.
pub fn grove_init() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("GROVE_INIT_BINARY") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let static_init = exe.with_file_name("grove-init-static");
    match static_init.exists() {
        true => static_init,
        false => exe.with_file_name("grove-init"),
    }
}

/// The ELF interpreter (dynamic loader) `binary` names, None for a static executable.
pub fn elf_interpreter(binary: &Path) -> std::io::Result<Option<String>> {
    let data = std::fs::read(binary)?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not a 64-bit ELF file");
    if data.len() < 64 || &data[..4] != b"\x7fELF" || data[4] != 2 {
        return Err(bad());
    }
    let u16_at = |o: usize| u16::from_le_bytes([data[o], data[o + 1]]) as usize;
    let u64_at = |o: usize| {
        data.get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize)
    };
    let (phoff, phentsize, phnum) = (u64_at(0x20).ok_or_else(bad)?, u16_at(0x36), u16_at(0x38));
    for i in 0..phnum {
        let ph = phoff + i * phentsize;
        let p_type = data.get(ph..ph + 4).ok_or_else(bad)?;
        if p_type == 3u32.to_le_bytes() {
            let (off, size) = (
                u64_at(ph + 8).ok_or_else(bad)?,
                u64_at(ph + 32).ok_or_else(bad)?,
            );
            let name = data.get(off..off + size).ok_or_else(bad)?;
            return Ok(Some(
                String::from_utf8_lossy(name)
                    .trim_end_matches('\0')
                    .to_string(),
            ));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod elf_tests {
    use super::*;

    #[test]
    fn tells_dynamic_from_static_executables() {
        let ld = elf_interpreter(Path::new("/bin/true")).unwrap();
        assert!(
            ld.is_some_and(|l| l.contains("ld-linux")),
            "/bin/true is dynamic"
        );
        assert!(elf_interpreter(Path::new("/etc/hostname")).is_err());
    }
}
