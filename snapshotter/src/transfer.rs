//! Moving snapshots between nodes: one stream = header, record, then the nodefs streams of the
//! fs manifest and of the images manifest, each holding only objects the receiver lacks.
//!
//! Format: `GRVSNAP1`, record length (u32 LE), record JSON, fs stream, images stream.

use std::collections::HashSet;
use std::io::{Read, Write};

use nodefs::ObjectId;

use crate::error::Error;
use crate::record::{self, SnapshotInfo};
use crate::snapshotter::{Pin, Snapshotter};

const MAGIC: &[u8; 8] = b"GRVSNAP1";
const MAX_RECORD: u32 = 1 << 20;
/// How long an export waits for a just-taken snapshot to be stored.
const EXPORT_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

/// Counts bytes written through it.
struct Counting<'a> {
    inner: &'a mut dyn Write,
    n: u64,
}
impl Write for Counting<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn werr(e: std::io::Error) -> Error {
    Error::BadStream {
        reason: format!("write: {e}"),
    }
}

impl Snapshotter {
    /// Writes a self-contained stream of the snapshot; returns the bytes written.
    pub fn export(&self, snapshot: &str, out: &mut dyn Write) -> Result<u64, Error> {
        self.export_delta(snapshot, None, out)
    }

    /// Like `export`, with `only` the objects the receiver lacks (the rest left out).
    pub fn export_delta(
        &self,
        snapshot: &str,
        only: Option<&HashSet<ObjectId>>,
        out: &mut dyn Write,
    ) -> Result<u64, Error> {
        let info = self.durable(snapshot)?;
        let fs: ObjectId = parse(&info.fs_root)?;
        let imgs: ObjectId = parse(&info.images_root)?;
        let body = serde_json::to_vec(&info).map_err(|e| Error::BadStream {
            reason: e.to_string(),
        })?;
        let mut w = Counting { inner: out, n: 0 };
        w.write_all(MAGIC).map_err(werr)?;
        w.write_all(&(body.len() as u32).to_le_bytes())
            .map_err(werr)?;
        w.write_all(&body).map_err(werr)?;
        self.store().export_stream(&fs, only, &mut w)?;
        self.store().export_stream(&imgs, only, &mut w)?;
        w.flush().map_err(werr)?;
        Ok(w.n)
    }

    /// Every object (trees and chunks) the snapshot's filesystem and images reach, sorted: what a
    /// receiver checks against its own store before asking for a delta.
    pub fn objects(&self, snapshot: &str) -> Result<Vec<ObjectId>, Error> {
        let info = self.durable(snapshot)?;
        let mut v = self.store().objects_of(&parse(&info.fs_root)?)?;
        v.extend(self.store().objects_of(&parse(&info.images_root)?)?);
        v.sort();
        v.dedup();
        Ok(v)
    }

    /// A snapshot once its images are in the store (a stream carries stored objects only).
    fn durable(&self, snapshot: &str) -> Result<SnapshotInfo, Error> {
        let info = self.get(snapshot)?;
        if info.durable {
            return Ok(info);
        }
        self.wait_durable(&info.id, EXPORT_WAIT)
    }

    /// The ones among `ids` this node's store does not hold.
    pub fn lacking(&self, ids: &[ObjectId]) -> Result<Vec<ObjectId>, Error> {
        Ok(self.store().lacking(ids)?)
    }

    /// Reads a stream written by `export` and records the snapshot; fails cleanly (nothing
    /// recorded) if the stream is damaged or lacks objects this store does not have.
    pub fn import(&self, input: &mut dyn Read) -> Result<SnapshotInfo, Error> {
        let rerr = |e: std::io::Error| Error::BadStream {
            reason: format!("read: {e}"),
        };
        let mut magic = [0u8; 8];
        input.read_exact(&mut magic).map_err(rerr)?;
        if &magic != MAGIC {
            return Err(Error::BadStream {
                reason: "not a Grove snapshot stream (bad magic)".into(),
            });
        }
        let mut n = [0u8; 4];
        input.read_exact(&mut n).map_err(rerr)?;
        let len = u32::from_le_bytes(n);
        if len > MAX_RECORD {
            return Err(Error::BadStream {
                reason: format!("record of {len} bytes is too large"),
            });
        }
        let mut body = vec![0u8; len as usize];
        input.read_exact(&mut body).map_err(rerr)?;
        let info: SnapshotInfo = serde_json::from_slice(&body).map_err(|e| Error::BadStream {
            reason: format!("record: {e}"),
        })?;
        // Records older than the `root` field are named by their root.
        let root = info.root.as_deref().unwrap_or(&info.id);
        if info.paused.is_some()
            || !info.durable
            || record::root_hash(&info.fs_root, &info.images_root, &info.spec) != root
        {
            return Err(Error::BadStream {
                reason: format!("snapshot {} does not match its root hash", info.id),
            });
        }
        if let Some(name) = &info.name {
            record::validate_name(name)?;
        }
        let parts = self
            .store()
            .import_streams(input, 2)
            .map_err(|e| Error::BadStream {
                reason: format!("filesystem and images: {e} (are chunks missing on this node?)"),
            })?;
        let (fs, imgs) = (parts[0], parts[1]);
        let _fs_pin = Pin::new(&**self.store(), fs)?;
        let _imgs_pin = Pin::new(&**self.store(), imgs)?;
        if fs.to_hex() != info.fs_root || imgs.to_hex() != info.images_root {
            return Err(Error::BadStream {
                reason: "stream manifests differ from the record".into(),
            });
        }
        self.record_imported(info, &fs, &imgs)
    }
}

fn parse(hex: &str) -> Result<ObjectId, Error> {
    hex.parse().map_err(|_| Error::BadStream {
        reason: format!("{hex:?} is not a manifest id"),
    })
}
