//! Content addresses: blake3 digests shown as 64 lowercase hex digits.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A blake3 digest naming a chunk or a tree object.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId(pub [u8; 32]);

/// A manifest is named by the id of its root tree object.
pub type ManifestId = ObjectId;

impl ObjectId {
    /// The blake3 digest of `data`.
    pub fn hash(data: &[u8]) -> ObjectId {
        ObjectId(*blake3::hash(data).as_bytes())
    }

    /// Lowercase hex form.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ObjectId({})", self.to_hex())
    }
}

/// Error parsing an [`ObjectId`] from text.
#[derive(Debug, thiserror::Error)]
#[error("not a 64-digit lowercase hex object id: {0:?}")]
pub struct ParseIdError(pub String);

impl FromStr for ObjectId {
    type Err = ParseIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 64
            || !s
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(ParseIdError(s.to_string()));
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|_| ParseIdError(s.to_string()))?;
        Ok(ObjectId(out))
    }
}

impl Serialize for ObjectId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for ObjectId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_roundtrip() {
        let id = ObjectId::hash(b"abc");
        let s = id.to_string();
        assert_eq!(s.len(), 64);
        assert_eq!(s.parse::<ObjectId>().unwrap(), id);
        assert!("ABC".parse::<ObjectId>().is_err());
        assert!(s.to_uppercase().parse::<ObjectId>().is_err());
        let j = serde_json::to_string(&id).unwrap();
        assert_eq!(j, format!("\"{s}\""));
        assert_eq!(serde_json::from_str::<ObjectId>(&j).unwrap(), id);
    }
}
