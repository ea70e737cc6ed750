//! Snapshot-based pause: park (destroy, keep the id as Paused) and create_restored_as (back under
//! the same id, Paused → Running).

mod common;

use common::*;
use grove_runtime::{EventKind, ExecRequest, SandboxState};

#[test]
fn park_then_restore_under_the_same_id() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let events = rt.subscribe();
    let mut s = spec();
    s.hostname = Some("parked".into());
    let first = rt.create(s.clone()).expect("create");
    let id = first.id.clone();

    let parked = rt.park(&id).expect("park");
    assert_eq!(parked.state, SandboxState::Paused);
    assert_eq!(parked.init_pid, None);
    assert_eq!(rt.get(&id).expect("get").state, SandboxState::Paused);
    assert!(rt
        .list()
        .iter()
        .any(|i| i.id == id && i.state == SandboxState::Paused));
    // Nothing of it is left on the host while parked.
    assert_gone(&rt, &id);
    let err = rt.exec(&id, ExecRequest::argv(["true"])).unwrap_err();
    assert_eq!(err.code(), "conflict", "{err}");
    assert_eq!(rt.resume(&id).unwrap_err().code(), "conflict");

    // A failed restore leaves it parked and nothing on the host.
    let err = rt
        .create_restored_as(id.clone(), s.clone(), &mut |_| Err("criu says no".into()))
        .unwrap_err();
    assert!(err.to_string().contains(id.as_str()), "{err}");
    assert_eq!(rt.get(&id).expect("get").state, SandboxState::Paused);
    assert_gone(&rt, &id);

    let back = rt
        .create_restored_as(id.clone(), s.clone(), &mut |t| {
            assert_eq!(t.id, id);
            start_init_into(t, "old-name")
        })
        .expect("restore as");
    assert_eq!(back.id, id);
    assert_eq!(back.state, SandboxState::Running);
    assert_eq!(back.created_at_ms, first.created_at_ms);
    assert_eq!(out(&sh(&rt, &id, "hostname")), "parked");

    // A live id cannot be restored over.
    let err = rt
        .create_restored_as(id.clone(), s.clone(), &mut |_| {
            panic!("restore must not run for a live id")
        })
        .unwrap_err();
    assert_eq!(err.code(), "conflict", "{err}");

    // destroy forgets a parked id.
    rt.park(&id).expect("park again");
    rt.destroy(&id).expect("destroy parked");
    assert_eq!(rt.get(&id).unwrap_err().code(), "not_found");
    assert!(!rt.list().iter().any(|i| i.id == id));
    assert_gone(&rt, &id);

    let kinds: Vec<EventKind> = events
        .try_iter()
        .filter(|e| e.sandbox == id)
        .map(|e| e.kind)
        .collect();
    use EventKind::*;
    assert_eq!(
        kinds,
        [Created, Paused, Failed, Resumed, Paused, Destroyed],
        "events"
    );
}

#[test]
fn restore_as_needs_a_parked_id_so_a_destroy_wins_over_a_racing_resume() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let never = |_: &grove_runtime::RestoreTarget| -> Result<i32, Box<dyn std::error::Error + Send + Sync>> {
        panic!("restore must not run for an id that is not parked")
    };
    // An id this runtime never saw.
    let unknown = grove_runtime::SandboxId::generate();
    let err = rt
        .create_restored_as(unknown.clone(), spec(), &mut { never })
        .unwrap_err();
    assert_eq!(err.code(), "not_found", "{err}");
    assert_gone(&rt, &unknown);

    // A resume that read the pause record, then lost the race to a DELETE: the sandbox stays
    // deleted.
    let id = rt.create(spec()).expect("create").id;
    rt.park(&id).expect("park");
    rt.destroy(&id).expect("destroy parked");
    let err = rt
        .create_restored_as(id.clone(), spec(), &mut { never })
        .unwrap_err();
    assert_eq!(err.code(), "not_found", "{err}");
    assert_eq!(rt.get(&id).unwrap_err().code(), "not_found");
    assert_gone(&rt, &id);
}

#[test]
fn a_sandbox_never_vanishes_from_get_or_list_while_it_is_paused_or_resumed() {
    if !can_run() {
        return;
    }
    let rt = rt();
    let id = rt.create(spec()).expect("create").id;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let seen = std::thread::scope(|s| {
        let poller = s.spawn(|| {
            let (mut polls, mut misses) = (0u32, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                polls += 1;
                if let Err(e) = rt.get(&id) {
                    misses.push(format!("get: {e}"));
                }
                if !rt.list().iter().any(|i| i.id == id) {
                    misses.push("list: missing".into());
                }
            }
            (polls, misses)
        });
        for _ in 0..5 {
            rt.park(&id).expect("park");
            rt.create_restored_as(id.clone(), spec(), &mut |t| start_init_into(t, "x"))
                .expect("restore as");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        poller.join().unwrap()
    });
    let (polls, misses) = seen;
    assert!(polls > 10, "the poller ran ({polls} polls)");
    assert!(
        misses.is_empty(),
        "{} of {polls} polls missed it: {:?}",
        misses.len(),
        &misses[..misses.len().min(5)]
    );
    rt.destroy(&id).expect("destroy");
    assert_gone(&rt, &id);
}
