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
    CommitUnsealed {
        mount: u64,
    },
    SealCommit {
        mount: u64,
        id: ManifestId,
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

/// Errors cross the socket as themselves, so that the in-process store and grove-fsd fail alike
/// for the same cause (same variant, same errno, hence the same HTTP status in groved). An I/O
/// error carries its OS code and is rebuilt as that `io::Error`; one without a code (made
/// in-process) crosses as its text. What has no variant of its own crosses as its message chain
/// and the first OS code in that chain.
///
/// Kinds were added without a protocol bump: an older server sends none of them, and its
/// `other` (no `errno`) still decodes.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum WireError {
    BadTar {
        entry: String,
        why: String,
    },
    BadOci {
        path: PathBuf,
        why: String,
    },
    BadRefName {
        name: String,
    },
    UnknownRef {
        name: String,
    },
    UnknownManifest {
        id: ManifestId,
    },
    Unmounted {
        path: PathBuf,
    },
    BadStream {
        why: String,
    },
    UnknownMount {
        id: u64,
    },
    Other {
        message: String,
        #[serde(default)]
        errno: Option<i32>,
    },
    BadLayer {
        digest: String,
        why: String,
    },
    Io {
        path: PathBuf,
        io: WireIo,
    },
    Mount {
        path: PathBuf,
        io: WireIo,
    },
    StoreIo {
        path: PathBuf,
        io: WireIo,
    },
    Missing {
        id: ObjectId,
    },
    Corrupt {
        id: ObjectId,
        why: String,
    },
    CorruptPack {
        path: PathBuf,
        offset: u64,
        why: String,
    },
    StoreVersion {
        path: PathBuf,
        version: String,
    },
}

/// An `io::Error` on the wire: its OS code, or (for one made in-process) its kind's text and
/// message.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WireIo {
    errno: Option<i32>,
    message: String,
}

impl From<&std::io::Error> for WireIo {
    fn from(e: &std::io::Error) -> WireIo {
        WireIo {
            errno: e.raw_os_error(),
            message: chain(e),
        }
    }
}

impl From<WireIo> for std::io::Error {
    fn from(w: WireIo) -> std::io::Error {
        match w.errno {
            Some(n) => std::io::Error::from_raw_os_error(n),
            None => std::io::Error::other(w.message),
        }
    }
}

impl From<&Error> for WireError {
    fn from(e: &Error) -> WireError {
        use crate::error::StoreError as S;
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
            Error::Fsd { message, errno } => WireError::Other {
                message: message.clone(),
                errno: *errno,
            },
            Error::BadLayer { digest, why } => WireError::BadLayer {
                digest: digest.clone(),
                why: why.clone(),
            },
            Error::Io { path, source } => WireError::Io {
                path: path.clone(),
                io: source.into(),
            },
            Error::Mount { path, source } => WireError::Mount {
                path: path.clone(),
                io: source.into(),
            },
            Error::Store(S::Io { path, source }) => WireError::StoreIo {
                path: path.clone(),
                io: source.into(),
            },
            Error::Store(S::Missing { id }) => WireError::Missing { id: *id },
            Error::Store(S::Corrupt { id, why }) => WireError::Corrupt {
                id: *id,
                why: why.clone(),
            },
            Error::Store(S::CorruptPack { path, offset, why }) => WireError::CorruptPack {
                path: path.clone(),
                offset: *offset,
                why: why.clone(),
            },
            Error::Store(S::Version { path, version }) => WireError::StoreVersion {
                path: path.clone(),
                version: version.clone(),
            },
            other @ Error::Unreachable(_) => WireError::Other {
                message: chain(other),
                errno: crate::error::first_errno(other),
            },
        }
    }
}

impl From<WireError> for Error {
    fn from(w: WireError) -> Error {
        use crate::error::StoreError as S;
        match w {
            WireError::BadTar { entry, why } => Error::BadTar { entry, why },
            WireError::BadOci { path, why } => Error::BadOci { path, why },
            WireError::BadRefName { name } => Error::BadRefName(name),
            WireError::UnknownRef { name } => Error::UnknownRef(name),
            WireError::UnknownManifest { id } => Error::UnknownManifest(id),
            WireError::Unmounted { path } => Error::Unmounted(path),
            WireError::BadStream { why } => Error::BadStream(why),
            WireError::UnknownMount { id } => Error::UnknownMount(id),
            WireError::Other { message, errno } => Error::Fsd { message, errno },
            WireError::BadLayer { digest, why } => Error::BadLayer { digest, why },
            WireError::Io { path, io } => Error::Io {
                path,
                source: io.into(),
            },
            WireError::Mount { path, io } => Error::Mount {
                path,
                source: io.into(),
            },
            WireError::StoreIo { path, io } => Error::Store(S::Io {
                path,
                source: io.into(),
            }),
            WireError::Missing { id } => Error::Store(S::Missing { id }),
            WireError::Corrupt { id, why } => Error::Store(S::Corrupt { id, why }),
            WireError::CorruptPack { path, offset, why } => {
                Error::Store(S::CorruptPack { path, offset, why })
            }
            WireError::StoreVersion { path, version } => Error::Store(S::Version { path, version }),
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

    /// What crossed the socket, as the client sees it.
    fn across(e: &Error) -> Error {
        let text = serde_json::to_string(&Reply::Err(e.into())).unwrap();
        let Reply::Err(w) = serde_json::from_str(&text).unwrap() else {
            panic!("not an error reply: {text}");
        };
        w.into()
    }

    /// The remote store fails as the in-process one does: same variant, same OS error.
    #[test]
    fn store_errors_cross_the_socket_as_themselves() {
        use crate::error::StoreError as S;
        let full = Error::Store(S::Io {
            path: "/s/packs/1".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        });
        let Error::Store(S::Io { path, source }) = across(&full) else {
            panic!("not a store I/O error");
        };
        assert_eq!(path, PathBuf::from("/s/packs/1"));
        assert_eq!(source.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(chain(&across(&full)), chain(&full));

        let gone = Error::Mount {
            path: "/m".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOTCONN),
        };
        assert!(matches!(across(&gone), Error::Mount { source, .. }
            if source.raw_os_error() == Some(libc::ENOTCONN)));

        let id = ObjectId([7; 32]);
        assert!(matches!(across(&Error::Store(S::Missing { id })),
            Error::Store(S::Missing { id: i }) if i == id));

        // An I/O error made in-process has no code: its text crosses.
        let made = Error::Io {
            path: "/x".into(),
            source: std::io::Error::other("short read"),
        };
        assert_eq!(chain(&across(&made)), chain(&made));
    }

    /// What has no variant keeps its chain's first OS code; an older server's `other` (no code)
    /// still decodes.
    #[test]
    fn other_errors_carry_their_errno_and_old_replies_decode() {
        let e = Error::Fsd {
            message: "commit: No space left on device (os error 28)".into(),
            errno: Some(libc::ENOSPC),
        };
        assert!(matches!(
            across(&e),
            Error::Fsd {
                errno: Some(libc::ENOSPC),
                ..
            }
        ));
        let old: Reply =
            serde_json::from_str(r#"{"err":{"kind":"other","message":"boom"}}"#).unwrap();
        let Reply::Err(w) = old else { panic!() };
        assert!(matches!(Error::from(w), Error::Fsd { errno: None, message } if message == "boom"));
    }
}
