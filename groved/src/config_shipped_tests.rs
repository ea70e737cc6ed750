//! The shipped default config (systemd/groved.toml) cannot rot: it parses, as shipped and with every
//! optional key switched on; it names every key groved reads, each under a comment; and the values it
//! sets are groved's real defaults.

use std::cell::Cell;

use serde::de::{self, Deserialize, Deserializer, Visitor};

use super::*;

const SHIPPED: &str = include_str!("../../systemd/groved.toml");

/// A deserializer that only records the field names a struct asks for.
struct FieldNames(Cell<&'static [&'static str]>);

impl<'de> Deserializer<'de> for &FieldNames {
    type Error = de::value::Error;
    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("not a struct"))
    }
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.set(fields);
        Err(de::Error::custom("fields recorded"))
    }
    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option unit
        unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
    }
}

fn fields_of<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    let f = FieldNames(Cell::new(&[]));
    let _ = T::deserialize(&f);
    f.0.get()
}

/// The file with every `#key = value` line switched on.
fn all_keys_on(text: &str) -> String {
    text.lines()
        .map(|l| match l.strip_prefix('#') {
            Some(rest) if is_key_line(rest) => rest,
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_key_line(l: &str) -> bool {
    l.split_once(" = ").is_some_and(|(k, _)| {
        !k.is_empty()
            && k.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    })
}

/// (section, key, line above) for every key line, set or commented out.
fn key_lines(text: &str) -> Vec<(String, String, String)> {
    let mut section = String::new();
    let mut prev = "";
    let mut out = Vec::new();
    for l in text.lines() {
        if let Some(s) = l.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            section = s.to_string();
        } else {
            let bare = l.strip_prefix('#').unwrap_or(l);
            if is_key_line(bare) {
                let key = bare.split_once(" = ").unwrap().0;
                out.push((section.clone(), key.to_string(), prev.to_string()));
            }
        }
        prev = l;
    }
    out
}

#[test]
fn shipped_config_parses_as_is_and_with_every_key_on() {
    toml::from_str::<FileConfig>(SHIPPED).expect("systemd/groved.toml as shipped");
    toml::from_str::<FileConfig>(&all_keys_on(SHIPPED)).expect("systemd/groved.toml, all keys on");
}

#[test]
fn shipped_config_documents_every_key() {
    let lines = key_lines(SHIPPED);
    let tables = [
        ("", fields_of::<FileConfig>()),
        ("capacity", fields_of::<CapacityOverrides>()),
        ("defaults", fields_of::<LimitsRequest>()),
    ];
    for (section, fields) in tables {
        assert!(!fields.is_empty(), "no fields recorded for [{section}]");
        for f in fields {
            if section.is_empty() && ["capacity", "defaults", "labels", "registries"].contains(f) {
                assert!(
                    SHIPPED.contains(&format!("\n[{f}]\n")),
                    "systemd/groved.toml lacks the [{f}] table"
                );
                continue;
            }
            let (_, _, above) = lines
                .iter()
                .find(|(s, k, _)| s == section && k == f)
                .unwrap_or_else(|| panic!("systemd/groved.toml lacks [{section}] {f}"));
            assert!(
                above.starts_with("# "),
                "[{section}] {f} in systemd/groved.toml has no comment above it"
            );
        }
    }
}

#[test]
fn shipped_values_are_the_defaults() {
    std::env::set_var("GROVE_INIT_BINARY", "/bin/true");
    let shipped: FileConfig = toml::from_str(SHIPPED).unwrap();
    let reserve = shipped.capacity.memory_reserve_mb;
    let a = Config::resolve(shipped, &Overrides::default()).unwrap();
    let b = Config::resolve(FileConfig::default(), &Overrides::default()).unwrap();
    assert_eq!(
        (
            &a.state_dir,
            &a.run_dir,
            &a.socket,
            &a.listen,
            a.root,
            a.reap_interval
        ),
        (
            &b.state_dir,
            &b.run_dir,
            &b.socket,
            &b.listen,
            b.root,
            b.reap_interval
        )
    );
    assert_eq!(a.cgroup_root, b.cgroup_root);
    assert_eq!(a.defaults, b.defaults);
    // The build cache's commented-out values are its defaults.
    let on: FileConfig = toml::from_str(&all_keys_on(SHIPPED)).unwrap();
    assert_eq!(on.build_cache_max_entries, Some(b.build_cache.max_entries));
    assert_eq!(
        on.build_cache_max_age_secs,
        Some(b.build_cache.max_age_secs)
    );
    assert_eq!(a.runtime_config().net_pool, b.runtime_config().net_pool);
    // grove_runtime's DEFAULT_MEMORY_RESERVE_MB (private to its admission module).
    assert_eq!(reserve, Some(1024));
}
