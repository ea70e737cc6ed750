//! SWE-ReX's `upload`: a multipart form (`file`, `target_path`, `unzip`). A file is written to the
//! target; a directory comes zipped (`shutil.make_archive`) and is unpacked under the target, each
//! member written through the files API (resolved inside the sandbox's root, held to its quota).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write as _};
use std::sync::Arc;

use axum::extract::{Multipart, Path, State};
use axum::http::StatusCode;
use axum::Json;
use grove_runtime::{Runtime, SandboxId};
use serde_json::{json, Value};

use super::{file_error, off_thread, rex_path, RexError, RexResult};
use crate::api::pause::awake;
use crate::api::sandbox_id;
use crate::app::App;
use crate::error::ApiError;

/// The largest upload (file or zip) spooled on the host before it goes into the sandbox.
const MAX_UPLOAD: u64 = 1 << 30;
/// The most members one zip may have, and the largest central directory read into memory.
const MAX_MEMBERS: u64 = 1_000_000;
const MAX_DIRECTORY: u64 = 128 << 20;

/// Why an uploaded zip cannot be unpacked: which part of the archive or which member, and why.
/// The request's fault (the archive it sent), answered as 422 on `file`.
#[derive(Debug, thiserror::Error)]
enum ZipError {
    /// Reading the spooled archive failed.
    #[error("{0}")]
    Io(std::io::Error),
    /// Reading one structure of it (`what`) failed.
    #[error("{what}: {error}")]
    Read {
        what: &'static str,
        error: std::io::Error,
    },
    /// A structure missing or damaged (`0` says which).
    #[error("{0}")]
    Damaged(&'static str),
    #[error("{count} members: at most {MAX_MEMBERS}")]
    TooManyMembers { count: u64 },
    #[error("a central directory of {size} bytes: at most {MAX_DIRECTORY}")]
    DirectoryTooLarge { size: u64 },
    #[error("{name:?} is encrypted")]
    Encrypted { name: String },
    /// A link, device or other special member: only files and directories are unpacked.
    #[error("{name:?}: only files and directories are unpacked")]
    NotAFile { name: String },
    #[error("compression method {method} (only stored and deflate)")]
    Method { method: u16 },
    /// A member name that would land outside the target (zip-slip).
    #[error("member {name:?} escapes the target directory")]
    Escapes { name: String },
    #[error("member {name:?} has no name")]
    NoName { name: String },
}

fn bad(field: &str, m: impl Into<String>) -> RexError {
    ApiError::invalid(field, m).into()
}

/// POST upload.
pub async fn upload(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    mut form: Multipart,
) -> RexResult<Json<Value>> {
    let id = sandbox_id(&id)?;
    let mut spooled: Option<File> = None;
    let mut target: Option<String> = None;
    let mut unzip = false;
    let form_err = |e: axum::extract::multipart::MultipartError| -> RexError {
        ApiError::bad_request("invalid_body", "body", format!("multipart form: {e}")).into()
    };
    while let Some(mut field) = form.next_field().await.map_err(form_err)? {
        match field.name().unwrap_or("") {
            "file" => {
                // Unnamed (O_TMPFILE, on the state dir's disk rather than a tmpfs) and gone with
                // its last descriptor: nothing to clean up, crash or not.
                let mut f = tempfile::tempfile_in(&app.config.state_dir)
                    .map_err(|e| ApiError::internal(format!("spool file: {e}")))?;
                let mut n: u64 = 0;
                while let Some(chunk) = field.chunk().await.map_err(form_err)? {
                    n += chunk.len() as u64;
                    if n > MAX_UPLOAD {
                        return Err(ApiError::new(
                            StatusCode::PAYLOAD_TOO_LARGE,
                            "body_too_large",
                            format!("an upload may be at most {MAX_UPLOAD} bytes"),
                        )
                        .with_field("file")
                        .into());
                    }
                    f.write_all(&chunk).map_err(|e| {
                        ApiError::from_cause(&e, ApiError::internal(format!("spool file: {e}")))
                    })?;
                }
                spooled = Some(f);
            }
            "target_path" => target = Some(field.text().await.map_err(form_err)?),
            "unzip" => {
                let v = field.text().await.map_err(form_err)?;
                // FastAPI's bool form values.
                unzip = match v.to_ascii_lowercase().as_str() {
                    "true" | "1" | "yes" | "on" | "y" | "t" => true,
                    "false" | "0" | "no" | "off" | "n" | "f" => false,
                    _ => return Err(bad("unzip", format!("{v:?} is not a boolean"))),
                };
            }
            // Unknown fields are ignored, as FastAPI does.
            _ => {}
        }
    }
    let mut file = spooled.ok_or_else(|| bad("file", "the form has no file"))?;
    let target = rex_path(
        "target_path",
        &target.ok_or_else(|| bad("target_path", "the form has no target_path"))?,
    )?;
    file.seek(SeekFrom::Start(0))
        .map_err(|e| ApiError::internal(format!("spool file: {e}")))?;
    let rt = awake(&app, &id).await?;
    off_thread(move || {
        if unzip {
            unpack(&rt, &id, &target, file)
        } else {
            rt.write_file_from(&id, &target, &mut file, None)
                .map(|_| ())
                .map_err(|e| file_error(&target, e))
        }
    })
    .await?;
    Ok(Json(json!({})))
}

/// Unpacks the zip `f` under `dir` in the sandbox.
fn unpack(rt: &Runtime, id: &SandboxId, dir: &str, f: File) -> RexResult<()> {
    let mut z = Zip::open(f).map_err(|e| bad("file", format!("not a zip archive: {e}")))?;
    let dir = dir.trim_end_matches('/');
    mkdir_p(rt, id, dir)?;
    for m in z.members.clone() {
        let name = member_name(&m.name).map_err(|e| bad("file", e.to_string()))?;
        let path = format!("{dir}/{name}");
        if m.is_dir {
            mkdir_p(rt, id, &path)?;
            continue;
        }
        let mut r = z
            .reader(&m)
            .map_err(|e| bad("file", format!("{:?}: {e}", m.name)))?;
        rt.write_file_from(id, &path, &mut r, Some(m.mode))
            .map_err(|e| match r.failure.take() {
                Some(why) => bad("file", format!("{:?}: {why}", m.name)),
                None => file_error(&path, e),
            })?;
    }
    Ok(())
}

/// `mkdir -p` in the sandbox: an empty tar unpacked there (the files API makes the directory).
fn mkdir_p(rt: &Runtime, id: &SandboxId, dir: &str) -> RexResult<()> {
    rt.upload_tar(id, dir, &mut std::io::empty())
        .map_err(|e| file_error(dir, e))
}

/// A member's name as a relative path: no absolute path, `..`, NUL or backslash (zip-slip).
fn member_name(n: &str) -> Result<String, ZipError> {
    let n = n.trim_end_matches('/');
    if n.starts_with('/') || n.contains(['\0', '\\']) || n.split('/').any(|c| c == "..") {
        return Err(ZipError::Escapes { name: n.into() });
    }
    let parts: Vec<&str> = n
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    if parts.is_empty() {
        return Err(ZipError::NoName { name: n.into() });
    }
    Ok(parts.join("/"))
}

#[derive(Debug, Clone)]
struct Member {
    name: String,
    is_dir: bool,
    method: u16,
    crc: u32,
    compressed: u64,
    size: u64,
    local_offset: u64,
    mode: u32,
}

/// The central directory of a zip (PKWARE APPNOTE: stored and deflated members, zip64 sizes).
struct Zip {
    f: File,
    members: Vec<Member>,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

impl Zip {
    fn open(mut f: File) -> Result<Zip, ZipError> {
        let len = f.seek(SeekFrom::End(0)).map_err(ZipError::Io)?;
        let tail_len = len.min(22 + 65535);
        let mut tail = vec![0u8; tail_len as usize];
        f.seek(SeekFrom::Start(len - tail_len))
            .and_then(|_| f.read_exact(&mut tail))
            .map_err(ZipError::Io)?;
        let eocd = (0..tail.len().saturating_sub(21))
            .rev()
            .find(|&i| u32_at(&tail, i) == 0x0605_4b50)
            .ok_or(ZipError::Damaged("no end of central directory"))?;
        let mut count = u64::from(u16_at(&tail, eocd + 10));
        let mut cd_size = u64::from(u32_at(&tail, eocd + 12));
        let mut cd_off = u64::from(u32_at(&tail, eocd + 16));
        if count == 0xffff || cd_size == 0xffff_ffff || cd_off == 0xffff_ffff {
            // The zip64 locator sits just before the end record.
            let loc = eocd
                .checked_sub(20)
                .ok_or(ZipError::Damaged("zip64 locator missing"))?;
            if u32_at(&tail, loc) != 0x0706_4b50 {
                return Err(ZipError::Damaged("zip64 locator missing"));
            }
            let rec_off = u64_at(&tail, loc + 8);
            let mut rec = [0u8; 56];
            f.seek(SeekFrom::Start(rec_off))
                .and_then(|_| f.read_exact(&mut rec))
                .map_err(|error| ZipError::Read {
                    what: "zip64 record",
                    error,
                })?;
            if u32_at(&rec, 0) != 0x0606_4b50 {
                return Err(ZipError::Damaged("zip64 record missing"));
            }
            count = u64_at(&rec, 32);
            cd_size = u64_at(&rec, 40);
            cd_off = u64_at(&rec, 48);
        }
        if count > MAX_MEMBERS {
            return Err(ZipError::TooManyMembers { count });
        }
        if cd_size > MAX_DIRECTORY {
            return Err(ZipError::DirectoryTooLarge { size: cd_size });
        }
        if cd_off.checked_add(cd_size).is_none_or(|e| e > len) {
            return Err(ZipError::Damaged("central directory outside the file"));
        }
        let mut cd = vec![0u8; cd_size as usize];
        f.seek(SeekFrom::Start(cd_off))
            .and_then(|_| f.read_exact(&mut cd))
            .map_err(ZipError::Io)?;
        let mut members = Vec::with_capacity(count as usize);
        let mut at = 0usize;
        for _ in 0..count {
            if at + 46 > cd.len() || u32_at(&cd, at) != 0x0201_4b50 {
                return Err(ZipError::Damaged("damaged central directory"));
            }
            let made_by_unix = u16_at(&cd, at + 4) >> 8 == 3;
            let flags = u16_at(&cd, at + 8);
            let method = u16_at(&cd, at + 10);
            let crc = u32_at(&cd, at + 16);
            let mut compressed = u64::from(u32_at(&cd, at + 20));
            let mut size = u64::from(u32_at(&cd, at + 24));
            let (nlen, xlen, clen) = (
                u16_at(&cd, at + 28) as usize,
                u16_at(&cd, at + 30) as usize,
                u16_at(&cd, at + 32) as usize,
            );
            let attrs = u32_at(&cd, at + 38);
            let mut local_offset = u64::from(u32_at(&cd, at + 42));
            let end = at + 46 + nlen + xlen + clen;
            if end > cd.len() {
                return Err(ZipError::Damaged("damaged central directory"));
            }
            let name = String::from_utf8_lossy(&cd[at + 46..at + 46 + nlen]).into_owned();
            let extra = &cd[at + 46 + nlen..at + 46 + nlen + xlen];
            // Zip64 extra field: the 64-bit values of the fields saturated above, in order.
            let mut x = 0;
            while x + 4 <= extra.len() {
                let (tag, n) = (u16_at(extra, x), u16_at(extra, x + 2) as usize);
                let body = extra
                    .get(x + 4..x + 4 + n)
                    .ok_or(ZipError::Damaged("damaged extra field"))?;
                if tag == 1 {
                    let mut p = 0;
                    for v in [&mut size, &mut compressed, &mut local_offset] {
                        if *v == 0xffff_ffff && p + 8 <= body.len() {
                            *v = u64_at(body, p);
                            p += 8;
                        }
                    }
                }
                x += 4 + n;
            }
            if flags & 1 != 0 {
                return Err(ZipError::Encrypted { name });
            }
            let unix_mode = attrs >> 16;
            let kind = unix_mode & 0o170000;
            let is_dir = name.ends_with('/') || (made_by_unix && kind == 0o040000);
            if made_by_unix && kind != 0 && kind != 0o100000 && kind != 0o040000 {
                return Err(ZipError::NotAFile { name });
            }
            let mode = if made_by_unix && unix_mode & 0o777 != 0 {
                unix_mode & 0o755
            } else {
                0o644
            };
            members.push(Member {
                name,
                is_dir,
                method,
                crc,
                compressed,
                size,
                local_offset,
                mode,
            });
            at = end;
        }
        Ok(Zip { f, members })
    }

    /// The member's bytes, checked against its size and CRC as they are read.
    fn reader(&mut self, m: &Member) -> Result<MemberReader, ZipError> {
        let mut h = [0u8; 30];
        self.f
            .seek(SeekFrom::Start(m.local_offset))
            .and_then(|_| self.f.read_exact(&mut h))
            .map_err(|error| ZipError::Read {
                what: "local header",
                error,
            })?;
        if u32_at(&h, 0) != 0x0403_4b50 {
            return Err(ZipError::Damaged("damaged local header"));
        }
        let skip = u64::from(u16_at(&h, 26)) + u64::from(u16_at(&h, 28));
        let start = m.local_offset + 30 + skip;
        let f = self.f.try_clone().map_err(ZipError::Io)?;
        let mut raw = f;
        raw.seek(SeekFrom::Start(start)).map_err(ZipError::Io)?;
        let raw = raw.take(m.compressed);
        let inner: Box<dyn Read + Send> = match m.method {
            0 => Box::new(raw),
            8 => Box::new(flate2::read::DeflateDecoder::new(raw)),
            other => return Err(ZipError::Method { method: other }),
        };
        Ok(MemberReader {
            inner: inner.take(m.size + 1),
            crc: flate2::Crc::new(),
            got: 0,
            want_crc: m.crc,
            want_size: m.size,
            failure: None,
        })
    }
}

/// Reads one member; at its end, a wrong size or CRC is an error (so the half-written file goes).
struct MemberReader {
    inner: std::io::Take<Box<dyn Read + Send>>,
    crc: flate2::Crc,
    got: u64,
    want_crc: u32,
    want_size: u64,
    failure: Option<String>,
}

impl Read for MemberReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.crc.update(&buf[..n]);
        self.got += n as u64;
        let got = self.got;
        let why = if got > self.want_size {
            Some(format!("longer than its {} bytes", self.want_size))
        } else if n == 0 && got != self.want_size {
            Some(format!("{got} of its {} bytes", self.want_size))
        } else if n == 0 && self.crc.sum() != self.want_crc {
            Some("CRC mismatch".to_string())
        } else {
            None
        };
        if let Some(why) = why {
            self.failure = Some(why.clone());
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, why));
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_names_stay_below_the_target() {
        assert_eq!(member_name("a/b.txt").unwrap(), "a/b.txt");
        assert_eq!(member_name("./a//b/").unwrap(), "a/b");
        for bad in ["/etc/passwd", "../x", "a/../../x", "a\\..\\x", ""] {
            assert!(member_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            member_name("../x").unwrap_err().to_string(),
            "member \"../x\" escapes the target directory"
        );
        assert_eq!(
            member_name("./").unwrap_err().to_string(),
            "member \".\" has no name"
        );
    }
}
