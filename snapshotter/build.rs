//! Builds the CRIU compatibility shim (compat/criu-shim.c) with the system C
//! compiler. Without a compiler the shim is empty and CRIU runs unpatched.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "compat/criu-shim.c";
    // Parts 12, 14 and 15 of the shim, in files of their own.
    let archive = "compat/tmpfs-archive.c";
    let smaps = "compat/smaps-ahead.c";
    let writer = "compat/page-writer.c";
    for f in [
        src,
        archive,
        "compat/tmpfs-archive.h",
        smaps,
        "compat/smaps-ahead.h",
        writer,
        "compat/page-writer.h",
    ] {
        println!("cargo:rerun-if-changed={f}");
    }
    let dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    // The plain shim, and the one preloaded only into dumps Grove tracks with userfaultfd
    // write-protect (its wrappers of read(2) and friends stay out of every other CRIU run).
    for (name, defines) in [
        ("criu-shim.so", &[][..]),
        ("criu-shim-uffd.so", &["-DGROVE_SHIM_UFFD_WP"][..]),
    ] {
        let out = dir.join(name);
        let ok = Command::new(&cc)
            .args(["-shared", "-fPIC", "-O2", "-Wall"])
            .args(defines)
            .arg("-o")
            .arg(&out)
            .arg(src)
            .arg(archive)
            .arg(smaps)
            .arg(writer)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            println!("cargo:warning=could not build {src} ({name}) with {cc}; CRIU will run without the compatibility shim");
            std::fs::write(&out, b"").expect("write empty shim");
        }
    }
}
