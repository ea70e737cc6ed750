//! A sandbox's hostname set from outside it: a restored tree takes the new sandbox's (it would
//! keep the one it was dumped with), a claimed pooled sandbox the one its spec asks for.

use std::os::fd::AsFd;

use nix::fcntl::OFlag;

use crate::init_handle::{HandleError, InitHandle};

/// Why the hostname of a restored or pooled tree could not be set.
#[derive(Debug, thiserror::Error)]
pub enum HostnameError {
    /// Init's UTS namespace could not be opened (init gone, or its pid reused).
    #[error("{0}")]
    Namespace(#[from] HandleError),
    #[error("setns: {0}")]
    Setns(nix::errno::Errno),
    #[error("sethostname: {0}")]
    Sethostname(nix::errno::Errno),
    /// The short-lived thread that enters the namespace could not be started (or panicked).
    #[error("{0}")]
    Thread(std::io::Error),
}

/// Sets the hostname in the UTS namespace of `init`. setns(CLONE_NEWUTS) is per thread, so a
/// short-lived thread does it and the daemon's own threads are untouched.
pub fn set_hostname(init: &InitHandle, hostname: &str) -> Result<(), HostnameError> {
    let ns = init.open_proc("ns/uts", OFlag::O_RDONLY)?;
    let name = hostname.to_string();
    grove_sys::thread::on_own_thread(move || {
        nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWUTS)
            .map_err(HostnameError::Setns)?;
        nix::unistd::sethostname(&name).map_err(HostnameError::Sethostname)
    })
    .map_err(HostnameError::Thread)?
}
