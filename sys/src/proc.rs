//! `/proc` views of processes.

/// The children of process `pid` (those of its main thread, which is where a single-threaded
/// parent forks), from `/proc/<pid>/task/<pid>/children`; none when it is gone.
pub fn children(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|k| k.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Test threads are not the main thread: a shell forks, and says whom.
    #[test]
    fn lists_what_a_process_forked_and_nothing_for_a_missing_pid() {
        use std::io::BufRead;
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(sh.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let sleep: i32 = line.trim().parse().unwrap();
        let kids = children(sh.id() as i32);
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(sleep),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = sh.wait();
        assert_eq!(kids, [sleep]);
        assert_eq!(children(i32::MAX), Vec::<i32>::new());
    }
}
