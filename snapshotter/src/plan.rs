//! How a snapshot dumps memory. Where the kernel tracks dirty pages (soft-dirty, probed once as
//! `Features::mem_dirty_track`), a pre-dump copies memory while the sandbox runs and the frozen
//! dump writes only the pages dirtied since. Without it (this project's reference kernel has
//! no `CONFIG_MEM_SOFT_DIRTY`) the dump is full, or, where userfaultfd write-protect tracking
//! works, incremental against the sandbox's last snapshot (`snapshotter/tracking.rs`); either
//! way the content store's per-page dedup keeps repeated snapshots of one sandbox down to the
//! pages that changed.
//! Pure, so both cases are unit-tested on any kernel.

use std::io;
use std::path::Path;

use crate::criu::{DumpOptions, Features, PreDumpOptions};

/// Scratch layout of one capture: `<scratch>/images` (the dump), `<scratch>/pre` (a pre-dump,
/// sibling of the dump as CRIU's relative `--prev-images-dir` needs), `<scratch>/criu` (logs).
pub(crate) const IMAGES: &str = "images";
pub(crate) const PRE: &str = "pre";
pub(crate) const LOGS: &str = "criu";

/// The pre-dump to run before freezing, if the kernel has soft-dirty tracking. A sandbox that
/// is already frozen gains nothing from one (its memory cannot change meanwhile).
pub(crate) fn pre_dump(
    features: Features,
    already_frozen: bool,
    base: &DumpOptions,
    scratch: &Path,
) -> Option<PreDumpOptions> {
    (features.mem_dirty_track && !already_frozen).then(|| PreDumpOptions {
        pid: base.pid,
        images_dir: scratch.join(PRE),
        work_dir: base.work_dir.clone(),
        external_mounts: base.external_mounts.clone(),
    })
}

/// The frozen dump: full, or the pages dirtied since `pre`.
pub(crate) fn dump(base: DumpOptions, pre: Option<&PreDumpOptions>) -> DumpOptions {
    match pre {
        Some(p) => p.complete(base),
        None => base,
    }
}

/// After an incremental dump: replaces the `parent` symlink CRIU made in the dump dir with the
/// pre-dump dir itself, so the images are one self-contained tree for the store (CRIU's
/// restore opens `parent` whether it is a link or a directory).
pub(crate) fn nest_parent(images: &Path, pre: &Path) -> io::Result<()> {
    let link = images.join("parent");
    if std::fs::symlink_metadata(&link).is_ok_and(|m| m.file_type().is_symlink()) {
        std::fs::remove_file(&link)?;
    }
    std::fs::rename(pre, &link)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    fn base() -> DumpOptions {
        DumpOptions {
            pid: 9,
            images_dir: "/s/images".into(),
            work_dir: "/s/criu".into(),
            leave_running: true,
            external_mounts: vec![("/data".into(), "k".into())],
            tcp_established: true,
            ..Default::default()
        }
    }

    fn joined(a: Vec<OsString>) -> String {
        a.into_iter()
            .map(|s| s.into_string().unwrap())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn without_soft_dirty_one_full_dump() {
        let f = Features {
            mem_dirty_track: false,
            lazy_pages: true,
            uffd_wp: false,
        };
        assert!(pre_dump(f, false, &base(), Path::new("/s")).is_none());
        let a = joined(dump(base(), None).to_args());
        assert!(!a.contains("--track-mem"), "{a}");
        assert!(!a.contains("--prev-images-dir"), "{a}");
        assert!(!a.contains("pre-dump"), "{a}");
    }

    #[test]
    fn with_soft_dirty_pre_dump_then_dirty_pages_only() {
        let f = Features {
            mem_dirty_track: true,
            lazy_pages: true,
            uffd_wp: false,
        };
        assert!(
            pre_dump(f, true, &base(), Path::new("/s")).is_none(),
            "a frozen sandbox is dumped once"
        );
        let pre = pre_dump(f, false, &base(), Path::new("/s")).unwrap();
        assert_eq!(
            joined(pre.to_args()),
            "pre-dump -t 9 -D /s/pre -W /s/criu -v4 -o pre-dump.log --network-lock nftables \
             --external mnt[/data]:k --track-mem"
        );
        let a = joined(dump(base(), Some(&pre)).to_args());
        assert!(a.starts_with("dump -t 9 -D /s/images -W /s/criu"), "{a}");
        assert!(a.contains("--leave-running"), "{a}");
        assert!(
            a.ends_with("--tcp-established --track-mem --prev-images-dir ../pre"),
            "{a}"
        );
    }

    #[test]
    fn parent_link_becomes_the_pre_dump_dir() {
        let d = tempfile::tempdir().unwrap();
        let (images, pre) = (d.path().join(IMAGES), d.path().join(PRE));
        std::fs::create_dir_all(&images).unwrap();
        std::fs::create_dir_all(&pre).unwrap();
        std::fs::write(pre.join("pages-1.img"), b"p").unwrap();
        std::os::unix::fs::symlink("../pre", images.join("parent")).unwrap();
        nest_parent(&images, &pre).unwrap();
        let parent = images.join("parent");
        assert!(std::fs::symlink_metadata(&parent).unwrap().is_dir());
        assert_eq!(std::fs::read(parent.join("pages-1.img")).unwrap(), b"p");
        assert!(!pre.exists());
    }
}
