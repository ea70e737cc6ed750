//! Whole-file objects for FUSE passthrough: a pristine base file is materialized once per
//! node under `<store>/cache/<content id>` and handed to the kernel as the backing file, so
//! reads bypass the server and the page cache is shared by every mount reading it.

use std::fs::{self, File};
use std::io::Write;

use super::file::Base;
use crate::store::Store;

/// Passthrough is on unless `NODEFS_NO_PASSTHROUGH` is set (for before/after measurements).
pub fn enabled() -> bool {
    std::env::var_os("NODEFS_NO_PASSTHROUGH").is_none()
}

/// Open (materializing if needed) the whole-file object for `base`, read-only.
pub fn materialize(store: &Store, base: &Base) -> std::io::Result<File> {
    let mut h = blake3::Hasher::new();
    for c in &base.chunks {
        h.update(&c.id.0);
        h.update(&c.len.to_le_bytes());
    }
    let name = h.finalize().to_hex().to_string();
    let dir = store.dir().join("cache");
    let path = dir.join(&name);
    if let Ok(f) = File::open(&path) {
        return Ok(f);
    }
    let tmp = dir.join(format!(
        "{name}.tmp{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let mut out = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
    for c in &base.chunks {
        let data = store
            .get_chunk(&c.id)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        out.write_all(&data)?;
    }
    let f = out.into_inner().map_err(|e| e.into_error())?;
    drop(f);
    fs::rename(&tmp, &path)?;
    File::open(&path)
}
