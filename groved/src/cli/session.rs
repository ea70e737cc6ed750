//! `grove session create|run|list|close|interrupt`: shell sessions whose state carries across runs.

use clap::{Args, Subcommand};
use hyper::Method;
use serde_json::{json, Value};

use super::{pairs, CliError, CliResult};
use crate::client::{check, enc, Client};

#[derive(Subcommand, Debug)]
pub enum SessionCmd {
    /// Start a named shell in a sandbox.
    Create(CreateArgs),
    /// Run one command in a session; prints its output, exits with its code.
    Run(RunArgs),
    /// List a sandbox's sessions.
    List {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// SIGINT to a session's foreground job.
    Interrupt { id: String, name: String },
    /// Kill a session's shell and everything it started.
    Close { id: String, name: String },
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    pub id: String,
    pub name: String,
    /// A POSIX shell (default bash).
    #[arg(long)]
    pub shell: Option<String>,
    /// KEY=VALUE (repeatable).
    #[arg(long, short = 'e')]
    pub env: Vec<String>,
    #[arg(long)]
    pub cwd: Option<String>,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    pub id: String,
    pub name: String,
    /// Seconds before the command is interrupted (the session lives on).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// The command, as shell text (joined with spaces).
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

fn base(id: &str) -> String {
    format!("/v1/sandboxes/{}/sessions", enc(id))
}

pub async fn run(c: &Client, cmd: SessionCmd) -> CliResult {
    match cmd {
        SessionCmd::Create(a) => {
            let mut body = json!({ "name": a.name, "env": pairs("--env", &a.env)? });
            if let Some(s) = a.shell {
                body["shell"] = s.into();
            }
            if let Some(d) = a.cwd {
                body["cwd"] = d.into();
            }
            let s: Value = c.json(Method::POST, &base(&a.id), Some(&body)).await?;
            println!("{}", s["name"].as_str().unwrap_or_default());
            Ok(())
        }
        SessionCmd::Run(a) => {
            let mut body = json!({ "command": a.command.join(" "), "encoding": "base64" });
            if let Some(t) = a.timeout {
                if !(t > 0.0 && t.is_finite()) {
                    return Err(CliError::Usage(format!("--timeout {t}: must be positive")));
                }
                body["timeout_ms"] = ((t * 1000.0).ceil() as u64).into();
            }
            let path = format!("{}/{}/run", base(&a.id), enc(&a.name));
            let r: Value = c.json(Method::POST, &path, Some(&body)).await?;
            use base64::Engine as _;
            let out = base64::engine::general_purpose::STANDARD
                .decode(r["output"].as_str().unwrap_or_default())
                .map_err(|e| CliError::Other(format!("output: {e}")))?;
            use std::io::Write as _;
            std::io::stdout().write_all(&out)?;
            std::io::stdout().flush()?;
            if r["timed_out"] == true {
                eprintln!("grove: timed out (the session lives on)");
            }
            if r["session_alive"] == false {
                eprintln!("grove: the session's shell exited");
            }
            match r["exit_code"].as_i64() {
                Some(0) => Ok(()),
                Some(code) => Err(CliError::Exit(code as i32)),
                None => Err(CliError::Exit(
                    128 + r["signal"].as_i64().unwrap_or(0) as i32,
                )),
            }
        }
        SessionCmd::List { id, json } => {
            let l: Value = c.json(Method::GET, &base(&id), None).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&l).unwrap_or_default());
                return Ok(());
            }
            println!(
                "{:<20} {:<8} {:<8} {:<6} SHELL",
                "NAME", "STATE", "PID", "BUSY"
            );
            for s in l["sessions"].as_array().into_iter().flatten() {
                let state = if s["alive"] == true { "alive" } else { "dead" };
                println!(
                    "{:<20} {:<8} {:<8} {:<6} {}",
                    s["name"].as_str().unwrap_or_default(),
                    state,
                    s["pid"],
                    s["busy"],
                    s["shell"].as_str().unwrap_or_default()
                );
            }
            Ok(())
        }
        SessionCmd::Interrupt { id, name } => {
            let path = format!("{}/{}/interrupt", base(&id), enc(&name));
            check(c.call(Method::POST, &path, None).await?).await?;
            Ok(())
        }
        SessionCmd::Close { id, name } => {
            let path = format!("{}/{}", base(&id), enc(&name));
            check(c.call(Method::DELETE, &path, None).await?).await?;
            Ok(())
        }
    }
}
