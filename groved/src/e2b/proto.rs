//! envd's protobuf messages (`filesystem` and `process` packages), generated at build time from
//! E2B's .proto files vendored in groved/proto/envd (Apache-2.0), with prost for the binary codec
//! and pbjson for the proto3 JSON one.

#![allow(clippy::all, missing_docs, unused_qualifications)]

pub mod filesystem {
    include!(concat!(env!("OUT_DIR"), "/filesystem.rs"));
    include!(concat!(env!("OUT_DIR"), "/filesystem.serde.rs"));
}

pub mod process {
    include!(concat!(env!("OUT_DIR"), "/process.rs"));
    include!(concat!(env!("OUT_DIR"), "/process.serde.rs"));
}
