#![allow(dead_code)]
pub mod app;
pub mod grove;
pub mod tree;

#[allow(unused_imports)] // not every test binary skips
pub use grove_testkit::capability_missing;
