//! A per-mount id shift for a sandbox in a user namespace: the store keeps image-space owners
//! (so commits, images and forks do not depend on the range a sandbox drew), the kernel sees
//! them moved into the sandbox's host range, where its uid_map moves them back.

use serde::{Deserialize, Serialize};

/// The id a range does not cover shows as (the kernel's default overflow id).
pub const OVERFLOW_ID: u32 = 65534;

/// Image ids `0..size` appear as host ids `base..base + size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdShift {
    pub base: u32,
    pub size: u32,
}

impl IdShift {
    /// An owner from the store, as the kernel (the host) sees it.
    pub fn out(&self, id: u32) -> u32 {
        if id < self.size {
            self.base + id
        } else {
            OVERFLOW_ID
        }
    }

    /// An owner coming from the kernel (a chown, a creating caller's fsuid), for the store. Host
    /// root (the runtime's files API, writing from outside) acts as the image's root; any other id
    /// outside the range is stored as the overflow id, never as a host id.
    pub fn into_store(&self, id: u32) -> u32 {
        match id.checked_sub(self.base) {
            Some(i) if i < self.size => i,
            _ if id == 0 => 0,
            _ => OVERFLOW_ID,
        }
    }
}

/// Applies an optional shift (none: ids pass unchanged).
pub fn out(shift: Option<IdShift>, id: u32) -> u32 {
    shift.map_or(id, |s| s.out(id))
}

pub fn into_store(shift: Option<IdShift>, id: u32) -> u32 {
    shift.map_or(id, |s| s.into_store(id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_move_into_the_range_and_back() {
        let s = IdShift {
            base: 200_000,
            size: 65536,
        };
        assert_eq!(s.out(0), 200_000);
        assert_eq!(s.out(1000), 201_000);
        assert_eq!(s.out(70_000), OVERFLOW_ID);
        assert_eq!(s.into_store(201_000), 1000);
        assert_eq!(s.into_store(200_000), 0);
        assert_eq!(s.into_store(0), 0);
        assert_eq!(s.into_store(1000), OVERFLOW_ID);
        assert_eq!(s.into_store(265_536), OVERFLOW_ID);
        assert_eq!(out(None, 7), 7);
        assert_eq!(into_store(None, 7), 7);
    }
}
