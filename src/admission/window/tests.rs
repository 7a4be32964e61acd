//! Stream-end windows on explicit time with the in-memory host: two workers
//! ([`Windows`] over one [`SharedStore`], like two worker VMs).

use super::*;
use crate::memory::{MemoryHost, SharedStore};

const MS: u64 = 1_000_000;
const W: u64 = 500 * MS;
/// The start of a window (an exact multiple of `W`).
const T0: u64 = 3_592_000_000 * W;

fn ok(ms: u64) -> Outcome {
    Outcome {
        latency_ns: ms * MS,
        kind: OutcomeKind::Success,
        in_flight: 1,
    }
}

fn of(kind: OutcomeKind, ms: u64) -> Outcome {
    Outcome {
        latency_ns: ms * MS,
        kind,
        in_flight: 1,
    }
}

#[test]
fn a_bucket_midpoint_is_within_its_stated_error() {
    let mut v = 8_000u64; // 8 µs
    while v < MAX_LATENCY_US * NANOS_PER_US / 2 {
        let mid = bucket_value_ns(bucket_of(v)) as f64;
        let err = (mid - v as f64).abs() / v as f64;
        assert!(err <= 0.0625 + 1e-9, "{v} ns -> {mid} ({err})");
        v = v + v / 97 + 1;
    }
    assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
    assert_eq!(bucket_of(0), 0);
    for b in 1..BUCKETS {
        assert!(
            bucket_value_ns(b) > bucket_value_ns(b - 1),
            "bucket {b} not increasing"
        );
    }
}

#[test]
fn p95_of_a_known_sample() {
    let mut t = Tally::default();
    for ms in 1..=100 {
        t.add(ok(ms));
    }
    let p95 = t.quantile_ns(0.95).unwrap_or(0) as f64;
    assert!((p95 / (95.0 * MS as f64) - 1.0).abs() <= 0.125, "{p95}");
    assert_eq!(t.min_ns, MS);
    // Interpolated: a dense uniform sample's quantiles are close.
    let mut t = Tally::default();
    for us in 0..100_000u64 {
        t.add(Outcome {
            latency_ns: (10_000 + us) * 1_000,
            kind: OutcomeKind::Success,
            in_flight: 1,
        });
    }
    for q in [0.5, 0.9, 0.95, 0.99] {
        let want = (10_000.0 + q * 100_000.0) * 1_000.0;
        let got = t.quantile_ns(q).unwrap_or(0) as f64;
        // (A partly filled bucket is assumed evenly filled: p99 is 3 % off.)
        assert!((got / want - 1.0).abs() < 0.04, "q{q}: {got} vs {want}");
    }
    // Errors are not latency samples; timeouts are.
    let mut t = Tally::default();
    t.add(of(OutcomeKind::Error, 1));
    assert_eq!(t.quantile_ns(0.95), None);
    t.add(of(OutcomeKind::Timeout, 1000));
    assert!(t.quantile_ns(0.95).is_some_and(|v| v >= 900 * MS));
    assert_eq!(t.min_ns, u64::MAX, "a timeout is not a minimum");
}

#[test]
fn classify_by_code_details_and_status() {
    use OutcomeKind::*;
    let cases: [(Option<&str>, Option<u32>, bool, OutcomeKind); 12] = [
        (Some("via_upstream"), Some(200), false, Success),
        (Some("via_upstream"), Some(404), false, Success),
        (Some("via_upstream"), Some(500), false, Error),
        (Some("via_upstream"), Some(503), false, Error),
        (Some("via_upstream"), Some(504), false, Timeout),
        (Some("upstream_response_timeout"), Some(504), false, Timeout),
        (
            Some("upstream_reset_before_response_started{connection_failure}"),
            Some(503),
            false,
            Error,
        ),
        (Some("no_healthy_upstream"), Some(503), false, Error),
        (Some("downstream_remote_disconnect"), None, false, NotCounted),
        (Some("direct_response"), Some(200), false, NotCounted),
        // tenantgate's own replies, whatever their status.
        (Some("via_upstream"), Some(503), true, NotCounted),
        (None, None, false, NotCounted),
    ];
    for (details, status, local, want) in cases {
        assert_eq!(
            classify(details, status, local),
            want,
            "{details:?} {status:?} {local}"
        );
    }
}

struct Node {
    store: std::rc::Rc<std::cell::RefCell<SharedStore>>,
}

impl Node {
    fn new() -> Node {
        Node {
            store: SharedStore::new(),
        }
    }
    fn host(&self) -> MemoryHost {
        MemoryHost::new(self.store.clone())
    }
}

#[test]
fn two_workers_fold_into_one_window_and_one_closes_it() {
    let node = Node::new();
    let host = node.host();
    prepare(&host, "db", W, T0);
    let (mut a, mut b) = (Windows::default(), Windows::default());
    for i in 0..10 {
        a.record("db", W, ok(10 + i), T0 + 10 * MS);
    }
    b.record("db", W, of(OutcomeKind::Error, 1), T0 + 20 * MS);
    b.record("db", W, of(OutcomeKind::Timeout, 300), T0 + 20 * MS);
    b.record("db", W, of(OutcomeKind::NotCounted, 1), T0 + 20 * MS);
    b.record("db", W, ok(5), T0 + 30 * MS);
    b.note_queue_age("db", W, 40 * MS, T0 + 30 * MS);
    b.note_refused("db", W, T0 + 30 * MS);
    a.note_refused("db", W, T0 + 30 * MS);
    b.record(
        "db",
        W,
        Outcome {
            in_flight: 9,
            ..ok(6)
        },
        T0 + 30 * MS,
    );
    // Folded, not closed; each fold gives the node's running counts: a's
    // 10 successes, then b's 4 health signals (2 failures) on top.
    let running = |completed, failures| Ticked {
        running: Some(Running { completed, failures }),
        ..Ticked::default()
    };
    assert_eq!(a.tick(&host, "db", W, T0 + 40 * MS), running(10, 0));
    assert_eq!(b.tick(&host, "db", W, T0 + 40 * MS), running(10 + 4, 2));
    for t in [T0 + 41 * MS, T0 + 450 * MS] {
        assert_eq!(a.tick(&host, "db", W, t), Ticked::default());
        assert_eq!(b.tick(&host, "db", W, t), Ticked::default());
    }
    assert!(a.pending("db").is_some_and(Tally::is_empty));
    // Ended, but within the grace: still open.
    let end = T0 + W;
    assert_eq!(a.tick(&host, "db", W, end + GRACE_NS - 1).closed, None);
    let first = a.tick(&host, "db", W, end + GRACE_NS).closed;
    let second = b.tick(&host, "db", W, end + GRACE_NS + MS).closed;
    let s = match (first, second) {
        (Some(s), None) => s,
        other => panic!("exactly one worker closes: {other:?}"),
    };
    assert_eq!(s.index, T0 / W);
    assert_eq!(s.start_ns, T0);
    assert_eq!(
        (s.completed, s.successes, s.errors, s.timeouts, s.not_counted),
        (14, 12, 1, 1, 1)
    );
    assert_eq!(s.min_ns, Some(5 * MS));
    assert_eq!(s.oldest_queue_ns, 40 * MS);
    assert!((s.error_rate() - 2.0 / 14.0).abs() < 1e-12);
    assert_eq!((s.peak_in_flight, s.refused), (9, 2));
    let p95 = s.p95_ns.unwrap_or(0);
    assert!(p95 >= 280 * MS, "the timeout is the top 5 %: {p95}");
    assert_eq!(open_window(&host, "db"), Some((T0 / W + 1, 1)));
}

#[test]
fn a_late_worker_counts_in_the_next_window() {
    let node = Node::new();
    let host = node.host();
    prepare(&host, "db", W, T0);
    let (mut a, mut b) = (Windows::default(), Windows::default());
    a.record("db", W, ok(10), T0 + 100 * MS);
    b.record("db", W, ok(20), T0 + 400 * MS);
    let _ = a.tick(&host, "db", W, T0 + 110 * MS);
    // b's tick comes after the close of the window its sample was in.
    let closed = a.tick(&host, "db", W, T0 + W + GRACE_NS).closed;
    assert_eq!(closed.map(|s| s.completed), Some(1));
    assert_eq!(b.tick(&host, "db", W, T0 + W + GRACE_NS + 5 * MS).closed, None);
    let next = b.tick(&host, "db", W, T0 + 2 * W + GRACE_NS).closed;
    assert_eq!(next.map(|s| (s.completed, s.min_ns)), Some((1, Some(20 * MS))));
}

#[test]
fn a_sample_of_the_next_window_waits_for_it() {
    let node = Node::new();
    let host = node.host();
    prepare(&host, "db", W, T0);
    let (mut a, mut b) = (Windows::default(), Windows::default());
    a.record("db", W, ok(10), T0 + 100 * MS);
    let _ = a.tick(&host, "db", W, T0 + 110 * MS);
    // During the grace: b's sample is of the next window.
    b.record("db", W, ok(30), T0 + W + 10 * MS);
    let _ = b.tick(&host, "db", W, T0 + W + 10 * MS);
    let s = a.tick(&host, "db", W, T0 + W + GRACE_NS).closed;
    assert_eq!(s.map(|s| (s.completed, s.min_ns)), Some((1, Some(10 * MS))));
    let s = a.tick(&host, "db", W, T0 + 2 * W + GRACE_NS).closed;
    assert_eq!(s.map(|s| (s.completed, s.min_ns)), Some((1, Some(30 * MS))));
}

#[test]
fn idle_windows_close_empty_and_cost_nothing_between_ends() {
    let node = Node::new();
    let host = node.host();
    prepare(&host, "db", W, T0);
    let mut a = Windows::default();
    let mut closed = Vec::new();
    let mut t = T0;
    while t < T0 + 10 * W {
        if let Some(s) = a.tick(&host, "db", W, t).closed {
            closed.push(s);
        }
        t += 10 * MS;
    }
    assert_eq!(closed.len(), 9, "one per window end");
    assert!(closed
        .iter()
        .all(|s| s.completed == 0 && s.p95_ns.is_none() && s.min_ns.is_none()));
    assert!(closed.windows(2).all(|p| p[1].index == p[0].index + 1));
    // Between ends an idle worker does not write.
    assert!(a.tick(&host, "db", W, T0 + 10 * W + GRACE_NS).closed.is_some());
    let before = node.store.borrow().get(&window_key("db")).map(<[u8]>::to_vec);
    let conflicts = node.store.borrow().conflicts;
    let _ = a.tick(&host, "db", W, T0 + 10 * W + GRACE_NS + 10 * MS);
    let _ = a.tick(&host, "db", W, T0 + 11 * W);
    let after = node.store.borrow().get(&window_key("db")).map(<[u8]>::to_vec);
    assert!(before.is_some());
    assert_eq!(before, after);
    assert_eq!(node.store.borrow().conflicts, conflicts);
}

#[test]
fn after_a_gap_the_open_window_catches_up_and_a_dead_worker_is_absent() {
    let node = Node::new();
    let host = node.host();
    prepare(&host, "db", W, T0);
    let (mut a, mut dead) = (Windows::default(), Windows::default());
    dead.record("db", W, ok(1), T0 + 10 * MS);
    a.record("db", W, ok(7), T0 + 10 * MS);
    // Nobody ticks for 100 windows.
    let late = T0 + 100 * W + 200 * MS;
    let s = a.tick(&host, "db", W, late).closed;
    assert_eq!(s.map(|s| (s.index, s.completed)), Some((T0 / W, 0)));
    assert_eq!(open_window(&host, "db").map(|o| o.0), Some(late / W));
    let s = a.tick(&host, "db", W, (late / W + 1) * W + GRACE_NS).closed;
    // a's sample, late, counts in the window that is open; dead's never.
    assert_eq!(s.map(|s| (s.completed, s.min_ns)), Some((1, Some(7 * MS))));
}

#[test]
fn a_failed_fold_keeps_the_samples() {
    let node = Node::new();
    let mut host = node.host();
    prepare(&host, "db", W, T0);
    let mut a = Windows::default();
    a.record("db", W, ok(3), T0 + 10 * MS);
    host.fail_shared = true;
    let t = a.tick(&host, "db", W, T0 + 20 * MS);
    assert!(t.failed.is_some());
    assert_eq!(a.pending("db").map(Tally::completed), Some(1));
    host.fail_shared = false;
    let _ = a.tick(&host, "db", W, T0 + 30 * MS);
    assert_eq!(a.pending("db").map(Tally::completed), Some(0));
    let s = a.tick(&host, "db", W, T0 + W + GRACE_NS).closed;
    assert_eq!(s.map(|s| s.completed), Some(1));
}

#[test]
fn a_changed_window_length_starts_over() {
    let node = Node::new();
    let host = node.host();
    prepare(&host, "db", W, T0);
    let mut a = Windows::default();
    a.record("db", W, ok(3), T0 + 10 * MS);
    let _ = a.tick(&host, "db", W, T0 + 20 * MS);
    let w2 = 250 * MS;
    let _ = a.tick(&host, "db", w2, T0 + 30 * MS);
    assert_eq!(open_window(&host, "db"), Some(((T0 + 30 * MS) / w2, 0)));
}

#[test]
fn the_entry_size_is_as_stated() {
    let node = Node::new();
    let host = node.host();
    prepare(&host, "db", W, T0);
    assert_eq!(TALLY_LEN, 840);
    assert_eq!(ENTRY_STATE_LEN, 1_705);
    let value = node.store.borrow().get(&window_key("db")).map(<[u8]>::len);
    // Entry and record headers around the state.
    assert!(
        value.is_some_and(|n| n > ENTRY_STATE_LEN && n < ENTRY_STATE_LEN + 64),
        "{value:?}"
    );
}
