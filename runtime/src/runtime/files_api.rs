//! The files API of a running or frozen sandbox: every call goes through a root proved to be its
//! init's (`files::Root`), never through a host path.

use super::Runtime;
use crate::error::Error;
use crate::files::Root;
use crate::registry::SlotState;
use crate::types::*;

impl Runtime {
    /// The root of a running or frozen sandbox, through its verified init handle only.
    fn root_of(&self, id: &SandboxId) -> Result<Root, Error> {
        let (sb, st) = self.live(id)?;
        if !matches!(st, SlotState::Running | SlotState::Frozen) {
            return Err(Error::Conflict {
                id: id.clone(),
                reason: format!(
                    "sandbox is {}: its files are not reachable",
                    Self::shown(st)
                ),
            });
        }
        sb.activity.touch();
        Root::open(&sb.init).map_err(|e| self.unreachable(&sb, e))
    }

    pub fn read_file(&self, id: &SandboxId, path: &str) -> Result<Vec<u8>, Error> {
        self.root_of(id)?.read(path)
    }

    /// A regular file of the sandbox opened for reading (anything else is refused), and its size:
    /// callers stream it rather than hold it.
    pub fn open_file(&self, id: &SandboxId, path: &str) -> Result<(std::fs::File, u64), Error> {
        self.root_of(id)?.open_read(path)
    }

    pub fn write_file(
        &self,
        id: &SandboxId,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
    ) -> Result<(), Error> {
        self.root_of(id)?.write(path, data, mode)
    }

    /// Streams `data` into a file of the sandbox; returns the bytes written.
    pub fn write_file_from(
        &self,
        id: &SandboxId,
        path: &str,
        data: &mut dyn std::io::Read,
        mode: Option<u32>,
    ) -> Result<u64, Error> {
        self.root_of(id)?.write_from(path, data, mode)
    }

    /// The sandbox's root for file operations beyond read/write/list (the E2B filesystem service).
    pub fn files(&self, id: &SandboxId) -> Result<crate::files::Root, Error> {
        self.root_of(id)
    }

    pub fn list_dir(&self, id: &SandboxId, path: &str) -> Result<Vec<DirEntry>, Error> {
        self.root_of(id)?.list(path)
    }

    pub fn upload_tar(
        &self,
        id: &SandboxId,
        dir: &str,
        tar: &mut dyn std::io::Read,
    ) -> Result<(), Error> {
        self.root_of(id)?.upload_tar(dir, tar)
    }

    pub fn download_tar(
        &self,
        id: &SandboxId,
        dir: &str,
        out: &mut dyn std::io::Write,
    ) -> Result<(), Error> {
        self.root_of(id)?.download_tar(dir, out)
    }
}
