//! `grove-fsd`'s protocol: frames of a u32 (LE) length and a JSON body over a unix stream socket.
//! A connection starts with `Hello`; then each request gets one reply. Streams travel in a pipe
//! whose end rides the request frame as SCM_RIGHTS; an import is followed by a `StreamEnd` frame
//! saying whether the client's input ended cleanly (a reader error must not import a prefix).

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::ImportPolicy;
use crate::error::{chain, Error};
use crate::fs::MountOptions;
use crate::id::{ManifestId, ObjectId};
use crate::layer::LayerCompression;

/// Bumped on any incompatible change; both sides refuse another version.
pub const VERSION: u32 = 1;
const MAX_FRAME: u32 = 64 << 20;

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum Request {
    /// `session` names the client process; its pins end when its last connection closes.
    Hello {
        version: u32,
        session: String,
    },
    Resolve {
        name: String,
    },
    GetRef {
        name: String,
    },
    SetRef {
        name: String,
        id: ManifestId,
    },
    DeleteRef {
        name: String,
    },
    Refs,
    Stats,
    StoredBytes,
    ManifestBytes {
        id: ManifestId,
    },
    ImportDir {
        dir: PathBuf,
        policy: ImportPolicy,
        #[serde(default)]
        base: Option<ManifestId>,
    },
    ImportOci {
        dir: PathBuf,
        reference: Option<String>,
    },
    /// Carries the read end of a pipe.
    ImportTar,
    /// Carries the read end of a pipe: one image layer blob.
    ApplyLayer {
        base: Option<ManifestId>,
        compression: LayerCompression,
        digest: Option<String>,
    },
    ExportDir {
        id: ManifestId,
        dst: PathBuf,
    },
    /// Carries the write end of a pipe.
    ExportStream {
        id: ManifestId,
        only: Option<Vec<ObjectId>>,
    },
    /// Carries the read end of a pipe holding `count` streams back to back.
    ImportStreams {
        count: usize,
    },
    /// After an import's data: whether the client read all of its input.
    StreamEnd {
        ok: bool,
        error: Option<String>,
    },
    ObjectsOf {
        id: ManifestId,
    },
    Lacking {
        ids: Vec<ObjectId>,
    },
    Pin {
        id: ObjectId,
    },
    Unpin {
        id: ObjectId,
    },
    Gc {
        live: Vec<ManifestId>,
    },
    Fsck,
    Mount {
        base: ManifestId,
        target: PathBuf,
        opts: MountOptions,
    },
    Commit {
        mount: u64,
    },
    Usage {
        mount: u64,
    },
    Unmount {
        mount: u64,
    },
    Mounts,
    /// Unmount everything, remove the socket, exit.
    Shutdown,
}

/// The typed errors callers act on (HTTP status, retries) cross the socket as themselves; the
/// rest as their message chain.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum WireError {
    BadTar { entry: String, why: String },
    BadOci { path: PathBuf, why: String },
    BadRefName { name: String },
    UnknownRef { name: String },
    UnknownManifest { id: ManifestId },
    Unmounted { path: PathBuf },
    BadStream { why: String },
    UnknownMount { id: u64 },
    Other { message: String },
    BadLayer { digest: String, why: String },
}

impl From<&Error> for WireError {
    fn from(e: &Error) -> WireError {
        match e {
            Error::BadTar { entry, why } => WireError::BadTar {
                entry: entry.clone(),
                why: why.clone(),
            },
            Error::BadOci { path, why } => WireError::BadOci {
                path: path.clone(),
                why: why.clone(),
            },
            Error::BadRefName(n) => WireError::BadRefName { name: n.clone() },
            Error::UnknownRef(n) => WireError::UnknownRef { name: n.clone() },
            Error::UnknownManifest(id) => WireError::UnknownManifest { id: *id },
            Error::Unmounted(p) => WireError::Unmounted { path: p.clone() },
            Error::BadStream(w) => WireError::BadStream { why: w.clone() },
            Error::UnknownMount(id) => WireError::UnknownMount { id: *id },
            Error::Fsd(m) => WireError::Other { message: m.clone() },
            Error::BadLayer { digest, why } => WireError::BadLayer {
                digest: digest.clone(),
                why: why.clone(),
            },
            other => WireError::Other {
                message: chain(other),
            },
        }
    }
}

impl From<WireError> for Error {
    fn from(w: WireError) -> Error {
        match w {
            WireError::BadTar { entry, why } => Error::BadTar { entry, why },
            WireError::BadOci { path, why } => Error::BadOci { path, why },
            WireError::BadRefName { name } => Error::BadRefName(name),
            WireError::UnknownRef { name } => Error::UnknownRef(name),
            WireError::UnknownManifest { id } => Error::UnknownManifest(id),
            WireError::Unmounted { path } => Error::Unmounted(path),
            WireError::BadStream { why } => Error::BadStream(why),
            WireError::UnknownMount { id } => Error::UnknownMount(id),
            WireError::Other { message } => Error::Fsd(message),
            WireError::BadLayer { digest, why } => Error::BadLayer { digest, why },
        }
    }
}

/// A reply: `{"ok": value}` or `{"err": error}`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Reply {
    Ok(serde_json::Value),
    Err(WireError),
}

/// Writes one frame, with `fd` attached if given.
pub(crate) fn send<T: Serialize>(
    sock: &UnixStream,
    msg: &T,
    fd: Option<RawFd>,
) -> std::io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    let mut frame = Vec::with_capacity(body.len() + 4);
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    let mut off = 0;
    if let Some(fd) = fd {
        let fds = [fd];
        let cmsg = [ControlMessage::ScmRights(&fds)];
        off = sendmsg::<()>(
            sock.as_raw_fd(),
            &[IoSlice::new(&frame)],
            &cmsg,
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .map_err(std::io::Error::from)?;
    }
    (&*sock).write_all(&frame[off..])
}

/// Reads one frame and any fd that came with it. `Ok(None)`: the peer closed the connection.
pub(crate) fn recv<T: DeserializeOwned>(
    sock: &UnixStream,
) -> std::io::Result<Option<(T, Option<OwnedFd>)>> {
    let mut len = [0u8; 4];
    let mut cmsg = nix::cmsg_space!([RawFd; 2]);
    let (n, fds) = {
        let mut iov = [IoSliceMut::new(&mut len)];
        let msg = recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(std::io::Error::from)?;
        let mut fds = Vec::new();
        for c in msg.cmsgs().map_err(std::io::Error::from)? {
            if let ControlMessageOwned::ScmRights(v) = c {
                fds.extend(v);
            }
        }
        (msg.bytes, fds)
    };
    // SAFETY: the kernel just installed these fds in this process; nothing else owns them.
    let mut owned: Vec<OwnedFd> = fds
        .into_iter()
        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    if n == 0 {
        return Ok(None);
    }
    (&*sock).read_exact(&mut len[n..])?;
    let len = u32::from_le_bytes(len);
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!("frame of {len} bytes")));
    }
    let mut body = vec![0u8; len as usize];
    (&*sock).read_exact(&mut body)?;
    let msg = serde_json::from_slice(&body).map_err(std::io::Error::other)?;
    Ok(Some((msg, owned.pop())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mount request from a client older than `MountOptions::passthrough` (no such field)
    /// still decodes, with passthrough on as before; an explicit `false` is kept.
    #[test]
    fn mount_options_passthrough_is_backward_compatible() {
        let base = "ab".repeat(32);
        let old = format!(
            r#"{{"op":"mount","base":"{base}","target":"/m","opts":{{"quota_bytes":null,"quota_inodes":7,"upper_dir":"/u","read_only":false}}}}"#
        );
        let Request::Mount { opts, .. } = serde_json::from_str(&old).unwrap() else {
            panic!("not a mount request");
        };
        assert!(opts.passthrough);
        assert_eq!(opts.quota_inodes, Some(7));
        let off = Request::Mount {
            base: ObjectId([0xab; 32]),
            target: "/m".into(),
            opts: MountOptions {
                passthrough: false,
                ..Default::default()
            },
        };
        let text = serde_json::to_string(&off).unwrap();
        let Request::Mount { opts, .. } = serde_json::from_str(&text).unwrap() else {
            panic!("not a mount request");
        };
        assert!(!opts.passthrough);
        assert!(MountOptions::default().passthrough);
    }
}
