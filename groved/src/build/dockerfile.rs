//! A Dockerfile parser of our own: the text becomes stages of typed instructions, each with the
//! line it starts on, so every later error can name that line. Variables are not expanded here
//! (that needs the build's ARG/ENV state, see [`expand`]).

use std::collections::BTreeMap;

/// A parse error: the (1-based) line and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Dockerfile line {line}: {reason}")]
pub struct ParseError {
    pub line: usize,
    pub reason: String,
}

fn err<T>(line: usize, reason: impl Into<String>) -> Result<T, ParseError> {
    Err(ParseError {
        line,
        reason: reason.into(),
    })
}

/// `RUN`/`CMD`/`ENTRYPOINT` arguments: a JSON array (exec form) or a shell command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmdForm {
    Exec(Vec<String>),
    Shell(String),
}

/// COPY and ADD.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copy {
    pub add: bool,
    pub srcs: Vec<String>,
    pub dst: String,
    /// A stage name or index, or an image.
    pub from: Option<String>,
    pub chown: Option<String>,
    pub chmod: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Run(CmdForm),
    Copy(Copy),
    Env(Vec<(String, String)>),
    Arg(String, Option<String>),
    Workdir(String),
    User(String),
    Label(Vec<(String, String)>),
    Expose(Vec<String>),
    Cmd(CmdForm),
    Entrypoint(CmdForm),
    Shell(Vec<String>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instr {
    pub line: usize,
    /// The instruction as written (continuations joined), for logs and cache keys.
    pub text: String,
    pub kind: Kind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    pub line: usize,
    /// `FROM` as written (variables unexpanded).
    pub from: String,
    pub name: Option<String>,
    pub steps: Vec<Instr>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dockerfile {
    /// `ARG`s before the first `FROM`: usable in `FROM` lines (and re-declared in stages).
    pub global_args: Vec<(String, Option<String>)>,
    pub stages: Vec<Stage>,
}

impl Dockerfile {
    /// The stage a `--from=` or `FROM` names: a stage name (case-insensitive) or index, among the
    /// stages before `before`.
    pub fn stage_index(&self, name: &str, before: usize) -> Option<usize> {
        if let Ok(i) = name.parse::<usize>() {
            return (i < before).then_some(i);
        }
        self.stages[..before].iter().position(|s| {
            s.name
                .as_deref()
                .is_some_and(|n| n.eq_ignore_ascii_case(name))
        })
    }
}

/// One logical line: the instruction word, its raw arguments, the line it started on.
struct Logical {
    line: usize,
    word: String,
    args: String,
}

pub fn parse(text: &str) -> Result<Dockerfile, ParseError> {
    let escape = directives(text)?;
    let mut df = Dockerfile {
        global_args: Vec::new(),
        stages: Vec::new(),
    };
    for l in logical_lines(text, escape)? {
        let word = l.word.to_ascii_uppercase();
        let text = format!("{word} {}", l.args).trim_end().to_string();
        if word == "FROM" {
            let stage = parse_from(l.line, &l.args)?;
            if let Some(n) = &stage.name {
                if df.stage_index(n, df.stages.len()).is_some() {
                    return err(l.line, format!("duplicate stage name {n:?}"));
                }
            }
            df.stages.push(stage);
            continue;
        }
        let kind = parse_instr(l.line, &word, &l.args, escape)?;
        match df.stages.last_mut() {
            Some(s) => s.steps.push(Instr {
                line: l.line,
                text,
                kind,
            }),
            None => match kind {
                Kind::Arg(k, v) => df.global_args.push((k, v)),
                _ => return err(l.line, format!("{word} before the first FROM")),
            },
        }
    }
    if df.stages.is_empty() {
        return err(1, "no FROM instruction");
    }
    Ok(df)
}

/// Parser directives (`# escape=`, `# syntax=`) at the top of the file; returns the escape char.
fn directives(text: &str) -> Result<char, ParseError> {
    let mut escape = '\\';
    for (i, raw) in text.lines().enumerate() {
        let Some(rest) = raw.trim().strip_prefix('#') else {
            break;
        };
        let Some((k, v)) = rest.split_once('=') else {
            break;
        };
        let k = k.trim().to_ascii_lowercase();
        if k.contains(char::is_whitespace) {
            break;
        }
        match k.as_str() {
            "escape" => match v.trim() {
                "\\" => escape = '\\',
                "`" => escape = '`',
                other => return err(i + 1, format!("escape must be \\ or `, not {other:?}")),
            },
            // The syntax frontend is BuildKit's business; this parser is the only one here.
            "syntax" | "check" => {}
            _ => break,
        }
    }
    Ok(escape)
}

/// Joins continuation lines (escape char at the end), drops comments and blank lines.
fn logical_lines(text: &str, escape: char) -> Result<Vec<Logical>, ParseError> {
    let mut out = Vec::new();
    let mut cur: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let lineno = i + 1;
        let trimmed = raw.trim_start();
        // Comment lines are dropped, also in the middle of a continued instruction.
        if trimmed.starts_with('#') {
            continue;
        }
        if cur.is_none() && trimmed.trim().is_empty() {
            continue;
        }
        let body = raw.trim_end();
        let (piece, continues) = match body.strip_suffix(escape) {
            Some(p) => (p, true),
            None => (body, false),
        };
        match &mut cur {
            None => cur = Some((lineno, piece.trim_start().to_string())),
            Some((_, s)) => {
                if !piece.trim().is_empty() {
                    s.push_str(piece);
                }
            }
        }
        if !continues {
            let (line, s) = cur.take().expect("set above");
            out.push(split_word(line, &s)?);
        }
    }
    if let Some((line, s)) = cur {
        // A trailing continuation at end of file still ends the instruction.
        out.push(split_word(line, &s)?);
    }
    Ok(out)
}

fn split_word(line: usize, s: &str) -> Result<Logical, ParseError> {
    let s = s.trim();
    let (word, args) = match s.find(char::is_whitespace) {
        Some(i) => (&s[..i], s[i..].trim()),
        None => (s, ""),
    };
    if !word.chars().all(|c| c.is_ascii_alphabetic()) {
        return err(line, format!("{word:?} is not an instruction"));
    }
    Ok(Logical {
        line,
        word: word.to_string(),
        args: args.to_string(),
    })
}

fn parse_from(line: usize, args: &str) -> Result<Stage, ParseError> {
    let (flags, rest) = take_flags(args);
    if let Some((k, _)) = flags.first() {
        return if k == "platform" {
            err(
                line,
                "FROM --platform is not supported (builds are linux/amd64)",
            )
        } else {
            err(line, format!("FROM: unknown flag --{k}"))
        };
    }
    let words: Vec<&str> = rest.split_whitespace().collect();
    let (from, name) = match words.as_slice() {
        [img] => (*img, None),
        [img, as_, name] if as_.eq_ignore_ascii_case("as") => {
            let ok = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
            if !ok {
                return err(line, format!("stage name {name:?} is invalid"));
            }
            (*img, Some(name.to_ascii_lowercase()))
        }
        _ => return err(line, "FROM takes IMAGE [AS NAME]"),
    };
    Ok(Stage {
        line,
        from: from.to_string(),
        name,
        steps: Vec::new(),
    })
}

/// Leading `--name=value` flags, and the rest.
fn take_flags(args: &str) -> (Vec<(String, String)>, &str) {
    let mut flags = Vec::new();
    let mut rest = args.trim_start();
    while let Some(f) = rest.strip_prefix("--") {
        let end = f.find(char::is_whitespace).unwrap_or(f.len());
        let (k, v) = match f[..end].split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (f[..end].to_string(), String::new()),
        };
        flags.push((k.to_ascii_lowercase(), v));
        rest = f[end..].trim_start();
    }
    (flags, rest)
}

fn parse_instr(line: usize, word: &str, args: &str, escape: char) -> Result<Kind, ParseError> {
    let need = |what: &str| {
        if args.is_empty() {
            err(line, format!("{word} needs {what}"))
        } else {
            Ok(())
        }
    };
    if args.starts_with("<<") || (word == "RUN" && args.contains(" <<")) {
        return err(line, format!("{word}: heredocs are not supported"));
    }
    Ok(match word {
        "RUN" => {
            let (flags, rest) = take_flags(args);
            if let Some((k, v)) = flags.first() {
                return match k.as_str() {
                    "mount" => err(
                        line,
                        format!("RUN --mount={v} is not supported (no cache/secret/ssh mounts)"),
                    ),
                    "network" => err(
                        line,
                        "RUN --network is not supported (the build's --allow sets egress)",
                    ),
                    _ => err(line, format!("RUN: unknown flag --{k}")),
                };
            }
            if rest.is_empty() {
                return err(line, "RUN needs a command");
            }
            Kind::Run(cmd_form(rest))
        }
        "CMD" | "ENTRYPOINT" => {
            need("a command")?;
            let c = cmd_form(args);
            if word == "CMD" {
                Kind::Cmd(c)
            } else {
                Kind::Entrypoint(c)
            }
        }
        "SHELL" => match json_array(args) {
            Some(v) if !v.is_empty() => Kind::Shell(v),
            _ => return err(line, "SHELL needs a JSON array, e.g. [\"/bin/sh\", \"-c\"]"),
        },
        "COPY" | "ADD" => Kind::Copy(parse_copy(line, word, args, escape)?),
        "ENV" => {
            need("KEY=VALUE")?;
            Kind::Env(key_values(line, word, args, escape, true)?)
        }
        "LABEL" => {
            need("KEY=VALUE")?;
            Kind::Label(key_values(line, word, args, escape, false)?)
        }
        "MAINTAINER" => {
            need("a name")?;
            Kind::Label(vec![("maintainer".into(), args.to_string())])
        }
        "ARG" => {
            let words = shell_words(line, args, escape)?;
            let [w] = words.as_slice() else {
                return err(line, "ARG takes one NAME[=DEFAULT]");
            };
            let (k, v) = match w.split_once('=') {
                Some((k, v)) => (k.to_string(), Some(v.to_string())),
                None => (w.clone(), None),
            };
            check_var_name(line, &k)?;
            Kind::Arg(k, v)
        }
        "WORKDIR" => {
            need("a path")?;
            Kind::Workdir(unquote_one(line, args, escape)?)
        }
        "USER" => {
            need("a user")?;
            Kind::User(unquote_one(line, args, escape)?)
        }
        "EXPOSE" => {
            need("a port")?;
            Kind::Expose(shell_words(line, args, escape)?)
        }
        "VOLUME" => return err(line, "VOLUME is not supported (sandboxes have no volumes)"),
        "HEALTHCHECK" => return err(line, "HEALTHCHECK is not supported"),
        "STOPSIGNAL" => return err(line, "STOPSIGNAL is not supported"),
        "ONBUILD" => return err(line, "ONBUILD is not supported"),
        other => return err(line, format!("unknown instruction {other}")),
    })
}

fn check_var_name(line: usize, k: &str) -> Result<(), ParseError> {
    let ok = k
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok {
        Ok(())
    } else {
        err(line, format!("{k:?} is not a variable name"))
    }
}

fn json_array(args: &str) -> Option<Vec<String>> {
    if !args.trim_start().starts_with('[') {
        return None;
    }
    serde_json::from_str::<Vec<String>>(args).ok()
}

/// Docker's rule: a valid JSON string array is the exec form, anything else a shell command.
fn cmd_form(args: &str) -> CmdForm {
    match json_array(args) {
        Some(v) => CmdForm::Exec(v),
        None => CmdForm::Shell(args.to_string()),
    }
}

fn parse_copy(line: usize, word: &str, args: &str, escape: char) -> Result<Copy, ParseError> {
    let (flags, rest) = take_flags(args);
    let mut c = Copy {
        add: word == "ADD",
        srcs: Vec::new(),
        dst: String::new(),
        from: None,
        chown: None,
        chmod: None,
    };
    for (k, v) in flags {
        match k.as_str() {
            "from" if !c.add => c.from = Some(v),
            "chown" => c.chown = Some(v),
            "chmod" => match u32::from_str_radix(&v, 8) {
                Ok(m) if m <= 0o7777 => c.chmod = Some(m),
                _ => return err(line, format!("{word} --chmod={v:?}: not an octal mode")),
            },
            // Only a layer-reuse hint for BuildKit; every COPY here is its own commit anyway.
            "link" => {}
            _ => return err(line, format!("{word}: unsupported flag --{k}")),
        }
    }
    let mut words = match json_array(rest) {
        Some(v) => v,
        None => shell_words(line, rest, escape)?,
    };
    if words.len() < 2 {
        return err(
            line,
            format!("{word} needs at least one source and a destination"),
        );
    }
    c.dst = words.pop().expect("len >= 2");
    c.srcs = words;
    if c.add {
        if let Some(u) = c.srcs.iter().find(|s| s.contains("://")) {
            return err(
                line,
                format!("ADD {u}: URLs are not supported (builds have no network by default)"),
            );
        }
    }
    Ok(c)
}

/// Splits on whitespace, honouring quotes and the escape char (quotes are removed).
fn shell_words(line: usize, s: &str, escape: char) -> Result<Vec<String>, ParseError> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (Some(q), c) if c == q => quote = None,
            (Some('\''), c) => cur.push(c),
            (_, c) if c == escape => {
                in_word = true;
                match chars.next() {
                    // `\$` stays escaped so that expansion leaves it a literal `$`.
                    Some('$') => cur.push_str("\\$"),
                    Some(n) => cur.push(n),
                    None => cur.push(c),
                }
            }
            (_, c) => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if quote.is_some() {
        return err(line, "unterminated quote");
    }
    if in_word {
        out.push(cur);
    }
    Ok(out)
}

fn unquote_one(line: usize, s: &str, escape: char) -> Result<String, ParseError> {
    let w = shell_words(line, s, escape)?;
    match w.as_slice() {
        [one] => Ok(one.clone()),
        _ => Ok(s.trim().to_string()),
    }
}

/// `K=V K2="v 2"` pairs, or the old `K V with spaces` form (only for ENV when there is no `=`).
fn key_values(
    line: usize,
    word: &str,
    args: &str,
    escape: char,
    env: bool,
) -> Result<Vec<(String, String)>, ParseError> {
    let words = shell_words(line, args, escape)?;
    let first_has_eq = words.first().is_some_and(|w| w.contains('='));
    if !first_has_eq {
        let Some((k, v)) = args.trim().split_once(char::is_whitespace) else {
            return err(line, format!("{word} needs KEY=VALUE"));
        };
        if env {
            check_var_name(line, k)?;
        }
        return Ok(vec![(k.to_string(), unquote_one(line, v, escape)?)]);
    }
    let mut out = Vec::new();
    for w in words {
        let Some((k, v)) = w.split_once('=') else {
            return err(line, format!("{word}: {w:?} is not KEY=VALUE"));
        };
        if env {
            check_var_name(line, k)?;
        } else if k.is_empty() {
            return err(line, "LABEL: empty key");
        }
        out.push((k.to_string(), v.to_string()));
    }
    Ok(out)
}

/// Expands `$V`, `${V}`, `${V:-default}` and `${V:+alt}` from `vars`; `\$` is a literal `$`.
/// Unset variables expand to nothing, as in Docker.
pub fn expand(s: &str, vars: &BTreeMap<String, String>) -> Result<String, String> {
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' && chars.peek() == Some(&'$') {
            out.push('$');
            chars.next();
            continue;
        }
        if c != '$' {
            out.push(c);
            continue;
        }
        match chars.peek() {
            Some('{') => {
                chars.next();
                let mut inner = String::new();
                let mut depth = 1;
                for c in chars.by_ref() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                    inner.push(c);
                }
                if depth != 0 {
                    return Err(format!("unterminated ${{ in {s:?}"));
                }
                let (name, op) = match inner.find(':') {
                    Some(i) => (&inner[..i], Some(&inner[i..])),
                    None => (inner.as_str(), None),
                };
                let val = vars.get(name).filter(|v| !v.is_empty());
                match op {
                    None => out.push_str(vars.get(name).map(String::as_str).unwrap_or("")),
                    Some(o) if o.starts_with(":-") => match val {
                        Some(v) => out.push_str(v),
                        None => out.push_str(&expand(&o[2..], vars)?),
                    },
                    Some(o) if o.starts_with(":+") => {
                        if val.is_some() {
                            out.push_str(&expand(&o[2..], vars)?);
                        }
                    }
                    Some(o) => return Err(format!("unsupported substitution ${{{name}{o}}}")),
                }
            }
            Some(c) if c.is_ascii_alphabetic() || *c == '_' => {
                let mut name = String::new();
                while let Some(&c) = chars.peek() {
                    if c.is_ascii_alphanumeric() || c == '_' {
                        name.push(c);
                        chars.next();
                    } else {
                        break;
                    }
                }
                out.push_str(vars.get(&name).map(String::as_str).unwrap_or(""));
            }
            _ => out.push('$'),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(text: &str) -> Kind {
        let df = parse(&format!("FROM scratch\n{text}\n")).unwrap();
        df.stages[0].steps[0].kind.clone()
    }

    fn line_of(text: &str) -> (usize, String) {
        let e = parse(text).unwrap_err();
        (e.line, e.reason)
    }

    #[test]
    fn stages_names_and_global_args() {
        let df = parse(
            "# syntax=docker/dockerfile:1\nARG BASE=debian12\nFROM ${BASE} AS Build\nRUN make\n\nFROM scratch\nCOPY --from=build /out /\n",
        )
        .unwrap();
        assert_eq!(
            df.global_args,
            vec![("BASE".into(), Some("debian12".into()))]
        );
        assert_eq!(df.stages.len(), 2);
        assert_eq!(df.stages[0].name.as_deref(), Some("build"));
        assert_eq!(df.stages[0].from, "${BASE}");
        assert_eq!(df.stages[1].line, 6);
        assert_eq!(df.stage_index("BUILD", 1), Some(0));
        assert_eq!(df.stage_index("0", 1), Some(0));
        assert_eq!(df.stage_index("0", 0), None);
        let Kind::Copy(c) = &df.stages[1].steps[0].kind else {
            panic!()
        };
        assert_eq!(c.from.as_deref(), Some("build"));
        assert_eq!(c.srcs, vec!["/out".to_string()]);
    }

    #[test]
    fn run_forms_continuations_and_comments() {
        let df = parse(
            "FROM img\nRUN apt-get update && \\\n    # a comment inside\n    apt-get install -y x\nRUN [\"/bin/echo\", \"a b\"]\nRUN [not json\n",
        )
        .unwrap();
        let s = &df.stages[0].steps;
        assert_eq!(s[0].line, 2);
        assert_eq!(
            s[0].kind,
            Kind::Run(CmdForm::Shell(
                "apt-get update &&     apt-get install -y x".into()
            ))
        );
        assert_eq!(s[1].line, 5);
        assert_eq!(
            s[1].kind,
            Kind::Run(CmdForm::Exec(vec!["/bin/echo".into(), "a b".into()]))
        );
        assert_eq!(s[2].kind, Kind::Run(CmdForm::Shell("[not json".into())));
    }

    #[test]
    fn escape_directive() {
        let df = parse("# escape=`\nFROM img\nRUN echo a `\n  b\nWORKDIR C:\\x\n").unwrap();
        assert_eq!(
            df.stages[0].steps[0].kind,
            Kind::Run(CmdForm::Shell("echo a   b".into()))
        );
        assert_eq!(df.stages[0].steps[1].kind, Kind::Workdir("C:\\x".into()));
    }

    #[test]
    fn copy_flags() {
        let k = one("COPY --chown=app:app --chmod=0755 a b* /dst/");
        assert_eq!(
            k,
            Kind::Copy(Copy {
                add: false,
                srcs: vec!["a".into(), "b*".into()],
                dst: "/dst/".into(),
                from: None,
                chown: Some("app:app".into()),
                chmod: Some(0o755),
            })
        );
        let k = one(r#"ADD ["a b", "/x y"]"#);
        let Kind::Copy(c) = k else { panic!() };
        assert!(c.add);
        assert_eq!(c.srcs, vec!["a b".to_string()]);
        assert_eq!(c.dst, "/x y");
    }

    #[test]
    fn env_label_arg_expose_shell() {
        assert_eq!(
            one(r#"ENV A=1 B="two words" C=\$HOME"#),
            Kind::Env(vec![
                ("A".into(), "1".into()),
                ("B".into(), "two words".into()),
                ("C".into(), "\\$HOME".into())
            ])
        );
        assert_eq!(
            one("ENV OLD value with spaces"),
            Kind::Env(vec![("OLD".into(), "value with spaces".into())])
        );
        assert_eq!(
            one(r#"LABEL org.x="a b" y=z"#),
            Kind::Label(vec![
                ("org.x".into(), "a b".into()),
                ("y".into(), "z".into())
            ])
        );
        assert_eq!(one("ARG V"), Kind::Arg("V".into(), None));
        assert_eq!(one("ARG V=3"), Kind::Arg("V".into(), Some("3".into())));
        assert_eq!(
            one("EXPOSE 80 443/tcp"),
            Kind::Expose(vec!["80".into(), "443/tcp".into()])
        );
        assert_eq!(
            one(r#"SHELL ["/bin/bash", "-ec"]"#),
            Kind::Shell(vec!["/bin/bash".into(), "-ec".into()])
        );
        assert_eq!(
            one("CMD [\"python3\"]"),
            Kind::Cmd(CmdForm::Exec(vec!["python3".into()]))
        );
        assert_eq!(
            one("entrypoint exec x"),
            Kind::Entrypoint(CmdForm::Shell("exec x".into()))
        );
    }

    #[test]
    fn errors_name_the_line() {
        assert_eq!(line_of("FROM a\n\nRUN x\nVOLUME /data\n").0, 4);
        assert!(line_of("FROM a\nFOO bar\n")
            .1
            .contains("unknown instruction FOO"));
        let (l, r) = line_of("FROM a\nRUN \\\n  --mount=type=cache,target=/c make\n");
        assert_eq!(l, 2);
        assert!(r.contains("--mount"), "{r}");
        assert_eq!(line_of("RUN x\n").0, 1);
        assert!(line_of("\n\n").1.contains("no FROM"));
        assert_eq!(line_of("FROM a AS x\nFROM b AS X\n").0, 2);
        assert_eq!(line_of("FROM a\nCOPY onlyone\n").0, 2);
        assert_eq!(line_of("FROM a\nCOPY --chmod=9z a b\n").0, 2);
        assert_eq!(line_of("FROM a\nADD https://x/y /y\n").0, 2);
        assert_eq!(line_of("FROM a\nENV 1X=2\n").0, 2);
        assert_eq!(line_of("FROM a\nRUN <<EOF\nx\nEOF\n").0, 2);
        assert_eq!(line_of("FROM a\nLABEL a=\"b\n").0, 2);
        assert_eq!(line_of("FROM --platform=x a\n").0, 1);
    }

    #[test]
    fn expansion() {
        let vars: BTreeMap<String, String> = [("A", "1"), ("E", "")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let x = |s: &str| expand(s, &vars).unwrap();
        assert_eq!(x("$A/${A}x"), "1/1x");
        assert_eq!(x("${NOPE}-$NOPE"), "-");
        assert_eq!(x("${E:-d}${A:-d}"), "d1");
        assert_eq!(x("${A:+yes}${E:+no}"), "yes");
        assert_eq!(x("\\$A $ 5"), "$A $ 5");
        assert!(expand("${A", &vars).is_err());
        assert!(expand("${A:?x}", &vars).is_err());
    }
}
