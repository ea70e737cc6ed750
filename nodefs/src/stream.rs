//! Moving a manifest between stores: a stream of the objects the receiver lacks.
//!
//! Format: `GRVSTRM1`, root id (32 bytes), then records `kind u8 | id [32] | raw_len u32 |
//! zlen u32 | zstd bytes`, ended by a record of kind 0. Every object is verified against its
//! id on receipt.

use std::io::{Read, Write};

use crate::error::{Error, StoreError};
use crate::id::{ManifestId, ObjectId};
use crate::pack::Kind;
use crate::store::Store;
use crate::tree::Tree;

const MAGIC: &[u8; 8] = b"GRVSTRM1";

/// Counters of a stream transfer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    pub objects: u64,
    pub bytes: u64,
}

fn werr(e: std::io::Error) -> Error {
    Error::BadStream(format!("write: {e}"))
}

impl Store {
    /// Object ids (trees and chunks) a manifest reaches.
    pub fn objects_of(&self, id: &ManifestId) -> Result<Vec<ObjectId>, Error> {
        let mut v: Vec<_> = self.reachable(id)?.into_iter().collect();
        v.sort();
        Ok(v)
    }

    /// Write manifest `id` as a stream, skipping objects for which `have` is true.
    pub fn export_stream(
        &self,
        id: &ManifestId,
        have: &dyn Fn(&ObjectId) -> bool,
        out: &mut dyn Write,
    ) -> Result<StreamStats, Error> {
        if !self.contains(id) {
            return Err(Error::UnknownManifest(*id));
        }
        let mut st = StreamStats::default();
        out.write_all(MAGIC).map_err(werr)?;
        out.write_all(&id.0).map_err(werr)?;
        for oid in self.objects_of(id)? {
            if have(&oid) {
                continue;
            }
            let loc = self
                .packs()
                .get(&oid)
                .ok_or(StoreError::Missing { id: oid })?;
            let raw = self.get_object(&oid)?;
            let z = crate::store::zstd_ctx::compress(&raw, 3).map_err(werr)?;
            out.write_all(&[loc.kind as u8]).map_err(werr)?;
            out.write_all(&oid.0).map_err(werr)?;
            out.write_all(&(raw.len() as u32).to_le_bytes())
                .map_err(werr)?;
            out.write_all(&(z.len() as u32).to_le_bytes())
                .map_err(werr)?;
            out.write_all(&z).map_err(werr)?;
            st.objects += 1;
            st.bytes += z.len() as u64 + 41;
        }
        out.write_all(&[0u8]).map_err(werr)?;
        Ok(st)
    }

    /// Read a stream written by [`Store::export_stream`]; returns its manifest once every
    /// object it reaches is present and verified.
    pub fn import_stream(&self, input: &mut dyn Read) -> Result<ManifestId, Error> {
        let _g = self.write_guard();
        let rerr = |e: std::io::Error| Error::BadStream(format!("read: {e}"));
        let mut magic = [0u8; 8];
        input.read_exact(&mut magic).map_err(rerr)?;
        if &magic != MAGIC {
            return Err(Error::BadStream("bad magic".into()));
        }
        let mut root = [0u8; 32];
        input.read_exact(&mut root).map_err(rerr)?;
        let root = ObjectId(root);
        loop {
            let mut k = [0u8; 1];
            input.read_exact(&mut k).map_err(rerr)?;
            if k[0] == 0 {
                break;
            }
            let mut idb = [0u8; 32];
            input.read_exact(&mut idb).map_err(rerr)?;
            let oid = ObjectId(idb);
            let mut n = [0u8; 4];
            input.read_exact(&mut n).map_err(rerr)?;
            let raw_len = u32::from_le_bytes(n) as usize;
            input.read_exact(&mut n).map_err(rerr)?;
            let zlen = u32::from_le_bytes(n) as usize;
            if raw_len > 64 << 20 || zlen > 64 << 20 {
                return Err(Error::BadStream(format!("object {oid} too large")));
            }
            let mut z = vec![0u8; zlen];
            input.read_exact(&mut z).map_err(rerr)?;
            let raw = crate::store::zstd_ctx::decompress(&z, raw_len)
                .map_err(|e| Error::BadStream(format!("object {oid}: {e}")))?;
            if ObjectId::hash(&raw) != oid {
                return Err(Error::BadStream(format!(
                    "object {oid} does not match its hash"
                )));
            }
            match k[0] {
                x if x == Kind::Chunk as u8 => {
                    self.put_chunk(&raw, None)?;
                }
                x if x == Kind::Tree as u8 => {
                    let t = Tree::decode(&raw)
                        .map_err(|e| Error::BadStream(format!("tree {oid}: {e}")))?;
                    self.put_tree(&t)?;
                }
                other => return Err(Error::BadStream(format!("unknown record kind {other}"))),
            }
        }
        // Everything the manifest reaches must now be here.
        for oid in self.objects_of(&root)? {
            if !self.has_object(&oid) {
                return Err(Error::Store(StoreError::Missing { id: oid }));
            }
        }
        self.seal_import(&root)?;
        Ok(root)
    }
}
