//! Which cgroups a dump names: the freezer the sandbox is frozen with, and the hierarchies
//! that hold the sandbox (its own dirs), so CRIU dumps those and not the host's whole tree.

use std::path::{Path, PathBuf};

/// The freezer CRIU should use: the one the runtime froze the sandbox with (v1 freezer or the
/// cgroup2 `cgroup.freeze`). CRIU then seizes the frozen tasks and leaves the cgroup frozen.
pub(crate) fn frozen(cgroups: &[(String, PathBuf)]) -> Option<PathBuf> {
    freezers(cgroups)
        .into_iter()
        .find(|f| f.is_frozen())
        .map(|f| f.dir)
}

/// The freezer the runtime will freeze the sandbox with, before it does: the first of its
/// freezers (the runtime takes the v1 freezer where the sandbox has one). [`frozen`] says, once
/// frozen, whether that guess was right.
pub(crate) fn freezer(cgroups: &[(String, PathBuf)]) -> Option<PathBuf> {
    freezers(cgroups).into_iter().next().map(|f| f.dir)
}

struct Freezer {
    dir: PathBuf,
    /// Its state file and the content that means frozen.
    state: (&'static str, &'static str),
}

impl Freezer {
    fn is_frozen(&self) -> bool {
        let (file, frozen) = self.state;
        std::fs::read_to_string(self.dir.join(file))
            .unwrap_or_default()
            .trim()
            == frozen
    }
}

/// The sandbox's freezers: its v1 freezer, then its cgroup2 dir.
fn freezers(cgroups: &[(String, PathBuf)]) -> Vec<Freezer> {
    let rel = |p: &PathBuf| p.strip_prefix("/").unwrap_or(p).to_path_buf();
    // cgroup2 sits at /sys/fs/cgroup/unified beside v1 hierarchies, at /sys/fs/cgroup alone.
    let base = Path::new("/sys/fs/cgroup");
    let unified = match base.join("cgroup.controllers").exists() {
        true => base.to_path_buf(),
        false => base.join("unified"),
    };
    let v1 = cgroups
        .iter()
        .filter(|(ctrl, _)| ctrl == "freezer")
        .map(|(_, path)| Freezer {
            dir: Path::new("/sys/fs/cgroup/freezer").join(rel(path)),
            state: ("freezer.state", "FROZEN"),
        });
    let v2 = cgroups
        .iter()
        .filter(|(ctrl, _)| ctrl == "unified")
        .map(|(_, path)| Freezer {
            dir: unified.join(rel(path)),
            state: ("cgroup.freeze", "1"),
        });
    v1.chain(v2).collect()
}

/// The hierarchies in which `pid` sits in one of the sandbox's own cgroups (`cgroups`: the
/// runtime's (controller, path) pairs), named as `/proc/<pid>/cgroup` names them (`""` for
/// cgroup2, `cpu,cpuacct` where co-mounted). Empty when that file can't be read: CRIU then
/// dumps every hierarchy, as it does by default.
pub(crate) fn own_controllers(pid: i32, cgroups: &[(String, PathBuf)]) -> Vec<String> {
    let table = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    controllers_at(&table, cgroups)
}

fn controllers_at(table: &str, cgroups: &[(String, PathBuf)]) -> Vec<String> {
    let mut names: Vec<String> = table
        .lines()
        .filter_map(|line| {
            let mut f = line.splitn(3, ':');
            let (_, names, path) = (f.next()?, f.next()?, f.next()?);
            cgroups
                .iter()
                .any(|(_, own)| Path::new(path) == own)
                .then(|| names.to_string())
        })
        .collect();
    names.dedup();
    names
}

/// Name of the file, in a dump's images, listing the hierarchies the dump holds (one per line,
/// as [`own_controllers`] names them). A restore uses the yard only when it covers them all.
pub(crate) const DUMPED_LIST: &str = "grove-cgroups";

/// A cgroup yard for CRIU (`--cgroup-yard`): a directory with one symlink per hierarchy of this
/// host, named as CRIU names it (`unified` for cgroup2, `systemd` for `name=systemd`,
/// `cpu,cpuacct` where co-mounted) and pointing at its mount. With it CRIU opens the
/// hierarchies instead of mounting and lazily unmounting each one per dump and per restore
/// (~7 ms apiece here).
#[derive(Debug, Clone)]
pub(crate) struct CgroupYard {
    dir: PathBuf,
    entries: Vec<String>,
}

impl CgroupYard {
    /// Builds the yard in `dir` from groved's own `/proc/self/cgroup`; hierarchies not mounted
    /// where the usual layout puts them (`/sys/fs/cgroup/<name>`) are left out.
    pub(crate) fn make(dir: &Path) -> Option<CgroupYard> {
        let table = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let base = Path::new("/sys/fs/cgroup");
        let pure_v2 = base.join("cgroup.controllers").exists();
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).ok()?;
        // Relative links: a restored task resolves them from the yard's fd after it has moved
        // into the sandbox's root, where an absolute target would name the sandbox's /sys.
        let up = PathBuf::from_iter(dir.canonicalize().ok()?.components().skip(1).map(|_| ".."));
        let mut entries = Vec::new();
        for (name, target) in yard_links(&table, base, pure_v2) {
            let relative = up.join(target.strip_prefix("/").unwrap_or(&target));
            if target.join("cgroup.procs").exists()
                && std::os::unix::fs::symlink(&relative, dir.join(&name)).is_ok()
            {
                entries.push(name);
            }
        }
        Some(CgroupYard {
            dir: dir.to_path_buf(),
            entries,
        })
    }

    /// The yard, if it has an entry for each of `controllers` (names as `/proc/<pid>/cgroup`
    /// gives them). CRIU would mount a missing one inside the yard and leave it there.
    pub(crate) fn covering(&self, controllers: &[String]) -> Option<PathBuf> {
        let covered = !controllers.is_empty()
            && controllers
                .iter()
                .all(|c| self.entries.contains(&entry_name(c)));
        covered.then(|| self.dir.clone())
    }

    /// Removes the yard (its links only; what they point at stays).
    pub(crate) fn remove(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// The yard for restoring the dump in `images`, per the list the dump left there.
    pub(crate) fn for_images(&self, images: &Path) -> Option<PathBuf> {
        let list = std::fs::read_to_string(images.join(DUMPED_LIST)).ok()?;
        let controllers: Vec<String> = list.lines().map(str::to_string).collect();
        self.covering(&controllers)
    }
}

/// Records in `images` which hierarchies the dump holds (see [`DUMPED_LIST`]).
pub(crate) fn write_dumped_list(images: &Path, controllers: &[String]) -> std::io::Result<()> {
    let mut text = controllers.join("\n");
    text.push('\n');
    std::fs::write(images.join(DUMPED_LIST), text)
}

/// CRIU's directory name for a hierarchy.
fn entry_name(controllers: &str) -> String {
    match controllers {
        "" => "unified".to_string(),
        n => n.strip_prefix("name=").unwrap_or(n).to_string(),
    }
}

/// (yard entry, mount) per hierarchy in a `/proc/<pid>/cgroup` table.
fn yard_links(table: &str, base: &Path, pure_v2: bool) -> Vec<(String, PathBuf)> {
    table
        .lines()
        .filter_map(|line| line.split(':').nth(1))
        .map(|names| {
            let entry = entry_name(names);
            let at = match names {
                "" if pure_v2 => base.to_path_buf(),
                _ => base.join(&entry),
            };
            (entry, at)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_only_the_hierarchies_holding_the_sandbox() {
        let table = "12:pids:/grove/sb-1\n11:cpu,cpuacct:/grove/sb-1\n10:blkio:/\n\
                     9:memory:/grove/sb-1\n1:name=systemd:/user.slice\n0::/grove/sb-1\n";
        let own: Vec<(String, PathBuf)> = ["pids", "cpu", "memory", "unified"]
            .iter()
            .map(|c| (c.to_string(), PathBuf::from("/grove/sb-1")))
            .collect();
        assert_eq!(
            controllers_at(table, &own),
            ["pids", "cpu,cpuacct", "memory", ""]
        );
        assert!(controllers_at("", &own).is_empty());
        assert!(controllers_at(table, &[("pids".into(), "/grove/sb-2".into())]).is_empty());
    }

    #[test]
    fn yard_names_hierarchies_as_criu_does() {
        let base = Path::new("/c");
        let hybrid = yard_links("4:cpu,cpuacct:/\n1:name=systemd:/x\n0::/\n", base, false);
        assert_eq!(
            hybrid,
            [
                ("cpu,cpuacct".to_string(), PathBuf::from("/c/cpu,cpuacct")),
                ("systemd".to_string(), PathBuf::from("/c/systemd")),
                ("unified".to_string(), PathBuf::from("/c/unified")),
            ]
        );
        let v2 = yard_links("0::/init.scope\n", base, true);
        assert_eq!(v2, [("unified".to_string(), PathBuf::from("/c"))]);
    }

    #[test]
    fn a_dump_lists_its_hierarchies_for_the_restore() {
        let images = tempfile::tempdir().unwrap();
        let yard = CgroupYard {
            dir: "/y".into(),
            entries: vec!["cpu".into(), "unified".into()],
        };
        write_dumped_list(images.path(), &["cpu".into(), "".into()]).unwrap();
        assert_eq!(yard.for_images(images.path()), Some(PathBuf::from("/y")));
        write_dumped_list(images.path(), &["".into(), "cpu".into(), "hugetlb".into()]).unwrap();
        assert_eq!(yard.for_images(images.path()), None, "hugetlb has no entry");
    }

    #[test]
    fn the_yard_of_this_host_opens_the_hierarchies_and_covers_only_those() {
        let dir = tempfile::tempdir().unwrap();
        let yard = CgroupYard::make(&dir.path().join("yard")).unwrap();
        for e in std::fs::read_dir(&yard.dir).unwrap() {
            let e = e.unwrap().path();
            assert!(
                e.join("cgroup.procs").exists(),
                "{} is not a cgroup hierarchy",
                e.display()
            );
        }
        let Some(first) = yard.entries.first() else {
            grove_testkit::capability_missing("no cgroup hierarchy under /sys/fs/cgroup");
            return;
        };
        let name = if first == "unified" {
            String::new()
        } else {
            first.clone()
        };
        assert_eq!(
            yard.covering(std::slice::from_ref(&name)),
            Some(yard.dir.clone())
        );
        assert_eq!(yard.covering(&[name, "no-such-controller".into()]), None);
        assert_eq!(yard.covering(&[]), None);
        let images = tempfile::tempdir().unwrap();
        assert_eq!(yard.for_images(images.path()), None, "no list: no yard");
    }
}
