//! Pulling images from OCI registries (the distribution protocol): references, credentials,
//! the HTTP client with its token dance, and the pull that streams layers into the store.

mod http;
pub mod pull;
pub mod reference;
mod tls;

use std::collections::BTreeMap;
use std::path::PathBuf;

use base64::Engine as _;
use serde::Deserialize;

pub use pull::{PullError, PullEvent};
pub use reference::Reference;

/// `[registries]` in groved.toml.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistriesConfig {
    /// Registries (`host[:port]`) spoken to over plain HTTP; every other one over HTTPS.
    pub insecure: Vec<String>,
    /// PEM files of certificate authorities trusted beside the system's (`/etc/ssl/certs`), for
    /// registries whose certificates a private CA signs.
    pub ca_files: Vec<PathBuf>,
    /// Per registry, mirrors (`host[:port]`) tried in order before it.
    pub mirrors: BTreeMap<String, Vec<String>>,
    /// Per registry, a user and password.
    pub credentials: BTreeMap<String, Credentials>,
    /// A docker-style `auth.json` / `config.json` (`{"auths": {"host": {"auth": base64}}}`);
    /// default: `$REGISTRY_AUTH_FILE`, else `/run/containers/0/auth.json`, else
    /// `/root/.docker/config.json`, whichever exists.
    pub auth_file: Option<PathBuf>,
}

#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({:?}, <password>)", self.username)
    }
}

impl RegistriesConfig {
    pub fn is_insecure(&self, host: &str) -> bool {
        self.insecure.iter().any(|h| h == host)
    }

    /// Whether a URL (a redirect's target, a token realm) may be dialled: HTTPS anywhere, plain
    /// HTTP only to a host listed as insecure.
    pub fn may_dial(&self, uri: &axum::http::Uri) -> bool {
        let host = uri.authority().map(|a| a.as_str()).unwrap_or("");
        match uri.scheme_str() {
            Some("https") => !host.is_empty(),
            Some("http") => self.is_insecure(host),
            _ => false,
        }
    }

    /// The credentials for `host`: the config's own, else the auth file's.
    pub fn credentials_for(&self, host: &str) -> Option<Credentials> {
        if let Some(c) = self.credentials.get(host) {
            return Some(c.clone());
        }
        let file = self.auth_file.clone().or_else(|| {
            std::env::var_os("REGISTRY_AUTH_FILE")
                .map(PathBuf::from)
                .into_iter()
                .chain([
                    PathBuf::from("/run/containers/0/auth.json"),
                    PathBuf::from("/root/.docker/config.json"),
                ])
                .find(|p| p.exists())
        })?;
        let text = std::fs::read(&file).ok()?;
        auth_file_entry(&text, host)
    }
}

/// The entry for `host` in a docker-style auth file.
fn auth_file_entry(text: &[u8], host: &str) -> Option<Credentials> {
    let v: serde_json::Value = serde_json::from_slice(text).ok()?;
    let auths = v.get("auths")?.as_object()?;
    let keys = [
        host.to_string(),
        format!("https://{host}"),
        format!("http://{host}"),
        format!("https://{host}/v1/"),
    ];
    let docker = ["https://index.docker.io/v1/".to_string()];
    let e = keys
        .iter()
        .chain(docker.iter().filter(|_| host == "docker.io"))
        .find_map(|k| auths.get(k))?;
    if let Some(a) = e.get("auth").and_then(|a| a.as_str()) {
        let raw = base64::engine::general_purpose::STANDARD.decode(a).ok()?;
        let s = String::from_utf8(raw).ok()?;
        let (u, p) = s.split_once(':')?;
        return Some(Credentials {
            username: u.into(),
            password: p.into(),
        });
    }
    Some(Credentials {
        username: e.get("username")?.as_str()?.into(),
        password: e.get("password")?.as_str()?.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_docker_auth_files() {
        let f = br#"{"auths": {"127.0.0.1:5000": {"auth": "dXNlcjpwYTpzcw=="},
                     "https://index.docker.io/v1/": {"username": "d", "password": "p"}}}"#;
        let c = auth_file_entry(f, "127.0.0.1:5000").unwrap();
        assert_eq!(
            (c.username.as_str(), c.password.as_str()),
            ("user", "pa:ss")
        );
        assert_eq!(auth_file_entry(f, "docker.io").unwrap().username, "d");
        assert!(auth_file_entry(f, "other:1").is_none());
        assert!(format!("{c:?}").contains("<password>"));
    }

    #[test]
    fn plain_http_only_to_insecure_hosts() {
        let cfg = RegistriesConfig {
            insecure: vec!["10.0.0.1:5000".into()],
            ..Default::default()
        };
        let ok = |u: &str| cfg.may_dial(&u.parse().unwrap());
        assert!(ok("https://auth.example.com/token"));
        assert!(ok("http://10.0.0.1:5000/v2/"));
        assert!(!ok("http://10.0.0.1:5001/v2/"));
        assert!(!ok("http://auth.example.com/token"));
        assert!(!ok("ftp://10.0.0.1:5000/x"));
        assert!(!ok("/relative"));
    }
}
