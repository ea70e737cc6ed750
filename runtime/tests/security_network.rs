//! Attacks on the network boundary, from inside real sandboxes and as a hostile API client:
//! a published port must never take over a host port (issue 24, break 4), and an allowlist as
//! broad as 0.0.0.0/0 must never reach another sandbox or the host itself (break 5). "The
//! internet" is a network namespace made here; no traffic ever leaves for a real address.

mod common;

use std::net::{Ipv4Addr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::*;
use grove_runtime::{
    EgressRule, ExecRequest, NetworkPolicy, OverlayRoot, PortMapping, Runtime, SandboxId,
};

const INSTANCE: &str = "grove-rtest-secnet";
/// One of this runtime's host ports that groved would pass as its own listener.
const RESERVED: u16 = 31999;

/// One runtime for this binary, and one test at a time: both tests wire "the internet" and
/// restore ip_forward when done.
fn node() -> (std::sync::MutexGuard<'static, ()>, Arc<Runtime>) {
    static SERIAL: Mutex<()> = Mutex::new(());
    static RT: OnceLock<Arc<Runtime>> = OnceLock::new();
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rt = RT
        .get_or_init(|| {
            let mut c = config(INSTANCE);
            c.net_pool = "10.216.0.0/16".into();
            c.reserved_ports = vec![RESERVED];
            let rt = Runtime::new(c, Arc::new(OverlayRoot::new(STATE_DIR))).expect("runtime");
            // A failed earlier run of this binary left sandboxes the start adopted: not ours now.
            for s in rt.list() {
                let _ = rt.destroy(&s.id);
            }
            // SAFETY: registering a plain extern "C" fn with no captured state.
            unsafe { libc::atexit(remove_parents) };
            rt
        })
        .clone();
    (guard, rt)
}

extern "C" fn remove_parents() {
    for ctrl in [
        "memory", "pids", "cpu", "cpuacct", "devices", "freezer", "unified",
    ] {
        let _ = std::fs::remove_dir(format!("/sys/fs/cgroup/{ctrl}/{INSTANCE}"));
    }
    // The runtime's init copy (its tmpfs): a runtime that is never shut down leaves it mounted.
    let init = format!("/run/{INSTANCE}/init");
    let _ = nix::mount::umount2(init.as_str(), nix::mount::MntFlags::MNT_DETACH);
    let _ = std::fs::remove_dir(&init);
    let _ = std::fs::remove_dir(format!("/run/{INSTANCE}/sandboxes"));
    let _ = std::fs::remove_dir(format!("/run/{INSTANCE}"));
}

fn ip(args: &str) {
    let ok = Command::new("ip")
        .args(args.split(' '))
        .status()
        .unwrap()
        .success();
    assert!(ok, "ip {args}");
}

/// "The internet": a netns `ns` behind the host link `link` (host 10.<net>.0.1/24, the netns
/// 10.<net>.0.2), with a listener on 8000 that answers "hi". Gone on drop, with the host
/// listeners the test started and the ip_forward setting it found.
struct Outside {
    ns: &'static str,
    link: &'static str,
    forward_before: String,
    servers: Vec<Child>,
}

impl Outside {
    fn new(ns: &'static str, link: &'static str, net: u8) -> Outside {
        let mut o = Outside {
            ns,
            link,
            forward_before: std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap(),
            servers: Vec::new(),
        };
        let _ = Command::new("ip").args(["netns", "del", ns]).status();
        ip(&format!("netns add {ns}"));
        ip(&format!(
            "link add {link} type veth peer name eth0 netns {ns}"
        ));
        ip(&format!("addr add 10.{net}.0.1/24 dev {link}"));
        ip(&format!("link set {link} up"));
        for cmd in [
            format!("addr add 10.{net}.0.2/24 dev eth0"),
            "link set eth0 up".into(),
            "link set lo up".into(),
            format!("route add default via 10.{net}.0.1"),
        ] {
            ip(&format!("-n {ns} {cmd}"));
        }
        o.servers.push(listener(Some(ns), 8000));
        o
    }

    /// Runs python `code` in the outside netns; its stdout.
    fn python(&self, code: &str) -> String {
        let got = Command::new("ip")
            .args(["netns", "exec", self.ns, "/usr/bin/python3", "-c", code])
            .output()
            .unwrap();
        String::from_utf8_lossy(&got.stdout).trim().to_string()
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        for s in &mut self.servers {
            let _ = s.kill();
            let _ = s.wait();
        }
        let _ = Command::new("ip").args(["netns", "del", self.ns]).status();
        let _ = Command::new("ip")
            .args(["link", "del", self.link])
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::write("/proc/sys/net/ipv4/ip_forward", &self.forward_before);
    }
}

/// A TCP server answering "hi" to every client, on 0.0.0.0:`port` (in netns `ns` when given).
fn listener(ns: Option<&str>, port: u16) -> Child {
    let py = format!(
        "import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('0.0.0.0',{port})); s.listen()\nwhile True:\n  c,_=s.accept(); c.sendall(b'hi'); c.close()\n"
    );
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "/usr/bin/python3", "-c", &py]);
            c
        }
        None => {
            let mut c = Command::new("/usr/bin/python3");
            c.args(["-c", &py]);
            c
        }
    };
    let child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    child
}

/// The same server inside a sandbox, in the background.
fn serve_in(rt: &Runtime, id: &SandboxId, port: u16) {
    let mut srv = ExecRequest::argv([
        "python3".to_string(),
        "-c".into(),
        format!("import socket\ns=socket.socket(); s.bind(('0.0.0.0',{port})); s.listen()\nwhile True:\n  c,_=s.accept(); c.sendall(b'hi'); c.close()\n"),
    ]);
    srv.background = true;
    rt.exec(id, srv).unwrap();
    std::thread::sleep(Duration::from_millis(400));
}

/// A TCP connection from inside the sandbox: "hi" when it got through, else the error's class.
fn connect(rt: &Runtime, id: &SandboxId, addr: &str, port: u16) -> String {
    let py = format!(
        "import socket\ntry:\n  s=socket.create_connection(('{addr}',{port}),timeout=1); print(s.recv(2).decode())\nexcept Exception as e:\n  print(type(e).__name__)\n"
    );
    out(&rt
        .exec(id, ExecRequest::argv(["python3", "-c", &py]))
        .unwrap())
}

fn connect_from_host(addr: &str, port: u16) -> String {
    let py = format!(
        "import socket\ntry:\n  s=socket.create_connection(('{addr}',{port}),timeout=2); print(s.recv(2).decode())\nexcept Exception as e:\n  print(type(e).__name__)\n"
    );
    let got = Command::new("/usr/bin/python3")
        .args(["-c", &py])
        .output()
        .unwrap();
    String::from_utf8_lossy(&got.stdout).trim().to_string()
}

fn egress_all() -> NetworkPolicy {
    NetworkPolicy::Egress {
        allow: vec![EgressRule {
            cidr: "0.0.0.0/0".into(),
            ports: vec![],
        }],
    }
}

fn publishing(host_port: u16) -> grove_runtime::SandboxSpec {
    let mut s = spec();
    s.network = egress_all();
    s.ports = vec![PortMapping {
        host_port,
        sandbox_port: 9000,
    }];
    s
}

/// Host links that carry this runtime's mark, and whether its nft table exists.
fn net_footprint(rt: &Runtime) -> (usize, bool) {
    let mark = rt.config().cgroup_root.replace('-', "_");
    let links = std::fs::read_dir("/sys/class/net")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("ifalias")).is_ok_and(|a| a.trim() == mark)
        })
        .count();
    let table = Command::new("nft")
        .args(["list", "table", "inet", &mark])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success();
    (links, table)
}

/// Asserts a create was refused for `ports[0].host_port` with `why` in its reason, and that it
/// left nothing: no sandbox, no link, no nft table, no residue.
fn assert_refused(rt: &Runtime, s: grove_runtime::SandboxSpec, why: &str) {
    let before = rt.list().len();
    let e = rt.create(s).expect_err("a create that must be refused");
    assert_eq!(e.code(), "invalid_spec", "{e}");
    assert_eq!(e.field(), Some("ports[0].host_port"), "{e}");
    assert!(e.to_string().contains(why), "{e} (wanted {why:?})");
    assert_eq!(rt.list().len(), before);
    assert_eq!(
        net_footprint(rt),
        (0, false),
        "network left by a refused create"
    );
    assert!(rt.residue().items.is_empty(), "{:#?}", rt.residue().items);
}

#[test]
fn published_ports_never_take_a_host_port() {
    if !can_run() {
        return;
    }
    let (_serial, rt) = node();
    let outside = Outside::new("grove-rtest-secp", "grovetsp0", 214);

    // A host service on a port inside the range (groved's TCP port, sshd, ...): held by the test.
    let service = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let mut taken = None;
    for port in 31100..31200 {
        if let Ok(l) = TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
            taken = Some((port, l));
            break;
        }
    }
    drop(service);
    let (port, service) = taken.expect("a free loopback port in the range");
    assert_refused(&rt, publishing(port), "in use on the host");
    // The service still gets its traffic.
    assert_eq!(
        service.local_addr().unwrap().port(),
        port,
        "the test's listener"
    );
    drop(service);

    // Below the range (sshd's port, groved's default TCP port), and groved's reserved listener.
    assert_refused(&rt, publishing(22), "outside the node's host port range");
    assert_refused(&rt, publishing(18090), "outside the node's host port range");
    assert_refused(&rt, publishing(RESERVED), "reserved");

    // In range and free: published, traffic from outside and from the host reaches the sandbox.
    let free = 31300;
    let a = rt.create(publishing(free)).unwrap();
    serve_in(&rt, &a.id, 9000);
    let code = format!(
        "import socket\ntry:\n  s=socket.create_connection(('10.214.0.1',{free}),timeout=2); print(s.recv(2).decode())\nexcept Exception as e:\n  print(type(e).__name__)\n"
    );
    assert_eq!(
        outside.python(&code),
        "hi",
        "outside → host:{free} → sandbox"
    );
    assert_eq!(
        connect_from_host("10.214.0.1", free),
        "hi",
        "host → host:{free} → sandbox"
    );
    // Held while published: a host service starting now cannot bind it (and be hijacked).
    let e = TcpListener::bind((Ipv4Addr::LOCALHOST, free)).expect_err("the port is held");
    assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{e}");
    // Nor can a second sandbox publish it.
    assert_refused_keeping(&rt, publishing(free), "published by another sandbox");

    rt.destroy(&a.id).unwrap();
    assert_gone(&rt, &a.id);
    assert_eq!(net_footprint(&rt), (0, false));
    // Released with the sandbox.
    drop(TcpListener::bind((Ipv4Addr::LOCALHOST, free)).expect("the port is free again"));
    drop(outside);
}

/// As `assert_refused`, while another sandbox of this runtime is wired (its link and table stay).
fn assert_refused_keeping(rt: &Runtime, s: grove_runtime::SandboxSpec, why: &str) {
    let before = (rt.list().len(), net_footprint(rt));
    let e = rt.create(s).expect_err("a create that must be refused");
    assert_eq!(e.field(), Some("ports[0].host_port"), "{e}");
    assert!(e.to_string().contains(why), "{e} (wanted {why:?})");
    assert_eq!((rt.list().len(), net_footprint(rt)), before);
}

#[test]
fn a_broad_allowlist_never_reaches_other_sandboxes_or_the_host() {
    if !can_run() {
        return;
    }
    let (_serial, rt) = node();
    let mut outside = Outside::new("grove-rtest-seci", "grovetsi0", 215);
    // A host service on every host address.
    outside.servers.push(listener(None, 18003));

    // The attacker may go anywhere; the victims publish nothing, or one port.
    let attacker = rt.create(publishing(31400)).unwrap();
    let mut quiet = spec();
    quiet.network = egress_all();
    let quiet = rt.create(quiet).unwrap();
    let mut closed = spec();
    closed.network = NetworkPolicy::Egress { allow: vec![] };
    let closed = rt.create(closed).unwrap();
    let published = rt.create(publishing(31401)).unwrap();
    for v in [&quiet, &closed, &published, &attacker] {
        serve_in(&rt, &v.id, 9000);
    }

    // The allowlist works: the "internet" answers.
    assert_eq!(connect(&rt, &attacker.id, "10.215.0.2", 8000), "hi");
    // No other sandbox, published or not, whatever its own allowlist.
    for v in [&quiet, &closed, &published] {
        let addr = v.address.clone().unwrap();
        assert_eq!(
            connect(&rt, &attacker.id, &addr, 9000),
            "TimeoutError",
            "sandbox {} at {addr}",
            v.id
        );
    }
    // Nor the other way round, at the attacker's own published port's target.
    let attacker_addr = attacker.address.clone().unwrap();
    assert_eq!(
        connect(&rt, &quiet.id, &attacker_addr, 9000),
        "TimeoutError"
    );
    // No host service: not at the gateway (the host end of its own veth), another sandbox's
    // gateway, or another host address.
    let gateway = |addr: &str| {
        let a: Ipv4Addr = addr.parse().unwrap();
        Ipv4Addr::from(u32::from(a) - 1).to_string()
    };
    for host_addr in [
        gateway(&attacker_addr),
        gateway(quiet.address.as_deref().unwrap()),
        "10.215.0.1".to_string(),
    ] {
        assert_eq!(
            connect(&rt, &attacker.id, &host_addr, 18003),
            "TimeoutError",
            "host service at {host_addr}"
        );
    }
    assert_eq!(
        connect_from_host("10.215.0.1", 18003),
        "hi",
        "the host service itself is up"
    );
    // A published port stays the way in, from outside and from the host.
    let code = "import socket\ntry:\n  s=socket.create_connection(('10.215.0.1',31401),timeout=2); print(s.recv(2).decode())\nexcept Exception as e:\n  print(type(e).__name__)\n";
    assert_eq!(outside.python(code), "hi");
    assert_eq!(connect_from_host("10.215.0.1", 31401), "hi");

    let ids = [&attacker.id, &quiet.id, &closed.id, &published.id];
    for id in ids {
        rt.destroy(id).unwrap();
    }
    for id in ids {
        assert_gone(&rt, id);
    }
    assert_eq!(net_footprint(&rt), (0, false));
    drop(outside);
    assert!(!Path::new("/run/netns/grove-rtest-seci").exists());
}
