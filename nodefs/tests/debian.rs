//! A real Debian userland on nodefs: import the base image once, chroot into a writable
//! mount, run git, python and dpkg, then commit and check the result.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use common::*;
use nodefs::MountOptions;

const IMAGE: &str = "/var/lib/grove/images/debian12";

/// Run `script` with sh inside a chroot at `root`, in a private mount namespace that has
/// /proc and /dev (those mounts die with the namespace).
fn in_chroot(root: &Path, script: &str) -> String {
    let r = root.display();
    let outer = format!(
        "set -e; mount -t proc proc {r}/proc; mount --rbind /dev {r}/dev; \
         exec chroot {r} /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 /bin/sh -ec \"$0\""
    );
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &outer, script])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "chroot script failed: {script}\nstdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn build_deb(dir: &Path) -> std::path::PathBuf {
    let pkg = dir.join("pkg");
    fs::create_dir_all(pkg.join("DEBIAN")).unwrap();
    fs::create_dir_all(pkg.join("usr/share/grove-nodefs-test")).unwrap();
    fs::write(
        pkg.join("DEBIAN/control"),
        "Package: grove-nodefs-test\nVersion: 1.0\nArchitecture: all\nMaintainer: grove <grove@example.invalid>\nDescription: nodefs test package\n",
    )
    .unwrap();
    fs::write(
        pkg.join("usr/share/grove-nodefs-test/hello.txt"),
        "hello from a deb\n",
    )
    .unwrap();
    let deb = dir.join("grove-nodefs-test.deb");
    let st = Command::new("dpkg-deb")
        .args(["--root-owner-group", "--build"])
        .arg(&pkg)
        .arg(&deb)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    deb
}

#[test]
fn debian_userland_runs_on_nodefs() {
    if !fuse_available() {
        return;
    }
    if !Path::new(IMAGE).join("usr/bin/git").exists() {
        capability_missing(&format!(
            "base image {IMAGE} not present (run scripts/setup)"
        ));
        return;
    }
    let env = Env::new();
    let t = Instant::now();
    let id = env.store.import_dir(Path::new(IMAGE)).unwrap();
    let st = env.store.stats();
    eprintln!(
        "imported {IMAGE} in {:?}: {} chunks, {} MB logical, {} MB stored",
        t.elapsed(),
        st.chunks,
        st.logical_bytes >> 20,
        st.stored_bytes >> 20
    );
    let t = Instant::now();
    assert_eq!(env.store.import_dir(Path::new(IMAGE)).unwrap(), id);
    let st2 = env.store.stats();
    eprintln!(
        "re-import took {:?}, added {} bytes",
        t.elapsed(),
        st2.stored_bytes - st.stored_bytes
    );
    assert!(st2.stored_bytes - st.stored_bytes < 4096);

    let deb = build_deb(env.tmp.path());
    let m = env.mount(&id, "root", MountOptions::default());
    let root = m.mountpoint().to_path_buf();
    fs::copy(&deb, root.join("tmp/grove-nodefs-test.deb")).unwrap();

    let t = Instant::now();
    in_chroot(&root, "python3 -c 'import json, email, http.client'");
    eprintln!("python3 imports (cold): {:?}", t.elapsed());

    let log = in_chroot(
        &root,
        "mkdir -p /root/repo && cd /root/repo && git init -q && git config user.email t@example.invalid \
         && git config user.name t && echo hello > README && mkdir src && seq 1 1000 > src/n.txt \
         && git add -A && git commit -qm first && echo more >> README && git commit -qam second \
         && git log --oneline && git fsck --no-progress",
    );
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("first") || l.contains("second"))
            .count(),
        2,
        "{log}"
    );

    in_chroot(&root, "dpkg -i /tmp/grove-nodefs-test.deb >/dev/null && dpkg -s grove-nodefs-test | grep -q 'Status: install ok installed'");
    assert_eq!(
        fs::read_to_string(root.join("usr/share/grove-nodefs-test/hello.txt")).unwrap(),
        "hello from a deb\n"
    );
    // apt on top of dpkg: remove the package, then install it again from the local file (no
    // network: the package has no dependencies).
    in_chroot(
        &root,
        "apt-get remove -y -q grove-nodefs-test >/dev/null \
         && ! test -e /usr/share/grove-nodefs-test/hello.txt \
         && apt-get install -y -q /tmp/grove-nodefs-test.deb >/dev/null \
         && dpkg -s grove-nodefs-test | grep -q 'Status: install ok installed'",
    );
    assert_eq!(
        fs::read_to_string(root.join("usr/share/grove-nodefs-test/hello.txt")).unwrap(),
        "hello from a deb\n"
    );

    // gcc (the host's: the base image has none) compiles a source kept on the mount into a
    // binary on the mount (temp files, rename, mmap of the output), which then runs from it.
    if Path::new("/usr/bin/gcc").exists() {
        fs::write(
            root.join("root/hello.c"),
            "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 6 * 7); return 0; }\n",
        )
        .unwrap();
        run_ok(
            Command::new("gcc")
                .args(["-O2", "-o"])
                .arg(root.join("root/hello"))
                .arg(root.join("root/hello.c"))
                .env("TMPDIR", root.join("tmp")),
        );
        assert_eq!(
            run_ok(&mut Command::new(root.join("root/hello"))).trim(),
            "42"
        );
    } else {
        capability_missing("gcc not installed on the host");
    }

    let t = Instant::now();
    let c = m.commit().unwrap();
    eprintln!("commit after the workload: {:?}", t.elapsed());
    // The snapshot holds the workload's results; a fresh mount of it sees them.
    let v = env.mount(
        &c,
        "view",
        MountOptions {
            read_only: true,
            ..Default::default()
        },
    );
    assert!(v.mountpoint().join("root/repo/.git/HEAD").exists());
    assert_eq!(
        fs::read_to_string(v.mountpoint().join("usr/share/grove-nodefs-test/hello.txt")).unwrap(),
        "hello from a deb\n"
    );
    let status = fs::read_to_string(v.mountpoint().join("var/lib/dpkg/status")).unwrap();
    assert!(status.contains("Package: grove-nodefs-test"));
    in_chroot(
        v.mountpoint(),
        "cd /root/repo && git log --oneline | grep -q second",
    );
    // The base image itself is untouched.
    assert!(!Path::new(IMAGE)
        .join("usr/share/grove-nodefs-test")
        .exists());
}

/// Python source that writes a minimal wheel (a zip with the module and its dist-info).
const MAKE_WHEEL: &str = r#"
import base64, hashlib, sys, zipfile
out = sys.argv[1]
files = {
    "grove_nodefs_probe/__init__.py": "VALUE = 'installed on nodefs'\n",
    "grove_nodefs_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: grove-nodefs-probe\nVersion: 1.0\n",
    "grove_nodefs_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: grove-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = []
with zipfile.ZipFile(out, "w") as z:
    for name, text in files.items():
        data = text.encode()
        z.writestr(name, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("grove_nodefs_probe-1.0.dist-info/RECORD,,")
    z.writestr("grove_nodefs_probe-1.0.dist-info/RECORD", "\n".join(record) + "\n")
"#;

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// pip inside a mount: a venv (pip itself unpacked into it by ensurepip), then `pip install`
/// of a local wheel, then the package imports, and a commit keeps it.
#[test]
fn pip_installs_a_local_wheel_into_a_mount() {
    if !fuse_available() {
        return;
    }
    if !host_python_has_venv() {
        capability_missing("host python3 lacks the venv/ensurepip modules (python3-venv)");
        return;
    }
    let env = Env::new();
    let id = env.empty();
    let m = env.mount(&id, "m", MountOptions::default());
    let venv = m.mountpoint().join("venv");
    let wheel = env.path("grove_nodefs_probe-1.0-py3-none-any.whl");
    run_ok(Command::new("python3").args(["-c", MAKE_WHEEL]).arg(&wheel));
    let t = Instant::now();
    run_ok(Command::new("python3").args(["-m", "venv"]).arg(&venv));
    eprintln!("venv with pip on nodefs: {:?}", t.elapsed());
    run_ok(
        Command::new(venv.join("bin/pip"))
            .args([
                "install",
                "--no-index",
                "--no-deps",
                "--disable-pip-version-check",
                "-q",
            ])
            .arg(&wheel),
    );
    let got = run_ok(Command::new(venv.join("bin/python")).args([
        "-c",
        "import grove_nodefs_probe; print(grove_nodefs_probe.VALUE)",
    ]));
    assert_eq!(got.trim(), "installed on nodefs");
    let listed = run_ok(Command::new(venv.join("bin/pip")).args([
        "list",
        "--disable-pip-version-check",
        "--format=freeze",
    ]));
    assert!(listed.contains("grove-nodefs-probe==1.0"), "{listed}");
    // The snapshot holds the installed package.
    let c = m.commit().unwrap();
    let v = env.mount(
        &c,
        "view",
        MountOptions {
            read_only: true,
            ..Default::default()
        },
    );
    let site: Vec<_> = fs::read_dir(v.mountpoint().join("venv/lib"))
        .unwrap()
        .flatten()
        .map(|e| {
            e.path()
                .join("site-packages/grove_nodefs_probe/__init__.py")
        })
        .filter(|p| p.exists())
        .collect();
    assert_eq!(site.len(), 1, "the package is in the committed venv");
}

fn host_python_has_venv() -> bool {
    Command::new("python3")
        .args(["-c", "import venv, ensurepip"])
        .output()
        .is_ok_and(|o| o.status.success())
}
