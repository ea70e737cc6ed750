//! One registry repository over HTTPS (plain HTTP for the registries listed as insecure):
//! requests under `/v2/<repo>/`, with the auth a 401 asks for (a `Bearer` token from the realm
//! it names, or `Basic`) and blob redirects followed.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue, Request, Response, StatusCode, Uri};
use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty, Limited};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::pull::PullError;
use super::{Credentials, RegistriesConfig};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// For the answer's head; bodies have their own idle limit.
const HEAD_TIMEOUT: Duration = Duration::from_secs(60);
const MAX_REDIRECTS: usize = 5;
/// Token answers, error bodies, manifests and configs are read whole up to this much.
pub(super) const MAX_SMALL_BODY: usize = 4 << 20;

pub(super) struct Registry {
    /// `host[:port]` spoken to (the registry or one of its mirrors).
    pub host: String,
    repo: String,
    creds: Option<Credentials>,
    cfg: Arc<RegistriesConfig>,
    /// The `Authorization` value that worked, reused for every later request.
    auth: tokio::sync::Mutex<Option<HeaderValue>>,
    http: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
}

impl Registry {
    pub fn new(cfg: Arc<RegistriesConfig>, host: &str, repo: &str) -> Result<Registry, PullError> {
        let tls = super::tls::client_config(&cfg).map_err(|why| PullError::Unreachable {
            registry: host.into(),
            why,
        })?;
        let mut conn = HttpConnector::new();
        conn.set_connect_timeout(Some(CONNECT_TIMEOUT));
        conn.set_nodelay(true);
        conn.enforce_http(false);
        // Either scheme is dialled; which one a URL may have is decided per host (`may_dial`).
        let conn = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*tls).clone())
            .https_or_http()
            .enable_http1()
            .wrap_connector(conn);
        Ok(Registry {
            host: host.into(),
            repo: repo.into(),
            creds: cfg.credentials_for(host),
            cfg,
            auth: tokio::sync::Mutex::new(None),
            http: Client::builder(TokioExecutor::new()).build(conn),
        })
    }

    /// The scheme this registry is spoken to with.
    fn scheme(&self) -> &'static str {
        if self.cfg.is_insecure(&self.host) {
            "http"
        } else {
            "https"
        }
    }

    fn unreachable(&self, why: impl std::fmt::Display) -> PullError {
        PullError::Unreachable {
            registry: self.host.clone(),
            why: why.to_string(),
        }
    }

    async fn send(
        &self,
        uri: &Uri,
        accept: &str,
        auth: Option<&HeaderValue>,
    ) -> Result<Response<Incoming>, PullError> {
        let mut b = Request::get(uri.clone()).header(header::USER_AGENT, "grove");
        if !accept.is_empty() {
            b = b.header(header::ACCEPT, accept);
        }
        if let Some(a) = auth {
            b = b.header(header::AUTHORIZATION, a.clone());
        }
        let req = b
            .body(Empty::new())
            .map_err(|e| self.unreachable(format!("building a request for {uri}: {e}")))?;
        match tokio::time::timeout(HEAD_TIMEOUT, self.http.request(req)).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(match super::tls::failure(&e) {
                Some(why) => PullError::Untrusted {
                    registry: self.host.clone(),
                    why,
                },
                None => self.unreachable(crate::error::chain(&e)),
            }),
            Err(_) => Err(self.unreachable(format!("no answer in {HEAD_TIMEOUT:?}"))),
        }
    }

    /// GET `/v2/<repo>/<path>`: authenticates when asked, follows redirects (to hosts that may
    /// be spoken to, without the registry's credentials). Any final status is the caller's.
    pub async fn get(&self, path: &str, accept: &str) -> Result<Response<Incoming>, PullError> {
        let first: Uri = format!("{}://{}/v2/{}/{path}", self.scheme(), self.host, self.repo)
            .parse()
            .map_err(|e| self.unreachable(format!("bad URL: {e}")))?;
        let mut authed = false;
        loop {
            let auth = self.auth.lock().await.clone();
            let mut uri = first.clone();
            let mut resp = self.send(&uri, accept, auth.as_ref()).await?;
            let mut hops = 0;
            while resp.status().is_redirection() {
                hops += 1;
                if hops > MAX_REDIRECTS {
                    return Err(self.unreachable(format!("more than {MAX_REDIRECTS} redirects")));
                }
                let loc = resp
                    .headers()
                    .get(header::LOCATION)
                    .and_then(|l| l.to_str().ok())
                    .ok_or_else(|| self.unreachable("a redirect without Location"))?;
                let next = resolve(&uri, loc)
                    .ok_or_else(|| self.unreachable(format!("bad redirect {loc:?}")))?;
                if !self.cfg.may_dial(&next) {
                    return Err(self.unreachable(format!(
                        "redirected to {next}: plain HTTP, to a host not listed in \
                         registries.insecure"
                    )));
                }
                let same = next.authority() == first.authority();
                uri = next;
                resp = self
                    .send(&uri, accept, auth.as_ref().filter(|_| same))
                    .await?;
            }
            if resp.status() != StatusCode::UNAUTHORIZED || authed {
                return Ok(resp);
            }
            let challenge = resp
                .headers()
                .get(header::WWW_AUTHENTICATE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            self.authenticate(&challenge).await?;
            authed = true;
        }
    }

    fn denied(&self, why: impl Into<String>) -> PullError {
        PullError::Denied {
            registry: self.host.clone(),
            why: why.into(),
        }
    }

    fn basic(&self) -> Option<HeaderValue> {
        let c = self.creds.as_ref()?;
        let raw = format!("{}:{}", c.username, c.password);
        let v = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(raw)
        );
        HeaderValue::from_str(&v).ok()
    }

    /// Answers a 401's challenge: stores the `Authorization` to send from now on.
    async fn authenticate(&self, challenge: &str) -> Result<(), PullError> {
        let (scheme, params) = challenge.split_once(' ').unwrap_or((challenge, ""));
        let params = parse_params(params);
        let value = if scheme.eq_ignore_ascii_case("basic") {
            self.basic()
                .ok_or_else(|| self.denied("it asks for a password and none is configured"))?
        } else if scheme.eq_ignore_ascii_case("bearer") {
            let realm = params
                .iter()
                .find(|(k, _)| k == "realm")
                .map(|(_, v)| v.clone())
                .ok_or_else(|| self.denied("a Bearer challenge without a realm"))?;
            let mut q = Vec::new();
            if let Some((_, s)) = params.iter().find(|(k, _)| k == "service") {
                q.push(format!("service={}", crate::client::enc(s)));
            }
            let scope = params
                .iter()
                .find(|(k, _)| k == "scope")
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| format!("repository:{}:pull", self.repo));
            q.push(format!("scope={}", crate::client::enc(&scope)));
            let sep = if realm.contains('?') { '&' } else { '?' };
            let url = format!("{realm}{sep}{}", q.join("&"));
            let uri: Uri = url
                .parse()
                .map_err(|_| self.denied(format!("token realm {realm:?} is not a URL")))?;
            // The password goes only over TLS, or in the clear to a host listed as insecure.
            if !self.cfg.may_dial(&uri) {
                return Err(self.denied(format!(
                    "token realm {realm:?} is plain HTTP to a host not listed in \
                     registries.insecure"
                )));
            }
            let resp = self
                .send(&uri, "application/json", self.basic().as_ref())
                .await?;
            let status = resp.status();
            let body = read_small(resp.into_body())
                .await
                .map_err(|e| self.unreachable(format!("reading the token: {e}")))?;
            if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
                return Err(self.denied(format!(
                    "the token service answered {}: {}",
                    status.as_u16(),
                    snippet(&body)
                )));
            }
            if !status.is_success() {
                return Err(self.unreachable(format!(
                    "the token service answered {}: {}",
                    status.as_u16(),
                    snippet(&body)
                )));
            }
            let v: serde_json::Value = serde_json::from_slice(&body)
                .map_err(|e| self.unreachable(format!("a token answer that is not JSON: {e}")))?;
            let tok = v
                .get("token")
                .or_else(|| v.get("access_token"))
                .and_then(|t| t.as_str())
                .filter(|t| !t.is_empty())
                .ok_or_else(|| self.unreachable("a token answer without a token"))?;
            HeaderValue::from_str(&format!("Bearer {tok}"))
                .map_err(|_| self.unreachable("a token that is not a header value"))?
        } else {
            return Err(self.denied(format!(
                "it asks for authentication this client does not speak: {challenge:?}"
            )));
        };
        *self.auth.lock().await = Some(value);
        Ok(())
    }
}

/// `Location` against the URL it came from.
fn resolve(base: &Uri, loc: &str) -> Option<Uri> {
    if loc.starts_with("http://") || loc.starts_with("https://") {
        return loc.parse().ok();
    }
    if loc.starts_with('/') {
        let a = base.authority()?;
        return format!("{}://{a}{loc}", base.scheme_str()?).parse().ok();
    }
    None
}

/// `k="v",k2=v2` of an auth challenge.
fn parse_params(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let Some((k, after)) = rest.split_once('=') else {
            break;
        };
        let k = k.trim().trim_start_matches(',').trim().to_ascii_lowercase();
        let after = after.trim_start();
        let (v, tail) = if let Some(q) = after.strip_prefix('"') {
            match q.find('"') {
                Some(end) => (&q[..end], &q[end + 1..]),
                None => (q, ""),
            }
        } else {
            match after.find(',') {
                Some(end) => (&after[..end], &after[end..]),
                None => (after, ""),
            }
        };
        out.push((k, v.to_string()));
        rest = tail.trim_start().trim_start_matches(',').trim_start();
    }
    out
}

/// A whole small body, refused past [`MAX_SMALL_BODY`].
pub(super) async fn read_small(body: Incoming) -> Result<Bytes, String> {
    match tokio::time::timeout(HEAD_TIMEOUT, Limited::new(body, MAX_SMALL_BODY).collect()).await {
        Ok(Ok(b)) => Ok(b.to_bytes()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("not read in {HEAD_TIMEOUT:?}")),
    }
}

/// The start of an error body, for messages.
pub(super) fn snippet(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(&b[..b.len().min(300)]);
    s.trim().replace(['\n', '\r'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_challenges() {
        let p = parse_params(
            r#"realm="http://127.0.0.1:1/token",service="reg",scope="repository:a/b:pull,push""#,
        );
        assert_eq!(p[0], ("realm".into(), "http://127.0.0.1:1/token".into()));
        assert_eq!(p[1], ("service".into(), "reg".into()));
        assert_eq!(p[2], ("scope".into(), "repository:a/b:pull,push".into()));
        assert_eq!(parse_params("realm=x, a=b")[1], ("a".into(), "b".into()));
    }
}

#[cfg(test)]
mod tls_tests {
    use super::*;

    /// A registry that answers TLS in plain HTTP (one not listed as insecure) fails as a TLS
    /// failure, whose message says where to list it, not as a registry that is down.
    #[tokio::test]
    async fn a_plain_http_answer_to_tls_is_a_tls_failure() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            for mut c in l.incoming().flatten() {
                let mut b = [0u8; 512];
                let _ = c.read(&mut b);
                let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
            }
        });
        let host = format!("127.0.0.1:{port}");
        let r = Registry::new(Arc::new(RegistriesConfig::default()), &host, "x").unwrap();
        match r.get("manifests/1", "").await {
            Err(PullError::Untrusted { registry, why }) => {
                assert_eq!(registry, host);
                assert!(why.contains("corrupt message"), "{why}");
            }
            other => panic!("{:?}", other.map(|r| r.status())),
        }
    }
}
