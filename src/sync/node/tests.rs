use super::*;
use crate::sync::cycle::{ApplyError, BreakerState, SyncState};
use crate::sync::protocol::Lease as WireLease;
use crate::sync::protocol::{SyncRequest, SyncResponse, PROTOCOL_VERSION};

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;
/// An arbitrary, realistic wall-clock start (2026-11-30).
const T0: u64 = 1_796_000_000 * S;

fn config(mode: FailureMode) -> NodeConfig {
    NodeConfig {
        node_id: "n1".into(),
        region: "r1".into(),
        policy_version: "v1".into(),
        provisional: 2,
        failure_mode: mode,
        response_timeout_ns: 500 * MS,
        interval_ns: S,
        max_ttl_ns: 10 * S,
        local_max_ns: 60 * S,
    }
}

fn node(mode: FailureMode) -> Node {
    Node::new(config(mode), T0)
}

fn lease(tokens: u64, share: u64, ttl_ms: u64) -> WireLease {
    WireLease {
        key: "k".into(),
        limit: "l".into(),
        tokens,
        share,
        share_milli: 0,
        ttl_ms,
        outage_milli: None,
        bucket_milli: None,
    }
}

fn answer(req: &SyncRequest, leases: Vec<WireLease>) -> SyncResponse {
    SyncResponse {
        version: PROTOCOL_VERSION,
        ack_seq: req.seq,
        interval_ms: 1000,
        leases,
    }
}

fn admit_n(n: &mut Node, count: u64, now: u64) -> u64 {
    (0..count).filter(|_| n.admit("k", "l", 1, now)).count() as u64
}

#[test]
fn the_first_request_of_a_new_key_is_admitted_at_once_then_it_awaits_its_lease() {
    let mut n = node(FailureMode::FailClosed);
    assert_eq!(n.decide("k", "l", 1, T0), Ok(Admitted::Provisional));
    assert_eq!(n.decide("k", "l", 1, T0), Ok(Admitted::Provisional));
    assert_eq!(n.decide("k", "l", 1, T0), Err(Denied::AwaitingLease));
    assert_eq!(
        n.pending("k", "l"),
        Counts {
            consumed: 2,
            unleased: 2,
            demand: 3
        }
    );
}

#[test]
fn a_report_carries_counts_and_only_its_acknowledgement_resets_them() {
    let mut n = node(FailureMode::FailClosed);
    admit_n(&mut n, 3, T0);
    let req = n.report(T0).unwrap();
    assert_eq!(req.reports.len(), 1);
    assert_eq!((req.reports[0].consumed, req.reports[0].demand), (2, 3));
    // Admitted while the report is in flight: stays counted after the ack.
    n.admit("k", "l", 1, T0 + MS);
    assert_eq!(
        n.apply(&answer(&req, vec![lease(10, 5, 3000)]), T0 + 50 * MS),
        Ok(1)
    );
    assert_eq!(
        n.pending("k", "l"),
        Counts {
            consumed: 0,
            unleased: 0,
            demand: 1
        }
    );
    let next = n.report(T0 + S).unwrap();
    assert_eq!(next.acked_seq, req.seq);
    assert!(next.seq > req.seq);
}

#[test]
fn a_lost_report_is_carried_again_merged_with_newer_counts() {
    let mut n = node(FailureMode::FailClosed);
    admit_n(&mut n, 1, T0);
    let lost = n.report(T0).unwrap();
    // One report in flight at a time, until its timeout.
    assert!(n.report(T0 + 400 * MS).is_none());
    admit_n(&mut n, 1, T0 + 450 * MS);
    let again = n.report(T0 + 501 * MS).unwrap();
    assert_eq!(n.stats().timeouts, 1);
    assert_eq!(again.acked_seq, 0);
    assert_eq!((again.reports[0].consumed, again.reports[0].demand), (2, 2));
    // The response to the lost report, arriving now, is not applied.
    assert_eq!(
        n.apply(&answer(&lost, vec![lease(10, 5, 3000)]), T0 + 600 * MS),
        Err(ApplyError::Stale)
    );
    assert_eq!(n.pending("k", "l").consumed, 2);
}

#[test]
fn a_response_after_the_callout_timeout_is_ignored() {
    let mut n = node(FailureMode::FailClosed);
    admit_n(&mut n, 1, T0);
    let req = n.report(T0).unwrap();
    assert_eq!(
        n.apply(&answer(&req, vec![lease(10, 5, 3000)]), T0 + 501 * MS),
        Err(ApplyError::Late)
    );
    assert_eq!(n.lease_tokens("k", "l", T0 + 501 * MS), None);
    assert_eq!(n.pending("k", "l").consumed, 1);
}

#[test]
fn lease_tokens_count_from_when_the_request_was_sent() {
    let mut n = node(FailureMode::FailClosed);
    admit_n(&mut n, 1, T0);
    let r1 = n.report(T0).unwrap();
    n.apply(&answer(&r1, vec![lease(10, 5, 3000)]), T0 + 10 * MS)
        .unwrap();
    assert_eq!(admit_n(&mut n, 4, T0 + 20 * MS), 4);
    let r2 = n.report(T0 + S).unwrap();
    // 3 more on the old lease while r2 is in flight...
    assert_eq!(admit_n(&mut n, 3, T0 + S + 10 * MS), 3);
    // ...are taken off the new lease of 10: 7 left, not 10 + what remained.
    n.apply(&answer(&r2, vec![lease(10, 5, 3000)]), T0 + S + 20 * MS)
        .unwrap();
    assert_eq!(n.lease_tokens("k", "l", T0 + S + 20 * MS), Some(7));
    assert_eq!(admit_n(&mut n, 10, T0 + S + 30 * MS), 7);
    assert_eq!(
        n.decide("k", "l", 1, T0 + S + 30 * MS),
        Err(Denied::LeaseExhausted)
    );
}

/// A node with a lease of `share` per interval, expired at `T0 + 3 s + 10 ms`
/// and never renewed (the central cluster is unreachable).
fn expired(mode: FailureMode, share: u64) -> (Node, u64) {
    let mut n = node(mode);
    admit_n(&mut n, 1, T0);
    let req = n.report(T0).unwrap();
    n.apply(&answer(&req, vec![lease(share, share, 3000)]), T0 + 10 * MS)
        .unwrap();
    admit_n(&mut n, 1, T0 + 20 * MS);
    (n, T0 + 3 * S + 10 * MS)
}

#[test]
fn after_expiry_fail_closed_denies_and_fail_open_admits_as_unleased() {
    let (mut closed, at) = expired(FailureMode::FailClosed, 5);
    assert_eq!(closed.lease_tokens("k", "l", at - 1), Some(4));
    assert_eq!(closed.decide("k", "l", 1, at), Err(Denied::FailClosed));
    let (mut open, at) = expired(FailureMode::FailOpen, 5);
    assert_eq!(admit_n(&mut open, 1000, at), 1000);
    assert_eq!(open.pending("k", "l").unleased, 1000);
}

#[test]
fn fail_open_local_starts_empty_enforces_the_last_share_and_ends() {
    let (mut n, at) = expired(FailureMode::FailOpenLocal, 10);
    // Empty at first: nothing until a token accrues (100 ms at 10/s).
    assert_eq!(n.decide("k", "l", 1, at), Err(Denied::LocalLimit));
    assert_eq!(admit_n(&mut n, 5, at + 100 * MS), 1);
    // Over 10 s: the share's rate, 10 per interval (1 s), and no more.
    let mut admitted = 0;
    for ms in (110..10_110).step_by(10) {
        admitted += admit_n(&mut n, 3, at + ms * MS);
    }
    assert_eq!(admitted, 100);
    // local_max (60 s) after the expiry: fail closed.
    assert_eq!(n.decide("k", "l", 1, at + 60 * S), Err(Denied::FailClosed));
}

/// Issue 21: the lease's outage allowance, not its share, sets
/// `fail_open_local`'s rate, exactly in thousandths: 100/min split over
/// three nodes is 0.556 units per 1 s interval (whole shares of 0 or 1
/// left a node with nothing or a third too much).
#[test]
fn fail_open_local_runs_at_the_outage_allowance_in_thousandths() {
    let with = |outage: Option<u64>| {
        let mut n = node(FailureMode::FailOpenLocal);
        admit_n(&mut n, 1, T0);
        let req = n.report(T0).unwrap();
        let l = WireLease {
            outage_milli: outage,
            ..lease(2, 1, 3000)
        };
        n.apply(&answer(&req, vec![l]), T0 + 10 * MS).unwrap();
        n
    };
    let at = T0 + 3 * S + 10 * MS;
    let mut n = with(Some(556));
    // Empty at first: one unit accrues in 1.8 s.
    assert_eq!(admit_n(&mut n, 5, at), 0);
    assert_eq!(admit_n(&mut n, 5, at + 1_700 * MS), 0);
    assert_eq!(admit_n(&mut n, 5, at + 1_800 * MS), 1);
    let mut admitted = 1;
    for ms in (1_900..59_900).step_by(100) {
        admitted += admit_n(&mut n, 2, at + ms * MS);
    }
    // 0.556 per second over 59.9 s: 33.
    assert_eq!(admitted, 33);
    // An allowance of 0 admits nothing: it is not the share.
    let mut zero = with(Some(0));
    assert_eq!(admit_n(&mut zero, 10, at), 0);
    assert_eq!(admit_n(&mut zero, 10, at + 10 * S), 0);
    // From a service that sent none: the whole share (1 per interval;
    // the bucket holds that and one request).
    let mut old = with(None);
    assert_eq!(admit_n(&mut old, 10, at), 0);
    assert_eq!(admit_n(&mut old, 10, at + 10 * S), 2);
}

#[test]
fn a_new_lease_ends_the_failure_mode() {
    let (mut n, at) = expired(FailureMode::FailOpenLocal, 10);
    let req = n.report(at).unwrap();
    n.apply(&answer(&req, vec![lease(50, 10, 3000)]), at + 10 * MS)
        .unwrap();
    assert_eq!(admit_n(&mut n, 60, at + 20 * MS), 50);
    assert_eq!(n.decide("k", "l", 1, at + 20 * MS), Err(Denied::LeaseExhausted));
}

#[test]
fn an_idle_key_on_a_connected_node_waits_for_its_next_lease_not_a_provisional_allowance() {
    let mut n = node(FailureMode::FailClosed);
    admit_n(&mut n, 1, T0);
    let mut now = T0;
    let req = n.report(now).unwrap();
    n.apply(&answer(&req, vec![lease(5, 5, 2000)]), now + 10 * MS)
        .unwrap();
    // Keep syncing past the lease's expiry: for a minute after its last
    // request the key is reported with zero counts (its keep-alive; this
    // service renews nothing), then no more.
    for i in 1..=62u64 {
        now += S;
        let req = n.report(now).unwrap();
        let kept = i * S < LEASE_KEEP_ALIVE_NS;
        assert_eq!(req.reports.len(), usize::from(kept), "at {i} s");
        assert!(req.reports.iter().all(|r| r.consumed == 0 && r.demand == 0));
        n.apply(&answer(&req, vec![]), now + 10 * MS).unwrap();
    }
    assert!(n.connected(now + 20 * MS));
    assert_eq!(n.decide("k", "l", 1, now + 20 * MS), Err(Denied::AwaitingLease));
    // Its demand goes out with the next report; the answer's lease admits.
    let req = n.report(now + S).unwrap();
    assert_eq!(req.reports[0].demand, 1);
    n.apply(&answer(&req, vec![lease(5, 5, 2000)]), now + S + 10 * MS)
        .unwrap();
    assert_eq!(n.decide("k", "l", 1, now + S + 20 * MS), Ok(Admitted::Lease));
}

/// The paced client: 3 requests every 4.5 s for two minutes on a
/// node whose service grants nothing (the bucket is empty), every lease
/// living 3 s. Regression: each lease expiry handed out `P` again (28
/// admitted in 60 s for a bound of 14).
#[test]
fn a_paced_client_cannot_farm_the_provisional_allowance_on_lease_expiry() {
    for mode in [FailureMode::FailClosed, FailureMode::FailOpenLocal] {
        let mut n = node(mode);
        let mut admitted = 0;
        let mut next_request = T0;
        let mut now = T0;
        while now < T0 + 120 * S {
            if now >= next_request {
                admitted += admit_n(&mut n, 3, now);
                next_request += 4_500 * MS;
            }
            if now % S == 0 {
                if let Some(req) = n.report(now) {
                    let leases = req.reports.iter().map(|_| lease(0, 0, 3000)).collect();
                    n.apply(&answer(&req, leases), now + 10 * MS).unwrap();
                }
            }
            now += 100 * MS;
        }
        // P = 2, once: the key started once.
        assert_eq!(admitted, 2, "{mode:?}");
    }
}

/// A node that keeps syncing but whose answers never lease the key (a
/// limit the service's policy lacks, a key in the overflow entry).
fn never_leased(mode: FailureMode) -> (Node, u64) {
    let mut n = node(mode);
    assert_eq!(admit_n(&mut n, 3, T0), 2);
    let mut now = T0;
    for _ in 0..2 {
        now += S;
        let req = n.report(now).unwrap();
        n.apply(&answer(&req, vec![]), now + 10 * MS).unwrap();
    }
    (n, now)
}

#[test]
fn a_key_never_leased_reaches_its_failure_mode_within_two_intervals_and_the_timeout() {
    // Waiting since T0 (the third request); 2 × 1 s + 0.5 s later the
    // failure mode applies. Regression: it denied for good.
    let until = T0 + 2_500 * MS;
    let (mut closed, _) = never_leased(FailureMode::FailClosed);
    assert_eq!(closed.decide("k", "l", 1, until - MS), Err(Denied::AwaitingLease));
    assert_eq!(closed.decide("k", "l", 1, until), Err(Denied::FailClosed));
    let (mut open, _) = never_leased(FailureMode::FailOpen);
    assert_eq!(open.decide("k", "l", 1, until - MS), Err(Denied::AwaitingLease));
    assert_eq!(admit_n(&mut open, 100, until), 100);
    // fail_open_local with no share: a local bucket at P (2) per interval,
    // starting empty.
    let (mut local, _) = never_leased(FailureMode::FailOpenLocal);
    assert_eq!(local.decide("k", "l", 1, until), Err(Denied::LocalLimit));
    let mut admitted = 0;
    for ms in (0..10_000).step_by(10) {
        let now = until + ms * MS;
        if ms % 1000 == 500 {
            // Still syncing, still no lease for the key.
            let req = local.report(now).unwrap();
            local.apply(&answer(&req, vec![]), now + MS).unwrap();
        }
        admitted += admit_n(&mut local, 3, now);
    }
    // One every 500 ms from empty: 19 in the 10 s that follow.
    assert_eq!(admitted, 19);
    // A lease ends it.
    let req = local.report(until + 10 * S).unwrap();
    local
        .apply(&answer(&req, vec![lease(1, 1, 3000)]), until + 10 * S + MS)
        .unwrap();
    assert_eq!(
        local.decide("k", "l", 1, until + 10 * S + 2 * MS),
        Ok(Admitted::Lease)
    );
    assert_eq!(
        local.decide("k", "l", 1, until + 10 * S + 2 * MS),
        Err(Denied::LeaseExhausted)
    );
}

#[test]
fn no_lease_says_when_the_failure_mode_runs_for_want_of_a_lease() {
    let mut a = Allowance::fresh(2);
    let s = SyncState::new(T0, S, 500 * MS);
    let view = s.view(FailureMode::FailClosed, 2, 60 * S, 500 * MS, 10 * S, T0);
    assert_eq!(view.await_max_ns, 2_500 * MS);
    assert!(a.decide(&view, 2, T0).is_ok());
    assert_eq!(a.decide(&view, 1, T0), Err(Denied::AwaitingLease));
    assert!(!a.no_lease(&view, T0 + 2_499 * MS));
    assert!(a.no_lease(&view, T0 + 2_500 * MS));
}

#[test]
fn a_clock_offset_changes_no_decision() {
    fn script(offset_ns: i64) -> Vec<String> {
        let at = |ns: u64| T0.checked_add_signed(offset_ns).unwrap() + ns;
        let mut n = Node::new(config(FailureMode::FailOpenLocal), at(0));
        let mut log = Vec::new();
        for step in 0..400u64 {
            let now = at(step * 37 * MS);
            let admitted = admit_n(&mut n, 2, now);
            log.push(format!("{step}:{admitted}"));
            if step % 27 == 0 {
                if let Some(req) = n.report(now) {
                    log.push(format!("{:?}", req.reports));
                    // Every other response is lost: leases expire, local mode runs.
                    if step % 54 == 0 {
                        let _ = n.apply(&answer(&req, vec![lease(20, 8, 1500)]), now + 30 * MS);
                    }
                }
            }
        }
        log
    }
    let reference = script(0);
    assert_eq!(script(2_000_000_000), reference);
    assert_eq!(script(-2_000_000_000), reference);
}

// The circuit breaker, on `SyncState` alone (what the glue keeps in shared
// data): every second a tick starts the report due, skips it while the
// breaker is open, and the report succeeds or fails at once.

const BREAKER: BreakerConfig = BreakerConfig {
    failures: 3,
    max_backoff_ns: 4 * S,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tick {
    Sent,
    Skipped,
}

/// Ticks at `T0 + sec·S` for each `sec`; `ok(sec)`: whether the report
/// sent then succeeds. Returns the second of every report and skip, and
/// how many times the breaker opened.
fn drive(
    s: &mut SyncState,
    secs: std::ops::RangeInclusive<u64>,
    ok: impl Fn(u64) -> bool,
) -> (Vec<(u64, Tick)>, u32) {
    let (mut ticks, mut opened) = (Vec::new(), 0);
    for sec in secs {
        let now = T0 + sec * S;
        if !s.due(now) {
            continue;
        }
        if s.breaker(now) == BreakerState::Open {
            s.skip(now);
            ticks.push((sec, Tick::Skipped));
            continue;
        }
        let (seq, _) = s.begin_report(now, S).unwrap();
        ticks.push((sec, Tick::Sent));
        if ok(sec) {
            s.accept(seq, now, 500 * MS).unwrap();
            s.applied(seq, 1000, 3 * S, 10 * S, now);
        } else {
            s.in_flight = None;
            opened += u32::from(s.failed(now, &BREAKER));
        }
    }
    (ticks, opened)
}

fn sent(ticks: &[(u64, Tick)]) -> Vec<u64> {
    ticks.iter().filter(|t| t.1 == Tick::Sent).map(|t| t.0).collect()
}

#[test]
fn the_breaker_opens_after_n_failures_in_a_row_and_a_success_resets_the_count() {
    let mut s = SyncState::new(T0, S, 500 * MS);
    // Two failures, a success, two failures: never three in a row.
    let (ticks, opened) = drive(&mut s, 1..=5, |sec| sec == 3);
    assert_eq!(sent(&ticks), [1, 2, 3, 4, 5]);
    assert_eq!(
        (opened, s.failures, s.breaker(T0 + 5 * S)),
        (0, 2, BreakerState::Closed)
    );
    // The third failure in a row opens it for one interval after the next
    // report was due: the report due at 7 s is skipped, 8 s is the probe.
    let (_, opened) = drive(&mut s, 6..=6, |_| false);
    assert_eq!((opened, s.failures), (1, 3));
    assert_eq!(s.open_until, Some(T0 + 8 * S));
    assert_eq!(s.breaker(T0 + 7 * S), BreakerState::Open);
    assert_eq!(s.breaker(T0 + 8 * S), BreakerState::HalfOpen);
}

#[test]
fn the_backoff_doubles_per_failed_probe_up_to_its_cap() {
    let mut s = SyncState::new(T0, S, 500 * MS);
    let (ticks, opened) = drive(&mut s, 1..=30, |_| false);
    // Three failures, then probes after backoffs of 1, 2, 4 and 4 (capped)
    // intervals; every interval between is skipped.
    assert_eq!(sent(&ticks), [1, 2, 3, 5, 8, 13, 18, 23, 28]);
    assert_eq!(ticks.iter().filter(|t| t.1 == Tick::Skipped).count(), 30 - 9);
    assert_eq!(opened, 7, "opened, then re-opened by each failed probe");
    let backoffs: Vec<Option<u64>> = (1..=7).map(|f| s.backoff_ns(f, &BREAKER)).collect();
    assert_eq!(
        backoffs,
        [
            None,
            None,
            Some(S),
            Some(2 * S),
            Some(4 * S),
            Some(4 * S),
            Some(4 * S)
        ]
    );
    assert_eq!(s.backoff_ns(u32::MAX, &BREAKER), Some(4 * S), "no overflow");
}

#[test]
fn a_successful_probe_closes_the_breaker_and_a_failed_one_reopens_it() {
    let mut s = SyncState::new(T0, S, 500 * MS);
    // Fails until 5 s: opened at 3 s, the probe at 5 s fails (backoff 2).
    let (ticks, _) = drive(&mut s, 1..=7, |_| false);
    assert_eq!(sent(&ticks), [1, 2, 3, 5]);
    assert_eq!(s.breaker(T0 + 7 * S), BreakerState::Open);
    assert_eq!(s.open_until, Some(T0 + 8 * S));
    // The probe at 8 s succeeds: closed, count reset, every interval again.
    let mut s2 = s;
    let (later, _) = drive(&mut s2, 8..=11, |_| true);
    assert_eq!(sent(&later), [8, 9, 10, 11]);
    assert_eq!((s2.failures, s2.open_until), (0, None));
    assert_eq!(s2.breaker(T0 + 11 * S), BreakerState::Closed);
    // The same probe failing instead re-opens it for 4 intervals (the cap).
    let (t, opened) = drive(&mut s, 8..=8, |_| false);
    assert_eq!((sent(&t), opened), (vec![8], 1));
    assert_eq!(s.open_until, Some(T0 + 13 * S));
}

#[test]
fn the_backoff_counts_from_when_the_next_report_was_due_not_from_the_failure() {
    // A report sent at 1 s that times out (found at 1.5 s) after two
    // failures: the next report was due at 2 s, so the breaker stays open
    // until 3 s, however late the failure was noticed.
    let mut s = SyncState::new(T0, S, 500 * MS);
    s.failures = 2;
    s.begin_report(T0 + S, S).unwrap();
    s.in_flight = None;
    assert!(s.failed(T0 + S + 500 * MS, &BREAKER));
    assert_eq!(s.open_until, Some(T0 + 3 * S));
}

/// A connected view (see [`SyncState::view`]).
fn connected_view() -> NodeView {
    SyncState::new(T0, S, 500 * MS).view(FailureMode::FailOpenLocal, 2, 60 * S, 500 * MS, 10 * S, T0)
}

fn leased(tokens: u64) -> Allowance {
    let mut a = Allowance::fresh(2);
    a.install(
        Granted {
            tokens,
            share: 10,
            share_milli: 10_000,
            ttl_ns: 3 * S,
            outage_milli: None,
            bucket_milli: None,
        },
        0,
        T0,
    );
    a
}

#[test]
fn a_settled_cost_is_taken_from_the_lease_then_owed_up_to_max_debt_and_paid_first() {
    let view = connected_view();
    let mut a = leased(100);
    assert_eq!(a.decide(&view, 10, T0), Ok(Admitted::Lease));
    // The request really cost 40: 30 more, from the lease, reported.
    assert_eq!(a.settle_more(30, 50, T0), 0);
    assert_eq!((a.available(T0), a.pending.consumed, a.owed), (60, 40, 0));
    // Another costs 100 more than its estimate: 60 from the lease, 40
    // owed (of at most 50).
    assert_eq!(a.settle_more(100, 50, T0), 0);
    assert_eq!((a.available(T0), a.pending.consumed, a.owed), (0, 100, 40));
    // Past the allowance: written off.
    assert_eq!(a.settle_more(30, 50, T0), 20);
    assert_eq!(a.owed, 50);
    // Owing, nothing is admitted on a lease; a request lacks its cost and
    // the debt.
    assert_eq!(a.decide(&view, 1, T0), Err(Denied::LeaseExhausted));
    assert_eq!(a.missing(1, T0), 51);
    // The next lease pays the debt first (reported as consumed on it).
    let consumed = a.pending.consumed;
    a.install(
        Granted {
            tokens: 80,
            share: 10,
            share_milli: 10_000,
            ttl_ns: 3 * S,
            outage_milli: None,
            bucket_milli: None,
        },
        0,
        T0 + S,
    );
    assert_eq!((a.owed, a.available(T0 + S)), (0, 30));
    assert_eq!(a.pending.consumed, consumed + 50);
    assert_eq!(a.decide(&view, 30, T0 + S), Ok(Admitted::Lease));
    // Nothing reported exceeds the leases: 100 + 80 granted, 180 consumed.
    assert_eq!(a.pending.consumed, 180);
}

#[test]
fn a_settled_cost_below_its_estimate_lowers_a_debt_then_goes_back_to_the_lease() {
    let view = connected_view();
    let mut a = leased(20);
    assert_eq!(a.decide(&view, 20, T0), Ok(Admitted::Lease));
    assert_eq!(a.settle_more(15, 100, T0), 0);
    assert_eq!(a.owed, 15);
    a.give_back(18, T0);
    assert_eq!((a.owed, a.available(T0), a.pending.consumed), (0, 3, 17));
    // An owing key is not idle; its record is kept.
    assert_eq!(a.settle_more(5, 100, T0), 0);
    assert!(!a.is_idle(T0 + 10 * S));
    // With no live lease nothing is given back.
    let mut expired = leased(5);
    expired.give_back(3, T0 + 4 * S);
    assert_eq!(expired.available(T0 + 4 * S), 0);
}
