//! A sandbox's hostname set from outside it: a restored tree takes the new sandbox's (it would
//! keep the one it was dumped with), a claimed pooled sandbox the one its spec asks for.

use std::os::fd::AsFd;

use nix::fcntl::OFlag;

use crate::init_handle::InitHandle;

/// Sets the hostname in the UTS namespace of `init`. setns(CLONE_NEWUTS) is per thread, so a
/// short-lived thread does it and the daemon's own threads are untouched.
pub fn set_hostname(init: &InitHandle, hostname: &str) -> Result<(), String> {
    let ns = init
        .open_proc("ns/uts", OFlag::O_RDONLY)
        .map_err(|e| e.to_string())?;
    let name = hostname.to_string();
    grove_sys::thread::on_own_thread(move || {
        nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWUTS)
            .map_err(|e| format!("setns: {e}"))?;
        nix::unistd::sethostname(&name).map_err(|e| format!("sethostname: {e}"))
    })
    .map_err(|e| e.to_string())?
}
