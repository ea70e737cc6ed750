//! envd's `filesystem.Filesystem` Connect service.

use super::connect::Services;

pub fn register(_s: &mut Services) {}
