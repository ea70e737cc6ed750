//! Grove addition: a seam for transports other than `/dev/fuse` reads and writes.
//!
//! FUSE over io_uring (kernel 6.14+) hands requests to the server in registered ring buffers
//! and takes replies back in the same buffers. The server still mounts, answers INIT and reads
//! FORGET/INTERRUPT through `/dev/fuse`, so the [`Session`](crate::Session) stays as it is; a
//! [`Dispatcher`] made from it runs requests that arrived another way through the same
//! [`Filesystem`] and hands each reply to a [`ReplyTarget`] instead of writing it to the
//! device.

use std::io;
use std::io::IoSlice;
use std::sync::Arc;

use nix::unistd::Uid;

use crate::Filesystem;
use crate::channel::Channel;
use crate::ll::Operation;
use crate::reply::ReplyEmpty;
use crate::request::RequestWithSender;
use crate::session::FilesystemHolder;
use crate::session::SessionACL;
use crate::session::SessionEventLoop;

/// Where the reply to one request goes when it is not written to `/dev/fuse`.
pub trait ReplyTarget: std::fmt::Debug + Send + Sync + 'static {
    /// Take the reply: `reply[0]` is the `fuse_out_header`, the rest its payload, as they
    /// would have been written to `/dev/fuse` in one `writev`. Called at most once per
    /// request.
    fn send(&self, reply: &[IoSlice<'_>]) -> io::Result<()>;
}

/// Runs requests that arrived by another transport through a filesystem, with the session's
/// access rules and its `/dev/fuse` channel (for passthrough backing ids).
pub struct Dispatcher<FS: Filesystem> {
    event_loop: SessionEventLoop<FS>,
}

impl<FS: Filesystem> std::fmt::Debug for Dispatcher<FS> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("name", &self.event_loop.thread_name)
            .finish()
    }
}

impl<FS: Filesystem> Dispatcher<FS> {
    pub(crate) fn new(
        filesystem: FS,
        ch: Channel,
        allowed: SessionACL,
        session_owner: Uid,
        name: String,
    ) -> Self {
        Dispatcher {
            event_loop: SessionEventLoop {
                thread_name: name,
                ch,
                filesystem: Arc::new(FilesystemHolder {
                    fs: Some(filesystem),
                }),
                allowed,
                session_owner,
            },
        }
    }

    /// Dispatch one request (its bytes as a `/dev/fuse` read would have returned them, aligned
    /// for `fuse_in_header`). The reply, or an error reply, goes to `target`; a request that
    /// does not parse is an error and `target` gets nothing.
    pub fn dispatch(&self, request: &[u8], target: Arc<dyn ReplyTarget>) -> io::Result<()> {
        let Some(req) =
            RequestWithSender::with_target(self.event_loop.ch.sender(), request, target)
        else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "invalid FUSE request",
            ));
        };
        if let Ok(Operation::Destroy(_)) = req.request.operation() {
            req.reply::<ReplyEmpty>().ok();
        } else {
            req.dispatch(&self.event_loop);
        }
        Ok(())
    }
}
