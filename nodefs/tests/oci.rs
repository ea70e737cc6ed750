//! OCI image layout import: layers in order, whiteouts, digests checked.

mod common;

use std::fs;
use std::io::Write;
use std::path::Path;

use common::*;
use nodefs::Error;
use sha2::{Digest, Sha256};

fn blob(layout: &Path, data: &[u8]) -> String {
    let hex = hex::encode(Sha256::digest(data));
    fs::create_dir_all(layout.join("blobs/sha256")).unwrap();
    fs::write(layout.join("blobs/sha256").join(&hex), data).unwrap();
    format!("sha256:{hex}")
}

fn layer(entries: &[(&str, Option<&[u8]>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mtime(1_600_000_000);
        h.set_uid(0);
        h.set_gid(0);
        match data {
            Some(d) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o644);
                h.set_size(d.len() as u64);
                b.append_data(&mut h, path, *d).unwrap();
            }
            None => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                h.set_size(0);
                b.append_data(&mut h, path, &[][..]).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

/// An OCI layout holding one image named `test:1` made of `layers` (uncompressed tars).
fn write_layout(dir: &Path, layers: &[Vec<u8>]) {
    fs::create_dir_all(dir).unwrap();
    fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    let descs: Vec<_> = layers
        .iter()
        .map(|l| {
            serde_json::json!({
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": blob(dir, l),
                "size": l.len(),
            })
        })
        .collect();
    let config = blob(dir, br#"{"architecture":"amd64","os":"linux"}"#);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config, "size": 1},
        "layers": descs,
    });
    let m = blob(dir, manifest.to_string().as_bytes());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": m, "size": 1,
            "annotations": {"org.opencontainers.image.ref.name": "test:1"}
        }]
    });
    fs::write(dir.join("index.json"), index.to_string()).unwrap();
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

fn make_layout(dir: &Path, corrupt_layer: bool) {
    fs::create_dir_all(dir).unwrap();
    fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    let l1 = gzip(&layer(&[
        ("etc/", None),
        ("etc/keep", Some(b"keep")),
        ("etc/gone", Some(b"gone")),
        ("opq/", None),
        ("opq/old", Some(b"old")),
    ]));
    let l2 = layer(&[
        ("etc/.wh.gone", Some(b"")),
        ("opq/.wh..wh..opq", Some(b"")),
        ("opq/new", Some(b"new")),
        ("etc/keep", Some(b"keep v2")),
    ]);
    let d1 = blob(dir, &l1);
    let d2 = blob(dir, &l2);
    if corrupt_layer {
        let p = dir
            .join("blobs/sha256")
            .join(d2.trim_start_matches("sha256:"));
        let mut b = fs::read(&p).unwrap();
        b[600] ^= 1;
        fs::write(p, b).unwrap();
    }
    let config = blob(dir, br#"{"architecture":"amd64","os":"linux"}"#);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config, "size": 1},
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d1, "size": l1.len()},
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d2, "size": l2.len()},
        ]
    });
    let m = blob(dir, manifest.to_string().as_bytes());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": m, "size": 1,
            "annotations": {"org.opencontainers.image.ref.name": "test:1"}
        }]
    });
    fs::write(dir.join("index.json"), index.to_string()).unwrap();
}

#[test]
fn oci_layers_apply_in_order_with_whiteouts() {
    let env = Env::new();
    let layout = env.path("layout");
    make_layout(&layout, false);
    let id = env.store.import_oci(&layout, Some("test:1")).unwrap();
    assert_eq!(env.store.import_oci(&layout, None).unwrap(), id);
    let out = env.path("out");
    env.store.export_dir(&id, &out).unwrap();
    assert_eq!(fs::read(out.join("etc/keep")).unwrap(), b"keep v2");
    assert!(!out.join("etc/gone").exists());
    assert!(!out.join("opq/old").exists());
    assert_eq!(fs::read(out.join("opq/new")).unwrap(), b"new");
    assert!(!out.join("etc/.wh.gone").exists());
    match env.store.import_oci(&layout, Some("nope")) {
        Err(Error::BadOci { why, .. }) => assert!(why.contains("nope"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn oci_corrupt_layer_is_refused() {
    let env = Env::new();
    let layout = env.path("layout");
    make_layout(&layout, true);
    let err = env.store.import_oci(&layout, None).unwrap_err();
    assert!(matches!(err, Error::BadOci { .. }), "{err:?}");
    eprintln!("{err}");
    fs::remove_file(layout.join("index.json")).unwrap();
    assert!(matches!(
        env.store.import_oci(&layout, None),
        Err(Error::BadOci { .. })
    ));
}

/// Whiteouts hide lower layers only: entries of the same layer survive whether the tar lists
/// them before or after the marker (OCI image spec, "Whiteouts").
#[test]
fn oci_whiteouts_hide_lower_layers_only() {
    let env = Env::new();
    let layout = env.path("layout");
    let lower = layer(&[
        ("d/", None),
        ("d/lower", Some(b"lower")),
        ("d/sub/", None),
        ("d/sub/deep", Some(b"deep")),
        ("e/", None),
        ("e/gone", Some(b"gone")),
        ("e/again", Some(b"again v1")),
        ("e/also", Some(b"also")),
        ("w/", None),
        ("w/x", Some(b"x")),
    ]);
    let upper = layer(&[
        ("d/", None),
        ("d/before", Some(b"before")),
        ("d/sub/", None),
        ("d/sub/new", Some(b"new")),
        ("d/.wh..wh..opq", Some(b"")),
        ("d/after", Some(b"after")),
        ("e/again", Some(b"again v2")),
        ("e/.wh.again", Some(b"")),
        ("e/.wh.gone", Some(b"")),
        ("w/y", Some(b"y")),
        (".wh.w", Some(b"")),
    ]);
    write_layout(&layout, &[lower, upper]);
    let id = env.store.import_oci(&layout, None).unwrap();
    let out = env.path("out");
    env.store.export_dir(&id, &out).unwrap();
    // Opaque dir: this layer's entries on both sides of the marker stay; the lower ones go,
    // including the lower content of a subdirectory this layer also names.
    assert_eq!(names(&out.join("d")), ["after", "before", "sub"]);
    assert_eq!(fs::read(out.join("d/before")).unwrap(), b"before");
    assert_eq!(fs::read(out.join("d/after")).unwrap(), b"after");
    assert_eq!(names(&out.join("d/sub")), ["new"]);
    // `.wh.name`: the lower file goes; a same-layer file of that name listed first stays.
    assert_eq!(names(&out.join("e")), ["again", "also"]);
    assert_eq!(fs::read(out.join("e/again")).unwrap(), b"again v2");
    // A whited-out directory keeps only what this layer put in it.
    assert_eq!(names(&out.join("w")), ["y"]);
    assert_eq!(names(&out), ["d", "e", "w"]);
}

fn sha(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// Layers applied one call at a time onto the previous result: whiteouts hide the base's
/// entries, gzip and zstd decode, and each result is an ordinary manifest.
#[test]
fn layers_apply_one_at_a_time_onto_a_stored_base() {
    use nodefs::LayerCompression as C;
    let env = Env::new();
    let l1 = layer(&[("etc/", None), ("etc/a", Some(b"a")), ("etc/b", Some(b"b"))]);
    let l2 = layer(&[("etc/.wh.a", Some(b"")), ("etc/c", Some(b"c"))]);
    let l1z = gzip(&l1);
    let l2z = zstd::encode_all(&l2[..], 3).unwrap();
    let base = env
        .store
        .apply_layer(None, C::Gzip, Some(&sha(&l1z)), &mut &l1z[..])
        .unwrap();
    let top = env
        .store
        .apply_layer(Some(&base), C::Zstd, Some(&sha(&l2z)), &mut &l2z[..])
        .unwrap();
    let out = env.path("out");
    env.store.export_dir(&top, &out).unwrap();
    assert!(!out.join("etc/a").exists());
    assert_eq!(fs::read(out.join("etc/b")).unwrap(), b"b");
    assert_eq!(fs::read(out.join("etc/c")).unwrap(), b"c");
    assert!(!out.join("etc/.wh.a").exists());
    // The same layers in one OCI import give the same tree.
    assert_eq!(
        env.store
            .apply_layer(None, C::None, Some(&sha(&l1)), &mut &l1[..])
            .unwrap(),
        base
    );
}

/// A blob that is not what its digest says fails, whatever its content does to the tar
/// reader, and what it wrote is freed by gc: nothing of it stays.
#[test]
fn a_layer_with_a_wrong_digest_keeps_nothing() {
    use nodefs::LayerCompression as C;
    let env = Env::new();
    env.store.set_fresh_grace(std::time::Duration::ZERO);
    let before = env.store.stored_bytes();
    let big = random_bytes(7, 3 << 20);
    let l = layer(&[("big", Some(&big[..]))]);
    let wrong = sha(b"something else");
    match env
        .store
        .apply_layer(None, C::None, Some(&wrong), &mut &l[..])
    {
        Err(Error::BadLayer { digest, why }) => {
            assert_eq!(digest, wrong);
            assert!(why.contains("does not match"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    // Cut short: the tar is broken and the digest cannot match either.
    let cut = &l[..l.len() / 2];
    assert!(matches!(
        env.store
            .apply_layer(None, C::None, Some(&sha(&l)), &mut &cut[..]),
        Err(Error::BadLayer { .. })
    ));
    env.store.gc(&[]).unwrap();
    assert!(env.store.fsck().unwrap().is_clean());
    assert!(
        env.store.stored_bytes() <= before + (64 << 10),
        "{} bytes left of a failed layer",
        env.store.stored_bytes() - before
    );
}
