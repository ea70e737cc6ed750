//! Restoring a user-namespace sandbox into a host id range of its own. CRIU records the dumped
//! namespace's `uid_map`/`gid_map` in `userns-<id>.img` and writes them back at restore, so every
//! branch would share the source's host ids (and one branch's root could signal, ptrace or read
//! another's files). Everything else in the images is kept in the namespace's own ids (creds,
//! file owners, tmpfs contents and mount options: CRIU translates them at dump), so a branch gets
//! its own range by rewriting that one image: each branch restores from a directory of links to
//! the snapshot's images beside its own copy of the map.
//!
//! The image is `IMG_COMMON_MAGIC`, `USERNS_MAGIC`, then one length-prefixed protobuf
//! `userns_entry { repeated uid_gid_extent uid_map = 1; repeated uid_gid_extent gid_map = 2; }`
//! with `uid_gid_extent { uint32 first = 1; uint32 lower_first = 2; uint32 count = 3; }`
//! (CRIU's images/userns.proto), all in the host's byte order.

use std::io;
use std::path::{Path, PathBuf};

use grove_runtime::userns::IdRange;

const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const USERNS_MAGIC: u32 = 0x5547_4906;

/// One line of a uid or gid map: ids `first..first+count` inside are `lower_first..` outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Extent {
    pub first: u32,
    pub lower_first: u32,
    pub count: u32,
}

/// The maps of one dumped user namespace.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct UsernsEntry {
    pub uid_map: Vec<Extent>,
    pub gid_map: Vec<Extent>,
}

/// Why a userns image cannot be moved to another range.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MapError {
    #[error("not a CRIU userns image: {0}")]
    Format(&'static str),
    #[error("{which} map {map:?} is not one extent from id 0 of {size} ids, as Grove sets it")]
    Unexpected {
        which: &'static str,
        map: Vec<Extent>,
        size: u32,
    },
}

impl From<MapError> for io::Error {
    fn from(e: MapError) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

impl UsernsEntry {
    pub(crate) fn parse(img: &[u8]) -> Result<UsernsEntry, MapError> {
        let word = |at: usize| -> Result<u32, MapError> {
            let b = img
                .get(at..at + 4)
                .ok_or(MapError::Format("truncated header"))?;
            Ok(u32::from_ne_bytes(b.try_into().expect("4 bytes")))
        };
        if word(0)? != IMG_COMMON_MAGIC || word(4)? != USERNS_MAGIC {
            return Err(MapError::Format("wrong magic"));
        }
        let len = word(8)? as usize;
        let body = img
            .get(12..12 + len)
            .ok_or(MapError::Format("truncated entry"))?;
        if img.len() != 12 + len {
            return Err(MapError::Format("more than one entry"));
        }
        let mut entry = UsernsEntry::default();
        let mut r = Reader(body);
        while let Some((field, value)) = r.field()? {
            let Value::Bytes(b) = value else {
                return Err(MapError::Format("a map that is not a message"));
            };
            let extent = Extent::parse(b)?;
            match field {
                1 => entry.uid_map.push(extent),
                2 => entry.gid_map.push(extent),
                _ => return Err(MapError::Format("unknown field")),
            }
        }
        Ok(entry)
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        for (field, map) in [(1, &self.uid_map), (2, &self.gid_map)] {
            for e in map {
                let msg = e.encode();
                put_varint(&mut body, (field << 3) | 2);
                put_varint(&mut body, msg.len() as u64);
                body.extend_from_slice(&msg);
            }
        }
        let mut img = Vec::with_capacity(12 + body.len());
        img.extend_from_slice(&IMG_COMMON_MAGIC.to_ne_bytes());
        img.extend_from_slice(&USERNS_MAGIC.to_ne_bytes());
        img.extend_from_slice(&(body.len() as u32).to_ne_bytes());
        img.extend_from_slice(&body);
        img
    }

    /// Both maps moved onto `ids`; they must be the single full-range extent Grove writes.
    pub(crate) fn moved_to(&self, ids: IdRange) -> Result<UsernsEntry, MapError> {
        let mv = |which: &'static str, map: &[Extent]| match map {
            [e] if e.first == 0 && e.count == ids.size => Ok(vec![Extent {
                lower_first: ids.base,
                ..*e
            }]),
            _ => Err(MapError::Unexpected {
                which,
                map: map.to_vec(),
                size: ids.size,
            }),
        };
        Ok(UsernsEntry {
            uid_map: mv("uid", &self.uid_map)?,
            gid_map: mv("gid", &self.gid_map)?,
        })
    }
}

impl Extent {
    fn parse(b: &[u8]) -> Result<Extent, MapError> {
        let mut e = [None; 3];
        let mut r = Reader(b);
        while let Some((field, value)) = r.field()? {
            let (Value::Varint(v), 1..=3) = (value, field) else {
                return Err(MapError::Format("unexpected extent field"));
            };
            let v = u32::try_from(v).map_err(|_| MapError::Format("id over 32 bits"))?;
            e[field as usize - 1] = Some(v);
        }
        match e {
            [Some(first), Some(lower_first), Some(count)] => Ok(Extent {
                first,
                lower_first,
                count,
            }),
            _ => Err(MapError::Format("an extent misses a required field")),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(16);
        for (field, v) in [(1u64, self.first), (2, self.lower_first), (3, self.count)] {
            put_varint(&mut b, field << 3);
            put_varint(&mut b, u64::from(v));
        }
        b
    }
}

enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
}

/// The protobuf wire format, as far as these two messages use it.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Result<u64, MapError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = self
                .0
                .split_first()
                .ok_or(MapError::Format("truncated varint"))?;
            self.0 = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(MapError::Format("varint over 64 bits"))
    }

    fn field(&mut self) -> Result<Option<(u64, Value<'a>)>, MapError> {
        if self.0.is_empty() {
            return Ok(None);
        }
        let key = self.varint()?;
        let value = match key & 7 {
            0 => Value::Varint(self.varint()?),
            2 => {
                let len = self.varint()? as usize;
                if len > self.0.len() {
                    return Err(MapError::Format("truncated field"));
                }
                let (b, rest) = self.0.split_at(len);
                self.0 = rest;
                Value::Bytes(b)
            }
            _ => return Err(MapError::Format("unexpected wire type")),
        };
        Ok(Some((key >> 3, value)))
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn is_userns_image(name: &str) -> bool {
    name.starts_with("userns-") && name.ends_with(".img")
}

/// Builds `dir`: the images of `images` (hard links, or symlinks across filesystems) with every
/// `userns-*.img` rewritten onto `ids`. Fails if the images hold no user namespace.
pub(crate) fn remap(images: &Path, dir: &Path, ids: IdRange) -> io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let mut found = false;
    for entry in std::fs::read_dir(images)? {
        let entry = entry?;
        let name = entry.file_name();
        let (src, dst) = (entry.path(), dir.join(&name));
        if is_userns_image(&name.to_string_lossy()) {
            let moved = UsernsEntry::parse(&std::fs::read(&src)?)?.moved_to(ids)?;
            std::fs::write(&dst, moved.encode())?;
            found = true;
            continue;
        }
        let linked = match entry.file_type()?.is_file() {
            true => std::fs::hard_link(&src, &dst),
            false => Err(io::Error::from(io::ErrorKind::Unsupported)),
        };
        if linked.is_err() {
            let target = match std::fs::read_link(&src) {
                // A relative link (CRIU's `parent`) keeps pointing where it did.
                Ok(t) if t.is_relative() => images.join(t),
                _ => src.clone(),
            };
            std::os::unix::fs::symlink(target, &dst)?;
        }
    }
    if !found {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: no user namespace image to remap", images.display()),
        ));
    }
    Ok(dir.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(base: u32) -> Vec<Extent> {
        vec![Extent {
            first: 0,
            lower_first: base,
            count: 65536,
        }]
    }

    #[test]
    fn an_image_round_trips_and_moves_to_another_range() {
        let e = UsernsEntry {
            uid_map: full(1 << 28),
            gid_map: full(1 << 28),
        };
        let img = e.encode();
        assert_eq!(&img[..4], &IMG_COMMON_MAGIC.to_ne_bytes());
        assert_eq!(UsernsEntry::parse(&img).unwrap(), e);
        let ids = IdRange {
            base: (1 << 28) + 65536,
            size: 65536,
        };
        let moved = e.moved_to(ids).unwrap();
        assert_eq!(moved.uid_map, full(ids.base));
        assert_eq!(moved.gid_map, full(ids.base));
        assert_eq!(UsernsEntry::parse(&moved.encode()).unwrap(), moved);
    }

    #[test]
    fn maps_grove_did_not_write_are_refused() {
        let ids = IdRange {
            base: 1 << 20,
            size: 65536,
        };
        let partial = UsernsEntry {
            uid_map: vec![Extent {
                first: 0,
                lower_first: 5,
                count: 10,
            }],
            gid_map: full(5),
        };
        assert!(matches!(
            partial.moved_to(ids),
            Err(MapError::Unexpected { which: "uid", .. })
        ));
        let two = UsernsEntry {
            uid_map: full(5),
            gid_map: [full(5), full(70000)].concat(),
        };
        assert!(two.moved_to(ids).is_err());
        let mut img = UsernsEntry {
            uid_map: full(5),
            gid_map: full(5),
        }
        .encode();
        assert!(UsernsEntry::parse(&img[..img.len() - 1]).is_err());
        img[4] ^= 1;
        assert!(matches!(
            UsernsEntry::parse(&img),
            Err(MapError::Format("wrong magic"))
        ));
    }

    #[test]
    fn remap_links_the_rest_and_rewrites_the_map() {
        let t = tempfile::tempdir().unwrap();
        let (images, out) = (t.path().join("images"), t.path().join("branch"));
        std::fs::create_dir(&images).unwrap();
        std::fs::write(images.join("pages-1.img"), b"pages").unwrap();
        let src = UsernsEntry {
            uid_map: full(1 << 28),
            gid_map: full(1 << 28),
        };
        std::fs::write(images.join("userns-11.img"), src.encode()).unwrap();
        let ids = IdRange {
            base: 3 << 27,
            size: 65536,
        };
        remap(&images, &out, ids).unwrap();
        assert_eq!(std::fs::read(out.join("pages-1.img")).unwrap(), b"pages");
        let got = UsernsEntry::parse(&std::fs::read(out.join("userns-11.img")).unwrap()).unwrap();
        assert_eq!(got.uid_map, full(ids.base));
        // The snapshot's own image is untouched.
        let kept = UsernsEntry::parse(&std::fs::read(images.join("userns-11.img")).unwrap());
        assert_eq!(kept.unwrap(), src);

        std::fs::remove_file(images.join("userns-11.img")).unwrap();
        let e = remap(&images, &t.path().join("b2"), ids).unwrap_err();
        assert!(e.to_string().contains("no user namespace"), "{e}");
    }
}
