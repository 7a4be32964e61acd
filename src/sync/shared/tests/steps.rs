//! Applying an answer in steps ([`accept`], [`apply_step`]): bounded work
//! per worker callback, exact accounting between steps, no report while
//! an answer is applied, reloads and stopped workers mid-application.

use super::*;
use crate::keys::kind;
use crate::sync::node::Allowance;

/// The glue's tick.
const TICK: u64 = 10 * MS;

/// `n` tenants whose keys sort in this order (`api|t|t00000`, …).
fn tenants(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("t{i:05}")).collect()
}

/// A world where every tenant of `names` (and `extra`) was admitted once
/// at `T0` (provisional) and the report of `T0 + S` carries them all.
fn reported(names: &[String]) -> (World, SyncRequest) {
    let w = World::new("fail_open_local");
    for t in names {
        assert_eq!(w.admitted(t, 1, T0), 1);
    }
    let req = w.report(T0 + S).unwrap();
    assert_eq!(req.reports.len(), names.len());
    (w, req)
}

/// The stored allowance of `tenant`'s key for the global limit.
fn allowance(w: &World, tenant: &str) -> Allowance {
    let key = format!("api|t|{tenant}");
    let store = w.store.borrow();
    let hash = crate::policy::limit_name_hash("global");
    for k in store.keys().filter(|k| k.starts_with("tg2|k|")) {
        for slot in table::decode_entry(store.get(k).unwrap()).unwrap() {
            if slot.key != key.as_bytes() {
                continue;
            }
            for r in table::decode_records(slot.records).unwrap() {
                if r.name_hash == hash && r.kind == kind::GLOBAL_ALLOWANCE {
                    return stored::decode_allowance(r.state).unwrap();
                }
            }
        }
    }
    panic!("no allowance for {tenant}");
}

fn has_lease(w: &World, tenant: &str) -> bool {
    allowance(w, tenant).lease.is_some()
}

/// The issue's case: a full report's answer (4,096 leases) is applied over
/// ⌈4096 / 256⌉ = 16 worker callbacks, each updating at most 256 keys; a
/// key leased in step `i` admits on its lease right after it, the next
/// key only on what it had (its provisional allowance).
#[test]
fn an_answer_of_4096_leases_is_applied_over_16_steps_of_at_most_256_keys() {
    let names = tenants(MAX_REPORTS);
    let (w, req) = reported(&names);
    let host = w.host();
    let received = T0 + S + 10 * MS;
    let mut app = accept(&host, &w.policy, w.settings(), &response(&req, 10), received).unwrap();
    assert_eq!(app.remaining(), MAX_REPORTS);
    let steps = MAX_REPORTS.div_ceil(APPLY_PER_STEP);
    assert_eq!(steps, 16);
    for i in 1..=steps {
        let now = received + i as u64 * TICK;
        let (before, left) = (app.applied.leases, app.remaining());
        let step = apply_step(&host, &w.policy, &mut app, now, || false);
        assert_eq!(app.applied.leases - before, APPLY_PER_STEP, "step {i}");
        assert_eq!(left - app.remaining(), APPLY_PER_STEP, "step {i}");
        assert_eq!(step, if i == steps { Step::Done } else { Step::More });
        let last = &names[i * APPLY_PER_STEP - 1];
        assert_eq!(w.admitted(last, 20, now), 10, "{last}: its lease, after step {i}");
        if let Some(next) = names.get(i * APPLY_PER_STEP) {
            assert!(!has_lease(&w, next), "{next}: not before step {}", i + 1);
            assert_eq!(w.admitted(next, 20, now), 1, "{next}: provisional only");
        }
    }
    assert_eq!(
        app.applied,
        Applied {
            leases: MAX_REPORTS,
            steps: 16,
            ..Applied::default()
        }
    );
    assert!(names.iter().all(|t| has_lease(&w, t)));
    assert_eq!(read_state(&host).unwrap().0.unwrap().applying, None);
}

/// The glue's time budget: a step whose time is up stops after
/// [`APPLY_CHECK_EVERY`] keys (it always makes progress).
#[test]
fn a_step_whose_time_is_up_stops_after_a_chunk_of_keys() {
    let names = tenants(300);
    let (w, req) = reported(&names);
    let host = w.host();
    let received = T0 + S + 10 * MS;
    let mut app = accept(&host, &w.policy, w.settings(), &response(&req, 10), received).unwrap();
    let mut asked = 0;
    let mut steps = 0;
    loop {
        steps += 1;
        let left = app.remaining();
        let step = apply_step(&host, &w.policy, &mut app, received + steps * TICK, || {
            asked += 1;
            true
        });
        assert_eq!(left - app.remaining(), APPLY_CHECK_EVERY.min(left));
        if step == Step::Done {
            break;
        }
    }
    assert_eq!(steps as usize, 300usize.div_ceil(APPLY_CHECK_EVERY));
    assert_eq!(asked, steps - 1, "asked once per step but the last");
    assert_eq!(app.applied.leases, 300);
}

/// Requests admitted between steps are charged exactly: the key applied
/// late gets `tokens` less what it admitted on leases since its report
/// was built (before and after the answer's receipt), its acknowledged
/// counts are subtracted once, and its lease's TTL counts from receipt.
#[test]
fn requests_admitted_between_steps_are_charged_exactly_and_leases_expire_from_receipt() {
    let mut names = tenants(300);
    names.extend(["zy".to_owned(), "zz".to_owned()]); // sorted last: step 2
    let (w, req) = reported(&names);
    w.answer(&req, 10, T0 + S + MS).unwrap();
    // On its first lease (10 tokens), 4 admitted before the next report.
    assert_eq!(w.admitted("zz", 4, T0 + S + 100 * MS), 4);
    let req = w.report(T0 + 2 * S).unwrap();
    let r = req.reports.iter().find(|r| r.key == "api|t|zz").unwrap();
    assert_eq!((r.consumed, r.unleased, r.demand), (4, 0, 4));
    let host = w.host();
    let received = T0 + 2 * S + 10 * MS;
    let mut app = accept(&host, &w.policy, w.settings(), &response(&req, 10), received).unwrap();
    assert_eq!(
        apply_step(&host, &w.policy, &mut app, received, || false),
        Step::More
    );
    let old = allowance(&w, "zz").lease.unwrap();
    assert_eq!(old.tokens_left, 6, "its old lease until step 2");
    // Between the steps: 3 more on the old lease (6 left of it).
    assert_eq!(w.admitted("zz", 3, received + 5 * MS), 3);
    assert_eq!(
        apply_step(&host, &w.policy, &mut app, received + TICK, || false),
        Step::Done
    );
    let a = allowance(&w, "zz");
    // 10 tokens from the report on, 7 of them used meanwhile (4 + 3) ...
    assert_eq!(a.lease.unwrap().tokens_left, 10 - 3);
    // ... expiring 3 s after receipt, not after the step that installed it.
    assert_eq!(a.lease.unwrap().expires_at, received + 3 * S);
    assert_eq!(allowance(&w, "zy").lease.unwrap().expires_at, received + 3 * S);
    // The report's 4 were subtracted once; the 3 admitted after it stay.
    assert_eq!(
        a.pending,
        Counts {
            consumed: 3,
            unleased: 0,
            demand: 3
        }
    );
    // Since the report: exactly its 10 tokens (3 + 7), none created, none lost.
    assert_eq!(w.admitted("zz", 30, received + 2 * TICK), 7);
    let next = w.report(T0 + 3 * S).unwrap();
    let r = next.reports.iter().find(|r| r.key == "api|t|zz").unwrap();
    assert_eq!((r.consumed, r.unleased, r.demand), (10, 0, 33));
    // The lease lives until 3 s after receipt, not a tick longer.
    let w2 = w;
    let resp = response(&next, 5);
    let received = T0 + 3 * S + 10 * MS;
    let mut app = accept(&host, &w2.policy, w2.settings(), &resp, received).unwrap();
    while apply_step(&host, &w2.policy, &mut app, received + 50 * MS, || false) == Step::More {}
    let d = w2.decide("api", "zy", received + 3 * S - 1);
    assert_eq!(d.reason, Reason::Allowed);
    assert_eq!(allowance(&w2, "zy").lease.unwrap().tokens_left, 4);
    assert_eq!(
        w2.admitted("zy", 5, received + 3 * S),
        0,
        "expired at receipt + TTL"
    );
}

/// No report starts while an answer is applied, so no count is carried
/// by two reports: the next one (after the last step) carries what came
/// after the acknowledged report, once.
#[test]
fn the_next_report_waits_for_the_application_and_carries_each_count_once() {
    let names = tenants(300);
    let (w, req) = reported(&names);
    let host = w.host();
    let received = T0 + S + 400 * MS;
    let mut app = accept(&host, &w.policy, w.settings(), &response(&req, 10), received).unwrap();
    assert_eq!(
        apply_step(&host, &w.policy, &mut app, received, || false),
        Step::More
    );
    // Due at T0 + 2 s, but the answer is still being applied.
    let last = names.last().unwrap();
    assert_eq!(w.admitted(last, 1, T0 + 2 * S), 1, "its provisional allowance");
    assert!(matches!(
        claim(&w.host(), w.settings(), T0 + 2 * S).unwrap(),
        Claim::NotDue(_)
    ));
    assert_eq!(
        apply_step(&host, &w.policy, &mut app, T0 + 2 * S + TICK, || false),
        Step::Done
    );
    let next = w.report(T0 + 2 * S + 2 * TICK).expect("due once applied");
    for r in &next.reports {
        let expected = if r.key.ends_with(last.as_str()) { 1 } else { 0 };
        assert_eq!(
            (r.consumed, r.unleased, r.demand),
            (expected, expected, expected),
            "{}",
            r.key
        );
    }
}

/// A worker that stopped mid-application (its VM torn down) loses the
/// rest: those keys keep their counts and are reported again (the
/// service counts them twice: it errs toward admitting less). Another
/// worker reports again [`APPLY_MAX_NS`] + [`APPLY_GRACE_NS`] after the
/// receipt; the stopped application, if it ever ran again, writes nothing.
#[test]
fn a_worker_stopped_mid_application_leaves_its_keys_counted_and_the_node_reports_again() {
    let names = tenants(300);
    let (w, req) = reported(&names);
    let host = w.host();
    let received = T0 + S + 10 * MS;
    let mut app = accept(&host, &w.policy, w.settings(), &response(&req, 10), received).unwrap();
    apply_step(&host, &w.policy, &mut app, received, || false);
    let stopped = app; // never stepped again
    let give_up = received + APPLY_MAX_NS + APPLY_GRACE_NS;
    assert!(matches!(
        claim(&w.host(), w.settings(), give_up).unwrap(),
        Claim::NotDue(_)
    ));
    let next = w.report(give_up + 1).expect("given up on");
    let carried = |t: &str| {
        let r = next.reports.iter().find(|r| r.key.ends_with(t)).unwrap();
        (r.consumed, r.unleased, r.demand)
    };
    assert_eq!(carried(&names[0]), (0, 0, 0), "applied: acknowledged");
    assert_eq!(carried(&names[299]), (1, 1, 1), "not applied: reported again");
    let mut stopped = stopped;
    assert_eq!(
        apply_step(&host, &w.policy, &mut stopped, give_up + 2, || false),
        Step::Dropped
    );
    assert!(!has_lease(&w, &names[299]));
    assert_eq!(stopped.applied.dropped, 300 - APPLY_PER_STEP);
    // The stopped worker's drop did not clear the new report.
    assert!(read_state(&host).unwrap().0.unwrap().in_flight.is_some());
}

/// An application still under way [`APPLY_MAX_NS`] after receipt is
/// dropped by its own worker (the rest keeps its counts), which lets the
/// next report start at once.
#[test]
fn an_application_outliving_its_bound_is_dropped_and_the_node_reports_again() {
    let names = tenants(300);
    let (w, req) = reported(&names);
    let host = w.host();
    let received = T0 + S + 10 * MS;
    let mut app = accept(&host, &w.policy, w.settings(), &response(&req, 10), received).unwrap();
    apply_step(&host, &w.policy, &mut app, received, || false);
    let late = received + APPLY_MAX_NS;
    assert_eq!(
        apply_step(&host, &w.policy, &mut app, late, || false),
        Step::Dropped
    );
    assert_eq!(app.applied.dropped, 300 - APPLY_PER_STEP);
    assert!(!has_lease(&w, &names[299]));
    let next = w.report(late + 1).expect("no longer applying");
    let r = next
        .reports
        .iter()
        .find(|r| r.key.ends_with(&names[299]))
        .unwrap();
    assert_eq!((r.consumed, r.unleased, r.demand), (1, 1, 1));
}

/// A reload mid-application: the rest is applied under the worker's new
/// policy (a limit it still has as global gets its lease); a policy that
/// no longer syncs drops the rest (counts kept) and lets reports start.
#[test]
fn a_reload_mid_application_applies_the_rest_under_the_new_policy_or_drops_it() {
    let names = tenants(300);
    for reloaded_keeps_sync in [true, false] {
        let (w, req) = reported(&names);
        let host = w.host();
        let received = T0 + S + 10 * MS;
        let mut app = accept(&host, &w.policy, w.settings(), &response(&req, 10), received).unwrap();
        apply_step(&host, &w.policy, &mut app, received, || false);
        let reloaded = if reloaded_keeps_sync {
            let mut p = policy_with("fail_closed", "");
            p.version = "g-2".to_owned();
            p.effective_from_ns = received + 5 * MS;
            p
        } else {
            let json = br#"{"version": "local", "identity": {"header": "x-tenant-id"},
                "plans": {"free": {"limits": [{"name": "node", "rate": 1000, "per": "1s"}]}},
                "default_plan": "free", "anonymous": {"plan": "free"}, "routes": {"api": {}}}"#;
            Policy::from_json(json).unwrap()
        };
        let step = apply_step(&host, &reloaded, &mut app, received + TICK, || false);
        let last = &names[299];
        if reloaded_keeps_sync {
            assert_eq!(step, Step::Done);
            assert_eq!(app.applied.leases, 300);
            let a = allowance(&w, last);
            assert_eq!((a.lease.unwrap().tokens_left, a.pending), (10, Counts::default()));
        } else {
            assert_eq!(step, Step::Dropped);
            assert_eq!(app.applied.leases, APPLY_PER_STEP);
            assert_eq!(allowance(&w, last).pending.consumed, 1, "kept, reported again");
            assert!(w.report(received + S).is_some(), "reports start again");
        }
    }
}

/// What a worker holds is bounded: an answer's leases beyond
/// [`MAX_REPORTS`] are ignored (and counted), so an application holds at
/// most `2 × MAX_REPORTS` keys.
#[test]
fn leases_beyond_the_report_bound_are_ignored() {
    let names = tenants(3);
    let (w, req) = reported(&names);
    let mut resp = response(&req, 10);
    let extra = (0..MAX_REPORTS + 5).map(|i| Lease {
        key: format!("api|t|unknown-{i}"),
        limit: "global".to_owned(),
        tokens: 10,
        share: 10,
        share_milli: 0,
        ttl_ms: 3000,
        outage_milli: None,
        bucket_milli: None,
    });
    resp.leases.extend(extra);
    let host = w.host();
    let app = accept(&host, &w.policy, w.settings(), &resp, T0 + S + 10 * MS).unwrap();
    assert_eq!(app.applied.ignored, 8, "3 + 4,101 leases, 4,096 kept");
    assert_eq!(app.remaining(), MAX_REPORTS);
}

/// One slot update's cost natively (in-memory host, release build), on a
/// second answer (warm memory):
/// `cargo test -p tenantgate-filter --release apply_step_cost -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement: run in release with --nocapture"]
fn apply_step_cost() {
    let names = tenants(MAX_REPORTS);
    let (w, req) = reported(&names);
    w.answer(&req, 10, T0 + S + 10 * MS).unwrap();
    let host = w.host();
    for round in 2..5 {
        let at = T0 + round * S;
        let req = w.report(at).unwrap();
        let received = at + 10 * MS;
        let mut app = accept(&host, &w.policy, w.settings(), &response(&req, 10), received).unwrap();
        let keys = app.remaining();
        let start = std::time::Instant::now();
        let mut steps = 1;
        while apply_step(&host, &w.policy, &mut app, received, || false) == Step::More {
            steps += 1;
        }
        let ns = start.elapsed().as_nanos() / keys as u128;
        println!(
            "apply_step: {keys} keys in {steps} steps, {ns} ns per slot update ({} us per step of {APPLY_PER_STEP})",
            ns * APPLY_PER_STEP as u128 / 1000
        );
    }
}
