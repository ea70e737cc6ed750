//! Network interfaces.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `ip link set lo up` in the calling thread's network namespace (the kernel adds 127.0.0.1
/// with it). A fresh namespace holds only `lo`, and down.
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: plain socket(2) call; the result is checked and wrapped right after.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: raw is a fresh descriptor we own.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *s as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS fills a properly sized ifreq.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ifru_flags is the union field SIOCGIFFLAGS filled.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    // SAFETY: SIOCSIFFLAGS reads a properly sized ifreq.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS as _, &req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a namespace of its own (a thread's), so the host's `lo` is not touched.
    #[test]
    fn brings_up_lo_in_a_fresh_namespace() {
        if !nix::unistd::geteuid().is_root() {
            grove_testkit::capability_missing("needs root (CAP_SYS_ADMIN) for a network namespace");
            return;
        }
        let up = std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let to = sock.local_addr().unwrap();
            let down = sock.send_to(b"x", to).is_err(); // ENETUNREACH while lo is down
            loopback_up().unwrap();
            sock.send_to(b"x", to).unwrap();
            let mut b = [0u8; 1];
            sock.recv(&mut b).unwrap();
            down && b == *b"x"
        })
        .join()
        .unwrap();
        assert!(up, "lo was down before and carried a datagram after");
    }
}
