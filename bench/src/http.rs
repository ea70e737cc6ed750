//! A minimal blocking HTTP/1.1 client over a unix socket with one kept-alive connection — what a
//! training loop's client does — so the `api` scenario times groved, not connection set-up or a
//! heavyweight client library.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

pub struct Conn {
    socket: PathBuf,
    stream: Option<BufReader<UnixStream>>,
}

pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_slice(&self.body).context("response body is not JSON")
    }

    /// The body as JSON, or an error carrying the status and body when it is not a 2xx.
    pub fn ok_json(&self) -> Result<serde_json::Value> {
        if !(200..300).contains(&self.status) {
            bail!(
                "HTTP {}: {}",
                self.status,
                String::from_utf8_lossy(&self.body).trim()
            );
        }
        self.json()
    }
}

impl Conn {
    pub fn new(socket: &Path) -> Conn {
        Conn {
            socket: socket.into(),
            stream: None,
        }
    }

    /// Sends one request (JSON body if any) on the kept-alive connection, reconnecting once if the
    /// server closed it between requests.
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<Response> {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: grove\r\n");
        if !body.is_empty() {
            head.push_str("Content-Type: application/json\r\n");
        }
        head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        let reused = self.stream.is_some();
        match self.round_trip(&head, &body) {
            Ok(r) => Ok(r),
            // Only a request the server never saw (it had closed the idle connection) is resent:
            // a create must not run twice.
            Err(Trip::Unsent(_)) if reused => {
                self.stream = None;
                self.round_trip(&head, &body).map_err(Trip::into_inner)
            }
            Err(e) => Err(e.into_inner()),
        }
    }

    fn round_trip(&mut self, head: &str, body: &str) -> Result<Response, Trip> {
        if self.stream.is_none() {
            let s = UnixStream::connect(&self.socket)
                .with_context(|| format!("connecting to {}", self.socket.display()))
                .map_err(Trip::Sent)?;
            self.stream = Some(BufReader::new(s));
        }
        let Some(conn) = self.stream.as_mut() else {
            unreachable!("connected above")
        };
        let mut req = Vec::with_capacity(head.len() + body.len());
        req.extend_from_slice(head.as_bytes());
        req.extend_from_slice(body.as_bytes());
        let r = match conn.get_mut().write_all(&req) {
            Err(e) => Err(Trip::Unsent(e.into())),
            Ok(()) => read_response(conn),
        };
        if r.is_err() {
            self.stream = None;
        }
        r
    }
}

/// How a round trip failed: before the server could have seen the request, or after.
enum Trip {
    Unsent(anyhow::Error),
    Sent(anyhow::Error),
}

impl Trip {
    fn into_inner(self) -> anyhow::Error {
        match self {
            Trip::Unsent(e) | Trip::Sent(e) => e,
        }
    }
}

fn read_response(conn: &mut BufReader<UnixStream>) -> Result<Response, Trip> {
    let mut line = String::new();
    match conn.read_line(&mut line) {
        // Closed without a byte of answer: an idle connection the server had already dropped.
        Ok(0) => Err(Trip::Unsent(anyhow::anyhow!(
            "connection closed before a response"
        ))),
        Ok(_) => read_rest(conn, line).map_err(Trip::Sent),
        Err(e) => Err(Trip::Sent(e.into())),
    }
}

fn read_rest(conn: &mut BufReader<UnixStream>, mut line: String) -> Result<Response> {
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line {line:?}"))?;
    let mut length = None;
    let mut chunked = false;
    loop {
        line.clear();
        conn.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            if k == "content-length" {
                length = Some(v.parse::<usize>().context("bad content-length")?);
            } else if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
                chunked = true;
            }
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            line.clear();
            conn.read_line(&mut line)?;
            let n = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .with_context(|| format!("bad chunk size {line:?}"))?;
            let start = body.len();
            body.resize(start + n, 0);
            conn.read_exact(&mut body[start..])?;
            line.clear();
            conn.read_line(&mut line)?;
            if n == 0 {
                break;
            }
        }
    } else if let Some(n) = length {
        body.resize(n, 0);
        conn.read_exact(&mut body)?;
    }
    Ok(Response { status, body })
}
