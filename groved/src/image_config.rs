//! The config an image came with (OCI image config's `config` object: Env, WorkingDir, User,
//! Entrypoint, Cmd, ExposedPorts, Labels), kept beside the image and honoured at create.
//!
//! One JSON file per image under `<state>/image-configs/`, written before the image's ref and
//! removed after it, so an image never lacks the config it was made with (a stray file for a
//! name without an image is replaced by the next image of that name).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::backend::check_name;
use crate::error::{ApiError, ApiResult};

/// Largest config file read back (a hostile registry's config is refused long before this).
const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// What an image says about how to run it, and where it came from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    /// `KEY=VALUE`, in the image's order; a create's own `env` wins over these.
    #[serde(default)]
    pub env: Vec<String>,
    /// The default cwd of the sandbox's processes.
    pub working_dir: Option<String>,
    /// The default user of execs (`name`, `uid`, `uid:gid`). Recorded; applied by exec once
    /// exec runs as a user.
    pub user: Option<String>,
    pub entrypoint: Option<Vec<String>>,
    pub cmd: Option<Vec<String>>,
    /// `PORT/PROTO`, sorted.
    #[serde(default)]
    pub exposed_ports: Vec<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The reference it was pulled from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The digest of the image manifest it was made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Its layers' digests, bottom first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
}

/// Why an image's config could not be read: which field of the document, or which file or
/// blob of an OCI layout, and why.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A field of the wrong type (`want`: "an object", "a string", ...).
    #[error("{field} is not {want}")]
    WrongType { field: String, want: &'static str },
    /// A list that should hold only strings.
    #[error("{field} holds a non-string")]
    NonString { field: String },
    /// An environment entry that is not `NAME=VALUE`.
    #[error("config.Env: {entry:?} is not NAME=VALUE")]
    BadEnv { entry: String },
    /// A working directory that is not an absolute path.
    #[error("config.WorkingDir {dir:?} is not an absolute path")]
    RelativeWorkdir { dir: String },
    /// A layout's file that could not be read.
    #[error("{}: {error}", .path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A descriptor's digest that is not `sha256:<hex>`.
    #[error("bad digest {0:?}")]
    BadDigest(String),
    /// A blob whose content does not hash to its name.
    #[error("blob {0} does not match its digest")]
    DigestMismatch(String),
    /// A document (`what`: index.json or a blob) that is not the JSON it should be.
    #[error("{what}: {error}")]
    BadJson {
        what: String,
        error: serde_json::Error,
    },
    /// index.json holding no image of the reference (or several, with none asked for).
    #[error("no single image in index.json")]
    NoImage,
    /// A nested index listing no manifest.
    #[error("empty index")]
    EmptyIndex,
    /// Indexes within indexes past the depth followed.
    #[error("indexes nested too deep")]
    TooDeep,
}

impl ConfigError {
    fn wrong_type(field: impl Into<String>, want: &'static str) -> Self {
        ConfigError::WrongType {
            field: field.into(),
            want,
        }
    }
}

impl ImageConfig {
    /// From an OCI (or Docker) image config document: its `config` object. Fields of the wrong
    /// type are refused, naming them, rather than dropped.
    pub fn from_oci(doc: &Value) -> Result<ImageConfig, ConfigError> {
        let c = match doc.get("config") {
            None | Some(Value::Null) => return Ok(ImageConfig::default()),
            Some(c @ Value::Object(_)) => c,
            Some(_) => return Err(ConfigError::wrong_type("config", "an object")),
        };
        let strings = |key: &str| -> Result<Option<Vec<String>>, ConfigError> {
            match c.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(String::from)
                            .ok_or_else(|| ConfigError::NonString {
                                field: format!("config.{key}"),
                            })
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map(Some),
                Some(_) => Err(ConfigError::wrong_type(
                    format!("config.{key}"),
                    "a list of strings",
                )),
            }
        };
        let string = |key: &str| -> Result<Option<String>, ConfigError> {
            match c.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) if s.is_empty() => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(ConfigError::wrong_type(format!("config.{key}"), "a string")),
            }
        };
        let keys = |key: &str| -> Result<Vec<String>, ConfigError> {
            match c.get(key) {
                None | Some(Value::Null) => Ok(Vec::new()),
                Some(Value::Object(m)) => Ok(m.keys().cloned().collect()),
                Some(_) => Err(ConfigError::wrong_type(
                    format!("config.{key}"),
                    "an object",
                )),
            }
        };
        let mut labels = BTreeMap::new();
        match c.get("Labels") {
            None | Some(Value::Null) => {}
            Some(Value::Object(m)) => {
                for (k, v) in m {
                    let v = v.as_str().ok_or_else(|| {
                        ConfigError::wrong_type(format!("config.Labels.{k}"), "a string")
                    })?;
                    labels.insert(k.clone(), v.to_string());
                }
            }
            Some(_) => return Err(ConfigError::wrong_type("config.Labels", "an object")),
        }
        let env = strings("Env")?.unwrap_or_default();
        if let Some(bad) = env.iter().find(|e| !valid_env(e)) {
            return Err(ConfigError::BadEnv { entry: bad.clone() });
        }
        let cfg = ImageConfig {
            env,
            working_dir: string("WorkingDir")?,
            user: string("User")?,
            entrypoint: strings("Entrypoint")?,
            cmd: strings("Cmd")?,
            exposed_ports: keys("ExposedPorts")?,
            labels,
            ..Default::default()
        };
        if let Some(w) = &cfg.working_dir {
            if !w.starts_with('/') || w.contains('\0') {
                return Err(ConfigError::RelativeWorkdir { dir: w.clone() });
            }
        }
        Ok(cfg)
    }

    /// Entrypoint followed by Cmd: what `grove run IMAGE` runs when given no command.
    pub fn default_command(&self) -> Vec<String> {
        let mut v = self.entrypoint.clone().unwrap_or_default();
        v.extend(self.cmd.clone().unwrap_or_default());
        v
    }

    /// The image's env as a map (later duplicates win, as in a shell).
    pub fn env_map(&self) -> BTreeMap<String, String> {
        self.env
            .iter()
            .filter_map(|e| e.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}

fn valid_env(e: &str) -> bool {
    matches!(e.split_once('='), Some((k, _)) if !k.is_empty()) && !e.contains('\0')
}

/// The config files, one per image name.
#[derive(Debug, Clone)]
pub struct ImageConfigs {
    dir: PathBuf,
}

fn io_err(what: &str, p: &Path, e: std::io::Error) -> ApiError {
    ApiError::internal(format!("{what} {}: {e}", p.display()))
}

impl ImageConfigs {
    pub fn new(state_dir: &Path) -> ImageConfigs {
        ImageConfigs {
            dir: state_dir.join("image-configs"),
        }
    }

    fn path(&self, name: &str) -> ApiResult<PathBuf> {
        check_name("name", name)?;
        Ok(self.dir.join(format!("{name}.json")))
    }

    /// The config of image `name`; None for images made without one (a directory import).
    pub fn get(&self, name: &str) -> ApiResult<Option<ImageConfig>> {
        let p = self.path(name)?;
        let f = match std::fs::File::open(&p) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("opening", &p, e)),
        };
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_CONFIG_BYTES), &mut buf)
            .map_err(|e| io_err("reading", &p, e))?;
        serde_json::from_slice(&buf)
            .map(Some)
            .map_err(|e| ApiError::internal(format!("image config {}: {e}", p.display())))
    }

    /// Writes the config of `name` durably (temp file, fsync, rename): call before the image's
    /// ref is set.
    pub fn put(&self, name: &str, cfg: &ImageConfig) -> ApiResult<()> {
        let p = self.path(name)?;
        std::fs::create_dir_all(&self.dir).map_err(|e| io_err("creating", &self.dir, e))?;
        let tmp = self.dir.join(format!(".{name}.{}.tmp", std::process::id()));
        let res = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&serde_json::to_vec_pretty(cfg).map_err(std::io::Error::other)?)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &p)?;
            std::fs::File::open(&self.dir)?.sync_all()
        })();
        if let Err(e) = res {
            let _ = std::fs::remove_file(&tmp);
            return Err(io_err("writing", &p, e));
        }
        Ok(())
    }

    /// The layer lists of every image's config (what pulled layers are still in use).
    pub fn all_layers(&self) -> Vec<Vec<String>> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        rd.flatten()
            .filter_map(|e| {
                let n = e.file_name().to_str()?.strip_suffix(".json")?.to_string();
                self.get(&n).ok().flatten().map(|c| c.layers)
            })
            .filter(|l| !l.is_empty())
            .collect()
    }

    /// Removes the config of `name` (gone already is fine): call after the image's ref is gone.
    pub fn remove(&self, name: &str) -> ApiResult<()> {
        let p = self.path(name)?;
        match std::fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err("removing", &p, e)),
        }
    }

    /// Applies the config of `image` to a create: the image's env under the request's, its
    /// WorkingDir when the request names none.
    pub fn apply(&self, image: &str, spec: &mut grove_runtime::SandboxSpec) -> ApiResult<()> {
        if check_name("image", image).is_err() {
            return Ok(());
        }
        let Some(cfg) = self.get(image)? else {
            return Ok(());
        };
        for (k, v) in cfg.env_map() {
            spec.env.entry(k).or_insert(v);
        }
        if spec.workdir.is_none() {
            spec.workdir = cfg.working_dir;
        }
        Ok(())
    }
}

/// Makes image `name` with `make` (which sets its ref), writing `cfg` first: a failed `make`
/// puts back what was there before (the config of the image that holds the name, if one
/// does). Builders and pulls call this so an image never exists without its config.
pub fn with_config(
    configs: &ImageConfigs,
    name: &str,
    cfg: Option<&ImageConfig>,
    make: impl FnOnce() -> ApiResult<crate::api_shapes::Image>,
) -> ApiResult<crate::api_shapes::Image> {
    let Some(cfg) = cfg else {
        return make();
    };
    let before = configs.get(name)?;
    configs.put(name, cfg)?;
    match make() {
        Ok(mut img) => {
            img.config = Some(cfg.clone());
            Ok(img)
        }
        Err(e) => {
            let undo = match &before {
                Some(b) => configs.put(name, b),
                None => configs.remove(name),
            };
            if let Err(r) = undo {
                tracing::warn!(
                    image = name,
                    "restoring the config after a failed import: {}",
                    r.message
                );
            }
            Err(e)
        }
    }
}

/// The config of the image an OCI layout holds (`reference` picked as `Store::import_oci`
/// picks it: by ref name, or the only one; nested indexes to linux/amd64 or the first).
pub fn from_layout(dir: &Path, reference: Option<&str>) -> Result<ImageConfig, ConfigError> {
    let io = |path: PathBuf| move |error: std::io::Error| ConfigError::Io { path, error };
    let read = |digest: &str| -> Result<Value, ConfigError> {
        let (alg, hex) = digest
            .split_once(':')
            .filter(|(a, h)| {
                *a == "sha256" && !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit())
            })
            .ok_or_else(|| ConfigError::BadDigest(digest.into()))?;
        let p = dir.join("blobs").join(alg).join(hex);
        let f = std::fs::File::open(&p).map_err(io(p.clone()))?;
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_CONFIG_BYTES), &mut buf)
            .map_err(io(p.clone()))?;
        use sha2::Digest as _;
        if !hex::encode(sha2::Sha256::digest(&buf)).eq_ignore_ascii_case(hex) {
            return Err(ConfigError::DigestMismatch(digest.into()));
        }
        serde_json::from_slice(&buf).map_err(|error| ConfigError::BadJson {
            what: format!("blob {digest}"),
            error,
        })
    };
    let index: Value = std::fs::read(dir.join("index.json"))
        .map_err(io("index.json".into()))
        .and_then(|b| {
            serde_json::from_slice(&b).map_err(|error| ConfigError::BadJson {
                what: "index.json".into(),
                error,
            })
        })?;
    let ms = index["manifests"].as_array().cloned().unwrap_or_default();
    let mut desc = match reference {
        Some(r) => ms
            .iter()
            .find(|m| m["annotations"]["org.opencontainers.image.ref.name"].as_str() == Some(r))
            .cloned(),
        None if ms.len() == 1 => ms.first().cloned(),
        None => None,
    }
    .ok_or(ConfigError::NoImage)?;
    for _ in 0..8 {
        let m = read(desc["digest"].as_str().unwrap_or(""))?;
        if let Some(ms) = m["manifests"].as_array() {
            desc = ms
                .iter()
                .find(|d| {
                    d["platform"]["os"] == "linux" && d["platform"]["architecture"] == "amd64"
                })
                .or_else(|| ms.first())
                .cloned()
                .ok_or(ConfigError::EmptyIndex)?;
            continue;
        }
        let Some(c) = m["config"]["digest"].as_str() else {
            return Ok(ImageConfig::default());
        };
        let mut cfg = ImageConfig::from_oci(&read(c)?)?;
        cfg.digest = desc["digest"].as_str().map(String::from);
        return Ok(cfg);
    }
    Err(ConfigError::TooDeep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_an_oci_config() {
        let doc = serde_json::json!({
            "architecture": "amd64",
            "config": {
                "Env": ["PATH=/usr/bin:/bin", "A=1=2"],
                "WorkingDir": "/srv",
                "User": "1000:1000",
                "Entrypoint": ["/bin/sh", "-c"],
                "Cmd": ["echo hi"],
                "ExposedPorts": {"8080/tcp": {}, "53/udp": {}},
                "Labels": {"org.example": "x"}
            }
        });
        let c = ImageConfig::from_oci(&doc).unwrap();
        assert_eq!(c.env_map()["A"], "1=2");
        assert_eq!(c.working_dir.as_deref(), Some("/srv"));
        assert_eq!(c.user.as_deref(), Some("1000:1000"));
        assert_eq!(c.default_command(), ["/bin/sh", "-c", "echo hi"]);
        assert_eq!(c.exposed_ports, ["53/udp", "8080/tcp"]);
        assert_eq!(c.labels["org.example"], "x");
    }

    #[test]
    fn refuses_fields_of_the_wrong_type() {
        // Each names the field and what is wrong with it.
        for (bad, why) in [
            (
                serde_json::json!({"config": {"Env": "PATH=/bin"}}),
                "config.Env is not a list of strings",
            ),
            (
                serde_json::json!({"config": {"Env": ["=x"]}}),
                "config.Env: \"=x\" is not NAME=VALUE",
            ),
            (
                serde_json::json!({"config": {"Cmd": [1]}}),
                "config.Cmd holds a non-string",
            ),
            (
                serde_json::json!({"config": {"WorkingDir": "relative"}}),
                "config.WorkingDir \"relative\" is not an absolute path",
            ),
            (
                serde_json::json!({"config": {"Labels": {"a": 1}}}),
                "config.Labels.a is not a string",
            ),
            (serde_json::json!({"config": []}), "config is not an object"),
        ] {
            let e = ImageConfig::from_oci(&bad).unwrap_err();
            assert_eq!(e.to_string(), why, "{bad}");
        }
        assert_eq!(
            ImageConfig::from_oci(&serde_json::json!({})).unwrap(),
            ImageConfig::default()
        );
    }

    #[test]
    fn kept_per_image_and_applied_under_the_request() {
        let d = tempfile::tempdir().unwrap();
        let cs = ImageConfigs::new(d.path());
        assert_eq!(cs.get("img").unwrap(), None);
        let cfg = ImageConfig {
            env: vec!["A=image".into(), "B=image".into()],
            working_dir: Some("/srv".into()),
            ..Default::default()
        };
        cs.put("img", &cfg).unwrap();
        assert_eq!(cs.get("img").unwrap().as_ref(), Some(&cfg));
        let mut spec = grove_runtime::SandboxSpec::from_image("img");
        spec.env.insert("A".into(), "request".into());
        cs.apply("img", &mut spec).unwrap();
        assert_eq!(spec.env["A"], "request");
        assert_eq!(spec.env["B"], "image");
        assert_eq!(spec.workdir.as_deref(), Some("/srv"));
        assert!(cs.get("../x").is_err());
        cs.remove("img").unwrap();
        cs.remove("img").unwrap();
        assert_eq!(cs.get("img").unwrap(), None);
    }
}
