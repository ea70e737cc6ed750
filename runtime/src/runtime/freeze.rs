//! Freezing a sandbox's cgroup: pause and resume as the API shows them (the sandbox keeps its
//! memory), and the bare freeze and thaw the snapshotter brackets a dump with.

use super::Runtime;
use crate::error::Error;
use crate::registry::SlotState;
use crate::types::*;

impl Runtime {
    /// Freezes the sandbox's cgroup: it keeps its memory. The snapshotter's pause (CRIU dump to
    /// the store, then `park`) is the one that frees it.
    pub fn pause(&self, id: &SandboxId) -> Result<SandboxInfo, Error> {
        let sb = self.running(id)?;
        self.freeze(id)?;
        self.registry
            .freeze(id, &sb)
            .map_err(|e| Self::refused(id, e))?;
        self.persist(&sb)?;
        self.emit(id, EventKind::Paused, None);
        Ok(sb.info(SandboxState::Paused))
    }

    pub fn resume(&self, id: &SandboxId) -> Result<SandboxInfo, Error> {
        let (sb, st) = self.live(id)?;
        if st != SlotState::Frozen {
            return Err(Error::Conflict {
                id: id.clone(),
                reason: "sandbox is not paused".into(),
            });
        }
        self.thaw(id)?;
        self.registry
            .thaw(id, &sb)
            .map_err(|e| Self::refused(id, e))?;
        self.persist(&sb)?;
        sb.activity.touch();
        self.emit(id, EventKind::Resumed, None);
        Ok(sb.info(SandboxState::Running))
    }

    pub fn freeze(&self, id: &SandboxId) -> Result<(), Error> {
        self.sandbox(id)?;
        self.cgroups.freeze(id.as_str()).map_err(|e| Error::Cgroup {
            path: e.path.clone(),
            source: e.source,
        })
    }

    pub fn thaw(&self, id: &SandboxId) -> Result<(), Error> {
        self.sandbox(id)?;
        self.cgroups.thaw(id.as_str()).map_err(|e| Error::Cgroup {
            path: e.path.clone(),
            source: e.source,
        })
    }
}
