//! `grove build [-f Dockerfile] -t NAME [--build-arg K=V] [--allow CIDR] CONTEXT`: sends the
//! context (less what `.dockerignore` leaves out) as a tar and prints the build's log.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use axum::body::Bytes;
use clap::Args;
use http_body_util::BodyExt as _;
use hyper::Method;
use serde_json::Value;

use super::{CliError, CliResult};
use crate::build::glob::{clean, Ignore};
use crate::client::{check, enc, Client, SseParser};

#[derive(Args, Debug)]
pub struct BuildArgs {
    /// The Dockerfile (default CONTEXT/Dockerfile); it must lie inside the context.
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// The image to make (replaced if it exists).
    #[arg(short = 't', long = "tag")]
    pub tag: String,
    /// K=V for an ARG (repeatable).
    #[arg(long = "build-arg")]
    pub build_arg: Vec<String>,
    /// Let RUN steps reach CIDR[:PORT,PORT...] (repeatable); default is no network.
    #[arg(long)]
    pub allow: Vec<String>,
    /// Print only the image name at the end.
    #[arg(short, long)]
    pub quiet: bool,
    pub context: PathBuf,
}

pub async fn run(c: &Client, a: BuildArgs) -> CliResult {
    let ctx = a
        .context
        .canonicalize()
        .map_err(|e| CliError::Usage(format!("context {}: {e}", a.context.display())))?;
    let dockerfile = match &a.file {
        None => "Dockerfile".to_string(),
        Some(f) => {
            let f = f
                .canonicalize()
                .map_err(|e| CliError::Usage(format!("{}: {e}", f.display())))?;
            f.strip_prefix(&ctx)
                .map_err(|_| {
                    CliError::Usage(format!(
                        "the Dockerfile {} is not inside the context {}",
                        f.display(),
                        ctx.display()
                    ))
                })?
                .to_string_lossy()
                .into_owned()
        }
    };
    let tar = {
        let (ctx, keep) = (ctx.clone(), dockerfile.clone());
        tokio::task::spawn_blocking(move || context_tar(&ctx, &keep))
            .await
            .map_err(|e| CliError::Other(e.to_string()))??
    };
    let mut q = format!(
        "/v1/images/build?name={}&dockerfile={}",
        enc(&a.tag),
        enc(&dockerfile)
    );
    for b in &a.build_arg {
        q.push_str(&format!("&build_arg={}", enc(b)));
    }
    for al in &a.allow {
        q.push_str(&format!("&allow={}", enc(al)));
    }
    let resp = check(
        c.send(
            Method::POST,
            &q,
            Some("application/x-tar"),
            Bytes::from(tar),
        )
        .await?,
    )
    .await?;
    let mut body = resp.into_body();
    let mut sse = SseParser::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(crate::client::ClientError::from)?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        for (event, data) in sse.push(data) {
            let v: Value = serde_json::from_str(&data)
                .map_err(|e| CliError::Other(format!("bad event: {e}")))?;
            match event.as_str() {
                "step" if !a.quiet => {
                    let cached = if v["cached"] == true { " (cached)" } else { "" };
                    println!(
                        "STEP {}/{}: {}{cached}",
                        v["step"],
                        v["total"],
                        v["instruction"].as_str().unwrap_or("")
                    );
                }
                "output" if !a.quiet => {
                    let d = v["data"].as_str().unwrap_or("");
                    if v["stream"] == "stderr" {
                        eprint!("{d}");
                    } else {
                        print!("{d}");
                        std::io::stdout().flush()?;
                    }
                }
                "done" => {
                    println!("{}", v["image"]["name"].as_str().unwrap_or(&a.tag));
                    return Ok(());
                }
                "error" => {
                    return Err(CliError::Other(format!(
                        "{}: {}",
                        v["code"].as_str().unwrap_or("error"),
                        v["message"].as_str().unwrap_or("")
                    )))
                }
                _ => {}
            }
        }
    }
    Err(CliError::Other(
        "the build's log ended without a result".into(),
    ))
}

/// The context as a tar in memory; `.dockerignore` applies, but never to the Dockerfile or to
/// `.dockerignore` itself. Symlinks are sent as links.
fn context_tar(ctx: &Path, dockerfile: &str) -> CliResult<Vec<u8>> {
    let ignore = std::fs::read_to_string(ctx.join(".dockerignore"))
        .map(|t| Ignore::parse(&t))
        .unwrap_or_default();
    let keep = [clean(dockerfile), ".dockerignore".to_string()];
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(ctx.join(&rel))?.collect::<Result<_, _>>()?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let r = rel.join(e.file_name());
            let rs = r.to_string_lossy().into_owned();
            if !keep.contains(&rs) && ignore.excluded(&rs) {
                continue;
            }
            let ft = e.file_type()?;
            if ft.is_dir() {
                b.append_dir(&r, e.path())?;
                stack.push(r);
            } else if ft.is_file() || ft.is_symlink() {
                b.append_path_with_name(e.path(), &r)?;
            }
        }
    }
    b.into_inner().map_err(CliError::from)
}
