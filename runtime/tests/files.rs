//! Files API, including path traversal and symlink escapes (root).

mod common;

use common::*;
use grove_runtime::Error;

#[test]
fn files_roundtrip_and_escapes() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;

    rt.write_file(&id, "/work/sub/a.txt", b"hello", Some(0o600))
        .unwrap();
    assert_eq!(
        out(&sh(
            &rt,
            &id,
            "cat /work/sub/a.txt; stat -c %a /work/sub/a.txt"
        )),
        "hello600"
    );
    assert_eq!(
        rt.read_file(&id, "work/sub/../sub/a.txt").unwrap(),
        b"hello"
    );
    let ls = rt.list_dir(&id, "/work/sub").unwrap();
    assert_eq!(ls.len(), 1);
    assert_eq!(
        (
            ls[0].name.as_str(),
            ls[0].kind.as_str(),
            ls[0].size,
            ls[0].mode
        ),
        ("a.txt", "file", 5, 0o600)
    );
    // What the sandbox writes to its private /tmp is visible too (the API sees the sandbox's view).
    sh(&rt, &id, "echo inside > /tmp/t");
    assert_eq!(rt.read_file(&id, "/tmp/t").unwrap(), b"inside\n");
    assert!(matches!(
        rt.read_file(&id, "/nope"),
        Err(Error::FileNotFound { .. })
    ));

    // `..` above the root is refused outright.
    assert!(matches!(
        rt.read_file(&id, "../../etc/passwd"),
        Err(Error::PathOutsideSandbox { .. })
    ));
    assert!(matches!(
        rt.write_file(&id, "/tmp/../../x", b"x", None),
        Err(Error::PathOutsideSandbox { .. })
    ));

    // Symlinks pointing out of the sandbox resolve inside it: they never reach a host file.
    // The host has a file at `marker`, its content unique to this run; the sandbox's /tmp is
    // its own, with nothing there.
    let marker = format!("/tmp/grove-rtest-host-{}", std::process::id());
    let secret = format!("HOST SECRET {marker} {:?}", std::time::SystemTime::now());
    std::fs::write(&marker, &secret).unwrap();
    sh(&rt, &id, &format!("ln -s {marker} /tmp/esc; ln -s ../../../../../../{marker} /tmp/esc2; ln -s / /tmp/rootlink"));
    for p in ["/tmp/esc", "/tmp/esc2"] {
        match rt.read_file(&id, p) {
            Err(Error::FileNotFound { .. }) => {}
            other => panic!("{p}: expected not found inside the sandbox, got {other:?}"),
        }
    }
    rt.write_file(&id, "/tmp/esc", b"written inside", None)
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap(),
        secret,
        "host file untouched"
    );
    assert_eq!(
        out(&sh(&rt, &id, &format!("cat {marker}"))),
        "written inside"
    );
    // Read back through either link, and at the path itself: the sandbox's file.
    for p in ["/tmp/esc", "/tmp/esc2", &marker] {
        assert_eq!(rt.read_file(&id, p).unwrap(), b"written inside", "{p}");
    }
    // A link to a path both have (/etc/hostname) leads to the sandbox's file, not the host's.
    let host_hostname = std::fs::read("/etc/hostname").unwrap_or_default();
    let inside = format!("sandbox-of-{}", std::process::id());
    sh(
        &rt,
        &id,
        &format!("echo {inside} > /etc/hostname; ln -s /etc/hostname /tmp/hn"),
    );
    let read = rt.read_file(&id, "/tmp/hn").unwrap();
    assert_eq!(read, format!("{inside}\n").as_bytes());
    assert_ne!(read, host_hostname);
    assert_eq!(
        std::fs::read("/etc/hostname").unwrap_or_default(),
        host_hostname,
        "the host's /etc/hostname untouched"
    );
    // A link to `/` is the sandbox's root: what it leads to is the sandbox's file, never the
    // host's. The host has no /etc/grove-rtest-mark; at the marker's path, the sandbox has the
    // copy written through /tmp/esc above, and the host the secret.
    sh(&rt, &id, "echo sandbox-side > /etc/grove-rtest-mark");
    assert_eq!(
        rt.read_file(&id, "/tmp/rootlink/etc/grove-rtest-mark")
            .unwrap(),
        b"sandbox-side\n"
    );
    assert!(!std::path::Path::new("/etc/grove-rtest-mark").exists());
    assert_eq!(
        rt.read_file(&id, &format!("/tmp/rootlink{marker}"))
            .unwrap(),
        b"written inside"
    );
    std::fs::remove_file(&marker).unwrap();
    // Magic links (/proc/self/root) and the sandbox's /proc are refused.
    assert!(rt.read_file(&id, "/proc/self/root/etc/passwd").is_err());
    assert!(rt.read_file(&id, "/proc/1/environ").is_err());

    // tar upload/download round trip, with a symlink kept as a link.
    let mut buf = Vec::new();
    {
        let mut b = tar::Builder::new(&mut buf);
        let mut h = tar::Header::new_gnu();
        h.set_size(3);
        h.set_mode(0o755);
        b.append_data(&mut h, "bin/run.sh", &b"abc"[..]).unwrap();
        let mut l = tar::Header::new_gnu();
        l.set_entry_type(tar::EntryType::Symlink);
        l.set_size(0);
        b.append_link(&mut l, "bin/link", "/etc/shadow").unwrap();
        b.finish().unwrap();
    }
    rt.upload_tar(&id, "/up", &mut &buf[..]).unwrap();
    assert_eq!(
        out(&sh(
            &rt,
            &id,
            "cat /up/bin/run.sh; stat -c %a /up/bin/run.sh; readlink /up/bin/link"
        )),
        "abc755\n/etc/shadow"
    );
    let mut tarball = Vec::new();
    rt.download_tar(&id, "/up", &mut tarball).unwrap();
    let mut ar = tar::Archive::new(&tarball[..]);
    let mut names: Vec<String> = ar
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().display().to_string())
        .collect();
    names.sort();
    assert_eq!(names, ["bin/", "bin/link", "bin/run.sh"]);

    // A tar member climbing out is refused.
    let mut evil = Vec::new();
    {
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_mode(0o644);
        h.as_gnu_mut().unwrap().name[..17].copy_from_slice(b"../../../../evil\0");
        h.set_cksum();
        evil.extend_from_slice(h.as_bytes());
        evil.extend_from_slice(&[b'x'; 512]);
        evil.extend_from_slice(&[0; 1024]);
    }
    assert!(matches!(
        rt.upload_tar(&id, "/up", &mut &evil[..]),
        Err(Error::PathOutsideSandbox { .. })
    ));

    rt.destroy(&id).unwrap();
    assert!(matches!(
        rt.read_file(&id, "/etc/passwd"),
        Err(Error::NotFound { .. })
    ));
    assert_gone(&rt, &id);
}
