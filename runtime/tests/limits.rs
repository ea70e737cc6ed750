//! What a sandbox's own output and files can make the runtime hold (root): exec output is capped,
//! only regular files are opened, and absurd ttl/cpu values are refused up front.

mod common;

use std::io::Read as _;
use std::time::{Duration, Instant};

use common::*;
use grove_runtime::{Error, ExecRequest, Limits, OutputChunk, DEFAULT_MAX_OUTPUT};

#[test]
fn exec_output_is_capped_and_flagged() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    // 100 MB on stdout, 3 bytes on stderr: stdout keeps the default cap, the command runs to the end.
    let r = sh(
        &rt,
        &id,
        "head -c 100000000 /dev/zero | tr '\\0' a; printf err >&2; exit 7",
    );
    assert_eq!(r.exit_code, Some(7), "the command ran on to its end");
    assert_eq!(r.stdout.len() as u64, DEFAULT_MAX_OUTPUT);
    assert!(r.stdout.iter().all(|b| *b == b'a'));
    assert!(r.stdout_truncated);
    assert_eq!(r.stderr, b"err");
    assert!(!r.stderr_truncated);

    // A request's own cap, per stream; exactly at the cap is not truncated.
    let mut req = ExecRequest::shell("printf 0123456789; printf abcdef >&2");
    req.max_output_bytes = Some(4);
    let r = rt.exec(&id, req).unwrap();
    assert_eq!((&r.stdout[..], r.stdout_truncated), (&b"0123"[..], true));
    assert_eq!((&r.stderr[..], r.stderr_truncated), (&b"abcd"[..], true));
    let mut req = ExecRequest::shell("printf 0123");
    req.max_output_bytes = Some(4);
    let r = rt.exec(&id, req).unwrap();
    assert_eq!((&r.stdout[..], r.stdout_truncated), (&b"0123"[..], false));

    // Streaming with nothing kept still hands every byte to the callback.
    let mut req = ExecRequest::shell("head -c 5000000 /dev/zero");
    req.max_output_bytes = Some(0);
    let mut seen = 0usize;
    let r = rt
        .exec_stream(&id, req, &mut |c| {
            if let OutputChunk::Stdout(d) = c {
                seen += d.len();
            }
        })
        .unwrap();
    assert_eq!(seen, 5_000_000);
    assert!(r.stdout.is_empty());

    let mut req = ExecRequest::shell("true");
    req.max_output_bytes = Some(u64::MAX);
    assert_eq!(
        rt.exec(&id, req).unwrap_err().field(),
        Some("max_output_bytes")
    );
    rt.destroy(&id).unwrap();
}

#[test]
fn only_regular_files_are_opened() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    sh(
        &rt,
        &id,
        "mkfifo /tmp/fifo && mkdir -p /tmp/d && ln -s /tmp/fifo /tmp/to-fifo && printf hi > /tmp/f",
    );
    for p in ["/tmp/fifo", "/tmp/to-fifo", "/dev/null", "/tmp/d"] {
        let t = Instant::now();
        match rt.open_file(&id, p) {
            Err(Error::InvalidSpec { field, reason }) => {
                assert_eq!(field, "path", "{p}: {reason}");
                let want = if p == "/tmp/d" {
                    "directory"
                } else {
                    "not a regular file"
                };
                assert!(reason.contains(want), "{p}: {reason}");
            }
            other => panic!("{p}: expected a refusal, got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(5), "{p} blocked");
        // Writing is refused too, before a FIFO could block the writer.
        let t = Instant::now();
        let w = rt.write_file(&id, p, b"x", None);
        assert!(
            matches!(w, Err(Error::InvalidSpec { .. })),
            "{p}: write gave {w:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{p} write blocked");
    }
    let (mut f, size) = rt.open_file(&id, "/tmp/f").unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    assert_eq!((s.as_str(), size), ("hi", 2));

    // A streamed write that fails half way leaves no new file behind.
    struct Failing(usize);
    impl std::io::Read for Failing {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.0 == 0 {
                return Err(std::io::Error::other("client went away"));
            }
            let n = buf.len().min(self.0);
            buf[..n].fill(b'z');
            self.0 -= n;
            Ok(n)
        }
    }
    assert!(rt
        .write_file_from(&id, "/tmp/partial", &mut Failing(1 << 20), None)
        .is_err());
    assert_eq!(
        sh(&rt, &id, "test -e /tmp/partial").exit_code,
        Some(1),
        "the half-written file was removed"
    );
    let n = rt
        .write_file_from(
            &id,
            "/tmp/whole",
            &mut std::io::repeat(b'q').take(3 << 20),
            None,
        )
        .unwrap();
    assert_eq!(n, 3 << 20);
    assert_eq!(out(&sh(&rt, &id, "stat -c %s /tmp/whole")), "3145728");
    rt.destroy(&id).unwrap();
}

#[test]
fn absurd_ttl_and_cpu_are_refused() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let mut s = spec();
    s.limits = Some(Limits {
        cpu_millis: 1,
        ..Limits::default()
    });
    assert_eq!(rt.create(s).unwrap_err().field(), Some("limits.cpu_millis"));
    for ttl in [
        u64::MAX,
        u64::MAX / 1000 + 1,
        grove_runtime::MAX_TTL_SECS + 1,
    ] {
        let mut s = spec();
        s.ttl_secs = Some(ttl);
        assert_eq!(rt.create(s).unwrap_err().field(), Some("ttl_secs"), "{ttl}");
    }
    // The smallest CPU share the kernel takes works; a re-timed ttl near u64::MAX is refused and a
    // sandbox with a long one is not reaped.
    let mut s = spec();
    s.limits = Some(Limits {
        cpu_millis: grove_runtime::MIN_CPU_MILLIS,
        ..Limits::default()
    });
    s.ttl_secs = Some(grove_runtime::MAX_TTL_SECS);
    let info = rt.create(s).expect("create at the minimums");
    let id = info.id;
    assert!(info.expires_at_ms.unwrap() > info.created_at_ms);
    assert_eq!(
        rt.set_ttl(&id, Some(u64::MAX)).unwrap_err().field(),
        Some("ttl_secs")
    );
    assert!(!rt.reap_expired().contains(&id));
    assert!(rt.get(&id).is_ok());
    rt.destroy(&id).unwrap();
}
