//! Undo actions that run however a scenario ends (success, error, panic, Ctrl-C), and the Ctrl-C flag.
//!
//! SIGINT/SIGTERM only set a flag: the scenario loops check it, return an error, and the guards they hold
//! unmount, kill and remove on the way out. A second signal still only sets the flag; guards always run.

use std::sync::atomic::{AtomicBool, Ordering};

static CANCELLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_sig: libc::c_int) {
    CANCELLED.store(true, Ordering::SeqCst);
}

/// Routes SIGINT and SIGTERM to the cancel flag.
pub fn install_signal_handlers() {
    use nix::sys::signal::{signal, SigHandler, Signal};
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        let _ = unsafe { signal(sig, SigHandler::Handler(on_signal)) };
    }
}

pub fn cancelled() -> bool {
    CANCELLED.load(Ordering::SeqCst)
}

/// Errors out once the run was interrupted, so the caller's guards clean up.
pub fn check() -> anyhow::Result<()> {
    if cancelled() {
        anyhow::bail!("interrupted");
    }
    Ok(())
}

/// Runs its action when dropped.
pub struct Guard {
    what: String,
    action: Option<Box<dyn FnOnce() -> Result<(), String> + Send>>,
}

impl Guard {
    pub fn new(
        what: impl Into<String>,
        f: impl FnOnce() -> Result<(), String> + Send + 'static,
    ) -> Self {
        Guard {
            what: what.into(),
            action: Some(Box::new(f)),
        }
    }
    /// Runs the action now (reporting its error) instead of at drop.
    pub fn run(mut self) -> Result<(), String> {
        match self.action.take() {
            Some(f) => f().map_err(|e| format!("{}: {e}", self.what)),
            None => Ok(()),
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(f) = self.action.take() {
            if let Err(e) = f() {
                eprintln!("grove-bench: cleanup of {} failed: {e}", self.what);
            }
        }
    }
}

/// Unmounts `path` (lazily, so a busy FUSE mount still goes) when dropped.
pub fn unmount_guard(path: std::path::PathBuf) -> Guard {
    Guard::new(format!("mount {}", path.display()), move || {
        crate::util::unmount(&path)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    #[test]
    fn guard_runs_once_on_drop_or_run() {
        let n = Arc::new(AtomicUsize::new(0));
        {
            let n = n.clone();
            let _g = Guard::new("a", move || {
                n.fetch_add(1, Ordering::SeqCst);
                Ok(())
            });
        }
        assert_eq!(n.load(Ordering::SeqCst), 1);
        let n2 = n.clone();
        let g = Guard::new("b", move || {
            n2.fetch_add(1, Ordering::SeqCst);
            Err("boom".into())
        });
        assert_eq!(g.run().unwrap_err(), "b: boom");
        assert_eq!(n.load(Ordering::SeqCst), 2);
    }
}
