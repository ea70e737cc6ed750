//! Which images a sandbox's next dump may be incremental against (userfaultfd write-protect,
//! `crate::dirty`; the design is in docs/incremental-snapshots.md).
//!
//! Per sandbox: its registered processes, and the *base*: hard links to the whole images of its
//! last snapshot, after whose dump every registered page was write-protected while the sandbox
//! was still frozen. So a registered page not written since equals the base's copy, and every
//! other page reads as written (unregistered VMAs, processes born later, a uffd that was
//! closed): a dump's pages are those written since the last snapshot. An incremental dump has
//! the base as its one parent: its images carry a `parent` directory of links to the base, one
//! level deep, until they are made whole (`whole.rs`), and a restore reads exactly as many bytes
//! as from a full dump. The links keep the base's files when its snapshot is deleted or its
//! materialized copy evicted (image files are only ever replaced, never rewritten in place).
//!
//! A full dump's images are whole at once and become the base when its snapshot is recorded;
//! an incremental dump's become it once made whole, which the next dump waits for. Anything
//! that leaves the protection state in doubt forgets the base (a dump whose snapshot was not
//! recorded, images that could not be made whole, a restart, which also closes every uffd):
//! the next dump is then full, and says why. [`REBASE_FRACTION`] still makes a dump full where
//! most of the base was written since.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use grove_runtime::SandboxId;
use parking_lot::Mutex;

use crate::dirty::{self, Registration};

/// Why a dump was full although the kernel can track dirty pages.
pub(crate) const NO_BASE: &str =
    "no tracked base: the sandbox's first snapshot since it (or groved) started";

/// A dump is full again once the pages written since the base exceed this share of the base's
/// pages: an incremental dump would then save little, and a fresh base makes the next ones small.
pub(crate) const REBASE_FRACTION: f64 = 0.75;

#[derive(Default)]
pub(crate) struct Tracking {
    sandboxes: Mutex<HashMap<SandboxId, Tracked>>,
}

#[derive(Default)]
struct Tracked {
    procs: HashMap<i32, Registration>,
    /// The processes armed at the base's dump: only their writes argue for a re-base (a
    /// process born since is dumped whole either way, and most are short-lived).
    armed: Vec<i32>,
    /// Links to the images the protection state matches (see the module doc).
    base: Option<PathBuf>,
    /// Why the next dump is full, if it has no base (for the record and the event).
    why_full: Option<String>,
    /// Armed after a dump whose snapshot is not recorded yet: nothing matches the protection
    /// until [`Tracking::based_on`] names the images.
    armed_unrecorded: bool,
    /// The images of the last snapshot, to become the base once whole (an incremental dump's).
    pending: Option<PendingBase>,
    /// The base dir the last arm let go of, still read by that dump's images until they are
    /// nested; removed with the next base, or with the sandbox.
    retired: Option<PathBuf>,
}

/// A snapshot's images that become the base once `whole` says they are whole.
struct PendingBase {
    snapshot: String,
    images: PathBuf,
    dir: PathBuf,
}

/// What a dump of one sandbox may use.
pub(crate) struct Prepared {
    /// Images to dump against (CRIU's `--prev-images-dir`), if any.
    pub base: Option<PathBuf>,
    /// Why there is none.
    pub why_full: Option<String>,
}

impl Tracking {
    /// Registers the sandbox's processes not yet registered (only while it runs: injection
    /// needs a ptrace stop) and says what the coming dump may use. A process that cannot be
    /// registered stays unregistered: its pages all read as written. A base still being made
    /// whole is waited for with `whole` (the snapshot's id: its outcome).
    pub(crate) fn prepare(
        &self,
        sandbox: &SandboxId,
        init_pid: i32,
        running: bool,
        whole: &dyn Fn(&str) -> Result<(), String>,
    ) -> Prepared {
        let (known, pending) = {
            let mut all = self.sandboxes.lock();
            let t = all.entry(sandbox.clone()).or_default();
            t.procs.retain(|_, r| r.is_alive());
            if std::mem::take(&mut t.armed_unrecorded) {
                forget_base(t, "the last dump's snapshot was not recorded");
            }
            let pending = t.pending.as_ref().map(|p| p.snapshot.clone());
            (t.procs.keys().copied().collect::<Vec<i32>>(), pending)
        };
        // Outside the lock: the images are usually whole (and the base linked, `whole_now`)
        // long before the next dump.
        let unmade = pending.and_then(|id| whole(&id).err());
        // Injection takes a ptrace stop of each new process (up to `dirty`'s timeout for one
        // that cannot stop): outside the lock, so other sandboxes' snapshots do not wait.
        let mut new = Vec::new();
        if running {
            // The sandbox's init reaps orphans, so every process of the sandbox descends from it.
            for pid in grove_sys::proc::tree(init_pid) {
                if known.contains(&pid) {
                    continue;
                }
                match dirty::register(pid) {
                    Ok(r) => {
                        tracing::debug!(
                            %sandbox, pid, registered_bytes = r.registered_bytes(),
                            skipped_vmas = r.skipped_vmas(), "tracking a process's writes"
                        );
                        new.push((pid, r));
                    }
                    Err(e) => {
                        tracing::debug!(%sandbox, pid, error = %e, "not tracked: its pages count as written");
                    }
                }
            }
        }
        let mut all = self.sandboxes.lock();
        let Some(t) = all.get_mut(sandbox) else {
            // Forgotten meanwhile (destroyed): the new registrations just close.
            return Prepared {
                base: None,
                why_full: Some("the sandbox is going away".into()),
            };
        };
        match unmade {
            Some(e) => forget_base(
                t,
                &format!("the last snapshot's images were not made whole: {e}"),
            ),
            // Whole, but not linked yet (they were whole before the base was named).
            None => link_pending(sandbox, t),
        }
        t.procs.extend(new);
        if let Some(b) = t.base.clone() {
            if !b.is_dir() {
                forget_base(t, "the base images are gone");
            } else if let Some(why) = rebase(&t.procs, &t.armed, &b) {
                forget_base(t, &why);
            }
        }
        Prepared {
            why_full: match &t.base {
                Some(_) => None,
                None => Some(t.why_full.clone().unwrap_or_else(|| NO_BASE.into())),
            },
            base: t.base.clone(),
        }
    }

    /// Right after a dump, the sandbox still frozen: write-protects every registered page and
    /// lets go of the old base (the protection now matches this dump, not it; its dir stays
    /// until this dump's images have nested it, see `retired`). Returns the pages written since
    /// the previous arm (for the log). A process whose arm fails is unregistered: its pages
    /// then read as written.
    pub(crate) fn arm(&self, sandbox: &SandboxId) -> u64 {
        let mut all = self.sandboxes.lock();
        let Some(t) = all.get_mut(sandbox) else {
            return 0;
        };
        if let Some(old) = t.base.take() {
            if let Some(older) = t.retired.replace(old) {
                let _ = std::fs::remove_dir_all(older);
            }
        }
        t.why_full = Some(NO_BASE.to_string());
        t.armed_unrecorded = true;
        let mut written = 0;
        t.procs.retain(|pid, r| match r.arm() {
            Ok(n) => {
                written += n;
                true
            }
            Err(e) => {
                tracing::debug!(%sandbox, pid, error = %e, "arm failed: unregistered");
                false
            }
        });
        t.armed = t.procs.keys().copied().collect();
        written
    }

    /// The dump the last [`Tracking::arm`] followed is recorded as `snapshot` with its images
    /// in `images`: they become the base, by hard links in `dir` (under the scratch work root,
    /// which a restart empties); at once where they are whole (a full dump's), else by the next
    /// [`Tracking::prepare`], once they are.
    pub(crate) fn based_on(
        &self,
        sandbox: &SandboxId,
        snapshot: &str,
        images: &Path,
        whole: bool,
        dir: PathBuf,
    ) {
        let mut all = self.sandboxes.lock();
        let Some(t) = all.get_mut(sandbox) else {
            return;
        };
        if !std::mem::take(&mut t.armed_unrecorded) {
            return;
        }
        forget_base(t, "the last snapshot's images could not be kept");
        t.pending = Some(PendingBase {
            snapshot: snapshot.to_string(),
            images: images.to_path_buf(),
            dir,
        });
        if whole {
            link_pending(sandbox, t);
        }
    }

    /// The images of `snapshot` are whole now: if they are to be the base of `sandbox`, they
    /// become it.
    pub(crate) fn whole_now(&self, sandbox: &SandboxId, snapshot: &str) {
        let mut all = self.sandboxes.lock();
        if let Some(t) = all.get_mut(sandbox) {
            if t.pending.as_ref().is_some_and(|p| p.snapshot == snapshot) {
                link_pending(sandbox, t);
            }
        }
    }

    /// The protection state of `sandbox` is in doubt: its next dump is full, for `why`.
    pub(crate) fn doubt(&self, sandbox: &SandboxId, why: &str) {
        if let Some(t) = self.sandboxes.lock().get_mut(sandbox) {
            forget_base(t, why);
        }
    }

    /// An orderly stop: every uffd closes and every base goes.
    pub(crate) fn forget_all(&self) {
        let ids: Vec<SandboxId> = self.sandboxes.lock().keys().cloned().collect();
        for id in ids {
            self.forget(&id);
        }
    }

    /// The sandbox is gone or parked: its uffds close, its base goes.
    pub(crate) fn forget(&self, sandbox: &SandboxId) {
        if let Some(mut t) = self.sandboxes.lock().remove(sandbox) {
            forget_base(&mut t, "");
        }
    }
}

/// After an incremental dump, at once: replaces the `parent` symlink CRIU made in `images` with
/// a directory of hard links to the base's files, so the images are one tree that needs nothing
/// else (the base may move on; a restart empties the dir the base is in).
pub(crate) fn nest_base(images: &Path, base: &Path) -> std::io::Result<()> {
    let link = images.join(PARENT);
    if std::fs::symlink_metadata(&link).is_ok_and(|m| m.file_type().is_symlink()) {
        std::fs::remove_file(&link)?;
    }
    link_tree(base, &link)
}

/// Where incremental images keep their parent until [`make_whole`].
pub(crate) const PARENT: &str = "parent";

/// Whether `images` still holds a nested parent (an incremental dump not yet made whole).
pub(crate) fn has_parent(images: &Path) -> bool {
    std::fs::symlink_metadata(images.join(PARENT)).is_ok()
}

/// Copies the nested parent's pages into the images (`crate::pagemap::flatten`) and removes
/// the parent: CRIU 4.1 cannot restore parent images lazily. Returns the pages copied. Safe to
/// run again after a crash part-way (each file is replaced whole; a pagemap already whole has
/// nothing to copy).
pub(crate) fn make_whole(images: &Path) -> std::io::Result<u64> {
    let parent = images.join(PARENT);
    let flat = crate::pagemap::flatten(images, &parent)?;
    std::fs::remove_dir_all(&parent)?;
    Ok(flat.parent_pages)
}

/// Why the pages written since the base call for a full dump, if they do: those of the
/// processes armed at the base, against the base's pages.
fn rebase(procs: &HashMap<i32, Registration>, armed: &[i32], base: &Path) -> Option<String> {
    let base_pages = pages_bytes(base) / 4096;
    let written: u64 = armed
        .iter()
        .filter_map(|pid| procs.get(pid))
        .filter_map(|r| r.written().ok())
        .sum();
    (base_pages > 0 && written as f64 > REBASE_FRACTION * base_pages as f64).then(|| {
        format!(
            "re-based: {written} pages written since the base of {base_pages} (more than {:.0} %)",
            REBASE_FRACTION * 100.0
        )
    })
}

/// Bytes of the page images (`pages-*.img`) directly in `dir`.
fn pages_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("pages-"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

fn forget_base(t: &mut Tracked, why: &str) {
    for dir in [t.base.take(), t.retired.take()].into_iter().flatten() {
        let _ = std::fs::remove_dir_all(dir);
    }
    t.pending = None;
    t.why_full = Some(why.to_string());
}

/// The pending base, whole now, linked as the base (or forgotten, with why).
fn link_pending(sandbox: &SandboxId, t: &mut Tracked) {
    let Some(p) = t.pending.take() else {
        return;
    };
    match link_base(&p.images, &p.dir) {
        Ok(()) => {
            t.base = Some(p.dir);
            t.why_full = None;
        }
        Err(e) => {
            tracing::warn!(%sandbox, error = %e, "no base for incremental dumps");
            forget_base(
                t,
                &format!("the last snapshot's images could not be kept as the base: {e}"),
            );
        }
    }
}

/// `images` linked into `dir` (replacing what was there), whole or not at all.
fn link_base(images: &Path, dir: &Path) -> std::io::Result<()> {
    let tmp = dir.with_extension("tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    let _ = std::fs::remove_dir_all(dir);
    link_tree(images, &tmp)
        .and_then(|()| std::fs::rename(&tmp, dir))
        .inspect_err(|_| {
            let _ = std::fs::remove_dir_all(&tmp);
        })
}

/// Hard links of every file under `from` in `to` (image dirs: files and at most a nested dir;
/// symlinks are copied as links).
fn link_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let (src, dst) = (e.path(), to.join(e.file_name()));
        let t = e.file_type()?;
        if t.is_dir() {
            link_tree(&src, &dst)?;
        } else if t.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&src)?, &dst)?;
        } else {
            std::fs::hard_link(&src, &dst)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(_: &str) -> Result<(), String> {
        Ok(())
    }

    #[test]
    fn a_base_links_the_images_and_survives_their_removal() {
        let d = tempfile::tempdir().unwrap();
        let images = d.path().join("images");
        std::fs::create_dir_all(images.join("sub")).unwrap();
        std::fs::write(images.join("pages-1.img"), vec![1u8; 8192]).unwrap();
        std::fs::write(images.join("sub/x"), b"x").unwrap();
        let t = Tracking::default();
        let id: SandboxId = "sb-0000000000b1".parse().unwrap();
        assert_eq!(
            t.prepare(&id, -1, false, &whole).why_full.as_deref(),
            Some(NO_BASE)
        );
        // A base only follows an arm (after a dump).
        t.based_on(&id, "s1", &images, true, d.path().join("base"));
        assert!(t.prepare(&id, -1, false, &whole).base.is_none());
        t.arm(&id);
        t.based_on(&id, "s1", &images, true, d.path().join("base"));
        std::fs::remove_dir_all(&images).unwrap();
        let p = t.prepare(&id, -1, false, &whole);
        let base = p.base.expect("a base");
        assert_eq!(std::fs::read(base.join("pages-1.img")).unwrap().len(), 8192);
        assert_eq!(std::fs::read(base.join("sub/x")).unwrap(), b"x");

        let dump = d.path().join("dump");
        std::fs::create_dir_all(&dump).unwrap();
        std::os::unix::fs::symlink(&base, dump.join("parent")).unwrap();
        nest_base(&dump, &base).unwrap();
        assert!(std::fs::symlink_metadata(dump.join("parent"))
            .unwrap()
            .is_dir());
        assert!(has_parent(&dump));
        assert_eq!(std::fs::read(dump.join("parent/sub/x")).unwrap(), b"x");
        // No pagemap there: nothing to copy, and the nested parent goes.
        assert_eq!(make_whole(&dump).unwrap(), 0);
        assert!(!has_parent(&dump));
        assert!(
            base.join("pages-1.img").exists(),
            "the base keeps its files"
        );

        t.doubt(&id, "test");
        assert!(!base.exists(), "a doubted base is removed");
        assert_eq!(
            t.prepare(&id, -1, false, &whole).why_full.as_deref(),
            Some("test")
        );
        t.forget(&id);
        assert!(t.sandboxes.lock().is_empty());
    }

    #[test]
    fn a_full_dump_not_recorded_leaves_no_base() {
        let d = tempfile::tempdir().unwrap();
        let images = d.path().join("images");
        std::fs::create_dir_all(&images).unwrap();
        let t = Tracking::default();
        let id: SandboxId = "sb-0000000000b2".parse().unwrap();
        t.prepare(&id, -1, false, &whole);
        t.arm(&id);
        t.based_on(&id, "s1", &images, true, d.path().join("base"));
        assert!(t.prepare(&id, -1, false, &whole).base.is_some());
        // Armed again after a dump whose snapshot then failed: the old base is gone.
        t.arm(&id);
        assert!(
            d.path().join("base").exists(),
            "kept until the dump's images nest it"
        );
        let p = t.prepare(&id, -1, false, &whole);
        assert!(p.base.is_none());
        assert!(!d.path().join("base").exists());
        assert!(p.why_full.unwrap().contains("not recorded"));
    }

    #[test]
    fn an_incremental_snapshot_becomes_the_base_once_whole() {
        let d = tempfile::tempdir().unwrap();
        let (first, second) = (d.path().join("first"), d.path().join("second"));
        for (dir, byte) in [(&first, 1u8), (&second, 2u8)] {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join("pages-1.img"), vec![byte; 4096]).unwrap();
        }
        let base = d.path().join("base");
        let t = Tracking::default();
        let id: SandboxId = "sb-0000000000b3".parse().unwrap();
        t.prepare(&id, -1, false, &whole);
        t.arm(&id);
        t.based_on(&id, "s1", &first, true, base.clone());
        assert!(t.prepare(&id, -1, false, &whole).base.is_some());
        // The incremental dump against it, armed again; its images become the base once whole.
        t.arm(&id);
        t.based_on(&id, "s2", &second, false, base.clone());
        let asked = std::cell::RefCell::new(Vec::new());
        let p = t.prepare(&id, -1, false, &|s: &str| {
            asked.borrow_mut().push(s.to_string());
            Ok(())
        });
        assert_eq!(asked.into_inner(), ["s2"]);
        assert_eq!(p.base.as_deref(), Some(base.as_path()));
        assert_eq!(
            std::fs::read(base.join("pages-1.img")).unwrap(),
            [2u8; 4096]
        );
        // Made whole in the background (whole.rs runs `whole_now`): linked then, and the next
        // dump has nothing to wait for.
        t.arm(&id);
        t.based_on(&id, "s3", &first, false, base.clone());
        t.whole_now(&id, "s2");
        assert!(
            !base.exists(),
            "another snapshot's images are not this base"
        );
        t.whole_now(&id, "s3");
        assert_eq!(
            std::fs::read(base.join("pages-1.img")).unwrap(),
            [1u8; 4096]
        );
        let p = t.prepare(&id, -1, false, &|s: &str| panic!("waited for {s}"));
        assert_eq!(p.base.as_deref(), Some(base.as_path()));
        // Images that could not be made whole: no base, and the next dump says why.
        t.arm(&id);
        t.based_on(&id, "s4", &second, false, base.clone());
        let p = t.prepare(&id, -1, false, &|_: &str| Err("disk full".into()));
        assert!(p.base.is_none());
        assert!(!base.exists());
        assert!(p.why_full.unwrap().contains("disk full"));
    }
}
