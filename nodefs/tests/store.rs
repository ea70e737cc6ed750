//! Content store: roundtrip, dedup, reproducibility, integrity, tar, gc, streams.

mod common;

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::process::Command;
use std::sync::Arc;

use common::*;
use nodefs::{ChunkPolicy, Error, ObjectId, Store, StoreError};

fn diff_trees(a: &std::path::Path, b: &std::path::Path) {
    compare_trees(a, b);
}

#[test]
fn roundtrip_and_dedup() {
    let env = Env::new();
    let src = env.path("src");
    make_tree(&src, 1);
    let id = env.store.import_dir(&src).unwrap();
    let s1 = env.store.stats();
    assert!(s1.chunks > 10, "{s1:?}");
    assert!(env.store.contains(&id));
    // Importing the same tree again adds (almost) nothing.
    let id2 = env.store.import_dir(&src).unwrap();
    assert_eq!(id, id2);
    let s2 = env.store.stats();
    assert_eq!(s1.chunks, s2.chunks);
    assert!(s2.stored_bytes - s1.stored_bytes < 1024, "{s1:?} {s2:?}");

    let out = env.path("out");
    env.store.export_dir(&id, &out).unwrap();
    diff_trees(&src, &out);
    let a = fs::metadata(out.join("small.txt")).unwrap();
    let b = fs::metadata(out.join("a/b/hard.txt")).unwrap();
    assert_eq!(a.ino(), b.ino(), "hard link preserved");
    assert!(fs::symlink_metadata(out.join("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(
        fs::symlink_metadata(out.join("a/big.bin")).unwrap().mtime(),
        fs::symlink_metadata(src.join("a/big.bin")).unwrap().mtime()
    );
    assert_eq!(
        env.store.manifest_bytes(&id).unwrap(),
        13 + (3 << 20) + 300_000
    );
}

#[test]
fn a_store_has_one_instance_and_one_process() {
    let env = Env::new();
    let again = Store::open(&env.path("store")).unwrap();
    assert!(std::sync::Arc::ptr_eq(&again, &env.store));
    // Another process cannot open it while we hold it.
    let out = Command::new("flock")
        .args(["-n"])
        .arg(env.path("store/LOCK"))
        .arg("true")
        .status()
        .unwrap();
    assert!(!out.success(), "the store lock is held");
}

#[test]
fn same_tree_same_root_hash() {
    let env = Env::new();
    let (a, b) = (env.path("a"), env.path("b"));
    make_tree(&a, 7);
    make_tree(&b, 7);
    // Same mtimes on both sides.
    Command::new("touch")
        .args(["-h", "-d", "2020-01-01"])
        .args(walk(&a))
        .status()
        .unwrap();
    Command::new("touch")
        .args(["-h", "-d", "2020-01-01"])
        .args(walk(&b))
        .status()
        .unwrap();
    let other = Store::open(&env.path("store2")).unwrap();
    let ia = env.store.import_dir(&a).unwrap();
    let ib = other.import_dir(&b).unwrap();
    assert_eq!(ia, ib);
    fs::write(b.join("small.txt"), b"changed").unwrap();
    assert_ne!(ia, other.import_dir(&b).unwrap());
}

fn walk(p: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut v = vec![p.to_path_buf()];
    for e in fs::read_dir(p).unwrap().flatten() {
        if e.file_type().unwrap().is_dir() {
            v.extend(walk(&e.path()));
        } else {
            v.push(e.path());
        }
    }
    v
}

#[test]
fn fixed_chunking_dedups_pages() {
    let env = Env::new();
    let src = env.path("src");
    fs::create_dir_all(&src).unwrap();
    let page = random_bytes(3, 4096);
    let mut data = Vec::new();
    for i in 0..64 {
        data.extend_from_slice(if i % 2 == 0 { &page } else { &[0u8; 4096][..] });
    }
    fs::write(src.join("pages-1.img"), &data).unwrap();
    let id = env
        .store
        .import_dir_with(&src, &|p| {
            if p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("pages-")
            {
                ChunkPolicy::Fixed(4096)
            } else {
                ChunkPolicy::Cdc
            }
        })
        .unwrap();
    assert_eq!(env.store.stats().chunks, 2, "two distinct pages");
    let out = env.path("out");
    env.store.export_dir(&id, &out).unwrap();
    assert_eq!(fs::read(out.join("pages-1.img")).unwrap(), data);
}

#[test]
fn corrupt_chunk_is_named_never_wrong_bytes() {
    let env = Env::new();
    let src = env.path("src");
    fs::create_dir_all(&src).unwrap();
    let data = random_bytes(9, 200_000);
    fs::write(src.join("f"), &data).unwrap();
    let id = env.store.import_dir(&src).unwrap();
    env.store.set_ref("img", &id).unwrap();
    let Env { tmp, store, fs } = env;
    drop(fs);
    let store_dir = tmp.path().join("store");
    drop(store);
    // Flip a byte in the middle of the pack (inside some chunk payload).
    let pack = fs::read_dir(store_dir.join("packs"))
        .unwrap()
        .flatten()
        .next()
        .unwrap()
        .path();
    let mut bytes = fs::read(&pack).unwrap();
    let mid = bytes.len() / 3;
    bytes[mid] ^= 0xff;
    fs::write(&pack, &bytes).unwrap();
    let store = Store::open(&store_dir).unwrap();
    let rep = store.fsck().unwrap();
    assert!(!rep.is_clean(), "fsck must find the damage");
    let bad = rep.bad[0].0;
    let out = tmp.path().join("out");
    let err = store.export_dir(&id, &out).unwrap_err();
    let msg = format!("{err}");
    assert!(msg.contains(&bad.to_hex()), "error names the object: {msg}");
    assert!(
        matches!(err, Error::Store(StoreError::Corrupt { .. })),
        "{err:?}"
    );
}

#[test]
fn truncated_pack_tail_is_cut_at_open() {
    let mut env = Env::new();
    let src = env.path("src");
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("f"), random_bytes(4, 100_000)).unwrap();
    let id = env.store.import_dir(&src).unwrap();
    env.store.set_ref("keep", &id).unwrap();
    let dir = env.path("store");
    let pack = fs::read_dir(dir.join("packs"))
        .unwrap()
        .flatten()
        .next()
        .unwrap()
        .path();
    let len = fs::metadata(&pack).unwrap().len();
    // A torn append: half a header of garbage.
    let mut f = fs::OpenOptions::new().append(true).open(&pack).unwrap();
    std::io::Write::write_all(&mut f, b"GRVRgarbage").unwrap();
    drop(f);
    env.reopen();
    assert_eq!(fs::metadata(&pack).unwrap().len(), len);
    assert!(env.store.fsck().unwrap().is_clean());
    // A missing chunk (pack truncated into the last record) is named, not garbage.
    let f = fs::OpenOptions::new().write(true).open(&pack).unwrap();
    f.set_len(len - 10).unwrap();
    env.reopen();
    let _ = &dir;
    let rep = env.store.fsck().unwrap();
    assert!(!rep.is_clean());
    assert!(rep.bad[0].1.contains("missing"), "{:?}", rep.bad);
}

#[test]
fn damaged_header_mid_pack_does_not_cut_later_records() {
    let mut env = Env::new();
    let (a, b) = (env.path("a"), env.path("b"));
    fs::create_dir_all(&a).unwrap();
    fs::create_dir_all(&b).unwrap();
    fs::write(a.join("f"), random_bytes(21, 100_000)).unwrap();
    let ia = env.store.import_dir(&a).unwrap();
    let pack = fs::read_dir(env.path("store/packs"))
        .unwrap()
        .flatten()
        .next()
        .unwrap()
        .path();
    let first_end = fs::metadata(&pack).unwrap().len();
    fs::write(b.join("g"), random_bytes(22, 100_000)).unwrap();
    let ib = env.store.import_dir(&b).unwrap();
    let len = fs::metadata(&pack).unwrap().len();
    // Flip a byte in the header of the first record (offset 8 is where records start).
    let mut bytes = fs::read(&pack).unwrap();
    bytes[8 + 20] ^= 0xff;
    fs::write(&pack, &bytes).unwrap();
    env.reopen();
    assert_eq!(fs::metadata(&pack).unwrap().len(), len, "nothing was cut");
    assert!(first_end < len);
    // The second import is intact; the first names its missing object.
    env.store.export_dir(&ib, &env.path("out-b")).unwrap();
    let err = env.store.export_dir(&ia, &env.path("out-a")).unwrap_err();
    assert!(format!("{err}").contains("missing"), "{err}");
}

#[test]
fn refs_are_durable_and_validated() {
    let mut env = Env::new();
    let id = env.empty();
    env.store.set_ref("images/base", &id).unwrap();
    assert_eq!(env.store.get_ref("images/base").unwrap(), Some(id));
    assert_eq!(env.store.resolve("images/base").unwrap(), id);
    assert_eq!(env.store.resolve(&id.to_hex()).unwrap(), id);
    assert!(env.store.resolve("nope").is_err());
    assert!(matches!(
        env.store.set_ref("../x", &id),
        Err(Error::BadRefName(_))
    ));
    assert!(env.store.set_ref("x", &ObjectId([7; 32])).is_err());
    env.reopen();
    assert_eq!(
        env.store.refs().unwrap(),
        vec![("images/base".to_string(), id)]
    );
    env.store.delete_ref("images/base").unwrap();
    assert_eq!(env.store.get_ref("images/base").unwrap(), None);
}

fn tar_of(dir: &std::path::Path) -> Vec<u8> {
    let out = Command::new("tar")
        .arg("-C")
        .arg(dir)
        .args(["--xattrs", "-cf", "-", "."])
        .output()
        .unwrap();
    assert!(out.status.success());
    out.stdout
}

#[test]
fn tar_import_matches_dir_import() {
    let env = Env::new();
    let src = env.path("src");
    make_tree(&src, 5);
    let t = tar_of(&src);
    let id = env.store.import_tar(&mut &t[..]).unwrap();
    let out = env.path("out");
    env.store.export_dir(&id, &out).unwrap();
    diff_trees(&src, &out);
    assert_eq!(
        fs::metadata(out.join("small.txt")).unwrap().ino(),
        fs::metadata(out.join("a/b/hard.txt")).unwrap().ino()
    );
}

#[test]
fn malformed_tar_names_the_entry() {
    let env = Env::new();
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(3);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    // Write the raw name so tar-rs does not refuse it on our side.
    h.as_gnu_mut().unwrap().name[..13].copy_from_slice(b"../escape.txt");
    h.set_cksum();
    b.append(&h, &b"abc"[..]).unwrap();
    let data = b.into_inner().unwrap();
    match env.store.import_tar(&mut &data[..]) {
        Err(Error::BadTar { entry, .. }) => assert!(entry.contains("escape.txt"), "{entry}"),
        other => panic!("expected BadTar, got {other:?}"),
    }
    // Truncated content.
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_path("short.bin").unwrap();
    h.set_size(100_000);
    h.set_cksum();
    let mut data = Vec::new();
    b.append(&h, &random_bytes(1, 100_000)[..]).unwrap();
    data.extend_from_slice(&b.into_inner().unwrap()[..50_000]);
    let err = env.store.import_tar(&mut &data[..]).unwrap_err();
    assert!(format!("{err}").contains("short.bin"), "{err}");
}

#[test]
fn gc_drops_unreferenced_and_keeps_live() {
    let mut env = Env::new();
    let (a, b) = (env.path("a"), env.path("b"));
    fs::create_dir_all(&a).unwrap();
    fs::create_dir_all(&b).unwrap();
    fs::write(a.join("f"), random_bytes(1, 500_000)).unwrap();
    fs::write(b.join("g"), random_bytes(2, 500_000)).unwrap();
    let ia = env.store.import_dir(&a).unwrap();
    let ib = env.store.import_dir(&b).unwrap();
    env.store.set_ref("a", &ia).unwrap();
    // `b` was named, then deleted: nothing holds it.
    env.store.set_ref("b", &ib).unwrap();
    env.store.delete_ref("b").unwrap();
    let before = env.store.stats();
    let rep = env.store.gc(&[]).unwrap();
    assert!(rep.removed_objects > 0);
    let after = env.store.stats();
    assert!(
        after.stored_bytes + 400_000 < before.stored_bytes,
        "{before:?} {after:?}"
    );
    assert!(!env.store.contains(&ib));
    assert!(env.store.fsck().unwrap().is_clean());
    env.store.export_dir(&ia, &env.path("out")).unwrap();
    // `live` roots survive.
    let ib = env.store.import_dir(&b).unwrap();
    env.store.gc(&[ib]).unwrap();
    assert!(env.store.contains(&ib));
    // gc's pack gets an idx (derived data: `<pack>.idx`); no idx outlives its pack.
    let names = |dir: &std::path::Path, ext: &str| -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter_map(|n| n.strip_suffix(ext).map(str::to_owned))
            .collect();
        v.sort();
        v
    };
    let packs_dir = env.path("store/packs");
    let (packs, idx) = (names(&packs_dir, ".pack"), names(&packs_dir, ".idx"));
    assert_eq!(packs.len(), 1, "{packs:?}");
    assert_eq!(idx, packs, "one idx, for the one compacted pack");
    // A reopened store sees the compacted packs.
    env.reopen();
    assert!(env.store.contains(&ia) && env.store.contains(&ib));
    assert!(env.store.fsck().unwrap().is_clean());
}

/// A large file gets a whole-file object in `<store>/cache` at import (passthrough serves it
/// from there); gc keeps the objects of live files and drops only those of collected ones.
#[test]
fn fsck_beside_a_gc_sees_no_damage() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let env = Env::new();
    let dir = env.path("d");
    fs::create_dir_all(&dir).unwrap();
    // A tree for fsck to walk, so its walk takes a while.
    let base = env.path("base");
    make_tree(&base, 1);
    let held = env.store.import_dir(&base).unwrap();
    env.store.set_ref("held", &held).unwrap();
    let store = env.store.clone();
    let rounds = Arc::new(AtomicU64::new(0));
    // Name an image, drop it, collect it: over and over, while fsck walks beside it.
    let churn = {
        let (store, rounds) = (store.clone(), rounds.clone());
        std::thread::spawn(move || {
            for i in 0..30 {
                fs::write(dir.join("f"), random_bytes(i, 300_000)).unwrap();
                let id = store.import_dir(&dir).unwrap();
                store.set_ref("churn", &id).unwrap();
                store.delete_ref("churn").unwrap();
                store.gc(&[]).unwrap();
                rounds.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let mut walks = 0;
    while rounds.load(Ordering::Relaxed) < 30 {
        let rep = store.fsck().unwrap();
        assert!(rep.is_clean(), "after {walks} walks: {rep:?}");
        walks += 1;
    }
    churn.join().unwrap();
    assert!(walks > 1, "fsck never ran beside gc");
}

#[test]
fn gc_keeps_cache_objects_of_live_files() {
    let env = Env::new();
    let block = random_bytes(21, 1 << 20);
    // 64 MiB (the size that gets its object at import) of mostly repeated, dedupable content.
    let big = |seed: u8| -> Vec<u8> {
        (0..64u8)
            .flat_map(|i| {
                let mut b = block.clone();
                b[..2].copy_from_slice(&[seed, i]);
                b
            })
            .collect()
    };
    let cached = || -> Vec<Vec<u8>> {
        let mut v: Vec<_> = fs::read_dir(env.store.dir().join("cache"))
            .unwrap()
            .map(|e| fs::read(e.unwrap().path()).unwrap())
            .collect();
        v.sort();
        v
    };
    let (a, b) = (env.path("a"), env.path("b"));
    fs::create_dir_all(&a).unwrap();
    fs::create_dir_all(&b).unwrap();
    let (da, db) = (big(1), big(2));
    fs::write(a.join("big"), &da).unwrap();
    fs::write(b.join("big"), &db).unwrap();
    let ia = env.store.import_dir(&a).unwrap();
    let ib = env.store.import_dir(&b).unwrap();
    assert_eq!(
        cached().len(),
        2,
        "both large files got an object at import"
    );
    env.store.set_ref("a", &ia).unwrap();
    // `b` was an image once and is deleted: nothing holds it any more.
    env.store.set_ref("b", &ib).unwrap();
    env.store.delete_ref("b").unwrap();
    env.store.gc(&[]).unwrap();
    assert!(!env.store.contains(&ib));
    let left = cached();
    assert!(
        left.len() == 1 && left[0] == da,
        "{} objects left",
        left.len()
    );
    assert!(env.store.fsck().unwrap().cache_removed.is_empty());
}

/// An import returns before its caller names it with `set_ref` (in groved the two are separate
/// calls to grove-fsd): a gc in between must not take the new manifest's objects.
#[test]
fn gc_between_import_and_set_ref_keeps_the_import() {
    let env = Env::new();
    let src = env.path("src");
    make_tree(&src, 8);
    let from_dir = env.store.import_dir(&src).unwrap();
    let from_tar = env.store.import_tar(&mut &tar_of(&src)[..]).unwrap();
    let mut stream = Vec::new();
    env.store
        .export_stream(&from_dir, &|_| false, &mut stream)
        .unwrap();
    let other = Store::open(&env.path("other")).unwrap();
    let from_stream = other.import_stream(&mut &stream[..]).unwrap();
    env.store.gc(&[]).unwrap();
    other.gc(&[]).unwrap();
    env.store.set_ref("dir", &from_dir).unwrap();
    env.store.set_ref("tar", &from_tar).unwrap();
    other.set_ref("stream", &from_stream).unwrap();
    // Named now: a later gc keeps them through their refs alone.
    env.store.set_fresh_grace(std::time::Duration::ZERO);
    other.set_fresh_grace(std::time::Duration::ZERO);
    env.store.gc(&[]).unwrap();
    other.gc(&[]).unwrap();
    for (store, id, out) in [
        (&env.store, from_dir, "out-dir"),
        (&env.store, from_tar, "out-tar"),
        (&other, from_stream, "out-stream"),
    ] {
        let out = env.path(out);
        store.export_dir(&id, &out).unwrap();
        diff_trees(&src, &out);
        assert!(store.fsck().unwrap().is_clean());
    }
    // The grace is only for the window: an import nobody names is collected once it is over.
    let src2 = env.path("src2");
    make_tree(&src2, 9);
    let unnamed = env.store.import_dir(&src2).unwrap();
    env.store.gc(&[]).unwrap();
    assert!(!env.store.contains(&unnamed));
    env.store
        .set_fresh_grace(std::time::Duration::from_secs(600));
    let unnamed = env.store.import_dir(&src2).unwrap();
    env.store.gc(&[]).unwrap();
    assert!(env.store.contains(&unnamed), "still within its grace");
}

/// `FORMAT` carries no checksum: it is compared byte for byte at open, so damage to it is
/// refused like another version, naming the file.
#[test]
fn a_damaged_format_file_is_refused_naming_it() {
    let env = Env::new();
    let dir = env.path("other");
    let id = {
        let s = Store::open(&dir).unwrap();
        let src = env.path("src");
        make_tree(&src, 3);
        let id = s.import_dir(&src).unwrap();
        s.set_ref("x", &id).unwrap();
        id
    };
    let fmt = dir.join("FORMAT");
    let good = fs::read(&fmt).unwrap();
    assert_eq!(good, b"nodefs-store 1\n");
    let mut flipped = good.clone();
    flipped[3] ^= 0x20;
    for bad in [
        flipped,
        b"nodefs-store 1".to_vec(),
        vec![0xff, 0xfe],
        Vec::new(),
    ] {
        fs::write(&fmt, &bad).unwrap();
        match Store::open(&dir) {
            Err(e @ StoreError::Version { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains(&fmt.display().to_string()), "{msg}");
            }
            other => panic!("{bad:?}: expected a Version error, got {other:?}"),
        }
    }
    fs::write(&fmt, &good).unwrap();
    let s = Store::open(&dir).unwrap();
    assert_eq!(s.get_ref("x").unwrap(), Some(id));
}

#[test]
fn stream_sends_only_missing_objects() {
    let env = Env::new();
    let src = env.path("src");
    make_tree(&src, 11);
    let id = env.store.import_dir(&src).unwrap();
    let other = Store::open(&env.path("other")).unwrap();
    let mut buf = Vec::new();
    let st = env
        .store
        .export_stream(&id, &|o| other.has_object(o), &mut buf)
        .unwrap();
    assert!(st.objects > 10);
    let got = other.import_stream(&mut &buf[..]).unwrap();
    assert_eq!(got, id);
    other.export_dir(&id, &env.path("out")).unwrap();
    diff_trees(&src, &env.path("out"));
    // Second transfer: nothing to send.
    let mut buf2 = Vec::new();
    let st2 = env
        .store
        .export_stream(&id, &|o| other.has_object(o), &mut buf2)
        .unwrap();
    assert_eq!(st2.objects, 0);
    assert_eq!(other.import_stream(&mut &buf2[..]).unwrap(), id);
    // A damaged stream is refused.
    let mut bad = buf.clone();
    let n = bad.len();
    bad[n / 2] ^= 1;
    let third = Store::open(&env.path("third")).unwrap();
    assert!(third.import_stream(&mut &bad[..]).is_err());
}

/// Page images change a few pages between two checkpoints, but their directory's encoding (the
/// chunk list, 36 bytes per page) is incompressible: stored as a delta against the previous
/// checkpoint's directory, it costs a fraction. Same manifest id, same bytes back, and a long
/// chain of checkpoints stays readable through gc and a reopen.
#[test]
fn a_directory_is_stored_as_a_delta_of_its_previous_version() {
    let mut env = Env::new();
    let src = env.path("src");
    fs::create_dir_all(&src).unwrap();
    let pages = |p: &std::path::Path| {
        if p.to_string_lossy().contains("pages-") {
            ChunkPolicy::Fixed(4096)
        } else {
            ChunkPolicy::Cdc
        }
    };
    let n_pages = 4096usize; // 16 MiB, a 144 KiB chunk list
                             // The imports here are never named; only `live` holds them, from the first gc on.
    env.store.set_fresh_grace(std::time::Duration::ZERO);
    let mut data = random_bytes(7, n_pages * 4096);
    fs::create_dir_all(src.join("sub")).unwrap();
    fs::write(src.join("sub/pages-1.img"), &data).unwrap();
    let mut prev = env.store.import_dir_with(&src, &pages).unwrap();
    let mut roots = vec![prev];
    for round in 0..7u8 {
        // Touch 1 % of the pages.
        for k in 0..n_pages / 100 {
            let at = ((k * 97 + round as usize * 13) % n_pages) * 4096;
            data[at] = data[at].wrapping_add(round + 1);
        }
        fs::write(src.join("sub/pages-1.img"), &data).unwrap();
        let before = env.store.stats().stored_bytes;
        let id = env
            .store
            .import_dir_based(&src, &pages, Some(&prev))
            .unwrap();
        let added = env.store.stats().stored_bytes - before;
        let touched = (n_pages / 100 * 4096) as u64;
        assert!(
            added < touched + touched / 10,
            "round {round}: {added} bytes added for {touched} touched (a full chunk list is {} bytes)",
            n_pages * 36
        );
        // The same manifest as a plain import of the same tree (a delta is storage only).
        assert_eq!(env.store.import_dir_with(&src, &pages).unwrap(), id);
        roots.push(id);
        prev = id;
    }
    // Only the newest checkpoint stays live: gc must keep the older trees its deltas build on.
    let rep = env.store.gc(&[prev]).unwrap();
    assert!(rep.removed_objects > 0, "older pages go");
    assert!(
        !env.store.contains(&roots[0]),
        "the oldest manifest itself is gone"
    );
    env.reopen();
    assert!(env.store.fsck().unwrap().is_clean());
    let out = env.path("out");
    env.store.export_dir(&prev, &out).unwrap();
    assert_eq!(fs::read(out.join("sub/pages-1.img")).unwrap(), data);
}

/// A small tmpfs, unmounted on drop.
struct SmallFs(std::path::PathBuf);

impl SmallFs {
    fn new(at: std::path::PathBuf, size: &str) -> Option<SmallFs> {
        fs::create_dir_all(&at).unwrap();
        let ok = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(&at)
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(SmallFs(at))
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn avail(p: &std::path::Path) -> u64 {
    let s = nix::sys::statvfs::statvfs(p).unwrap();
    s.blocks_available() as u64 * s.fragment_size() as u64
}

/// Names under `dir` (recursively) that end in `.tmp` or hold `.tmp`.
fn temp_files(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(temp_files(&p));
        } else if e.file_name().to_string_lossy().contains(".tmp") {
            out.push(p.display().to_string());
        }
    }
    out
}

/// Issue 25, item 3: after deletes, `gc` on a full disk failed with ENOSPC and left a partial
/// pack; each retry added another, and it reported 7 MB freed for 124 MB. On a 64 MiB
/// filesystem filled to ENOSPC after most of the store died, gc succeeds, leaves no partial
/// pack or temp file, frees the space (its report agrees with statvfs), fsck is clean, the
/// live image exports intact, a retry adds nothing, and the store takes writes again.
#[test]
fn gc_on_a_full_disk_frees_space_and_says_how_much() {
    if !is_root() {
        capability_missing("mounting a tmpfs needs root");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let Some(small) = SmallFs::new(tmp.path().join("fs"), "64m") else {
        capability_missing("cannot mount a tmpfs");
        return;
    };
    let root = small.0.clone();
    let store = Store::open(&root.join("store")).unwrap();
    let src = tmp.path().join("src");
    let mut images = Vec::new();
    for (i, mb) in [(0u64, 8usize), (1, 12), (2, 12), (3, 12)] {
        let d = src.join(format!("i{i}"));
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("data"), random_bytes(100 + i, mb << 20)).unwrap();
        let id = store.import_dir(&d).unwrap();
        store.set_ref(&format!("img{i}"), &id).unwrap();
        images.push(id);
    }
    for i in 1..4 {
        store.delete_ref(&format!("img{i}")).unwrap();
    }
    let packs = |s: &Store| -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(s.dir().join("packs"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".pack"))
            .collect();
        v.sort();
        v
    };
    let packs_before = packs(&store);
    // Fill the rest of the disk.
    let mut filler = fs::File::create(root.join("filler")).unwrap();
    for chunk in [1usize << 20, 4096] {
        let buf = vec![0x5au8; chunk];
        while std::io::Write::write_all(&mut filler, &buf).is_ok() {}
    }
    drop(filler);
    let full = avail(&root);
    assert!(full < 1 << 20, "disk not full: {full} bytes free");
    let rep = store.gc(&[]).expect("gc on a full disk");
    let freed_fs = avail(&root) - full;
    eprintln!("{rep:?}; statvfs says {freed_fs} bytes freed");
    assert!(rep.removed_objects > 0, "{rep:?}");
    assert!(freed_fs > 30 << 20, "only {freed_fs} bytes freed");
    let diff = rep.freed_bytes.abs_diff(freed_fs);
    assert!(
        diff <= 256 << 10,
        "reported {} freed, the filesystem says {freed_fs}",
        rep.freed_bytes
    );
    assert!(
        temp_files(store.dir()).is_empty(),
        "{:?}",
        temp_files(store.dir())
    );
    assert!(
        packs(&store).len() <= packs_before.len(),
        "{packs_before:?} -> {:?}",
        packs(&store)
    );
    assert!(store.fsck().unwrap().is_clean());
    let out = tmp.path().join("out");
    store.export_dir(&images[0], &out).unwrap();
    diff_trees(&src.join("i0"), &out);
    // A retry has nothing left to free and adds nothing.
    let listed = packs(&store);
    let again = store.gc(&[]).unwrap();
    assert_eq!(again.removed_objects, 0, "{again:?}");
    assert!(again.freed_bytes < 64 << 10, "{again:?}");
    assert_eq!(packs(&store), listed);
    assert!(temp_files(store.dir()).is_empty());
    // The space is usable again; the store reopens clean.
    let d = src.join("i4");
    fs::create_dir_all(&d).unwrap();
    fs::write(d.join("data"), random_bytes(104, 8 << 20)).unwrap();
    let id = store.import_dir(&d).unwrap();
    store.set_ref("img4", &id).unwrap();
    drop(store);
    let store = Store::open(&root.join("store")).unwrap();
    assert!(store.fsck().unwrap().is_clean());
    let out = tmp.path().join("out4");
    store.export_dir(&id, &out).unwrap();
    diff_trees(&d, &out);
    drop(store);
    drop(small);
}

/// A registry layer applied onto a store with no room: the chunk writers' ENOSPC stops the
/// import and is the error reported (not a tar error, not a hang), nothing half-imported is
/// referenced, fsck stays clean, and once space is back the same layer applies whole.
#[test]
fn a_layer_onto_a_full_store_fails_with_the_stores_error_and_applies_once_space_returns() {
    if !is_root() {
        capability_missing("mounting a tmpfs needs root");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let Some(small) = SmallFs::new(tmp.path().join("fs"), "32m") else {
        capability_missing("cannot mount a tmpfs");
        return;
    };
    let store = Store::open(&small.0.join("store")).unwrap();
    // 48 MiB of incompressible files in one gzip layer, held in memory: more than the store's
    // filesystem holds.
    let files: Vec<Vec<u8>> = (0..12).map(|i| random_bytes(700 + i, 4 << 20)).collect();
    let names: Vec<String> = (0..files.len()).map(|i| format!("f{i}")).collect();
    let entries: Vec<(&str, &[u8])> = names
        .iter()
        .zip(&files)
        .map(|(n, d)| (n.as_str(), &d[..]))
        .collect();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &tar_of_files(&entries)).unwrap();
    let blob = gz.finish().unwrap();
    let apply = |store: &Store| {
        store.apply_layer(None, nodefs::LayerCompression::Gzip, None, &mut &blob[..])
    };
    let err = apply(&store).expect_err("48 MiB into 32 MiB");
    assert!(matches!(err, Error::Store(_)), "the store's error: {err:?}");
    assert_eq!(
        nodefs::first_errno(&err),
        Some(libc::ENOSPC),
        "ENOSPC first in its causes: {}",
        nodefs::chain(&err)
    );
    assert!(store.fsck().unwrap().is_clean());

    // Room again: the same layer applies, every file whole.
    let grown = Command::new("mount")
        .args(["-o", "remount,size=160m"])
        .arg(&small.0)
        .status()
        .is_ok_and(|s| s.success());
    assert!(grown, "remount the tmpfs larger");
    let id = apply(&store).expect("the layer, once there is room");
    let out = tmp.path().join("out");
    store.export_dir(&id, &out).unwrap();
    for (i, data) in files.iter().enumerate() {
        assert!(
            fs::read(out.join(format!("f{i}"))).unwrap() == *data,
            "f{i}"
        );
    }
    assert!(store.fsck().unwrap().is_clean());
}
