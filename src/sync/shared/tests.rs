//! The node's sync over shared data, with the in-memory host: several hosts on
//! one store are the worker VMs of one Envoy. Time is explicit.

use super::*;
use crate::engine::{self, Reason};
use crate::keys::kind;
use crate::memory::{MemoryHost, SharedStore};
use crate::sync::apply::*;
use crate::sync::cycle::ApplyError;
use crate::sync::node::Counts;
use crate::sync::protocol::Lease;
use crate::sync::protocol::SyncResponse;
use std::cell::RefCell;
use std::rc::Rc;

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;
const T0: u64 = 1_796_000_000 * S;

fn policy(mode: &str) -> Policy {
    policy_with(mode, "")
}

/// `extra`: more top-level fields (with a leading comma).
fn policy_with(mode: &str, extra: &str) -> Policy {
    let json = format!(
        r#"{{"version": "g-1", "identity": {{"header": "x-tenant-id"}},
        "plans": {{"free": {{"limits": [
            {{"name": "node", "rate": 1000, "per": "1s"}},
            {{"name": "global", "rate": 100, "per": "1s", "global": true}}]}}}},
        "default_plan": "free", "anonymous": {{"plan": "free"}},
        "routes": {{"api": {{}}, "strict": {{"action": "api", "failure_mode": "fail_closed"}},
            "search": {{"action": "api", "cost": 5}}}},
        "sync": {{"interval": "1s", "timeout": "500ms", "provisional": 2, "failure_mode": "{mode}"}}{extra}}}"#
    );
    let mut p = Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    p.effective_from_ns = T0;
    p
}

struct World {
    store: Rc<RefCell<SharedStore>>,
    policy: Policy,
}

impl World {
    fn new(mode: &str) -> World {
        World {
            store: SharedStore::new(),
            policy: policy(mode),
        }
    }

    /// A request of `tenant` on `class`, as worker `w` sees the node.
    fn request(&self, class: &str, tenant: &str, now: u64) -> Reason {
        self.decide(class, tenant, now).reason
    }

    fn decide(&self, class: &str, tenant: &str, now: u64) -> engine::Decision {
        let host = MemoryHost::new(self.store.clone())
            .route_class(class)
            .header("x-tenant-id", tenant);
        let state = read_state(&host).unwrap().0;
        let prepared = engine::prepare(&self.policy, &host).unwrap();
        engine::charge_synced(
            &self.policy,
            &prepared,
            &host,
            now,
            state.as_ref(),
            &mut engine::Scratch::default(),
        )
    }

    fn admitted(&self, tenant: &str, n: usize, now: u64) -> usize {
        (0..n)
            .filter(|_| self.request("api", tenant, now) == Reason::Allowed)
            .count()
    }

    fn host(&self) -> MemoryHost {
        MemoryHost::new(self.store.clone())
    }

    fn settings(&self) -> &SyncSettings {
        self.policy.sync.as_ref().unwrap()
    }

    /// One worker wins, scans and "sends"; returns the request.
    fn report(&self, now: u64) -> Option<SyncRequest> {
        let host = self.host();
        let Claim::Won { seq, .. } = claim(&host, self.settings(), now).unwrap() else {
            return None;
        };
        let mut scan = Scan::new(seq, now);
        while !scan_step(&host, &self.policy, &mut scan, 64) {}
        let acked = read_state(&host).unwrap().0.unwrap().acked_seq;
        assert!(sent(&host, &scan, now).unwrap());
        Some(request(&self.policy, "n1", "r1", acked, &scan))
    }

    fn answer(&self, req: &SyncRequest, tokens: u64, now: u64) -> Result<Applied, NotApplied> {
        let resp = response(req, tokens);
        apply(&self.host(), &self.policy, self.settings(), &resp, now)
    }
}

/// The service's answer to `req`: a lease of `tokens` (3 s) for every
/// reported key.
pub(crate) fn response(req: &SyncRequest, tokens: u64) -> SyncResponse {
    SyncResponse {
        version: 1,
        ack_seq: req.seq,
        interval_ms: 1000,
        leases: req
            .reports
            .iter()
            .map(|r| Lease {
                key: r.key.clone(),
                limit: r.limit.clone(),
                tokens,
                share: tokens,
                share_milli: 0,
                ttl_ms: 3000,
                outage_milli: None,
                bucket_milli: None,
            })
            .collect(),
    }
}

mod steps;

#[test]
fn a_policy_without_global_limits_has_no_sync() {
    let json = br#"{"version": "v", "identity": {"header": "x"}, "plans": {"p": {"limits": [{"rate": 1, "per": "1s"}]}},
        "default_plan": "p", "anonymous": {"plan": "p"}, "routes": {"api": {}}}"#;
    let p = Policy::from_json(json).unwrap();
    assert!(p.sync.is_none() && !p.has_global_limits());
    let g = policy("fail_open");
    assert!(g.has_global_limits());
    assert_eq!(
        g.global_limit_name(crate::policy::limit_name_hash("global")),
        Some("global")
    );
    assert_eq!(g.global_limit_name(crate::policy::limit_name_hash("node")), None);
}

#[test]
fn the_provisional_allowance_admits_the_first_requests_then_they_await_the_lease() {
    let w = World::new("fail_open_local");
    assert_eq!(w.admitted("acme", 5, T0), 2);
    assert_eq!(w.request("api", "acme", T0), Reason::RateLimited);
}

#[test]
fn exactly_one_worker_wins_each_interval() {
    let w = World::new("fail_open_local");
    let (a, b) = (w.host(), w.host());
    assert!(matches!(
        claim(&a, w.settings(), T0 + S).unwrap(),
        Claim::Won { .. }
    ));
    assert!(matches!(
        claim(&b, w.settings(), T0 + S).unwrap(),
        Claim::NotDue(_)
    ));
    // Racing: both read the same state; only one write lands (after the
    // unsent report's grace, so that both may give up on it).
    let store = w.store.clone();
    let racer = MemoryHost::new(store);
    let settings = w.settings().clone();
    let later = T0 + 3 * S + SCAN_GRACE_NS;
    *a.before_write.borrow_mut() = Some(crate::memory::Hook(Box::new(move || {
        let _ = claim(&racer, &settings, later);
    })));
    assert_eq!(claim(&a, w.settings(), later).unwrap(), Claim::Lost);
}

#[test]
fn leases_are_consumed_across_workers_and_counts_reset_on_acknowledgement() {
    let w = World::new("fail_open_local");
    assert_eq!(w.admitted("acme", 3, T0), 2); // provisional; 3 units of demand
    let req = w.report(T0 + S).unwrap();
    assert_eq!(req.reports.len(), 1);
    let r = &req.reports[0];
    assert_eq!((r.key.as_str(), r.limit.as_str()), ("api|t|acme", "global"));
    assert_eq!((r.consumed, r.unleased, r.demand), (2, 2, 3));
    // Admitted while the report is in flight: still awaiting its lease.
    assert_eq!(w.admitted("acme", 1, T0 + S + 10 * MS), 0);
    assert_eq!(w.answer(&req, 10, T0 + S + 50 * MS).unwrap().leases, 1);
    // Ten tokens, whichever worker (host) asks.
    assert_eq!(w.admitted("acme", 30, T0 + S + 60 * MS), 10);
    // The next report carries only what came after the acknowledged one.
    let next = w.report(T0 + 2 * S).unwrap();
    assert_eq!(next.acked_seq, req.seq);
    let r = &next.reports[0];
    assert_eq!((r.consumed, r.unleased, r.demand), (10, 0, 31));
}

#[test]
fn lease_tokens_count_from_when_the_report_was_built() {
    let w = World::new("fail_open_local");
    w.admitted("acme", 1, T0);
    let req = w.report(T0 + S).unwrap();
    w.answer(&req, 10, T0 + S + 10 * MS).unwrap();
    let req = w.report(T0 + 2 * S).unwrap();
    assert_eq!(w.admitted("acme", 4, T0 + 2 * S + 10 * MS), 4); // on the old lease, in flight
    w.answer(&req, 10, T0 + 2 * S + 20 * MS).unwrap();
    assert_eq!(w.admitted("acme", 30, T0 + 2 * S + 30 * MS), 6);
}

#[test]
fn an_answer_is_applied_once_and_a_late_one_not_at_all() {
    let w = World::new("fail_open_local");
    w.admitted("acme", 1, T0);
    let req = w.report(T0 + S).unwrap();
    assert!(w.answer(&req, 5, T0 + S + 10 * MS).is_ok());
    assert_eq!(w.admitted("acme", 3, T0 + S + 20 * MS), 3);
    assert_eq!(
        w.answer(&req, 5, T0 + S + 30 * MS),
        Err(NotApplied::Refused(ApplyError::Stale))
    );
    assert_eq!(w.admitted("acme", 10, T0 + S + 40 * MS), 2, "not refilled");
    let req = w.report(T0 + 2 * S).unwrap();
    assert_eq!(
        w.answer(&req, 5, T0 + 2 * S + 600 * MS),
        Err(NotApplied::Refused(ApplyError::Late))
    );
}

fn cut_off(mode: &str) -> (World, u64) {
    let w = World::new(mode);
    w.admitted("acme", 1, T0);
    let req = w.report(T0 + S).unwrap();
    w.answer(&req, 5, T0 + S).unwrap();
    // No answer after this: leases (3 s) and contact (3 intervals) run out.
    (w, T0 + 5 * S)
}

#[test]
fn when_leases_expire_with_no_answer_the_failure_mode_applies_per_class() {
    let (w, later) = cut_off("fail_open");
    assert_eq!(w.admitted("acme", 50, later), 50);
    assert_eq!(
        w.request("strict", "acme", later),
        Reason::RateLimited,
        "class override: fail_closed"
    );
    let (w, later) = cut_off("fail_closed");
    assert_eq!(w.admitted("acme", 5, later), 0);
    // fail_open_local: a bucket at the last share (5 per interval, from a
    // service that sent no outage allowance), empty when the lease expired
    // (+4 s): a second of it accrued by +5 s.
    let (w, later) = cut_off("fail_open_local");
    assert_eq!(w.admitted("acme", 50, later), 5);
    assert_eq!(w.admitted("acme", 50, later + S), 5);
}

#[test]
fn a_node_that_never_reaches_the_service_applies_its_failure_mode_after_one_interval_and_timeout() {
    let w = World::new("fail_open");
    assert_eq!(w.admitted("acme", 5, T0), 2);
    // The first claim creates the state; nothing ever answers.
    let _ = w.report(T0 + 10 * MS);
    assert_eq!(w.admitted("acme", 5, T0 + 100 * MS), 0);
    assert_eq!(w.admitted("acme", 5, T0 + 2 * S), 5);
}

#[test]
fn global_allowances_go_idle_and_non_global_limits_are_unchanged() {
    let w = World::new("fail_open_local");
    w.admitted("acme", 1, T0);
    let req = w.report(T0 + S).unwrap();
    w.answer(&req, 5, T0 + S).unwrap();
    let req = w.report(T0 + 2 * S).unwrap();
    w.answer(&req, 0, T0 + 2 * S).unwrap();
    let store = w.store.borrow();
    let entry = store.keys().find(|k| k.starts_with("tg2|k|")).unwrap();
    let slots = table::decode_entry(store.get(entry).unwrap()).unwrap();
    let records = table::decode_records(slots[0].records).unwrap();
    assert_eq!(records.len(), 2);
    assert_eq!(records[0].kind, kind::TOKEN_BUCKET);
    assert_eq!(records[1].kind, kind::GLOBAL_ALLOWANCE);
    assert!(!crate::engine::record_is_idle(&records[1], T0 + 2 * S));
    assert!(crate::engine::record_is_idle(&records[1], T0 + 6 * S));
}

#[test]
fn the_breaker_is_node_wide_skips_intervals_once_and_a_probe_closes_it() {
    // Defaults: 3 failures in a row open it; the backoff starts at 1 s.
    let w = World::new("fail_open_local");
    let (a, b) = (w.host(), w.host());
    w.admitted("acme", 1, T0);
    for (i, worker) in [&a, &b, &a].into_iter().enumerate() {
        let now = T0 + (i as u64 + 1) * S;
        let Claim::Won { seq, .. } = claim(worker, w.settings(), now).unwrap() else {
            panic!("not won at {i}");
        };
        // Each worker's failure is counted on the node, once.
        let done = abandon(worker, w.settings(), seq, now + 10 * MS).unwrap();
        assert_eq!(done, Abandoned::Failed { opened: i == 2 });
        assert_eq!(
            abandon(&b, w.settings(), seq, now + 20 * MS).unwrap(),
            Abandoned::NotInFlight
        );
    }
    // Open: the interval due at 4 s is skipped by exactly one worker.
    let given_up = GivenUp::default();
    assert_eq!(
        claim(&b, w.settings(), T0 + 4 * S).unwrap(),
        Claim::Skipped { given_up }
    );
    assert!(matches!(
        claim(&a, w.settings(), T0 + 4 * S).unwrap(),
        Claim::NotDue(_)
    ));
    // Half-open at 5 s: one probe, which succeeds and closes the breaker.
    let req = w.report(T0 + 5 * S).expect("the probe");
    assert!(matches!(
        claim(&a, w.settings(), T0 + 5 * S).unwrap(),
        Claim::NotDue(_)
    ));
    w.answer(&req, 5, T0 + 5 * S + 10 * MS).unwrap();
    let s = read_state(&a).unwrap().0.unwrap();
    assert_eq!((s.failures, s.breaker(T0 + 6 * S)), (0, BreakerState::Closed));
    assert!(w.report(T0 + 6 * S).is_some());
    assert_eq!(w.admitted("acme", 10, T0 + 6 * S), 5, "leases apply again");
}

#[test]
fn a_report_never_answered_is_a_failure_and_a_late_answer_too() {
    let w = World::new("fail_open_local");
    let host = w.host();
    // Two reports whose callout never came back: the next claim gives up on
    // each (a timeout), and the third such failure opens the breaker.
    let _ = w.report(T0 + S).unwrap();
    let _ = w.report(T0 + 2 * S + 10 * MS).unwrap();
    let Claim::Won { seq, given_up } = claim(&host, w.settings(), T0 + 3 * S + 20 * MS).unwrap() else {
        panic!("not won");
    };
    assert_eq!(
        given_up,
        GivenUp {
            timed_out: true,
            opened: false
        }
    );
    // Its answer comes too late: refused, then abandoned (the glue's path).
    let resp = SyncResponse {
        version: 1,
        ack_seq: seq,
        interval_ms: 1000,
        leases: vec![],
    };
    let late = T0 + 3 * S + 700 * MS;
    assert_eq!(
        apply(&host, &w.policy, w.settings(), &resp, late),
        Err(NotApplied::Refused(ApplyError::Late))
    );
    assert_eq!(
        abandon(&host, w.settings(), seq, late).unwrap(),
        Abandoned::Failed { opened: true }
    );
    let s = read_state(&host).unwrap().0.unwrap();
    assert_eq!(s.failures, 3);
    assert_eq!(s.open_until, Some(T0 + 3 * S + 20 * MS + 2 * S));
}

/// Syncs every second from `from` to `to` (exclusive), answering every
/// report with no lease at all (a service whose policy lacks the limit).
fn sync_without_leases(w: &World, from: u64, to: u64) {
    let mut now = from;
    while now < to {
        if let Some(req) = w.report(now) {
            w.answer(
                &SyncRequest {
                    reports: vec![],
                    ..req
                },
                0,
                now + MS,
            )
            .unwrap();
        }
        now += S;
    }
}

/// Regression: a limit the service does not know got no lease, and the
/// key denied for good. It runs its failure mode `2·I + D` (2.5 s) after
/// it began to wait, and says so (`no_lease`, counted by the glue).
#[test]
fn a_limit_unknown_to_the_service_reaches_the_failure_mode_in_bounded_time() {
    for (mode, then) in [
        ("fail_open", Reason::Allowed),
        ("fail_closed", Reason::RateLimited),
    ] {
        let w = World::new(mode);
        assert_eq!(w.admitted("acme", 2, T0), 2);
        let waiting = w.decide("api", "acme", T0);
        assert_eq!(waiting.reason, Reason::RateLimited);
        assert!(!waiting.no_lease);
        sync_without_leases(&w, T0 + S, T0 + 3 * S);
        let before = w.decide("api", "acme", T0 + 2_499 * MS);
        assert_eq!(
            (before.reason, before.no_lease),
            (Reason::RateLimited, false),
            "{mode}"
        );
        let after = w.decide("api", "acme", T0 + 2_500 * MS);
        assert_eq!((after.reason, after.no_lease), (then, true), "{mode}");
    }
}

/// Regression: keys charged to the overflow entry are never reported, so
/// they never got a lease and denied for good.
#[test]
fn an_overflowing_key_reaches_the_failure_mode_in_bounded_time() {
    let w = World {
        store: SharedStore::new(),
        policy: policy_with("fail_open", r#", "key_table": {"max_keys": 8}"#),
    };
    // Eight tenants fill the table (one entry of eight slots); a ninth
    // lands in the overflow entry.
    for t in 0..8 {
        assert_eq!(w.admitted(&format!("t{t}"), 1, T0), 1);
    }
    let first = w.decide("api", "late", T0);
    assert_eq!(first.table, engine::TableEvent::Overflow);
    w.admitted("late", 5, T0);
    let mut now = T0 + S;
    while now < T0 + 3 * S {
        if let Some(req) = w.report(now) {
            assert!(req.reports.iter().all(|r| !r.key.contains("late")));
            w.answer(&req, 10, now + MS).unwrap();
        }
        now += S;
    }
    let after = w.decide("api", "late", T0 + 2_500 * MS);
    assert_eq!((after.reason, after.no_lease), (Reason::Allowed, true));
}

/// A denial's Retry-After is never earlier than when the lease can carry
/// the request: a cost-5 request on a lease of 2 with a share of 2 per
/// interval waits two intervals, not one.
#[test]
fn retry_after_of_a_costly_request_counts_the_intervals_its_lease_needs() {
    let w = World::new("fail_closed");
    assert_eq!(w.admitted("acme", 1, T0), 1);
    let req = w.report(T0 + S).unwrap();
    w.answer(&req, 2, T0 + S + MS).unwrap();
    let d = w.decide("search", "acme", T0 + S + 2 * MS);
    assert_eq!(d.reason, Reason::RateLimited);
    assert_eq!(d.retry_after_secs, 2);
}

/// A fractional share (100/min over nine nodes: 0.185 units per 1 s
/// interval, sent as 0 whole units and 185 thousandths) makes a cost-5
/// request on an empty lease wait 28 intervals, the time its lease needs
/// to grow by 5, not 5 intervals (the whole-unit share, rounded up to 1);
/// a service that sends no exact share keeps the whole-unit estimate.
#[test]
fn retry_after_with_a_fractional_share_counts_the_intervals_it_really_needs() {
    for (share, share_milli, expected) in [(0, 185, 28), (0, 0, 5), (2, 2_000, 3), (1, 1_667, 3)] {
        let w = World::new("fail_closed");
        assert_eq!(w.admitted("acme", 1, T0), 1);
        let req = w.report(T0 + S).unwrap();
        let mut resp = response(&req, 0);
        for l in &mut resp.leases {
            (l.share, l.share_milli) = (share, share_milli);
        }
        apply(&w.host(), &w.policy, w.settings(), &resp, T0 + S + MS).unwrap();
        let d = w.decide("search", "acme", T0 + S + 2 * MS);
        assert_eq!(d.reason, Reason::RateLimited);
        assert_eq!(
            d.retry_after_secs, expected,
            "share {share}, {share_milli} thousandths"
        );
    }
}

/// A global calendar month's budget of 100 (UTC) whose key started at
/// `start` and whose first answer, a second later, leased nothing at a
/// share of `share_milli` thousandths a second, saying the service's
/// bucket is `bucket_milli` full.
fn month_answered(start: u64, share_milli: u64, bucket_milli: Option<u64>) -> World {
    let json = r#"{"version": "g-month", "identity": {"header": "x-tenant-id"},
        "plans": {"free": {"limits": [
            {"name": "global", "algorithm": "fixed_window", "rate": 100, "per": "month", "global": true}]}},
        "default_plan": "free", "anonymous": {"plan": "free"},
        "routes": {"api": {}, "search": {"action": "api", "cost": 5}},
        "sync": {"interval": "1s", "timeout": "500ms", "provisional": 2, "failure_mode": "fail_closed"}}"#;
    let mut policy = Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    policy.effective_from_ns = start;
    let w = World {
        store: SharedStore::new(),
        policy,
    };
    assert_eq!(w.admitted("acme", 1, start), 1);
    let req = w.report(start + S).unwrap();
    let mut resp = response(&req, 0);
    for l in &mut resp.leases {
        (l.share, l.share_milli, l.bucket_milli) = (share_milli / 1000, share_milli, bucket_milli);
    }
    apply(&w.host(), &w.policy, w.settings(), &resp, start + S + MS).unwrap();
    w
}

/// December 2026 begins (UTC).
const DECEMBER: u64 = 1_796_083_200 * S;

/// 1,000 s before December: a refused request waits as its lease needs,
/// never past the month's end (when the service's bucket fills again): at
/// a share of 0.185 a second, a cost of 5 waits 28 s; at 0.001 a second
/// its 5,000 s would pass December, so it waits until December (999 s).
#[test]
fn a_global_month_never_makes_a_request_wait_past_its_end() {
    let start = DECEMBER - 1_000 * S;
    for (share_milli, expected) in [(185, 28), (2_000, 3), (1, 999)] {
        let w = month_answered(start, share_milli, None);
        let d = w.decide("search", "acme", start + S + 2 * MS);
        assert_eq!(d.reason, Reason::RateLimited);
        assert_eq!(d.retry_after_secs, expected, "{share_milli} thousandths");
    }
}

/// A month the service says is spent (a lease with `bucket_milli` 0: every
/// unit admitted, none in its bucket or any node's lease) waits until its
/// end, not the lease's estimate; a bucket with anything left, or a spent
/// answer granted before the month began (still live in its first
/// seconds), waits as the lease needs.
#[test]
fn a_global_month_the_service_says_is_spent_waits_until_its_end() {
    // (when the key starts, how full the service says its bucket is, when
    // the request comes, the wait in seconds)
    let cases = [
        (DECEMBER - 1_000 * S, Some(0), DECEMBER - 998 * S, 998),
        (DECEMBER - 1_000 * S, Some(1), DECEMBER - 998 * S, 28),
        (DECEMBER - 1_000 * S, None, DECEMBER - 998 * S, 28),
        // Spent in the month before, the lease still live in this one:
        // not this month's word (the new month's bucket is full).
        (DECEMBER - 2 * S, Some(0), DECEMBER + 500 * MS, 28),
    ];
    for (start, bucket_milli, at, expected) in cases {
        let w = month_answered(start, 185, bucket_milli);
        let d = w.decide("search", "acme", at);
        assert_eq!(d.reason, Reason::RateLimited);
        assert_eq!(d.retry_after_secs, expected, "{bucket_milli:?} at {at}");
    }
}

/// Regression: the scan's report was stamped at claim time, so a scan
/// longer than the interval was given up on by another worker, again and
/// again (a livelock with short intervals). Its timer starts at dispatch.
#[test]
fn a_scan_longer_than_the_interval_is_not_abandoned_and_its_timer_starts_at_dispatch() {
    let w = World::new("fail_open");
    assert_eq!(w.admitted("acme", 1, T0), 1);
    let host = w.host();
    let Claim::Won { seq, .. } = claim(&host, w.settings(), T0).unwrap() else {
        panic!("the first claim wins");
    };
    // Still scanning 1.5 s later (interval 1 s): nobody takes it over.
    assert!(matches!(
        claim(&w.host(), w.settings(), T0 + 1_500 * MS).unwrap(),
        Claim::NotDue(_)
    ));
    let mut scan = Scan::new(seq, T0);
    while !scan_step(&host, &w.policy, &mut scan, 64) {}
    assert!(sent(&host, &scan, T0 + 1_600 * MS).unwrap());
    // Sent at 1.6 s: it is in flight until 1.6 s + the timeout (0.5 s),
    // then given up on.
    assert!(matches!(
        claim(&w.host(), w.settings(), T0 + 2_050 * MS).unwrap(),
        Claim::NotDue(_)
    ));
    assert!(matches!(
        claim(&w.host(), w.settings(), T0 + 2_150 * MS).unwrap(),
        Claim::Won {
            given_up: GivenUp { timed_out: true, .. },
            ..
        }
    ));
    // A worker that died mid-scan: given up on after the grace.
    let w2 = World::new("fail_open");
    let Claim::Won { .. } = claim(&w2.host(), w2.settings(), T0).unwrap() else {
        panic!("the first claim wins");
    };
    assert!(matches!(
        claim(&w2.host(), w2.settings(), T0 + S + SCAN_GRACE_NS + MS).unwrap(),
        Claim::Won {
            given_up: GivenUp { timed_out: true, .. },
            ..
        }
    ));
}

/// The request carries the settings the service's bound depends on (item
/// "one source for shared settings"): the node's callout timeout,
/// `fail_open_local`'s duration, its interval and default failure mode,
/// and the failure mode of each report whose key runs another one (the
/// most permissive of the classes sharing its action).
#[test]
fn the_request_carries_the_settings_the_node_enforces() {
    let w = World::new("fail_open_local");
    // `strict` (fail_closed) shares action `api` with `api` (the
    // default): its keys run the more permissive default.
    assert_eq!(w.request("strict", "t1", T0), Reason::Allowed);
    let req = w.report(T0 + S).unwrap();
    assert_eq!(
        req.settings,
        Some(NodeSettings {
            timeout_ms: 500,
            local_max_ms: crate::policy::LOCAL_MAX_NS / MS,
            interval_ms: 1000,
            failure_mode: FailureMode::FailOpenLocal,
            outage_allowance: true,
        })
    );
    assert_eq!(req.reports.len(), 1);
    assert_eq!(req.reports[0].failure_mode, None);

    // A class of its own action that fails closed: its keys say so; a
    // fail_open class outranks it on a shared action.
    let json = br#"{"version": "g-2", "identity": {"header": "x-tenant-id"},
        "plans": {"free": {"limits": [{"name": "global", "rate": 100, "per": "1s", "global": true}]}},
        "default_plan": "free", "anonymous": {"plan": "free"},
        "routes": {"api": {}, "pay": {"failure_mode": "fail_closed"},
            "feed": {"failure_mode": "fail_closed"}, "feed-open": {"action": "feed", "failure_mode": "fail_open"}},
        "sync": {"interval": "1s", "timeout": "250ms"}}"#;
    let mut p = Policy::from_json(json).unwrap_or_else(|e| panic!("{e}"));
    p.effective_from_ns = T0;
    let w = World {
        store: SharedStore::new(),
        policy: p,
    };
    for class in ["api", "pay", "feed"] {
        assert_eq!(w.request(class, "t1", T0), Reason::Allowed);
    }
    let req = w.report(T0 + S).unwrap();
    assert_eq!(req.settings.map(|s| s.timeout_ms), Some(250));
    let mode = |action: &str| {
        req.reports
            .iter()
            .find(|r| r.key.starts_with(&format!("{action}|")))
            .map(|r| r.failure_mode)
    };
    assert_eq!(mode("api"), Some(None));
    assert_eq!(mode("pay"), Some(Some(FailureMode::FailClosed)));
    assert_eq!(mode("feed"), Some(Some(FailureMode::FailOpen)));
}

/// Issue 35: a report unanswered within the callout timeout is sent again
/// at once, once, before the interval is due; the report and its retry
/// count as one failure for the breaker, and the next report waits for
/// the interval.
#[test]
fn a_lost_report_is_retried_at_once_and_counts_one_failure_with_its_retry() {
    let w = World::new("fail_open_local");
    assert_eq!(w.admitted("acme", 1, T0), 1);
    let host = w.host();
    let send = |now: u64| {
        let Claim::Won { seq, given_up } = claim(&host, w.settings(), now).unwrap() else {
            panic!("a report is due at {now}");
        };
        let mut scan = Scan::new(seq, now);
        while !scan_step(&host, &w.policy, &mut scan, 64) {}
        assert!(sent(&host, &scan, now).unwrap());
        (seq, given_up)
    };
    let (first, _) = send(T0);
    // Within the timeout (0.5 s): in flight.
    assert!(matches!(
        claim(&host, w.settings(), T0 + 500 * MS).unwrap(),
        Claim::NotDue(_)
    ));
    // Past it: given up on (one failure) and retried at once, long before
    // the interval (1 s) is due, under a new seq.
    let (retry, given_up) = send(T0 + 510 * MS);
    assert!(given_up.timed_out && !given_up.opened);
    assert!(retry > first);
    let (s, _) = read_state(&host).unwrap();
    let s = s.unwrap();
    assert_eq!((s.failures, s.retry), (1, crate::sync::Retry::InFlight));
    assert_eq!(s.last_report_at, Some(T0), "the interval's cadence stays");
    // The retry is lost too: given up on with no second failure; the next
    // report is the interval's (due at 1 s), not a third try.
    let (next, given_up) = send(T0 + 1_020 * MS);
    assert!(given_up.timed_out && !given_up.opened);
    assert!(next > retry);
    let (s, _) = read_state(&host).unwrap();
    let s = s.unwrap();
    assert_eq!((s.failures, s.retry), (1, crate::sync::Retry::None));
    assert_eq!(s.last_report_at, Some(T0 + 1_020 * MS));
    // An answer to the given-up first report is refused: it is not the
    // report in flight.
    let late = SyncResponse {
        version: PROTOCOL_VERSION,
        ack_seq: first,
        interval_ms: 1_000,
        leases: vec![],
    };
    assert!(matches!(
        accept(&host, &w.policy, w.settings(), &late, T0 + 1_030 * MS),
        Err(NotApplied::Refused(ApplyError::Stale))
    ));
}

/// A report unanswered half its callout timeout after it was sent is sent
/// again, the same `seq` (its hedge, issue 35): once, and the report's
/// deadline then counts from the copy.
#[test]
fn an_unanswered_report_is_hedged_once_and_its_deadline_moves_to_the_copy() {
    let w = World::new("fail_open_local");
    assert_eq!(w.admitted("acme", 1, T0), 1);
    let host = w.host();
    let req = w.report(T0).unwrap();
    assert_eq!(hedge_after_ns(w.settings()), 250 * MS);
    assert!(!hedge(&host, w.settings(), req.seq, T0 + 249 * MS).unwrap());
    assert!(
        !hedge(&host, w.settings(), req.seq + 1, T0 + 250 * MS).unwrap(),
        "not in flight"
    );
    assert!(hedge(&host, w.settings(), req.seq, T0 + 250 * MS).unwrap());
    assert!(
        !hedge(&host, w.settings(), req.seq, T0 + 700 * MS).unwrap(),
        "once"
    );
    // Not given up on at the first copy's deadline: the copy's runs to 0.75 s.
    assert!(matches!(
        claim(&host, w.settings(), T0 + 740 * MS).unwrap(),
        Claim::NotDue(_)
    ));
    // Either copy's answer is the report's: applied once.
    assert!(w.answer(&req, 10, T0 + 700 * MS).is_ok());
    assert!(matches!(
        w.answer(&req, 10, T0 + 720 * MS),
        Err(NotApplied::Refused(ApplyError::Stale))
    ));
    assert_eq!(w.admitted("acme", 20, T0 + 730 * MS), 10);
}
