//! Request body parsing that names the offending field: syntax errors are 400 `invalid_json`, well-formed JSON
//! of the wrong shape (unknown field, wrong type, negative number) is 422 `invalid_request` with `field` set.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::error::{ApiError, ApiResult};

/// Like `axum::Json`, with errors that name the field. The body is required.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = body_bytes(req, state).await?;
        if is_blank(&bytes) {
            return Err(ApiError::bad_request(
                "invalid_json",
                "body",
                "a JSON request body is required",
            ));
        }
        parse_json(&bytes).map(ApiJson)
    }
}

/// For endpoints whose body is optional: an empty body parses as `{}`.
#[derive(Debug)]
pub struct OptionalJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for OptionalJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = body_bytes(req, state).await?;
        let bytes: &[u8] = if is_blank(&bytes) { b"{}" } else { &bytes };
        parse_json(bytes).map(OptionalJson)
    }
}

async fn body_bytes<S: Send + Sync>(req: Request, state: &S) -> ApiResult<Bytes> {
    Bytes::from_request(req, state).await.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::body_too_large()
        } else {
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_body", e.body_text())
        }
    })
}

fn is_blank(b: &[u8]) -> bool {
    b.iter().all(u8::is_ascii_whitespace)
}

/// Parses `bytes` as `T`, mapping failures as described in the module doc.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> ApiResult<T> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = inner.to_string();
        match inner.classify() {
            serde_json::error::Category::Data => {
                let field = field_of(&path, &msg);
                let said = user_terms(&field, &msg);
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request", said)
                    .with_field(field)
            }
            _ => ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", msg),
        }
    })?;
    de.end()
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", e.to_string()))?;
    Ok(value)
}

/// The dotted path of the field at fault, from serde_path_to_error's path and serde's message.
fn field_of(path: &str, msg: &str) -> String {
    let named = ["unknown field `", "missing field `"].iter().find_map(|p| {
        msg.split_once(p)
            .and_then(|(_, rest)| rest.split_once('`'))
            .map(|(f, _)| f.to_string())
    });
    let path = if path == "." { "" } else { path };
    match named {
        Some(f) if path.is_empty() => f,
        Some(f) if path.ends_with(&f) => path.to_string(),
        Some(f) if msg.starts_with("missing") => format!("{path}.{f}"),
        _ if path.is_empty() => "body".to_string(),
        _ => path.to_string(),
    }
}

/// serde's message for a well-formed body of the wrong shape, said in the API's terms: `{field}: what it
/// must be, got what`, without Rust type names or the body's line and column.
fn user_terms(field: &str, msg: &str) -> String {
    let msg = match msg.rsplit_once(" at line ") {
        Some((m, pos)) if pos.split(" column ").all(|n| n.parse::<u64>().is_ok()) => m,
        _ => msg,
    };
    let leaf = field.rsplit('.').next().unwrap_or(field);
    if msg.starts_with("missing field") {
        return format!("{field}: is required");
    }
    if msg.starts_with("unknown field") {
        let known = msg.split_once("expected ").map_or("", |(_, k)| k);
        return format!("{field}: is not a field here ({})", known.replace('`', ""));
    }
    if let Some(rest) = msg.strip_prefix("unknown variant ") {
        let (got, known) = rest.split_once(", expected ").unwrap_or((rest, ""));
        let known = known.trim_start_matches("one of ").replace('`', "");
        return format!(
            "{field}: must be one of {known}, got {}",
            got.replace('`', "")
        );
    }
    let (got, expected) = match msg
        .strip_prefix("invalid value: ")
        .or_else(|| msg.strip_prefix("invalid type: "))
        .and_then(|r| r.split_once(", expected "))
    {
        Some(x) => x,
        None => return format!("{field}: {msg}"),
    };
    let got = got.replace('`', "");
    let unsigned = ["u8", "u16", "u32", "u64", "usize"].contains(&expected);
    let wanted = match expected {
        _ if leaf == "cpu_millis" => "a positive number of millicores (1000 = one CPU)".to_string(),
        _ if unsigned && leaf.ends_with("_mb") => "a positive whole number of megabytes".into(),
        _ if unsigned && leaf.ends_with("_ms") => {
            "a whole number of milliseconds, 0 or more".into()
        }
        _ if unsigned && leaf.ends_with("_secs") => "a whole number of seconds, 0 or more".into(),
        _ if unsigned => format!("a whole number from 0 to {}", unsigned_max(expected)),
        "i8" | "i16" | "i32" | "i64" | "isize" => "a whole number".into(),
        "f32" | "f64" => "a number".into(),
        "a boolean" => "true or false".into(),
        "a sequence" => "a list".into(),
        e if e.starts_with("a map") || e.starts_with("struct ") => "an object".into(),
        e => e.to_string(),
    };
    format!("{field}: must be {wanted}, got {got}")
}

fn unsigned_max(t: &str) -> u64 {
    match t {
        "u8" => u8::MAX.into(),
        "u16" => u16::MAX.into(),
        "u32" => u32::MAX.into(),
        _ => u64::MAX,
    }
}

/// Decoded `key=value` pairs of a query string (repeated keys kept, in order).
pub fn query_pairs(query: Option<&str>) -> ApiResult<Vec<(String, String)>> {
    let q = query.unwrap_or("");
    serde_urlencoded_pairs(q)
}

fn serde_urlencoded_pairs(q: &str) -> ApiResult<Vec<(String, String)>> {
    let mut out = Vec::new();
    for part in q.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once('=').unwrap_or((part, ""));
        out.push((percent_decode(k)?, percent_decode(v)?));
    }
    Ok(out)
}

fn percent_decode(s: &str) -> ApiResult<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => out.push(b),
                    None => return Err(bad_query(s)),
                }
                i += 2;
            }
            b'%' => return Err(bad_query(s)),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).map_err(|_| bad_query(s))
}

fn bad_query(s: &str) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_query",
        format!("bad percent-encoding in {s:?}"),
    )
}

/// The value of a single-valued query parameter.
pub fn query_one<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .rev()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        #[allow(dead_code)]
        memory_mb: u64,
    }
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Outer {
        #[allow(dead_code)]
        image: String,
        #[allow(dead_code)]
        limits: Option<Inner>,
    }

    #[test]
    fn names_fields() {
        let e = parse_json::<Outer>(br#"{"image":"x","limits":{"memory_mb":-1}}"#).unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.field.as_deref()),
            (422, Some("limits.memory_mb"))
        );
        let e = parse_json::<Outer>(br#"{"image":"x","bogus":1}"#).unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.field.as_deref()),
            (422, Some("bogus"))
        );
        let e =
            parse_json::<Outer>(br#"{"image":"x","limits":{"memory_mb":1,"cpu":2}}"#).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("limits.cpu"));
        let e = parse_json::<Outer>(br#"{}"#).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("image"));
        let e = parse_json::<Outer>(br#"{"image":"x","limits":{"memory_mb":"big"}}"#).unwrap_err();
        assert_eq!(
            e.message,
            "limits.memory_mb: must be a positive whole number of megabytes, got string \"big\""
        );
        let e = parse_json::<Outer>(br#"{"image": "#).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code.as_str()), (400, "invalid_json"));
    }

    #[test]
    fn decodes_queries() {
        let p = query_pairs(Some("label=a%3Db&label=c=d&path=%2Ftmp%2Fx+y")).unwrap();
        assert_eq!(p[0], ("label".into(), "a=b".into()));
        assert_eq!(p[1], ("label".into(), "c=d".into()));
        assert_eq!(query_one(&p, "path"), Some("/tmp/x y"));
        assert!(query_pairs(Some("path=%zz")).is_err());
    }
}
