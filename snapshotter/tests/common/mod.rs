#![allow(dead_code)]
pub mod tree;
