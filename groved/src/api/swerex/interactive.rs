//! SWE-ReX's interactive commands (`is_interactive_command`, `is_interactive_quit`, `expect`): a
//! program such as gdb or a REPL that keeps running between actions. Grove's sessions run one
//! command to its end, so the program runs as a background job of the session, reading a FIFO and
//! writing a file in the sandbox (`/tmp/.grove-rex-<tag>/`): each action writes one line to the FIFO
//! and reads the new output until an `expect` string shows. All of it lives in the sandbox (the read
//! offset too), so a fork carries the program and its place into every branch.

use std::io::{Read as _, Seek as _, SeekFrom};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grove_runtime::{ExecRequest, Runtime, SandboxId};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::session::{backend, does_not_exist, observation, shell_quote};
use super::{backslashreplace, py_repr, RexError, RexResult};
use crate::error::ApiError;

/// How long an action waits for its `expect` when it gives no timeout (pexpect's default).
const DEFAULT_WAIT: Duration = Duration::from_secs(30);
/// With no `expect` strings, an action ends once the program has been quiet this long.
const QUIET: Duration = Duration::from_millis(300);
const POLL: Duration = Duration::from_millis(20);
/// The most output one action returns.
const MAX_OUT: u64 = 16 << 20;

/// The sandbox directory of `session`'s interactive program.
pub fn dir_of(session: &str) -> String {
    let h = Sha256::digest(session.as_bytes());
    let tag: String = h[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("/tmp/.grove-rex-{tag}")
}

fn exec(rt: &Runtime, id: &SandboxId, argv: &[&str], timeout_ms: u64) -> RexResult<()> {
    let req = ExecRequest {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        timeout_ms: Some(timeout_ms),
        max_output_bytes: Some(4096),
        ..Default::default()
    };
    rt.exec(id, req).map_err(ApiError::from)?;
    Ok(())
}

fn file(rt: &Runtime, id: &SandboxId, path: &str) -> Option<Vec<u8>> {
    rt.read_file(id, path).ok()
}

/// One interactive action in `session`.
pub fn run(
    rt: &Arc<Runtime>,
    id: &SandboxId,
    session: &str,
    command: &str,
    quit: bool,
    expect: &[String],
    timeout_ms: Option<u64>,
) -> RexResult<Value> {
    if !backend::exists(rt, id, session)? {
        return Err(does_not_exist(session));
    }
    let d = dir_of(session);
    let running =
        file(rt, id, &format!("{d}/pid")).is_some() && file(rt, id, &format!("{d}/exit")).is_none();
    if running {
        // One line to the program's stdin (the FIFO a holder keeps open, so it never sees EOF).
        exec(
            rt,
            id,
            &[
                "/bin/sh",
                "-c",
                "printf '%s\\n' \"$1\" > \"$2/in\"",
                "sh",
                command,
                &d,
            ],
            10_000,
        )?;
    } else if quit {
        return Err(RexError::exception(
            "swerex.exceptions.SwerexException",
            format!(
                "no interactive program runs in session {}",
                py_repr(session)
            ),
        ));
    } else {
        let q = shell_quote(&d);
        // The holder keeps the FIFO open for writing (so the program never reads EOF); the program's
        // job records its exit status and then ends the holder.
        let start = format!(
            "if rm -rf {q} && mkdir -p {q} && mkfifo {q}/in && : > {q}/out && echo 0 > {q}/off; then\n\
             sleep 2147483647 > {q}/in &\n\
             echo $! > {q}/holder\n\
             {{ {{ {command}\n}} < {q}/in > {q}/out 2>&1; echo $? > {q}/exit; kill $(cat {q}/holder) 2>/dev/null; }} &\n\
             echo $! > {q}/pid\n\
             else false; fi"
        );
        let r = backend::run(rt, id, session, &start, Some(10_000))?;
        if r.exit_code != Some(0) {
            return Err(RexError::exception(
                "swerex.exceptions.SwerexException",
                format!(
                    "starting {} failed: {}",
                    py_repr(command),
                    py_repr(&backslashreplace(&r.output))
                ),
            ));
        }
    }
    let wait = timeout_ms.map_or(DEFAULT_WAIT, Duration::from_millis);
    let (output, matched) = read_until(rt, id, &d, expect, quit, wait)?;
    let Some(matched) = matched else {
        return Err(RexError::exception(
            "swerex.exceptions.CommandTimeoutError",
            format!(
                "timeout after {} seconds while running command {}",
                wait.as_secs_f64(),
                py_repr(command)
            ),
        ));
    };
    if quit {
        // The program ended (or was told to): its job, holder and files go.
        let q = shell_quote(&d);
        let _ = backend::run(
            rt,
            id,
            session,
            &format!("kill $(cat {q}/pid) $(cat {q}/holder) 2>/dev/null; rm -rf {q}"),
            Some(10_000),
        );
    }
    let output = output.trim().to_string();
    Ok(observation(output, Some(0), &matched))
}

/// New output of the program from the stored offset until an `expect` string shows (returned with
/// the text before it; the offset moves past it), the program exits (quit), or `wait` passes.
fn read_until(
    rt: &Runtime,
    id: &SandboxId,
    d: &str,
    expect: &[String],
    quit: bool,
    wait: Duration,
) -> RexResult<(String, Option<String>)> {
    let off: u64 = file(rt, id, &format!("{d}/off"))
        .and_then(|b| String::from_utf8(b).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    let deadline = Instant::now() + wait;
    let mut seen = Vec::new();
    let mut last_change = Instant::now();
    loop {
        let (mut f, _) = rt
            .open_file(id, &format!("{d}/out"))
            .map_err(ApiError::from)?;
        let mut buf = Vec::new();
        f.seek(SeekFrom::Start(off))
            .and_then(|_| f.take(MAX_OUT).read_to_end(&mut buf))
            .map_err(|e| ApiError::internal(format!("reading the program's output: {e}")))?;
        if buf.len() != seen.len() {
            last_change = Instant::now();
        }
        seen = buf;
        let text = backslashreplace(&seen);
        let hit = expect
            .iter()
            .filter(|e| !e.is_empty())
            .filter_map(|e| text.find(e.as_str()).map(|at| (at, e)))
            .min_by_key(|(at, _)| *at);
        let exited = file(rt, id, &format!("{d}/exit")).is_some();
        let done = match hit {
            Some((at, e)) => {
                let consumed = text[..at + e.len()].len();
                // Bytes of the text up to the match (the text may hold escapes for bad bytes).
                let used = byte_len_of_prefix(&seen, consumed);
                Some((text[..at].to_string(), e.clone(), used))
            }
            None if exited && quit => Some((text.clone(), String::new(), seen.len())),
            None if exited => {
                return Err(RexError::exception(
                    "swerex.exceptions.SwerexException",
                    format!("the interactive program exited; output: {}", py_repr(&text)),
                ))
            }
            None if expect.is_empty() && !quit && last_change.elapsed() >= QUIET => {
                Some((text.clone(), String::new(), seen.len()))
            }
            None => None,
        };
        if let Some((out, matched, used)) = done {
            let _ = rt.write_file(
                id,
                &format!("{d}/off"),
                (off + used as u64).to_string().as_bytes(),
                None,
            );
            return Ok((out, Some(matched)));
        }
        if Instant::now() >= deadline {
            return Ok((text, None));
        }
        std::thread::sleep(POLL);
    }
}

/// How many bytes of `raw` make the first `chars_len` bytes of its backslash-replaced text.
fn byte_len_of_prefix(raw: &[u8], text_len: usize) -> usize {
    let mut text = 0;
    let mut bytes = 0;
    for chunk in raw.utf8_chunks() {
        for c in chunk.valid().chars() {
            if text >= text_len {
                return bytes;
            }
            text += c.len_utf8();
            bytes += c.len_utf8();
        }
        for _ in chunk.invalid() {
            if text >= text_len {
                return bytes;
            }
            text += 4;
            bytes += 1;
        }
    }
    bytes
}

/// Best-effort removal of a closed session's program files.
pub fn forget(rt: &Runtime, id: &SandboxId, session: &str) {
    let _ = exec(rt, id, &["rm", "-rf", &dir_of(session)], 10_000);
}

#[cfg(test)]
mod tests {
    #[test]
    fn prefix_lengths_count_replaced_bytes_once() {
        let raw = b"a\xffbc";
        assert_eq!(super::byte_len_of_prefix(raw, 1), 1);
        assert_eq!(super::byte_len_of_prefix(raw, 5), 2);
        assert_eq!(super::byte_len_of_prefix(raw, 6), 3);
    }
}
