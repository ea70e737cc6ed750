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

/// `pid` and every process descending from it, from the children lists of all their threads (a
/// thread other than the main one may fork too); processes that exit meanwhile drop out.
pub fn tree(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        out.push(p);
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let kids = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            todo.extend(
                kids.split_whitespace()
                    .filter_map(|c| c.parse::<i32>().ok()),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_holds_the_root_and_what_it_forked() {
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & wait"])
            .spawn()
            .unwrap();
        let root = sh.id() as i32;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let t = loop {
            let t = tree(root);
            if t.len() >= 2 || std::time::Instant::now() > deadline {
                break t;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        let _ = sh.kill();
        let _ = sh.wait();
        assert_eq!(t[0], root);
        assert_eq!(t.len(), 2, "sh and its sleep: {t:?}");
        assert_eq!(
            tree(i32::MAX),
            vec![i32::MAX],
            "a missing root has no descendants"
        );
    }

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
