//! A start-up step of grove-init that failed (setup's, or the server's before it listens): the
//! system call or file operation and what it was doing. Its text is the `error <text>` line the
//! runtime reads on the init's stdout.

/// One failed step; `step` says what it was doing, on what.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("{step}: {errno}")]
    Sys { step: String, errno: nix::Error },
    #[error("{step}: {error}")]
    Io { step: String, error: std::io::Error },
}

/// For `map_err` on a nix call.
pub fn sys(step: impl Into<String>) -> impl FnOnce(nix::Error) -> StepError {
    let step = step.into();
    move |errno| StepError::Sys { step, errno }
}

/// For `map_err` on a std I/O call.
pub fn io(step: impl Into<String>) -> impl FnOnce(std::io::Error) -> StepError {
    let step = step.into();
    move |error| StepError::Io { step, error }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runtime shows these texts: they read as the `format!`s they replaced.
    #[test]
    fn reads_as_step_then_error() {
        assert_eq!(
            sys("pivot_root")(nix::Error::EPERM).to_string(),
            format!("pivot_root: {}", nix::Error::EPERM)
        );
        let e = std::io::Error::from_raw_os_error(libc::ENOENT);
        let want = format!("open /dev/null: {e}");
        assert_eq!(io("open /dev/null")(e).to_string(), want);
    }
}
