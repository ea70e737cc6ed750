//! Directory objects of the Merkle manifest and their binary encoding (format v1, see
//! docs/nodefs-format.md). One object per directory: the directory's own metadata and its
//! sorted entries; child directories are referenced by object id, so unchanged subtrees are
//! shared between manifests and load lazily.

use std::collections::BTreeMap;

use crate::id::ObjectId;

const MAGIC: &[u8; 4] = b"GTR1";

/// Inode metadata kept in a manifest. ctime and atime are not stored (they cannot be
/// restored and would make the same tree hash differently on every import).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Meta {
    /// Permission bits incl. setuid/setgid/sticky (no file type bits).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime_sec: i64,
    pub mtime_nsec: u32,
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

/// One chunk of a regular file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkRef {
    pub id: ObjectId,
    pub len: u32,
}

/// What an entry is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Node {
    File { size: u64, chunks: Vec<ChunkRef> },
    Dir(ObjectId),
    Symlink(Vec<u8>),
    Fifo,
    Socket,
    CharDev(u64),
    BlockDev(u64),
}

/// A named entry of a directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub name: Vec<u8>,
    pub meta: Meta,
    /// Hard-link group within the manifest (0 = not hard linked); entries with the same
    /// group are one inode.
    pub link: u64,
    /// Link count of the inode (1 unless hard linked; directories store 1).
    pub nlink: u32,
    pub node: Node,
}

/// A directory object.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Tree {
    pub meta: Meta,
    /// Sorted by name, unique.
    pub entries: Vec<Entry>,
}

/// Decoding failure, with what was wrong.
#[derive(Debug, thiserror::Error)]
#[error("bad tree object: {0}")]
pub struct DecodeError(pub &'static str);

/// Writes a tree object's encoding: little-endian integers and length-prefixed bytes.
struct Encoder(Vec<u8>);
impl Encoder {
    fn u8(&mut self, v: u8) {
        self.0.push(v)
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b)
    }
    fn meta(&mut self, m: &Meta) {
        self.u32(m.mode);
        self.u32(m.uid);
        self.u32(m.gid);
        self.u64(m.mtime_sec as u64);
        self.u32(m.mtime_nsec);
        self.u32(m.xattrs.len() as u32);
        for (k, v) in &m.xattrs {
            self.bytes(k);
            self.bytes(v);
        }
    }
}

/// Reads a tree object's encoding, failing on a truncated one.
struct Decoder<'a>(&'a [u8]);
impl<'a> Decoder<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError("truncated"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or_default(),
        ))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().unwrap_or_default(),
        ))
    }
    fn id(&mut self) -> Result<ObjectId, DecodeError> {
        let mut a = [0u8; 32];
        a.copy_from_slice(self.take(32)?);
        Ok(ObjectId(a))
    }
    fn bytes(&mut self) -> Result<Vec<u8>, DecodeError> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn meta(&mut self) -> Result<Meta, DecodeError> {
        let mode = self.u32()?;
        let uid = self.u32()?;
        let gid = self.u32()?;
        let mtime_sec = self.u64()? as i64;
        let mtime_nsec = self.u32()?;
        let n = self.u32()?;
        let mut xattrs = BTreeMap::new();
        for _ in 0..n {
            let k = self.bytes()?;
            let v = self.bytes()?;
            xattrs.insert(k, v);
        }
        Ok(Meta {
            mode,
            uid,
            gid,
            mtime_sec,
            mtime_nsec,
            xattrs,
        })
    }
}

impl Tree {
    /// Canonical encoding: same tree, same bytes, same id.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Encoder(Vec::with_capacity(64 + self.entries.len() * 96));
        w.0.extend_from_slice(MAGIC);
        w.meta(&self.meta);
        w.u32(self.entries.len() as u32);
        for e in &self.entries {
            w.bytes(&e.name);
            w.meta(&e.meta);
            w.u64(e.link);
            w.u32(e.nlink);
            match &e.node {
                Node::File { size, chunks } => {
                    w.u8(1);
                    w.u64(*size);
                    w.u32(chunks.len() as u32);
                    for c in chunks {
                        w.0.extend_from_slice(&c.id.0);
                        w.u32(c.len);
                    }
                }
                Node::Dir(id) => {
                    w.u8(2);
                    w.0.extend_from_slice(&id.0);
                }
                Node::Symlink(t) => {
                    w.u8(3);
                    w.bytes(t);
                }
                Node::Fifo => w.u8(4),
                Node::Socket => w.u8(5),
                Node::CharDev(r) => {
                    w.u8(6);
                    w.u64(*r);
                }
                Node::BlockDev(r) => {
                    w.u8(7);
                    w.u64(*r);
                }
            }
        }
        w.0
    }

    /// Decode a tree object; rejects anything not canonical enough to be trusted.
    pub fn decode(data: &[u8]) -> Result<Tree, DecodeError> {
        let mut r = Decoder(data);
        if r.take(4)? != MAGIC {
            return Err(DecodeError("bad magic"));
        }
        let meta = r.meta()?;
        let n = r.u32()? as usize;
        let mut entries = Vec::with_capacity(n.min(1 << 16));
        for _ in 0..n {
            let name = r.bytes()?;
            if name.is_empty() || name.contains(&b'/') || name == b"." || name == b".." {
                return Err(DecodeError("bad entry name"));
            }
            let meta = r.meta()?;
            let link = r.u64()?;
            let nlink = r.u32()?;
            let node = match r.u8()? {
                1 => {
                    let size = r.u64()?;
                    let c = r.u32()? as usize;
                    let mut chunks = Vec::with_capacity(c.min(1 << 20));
                    let mut total = 0u64;
                    for _ in 0..c {
                        let id = r.id()?;
                        let len = r.u32()?;
                        total += len as u64;
                        chunks.push(ChunkRef { id, len });
                    }
                    if total != size {
                        return Err(DecodeError("chunk lengths do not sum to file size"));
                    }
                    Node::File { size, chunks }
                }
                2 => Node::Dir(r.id()?),
                3 => Node::Symlink(r.bytes()?),
                4 => Node::Fifo,
                5 => Node::Socket,
                6 => Node::CharDev(r.u64()?),
                7 => Node::BlockDev(r.u64()?),
                _ => return Err(DecodeError("unknown entry kind")),
            };
            if let Some(prev) = entries.last() {
                let prev: &Entry = prev;
                if prev.name >= name {
                    return Err(DecodeError("entries not sorted"));
                }
            }
            entries.push(Entry {
                name,
                meta,
                link,
                nlink,
                node,
            });
        }
        if !r.0.is_empty() {
            return Err(DecodeError("trailing bytes"));
        }
        Ok(Tree { meta, entries })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip() {
        let mut meta = Meta {
            mode: 0o755,
            ..Default::default()
        };
        meta.xattrs.insert(b"user.a".to_vec(), b"v".to_vec());
        let t = Tree {
            meta: meta.clone(),
            entries: vec![
                Entry {
                    name: b"a".to_vec(),
                    meta: meta.clone(),
                    link: 0,
                    nlink: 1,
                    node: Node::File {
                        size: 3,
                        chunks: vec![ChunkRef {
                            id: ObjectId::hash(b"abc"),
                            len: 3,
                        }],
                    },
                },
                Entry {
                    name: b"b".to_vec(),
                    meta,
                    link: 0,
                    nlink: 1,
                    node: Node::Symlink(b"a".to_vec()),
                },
            ],
        };
        let enc = t.encode();
        assert_eq!(Tree::decode(&enc).unwrap(), t);
        assert!(Tree::decode(&enc[..enc.len() - 1]).is_err());
    }
}
