//! The code of the `grove-init` binary: `--setup` (build the sandbox and become its pid 1) and
//! `--serve` (the init loop, exec'd from inside the sandbox).

pub mod harden;
mod live;
mod procs;
mod pty;
pub mod server;
pub mod session;
pub mod setup;
mod spawn;
mod step;
mod user;

use serde::{Deserialize, Serialize};

use crate::proto::{InitErrorKind, Reply};

/// A refusal of init's: what [`Reply::Error`] carries, and what a forked child hands its parent
/// through the status pipe when it cannot exec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub kind: InitErrorKind,
    pub message: String,
}

impl Failure {
    pub fn new(kind: InitErrorKind, message: impl Into<String>) -> Self {
        Failure {
            kind,
            message: message.into(),
        }
    }

    /// A failed system call: `what: errno`, of `kind` unless the errno says the root is gone.
    pub fn errno(kind: InitErrorKind, what: impl std::fmt::Display, e: nix::errno::Errno) -> Self {
        Failure {
            kind: InitErrorKind::of_errno(e as i32, kind),
            message: format!("{what}: {e}"),
        }
    }

    /// For the status pipe (a child writes it just before `_exit`).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_else(|_| self.message.clone().into_bytes())
    }

    /// What a child wrote on the status pipe; bytes that are no failure are taken as a message.
    pub fn decode(bytes: &[u8]) -> Self {
        serde_json::from_slice(bytes)
            .unwrap_or_else(|_| Failure::new(InitErrorKind::Spawn, String::from_utf8_lossy(bytes)))
    }
}

impl From<Failure> for Reply {
    fn from(f: Failure) -> Reply {
        Reply::Error {
            kind: f.kind,
            message: f.message,
        }
    }
}

/// Dispatches on argv[1].
pub fn main() -> ! {
    match std::env::args().nth(1).as_deref() {
        Some("--setup") => setup::main(),
        Some("--serve") => server::main(),
        _ => {
            eprintln!("usage: grove-init --setup | --serve (started by the Grove runtime)");
            std::process::exit(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_cross_the_status_pipe() {
        let f = Failure::errno(
            InitErrorKind::BadCwd,
            "cwd \"/x\"",
            nix::errno::Errno::ENOENT,
        );
        assert_eq!(f.kind, InitErrorKind::BadCwd);
        assert!(f.message.starts_with("cwd \"/x\": ENOENT"), "{}", f.message);
        assert_eq!(Failure::decode(&f.encode()), f);
        let gone = Failure::errno(InitErrorKind::BadExec, "exec", nix::errno::Errno::ENOTCONN);
        assert_eq!(gone.kind, InitErrorKind::RootGone);
        assert_eq!(
            Failure::decode(b"plain words"),
            Failure::new(InitErrorKind::Spawn, "plain words")
        );
        match Reply::from(f) {
            Reply::Error { kind, .. } => assert_eq!(kind, InitErrorKind::BadCwd),
            r => panic!("{r:?}"),
        }
    }
}
