//! Snapshot records: what a snapshot is, named by its root hash, kept durably on disk.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use grove_runtime::{SandboxInfo, SandboxSpec};
use serde::{Deserialize, Serialize};

use crate::error::Error;

/// A committed snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    /// Names this snapshot for its whole life: [`capture_id`] for snapshots taken here (known
    /// the moment the sandbox is thawed), or the [`root_hash`] of older and pause records.
    pub id: String,
    /// The content root: [`root_hash`] over the fs manifest, the images manifest and the spec.
    /// None until the images are in the store (and on records older than this field, whose id
    /// is their root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
    pub name: Option<String>,
    /// The sandbox it was taken from.
    pub source: String,
    pub created_at_ms: u64,
    /// nodefs manifest (hex) of the sandbox root at the freeze point.
    pub fs_root: String,
    /// nodefs manifest (hex) of the CRIU image directory; empty until `durable`.
    pub images_root: String,
    pub spec: SandboxSpec,
    /// How long the sandbox was frozen (freeze → dump → commit → thaw).
    pub dump_ms: u64,
    /// Bytes the snapshot added to the store (compressed, after dedup).
    pub bytes_added: u64,
    /// After the thaw: images into the store, up to the refs and record writes (a few fsyncs).
    /// `dump_ms + store_ms` is about the time until the snapshot is durable and forkable.
    #[serde(default)]
    pub store_ms: u64,
    /// Whether the CRIU images are in the content store. A snapshot is forkable at once from
    /// its images in scratch space; a background import makes it durable (a daemon crash in
    /// between resumes the import at start; a host reboot, which empties a tmpfs scratch, loses
    /// a snapshot that never became durable). `SnapshotOptions::durable` waits for it.
    #[serde(default = "durable_default")]
    pub durable: bool,
    /// Set on the record of a pause to the store: the parked sandbox it brings back. Such
    /// records are internal (not listed, not forkable, not exported) and go away on resume or
    /// when the sandbox is destroyed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<SandboxInfo>,
    /// How its memory was dumped (records from before this field: in full).
    #[serde(default)]
    pub memory_dump: MemoryDump,
    /// Why the memory was dumped in full where the kernel could have tracked dirty pages (the
    /// first snapshot since tracking began, a restart, a failed incremental dump, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_dump_reason: Option<String>,
}

/// How a snapshot's memory was dumped: what its record, the API and the `snapshot_created`
/// event say, so a slow snapshot can be told from a kernel that cannot track dirty pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryDump {
    /// Every page, while frozen: the kernel tracks no dirty pages, or the pre-dump failed, or
    /// its tracking state was lost (a dump that had to be retried). Never an incremental dump
    /// on tracking state nobody can vouch for.
    #[default]
    Full,
    /// A pre-dump while the sandbox ran, then, frozen, only the pages soft-dirty since.
    SoftDirty,
    /// Frozen, only the pages written since the sandbox's last snapshot (userfaultfd
    /// write-protect, `dirty/`); the rest copied from that snapshot's images after the thaw.
    UffdWp,
}

impl MemoryDump {
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryDump::Full => "full",
            MemoryDump::SoftDirty => "soft_dirty",
            MemoryDump::UffdWp => "uffd_wp",
        }
    }
}

fn durable_default() -> bool {
    true
}

/// The id of a snapshot taken on this node: known as soon as the root is committed, before
/// the images are hashed into the store; unique per capture.
pub fn capture_id(fs_root: &str, spec: &SandboxSpec, source: &str, at_ms: u64) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"grove-snapshot-v2\0");
    for part in [fs_root, source, &at_ms.to_string()] {
        h.update(part.as_bytes());
        h.update(b"\0");
    }
    h.update(&serde_json::to_vec(spec).unwrap_or_default());
    h.update(&rand::random::<[u8; 16]>());
    h.finalize().to_hex().to_string()
}

/// The content root hash of a snapshot.
pub fn root_hash(fs_root: &str, images_root: &str, spec: &SandboxSpec) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"grove-snapshot-v1\0");
    h.update(fs_root.as_bytes());
    h.update(b"\0");
    h.update(images_root.as_bytes());
    h.update(b"\0");
    h.update(&serde_json::to_vec(spec).unwrap_or_default());
    h.finalize().to_hex().to_string()
}

/// The id of a pause record: distinct from any snapshot of the same state, one per pause.
pub fn pause_hash(sandbox: &str, fs_root: &str, images_root: &str, at_ms: u64) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"grove-pause-v1\0");
    for part in [sandbox, fs_root, images_root, &at_ms.to_string()] {
        h.update(part.as_bytes());
        h.update(b"\0");
    }
    h.finalize().to_hex().to_string()
}

/// Whether `s` looks like a snapshot id (64 lowercase hex digits).
pub fn is_id(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Names are short, printable and never mistaken for an id.
pub fn validate_name(name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !is_id(name)
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidInput {
            field: "name",
            reason: format!(
                "{name:?}: use 1-128 of [A-Za-z0-9._-], not starting with '.', not a 64-hex id"
            ),
        })
    }
}

/// The directory of records: `<state>/snapshots/<id>.json`.
#[derive(Debug)]
pub struct RecordDir {
    dir: PathBuf,
}

impl RecordDir {
    pub fn open(dir: PathBuf) -> Result<RecordDir, Error> {
        fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        Ok(RecordDir { dir })
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Every readable record; leftover temp files from a crash are removed.
    pub fn load_all(&self) -> Result<Vec<SnapshotInfo>, Error> {
        let mut out = Vec::new();
        for e in fs::read_dir(&self.dir)
            .map_err(|e| Error::io(&self.dir, e))?
            .flatten()
        {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".tmp") {
                let _ = fs::remove_file(&p);
                continue;
            }
            let Some(id) = name.strip_suffix(".json") else {
                continue;
            };
            match read(&p) {
                Ok(info) if info.id == id => out.push(info),
                Ok(_) => {
                    tracing::warn!(path = %p.display(), "snapshot record id does not match its file name")
                }
                Err(e) => {
                    tracing::warn!(path = %p.display(), error = %e, "unreadable snapshot record skipped")
                }
            }
        }
        out.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(out)
    }

    /// Writes a record durably: temp file, fsync, rename, fsync of the directory.
    pub fn write(&self, info: &SnapshotInfo) -> Result<(), Error> {
        let dst = self.path(&info.id);
        let tmp = self.dir.join(format!("{}.json.tmp", info.id));
        let body = serde_json::to_vec_pretty(info).map_err(|e| Error::Corrupt {
            path: dst.clone(),
            reason: e.to_string(),
        })?;
        let res = (|| {
            let mut f = File::create(&tmp)?;
            f.write_all(&body)?;
            f.sync_all()?;
            fs::rename(&tmp, &dst)?;
            File::open(&self.dir)?.sync_all()
        })();
        if res.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        res.map_err(|e| Error::io(&dst, e))
    }

    pub fn remove(&self, id: &str) -> Result<(), Error> {
        let p = self.path(id);
        match fs::remove_file(&p) {
            Ok(()) => File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| Error::io(&self.dir, e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(p, e)),
        }
    }
}

fn read(p: &Path) -> Result<SnapshotInfo, Error> {
    let body = fs::read(p).map_err(|e| Error::io(p, e))?;
    serde_json::from_slice(&body).map_err(|e| Error::Corrupt {
        path: p.to_path_buf(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: &str, at: u64) -> SnapshotInfo {
        SnapshotInfo {
            id: id.into(),
            name: Some("n".into()),
            source: "sb-000000000001".into(),
            created_at_ms: at,
            fs_root: "a".repeat(64),
            images_root: "b".repeat(64),
            spec: SandboxSpec::from_image("debian12"),
            dump_ms: 5,
            bytes_added: 7,
            store_ms: 3,
            root: None,
            durable: true,
            paused: None,
            memory_dump: MemoryDump::Full,
            full_dump_reason: None,
        }
    }

    #[test]
    fn a_record_from_before_memory_dump_reads_as_a_full_dump() {
        let mut v = serde_json::to_value(info(&"1".repeat(64), 2)).unwrap();
        assert_eq!(v["memory_dump"], "full");
        v.as_object_mut().unwrap().remove("memory_dump");
        let old: SnapshotInfo = serde_json::from_value(v).unwrap();
        assert_eq!(old.memory_dump, MemoryDump::Full);
        let mut inc = info(&"2".repeat(64), 3);
        inc.memory_dump = MemoryDump::SoftDirty;
        let v = serde_json::to_value(&inc).unwrap();
        assert_eq!(v["memory_dump"], MemoryDump::SoftDirty.as_str());
        assert_eq!(serde_json::from_value::<SnapshotInfo>(v).unwrap(), inc);
    }

    #[test]
    fn records_round_trip_and_crash_leftovers_are_dropped() {
        let d = tempfile::tempdir().unwrap();
        let rd = RecordDir::open(d.path().join("snapshots")).unwrap();
        let a = info(&"1".repeat(64), 2);
        let b = info(&"2".repeat(64), 1);
        rd.write(&a).unwrap();
        rd.write(&b).unwrap();
        fs::write(d.path().join("snapshots/x.json.tmp"), b"half").unwrap();
        fs::write(d.path().join("snapshots/garbage.json"), b"{").unwrap();
        let all = rd.load_all().unwrap();
        assert_eq!(
            all,
            vec![b.clone(), a.clone()],
            "sorted by creation time, garbage skipped"
        );
        assert!(!d.path().join("snapshots/x.json.tmp").exists());
        rd.remove(&a.id).unwrap();
        rd.remove(&a.id).unwrap();
        assert_eq!(rd.load_all().unwrap(), vec![b]);
    }

    #[test]
    fn root_hash_covers_all_three_parts() {
        let spec = SandboxSpec::from_image("x");
        let h = root_hash("a", "b", &spec);
        assert!(is_id(&h));
        assert_ne!(h, root_hash("a", "c", &spec));
        assert_ne!(h, root_hash("c", "b", &spec));
        let mut other = spec.clone();
        other.hostname = Some("h".into());
        assert_ne!(h, root_hash("a", "b", &other));
        assert_eq!(h, root_hash("a", "b", &spec));
    }

    #[test]
    fn capture_ids_are_unique_and_look_like_ids() {
        let spec = SandboxSpec::from_image("x");
        let a = capture_id("f", &spec, "sb-000000000001", 5);
        assert!(is_id(&a));
        assert_ne!(a, capture_id("f", &spec, "sb-000000000001", 5));
    }

    #[test]
    fn a_record_without_the_durable_field_is_durable() {
        let mut v = serde_json::to_value(info(&"1".repeat(64), 1)).unwrap();
        v.as_object_mut().unwrap().remove("durable");
        let back: SnapshotInfo = serde_json::from_value(v).unwrap();
        assert!(back.durable);
    }

    #[test]
    fn names() {
        assert!(validate_name("base-1.2_x").is_ok());
        for bad in ["", ".x", "a/b", "a b", &"f".repeat(64), &"x".repeat(129)] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
    }
}
