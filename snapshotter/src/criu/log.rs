//! Picks the useful lines out of a CRIU log.

/// Lines CRIU prints on every run here that do not explain a failure (see HOST-NOTES).
const HARMLESS: &[&str] = &[
    "Can't setup RLIMIT_NOFILE for self",
    "Address already assigned",
];

/// At most this many lines are kept, the last ones (CRIU's final lines say "FAILED").
const MAX_LINES: usize = 12;

/// The `Error (` lines of a CRIU log, without the known-harmless ones. Falls back to the last
/// lines of the log when CRIU failed without an `Error (` line (e.g. a crash or a BUG).
pub fn error_lines(log: &str) -> Vec<String> {
    let mut errors: Vec<String> = log
        .lines()
        .filter(|l| l.contains("Error (") || l.contains("BUG "))
        .filter(|l| !HARMLESS.iter().any(|h| l.contains(h)))
        .map(|l| l.trim().to_string())
        .collect();
    if errors.is_empty() {
        errors = log
            .lines()
            .rev()
            .take(5)
            .map(|l| l.trim().to_string())
            .collect();
        errors.reverse();
    }
    if errors.len() > MAX_LINES {
        errors.drain(..errors.len() - MAX_LINES);
    }
    errors
}

/// Whether the failure was a socket connected to a peer outside the dumped tree.
/// (CRIU says "External socket is used" when the peer is alive outside, "Unix socket … not found"
/// when the peer is outside the sandbox's network namespace or just closed.)
pub fn is_external_socket(lines: &[String]) -> bool {
    lines.iter().any(|l| {
        l.contains("External socket is used")
            || l.contains("ext-unix-sk")
            || (l.contains("Unix socket") && l.contains("not found"))
    })
}

/// Whether the dump could not read a process's rlimits (EPERM): for a process of another uid
/// that takes CAP_SYS_RESOURCE, which a root without it in its bounding set never has.
pub fn is_rlimit_denied(lines: &[String]) -> bool {
    lines
        .iter()
        .any(|l| l.contains("Can't get rlimit") && l.contains("Operation not permitted"))
}

/// Whether a restore failed on an I/O error opening a file of the new root (a FUSE hiccup rather
/// than a bad image): worth one more try.
pub fn is_io_error(lines: &[String]) -> bool {
    lines
        .iter()
        .any(|l| l.contains("Can't open file") && l.contains("Input/output error"))
}

/// CRIU's staging dirs at fixed /tmp paths; it removes them itself unless it fails or is killed
/// part-way, and then they are ours to remove.
const STAGING: &[&str] = &["/tmp/.criu.mntns.", "/tmp/.criu.move_mount_set_group."];

/// The staging dirs a CRIU log names (mkdtemp: a fixed prefix and six more characters).
pub fn staging_dirs(log: &str) -> Vec<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> = Vec::new();
    for prefix in STAGING {
        for (at, _) in log.match_indices(prefix) {
            // A whole path, not the tail of a longer one (/var/tmp/.criu.…).
            let before = log[..at].chars().next_back();
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || "/._-".contains(c)) {
                continue;
            }
            let rest = &log[at + prefix.len()..];
            let suffix: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            if suffix.len() == 6 {
                let d = std::path::PathBuf::from(format!("{prefix}{suffix}"));
                if !dirs.contains(&d) {
                    dirs.push(d);
                }
            }
        }
    }
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_dirs_are_found_once_each() {
        let log =
            "(00.003217) mnt:   [/tmp/.criu.mntns.EnYddk/13-0000000000/sys/firmware](135->205)\n\
                   (00.003218) mnt:   [/tmp/.criu.mntns.EnYddk/13-0000000000/proc](136->205)\n\
                   (00.000100) kerndat: /tmp/.criu.move_mount_set_group.a1B2c3 made\n\
                   (00.000101) not ours: /tmp/.criu.mntns.short/x and /var/tmp/.criu.mntns.ABCDEF";
        let dirs = staging_dirs(log);
        assert_eq!(
            dirs,
            vec![
                std::path::PathBuf::from("/tmp/.criu.mntns.EnYddk"),
                std::path::PathBuf::from("/tmp/.criu.move_mount_set_group.a1B2c3"),
            ]
        );
    }

    const DUMP_FAIL: &str = "\
(00.000010) Version: 4.1.1
(00.054396) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.055000) mnt: something harmless
(00.057541) Error (criu/mount.c:724): mnt: FS mnt ./oldroot dev 0xfe00000 root / unsupported id 46
(00.078048) Error (criu/cr-dump.c:2111): Dumping FAILED.
";

    #[test]
    fn keeps_error_lines_and_drops_harmless_ones() {
        let lines = error_lines(DUMP_FAIL);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].contains("unsupported id 46"));
        assert!(lines[1].contains("Dumping FAILED"));
    }

    #[test]
    fn falls_back_to_the_log_tail() {
        let log = "a\nb\nc\nd\ne\nf\ng\n";
        assert_eq!(error_lines(log), vec!["c", "d", "e", "f", "g"]);
        assert!(error_lines("").is_empty());
    }

    #[test]
    fn caps_the_number_of_lines() {
        let log: String = (0..40)
            .map(|i| format!("(0.1) Error (x.c:{i}): e{i}\n"))
            .collect();
        let lines = error_lines(&log);
        assert_eq!(lines.len(), MAX_LINES);
        assert!(lines.last().unwrap().ends_with("e39"));
    }

    #[test]
    fn detects_io_errors_on_restore() {
        let log = "(00.37)      4: Error (criu/files-reg.c:2353): Can't open file usr/bin/python3.11 on restore: Input/output error\n";
        assert!(is_io_error(&error_lines(log)));
        assert!(!is_io_error(&error_lines(DUMP_FAIL)));
    }

    #[test]
    fn detects_denied_rlimits() {
        let log =
            "(00.030968) Error (criu/cr-dump.c:371): Can't get rlimit 0: Operation not permitted\n";
        assert!(is_rlimit_denied(&error_lines(log)));
        assert!(!is_rlimit_denied(&error_lines(DUMP_FAIL)));
    }

    #[test]
    fn detects_external_sockets() {
        let log = "(0.2) Error (criu/sk-unix.c:860): unix: External socket is used. Consider using --ext-unix-sk option.\n";
        assert!(is_external_socket(&error_lines(log)));
        let log = "(00.072435) Error (criu/sk-unix.c:351): unix: Unix socket 225745 not found\n";
        assert!(is_external_socket(&error_lines(log)));
        assert!(!is_external_socket(&error_lines(DUMP_FAIL)));
    }
}
