//! Resolving the `user` of an exec against the sandbox's own /etc/passwd and /etc/group (init runs
//! inside the sandbox, so these are the image's files, never the host's).

/// Who a command runs as: ids, supplementary groups and the environment a login would set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Creds {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub name: Option<String>,
    pub home: String,
}

/// Longest /etc/passwd or /etc/group read: an image may hold anything there.
const MAX_DB: u64 = 4 << 20;

/// Reads a regular file only: the sandbox may have made it a FIFO, which would block init.
fn read_db(path: &str) -> String {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut s = String::new();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path);
    if let Ok(f) = f {
        if f.metadata().is_ok_and(|m| m.is_file()) {
            let _ = f.take(MAX_DB).read_to_string(&mut s);
        }
    }
    s
}

/// Why a `user` does not resolve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UserError {
    /// A name (not a number) that the sandbox's /etc/passwd lacks.
    #[error("user {0:?}: no such user in the sandbox's /etc/passwd")]
    NoSuchUser(String),
    #[error("user {user:?}: {reason}")]
    Bad { user: String, reason: &'static str },
}

impl UserError {
    fn bad(user: &str, reason: &'static str) -> Self {
        UserError::Bad {
            user: user.to_string(),
            reason,
        }
    }
}

impl From<UserError> for super::Failure {
    fn from(e: UserError) -> Self {
        super::Failure::new(crate::proto::InitErrorKind::BadUser, e.to_string())
    }
}

/// `user` is a name from /etc/passwd, or `uid[:gid]` (a uid without an entry runs with gid = uid
/// unless given, home `/`).
pub fn resolve(user: &str) -> Result<Creds, UserError> {
    resolve_in(user, &read_db("/etc/passwd"), &read_db("/etc/group"))
}

fn resolve_in(user: &str, passwd: &str, group: &str) -> Result<Creds, UserError> {
    if user.is_empty() || user.contains(['\0', '\n']) {
        return Err(UserError::bad(user, "not a user name or uid[:gid]"));
    }
    let entries: Vec<Vec<&str>> = passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .filter(|f| f.len() >= 7)
        .collect();
    let (uid_part, gid_part) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let numeric = |s: &str| {
        s.parse::<u32>()
            .ok()
            .filter(|_| s.bytes().all(|b| b.is_ascii_digit()))
    };
    let entry = match numeric(uid_part) {
        Some(uid) => entries
            .iter()
            .find(|f| numeric(f[2]) == Some(uid) && gid_part.is_none()),
        None if gid_part.is_some() => {
            return Err(UserError::bad(user, "uid:gid takes numbers"));
        }
        None => Some(
            entries
                .iter()
                .find(|f| f[0] == uid_part)
                .ok_or_else(|| UserError::NoSuchUser(user.to_string()))?,
        ),
    };
    let (uid, gid, name, home) = match entry {
        Some(f) => {
            let uid =
                numeric(f[2]).ok_or_else(|| UserError::bad(user, "bad uid in /etc/passwd"))?;
            let gid =
                numeric(f[3]).ok_or_else(|| UserError::bad(user, "bad gid in /etc/passwd"))?;
            let home = if f[5].starts_with('/') { f[5] } else { "/" };
            (uid, gid, Some(f[0].to_string()), home.to_string())
        }
        None => {
            let uid = numeric(uid_part).unwrap_or(0);
            let gid = match gid_part {
                Some(g) => numeric(g).ok_or_else(|| UserError::bad(user, "bad gid"))?,
                None => uid,
            };
            // An explicit uid:gid that matches an entry still gets its name and home.
            match entries
                .iter()
                .find(|f| numeric(f[2]) == Some(uid) && numeric(f[3]) == Some(gid))
            {
                Some(f) => (uid, gid, Some(f[0].to_string()), f[5].to_string()),
                None => (uid, gid, None, "/".to_string()),
            }
        }
    };
    if uid == u32::MAX || gid == u32::MAX {
        return Err(UserError::bad(user, "-1 is not an id"));
    }
    let mut groups = vec![gid];
    if let Some(n) = &name {
        for f in group.lines().map(|l| l.split(':').collect::<Vec<_>>()) {
            if f.len() >= 4 && f[3].split(',').any(|m| m == n) {
                if let Some(g) = numeric(f[2]).filter(|g| *g != u32::MAX) {
                    if !groups.contains(&g) {
                        groups.push(g);
                    }
                }
            }
        }
    }
    groups.truncate(64);
    Ok(Creds {
        uid,
        gid,
        groups,
        name,
        home,
    })
}

impl Creds {
    /// Environment a login sets for this user; the request's own env wins over it.
    pub fn env(&self) -> Vec<(String, String)> {
        let mut v = vec![("HOME".to_string(), self.home.clone())];
        if let Some(n) = &self.name {
            v.push(("USER".into(), n.clone()));
            v.push(("LOGNAME".into(), n.clone()));
        }
        v
    }
}

/// In the forked child, before exec: groups, gid, then uid (which clears every capability, so the
/// command holds no more power than that uid has).
pub fn drop_to(c: &Creds) -> Result<(), super::Failure> {
    use super::Failure;
    use crate::proto::InitErrorKind::Spawn;
    let groups: Vec<nix::unistd::Gid> = c
        .groups
        .iter()
        .map(|g| nix::unistd::Gid::from_raw(*g))
        .collect();
    nix::unistd::setgroups(&groups).map_err(|e| Failure::errno(Spawn, "setgroups", e))?;
    let gid = nix::unistd::Gid::from_raw(c.gid);
    nix::unistd::setresgid(gid, gid, gid)
        .map_err(|e| Failure::errno(Spawn, format_args!("setgid {}", c.gid), e))?;
    let uid = nix::unistd::Uid::from_raw(c.uid);
    nix::unistd::setresuid(uid, uid, uid)
        .map_err(|e| Failure::errno(Spawn, format_args!("setuid {}", c.uid), e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n\
        user:x:1000:1000::/home/user:/bin/bash\n\
        broken:x:abc:1::/x:/bin/sh\n";
    const GROUP: &str = "root:x:0:\nusers:x:100:user,daemon\nuser:x:1000:\naudio:x:29:user\n";

    #[test]
    fn names_and_ids() {
        let u = resolve_in("user", PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (1000, 1000, "/home/user"));
        assert_eq!(u.groups, vec![1000, 100, 29]);
        assert_eq!(u.name.as_deref(), Some("user"));
        let r = resolve_in("root", PASSWD, GROUP).unwrap();
        assert_eq!((r.uid, r.gid, r.home.as_str()), (0, 0, "/root"));
        let n = resolve_in("1000", PASSWD, GROUP).unwrap();
        assert_eq!(n.name.as_deref(), Some("user"));
        let x = resolve_in("4242", PASSWD, GROUP).unwrap();
        assert_eq!(
            (x.uid, x.gid, x.home.as_str(), x.name),
            (4242, 4242, "/", None)
        );
        let y = resolve_in("4242:7", PASSWD, GROUP).unwrap();
        assert_eq!((y.uid, y.gid, y.groups), (4242, 7, vec![7]));
    }

    #[test]
    fn bad_users() {
        for bad in [
            "",
            "nobody-here",
            "user:1",
            "1:x",
            "-1",
            "4294967295",
            "a\0b",
            "+1",
            "broken",
        ] {
            assert!(resolve_in(bad, PASSWD, GROUP).is_err(), "{bad:?}");
        }
        assert_eq!(
            resolve_in("nobody-here", PASSWD, GROUP),
            Err(UserError::NoSuchUser("nobody-here".into()))
        );
        assert_eq!(
            resolve_in("nobody-here", PASSWD, GROUP)
                .unwrap_err()
                .to_string(),
            "user \"nobody-here\": no such user in the sandbox's /etc/passwd"
        );
        assert!(matches!(
            resolve_in("user:1", PASSWD, GROUP),
            Err(UserError::Bad { .. })
        ));
        assert_eq!(
            resolve_in("4294967295", PASSWD, GROUP)
                .unwrap_err()
                .to_string(),
            "user \"4294967295\": -1 is not an id"
        );
    }
}
