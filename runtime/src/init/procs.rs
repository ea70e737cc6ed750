//! Process-table helpers for init: listing, and killing a command's whole tree.

use std::collections::{HashMap, HashSet};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::proto::Proc;

/// (pid, ppid, session, state) of every process in /proc.
pub(super) fn table() -> Vec<(i32, i32, i32, char)> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // Fields after the ")" that closes comm: state ppid pgrp session ...
            let rest = &stat[stat.rfind(')')? + 2..];
            let mut it = rest.split(' ');
            let state = it.next()?.chars().next()?;
            let ppid = it.next()?.parse().ok()?;
            let _pgrp = it.next()?;
            let sid = it.next()?.parse().ok()?;
            Some((pid, ppid, sid, state))
        })
        .collect()
}

/// Every process but init itself.
pub fn list() -> Vec<Proc> {
    table()
        .into_iter()
        .filter(|&(pid, ..)| pid != 1)
        .map(|(pid, _, _, state)| {
            let argv = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|b| {
                    b.split(|&c| c == 0)
                        .filter(|s| !s.is_empty())
                        .map(|s| String::from_utf8_lossy(s).into_owned())
                        .collect()
                })
                .unwrap_or_default();
            Proc {
                pid,
                argv,
                running: state != 'Z' && state != 'X',
            }
        })
        .collect()
}

/// SIGKILLs `top`, its descendants and everything in its session, repeating until none is left alive
/// (so forks racing the kill are caught). `top` is a subreaper, so double-forked children stay below it.
pub fn kill_tree(top: i32) {
    for _ in 0..50 {
        let t = table();
        let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
        for &(pid, ppid, ..) in &t {
            children.entry(ppid).or_default().push(pid);
        }
        let mut victims: HashSet<i32> = HashSet::new();
        let mut stack = vec![top];
        while let Some(p) = stack.pop() {
            if victims.insert(p) {
                stack.extend(children.get(&p).into_iter().flatten());
            }
        }
        victims.extend(
            t.iter()
                .filter(|&&(_, _, sid, _)| sid == top)
                .map(|&(pid, ..)| pid),
        );
        let alive: Vec<i32> = t
            .iter()
            .filter(|&&(pid, _, _, st)| {
                pid != 1 && victims.contains(&pid) && st != 'Z' && st != 'X'
            })
            .map(|&(pid, ..)| pid)
            .collect();
        if alive.is_empty() {
            return;
        }
        for pid in alive {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}
