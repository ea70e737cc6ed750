//! What a CRIU killed part-way through a dump leaves in the processes it had seized.
//!
//! CRIU (compel) works inside each process it dumps, and undoes it when it cures the process:
//!
//! - For each system call it makes the process run, it writes a `syscall` instruction followed
//!   by six `int3` over the first bytes of the process's lowest executable mapping
//!   (`get_exec_start`) and writes the original bytes back right after. Killed in between (by
//!   the OOM killer; a restarting groved lets it finish, `recover.rs`), it leaves those eight
//!   bytes: the process runs on (nothing jumps to a mapping's first byte), but every later dump
//!   carries them, and where that mapping is the vDSO a restore of any such snapshot fails
//!   ("vdso: ELF header magic mismatch"). No mapping starts with these bytes otherwise (an ELF
//!   header, or the text a linker placed there).
//! - Its parasite, mapped from a memfd named `CRIUMFD` for the whole dump of the process, runs
//!   there as a daemon serving CRIU's socket. Killed then, CRIU leaves the mapping, and the
//!   process, thawed, runs on in parasite code that traps once the socket is gone.
//!
//! Either is proof that the process is no longer what it was, not a guess. (A sandbox can name
//! a memfd `CRIUMFD` itself; it only gets itself reported failed, after a failed dump or a
//! restart of groved.)

use std::fmt;
use std::os::unix::fs::FileExt;

/// compel's `code_syscall` for x86-64: `syscall` and six `int3`.
pub const CRIU_SYSCALL_CODE: [u8; 8] = [0x0f, 0x05, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc];

/// How /proc/<pid>/maps names the memfd compel maps its parasite from.
pub const CRIU_PARASITE_MAPPING: &str = "/memfd:CRIUMFD (deleted)";

/// What CRIU left in a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Its `syscall` instruction over the start of an executable mapping.
    SyscallCode,
    /// Its parasite's mapping.
    Parasite,
}

/// CRIU's code left in a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leftover {
    pub pid: i32,
    pub kind: Kind,
    /// Start of the mapping that holds it.
    pub addr: u64,
    /// The mapping's name in /proc/<pid>/maps (a path, `[vdso]`, or empty).
    pub mapping: String,
}

impl fmt::Display for Leftover {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            Kind::SyscallCode => "CRIU's syscall instruction written",
            Kind::Parasite => "CRIU's parasite mapped",
        };
        let mapping = if self.mapping.is_empty() {
            "anonymous"
        } else {
            &self.mapping
        };
        write!(
            f,
            "{what} at {:#x} ({mapping}) in process {}",
            self.addr, self.pid
        )
    }
}

/// The first of `pids` whose executable mappings hold CRIU's code. Processes that are gone, or
/// whose memory cannot be read, have none.
pub fn find_in(pids: impl IntoIterator<Item = i32>) -> Option<Leftover> {
    pids.into_iter().find_map(find_in_process)
}

fn find_in_process(pid: i32) -> Option<Leftover> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).ok()?;
    for line in maps.lines() {
        let Some((start, mapping)) = executable_start(line) else {
            continue;
        };
        let leftover = |kind| Leftover {
            pid,
            kind,
            addr: start,
            mapping: mapping.to_string(),
        };
        if mapping == CRIU_PARASITE_MAPPING {
            return Some(leftover(Kind::Parasite));
        }
        let mut head = [0u8; CRIU_SYSCALL_CODE.len()];
        if mem.read_exact_at(&mut head, start).is_ok() && head == CRIU_SYSCALL_CODE {
            return Some(leftover(Kind::SyscallCode));
        }
    }
    None
}

/// Start and name of an executable user mapping in a maps line (`[vsyscall]` lies above user
/// space and is never written).
fn executable_start(line: &str) -> Option<(u64, &str)> {
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?;
    let name = fields.nth(3).map(str::trim).unwrap_or("");
    if perms.as_bytes().get(2) != Some(&b'x') || name == "[vsyscall]" {
        return None;
    }
    let start = u64::from_str_radix(range.split_once('-')?.0, 16).ok()?;
    Some((start, name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Child, Command};

    struct Killed(Child);

    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn maps_lines_name_executable_mappings() {
        let text = "55d0c0a00000-55d0c0a22000 r-xp 00002000 fe:01 131 /usr/bin/sleep";
        assert_eq!(
            executable_start(text),
            Some((0x55d0_c0a0_0000, "/usr/bin/sleep"))
        );
        let vdso =
            "7ffd1a1f0000-7ffd1a1f2000 r-xp 00000000 00:00 0                          [vdso]";
        assert_eq!(executable_start(vdso), Some((0x7ffd_1a1f_0000, "[vdso]")));
        let anon = "7f00000000-7f00001000 r-xp 00000000 00:00 0";
        assert_eq!(executable_start(anon), Some((0x7f_0000_0000, "")));
        let data = "55d0c0a22000-55d0c0a23000 rw-p 00024000 fe:01 131 /usr/bin/sleep";
        assert_eq!(executable_start(data), None);
        let vsyscall = "ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0  [vsyscall]";
        assert_eq!(executable_start(vsyscall), None);
    }

    /// A process with a memfd named as CRIU names its parasite's mapped executable, as CRIU maps
    /// it: found.
    #[test]
    fn a_parasite_mapping_left_in_a_process_is_found() {
        use std::io::BufRead;
        let script = "import os, mmap, time\n\
                      fd = os.memfd_create('CRIUMFD')\n\
                      os.ftruncate(fd, 4096)\n\
                      m = mmap.mmap(fd, 4096, prot=mmap.PROT_READ | mmap.PROT_EXEC)\n\
                      print('mapped', flush=True)\n\
                      time.sleep(30)\n";
        let mut child = Killed(
            Command::new("/usr/bin/python3")
                .args(["-c", script])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let mut line = String::new();
        std::io::BufReader::new(child.0.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "mapped");
        let pid = child.0.id() as i32;
        let found = find_in([pid]).expect("the parasite's mapping is found");
        assert_eq!((found.pid, found.kind), (pid, Kind::Parasite));
        assert_eq!(found.mapping, CRIU_PARASITE_MAPPING);
        assert!(
            found.to_string().contains("CRIU's parasite mapped"),
            "{found}"
        );
    }

    /// Writes CRIU's code where CRIU would (the lowest executable mapping) into a live child,
    /// as a debugger writes a breakpoint: found there, and not in the untouched child.
    #[test]
    fn criu_code_left_in_a_process_is_found() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED criu_code_left_in_a_process_is_found: needs root to write another process's text");
            return;
        }
        let clean = Killed(Command::new("sleep").arg("30").spawn().unwrap());
        let marked = Killed(Command::new("sleep").arg("30").spawn().unwrap());
        let (clean_pid, marked_pid) = (clean.0.id() as i32, marked.0.id() as i32);
        // Let both exec; a pid's maps name sleep's own mappings from then on.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        for pid in [clean_pid, marked_pid] {
            while !std::fs::read_to_string(format!("/proc/{pid}/maps"))
                .unwrap_or_default()
                .contains("sleep")
            {
                assert!(std::time::Instant::now() < deadline, "sleep did not exec");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        assert_eq!(find_in([clean_pid, marked_pid]), None);
        let maps = std::fs::read_to_string(format!("/proc/{marked_pid}/maps")).unwrap();
        let (start, name) = maps.lines().find_map(executable_start).unwrap();
        let mem = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/{marked_pid}/mem"))
            .unwrap();
        mem.write_all_at(&CRIU_SYSCALL_CODE, start).unwrap();
        let found = find_in([clean_pid, marked_pid]).expect("the code written is found");
        assert_eq!(
            found,
            Leftover {
                pid: marked_pid,
                kind: Kind::SyscallCode,
                addr: start,
                mapping: name.to_string()
            }
        );
        assert!(found.to_string().contains(&format!("process {marked_pid}")));
        assert_eq!(
            find_in([clean_pid, 0, i32::MAX]),
            None,
            "gone or absent: none"
        );
    }
}
