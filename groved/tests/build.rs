//! Image builds from Dockerfiles through the real daemon: RUN in real sandboxes, steps as nodefs
//! commits, the step cache, errors naming the line, hostile contexts and trees.

mod common;

use axum::body::Bytes;
use common::{daemon, rand_suffix, Daemon, IMAGE};
use hyper::Method;
use serde_json::{json, Value};

/// A tar of `files` (path, content); a content starting with "->" makes a symlink.
fn tar_of(files: &[(&str, &str)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, content) in files {
        let mut h = tar::Header::new_gnu();
        if let Some(target) = content.strip_prefix("->") {
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            h.set_mode(0o777);
            b.append_link(&mut h, path, target).unwrap();
        } else {
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(content.len() as u64);
            h.set_mode(0o644);
            b.append_data(&mut h, path, content.as_bytes()).unwrap();
        }
    }
    b.into_inner().unwrap()
}

/// POSTs a build; returns the status and, for 200, the SSE events.
fn build(d: &Daemon, query: &str, ctx: Vec<u8>) -> (u16, Vec<(String, Value)>, Value) {
    let r = d.send(
        Method::POST,
        &format!("/v1/images/build?{query}"),
        Some(("application/x-tar", Bytes::from(ctx))),
        &[],
    );
    if r.status != 200 {
        let v = r.json();
        return (r.status, Vec::new(), v);
    }
    let mut p = groved::client::SseParser::default();
    let evs: Vec<(String, Value)> = p
        .push(&r.body)
        .into_iter()
        .map(|(e, d)| (e, serde_json::from_str(&d).unwrap()))
        .collect();
    let last = evs.last().map(|e| e.1.clone()).unwrap_or(Value::Null);
    (200, evs, last)
}

fn steps(evs: &[(String, Value)]) -> Vec<&Value> {
    evs.iter()
        .filter(|(e, _)| e == "step")
        .map(|e| &e.1)
        .collect()
}

fn ended_with<'a>(evs: &'a [(String, Value)], what: &str) -> &'a Value {
    let (e, v) = evs.last().expect("no events");
    assert_eq!(e, what, "the build ended with {e}: {v}");
    v
}

/// Runs `shell` in a sandbox of `image`; returns stdout (asserting exit 0).
fn run_in(d: &Daemon, image: &str, shell: &str) -> String {
    let id = d.create(json!({ "image": image }));
    let r = d.exec(&id, shell);
    d.delete(&id);
    assert_eq!(r["exit_code"], 0, "{shell}: {r}");
    r["stdout"].as_str().unwrap_or("").to_string()
}

fn no_build_sandboxes(d: &Daemon) {
    let v = d
        .call(Method::GET, "/v1/sandboxes", None)
        .expect(200)
        .json();
    for s in v["items"].as_array().unwrap() {
        assert!(
            s["labels"].get("grove.build").is_none(),
            "a build sandbox is left: {s}"
        );
    }
}

fn fsck_clean(d: &Daemon) {
    let v = d
        .call(Method::POST, "/v1/node/fsck", None)
        .expect(200)
        .json();
    assert_eq!(v["ok"], true, "fsck: {v}");
}

fn image_names(d: &Daemon) -> Vec<String> {
    let v = d.call(Method::GET, "/v1/images", None).expect(200).json();
    v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_string())
        .collect()
}

const MULTI: &str = r#"# a multi-stage build
ARG GREETING=hello
FROM BASE AS builder
ARG GREETING
WORKDIR /src
COPY a.txt b.txt ./
RUN cat a.txt b.txt > out.txt \
 && echo "$GREETING" >> out.txt && echo built-it

FROM BASE AS unused
RUN exit 1

FROM BASE
ENV APP=/app
COPY --from=builder /src/out.txt $APP/
COPY --chown=1000:1000 --chmod=0600 conf/ /etc/app/
RUN mkdir /data && chown 1000 /data && echo second-run
USER 1000
RUN id -u > /data/uid
LABEL org.test=yes
EXPOSE 8080
CMD ["cat", "/app/out.txt"]
"#;

fn multi_ctx(x_conf: &str, secret: &str) -> Vec<u8> {
    let df = MULTI.replace("BASE", IMAGE);
    tar_of(&[
        ("Dockerfile", &df),
        (".dockerignore", "conf/secret.txt\n"),
        ("a.txt", "A\n"),
        ("b.txt", "B\n"),
        ("conf/x.conf", x_conf),
        ("conf/secret.txt", secret),
    ])
}

/// A multi-stage build; its rebuild runs no step (an ignored file changed); a change to one
/// COPY'd file reruns from that COPY on and nothing before it.
#[test]
fn multi_stage_cache_and_one_file_change() {
    // Alone on the node: the checks for build sandboxes left over see every sandbox.
    let _g = common::EXCLUSIVE.write().unwrap();
    let d = daemon();
    let name = format!("built-{}", rand_suffix());
    let q = format!("name={name}&build_arg=GREETING%3Dhello2");

    let (st, evs, _) = build(d, &q, multi_ctx("x=1\n", "s1"));
    assert_eq!(st, 200);
    let done = ended_with(&evs, "done");
    let out: String = evs
        .iter()
        .filter(|(e, _)| e == "output")
        .map(|(_, v)| v["data"].as_str().unwrap().to_string())
        .collect();
    assert!(
        out.contains("built-it") && out.contains("second-run"),
        "{out}"
    );
    // The unused stage (its RUN fails) was never built.
    assert!(steps(&evs).iter().all(|s| s["instruction"] != "RUN exit 1"));
    let cfg = &done["image"]["config"];
    assert_eq!(cfg["cmd"], json!(["cat", "/app/out.txt"]), "{done}");
    assert_eq!(cfg["user"], "1000");
    assert_eq!(cfg["exposed_ports"], json!(["8080/tcp"]));
    assert_eq!(cfg["labels"]["org.test"], "yes");
    assert!(cfg["env"].as_array().unwrap().contains(&json!("APP=/app")));
    assert_eq!(
        run_in(d, &name, "cat /app/out.txt"),
        "A\nB\nhello2\n",
        "COPY --from and the build arg"
    );
    assert_eq!(
        run_in(
            d,
            &name,
            "stat -c '%u %g %a' /etc/app/x.conf; cat /data/uid; test ! -e /etc/app/secret.txt && echo ignored"
        ),
        "1000 1000 600\n1000\nignored\n"
    );

    // Nothing changed but an ignored file: no step runs, nothing is printed by a RUN.
    let t = std::time::Instant::now();
    let (st, evs, _) = build(d, &q, multi_ctx("x=1\n", "s2-changed"));
    let took = t.elapsed();
    assert_eq!(st, 200);
    let done = ended_with(&evs, "done");
    assert_eq!(done["steps_run"], 0, "{evs:?}");
    assert!(evs.iter().all(|(e, _)| e != "output"), "a RUN ran: {evs:?}");
    for s in steps(&evs) {
        assert_ne!(s["cached"], false, "step ran: {s}");
    }
    eprintln!("cached rebuild: {took:?}");

    // One COPY'd file changed: the builder stage and the COPY --from are cache hits, the COPY
    // of conf/ and every step after it run again.
    let (st, evs, _) = build(d, &q, multi_ctx("x=2\n", "s2-changed"));
    assert_eq!(st, 200);
    ended_with(&evs, "done");
    let fs: Vec<(String, bool)> = steps(&evs)
        .iter()
        .filter(|s| !s["cached"].is_null())
        .map(|s| {
            (
                s["instruction"].as_str().unwrap().to_string(),
                s["cached"] == true,
            )
        })
        .collect();
    let first_run = fs.iter().position(|(_, c)| !c).expect("something reran");
    assert!(
        fs[first_run].0.starts_with("COPY --chown"),
        "reran from {:?}: {fs:?}",
        fs[first_run].0
    );
    assert!(fs[first_run..].iter().all(|(_, c)| !c), "{fs:?}");
    assert_eq!(run_in(d, &name, "cat /etc/app/x.conf"), "x=2\n");

    d.call(Method::DELETE, &format!("/v1/images/{name}"), None)
        .expect(204);
    no_build_sandboxes(d);
}

/// Dockerfile errors are a 400 naming the line, before anything is made; a failing RUN names its
/// step and line, and leaves no image, no sandbox and a clean store.
#[test]
fn errors_name_the_line_and_leave_nothing() {
    // Alone on the node: the checks for build sandboxes left over see every sandbox.
    let _g = common::EXCLUSIVE.write().unwrap();
    let d = daemon();
    let name = format!("bad-{}", rand_suffix());
    let df = format!("FROM {IMAGE}\nRUN true\n\nVOLUME /data\n");
    let (st, _, v) = build(d, &format!("name={name}"), tar_of(&[("Dockerfile", &df)]));
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["field"], "dockerfile");
    assert!(v["message"].as_str().unwrap().contains("line 4"), "{v}");
    let (st, _, v) = build(d, &format!("name={name}"), tar_of(&[("a", "b")]));
    assert_eq!(st, 400, "no Dockerfile: {v}");
    let (st, _, v) = build(d, "name=..x", tar_of(&[("Dockerfile", &df)]));
    assert_eq!(st, 422, "{v}");
    assert_eq!(v["field"], "name");

    let df = format!("FROM {IMAGE}\nRUN echo partial > /partial\nRUN echo failing-step; exit 3\nRUN echo never\n");
    let (st, evs, _) = build(d, &format!("name={name}"), tar_of(&[("Dockerfile", &df)]));
    assert_eq!(st, 200);
    let e = ended_with(&evs, "error");
    assert_eq!(e["step"], 3, "{e}");
    assert_eq!(e["line"], 3, "{e}");
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains("exited with code 3") && msg.contains("line 3"),
        "{msg}"
    );
    assert!(!image_names(d).contains(&name));
    let df = format!("FROM no-such-image-{}\n", rand_suffix());
    let (st, evs, _) = build(d, &format!("name={name}"), tar_of(&[("Dockerfile", &df)]));
    assert_eq!(st, 200);
    let e = ended_with(&evs, "error");
    assert_eq!(e["line"], 1, "{e}");
    assert!(!image_names(d).contains(&name));
    no_build_sandboxes(d);
    fsck_clean(d);
}

/// A hostile context and a hostile tree: a context symlink to the host's /etc, a tar member
/// climbing out, and an earlier RUN planting a symlink to a host directory that a later COPY
/// writes through. None reaches the host.
#[test]
fn hostile_context_and_tree_stay_inside() {
    // Alone on the node: the checks for build sandboxes left over see every sandbox.
    let _g = common::EXCLUSIVE.write().unwrap();
    let d = daemon();
    let name = format!("hostile-{}", rand_suffix());

    // COPY through a context symlink to /etc: resolved inside the context, so not found.
    let df = format!("FROM {IMAGE}\nCOPY evil/hostname /leak\n");
    let (st, evs, _) = build(
        d,
        &format!("name={name}"),
        tar_of(&[("Dockerfile", &df), ("evil", "->/etc")]),
    );
    assert_eq!(st, 200);
    let e = ended_with(&evs, "error");
    assert_eq!(e["line"], 2, "{e}");
    assert!(!image_names(d).contains(&name));

    // A member named ../x: refused, nothing written next to the context.
    let mut raw = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(1);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    {
        let gnu = h.as_gnu_mut().unwrap();
        gnu.name[..13].copy_from_slice(b"../../escaped");
    }
    h.set_cksum();
    raw.append(&h, &b"x"[..]).unwrap();
    let (st, _, v) = build(d, &format!("name={name}"), raw.into_inner().unwrap());
    assert_eq!(st, 400, "{v}");

    // A RUN plants /target -> a directory that exists on the host (and in the image); the COPYs
    // through it and through a link to a file there land inside the image.
    let host_dir =
        std::path::PathBuf::from(format!("/var/tmp/grove-build-escape-{}", rand_suffix()));
    std::fs::create_dir_all(&host_dir).unwrap();
    let df = format!(
        "FROM {IMAGE}\nRUN mkdir -p {h} && ln -s {h} /target\nCOPY f.txt /target/f.txt\nRUN ln -s {h}/g.txt /g-link\nCOPY f.txt /g-link\n",
        h = host_dir.display()
    );
    let (st, evs, _) = build(
        d,
        &format!("name={name}"),
        tar_of(&[("Dockerfile", &df), ("f.txt", "planted\n")]),
    );
    assert_eq!(st, 200);
    ended_with(&evs, "done");
    let escaped: Vec<String> = std::fs::read_dir(&host_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let _ = std::fs::remove_dir_all(&host_dir);
    assert!(
        escaped.is_empty(),
        "COPY wrote {escaped:?} into {} on the host",
        host_dir.display()
    );
    assert_eq!(
        run_in(
            d,
            &name,
            &format!("cat {h}/f.txt {h}/g.txt /g-link", h = host_dir.display())
        ),
        "planted\nplanted\nplanted\n"
    );
    d.call(Method::DELETE, &format!("/v1/images/{name}"), None)
        .expect(204);
    no_build_sandboxes(d);
}

/// The step cache is bounded: a prune keeps the most recently used entries and drops the rest,
/// so a build whose entries went runs its steps again while a newer one stays cached; `all`
/// empties it and the store's gc then frees bytes. A bad body is a 4xx naming the field.
#[test]
fn cache_prune_keeps_the_recently_used_and_drops_the_rest() {
    // Alone on the node: other builds' entries and a build under way would change the counts.
    let _g = common::EXCLUSIVE.write().unwrap();
    let d = daemon();
    let prune = |body: Value| d.call(Method::POST, "/v1/images/build-cache/prune", Some(body));
    prune(json!({"all": true})).expect(200);
    let ctx = |tag: &str| {
        let df = format!("FROM {IMAGE}\nCOPY f /f\nRUN cat /f > /g\n");
        tar_of(&[("Dockerfile", &df), ("f", tag)])
    };
    let (a, b) = (rand_suffix(), rand_suffix());
    let name = format!("pruned-{}", rand_suffix());
    let build_run = |tag: &str| -> u64 {
        let (st, evs, _) = build(d, &format!("name={name}"), ctx(tag));
        assert_eq!(st, 200);
        ended_with(&evs, "done")["steps_run"].as_u64().unwrap()
    };
    assert_eq!(build_run(&a), 2, "a fresh build runs COPY and RUN");
    let after_a = prune(json!({})).expect(200).json();
    assert_eq!(after_a["removed"], 0, "{after_a}");
    let per_build = after_a["kept"].as_u64().unwrap();
    assert!(per_build >= 2, "{after_a}");
    // Distinct last-use times for a and b.
    std::thread::sleep(std::time::Duration::from_millis(5));
    assert_eq!(build_run(&b), 2);
    assert_eq!(build_run(&b), 0, "a rebuild is fully cached");
    assert_eq!(build_run(&a), 0, "a's entries are still there");
    // a was used last: keeping one build's worth keeps a's and drops b's.
    let r = prune(json!({"max_entries": per_build})).expect(200).json();
    assert_eq!(r["kept"], per_build, "{r}");
    assert_eq!(r["removed"], per_build, "{r}");
    assert_eq!(build_run(&a), 0, "the most recently used stay cached");
    assert_eq!(build_run(&b), 2, "the pruned build runs its steps again");
    // Nothing is older than a day: an age bound of a day drops nothing, of 0 s everything.
    let r = prune(json!({"max_age_secs": 86400})).expect(200).json();
    assert_eq!(r["removed"], 0, "{r}");
    std::thread::sleep(std::time::Duration::from_millis(5));
    let r = prune(json!({"max_age_secs": 0})).expect(200).json();
    assert_eq!(r["kept"], 0, "{r}");
    assert!(r["removed"].as_u64().unwrap() >= per_build, "{r}");
    assert_eq!(build_run(&a), 2, "an emptied cache runs every step");
    d.call(Method::DELETE, &format!("/v1/images/{name}"), None)
        .expect(204);
    let r = prune(json!({"all": true})).expect(200).json();
    assert!(r["removed"].as_u64().unwrap() >= per_build, "{r}");
    let gc = d.call(Method::POST, "/v1/node/gc", None).expect(200).json();
    assert_eq!(gc["ok"], true, "{gc}");

    let bad = |body: &str| d.call_invalid(Method::POST, "/v1/images/build-cache/prune", body);
    let e = bad(r#"{"max_entries": -1}"#).expect_error(422, Some("max_entries"));
    assert_eq!(e["code"], "invalid_request", "{e}");
    bad(r#"{"bogus": 1}"#).expect_error(422, Some("bogus"));
    no_build_sandboxes(d);
}
