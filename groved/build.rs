//! Generates the envd protobuf messages (E2B's in-sandbox daemon protocol, vendored under proto/envd)
//! with prost, and their proto3 JSON mapping with pbjson, for the E2B-compatible endpoint.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/envd/filesystem.proto", "proto/envd/process.proto"];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto/envd"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut cfg = prost_build::Config::new();
    cfg.compile_well_known_types()
        .extern_path(".google.protobuf", "::pbjson_types");
    cfg.compile_fds(fds.clone())?;
    let mut bytes = Vec::new();
    prost::Message::encode(&fds, &mut bytes)?;
    let set = out.join("envd_descriptor.bin");
    std::fs::write(&set, &bytes)?;
    pbjson_build::Builder::new()
        .register_descriptors(&bytes)?
        .extern_path(".google.protobuf", "::pbjson_types")
        .build(&[".filesystem", ".process"])?;
    Ok(())
}
