#![allow(dead_code)]
pub mod app;
pub mod grove;
pub mod tree;
