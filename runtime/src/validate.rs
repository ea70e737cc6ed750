//! Spec validation: every field checked before anything is made.

use std::net::Ipv4Addr;

use crate::config::PortRange;
use crate::error::Error;
use crate::types::{
    EgressRule, ExecRequest, Limits, NetworkPolicy, PortMapping, SandboxSpec, MAX_OUTPUT,
};

/// The longest time-to-live a sandbox may ask for (ten years): a deadline far beyond any node's
/// life, and far from overflowing milliseconds since the epoch.
pub const MAX_TTL_SECS: u64 = 10 * 365 * 24 * 3600;

/// The smallest CPU share: the kernel refuses a CFS quota under 1 ms per (100 ms) period.
pub const MIN_CPU_MILLIS: u32 = 10;

/// A time-to-live in seconds: at least 1 (leave it out for none), at most [`MAX_TTL_SECS`].
pub fn ttl(field: &str, ttl_secs: Option<u64>) -> Result<(), Error> {
    match ttl_secs {
        Some(0) => Err(Error::invalid(
            field,
            "must be at least 1 (omit it for no expiry)",
        )),
        Some(t) if t > MAX_TTL_SECS => Err(Error::invalid(
            field,
            format!("{t} is more than {MAX_TTL_SECS} (10 years)"),
        )),
        _ => Ok(()),
    }
}

/// The expiry deadline in ms since the epoch; saturates instead of wrapping into the past, so a
/// huge ttl can never mean an immediate reap (callers validate with [`ttl`] first).
pub fn expires_at(now_ms: u64, ttl_secs: Option<u64>) -> Option<u64> {
    ttl_secs.map(|t| now_ms.saturating_add(t.saturating_mul(1000)))
}

/// Limits outside these bounds are refused as absurd (capacity is checked separately).
pub fn limits(l: &Limits) -> Result<(), Error> {
    let check = |field: &str, v: u64, min: u64, max: u64| {
        if v < min || v > max {
            Err(Error::invalid(
                &format!("limits.{field}"),
                format!("{v} is outside {min}..={max}"),
            ))
        } else {
            Ok(())
        }
    };
    check(
        "cpu_millis",
        u64::from(l.cpu_millis),
        u64::from(MIN_CPU_MILLIS),
        1_024_000,
    )?;
    check("memory_mb", l.memory_mb, 16, 1 << 24)?;
    check("pids", u64::from(l.pids), 8, 4_194_304)?;
    check("open_files", u64::from(l.open_files), 64, 1 << 20)?;
    check("disk_mb", l.disk_mb, 1, 1 << 30)?;
    Ok(())
}

pub fn hostname(h: &str) -> Result<(), Error> {
    let ok = !h.is_empty()
        && h.len() <= 63
        && !h.starts_with('-')
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(
            "hostname",
            format!("{h:?} is not a valid hostname"),
        ))
    }
}

fn env_map(field: &str, env: &std::collections::BTreeMap<String, String>) -> Result<(), Error> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(Error::invalid(field, format!("bad variable {k:?}")));
        }
    }
    Ok(())
}

/// Parses "a.b.c.d/n" (IPv4; IPv6 is not supported yet).
pub fn cidr(s: &str) -> Result<(Ipv4Addr, u8), Error> {
    let bad = |why: &str| Error::invalid("network.allow.cidr", format!("{s:?}: {why}"));
    let (ip, len) = s.split_once('/').ok_or_else(|| bad("missing /prefix"))?;
    let ip: Ipv4Addr = ip.parse().map_err(|_| bad("not an IPv4 address"))?;
    let len: u8 = len.parse().map_err(|_| bad("prefix is not a number"))?;
    if len > 32 {
        return Err(bad("prefix longer than 32"));
    }
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    if u32::from(ip) & !mask != 0 {
        return Err(bad("host bits set"));
    }
    Ok((ip, len))
}

pub fn egress(rules: &[EgressRule]) -> Result<(), Error> {
    for r in rules {
        cidr(&r.cidr)?;
        if r.ports.contains(&0) {
            return Err(Error::invalid("network.allow.ports", "port 0"));
        }
    }
    Ok(())
}

/// Everything but the image (the root provider answers for it) and capacity.
pub fn spec(s: &SandboxSpec) -> Result<(), Error> {
    if s.image.is_empty() {
        return Err(Error::invalid("image", "empty"));
    }
    if let Some(l) = &s.limits {
        limits(l)?;
    }
    env_map("env", &s.env)?;
    if let Some(w) = &s.workdir {
        if !w.starts_with('/') || w.contains('\0') {
            return Err(Error::invalid(
                "workdir",
                format!("{w:?} is not an absolute path"),
            ));
        }
    }
    if let Some(h) = &s.hostname {
        hostname(h)?;
    }
    if let NetworkPolicy::Egress { allow } = &s.network {
        egress(allow)?;
    }
    if !s.ports.is_empty() && s.network == NetworkPolicy::None {
        return Err(Error::invalid(
            "ports",
            "published ports need network mode egress",
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for p in &s.ports {
        if p.host_port == 0 || p.sandbox_port == 0 {
            return Err(Error::invalid("ports", "port 0"));
        }
        if !seen.insert(p.host_port) {
            return Err(Error::invalid(
                "ports",
                format!("host port {} twice", p.host_port),
            ));
        }
    }
    ttl("ttl_secs", s.ttl_secs)?;
    if s.idle.is_some_and(|i| i.timeout_secs == 0) {
        return Err(Error::invalid(
            "idle.timeout_secs",
            "0 (omit idle for the node default)",
        ));
    }
    Ok(())
}

/// Published host ports against the node's policy: inside the configured range and not one of the
/// daemon's own listeners (whose traffic, bearer keys included, a DNAT would hand to the sandbox).
/// Whether the port is free on the host is `Network`'s check (it holds the port).
pub fn host_ports(ports: &[PortMapping], range: PortRange, reserved: &[u16]) -> Result<(), Error> {
    for (i, p) in ports.iter().enumerate() {
        let field = format!("ports[{i}].host_port");
        if reserved.contains(&p.host_port) {
            return Err(Error::invalid(
                &field,
                format!(
                    "{} is reserved (a listener of the node's daemon)",
                    p.host_port
                ),
            ));
        }
        if !range.contains(p.host_port) {
            return Err(Error::invalid(
                &field,
                format!(
                    "{} is outside the node's host port range {range}",
                    p.host_port
                ),
            ));
        }
    }
    Ok(())
}

/// Turns an exec request into the argv to run.
pub fn exec_argv(r: &ExecRequest) -> Result<Vec<String>, Error> {
    env_map("env", &r.env)?;
    let argv = match (&r.shell, r.argv.is_empty()) {
        (Some(_), false) => return Err(Error::invalid("argv", "give argv or shell, not both")),
        (None, true) => return Err(Error::invalid("argv", "give argv or shell")),
        (Some(sh), true) => vec!["/bin/sh".into(), "-c".into(), sh.clone()],
        (None, false) => r.argv.clone(),
    };
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(Error::invalid("argv", "NUL byte"));
    }
    if r.cwd.as_ref().is_some_and(|c| !c.starts_with('/')) {
        return Err(Error::invalid("cwd", "must be absolute"));
    }
    if r.timeout_ms == Some(0) {
        return Err(Error::invalid("timeout_ms", "0"));
    }
    if let Some(m) = r.max_output_bytes.filter(|m| *m > MAX_OUTPUT) {
        return Err(Error::invalid(
            "max_output_bytes",
            format!("{m} is more than {MAX_OUTPUT}"),
        ));
    }
    Ok(argv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs() {
        assert!(cidr("10.0.0.0/8").is_ok());
        assert!(cidr("10.1.2.3/32").is_ok());
        for bad in [
            "10.0.0.0",
            "10.0.0.1/8",
            "300.0.0.0/8",
            "10.0.0.0/33",
            "x/8",
            "::1/128",
        ] {
            assert_eq!(cidr(bad).unwrap_err().code(), "invalid_spec", "{bad}");
        }
    }

    #[test]
    fn host_ports_outside_the_range_or_reserved_are_refused() {
        let p = |host_port| PortMapping {
            host_port,
            sandbox_port: 80,
        };
        let range = PortRange::default();
        assert!(host_ports(&[p(30000), p(32767)], range, &[]).is_ok());
        let e = host_ports(&[p(30001), p(22)], range, &[]).unwrap_err();
        assert_eq!(e.field(), Some("ports[1].host_port"));
        assert!(e.to_string().contains("outside"), "{e}");
        let e = host_ports(&[p(31000)], range, &[31000]).unwrap_err();
        assert_eq!(e.field(), Some("ports[0].host_port"));
        assert!(e.to_string().contains("reserved"), "{e}");
    }

    #[test]
    fn limits_bounds() {
        assert!(limits(&Limits::default()).is_ok());
        let zero_mem = Limits {
            memory_mb: 0,
            ..Limits::default()
        };
        assert_eq!(
            limits(&zero_mem).unwrap_err().field(),
            Some("limits.memory_mb")
        );
        let absurd = Limits {
            pids: u32::MAX,
            ..Limits::default()
        };
        assert_eq!(limits(&absurd).unwrap_err().field(), Some("limits.pids"));
        // Below the kernel's 1 ms CFS quota the cgroup write would fail: refused as input instead.
        let tiny_cpu = Limits {
            cpu_millis: 1,
            ..Limits::default()
        };
        assert_eq!(
            limits(&tiny_cpu).unwrap_err().field(),
            Some("limits.cpu_millis")
        );
    }

    #[test]
    fn ttl_bounds_and_no_overflow() {
        assert!(ttl("ttl_secs", None).is_ok());
        assert!(ttl("ttl_secs", Some(MAX_TTL_SECS)).is_ok());
        for bad in [0, MAX_TTL_SECS + 1, u64::MAX / 1000 + 1, u64::MAX] {
            assert_eq!(
                ttl("ttl_secs", Some(bad)).unwrap_err().field(),
                Some("ttl_secs")
            );
        }
        let now = 1_700_000_000_000;
        assert_eq!(expires_at(now, Some(u64::MAX)), Some(u64::MAX));
        assert_eq!(expires_at(now, Some(u64::MAX / 1000 + 1)), Some(u64::MAX));
        assert_eq!(expires_at(now, Some(2)), Some(now + 2000));
    }
}
