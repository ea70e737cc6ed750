//! Image references as users write them: `[REGISTRY/]REPOSITORY[:TAG][@DIGEST]`, with Docker's
//! defaults (`docker.io`, `library/`, `latest`).

/// A parsed reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `host[:port]` as written (`docker.io` when none is).
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    /// `sha256:<64 hex>`.
    pub digest: Option<String>,
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

/// `sha256:` and 64 lowercase hex digits: the only digests pulls accept.
pub fn valid_digest(d: &str) -> bool {
    d.strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

fn valid_component(c: &str) -> bool {
    // [a-z0-9]+ separated by one `.`, `_`, `__` or `-`s (the distribution spec's grammar, loosely).
    !c.is_empty()
        && c.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        && c.as_bytes()[0].is_ascii_alphanumeric()
        && c.as_bytes()[c.len() - 1].is_ascii_alphanumeric()
        && !c.contains("..")
}

fn valid_host(h: &str) -> bool {
    let (host, port) = match h.rsplit_once(':') {
        Some((a, p)) if !a.ends_with(']') || a.starts_with('[') => (a, Some(p)),
        _ => (h, None),
    };
    !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-[]:".contains(&b))
        && port.is_none_or(|p| p.parse::<u16>().is_ok_and(|n| n > 0))
}

impl Reference {
    pub fn parse(s: &str) -> Result<Reference, String> {
        if s.is_empty() || s.len() > 512 {
            return Err("must be 1-512 characters".into());
        }
        if s.bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
        {
            return Err("holds whitespace or control characters".into());
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                if !valid_digest(d) {
                    return Err(format!("digest {d:?} is not sha256:<64 lowercase hex>"));
                }
                (r, Some(d.to_string()))
            }
            None => (s, None),
        };
        let (registry, path) = match rest.split_once('/') {
            Some((first, path))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                (first.to_string(), path)
            }
            _ => ("docker.io".to_string(), rest),
        };
        if !valid_host(&registry) {
            return Err(format!("registry {registry:?} is not host[:port]"));
        }
        let (repo, tag) = match path.rsplit_once(':') {
            Some((r, t)) if !t.contains('/') => (r, Some(t.to_string())),
            _ => (path, None),
        };
        if let Some(t) = &tag {
            let ok = t.len() <= 128
                && t.as_bytes()[0] != b'.'
                && t.as_bytes()[0] != b'-'
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
            if t.is_empty() || !ok {
                return Err(format!(
                    "tag {t:?} is not [A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}"
                ));
            }
        }
        if repo.is_empty() || repo.len() > 255 || !repo.split('/').all(valid_component) {
            return Err(format!(
                "repository {repo:?} is not lowercase [a-z0-9._-] components separated by /"
            ));
        }
        let repository = if registry == "docker.io" && !repo.contains('/') {
            format!("library/{repo}")
        } else {
            repo.to_string()
        };
        let tag = if tag.is_none() && digest.is_none() {
            Some("latest".to_string())
        } else {
            tag
        };
        Ok(Reference {
            registry,
            repository,
            tag,
            digest,
        })
    }

    /// What the manifest is asked for by: the digest when given (it pins the content), else the tag.
    pub fn wanted(&self) -> &str {
        self.digest
            .as_deref()
            .or(self.tag.as_deref())
            .unwrap_or("latest")
    }

    /// A Grove image name for it: the repository's last part and the tag (or the digest's start).
    pub fn default_name(&self) -> String {
        let last = self.repository.rsplit('/').next().unwrap_or("image");
        let suffix = match (&self.tag, &self.digest) {
            (Some(t), _) => t.clone(),
            (None, Some(d)) => d.trim_start_matches("sha256:")[..12].to_string(),
            (None, None) => "latest".into(),
        };
        let mut n = format!("{last}-{suffix}");
        n.truncate(128);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_with_docker_defaults() {
        let r = Reference::parse("debian").unwrap();
        assert_eq!(r.registry, "docker.io");
        assert_eq!(r.repository, "library/debian");
        assert_eq!(r.tag.as_deref(), Some("latest"));
        let d = format!("sha256:{}", "a".repeat(64));
        let r = Reference::parse(&format!("127.0.0.1:5000/ns/app:1.0@{d}")).unwrap();
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.repository, "ns/app");
        assert_eq!(r.tag.as_deref(), Some("1.0"));
        assert_eq!(r.wanted(), d);
        assert_eq!(r.default_name(), "app-1.0");
        let r = Reference::parse("localhost/x").unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str()),
            ("localhost", "x")
        );
    }

    #[test]
    fn refuses_what_could_escape_a_url() {
        for bad in [
            "",
            "a b",
            "Upper/x",
            "h:5000/../x",
            "h:5000/a/../../v2",
            "h:5000/a?x=1",
            "h:5000/a#f",
            "h:5000/a:t@sha256:zz",
            "h:5000/a:-t",
            "h:99999/a",
            "h:5000/",
            "h:5000/a//b",
            "h:5000/a%2f",
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad:?}");
        }
    }
}
