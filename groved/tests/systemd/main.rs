//! groved as a systemd service. On the host: the unit passes `systemd-analyze verify` and `grove install`
//! places binaries, unit, tmpfiles.d entry and config (keeping an existing config). Under a real systemd
//! (PID 1 of a systemd-nspawn container; PID 1 here is not systemd): the service is active only after
//! READY=1, and a hung daemon is restarted by the watchdog.

mod container;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use container::{Container, BASE_IMAGE, BUILD};

/// One container at a time: nspawn's host-side cgroups (`payload`, `supervisor`) have fixed names.
static NSPAWN: Mutex<()> = Mutex::new(());

use grove_testkit::capability_missing;

fn build_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_groved"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn scratch() -> tempfile::TempDir {
    // Not /tmp: the binaries are large, and tests leave nothing in /tmp even when killed.
    tempfile::Builder::new()
        .prefix("grove-systemd-test-")
        .tempdir_in("/var/tmp")
        .unwrap()
}

fn run(cmd: &mut Command) -> String {
    let o = cmd.stdin(Stdio::null()).output().unwrap();
    assert!(
        o.status.success(),
        "{cmd:?}: {}\n{}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

#[test]
fn install_places_everything_and_the_unit_verifies() {
    let t = scratch();
    let root = t.path().join("root");
    let grove = PathBuf::from(env!("CARGO_BIN_EXE_grove"));
    let install = || {
        run(Command::new(&grove)
            .args(["install", "--root"])
            .arg(&root)
            .arg("--from")
            .arg(build_dir()))
    };
    install();
    for p in [
        "usr/local/bin/groved",
        "usr/local/bin/grove",
        "usr/local/libexec/grove/grove-init",
        "usr/local/libexec/grove/grove-fsd",
        "etc/systemd/system/groved.service",
        "etc/tmpfiles.d/grove.conf",
        "etc/grove/groved.toml",
    ] {
        assert!(root.join(p).is_file(), "{p} not installed");
    }
    // A second install (an upgrade) keeps the operator's config.
    let config = root.join("etc/grove/groved.toml");
    std::fs::write(&config, "state_dir = \"/srv/grove\"\n").unwrap();
    let out = install();
    assert!(out.contains("kept"), "{out}");
    assert_eq!(
        std::fs::read_to_string(&config).unwrap(),
        "state_dir = \"/srv/grove\"\n"
    );

    // The unit as installed, pointed at the installed groved so verify can check ExecStart.
    let unit = std::fs::read_to_string(root.join("etc/systemd/system/groved.service")).unwrap();
    let groved = root.join("usr/local/bin/groved");
    let check = t.path().join("verify");
    std::fs::create_dir(&check).unwrap();
    std::fs::write(
        check.join("groved.service"),
        unit.replace("/usr/local/bin/groved", &groved.to_string_lossy()),
    )
    .unwrap();
    let out = run(Command::new("systemd-analyze")
        .arg("verify")
        .arg(check.join("groved.service")));
    assert!(
        !out.contains("groved.service"),
        "systemd-analyze verify complains:\n{out}"
    );
    for (p, want) in [
        ("Type", "notify"),
        ("KillMode", "process"),
        ("Delegate", "yes"),
        ("TasksMax", "infinity"),
        ("Restart", "always"),
    ] {
        assert!(
            unit.lines().any(|l| l == format!("{p}={want}")),
            "unit lacks {p}={want}"
        );
    }

    // The tmpfiles.d entry applies: it creates the directories under the root.
    run(Command::new("systemd-tmpfiles")
        .arg("--create")
        .arg(format!("--root={}", root.display()))
        .arg(root.join("etc/tmpfiles.d/grove.conf")));
    for d in ["run/grove", "var/lib/grove", "etc/grove"] {
        assert!(root.join(d).is_dir(), "tmpfiles did not create /{d}");
    }
}

/// The config groved gets inside the container: its own cgroup root and address pool, so it cannot
/// touch the host's Grove (the container shares the host's cgroup hierarchies).
fn container_config(extra: &str) -> String {
    format!(
        "cgroup_root = \"{}\"\nnet_pool = \"10.218.0.0/16\"\n{extra}[capacity]\nsandboxes = 8\n",
        container::cgroup_root()
    )
}

/// Boots the container and writes groved's config and a drop-in for the unit before `grove install`.
fn boot_with(config: &str, dropin: &str) -> (Container, tempfile::TempDir) {
    let t = scratch();
    let c = Container::boot(&build_dir(), t.path().join("nspawn.log"));
    c.write("/etc/grove/groved.toml", &container_config(config));
    if !dropin.is_empty() {
        c.write("/etc/systemd/system/groved.service.d/test.conf", dropin);
    }
    (c, t)
}

fn health_answers(c: &Container, within: Duration) -> bool {
    let socket = c.host_path("/run/grove/groved.sock");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = groved::client::Client::new(socket);
        let call = client.call(hyper::Method::GET, "/v1/health", None);
        matches!(tokio::time::timeout(within, call).await, Ok(Ok(_)))
    })
}

#[test]
fn under_systemd_active_only_after_ready_and_the_watchdog_restarts_a_hung_daemon() {
    let _one = NSPAWN.lock().unwrap_or_else(|e| e.into_inner());
    if !Path::new("/usr/bin/systemd-nspawn").exists() {
        capability_missing(
            "systemd-nspawn is not installed (scripts/setup installs systemd-container)",
        );
        return;
    }
    let (c, _t) = boot_with(
        "",
        "[Service]\n\
         Environment=GROVED_DEBUG_HOOKS=ready-delay-ms=2500,hang-on-sigusr2\n\
         WatchdogSec=4s\n\
         LimitCORE=0\n",
    );

    // `grove install` enables and (re)starts the unit; meanwhile groved serves on its socket for 2.5 s
    // before READY=1, and the unit must stay "activating" all that time.
    let mut install = Command::new("nsenter")
        .args(["-t", &c.pid1.to_string(), "-a", "--"])
        .arg(format!("{BUILD}/grove"))
        .args(["install", "--from", BUILD])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let mut serving_while_activating = false;
    let mut active_early = false;
    while install.try_wait().unwrap().is_none() {
        assert!(t.elapsed() < Duration::from_secs(60), "grove install hangs");
        let state = c.prop("groved", "ActiveState");
        if state == "activating" && health_answers(&c, Duration::from_secs(1)) {
            serving_while_activating = true;
        }
        if state == "active" && !serving_while_activating {
            active_early = true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = install.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "grove install: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        serving_while_activating,
        "never saw the API answering while the unit was still activating"
    );
    assert!(
        !active_early,
        "the unit was active before groved said READY=1"
    );
    assert_eq!(c.prop("groved", "ActiveState"), "active");
    assert_eq!(c.prop("groved", "Type"), "notify");
    assert!(health_answers(&c, Duration::from_secs(5)));

    // Hang the daemon: its API stops answering, the watchdog stops being pinged, systemd kills and
    // restarts it.
    let pid = c.prop("groved", "MainPID");
    let restarts: u32 = c.prop("groved", "NRestarts").parse().unwrap();
    c.ok(&format!("kill -USR2 {pid}"));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !health_answers(&c, Duration::from_secs(1)),
        "groved still answers after the hang hook"
    );
    c.wait_until(
        "the watchdog to restart groved",
        Duration::from_secs(40),
        |c| {
            let now: u32 = c.prop("groved", "NRestarts").parse().unwrap_or(0);
            now > restarts
                && c.prop("groved", "MainPID") != pid
                && c.prop("groved", "ActiveState") == "active"
        },
    );
    let journal = c.ok("journalctl -u groved --no-pager");
    assert!(
        journal.contains("Watchdog timeout"),
        "restart not caused by the watchdog:\n{journal}"
    );
    assert!(health_answers(&c, Duration::from_secs(5)));

    // An orderly stop: groved drains and exits 0.
    c.ok("systemctl stop groved");
    assert_eq!(c.prop("groved", "Result"), "success");
}

/// `systemctl restart groved` keeps sandboxes running: with `keep_sandboxes_on_stop` SIGTERM leaves them,
/// and the new daemon adopts them (their init and root alive, records intact), on overlay and nodefs roots.
#[test]
fn systemctl_restart_keeps_sandboxes_running() {
    let _one = NSPAWN.lock().unwrap_or_else(|e| e.into_inner());
    if !Path::new("/usr/bin/systemd-nspawn").exists() {
        capability_missing(
            "systemd-nspawn is not installed (scripts/setup installs systemd-container)",
        );
        return;
    }
    // Kernel overlayfs roots outlive groved by themselves; nodefs roots because grove-fsd serves
    // them, outside what a restart stops (KillMode=process).
    for root in ["overlay", "nodefs"] {
        restart_keeps_a_sandbox(root);
    }
}

fn restart_keeps_a_sandbox(root: &str) {
    let (c, _t) = boot_with(
        &format!("root_provider = \"{root}\"\nkeep_sandboxes_on_stop = true\n"),
        "",
    );
    let grove = format!("{BUILD}/grove");
    c.ok(&format!("{grove} install --from {BUILD}"));
    if root == "nodefs" {
        c.ok(&format!("{grove} images import debian12 {BASE_IMAGE}"));
    }
    // Overlay images are directories under <state_dir>/images: the bind-mounted base image is one.
    let id = c.ok(&format!("{grove} create debian12"));
    c.ok(&format!(
        "{grove} exec {id} -- sh -c 'echo before >/state; setsid nohup sleep 1000 >/dev/null 2>&1 &'"
    ));
    let pid = c.prop("groved", "MainPID");

    c.ok("systemctl restart groved");
    assert_ne!(
        c.prop("groved", "MainPID"),
        pid,
        "groved was not restarted ({root})"
    );
    assert_eq!(c.prop("groved", "ActiveState"), "active");
    let ls = c.ok(&format!("{grove} ls -q"));
    assert!(
        ls.lines().any(|l| l.trim() == id),
        "{id} is gone after the restart ({root}): {ls}"
    );
    assert_eq!(c.ok(&format!("{grove} exec {id} -- cat /state")), "before");
    let ps = c.ok(&format!("{grove} exec {id} -- ps -e -o args"));
    assert!(
        ps.contains("sleep 1000"),
        "the sandbox's daemon did not survive ({root}):\n{ps}"
    );

    c.ok(&format!("{grove} rm {id}"));
    c.ok("systemctl stop groved");
    assert_eq!(c.prop("groved", "Result"), "success");
    // With no sandbox left, the stop took grove-fsd down too.
    let fsd = c.ok(
        "for i in $(seq 20); do n=$(grep -lx grove-fsd /proc/[0-9]*/comm 2>/dev/null | wc -l); \
         [ $n = 0 ] && break; sleep 0.1; done; echo $n",
    );
    assert_eq!(
        fsd.trim(),
        "0",
        "grove-fsd outlived an orderly stop ({root})"
    );
    eprintln!("systemctl restart kept a sandbox on {root} roots");
}
