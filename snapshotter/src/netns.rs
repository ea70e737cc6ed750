//! Offline sandboxes' network namespaces in snapshots. Such a namespace holds only `lo` (the
//! sandbox has no CAP_NET_ADMIN to add more), so CRIU dumps it by reference instead of running
//! `ip route/rule save`, `iptables-save` and friends while the sandbox is frozen, and each
//! restore joins a fresh loopback-only namespace made here (no `ip ... restore` per branch).
//! The sockets inside (listeners, loopback connections) are process state and are restored
//! into it as before.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Inode of the network namespace of `pid` (what `--external net[<inode>]` names).
pub(crate) fn inode_of(pid: i32) -> io::Result<u64> {
    Ok(std::fs::metadata(format!("/proc/{pid}/ns/net"))?.ino())
}

/// Whether a dump in `images` took its network namespace by reference: CRIU writes a
/// `netdev-<id>.img` for every namespace it dumps in full (`lo` at least).
pub(crate) fn is_external(images: &Path) -> bool {
    let Ok(rd) = std::fs::read_dir(images) else {
        return false;
    };
    !rd.flatten().any(|e| {
        let n = e.file_name();
        let n = n.to_string_lossy();
        n.starts_with("netdev-") && n.ends_with(".img")
    })
}

/// Whether no TCP socket in the network namespace of `pid` is connected, connecting or closing
/// (listeners and TIME_WAIT aside). Asked while the sandbox is frozen, when no socket can
/// change state but through a TCP timer, and only a socket counted here has one: the dump
/// of a loopback-only namespace then needs no network lock (`DumpOptions::skip_network_lock`).
/// A namespace with no TCP socket at all answers from its counters; else sock_diag walks the
/// host's table (about 2 ms per family here, frozen).
pub(crate) fn tcp_quiet(pid: i32) -> io::Result<bool> {
    if grove_sys::net::tcp_sockets_in_use(Path::new(&format!("/proc/{pid}/net")))? == 0 {
        return Ok(true);
    }
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    grove_sys::thread::on_own_thread(move || -> io::Result<bool> {
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
        Ok(grove_sys::net::moving_tcp_sockets()? == 0)
    })?
}

/// A new network namespace with `lo` up, held by the returned fd (it lives while the fd or a
/// process in it does). Made on a short-lived thread: network namespaces are per thread, so
/// the caller's stays untouched.
pub(crate) fn fresh_loopback() -> io::Result<OwnedFd> {
    grove_sys::thread::on_own_thread(|| -> io::Result<OwnedFd> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
        let ns: OwnedFd = std::fs::File::open("/proc/thread-self/ns/net")?.into();
        grove_sys::net::loopback_up()?;
        Ok(ns)
    })?
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn full_dumps_have_netdev_images() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("netns-10.img"), b"").unwrap();
        assert!(is_external(d.path()));
        std::fs::write(d.path().join("netdev-10.img"), b"").unwrap();
        assert!(!is_external(d.path()));
    }

    #[test]
    fn fresh_namespace_is_new_and_leaves_ours_alone() {
        if !nix::unistd::geteuid().is_root() {
            grove_testkit::capability_missing("needs root (CAP_SYS_ADMIN)");
            return;
        }
        let ours = inode_of(std::process::id() as i32).unwrap();
        let ns = fresh_loopback().unwrap();
        let theirs = std::fs::metadata(format!("/proc/self/fd/{}", ns.as_raw_fd()))
            .unwrap()
            .ino();
        assert_ne!(ours, theirs);
        assert_eq!(inode_of(std::process::id() as i32).unwrap(), ours);
    }

    /// Asked of another task's namespace (a thread's own, here): quiet with a listener, not
    /// with a connection; ours is left alone.
    #[test]
    fn tcp_quiet_reads_the_namespace_of_the_task_named() {
        if !nix::unistd::geteuid().is_root() {
            grove_testkit::capability_missing("needs root (CAP_SYS_ADMIN) for a network namespace");
            return;
        }
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let (step_tx, step_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            grove_sys::net::loopback_up().unwrap();
            tid_tx.send(nix::unistd::gettid().as_raw()).unwrap();
            step_rx.recv().unwrap();
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            tid_tx.send(0).unwrap();
            step_rx.recv().unwrap();
            let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let s = l.accept().unwrap();
            tid_tx.send(0).unwrap();
            step_rx.recv().unwrap();
            drop((c, s));
        });
        let tid = tid_rx.recv().unwrap();
        let mut seen = Vec::new();
        for _ in 0..3 {
            seen.push(tcp_quiet(tid).unwrap());
            step_tx.send(()).unwrap();
            let _ = tid_rx.recv();
        }
        t.join().unwrap();
        // No socket (the counters answer), a listener alone (sock_diag answers), a connection.
        assert_eq!(seen, [true, true, false], "(empty, listening, connected)");
    }
}
