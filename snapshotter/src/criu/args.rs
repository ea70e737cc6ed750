//! CRIU command lines, built from typed options (pure, so it is unit-tested).

use std::ffi::OsString;
use std::path::PathBuf;

/// Name of the log file CRIU writes in the work dir.
pub const DUMP_LOG: &str = "dump.log";
pub const RESTORE_LOG: &str = "restore.log";
pub const LAZY_LOG: &str = "lazy-pages.log";

/// Key naming an offline sandbox's network namespace as external: dumped by reference (no
/// `ip`/`iptables` saves while frozen), restored by joining the fresh loopback-only namespace
/// the restore passes in at [`NETNS_FD`].
pub const NETNS_KEY: &str = "grove-netns";
/// The fd number the fresh network namespace has in a restoring CRIU.
pub const NETNS_FD: i32 = 4;

/// `criu lazy-pages`: serves the pages of `images` to a `--lazy-pages` restore using `work`.
pub fn lazy_pages_args(images: &std::path::Path, work: &std::path::Path) -> Vec<OsString> {
    let mut a: Vec<OsString> = vec![
        "lazy-pages".into(),
        "-D".into(),
        images.into(),
        "-W".into(),
        work.into(),
    ];
    a.extend(["-v4", "-o", LAZY_LOG].map(OsString::from));
    a
}

/// What to checkpoint and how.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DumpOptions {
    /// Host pid of the tree's root (the sandbox's pid 1).
    pub pid: i32,
    /// Where the images go (must exist, empty).
    pub images_dir: PathBuf,
    /// Where CRIU keeps its log (kept out of the images so the log is not stored with them).
    pub work_dir: PathBuf,
    /// Keep the tree running after the dump.
    pub leave_running: bool,
    /// Mounts provided from outside the sandbox: (path inside the sandbox, key).
    pub external_mounts: Vec<(String, String)>,
    /// The freezer the caller froze the tree with; CRIU seizes the frozen tasks and leaves the
    /// cgroup in the state it found it.
    pub freeze_cgroup: Option<PathBuf>,
    /// Checkpoint established TCP connections (loopback ones inside the sandbox).
    pub tcp_established: bool,
    /// Incremental dump against `prev_images_dir` (needs soft-dirty or `uffd_wp`; see
    /// `Features`).
    pub track_mem: bool,
    pub prev_images_dir: Option<PathBuf>,
    /// Dirty pages come from Grove's userfaultfd write-protect tracking, through the shim
    /// (`Features::uffd_wp`).
    pub uffd_wp: bool,
    /// Inode of the tree's network namespace, to dump as external ([`NETNS_KEY`]).
    pub external_net: Option<u64>,
    /// Dump (and so restore: CRIU takes the method from the images) without the network lock.
    /// Only for a frozen tree whose network namespace has no interface but loopback and no TCP
    /// socket but listeners and TIME_WAIT: no task runs, no peer is outside, and no TCP timer
    /// (retransmission, probe, delayed ACK) is armed, so nothing moves a packet while CRIU
    /// reads the sockets. With `external_net` too, the shim answers CRIU's conntrack dump of
    /// an empty table itself (compat/criu-shim.c, 5).
    pub skip_network_lock: bool,
    /// The cgroup hierarchies to dump, named as in `/proc/<pid>/cgroup` (`""` for cgroup2):
    /// the sandbox's own. Empty: all. CRIU otherwise walks and dumps every hierarchy the tree
    /// sits at the root of, i.e. the whole host's cgroup tree (tens of ms, growing with it).
    pub cgroup_controllers: Vec<String>,
    /// A directory naming every cgroup hierarchy (see `--cgroup-yard`); None: CRIU mounts
    /// and unmounts each one itself.
    pub cgroup_yard: Option<PathBuf>,
}

/// `criu pre-dump`: copies the tree's memory while it keeps running and arms soft-dirty
/// tracking, so a dump with `track_mem` and `prev_images_dir` = this dir writes only the pages
/// dirtied since (the frozen part shrinks to those). Needs `Features::mem_dirty_track`.
#[derive(Debug, Clone, Default)]
pub struct PreDumpOptions {
    pub pid: i32,
    pub images_dir: PathBuf,
    pub work_dir: PathBuf,
    pub external_mounts: Vec<(String, String)>,
}

/// Name of the log of a pre-dump in the work dir.
pub const PRE_DUMP_LOG: &str = "pre-dump.log";

impl PreDumpOptions {
    pub fn to_args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> =
            vec!["pre-dump".into(), "-t".into(), self.pid.to_string().into()];
        common(
            &mut a,
            &self.images_dir,
            &self.work_dir,
            PRE_DUMP_LOG,
            LOCK_NFTABLES,
        );
        for (path, key) in &self.external_mounts {
            a.push("--external".into());
            a.push(format!("mnt[{path}]:{key}").into());
        }
        a.push("--track-mem".into());
        a
    }

    /// The dump that completes this pre-dump: only pages dirtied since, the rest referenced
    /// in the pre-dump's images through the `parent` symlink CRIU makes in the dump dir. CRIU
    /// takes that path relative to the dump dir, so the two dirs must be siblings.
    pub fn complete(&self, dump: DumpOptions) -> DumpOptions {
        let name = self.images_dir.file_name().unwrap_or_default();
        DumpOptions {
            track_mem: true,
            prev_images_dir: Some(std::path::Path::new("..").join(name)),
            ..dump
        }
    }
}

/// What to restore and where.
#[derive(Debug, Clone, Default)]
pub struct RestoreOptions {
    pub images_dir: PathBuf,
    pub work_dir: PathBuf,
    /// The fresh root filesystem of the new sandbox (mandatory here, see HOST-NOTES).
    pub root: PathBuf,
    /// CRIU writes the host pid of the restored root task here.
    pub pidfile: PathBuf,
    /// (controller, cgroup path relative to the hierarchy root), one per controller.
    pub cgroup_roots: Vec<(String, PathBuf)>,
    /// External mounts: (key used at dump, host path to bind there).
    pub external_mounts: Vec<(String, PathBuf)>,
    pub tcp_established: bool,
    /// Leave memory to a `criu lazy-pages` daemon listening in `work_dir`.
    pub lazy_pages: bool,
    /// The images name an external network namespace: join the one passed at [`NETNS_FD`].
    pub inherit_netns: bool,
    /// As [`DumpOptions::cgroup_yard`].
    pub cgroup_yard: Option<PathBuf>,
    /// Restore every VMA mergeable by ksmd (`PR_SET_MEMORY_MERGE` on CRIU, which its tasks
    /// inherit): a fork's branches share their clean pages (see `ksm.rs`).
    pub merge_pages: bool,
}

/// CRIU's network lock: an nftables table that drops every packet in the tree's network
/// namespace while it is dumped or restored (its teardown waits out an RCU grace period, about
/// 13 ms here). A restore takes the method its images were dumped with, whatever it is told.
const LOCK_NFTABLES: &str = "nftables";
/// No lock: for a namespace whose only interface is loopback, so that every peer of its
/// sockets is a task of the frozen tree (see [`DumpOptions::skip_network_lock`]).
const LOCK_SKIP: &str = "skip";

fn common(args: &mut Vec<OsString>, images: &PathBuf, work: &PathBuf, log: &str, lock: &str) {
    args.push("-D".into());
    args.push(images.into());
    args.push("-W".into());
    args.push(work.into());
    // A dump logs at info level: at debug level CRIU writes lines for every run of pages, which
    // cost an incremental dump of a 256 MiB heap 40-100 ms while frozen (26,000-60,000 lines).
    // Grove reads only the error lines; restores keep debug level for their diagnosis.
    let level = if log == DUMP_LOG { "-v3" } else { "-v4" };
    args.extend([level, "-o", log, "--network-lock", lock].map(OsString::from));
}

fn yard(args: &mut Vec<OsString>, yard: &Option<PathBuf>) {
    if let Some(y) = yard {
        args.push("--cgroup-yard".into());
        args.push(y.into());
    }
}

impl DumpOptions {
    pub fn to_args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = vec!["dump".into(), "-t".into(), self.pid.to_string().into()];
        let lock = match self.skip_network_lock {
            true => LOCK_SKIP,
            false => LOCK_NFTABLES,
        };
        common(&mut a, &self.images_dir, &self.work_dir, DUMP_LOG, lock);
        if self.leave_running {
            a.push("--leave-running".into());
        }
        if let Some(cg) = &self.freeze_cgroup {
            a.push("--freeze-cgroup".into());
            a.push(cg.into());
        }
        for (path, key) in &self.external_mounts {
            a.push("--external".into());
            a.push(format!("mnt[{path}]:{key}").into());
        }
        if let Some(ino) = self.external_net {
            a.push("--external".into());
            a.push(format!("net[{ino}]:{NETNS_KEY}").into());
        }
        for c in &self.cgroup_controllers {
            a.push("--cgroup-dump-controller".into());
            a.push(c.into());
        }
        yard(&mut a, &self.cgroup_yard);
        if self.tcp_established {
            a.push("--tcp-established".into());
        }
        if self.track_mem {
            a.push("--track-mem".into());
            if let Some(prev) = &self.prev_images_dir {
                a.push("--prev-images-dir".into());
                a.push(prev.into());
            }
        }
        a
    }
}

impl RestoreOptions {
    pub fn to_args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = vec!["restore".into()];
        common(
            &mut a,
            &self.images_dir,
            &self.work_dir,
            RESTORE_LOG,
            LOCK_NFTABLES,
        );
        a.push("-d".into());
        a.push("--root".into());
        a.push((&self.root).into());
        a.push("--pidfile".into());
        a.push((&self.pidfile).into());
        if !self.cgroup_roots.is_empty() {
            a.push("--manage-cgroups=soft".into());
            yard(&mut a, &self.cgroup_yard);
        }
        for (ctrl, path) in &self.cgroup_roots {
            a.push("--cgroup-root".into());
            // CRIU names the cgroup2 hierarchy by the empty controller name.
            let ctrl = if ctrl == "unified" { "" } else { ctrl.as_str() };
            let mut v = OsString::from(format!("{ctrl}:/"));
            v.push(path.strip_prefix("/").unwrap_or(path));
            a.push(v);
        }
        for (key, host) in &self.external_mounts {
            a.push("--external".into());
            let mut v = OsString::from(format!("mnt[{key}]:"));
            v.push(host);
            a.push(v);
        }
        if self.tcp_established {
            a.push("--tcp-established".into());
        }
        if self.lazy_pages {
            a.push("--lazy-pages".into());
        }
        if self.inherit_netns {
            a.push("--inherit-fd".into());
            a.push(format!("fd[{NETNS_FD}]:{NETNS_KEY}").into());
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strs(v: Vec<OsString>) -> Vec<String> {
        v.into_iter().map(|s| s.into_string().unwrap()).collect()
    }

    #[test]
    fn dump_args() {
        let o = DumpOptions {
            pid: 42,
            images_dir: "/i".into(),
            work_dir: "/w".into(),
            leave_running: true,
            external_mounts: vec![("/data".into(), "grove-data".into())],
            freeze_cgroup: Some("/sys/fs/cgroup/freezer/grove/sb-1".into()),
            tcp_established: true,
            ..Default::default()
        };
        let a = strs(o.to_args()).join(" ");
        assert_eq!(
            a,
            "dump -t 42 -D /i -W /w -v3 -o dump.log --network-lock nftables --leave-running \
             --freeze-cgroup /sys/fs/cgroup/freezer/grove/sb-1 --external mnt[/data]:grove-data \
             --tcp-established"
        );
        let quiet = DumpOptions {
            skip_network_lock: true,
            ..o
        };
        let a = strs(quiet.to_args()).join(" ");
        assert!(a.contains(" --network-lock skip "), "{a}");
    }

    #[test]
    fn dump_names_only_the_sandbox_cgroups() {
        let o = DumpOptions {
            pid: 1,
            cgroup_controllers: vec!["cpu".into(), "".into()],
            cgroup_yard: Some("/y".into()),
            ..Default::default()
        };
        let a = strs(o.to_args());
        let at = a
            .iter()
            .position(|x| x == "--cgroup-dump-controller")
            .unwrap();
        assert_eq!(
            a[at..at + 6],
            [
                "--cgroup-dump-controller",
                "cpu",
                "--cgroup-dump-controller",
                "",
                "--cgroup-yard",
                "/y"
            ]
        );
    }

    #[test]
    fn dump_stops_by_default_and_tracks_mem_only_when_asked() {
        let o = DumpOptions {
            pid: 1,
            images_dir: "/i".into(),
            work_dir: "/w".into(),
            ..Default::default()
        };
        let a = strs(o.to_args());
        assert!(!a.contains(&"--leave-running".to_string()));
        assert!(!a.contains(&"--track-mem".to_string()));
        let o = DumpOptions {
            track_mem: true,
            prev_images_dir: Some("../p".into()),
            ..o
        };
        let a = strs(o.to_args()).join(" ");
        assert!(a.ends_with("--track-mem --prev-images-dir ../p"), "{a}");
    }

    #[test]
    fn offline_netns_is_external_on_both_sides() {
        let d = DumpOptions {
            pid: 3,
            images_dir: "/i".into(),
            work_dir: "/w".into(),
            external_net: Some(4026533214),
            ..Default::default()
        };
        let a = strs(d.to_args()).join(" ");
        assert!(a.ends_with("--external net[4026533214]:grove-netns"), "{a}");
        let r = RestoreOptions {
            images_dir: "/i".into(),
            work_dir: "/w".into(),
            inherit_netns: true,
            ..Default::default()
        };
        let a = strs(r.to_args()).join(" ");
        assert!(a.ends_with("--inherit-fd fd[4]:grove-netns"), "{a}");
    }

    #[test]
    fn pre_dump_then_incremental_dump() {
        let pre = PreDumpOptions {
            pid: 7,
            images_dir: "/s/pre".into(),
            work_dir: "/s/criu".into(),
            external_mounts: vec![("/data".into(), "k".into())],
        };
        assert_eq!(
            strs(pre.to_args()).join(" "),
            "pre-dump -t 7 -D /s/pre -W /s/criu -v4 -o pre-dump.log --network-lock nftables \
             --external mnt[/data]:k --track-mem"
        );
        let dump = pre.complete(DumpOptions {
            pid: 7,
            images_dir: "/s/images".into(),
            work_dir: "/s/criu".into(),
            leave_running: true,
            ..Default::default()
        });
        let a = strs(dump.to_args()).join(" ");
        assert!(a.starts_with("dump -t 7 -D /s/images"), "{a}");
        assert!(a.ends_with("--track-mem --prev-images-dir ../pre"), "{a}");
    }

    #[test]
    fn restore_args() {
        let o = RestoreOptions {
            images_dir: "/i".into(),
            work_dir: "/w".into(),
            root: "/run/grove/sb/root".into(),
            pidfile: "/w/pid".into(),
            cgroup_roots: vec![
                ("memory".into(), "grove/sb-2".into()),
                ("cpuset".into(), "/grove/sb-2".into()),
                ("unified".into(), "grove/sb-2".into()),
            ],
            external_mounts: vec![("grove-data".into(), "/srv/data".into())],
            tcp_established: false,
            lazy_pages: true,
            inherit_netns: false,
            cgroup_yard: Some("/y".into()),
            merge_pages: true,
        };
        let a = strs(o.to_args()).join(" ");
        assert_eq!(
            a,
            "restore -D /i -W /w -v4 -o restore.log --network-lock nftables -d \
             --root /run/grove/sb/root --pidfile /w/pid --manage-cgroups=soft --cgroup-yard /y \
             --cgroup-root memory:/grove/sb-2 --cgroup-root cpuset:/grove/sb-2 --cgroup-root :/grove/sb-2 \
             --external mnt[grove-data]:/srv/data --lazy-pages"
        );
    }
}
