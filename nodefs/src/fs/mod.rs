//! Serving writable copy-on-write views of manifests over FUSE: `registry` holds the server
//! (`NodeFs`) and its mounts, `kernel` what they ask the kernel, `fuse` the request handlers, `ring` the FUSE-over-io_uring
//! transport.

mod commit;
mod dir;
mod file;
mod fuse;
mod idshift;
mod kernel;
mod killpriv;
mod openmode;
mod passthrough;
mod registry;
mod ring;
mod state;
mod upper;

pub use idshift::IdShift;
pub(crate) use passthrough::{object_name, ObjectWriter, CONTENT_XATTR};
pub use registry::{Mount, MountOptions, NodeFs, ServerOptions, Usage};
pub use ring::{RingError, Transport};
