//! Network interfaces.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

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

/// TCP states in which a socket may still put a packet on the wire: every state but LISTEN
/// (10), TIME_WAIT (6) and CLOSE (7), one bit per state as in sock_diag's `idiag_states`. A
/// listener's half-open connections (NEW_SYN_RECV, 12) count.
const TCP_MOVING_STATES: u32 = !((1 << 10) | (1 << 6) | (1 << 7));

/// `struct inet_diag_req_v2` (linux/inet_diag.h), with its socket id left zero.
#[repr(C)]
struct InetDiagReq {
    family: u8,
    protocol: u8,
    ext: u8,
    pad: u8,
    states: u32,
    id: [u8; 48],
}

#[repr(C)]
struct DiagRequest {
    header: libc::nlmsghdr,
    req: InetDiagReq,
}

/// How many TCP sockets (IPv4 and IPv6) are hashed in the network namespace whose `/proc/.../net`
/// is `proc_net`: listeners, connected, connecting and closing ones (TIME_WAIT and sockets only
/// created or bound are not). Read from `sockstat` and `sockstat6`, the namespace's own counters:
/// no table walk. A namespace without IPv6 has no `sockstat6`, and counts IPv4 alone.
pub fn tcp_sockets_in_use(proc_net: &Path) -> io::Result<u64> {
    let v4 = std::fs::read_to_string(proc_net.join("sockstat"))?;
    let mut n = in_use(&v4, "TCP:").ok_or_else(|| bad_sockstat(proc_net))?;
    match std::fs::read_to_string(proc_net.join("sockstat6")) {
        Ok(v6) => n += in_use(&v6, "TCP6:").ok_or_else(|| bad_sockstat(proc_net))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    Ok(n)
}

/// `inuse` of the line for `proto` ("TCP: inuse 1 orphan 0 tw 0 alloc 1 mem 0").
fn in_use(sockstat: &str, proto: &str) -> Option<u64> {
    let line = sockstat.lines().find(|l| l.starts_with(proto))?;
    let mut words = line.split_whitespace().skip(1);
    while let Some(w) = words.next() {
        if w == "inuse" {
            return words.next()?.parse().ok();
        }
    }
    None
}

fn bad_sockstat(proc_net: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("no TCP inuse count in {}/sockstat", proc_net.display()),
    )
}

/// How many TCP sockets (IPv4 and IPv6) of the calling thread's network namespace are
/// connected, connecting or closing: every one but listeners and TIME_WAIT. Asked of
/// sock_diag, which walks the host's established-socket table (about 2 ms per family here).
pub fn moving_tcp_sockets() -> io::Result<usize> {
    // SAFETY: plain socket(2) call; the result is checked and wrapped right after.
    let raw = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: raw is a fresh descriptor we own.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut n = 0;
    for (seq, family) in [(1u32, libc::AF_INET), (2, libc::AF_INET6)] {
        n += diag_count(&sock, seq, family as u8)?;
    }
    Ok(n)
}

fn diag_count(sock: &OwnedFd, seq: u32, family: u8) -> io::Result<usize> {
    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    let request = DiagRequest {
        header: libc::nlmsghdr {
            nlmsg_len: std::mem::size_of::<DiagRequest>() as u32,
            nlmsg_type: SOCK_DIAG_BY_FAMILY,
            nlmsg_flags: (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16,
            nlmsg_seq: seq,
            nlmsg_pid: 0,
        },
        req: InetDiagReq {
            family,
            protocol: libc::IPPROTO_TCP as u8,
            ext: 0,
            pad: 0,
            states: TCP_MOVING_STATES,
            id: [0; 48],
        },
    };
    // SAFETY: the request is a fully initialized repr(C) value; send reads its bytes only.
    let sent = unsafe {
        libc::send(
            sock.as_raw_fd(),
            (&request as *const DiagRequest).cast(),
            std::mem::size_of::<DiagRequest>(),
            0,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = vec![0u8; 32 * 1024];
    let mut count = 0;
    loop {
        // SAFETY: recv writes at most buf.len() bytes into buf.
        let got = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if got < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if got == 0 {
            return Err(io::Error::other(
                "sock_diag: the socket closed before its answer",
            ));
        }
        let mut at = 0;
        let got = got as usize;
        while at + std::mem::size_of::<libc::nlmsghdr>() <= got {
            let word = |o: usize| u32::from_ne_bytes(buf[at + o..at + o + 4].try_into().unwrap());
            let len = word(0) as usize;
            let kind = u16::from_ne_bytes(buf[at + 4..at + 6].try_into().unwrap());
            if len < std::mem::size_of::<libc::nlmsghdr>() || at + len > got {
                return Err(io::Error::other("sock_diag: malformed reply"));
            }
            if word(8) == seq {
                match kind as i32 {
                    libc::NLMSG_DONE => return Ok(count),
                    libc::NLMSG_ERROR if len >= 20 => {
                        let errno = i32::from_ne_bytes(buf[at + 16..at + 20].try_into().unwrap());
                        return Err(io::Error::from_raw_os_error(-errno));
                    }
                    _ if kind == SOCK_DIAG_BY_FAMILY => count += 1,
                    _ => {}
                }
            }
            at += (len + 3) & !3;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on a thread of its own in a new network namespace, so the host's is not
    /// touched; None, said loudly, without root.
    fn in_fresh_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        if !nix::unistd::geteuid().is_root() {
            grove_testkit::capability_missing("needs root (CAP_SYS_ADMIN) for a network namespace");
            return None;
        }
        let t = std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            f()
        });
        Some(t.join().unwrap())
    }

    /// In a namespace of its own (a thread's), so the host's `lo` is not touched.
    #[test]
    fn brings_up_lo_in_a_fresh_namespace() {
        let Some(up) = in_fresh_netns(|| {
            let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let to = sock.local_addr().unwrap();
            let down = sock.send_to(b"x", to).is_err(); // ENETUNREACH while lo is down
            loopback_up().unwrap();
            sock.send_to(b"x", to).unwrap();
            let mut b = [0u8; 1];
            sock.recv(&mut b).unwrap();
            down && b == *b"x"
        }) else {
            return;
        };
        assert!(up, "lo was down before and carried a datagram after");
    }

    /// A listener does not count; an accepted connection does, on both ends; once both ends
    /// have closed, the TIME_WAIT left behind does not.
    #[test]
    fn sockstat_lines_give_their_in_use_count() {
        let v4 = "sockets: used 5\nTCP: inuse 3 orphan 0 tw 1 alloc 4 mem 1\nUDP: inuse 0 mem 0\n";
        assert_eq!(in_use(v4, "TCP:"), Some(3));
        assert_eq!(in_use("TCP6: inuse 2\nUDP6: inuse 0\n", "TCP6:"), Some(2));
        assert_eq!(in_use("UDP: inuse 0 mem 0\n", "TCP:"), None);
        assert_eq!(in_use("TCP: orphan 0\n", "TCP:"), None);
    }

    /// A new namespace has none; a listener and each end of a connection count, on either
    /// family, in that namespace only.
    #[test]
    fn counts_the_namespaces_own_tcp_sockets_without_a_walk() {
        let Some(seen) = in_fresh_netns(|| {
            loopback_up().unwrap();
            let here = Path::new("/proc/thread-self/net");
            let empty = tcp_sockets_in_use(here).unwrap();
            let _udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let _bound_only = bound_tcp_socket();
            let after_udp = tcp_sockets_in_use(here).unwrap();
            let l4 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let l6 = std::net::TcpListener::bind("[::1]:0").ok();
            let listening = tcp_sockets_in_use(here).unwrap();
            let c = std::net::TcpStream::connect(l4.local_addr().unwrap()).unwrap();
            let (s, _) = l4.accept().unwrap();
            let connected = tcp_sockets_in_use(here).unwrap();
            drop((c, s));
            (
                empty,
                after_udp,
                listening - l6.is_some() as u64,
                connected - listening,
            )
        }) else {
            return;
        };
        assert_eq!(
            seen,
            (0, 0, 1, 2),
            "(empty, udp and a bound socket, listener, connection)"
        );
    }

    /// A TCP socket bound to a port but neither listening nor connected.
    fn bound_tcp_socket() -> OwnedFd {
        // SAFETY: plain socket(2); checked and wrapped right after.
        let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        assert!(raw >= 0);
        // SAFETY: raw is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let addr = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from_be_bytes([127, 0, 0, 1]).to_be(),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: addr is a valid sockaddr_in of the size given.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &addr as *const libc::sockaddr_in as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        assert_eq!(r, 0);
        fd
    }

    #[test]
    fn counts_connections_not_listeners_or_time_wait() {
        let Some(seen) = in_fresh_netns(|| {
            loopback_up().unwrap();
            let empty = moving_tcp_sockets().unwrap();
            let l4 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let _l6 = std::net::TcpListener::bind("[::1]:0");
            let listening = moving_tcp_sockets().unwrap();
            let client = std::net::TcpStream::connect(l4.local_addr().unwrap()).unwrap();
            let (server, _) = l4.accept().unwrap();
            let connected = moving_tcp_sockets().unwrap();
            drop(client);
            drop(server);
            let mut closed = usize::MAX;
            for _ in 0..200 {
                closed = moving_tcp_sockets().unwrap();
                if closed == 0 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            (empty, listening, connected, closed)
        }) else {
            return;
        };
        assert_eq!(seen, (0, 0, 2, 0), "(empty, listening, connected, closed)");
    }
}
