//! What more than one of Grove's crates needs from the kernel and `nix` does not wrap: one copy
//! of each, so that their unsafe blocks are written (and reviewed) once.
//!
//! nodefs and the runtime do not depend on each other; both depend on this.

pub mod fd;
pub mod mountinfo;
pub mod net;
pub mod proc;
pub mod process;
pub mod sched;
pub mod thread;
