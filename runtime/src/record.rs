//! Durable sandbox records: what a restarted runtime needs to adopt a live sandbox, or to report
//! one it could not adopt.
//!
//! `<run_dir>/sandboxes/<id>/sandbox.json` is written (write, rename) once a create has made every
//! part, rewritten when the state or TTL changes, and removed first thing by destroy.
//! A sandbox dir without a record is therefore a create or a destroy that was in flight: a restart
//! reclaims it. `<run_dir>/lost/<id>.json` holds a sandbox a restart found dead (state `failed`)
//! until the client deletes it. Both live in the run dir: sandboxes do not outlive a reboot.
//!
//! No fsync: the records must survive the daemon's death, not the kernel's. A killed process
//! loses nothing it wrote (the page cache holds it) and the rename makes each record whole or
//! absent; after a power loss the sandboxes are gone anyway, and a stale or torn record is judged
//! like any other (its init's start time no longer matches). An fsync would cost every create a
//! disk flush (8 ms measured here, where /run is on the root ext4).

use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::network::NetLease;
use crate::types::{Limits, SandboxId, SandboxInfo, SandboxSpec, SandboxState};

const FILE: &str = "sandbox.json";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: SandboxId,
    pub spec: SandboxSpec,
    pub limits: Limits,
    pub hostname: String,
    pub created_at_ms: u64,
    pub expires_at_ms: Option<u64>,
    /// `running` or `paused` (frozen).
    pub state: SandboxState,
    pub init_pid: i32,
    /// Start time of the init (clock ticks since boot, /proc/<pid>/stat field 22): a pid reused by
    /// another process after the init died does not match, and adoption refuses it
    /// (`InitHandle::adopt`).
    pub init_start: u64,
    pub net: Option<NetLease>,
    /// The host id range of a sandbox in a user namespace: claimed again at adoption.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ids: Option<crate::userns::IdRange>,
}

/// A sandbox a restart could not adopt: reported `failed` until deleted.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LostRecord {
    pub info: SandboxInfo,
    pub reason: String,
}

/// Writes `value` as JSON to `path` through a temp file and a rename (whole or absent).
fn write_json(path: &Path, value: &impl Serialize) -> io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    let body = serde_json::to_vec(value).map_err(io::Error::other)?;
    std::fs::File::create(&tmp)?.write_all(&body)?;
    std::fs::rename(&tmp, path)
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> io::Result<T> {
    let body = std::fs::read(path)?;
    serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

fn remove(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// `dir` is the sandbox's run dir.
pub fn write(dir: &Path, rec: &SandboxRecord) -> io::Result<()> {
    write_json(&dir.join(FILE), rec)
}

pub fn read(dir: &Path) -> io::Result<SandboxRecord> {
    read_json(&dir.join(FILE))
}

pub fn discard(dir: &Path) -> io::Result<()> {
    remove(&dir.join(FILE))
}

fn lost_path(lost_dir: &Path, id: &SandboxId) -> PathBuf {
    lost_dir.join(format!("{id}.json"))
}

pub fn write_lost(lost_dir: &Path, rec: &LostRecord) -> io::Result<()> {
    std::fs::create_dir_all(lost_dir)?;
    write_json(&lost_path(lost_dir, &rec.info.id), rec)
}

pub fn discard_lost(lost_dir: &Path, id: &SandboxId) -> io::Result<()> {
    remove(&lost_path(lost_dir, id))
}

/// Every readable lost record; unreadable files (a torn temp file) are removed.
pub fn load_lost(lost_dir: &Path) -> Vec<LostRecord> {
    let Ok(rd) = std::fs::read_dir(lost_dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let path = e.path();
        match read_json::<LostRecord>(&path) {
            Ok(r) if path.extension().is_some_and(|x| x == "json") => out.push(r),
            _ => {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    out
}

/// Whether `pid` exists and is not a zombie.
pub fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s.get(i + 2..i + 3))
            .is_some_and(|state| state != "Z")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips_and_discard_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let rec = SandboxRecord {
            id: "sb-0123456789ab".parse().unwrap(),
            spec: SandboxSpec::from_image("debian12"),
            limits: Limits::default(),
            hostname: "h".into(),
            created_at_ms: 1,
            expires_at_ms: Some(2),
            state: SandboxState::Running,
            init_pid: 42,
            init_start: 7,
            net: None,
            ids: None,
        };
        write(dir.path(), &rec).unwrap();
        let back = read(dir.path()).unwrap();
        assert_eq!((back.id, back.init_pid, back.init_start), (rec.id, 42, 7));
        discard(dir.path()).unwrap();
        discard(dir.path()).unwrap();
        assert!(read(dir.path()).is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
