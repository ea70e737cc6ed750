//! Path patterns for COPY sources and `.dockerignore`: `*` and `?` within one component,
//! `[...]` classes, `**` for any number of components (Go's `filepath.Match` plus Docker's `**`).

/// Cleans a context-relative pattern or path: no leading `/` or `./`, no empty or `.` parts.
pub fn clean(p: &str) -> String {
    p.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect::<Vec<_>>()
        .join("/")
}

pub fn has_magic(p: &str) -> bool {
    p.contains(['*', '?', '['])
}

/// Whether `path` (cleaned) matches `pattern` (cleaned) as a whole.
pub fn matches(pattern: &str, path: &str) -> bool {
    let pat: Vec<&str> = if pattern.is_empty() {
        Vec::new()
    } else {
        pattern.split('/').collect()
    };
    let comps: Vec<&str> = if path.is_empty() {
        Vec::new()
    } else {
        path.split('/').collect()
    };
    match_comps(&pat, &comps)
}

fn match_comps(pat: &[&str], path: &[&str]) -> bool {
    match pat.split_first() {
        None => path.is_empty(),
        Some((&"**", rest)) => (0..=path.len()).any(|i| match_comps(rest, &path[i..])),
        Some((p, rest)) => match path.split_first() {
            Some((c, prest)) => match_one(p.as_bytes(), c.as_bytes()) && match_comps(rest, prest),
            None => false,
        },
    }
}

/// One component against one pattern component.
fn match_one(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| match_one(rest, &s[i..])),
        Some((b'?', rest)) => !s.is_empty() && match_one(rest, &s[1..]),
        Some((b'[', rest)) => {
            let Some((&c, srest)) = s.split_first() else {
                return false;
            };
            let Some(end) = rest.iter().skip(1).position(|&b| b == b']').map(|i| i + 1) else {
                // No closing bracket: a literal `[`.
                return c == b'[' && match_one(rest, srest);
            };
            let (class, after) = (&rest[..end], &rest[end + 1..]);
            let (neg, class) = match class.first() {
                Some(b'^' | b'!') => (true, &class[1..]),
                _ => (false, class),
            };
            let mut hit = false;
            let mut i = 0;
            while i < class.len() {
                if i + 2 < class.len() && class[i + 1] == b'-' {
                    hit |= class[i] <= c && c <= class[i + 2];
                    i += 3;
                } else {
                    hit |= class[i] == c;
                    i += 1;
                }
            }
            hit != neg && match_one(after, srest)
        }
        Some((b'\\', rest)) if !rest.is_empty() => {
            s.first() == Some(&rest[0]) && match_one(&rest[1..], &s[1..])
        }
        Some((&b, rest)) => s.first() == Some(&b) && match_one(rest, &s[1..]),
    }
}

/// The rules of a `.dockerignore`: the last matching rule wins; `!` re-includes. A rule that
/// matches a directory excludes everything below it.
#[derive(Debug, Default, Clone)]
pub struct Ignore {
    rules: Vec<(bool, String)>,
}

impl Ignore {
    pub fn parse(text: &str) -> Ignore {
        let mut rules = Vec::new();
        for l in text.lines() {
            let l = l.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let (neg, p) = match l.strip_prefix('!') {
                Some(p) => (true, p.trim()),
                None => (false, l),
            };
            let p = clean(p);
            if !p.is_empty() {
                rules.push((neg, p));
            }
        }
        Ignore { rules }
    }

    /// Whether a context path (cleaned) is left out.
    pub fn excluded(&self, path: &str) -> bool {
        let comps: Vec<&str> = path.split('/').collect();
        let mut out = false;
        for (neg, p) in &self.rules {
            // The path itself or one of its parent directories.
            let hit = (1..=comps.len()).any(|n| matches(p, &comps[..n].join("/")));
            if hit {
                out = !neg;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components_and_classes() {
        assert!(matches("*.py", "a.py"));
        assert!(!matches("*.py", "d/a.py"));
        assert!(matches("d/*.py", "d/a.py"));
        assert!(matches("**/*.py", "a.py"));
        assert!(matches("**/*.py", "x/y/a.py"));
        assert!(matches("x/**", "x/y/z"));
        assert!(matches("f?le[0-9]", "file7"));
        assert!(!matches("f?le[0-9]", "file"));
        assert!(matches("[!a]b", "cb"));
        assert!(!matches("[!a]b", "ab"));
        assert_eq!(clean("./a//b/."), "a/b");
    }

    #[test]
    fn dockerignore() {
        let ig = Ignore::parse("# c\nnode_modules\n*.log\n!keep.log\n/build/**\n");
        assert!(ig.excluded("node_modules"));
        assert!(ig.excluded("node_modules/x/y.js"));
        assert!(ig.excluded("a.log"));
        assert!(!ig.excluded("keep.log"));
        assert!(!ig.excluded("d/a.log"));
        assert!(ig.excluded("build/x"));
        assert!(!ig.excluded("src/main.rs"));
    }
}
