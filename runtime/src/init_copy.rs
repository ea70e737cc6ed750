//! The runtime's own copy of grove-init, on a small tmpfs of its own at `<run_dir>/init`, which is
//! what every sandbox binds at `INIT_PATH`. A bind's root field in the sandbox's mountinfo is the
//! file's path inside its filesystem: here `/grove-init`, never the host path of the installed
//! binary. The copy also keeps sandboxes (and their checkpoints, which CRIU validates by the
//! mapped file) independent of a rebuild or an upgrade of the installed binary.

use std::io;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use nix::mount::MsFlags;

use crate::mounts;

const NAME: &str = "grove-init";

/// The tmpfs mount point under the run dir.
pub(crate) fn dir(run_dir: &Path) -> PathBuf {
    run_dir.join("init")
}

fn is_mounted(dir: &Path) -> bool {
    mounts::mount_points().is_ok_and(|m| m.iter().any(|p| p == dir))
}

/// Mounts the tmpfs (or finds it, left for sandboxes adopted across a restart) and puts `binary`
/// in it; returns the copy's path. A copy with the same bytes is kept as it is: replacing it would
/// turn an adopted sandbox's mapping into a deleted file, which CRIU cannot checkpoint.
pub(crate) fn install(run_dir: &Path, binary: &Path) -> io::Result<PathBuf> {
    let dir = dir(run_dir);
    let bytes = std::fs::read(binary)?;
    std::fs::create_dir_all(&dir)?;
    if !is_mounted(&dir) {
        // Room for the binary twice (a replacement is written beside the old copy).
        let size = bytes.len().saturating_mul(2) + (1 << 20);
        nix::mount::mount(
            Some(NAME),
            &dir,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(format!("mode=0755,size={size}").as_str()),
        )?;
    }
    let dst = dir.join(NAME);
    if std::fs::read(&dst).is_ok_and(|have| have == bytes) {
        return Ok(dst);
    }
    let tmp = dir.join(format!(".{NAME}.{}", std::process::id()));
    std::fs::write(&tmp, &bytes)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&tmp, &dst)?;
    Ok(dst)
}

/// Unmounts the tmpfs and removes its mount point (at shutdown, once no sandbox is left).
pub(crate) fn remove(run_dir: &Path) {
    let dir = dir(run_dir);
    if let Err(e) = mounts::unmount_if_mounted(&dir) {
        tracing::warn!(dir = %dir.display(), error = %e, "unmounting the init copy");
    }
    let _ = std::fs::remove_dir(&dir);
}
