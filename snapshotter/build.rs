//! Builds the CRIU compatibility shim (compat/criu-shim.c) with the system C
//! compiler. Without a compiler the shim is empty and CRIU runs unpatched.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "compat/criu-shim.c";
    println!("cargo:rerun-if-changed={src}");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("criu-shim.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let ok = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-o"])
        .arg(&out)
        .arg(src)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        println!("cargo:warning=could not build {src} with {cc}; CRIU will run without the compatibility shim");
        std::fs::write(&out, b"").expect("write empty shim");
    }
}
