//! Noticing a sandbox's init die: a thread polls every live sandbox's pidfd (readable once the
//! init exits), and each request that finds its init gone says so. Either way the sandbox is
//! marked `failed` with a reason and a `failed` event at once: every process in it died with its
//! pid namespace's init, and no request may reach anything through its pid any more.

use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Weak};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use crate::error::Error;
use crate::init_handle::HandleError;
use crate::registry::SlotState;
use crate::runtime::Runtime;
use crate::sandbox::Sandbox;

/// The runtime's end of the watcher's wake-up channel: a byte makes the watcher look at the
/// live sandboxes again; closing it (the runtime dropped) ends the watcher.
pub(crate) struct InitWatch {
    wake: UnixStream,
}

impl InitWatch {
    /// Starts the watcher thread of `rt`.
    pub(crate) fn start(rt: Weak<Runtime>) -> std::io::Result<InitWatch> {
        let (wake, rx) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        rx.set_nonblocking(true)?;
        std::thread::Builder::new()
            .name("grove-init-watch".into())
            .spawn(move || watch(rt, rx))?;
        Ok(InitWatch { wake })
    }

    /// A sandbox joined the live ones: watch it too.
    pub(crate) fn nudge(&self) {
        let _ = std::io::Write::write(&mut &self.wake, &[1]);
    }
}

fn watch(rt: Weak<Runtime>, rx: UnixStream) {
    loop {
        let watched: Vec<Arc<Sandbox>> = match rt.upgrade() {
            None => return,
            Some(rt) => rt
                .registry
                .live()
                .into_iter()
                .filter(|(_, st)| matches!(st, SlotState::Running | SlotState::Frozen))
                .map(|(s, _)| s)
                .collect(),
        };
        let mut fds = vec![PollFd::new(rx.as_fd(), PollFlags::POLLIN)];
        fds.extend(
            watched
                .iter()
                .map(|s| PollFd::new(s.init.pidfd(), PollFlags::POLLIN)),
        );
        if nix::poll::poll(&mut fds, PollTimeout::NONE).is_err() {
            continue; // EINTR
        }
        let ready: Vec<bool> = fds
            .iter()
            .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(fds);
        if ready[0] {
            let mut buf = [0u8; 64];
            loop {
                match (&rx).read(&mut buf) {
                    Ok(0) => return, // the runtime is gone
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        if ready[1..].iter().any(|r| *r) {
            let Some(rt) = rt.upgrade() else { return };
            for (sb, _) in watched.iter().zip(&ready[1..]).filter(|(_, r)| **r) {
                rt.init_died(sb);
            }
        }
    }
}

impl Runtime {
    /// Marks `failed` (with an event) a live sandbox whose init exited.
    pub(crate) fn init_died(&self, sb: &Arc<Sandbox>) {
        let reason = format!(
            "its init (pid {}) exited: every process of the sandbox is gone",
            sb.init.pid()
        );
        self.mark_failed(sb, reason);
    }

    /// What a request hears when its sandbox's init cannot be reached. A dead init fails the
    /// sandbox (409 from then on); a control socket the sandbox replaced is its own doing (409).
    pub(crate) fn unreachable(&self, sb: &Arc<Sandbox>, e: HandleError) -> Error {
        if e.init_gone() {
            self.init_died(sb);
            return Error::Conflict {
                id: sb.id.clone(),
                reason: format!("sandbox failed: {e}"),
            };
        }
        match e {
            HandleError::Socket { .. } | HandleError::Impostor { .. } => Error::Conflict {
                id: sb.id.clone(),
                reason: format!("{e}: exec needs init's own socket, which was changed from inside"),
            },
            e => Error::Init {
                id: sb.id.clone(),
                reason: e.to_string(),
            },
        }
    }
}
