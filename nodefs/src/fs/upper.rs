//! Where a mount keeps its files' upper (written) blocks.
//!
//! A file whose upper blocks all lie below [`SLOT`] keeps them in a slot of the mount's
//! sparse slot file (`<upper_dir>/slots`, slot `n` at byte `n * SLOT`); a file that outgrows
//! its slot moves to a file of its own, `<upper_dir>/<ino>`. A slot costs no inode: ext4
//! without a journal scans past every recently freed inode of a group on each inode
//! allocation (`recently_deleted`), so under create/delete churn one upper file per small
//! file cost milliseconds each (measured on this host kind: 7,313 4 KiB files into one
//! directory 5–10 s; the same writes into slots 0.1 s), and unmounting freed thousands of
//! inodes that slowed the next mount's creates in turn. A freed slot is hole-punched: its
//! blocks go back to the disk and it reads as zeros when it is reused.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

/// Bytes of one slot: files whose upper blocks stay below this live in the slot file.
pub const SLOT: u64 = 1 << 20;

/// Slots per mount at most (1 TiB of sparse slot file; ext4 files end at 16 TiB).
const MAX_SLOTS: u64 = 1 << 20;

/// The upper storage of one mount.
#[derive(Debug)]
pub struct Uppers {
    dir: PathBuf,
    slots: Mutex<Slots>,
}

#[derive(Debug, Default)]
struct Slots {
    file: Option<Arc<File>>,
    next: u64,
    free: Vec<u64>,
    /// The slot file could not be made or punched: every file gets its own (a reused slot
    /// must read as zeros).
    off: bool,
}

impl Uppers {
    pub fn new(dir: &Path) -> Uppers {
        Uppers {
            dir: dir.to_path_buf(),
            slots: Mutex::new(Slots::default()),
        }
    }

    /// Opens (creating) an upper file. The mount makes its upper dir on the first write, not at
    /// mount time: most sandboxes write nothing to their root (issue 4).
    fn open(&self, path: &Path) -> std::io::Result<File> {
        let open = || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
        };
        match open() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(&self.dir)?;
                open()
            }
            r => r,
        }
    }

    fn own_path(&self, ino: u64) -> PathBuf {
        self.dir.join(ino.to_string())
    }

    /// A free slot and the slot file, if slots are usable.
    fn alloc(&self) -> Option<(u64, Arc<File>)> {
        let mut s = self.slots.lock();
        if s.off || self.dir.as_os_str().is_empty() {
            return None;
        }
        if s.file.is_none() {
            let path = self.dir.join("slots");
            match self.open(&path) {
                Ok(f) => s.file = Some(Arc::new(f)),
                Err(e) => {
                    tracing::warn!(error = %e, path = %path.display(), "no slot file; one upper file per file");
                    s.off = true;
                    return None;
                }
            }
        }
        let slot = match s.free.pop() {
            Some(n) => n,
            None if s.next < MAX_SLOTS => {
                s.next += 1;
                s.next - 1
            }
            None => return None,
        };
        Some((slot, s.file.clone()?))
    }

    fn slot_file(&self) -> Option<Arc<File>> {
        self.slots.lock().file.clone()
    }

    /// Give `slot` back, zeroed (its blocks freed). A slot that cannot be punched is not
    /// reused, and no new slots are handed out.
    fn release(&self, slot: u64) {
        let mut s = self.slots.lock();
        let Some(f) = s.file.clone() else { return };
        match punch(&f, slot * SLOT, SLOT) {
            Ok(()) => s.free.push(slot),
            Err(e) => {
                tracing::warn!(error = %e, "punching a slot failed; one upper file per file from now on");
                s.off = true;
            }
        }
    }
}

/// Deallocate [off, off+len) of `f`, keeping its size; the range reads as zeros afterwards.
fn punch(f: &File, off: u64, len: u64) -> std::io::Result<()> {
    use nix::fcntl::FallocateFlags;
    nix::fcntl::fallocate(
        f.as_raw_fd(),
        FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE,
        off as libc::off_t,
        len as libc::off_t,
    )
    .map_err(Into::into)
}

/// Where one file's upper blocks are. Invariant: a slot holds zeros past the file's size.
#[derive(Debug, Default)]
pub struct Upper {
    slot: Option<u64>,
    /// `<upper_dir>/<ino>` exists.
    own: bool,
    /// Open handle of the own file; dropped when the inode's last open closes.
    handle: Option<Arc<File>>,
}

impl Upper {
    fn own_file(&mut self, u: &Uppers, ino: u64) -> std::io::Result<Arc<File>> {
        if let Some(f) = &self.handle {
            return Ok(f.clone());
        }
        let f = Arc::new(u.open(&u.own_path(ino))?);
        self.own = true;
        self.handle = Some(f.clone());
        Ok(f)
    }

    /// The file and the offset of byte 0 for writing upper bytes below `end`. A file with
    /// nothing upper yet gets a slot if it fits; one that outgrows its slot moves its
    /// `size` bytes to an own file.
    pub fn for_write(
        &mut self,
        u: &Uppers,
        ino: u64,
        end: u64,
        size: u64,
    ) -> std::io::Result<(Arc<File>, u64)> {
        if let Some(slot) = self.slot {
            let sf = u
                .slot_file()
                .ok_or_else(|| std::io::Error::other("slot file gone"))?;
            if end <= SLOT {
                return Ok((sf, slot * SLOT));
            }
            let own = self.own_file(u, ino)?;
            let mut buf = vec![0u8; size.min(SLOT) as usize];
            read_full_at(&sf, &mut buf, slot * SLOT)?;
            own.write_all_at(&buf, 0)?;
            self.slot = None;
            u.release(slot);
            return Ok((own, 0));
        }
        if !self.own && end <= SLOT && size <= SLOT {
            if let Some((slot, sf)) = u.alloc() {
                self.slot = Some(slot);
                return Ok((sf, slot * SLOT));
            }
        }
        Ok((self.own_file(u, ino)?, 0))
    }

    /// Read upper bytes at `off` into `buf`; zeros where nothing was written.
    pub fn read(&mut self, u: &Uppers, ino: u64, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        if let Some(slot) = self.slot {
            let sf = u
                .slot_file()
                .ok_or_else(|| std::io::Error::other("slot file gone"))?;
            return read_full_at(&sf, buf, slot * SLOT + off);
        }
        if self.own {
            let f = self.own_file(u, ino)?;
            return read_full_at(&f, buf, off);
        }
        buf.fill(0);
        Ok(())
    }

    /// The file shrinks or grows from `old` to `new` bytes: upper bytes past `new` go.
    pub fn truncate(&mut self, u: &Uppers, ino: u64, old: u64, new: u64) -> std::io::Result<()> {
        if let Some(slot) = self.slot {
            if new < old && new < SLOT {
                if let Some(sf) = u.slot_file() {
                    punch(&sf, slot * SLOT + new, old.min(SLOT) - new)?;
                }
            }
        } else if self.own {
            self.own_file(u, ino)?.set_len(new)?;
        }
        Ok(())
    }

    /// The file to sync for an fsync of this file (the whole slot file for a slotted one).
    pub fn sync_handle(&mut self, u: &Uppers, ino: u64) -> std::io::Result<Option<Arc<File>>> {
        if self.slot.is_some() {
            Ok(u.slot_file())
        } else if self.own {
            self.own_file(u, ino).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Drop the open handle (the inode has no open files left).
    pub fn close(&mut self) {
        self.handle = None;
    }

    /// The file is gone: free its slot or remove its own file.
    pub fn free(&mut self, u: &Uppers, ino: u64) {
        if let Some(slot) = self.slot.take() {
            u.release(slot);
        }
        if std::mem::take(&mut self.own) {
            self.handle = None;
            let _ = std::fs::remove_file(u.own_path(ino));
        }
    }
}

/// Read exactly `buf.len()` bytes at `off`; past the end of the file reads zeros.
pub fn read_full_at(f: &File, buf: &mut [u8], off: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let n = f.read_at(&mut buf[done..], off + done as u64)?;
        if n == 0 {
            buf[done..].fill(0);
            break;
        }
        done += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_reused_zeroed_and_outgrown_files_move() {
        let tmp = tempfile::tempdir().unwrap();
        let u = Uppers::new(tmp.path());
        let mut a = Upper::default();
        let (f, base) = a.for_write(&u, 1, 8192, 0).unwrap();
        f.write_all_at(&[7u8; 8192], base).unwrap();
        let mut b = Upper::default();
        let (_, base_b) = b.for_write(&u, 2, 10, 0).unwrap();
        assert_ne!(base, base_b);
        assert!(
            !tmp.path().join("1").exists(),
            "a small file needs no inode"
        );
        // Shrinking zeroes what was cut off.
        a.truncate(&u, 1, 8192, 100).unwrap();
        let mut got = vec![1u8; 8192];
        a.read(&u, 1, &mut got, 0).unwrap();
        assert!(got[..100].iter().all(|&x| x == 7) && got[100..].iter().all(|&x| x == 0));
        // A freed slot comes back as zeros.
        a.free(&u, 1);
        let mut c = Upper::default();
        let (_, base_c) = c.for_write(&u, 3, 10, 0).unwrap();
        assert_eq!(base_c, base);
        c.read(&u, 3, &mut got, 0).unwrap();
        assert!(got.iter().all(|&x| x == 0));
        // Growing past the slot moves the content to an own file.
        let (f, base) = b.for_write(&u, 2, 10, 10).unwrap();
        f.write_all_at(b"0123456789", base).unwrap();
        let (f, base) = b.for_write(&u, 2, SLOT + 1, 10).unwrap();
        assert_eq!(base, 0);
        f.write_all_at(b"x", SLOT).unwrap();
        assert!(tmp.path().join("2").exists());
        let mut ten = [0u8; 10];
        b.read(&u, 2, &mut ten, 0).unwrap();
        assert_eq!(&ten, b"0123456789");
        b.free(&u, 2);
        assert!(!tmp.path().join("2").exists());
        // Nothing written reads as zeros without creating anything.
        let mut d = Upper::default();
        d.read(&u, 4, &mut ten, 0).unwrap();
        assert_eq!(ten, [0u8; 10]);
        assert!(!tmp.path().join("4").exists());
    }
}
