//! Manifests and their names: the marker that records a manifest, the grace gc gives a
//! manifest an import made until a ref names it, and refs (durable, checksummed names).

use std::fs;
use std::path::PathBuf;

use super::{write_durable, Store};
use crate::error::{io_err, Error, StoreError};
use crate::id::{ManifestId, ObjectId};
use crate::pack::sync_dir;

fn check8(s: &str) -> String {
    hex::encode(&blake3::hash(s.as_bytes()).as_bytes()[..4])
}

fn valid_ref(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && !name.starts_with('/')
        && !name.ends_with('/')
        && !name.contains("..")
        && !name.contains("//")
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:@+=/-".contains(&b))
}

impl Store {
    /// Make appended objects durable and record `id` as a manifest.
    pub(crate) fn seal_manifest(&self, id: &ManifestId) -> Result<(), StoreError> {
        self.packs.sync()?;
        let p = self.dir.join("manifests").join(id.to_hex());
        if !p.exists() {
            write_durable(&p, format!("{id}\n").as_bytes())?;
        }
        Ok(())
    }

    /// [`Store::seal_manifest`] for a manifest an import made: gc keeps it until a ref names
    /// it or the grace runs out. Called with the write guard still held, so no gc comes
    /// between.
    pub(crate) fn seal_import(&self, id: &ManifestId) -> Result<(), StoreError> {
        self.seal_manifest(id)?;
        let now = std::time::Instant::now();
        let grace = *self.fresh_grace.lock();
        let mut fresh = self.fresh.lock();
        fresh.retain(|_, t| now.duration_since(*t) < grace);
        fresh.insert(*id, now);
        Ok(())
    }

    /// How long gc keeps a manifest that an import returned and no ref names yet (default 10
    /// minutes). Naming it (`set_ref`) ends the grace; so does its running out, after which
    /// gc collects it like anything else that nothing holds. A test knob (feature
    /// `test-knobs`): shipped builds keep the default.
    #[cfg(any(test, feature = "test-knobs"))]
    pub fn set_fresh_grace(&self, grace: std::time::Duration) {
        *self.fresh_grace.lock() = grace;
    }

    fn ref_path(&self, name: &str) -> PathBuf {
        self.dir.join("refs").join(name.replace('/', "%"))
    }

    /// Point `name` at `id`, durably.
    pub fn set_ref(&self, name: &str, id: &ManifestId) -> Result<(), Error> {
        if !valid_ref(name) {
            return Err(Error::BadRefName(name.to_string()));
        }
        if !self.contains(id) {
            return Err(Error::UnknownManifest(*id));
        }
        let _g = self.refs_lock.lock();
        let hex = id.to_hex();
        let body = format!("{hex} {}\n", check8(&hex));
        write_durable(&self.ref_path(name), body.as_bytes())?;
        // The ref holds it now.
        self.fresh.lock().remove(id);
        Ok(())
    }

    /// The manifest `name` points at, if any.
    pub fn get_ref(&self, name: &str) -> Result<Option<ManifestId>, Error> {
        if !valid_ref(name) {
            return Err(Error::BadRefName(name.to_string()));
        }
        let p = self.ref_path(name);
        match fs::read_to_string(&p) {
            Ok(s) => parse_ref(&s).map(Some).ok_or_else(|| {
                Error::Store(StoreError::CorruptPack {
                    path: p,
                    offset: 0,
                    why: "ref file damaged".into(),
                })
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(p)(e)),
        }
    }

    /// All refs, sorted by name.
    pub fn refs(&self) -> Result<Vec<(String, ManifestId)>, Error> {
        let d = self.dir.join("refs");
        let mut out = Vec::new();
        for e in fs::read_dir(&d).map_err(io_err(&d))? {
            let e = e.map_err(io_err(&d))?;
            let name = e.file_name().to_string_lossy().replace('%', "/");
            if name.contains(".tmp") {
                continue;
            }
            if let Some(id) = fs::read_to_string(e.path())
                .ok()
                .and_then(|s| parse_ref(&s))
            {
                out.push((name, id));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Remove a ref (no error if absent).
    pub fn delete_ref(&self, name: &str) -> Result<(), Error> {
        if !valid_ref(name) {
            return Err(Error::BadRefName(name.to_string()));
        }
        let _g = self.refs_lock.lock();
        let p = self.ref_path(name);
        match fs::remove_file(&p) {
            Ok(()) => {
                sync_dir(&self.dir.join("refs"))?;
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(p)(e)),
        }
    }

    /// A ref name, or the hex id of a stored manifest.
    pub fn resolve(&self, name_or_hex: &str) -> Result<ManifestId, Error> {
        if let Ok(id) = name_or_hex.parse::<ObjectId>() {
            if self.contains(&id) {
                return Ok(id);
            }
        }
        if valid_ref(name_or_hex) {
            if let Some(id) = self.get_ref(name_or_hex)? {
                return Ok(id);
            }
        }
        Err(Error::UnknownRef(name_or_hex.to_string()))
    }
}

fn parse_ref(s: &str) -> Option<ManifestId> {
    let mut it = s.split_whitespace();
    let hex = it.next()?;
    let sum = it.next()?;
    if check8(hex) != sum {
        return None;
    }
    hex.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refs_validate() {
        assert!(valid_ref("images/debian12"));
        assert!(!valid_ref("../x"));
        assert!(!valid_ref(""));
        assert!(!valid_ref("a b"));
    }
}
