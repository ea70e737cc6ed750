//! Typed CRIU failures. Each carries the `Error (` lines of CRIU's log so callers see why.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No usable CRIU binary: none of the candidates exists or passes `criu check`.
    #[error("no usable criu binary (tried {tried:?})")]
    NotFound { tried: Vec<PathBuf> },
    /// `criu check` ran but did not say "Looks good".
    #[error("criu check with {binary} failed: {log_tail:?}")]
    CheckFailed {
        binary: PathBuf,
        log_tail: Vec<String>,
    },
    /// The CRIU process could not be started at all.
    #[error("cannot run {binary}")]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `criu dump` exited non-zero.
    #[error("criu dump of pid {pid} failed: {log_tail:?}")]
    DumpFailed { pid: i32, log_tail: Vec<String> },
    /// `criu dump` was killed by a signal (the OOM killer, a crash): it may have left its code
    /// or parasite in the processes it had seized (`grove_runtime::criu_leftovers`).
    #[error("criu dump of pid {pid} was killed by signal {signal} part-way: {log_tail:?}")]
    DumpKilled {
        pid: i32,
        signal: i32,
        log_tail: Vec<String>,
    },
    /// The dump hit a socket connected to a process outside the tree (e.g. a control connection
    /// of an exec in flight); retrying after it closes succeeds.
    #[error("criu dump of pid {pid}: a socket is connected outside the sandbox: {log_tail:?}")]
    ExternalSocket { pid: i32, log_tail: Vec<String> },
    /// `criu restore` exited non-zero.
    #[error("criu restore from {dir} failed: {log_tail:?}")]
    RestoreFailed { dir: PathBuf, log_tail: Vec<String> },
    /// CRIU claimed success but the pid file is missing or malformed.
    #[error("criu restore from {dir} wrote no usable pid file {pidfile}")]
    Pidfile { dir: PathBuf, pidfile: PathBuf },
    /// Filesystem work around a CRIU call (work dirs, logs).
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// The relevant CRIU log lines, if this failure has any.
    pub fn log_tail(&self) -> &[String] {
        match self {
            Error::CheckFailed { log_tail, .. }
            | Error::DumpFailed { log_tail, .. }
            | Error::DumpKilled { log_tail, .. }
            | Error::ExternalSocket { log_tail, .. }
            | Error::RestoreFailed { log_tail, .. } => log_tail,
            _ => &[],
        }
    }
}
