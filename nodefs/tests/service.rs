//! The grove-fsd protocol end to end: a server on a socket (in a thread here), a client doing what
//! the daemon does: imports through paths and pipes, refs, streams, mounts that someone else
//! detaches, and typed errors coming back typed.

mod common;

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{fuse_available, tar_of_files};
use nodefs::service::{Client, FsService, ImportPolicy};
use nodefs::{Error, MountOptions};

/// A reader that fails after `n` bytes (an upload cut off).
struct Failing(std::io::Cursor<Vec<u8>>, usize);
impl std::io::Read for Failing {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.0.position() as usize >= self.1 {
            return Err(std::io::Error::other("client went away"));
        }
        let end = buf.len().min(self.1 - self.0.position() as usize);
        self.0.read(&mut buf[..end])
    }
}

#[test]
fn a_client_does_everything_through_the_socket() {
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("nodefs-fsd")
        .tempdir()
        .unwrap();
    let socket = tmp.path().join("fsd.sock");
    let store_dir = tmp.path().join("store");
    {
        let (store_dir, socket) = (store_dir.clone(), socket.clone());
        std::thread::spawn(move || nodefs::service::serve(&store_dir, &socket));
    }
    let t = Instant::now();
    let c = loop {
        match Client::start(&socket, None) {
            Ok(c) => break Arc::new(c),
            Err(_) if t.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("no server: {e}"),
        }
    };
    // A second server on the same socket refuses to start.
    assert!(matches!(
        nodefs::service::serve(&tmp.path().join("other"), &socket),
        Err(nodefs::service::ServeError::AlreadyRunning(_))
    ));

    // A tar through a pipe; a cut-off one and a malformed one fail, typed.
    let tar = tar_of_files(&[("etc/hello", b"hi\n"), ("big", &vec![7u8; 300_000])]);
    let id = c
        .import_tar(&mut std::io::Cursor::new(tar.clone()))
        .unwrap();
    let cut = c.import_tar(&mut Failing(std::io::Cursor::new(tar.clone()), 100_000));
    assert!(matches!(cut, Err(Error::BadStream(_))), "{cut:?}");
    let bad = c.import_tar(&mut std::io::Cursor::new(vec![1u8; 1024]));
    assert!(
        matches!(bad, Err(Error::BadTar { .. } | Error::BadStream(_))),
        "{bad:?}"
    );
    c.set_ref("img", &id).unwrap();
    assert_eq!(c.resolve("img").unwrap(), id);
    assert!(matches!(c.resolve("nope"), Err(Error::UnknownRef(_))));
    assert!(matches!(c.set_ref("../x", &id), Err(Error::BadRefName(_))));
    assert!(c.refs().unwrap().contains(&("img".to_string(), id)));

    // Directories go by path; the policy crosses too.
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("pages-1.img"), vec![3u8; 8192]).unwrap();
    let imgs = c.import_dir(&src, ImportPolicy::CriuImages, None).unwrap();
    let out = tmp.path().join("out");
    c.export_dir(&imgs, &out).unwrap();
    assert_eq!(
        std::fs::read(out.join("pages-1.img")).unwrap(),
        vec![3u8; 8192]
    );

    // Streams: whole, and only what a receiver lacks.
    let mut full = Vec::new();
    c.export_stream(&id, None, &mut full).unwrap();
    let mut none = Vec::new();
    c.export_stream(&id, Some(&HashSet::new()), &mut none)
        .unwrap();
    assert!(
        none.len() < full.len() / 10,
        "{} vs {}",
        none.len(),
        full.len()
    );
    let mut two = full.clone();
    two.extend_from_slice(&full);
    assert_eq!(
        c.import_streams(&mut std::io::Cursor::new(two), 2).unwrap(),
        vec![id, id]
    );
    let objs = c.objects_of(&id).unwrap();
    assert!(c.lacking(&objs).unwrap().is_empty());

    // A mount: write, commit, usage; listed until someone else detaches it, then forgotten.
    let mp = tmp.path().join("mnt");
    std::fs::create_dir_all(&mp).unwrap();
    let opts = MountOptions {
        upper_dir: tmp.path().join("upper"),
        ..Default::default()
    };
    let m = c.mount(&id, &mp, &opts).unwrap();
    assert_eq!(std::fs::read(mp.join("etc/hello")).unwrap(), b"hi\n");
    std::fs::write(mp.join("new"), vec![1u8; 10_000]).unwrap();
    let committed = c.commit(m.id).unwrap();
    assert!(c.usage(m.id).unwrap().bytes >= 10_000);
    assert_eq!(c.mounts().unwrap(), vec![m.clone()]);
    // The committed manifest is pinned by its mount, the image by its ref, the CRIU images by
    // their fresh import: gc keeps every object any of them reaches, and no other (none of
    // these is stored as a delta of something else).
    let reached = c.objects_of(&committed).unwrap();
    let held: HashSet<_> = [&id, &imgs]
        .into_iter()
        .flat_map(|m| c.objects_of(m).unwrap())
        .collect();
    let gc = c.gc(&[]).unwrap();
    let all: HashSet<_> = held.iter().chain(&reached).copied().collect();
    assert_eq!(gc.kept_objects as usize, all.len(), "{gc:?}");
    assert!(c.lacking(&reached).unwrap().is_empty(), "{gc:?}");
    assert!(c.lacking(&objs).unwrap().is_empty(), "{gc:?}");
    // What only the commit reaches: its root tree and the new file's data.
    let only_committed: Vec<_> = reached
        .iter()
        .filter(|o| !held.contains(o))
        .copied()
        .collect();
    assert!(!only_committed.is_empty());
    c.export_dir(&committed, &tmp.path().join("committed"))
        .unwrap();
    assert!(tmp.path().join("committed/new").is_file());
    nix::mount::umount2(&mp, nix::mount::MntFlags::MNT_DETACH).unwrap();
    assert!(
        c.mounts().unwrap().is_empty(),
        "a detached mount is forgotten"
    );
    assert!(!tmp.path().join("upper").exists(), "its upper dir went");
    assert!(matches!(c.commit(m.id), Err(Error::UnknownMount(_))));
    // The mount's pins went with it: a gc now collects exactly what only the commit reached,
    // and keeps the rest.
    let after = c.gc(&[]).unwrap();
    assert_eq!(
        after.removed_objects as usize,
        only_committed.len(),
        "{after:?}"
    );
    assert_eq!(
        after.kept_objects,
        gc.kept_objects - after.removed_objects,
        "{after:?}"
    );
    assert_eq!(c.lacking(&only_committed).unwrap(), only_committed);
    assert!(c.lacking(&objs).unwrap().is_empty(), "{after:?}");
    c.unmount(m.id).unwrap();
    // An id below this server's first one is a mount of a server before it: not this one's
    // to have unmounted, so the caller hears it (and takes a dead kernel mount down itself).
    assert!(m.id > 1);
    assert!(matches!(c.unmount(1), Err(Error::UnknownMount(1))));
    assert!(c.fsck().unwrap().is_clean());
    assert!(!Path::new(&mp).join("etc").exists());
}
