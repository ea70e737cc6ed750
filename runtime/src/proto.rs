//! Wire protocol between the runtime and grove-init's control socket.
//!
//! A frame is `[u32 BE length][u8 kind][payload]` where length counts kind + payload. One request per
//! connection; the connection closes after the final frame (CRIU needs no connection open at dump time).

use std::collections::BTreeMap;
use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// Path of init's control socket inside the sandbox.
pub const SOCKET_PATH: &str = "/run/grove/init.sock";
/// Where the init binary is bind-mounted inside the sandbox (CRIU must see the exe).
pub const INIT_PATH: &str = "/run/grove/init";

/// The character devices every sandbox's /dev holds: (name, major, minor). Made with mknod, or in
/// a user namespace (where a node cannot be made) bound from the host's /dev.
pub const DEV_NODES: [(&str, u64, u64); 6] = [
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];
/// Directory for background exec logs inside the sandbox.
pub const LOG_DIR: &str = "/run/grove/logs";
/// An empty directory, bound read-only over the host directories a sandbox must not see.
pub const MASK_DIR: &str = "/run/grove/masked";

/// Arguments after `--setup` that name the runtime instance (its cgroup root) and the sandbox a
/// setup process works for; grove-init ignores them, residue scans read them from
/// /proc/<pid>/cmdline so each instance claims only its own in-flight setups.
pub const OWNER_INSTANCE_ARG: &str = "--instance";
pub const OWNER_SANDBOX_ARG: &str = "--sandbox";

/// `(instance, sandbox)` from a NUL-separated cmdline carrying the owner arguments.
pub fn setup_owner(cmdline: &[u8]) -> Option<(String, String)> {
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    let value = |flag: &str| {
        let i = args.iter().position(|a| *a == flag.as_bytes())?;
        String::from_utf8(args.get(i + 1)?.to_vec()).ok()
    };
    Some((value(OWNER_INSTANCE_ARG)?, value(OWNER_SANDBOX_ARG)?))
}

pub const KIND_JSON: u8 = 1;
pub const KIND_STDOUT: u8 = 2;
pub const KIND_STDERR: u8 = 3;
/// Output of a process on a pseudo-terminal (one stream).
pub const KIND_PTY: u8 = 4;

/// Frames larger than this are refused (protects init from a bad peer).
pub const MAX_FRAME: usize = 64 << 20;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Exec(ExecSpec),
    Processes,
    Signal {
        pid: i32,
        signal: i32,
    },
    Ping,
    /// Starts a named shell init holds (see init/session.rs); replies `Sessions` with it.
    SessionCreate(SessionSpec),
    /// One command in a session: STDOUT frames (stdout and stderr merged, as on a terminal), then
    /// `SessionDone` or `SessionError`.
    SessionRun(SessionRunSpec),
    /// SIGINT to the session's foreground process group (the shell's).
    SessionInterrupt {
        name: String,
    },
    /// Kills the shell and everything it started.
    SessionClose {
        name: String,
    },
    SessionList,
    /// Starts a process init keeps past this connection (see [`ProcSpec`]).
    ProcStart(ProcSpec),
    /// Streams a kept process's buffered output, then its live output and its exit.
    ProcConnect {
        pid: i32,
    },
    /// Queues bytes for a kept process's stdin (or its terminal).
    ProcInput {
        pid: i32,
        #[serde(with = "b64")]
        data: Vec<u8>,
    },
    /// Closes a kept process's stdin once what is queued is written.
    ProcCloseStdin {
        pid: i32,
    },
    /// Sets the size of a kept process's terminal.
    ProcResize {
        pid: i32,
        size: PtySize,
    },
    /// The kept processes, running and recently ended.
    ProcList,
}

/// Terminal size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    pub cols: u16,
    pub rows: u16,
}

/// A process init keeps: its output is buffered (for a later `ProcConnect`) and streamed to every
/// connection attached to it, its stdin and terminal stay open for `ProcInput`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ProcSpec {
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    /// Empty: the user's home (or /).
    pub cwd: String,
    /// A name from the sandbox's /etc/passwd or `uid[:gid]`; None: root.
    pub user: Option<String>,
    /// A `user` name the sandbox's /etc/passwd lacks runs as root instead of failing (a default
    /// user an image may not have).
    pub user_or_root: bool,
    /// Run on a new pseudo-terminal of this size (stdout and stderr are then one stream).
    pub pty: Option<PtySize>,
    /// Keep a stdin pipe open for `ProcInput` (otherwise stdin is /dev/null).
    pub stdin: bool,
    pub tag: Option<String>,
    /// Stream the output and exit on this connection after `Started`.
    pub attach: bool,
    /// The process outlives the attached connection; otherwise its hang-up kills the tree.
    pub keep: bool,
    pub timeout_ms: Option<u64>,
    /// Also append the output to `LOG_DIR/<pid>.log`.
    pub log: bool,
}

/// A kept process, as `ProcList` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveInfo {
    pub pid: i32,
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    pub tag: Option<String>,
    pub pty: bool,
    pub running: bool,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
}

/// Bytes as base64 in the JSON frames.
mod b64 {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(serde::de::Error::custom)
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SessionSpec {
    pub name: String,
    /// A POSIX shell, by path or name in PATH; None: bash.
    pub shell: Option<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SessionRunSpec {
    pub name: String,
    pub command: String,
    /// The command's stdin; None: /dev/null.
    pub input: Option<Vec<u8>>,
    pub timeout_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionStatus {
    pub name: String,
    pub shell: String,
    /// The shell's pid inside the sandbox.
    pub pid: i32,
    pub alive: bool,
    /// A run is in progress.
    pub busy: bool,
    /// How the shell ended, once dead.
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub created_ms: u64,
}

/// Why init refused a session request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionErrorKind {
    NotFound,
    Exists,
    Dead,
    Busy,
    Limit,
    /// The session's working directory cannot be entered.
    BadCwd,
    /// The shell is not one program, or cannot be executed.
    BadShell,
    /// The command of a run is too long or holds a NUL byte.
    BadCommand,
    /// The input of a run is too long, or could not be staged.
    BadInput,
    /// Anything else wrong with the request (the session name; a start-up step of the shell): also
    /// what an older init's `invalid` means, for it said no more.
    Invalid,
}

impl SessionErrorKind {
    /// The request field an invalid-request kind blames; None for the other kinds.
    pub fn field(self) -> Option<&'static str> {
        match self {
            SessionErrorKind::BadCwd => Some("cwd"),
            SessionErrorKind::BadShell => Some("shell"),
            SessionErrorKind::BadCommand => Some("command"),
            SessionErrorKind::BadInput => Some("input"),
            SessionErrorKind::Invalid => Some("name"),
            SessionErrorKind::NotFound
            | SessionErrorKind::Exists
            | SessionErrorKind::Dead
            | SessionErrorKind::Busy
            | SessionErrorKind::Limit => None,
        }
    }
}

/// What init failed at, carried by [`Reply::Error`]: the runtime classifies a refusal by this,
/// never by the message's text (which is for people).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InitErrorKind {
    /// The working directory cannot be entered (chdir failed, as the command's user).
    BadCwd,
    /// The program cannot be executed (no PATH candidate could be exec'd).
    BadExec,
    /// The user is not a name of the sandbox's /etc/passwd nor `uid[:gid]`.
    BadUser,
    /// The sandbox's root filesystem is gone (ENOTCONN: its file server was lost).
    RootGone,
    /// No process of that pid is kept by init.
    NoProcess,
    /// The process cannot take the request (ended, stdin closed, no terminal, pid not signallable,
    /// a queue full, a bad terminal size).
    Refused,
    /// The request could not be read, or is not one this init serves.
    Protocol,
    /// Setting the command up failed in init itself (pipe, fork, pty, dup2, ids, a NUL byte).
    Spawn,
    /// Anything else. An older init's reply carries no kind and decodes as this, as does a kind
    /// this runtime does not know.
    #[default]
    #[serde(other)]
    Other,
}

impl InitErrorKind {
    /// The request field a refusal of this kind blames: None for the kinds that are not the
    /// request's fault (or not its spec's).
    pub fn spec_field(self) -> Option<&'static str> {
        match self {
            InitErrorKind::BadCwd => Some("cwd"),
            InitErrorKind::BadExec => Some("argv"),
            InitErrorKind::BadUser => Some("user"),
            InitErrorKind::RootGone
            | InitErrorKind::NoProcess
            | InitErrorKind::Refused
            | InitErrorKind::Protocol
            | InitErrorKind::Spawn
            | InitErrorKind::Other => None,
        }
    }

    /// The kind of a failed system call: ENOTCONN (the root's file server went away) wins over
    /// what the call was for.
    pub fn of_errno(errno: i32, otherwise: InitErrorKind) -> InitErrorKind {
        if errno == libc::ENOTCONN {
            InitErrorKind::RootGone
        } else {
            otherwise
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ExecSpec {
    /// Full argv (argv[0] looked up in PATH).
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    pub stdin: Option<Vec<u8>>,
    pub timeout_ms: Option<u64>,
    pub background: bool,
    /// A name from the sandbox's /etc/passwd or `uid[:gid]`; None: root.
    #[serde(default)]
    pub user: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Reply {
    /// The command started (pid inside the sandbox); for background execs this is the only frame.
    Started {
        pid: i32,
        log_path: Option<String>,
    },
    Exit {
        exit_code: Option<i32>,
        signal: Option<i32>,
        timed_out: bool,
        duration_ms: u64,
    },
    Processes {
        list: Vec<Proc>,
    },
    Ok,
    Error {
        /// Absent from an older init's replies (a restored sandbox may run one): `Other`.
        #[serde(default)]
        kind: InitErrorKind,
        message: String,
    },
    Sessions {
        list: Vec<SessionStatus>,
    },
    /// The end of a session run. `exit_code` is the shell's `$?` after the command (130 after an
    /// interrupt), or the shell's own status when it died (`alive` false).
    SessionDone {
        exit_code: Option<i32>,
        signal: Option<i32>,
        timed_out: bool,
        interrupted: bool,
        alive: bool,
        duration_ms: u64,
    },
    SessionError {
        kind: SessionErrorKind,
        message: String,
    },
    Live {
        list: Vec<LiveInfo>,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Proc {
    pub pid: i32,
    pub argv: Vec<String>,
    pub running: bool,
}

/// Encodes one frame.
pub fn encode(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.extend_from_slice(&((payload.len() + 1) as u32).to_be_bytes());
    out.push(kind);
    out.extend_from_slice(payload);
    out
}

pub fn encode_json<T: Serialize>(v: &T) -> Vec<u8> {
    encode(KIND_JSON, &serde_json::to_vec(v).unwrap_or_default())
}

pub fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    w.write_all(&encode(kind, payload))
}

/// Reads one frame; `Ok(None)` at a clean EOF before the frame started.
pub fn read_frame(r: &mut impl Read) -> io::Result<Option<(u8, Vec<u8>)>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad frame length {len}"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    let kind = buf.remove(0);
    Ok(Some((kind, buf)))
}

/// Config handed by the runtime to `grove-init --setup` on stdin.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SetupConfig {
    /// Host path of the mounted root.
    pub root: String,
    pub hostname: String,
    /// cgroup.procs files to join (host paths).
    pub cgroup_procs: Vec<String>,
    /// Host path of the init binary (bind-mounted at INIT_PATH).
    pub init_binary: String,
    pub tmp_size_mb: u64,
    pub shm_size_mb: u64,
    pub open_files: u64,
    /// Create a new network namespace (always true today; false is for tests of the setup itself).
    pub new_netns: bool,
    /// CAP_* numbers kept in the bounding set beyond `harden::KEEP_CAPS` (the spec's `cap_add`).
    #[serde(default)]
    pub extra_caps: Vec<u32>,
    /// Pid 1 runs in a user namespace of its own (its uid/gid maps and cgroups were set by the
    /// runtime before it ran): /dev's nodes are binds of the host's, which it cannot mknod.
    #[serde(default)]
    pub userns: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setup_owner_is_read_from_cmdline() {
        let cmd = b"/x/grove-init\0--setup\0--instance\0grove-a\0--sandbox\0sb-0123456789ab\0";
        assert_eq!(
            setup_owner(cmd),
            Some(("grove-a".into(), "sb-0123456789ab".into()))
        );
        assert_eq!(setup_owner(b"/x/grove-init\0--setup\0"), None);
        assert_eq!(setup_owner(b"/x/grove-init\0--setup\0--instance\0"), None);
    }

    fn decode(json: &str) -> Reply {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn error_kind_decodes_with_and_without_kind() {
        let r = Reply::Error {
            kind: InitErrorKind::BadCwd,
            message: "cwd \"/x\": ENOENT".into(),
        };
        let wire = serde_json::to_string(&r).unwrap();
        assert!(wire.contains(r#""kind":"bad_cwd""#), "{wire}");
        assert!(matches!(
            decode(&wire),
            Reply::Error { kind: InitErrorKind::BadCwd, message } if message == "cwd \"/x\": ENOENT"
        ));
        // An older init (a restored sandbox's) sends no kind: the generic one, message kept.
        assert!(matches!(
            decode(r#"{"type":"error","message":"cwd \"/x\": ENOENT"}"#),
            Reply::Error { kind: InitErrorKind::Other, message } if message.starts_with("cwd")
        ));
        // A kind this runtime does not know is the generic one too.
        assert!(matches!(
            decode(r#"{"type":"error","kind":"from_the_future","message":"m"}"#),
            Reply::Error {
                kind: InitErrorKind::Other,
                ..
            }
        ));
        for k in [
            InitErrorKind::BadCwd,
            InitErrorKind::BadExec,
            InitErrorKind::BadUser,
            InitErrorKind::RootGone,
            InitErrorKind::NoProcess,
            InitErrorKind::Refused,
            InitErrorKind::Protocol,
            InitErrorKind::Spawn,
            InitErrorKind::Other,
        ] {
            let wire = serde_json::to_string(&Reply::Error {
                kind: k,
                message: String::new(),
            })
            .unwrap();
            assert!(
                matches!(decode(&wire), Reply::Error { kind, .. } if kind == k),
                "{wire}"
            );
        }
    }

    #[test]
    fn errno_kind() {
        assert_eq!(
            InitErrorKind::of_errno(libc::ENOTCONN, InitErrorKind::BadCwd),
            InitErrorKind::RootGone
        );
        assert_eq!(
            InitErrorKind::of_errno(libc::ENOENT, InitErrorKind::BadCwd),
            InitErrorKind::BadCwd
        );
    }

    #[test]
    fn session_error_kinds() {
        // An older init's `invalid` still decodes (as the generic invalid request).
        assert!(matches!(
            decode(r#"{"type":"session_error","kind":"invalid","message":"cwd: x"}"#),
            Reply::SessionError {
                kind: SessionErrorKind::Invalid,
                ..
            }
        ));
        assert!(matches!(
            decode(r#"{"type":"session_error","kind":"bad_cwd","message":"m"}"#),
            Reply::SessionError {
                kind: SessionErrorKind::BadCwd,
                ..
            }
        ));
        assert_eq!(SessionErrorKind::BadCwd.field(), Some("cwd"));
        assert_eq!(SessionErrorKind::BadShell.field(), Some("shell"));
        assert_eq!(SessionErrorKind::BadCommand.field(), Some("command"));
        assert_eq!(SessionErrorKind::BadInput.field(), Some("input"));
        assert_eq!(SessionErrorKind::Invalid.field(), Some("name"));
        assert_eq!(SessionErrorKind::Busy.field(), None);
    }

    #[test]
    fn frames_roundtrip() {
        let f = encode(KIND_STDOUT, b"hello");
        let mut r = &f[..];
        assert_eq!(
            read_frame(&mut r).unwrap().unwrap(),
            (KIND_STDOUT, b"hello".to_vec())
        );
        assert!(read_frame(&mut r).unwrap().is_none());
        assert!(read_frame(&mut &f[..6]).is_err(), "truncated frame");
        assert!(
            read_frame(&mut &[0u8, 0, 0, 0, 1][..]).is_err(),
            "zero length"
        );
    }
}
