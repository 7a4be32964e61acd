//! The controller on explicit time: its step function on exact windows
//! (here) and a simulation of the code that ships ([`sim`]).

use std::rc::Rc;

use super::*;
use crate::testing::{FakeHost, SharedStore};

mod sim;

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;
const W: u64 = 500 * MS;
const T0: u64 = 3_592_000_000 * W;

fn policy(max_in_flight: u32, adaptive: &str) -> Rc<Policy> {
    let json = format!(
        r#"{{
        "version": "ctl-1",
        "identity": {{"header": "x-tenant-id"}},
        "plans": {{"free": {{"limits": [{{"rate": 1000000000, "per": "1s"}}]}}}},
        "default_plan": "free",
        "anonymous": {{"plan": "free"}},
        "dependencies": {{"db": {{"max_in_flight": {max_in_flight}, "adaptive": {adaptive}}}}},
        "routes": {{"orders": {{"dependency": "db"}}}}
    }}"#
    );
    match Policy::from_json(json.as_bytes()) {
        Ok(p) => Rc::new(p),
        Err(e) => panic!("test policy invalid: {e}"),
    }
}

fn settings(p: &Policy) -> Adaptive {
    match p.dependency(0).and_then(|d| d.adaptive) {
        Some(a) => a,
        None => panic!("no adaptive settings"),
    }
}

fn summary(index: u64, completed: u32, p95_ms: u64, peak: u32) -> WindowSummary {
    WindowSummary {
        index,
        start_ns: index * W,
        window_ns: W,
        completed,
        successes: completed,
        errors: 0,
        timeouts: 0,
        not_counted: 0,
        p95_ns: (completed > 0).then_some(p95_ms * MS),
        min_ns: (completed > 0).then_some(MS),
        oldest_queue_ns: 0,
        peak_in_flight: peak,
        refused: 0,
    }
}

/// A state with a measured baseline of 20 ms and a limit of `limit`.
fn with_baseline(a: &Adaptive, limit: u32) -> State {
    State {
        limit_milli: u64::from(limit) * 1000,
        baseline_ns: 20 * MS,
        next_refresh: u64::MAX,
        last_index: 1,
        ..State::initial(a)
    }
}

#[test]
fn the_first_window_with_traffic_measures_the_baseline_at_an_eighth_of_the_limit() {
    let p = policy(100, "{}");
    let a = settings(&p);
    let st = State::initial(&a);
    assert_eq!((st.limit(&a), st.cap(&a)), (100, 100));
    // Idle: nothing to measure.
    let st = step(&a, 7, &st, &summary(10, 0, 0, 0));
    assert_eq!(
        (st.phase, st.last_move, st.limit(&a)),
        (Phase::Normal, Move::Idle, 100)
    );
    let st = step(&a, 7, &st, &summary(11, 500, 80, 100));
    // The first refresh cuts to 1/8 (the limit may be far too high yet).
    assert_eq!((st.phase, st.cap(&a)), (Phase::Draining, 12));
    let st = step(&a, 7, &st, &summary(12, 500, 60, 12));
    assert_eq!((st.phase, st.cap(&a)), (Phase::Measuring, 12));
    let st = step(&a, 7, &st, &summary(13, 500, 20, 50));
    assert_eq!(
        (st.phase, st.last_move, st.baseline_ns),
        (Phase::Normal, Move::Measured, 20 * MS)
    );
    assert_eq!((st.limit(&a), st.cap(&a)), (100, 100), "the limit comes back");
    let windows = a.baseline_refresh_ns / W;
    let jitter = windows / 4;
    assert!((13 + windows - jitter..=13 + windows + jitter).contains(&st.next_refresh));
    // A window already applied changes nothing.
    assert_eq!(step(&a, 7, &st, &summary(13, 500, 900, 50)), st);
}

#[test]
fn each_rule_moves_the_limit_within_its_bound() {
    let p = policy(1000, "{}");
    let a = settings(&p);
    let st = with_baseline(&a, 100);
    // Far over the baseline: the gradient (20·1.02/200 clamps to 0.5),
    // smoothed by 2α = 0.5 on the way down: 100 + 0.5·(50 − 100) = 75.
    let down = step(&a, 1, &st, &summary(2, 500, 200, 100));
    assert_eq!(down.last_move, Move::Gradient);
    assert_eq!(down.limit_milli, 75_000);
    // In the dead zone: g = 20·1.02/21 = 0.971, between 1 − 0.04 − 0.3/√500
    // = 0.947 and 1 − 0.3/√500 = 0.987: held.
    let held = step(&a, 1, &st, &summary(2, 500, 21, 100));
    assert_eq!((held.last_move, held.limit(&a)), (Move::Held, 100));
    // Healthy and used: up by α·(L·g + √(L·g) − L), g = 1.02.
    let up = step(&a, 1, &st, &summary(2, 500, 20, 90));
    assert_eq!(up.last_move, Move::Increase);
    let lg = 100.0 * 1.02;
    let want = 100.0 + 0.25 * (lg + f64::sqrt(lg) - 100.0);
    assert!(
        (up.limit_milli as f64 / 1000.0 - want).abs() < 0.01,
        "{}",
        up.limit_milli
    );
    // Very healthy: the increase is bounded by max_increase (25 %).
    let capped = step(&a, 1, &st, &summary(2, 500, 5, 100));
    assert_eq!(capped.limit(&a), 125);
    // Healthy but unused (peak 50 of 100): held, never inflated.
    let unused = step(&a, 1, &st, &summary(2, 500, 20, 50));
    assert_eq!((unused.last_move, unused.limit(&a)), (Move::Held, 100));
    // ... unless requests were refused for the limit (a level's share).
    let refused = WindowSummary {
        refused: 3,
        ..summary(2, 500, 20, 50)
    };
    assert_eq!(step(&a, 1, &st, &refused).last_move, Move::Increase);
    // Errors over the threshold: the multiplicative backoff.
    let mut errs = summary(2, 500, 20, 100);
    errs.errors = 60;
    errs.successes = 440;
    let e = step(&a, 1, &st, &errs);
    assert_eq!((e.last_move, e.limit(&a)), (Move::ErrorBackoff, 80));
    // Queue age over its threshold with unhealthy latency: backoff; with
    // healthy latency it is demand: no backoff.
    let mut q = summary(2, 500, 40, 100);
    q.oldest_queue_ns = 300 * MS;
    assert_eq!(step(&a, 1, &st, &q).last_move, Move::QueueBackoff);
    q.p95_ns = Some(20 * MS);
    assert_eq!(step(&a, 1, &st, &q).last_move, Move::Increase);
    // Nothing completes while requests wait (a hung upstream): backoff.
    let mut hung = summary(2, 0, 0, 100);
    hung.oldest_queue_ns = 300 * MS;
    assert_eq!(step(&a, 1, &st, &hung).last_move, Move::QueueBackoff);
    // min and max hold.
    let mut low = with_baseline(&a, 2);
    low.limit_milli = 1500;
    let e = step(&a, 1, &low, &errs);
    assert_eq!(e.limit(&a), a.min);
    let high = with_baseline(&a, 1000);
    assert_eq!(step(&a, 1, &high, &summary(2, 500, 5, 1000)).limit(&a), 1000);
}

#[test]
fn idle_windows_hold_the_limit_forever() {
    let p = policy(1000, "{}");
    let a = settings(&p);
    let mut st = with_baseline(&a, 123);
    for i in 2..2000 {
        // No traffic at all, and a trickle below MIN_SAMPLES.
        let s = if i % 2 == 0 {
            summary(i, 0, 0, 0)
        } else {
            summary(i, MIN_SAMPLES - 1, 900, 123)
        };
        st = step(&a, 1, &st, &s);
    }
    assert_eq!(st.limit(&a), 123);
    assert_eq!(st.reversals, 0);
}

#[test]
fn the_refresh_is_spread_over_dependencies() {
    let p = policy(1000, "{}");
    let a = settings(&p);
    let at: std::collections::BTreeSet<u64> = (0..50u64).map(|seed| next_refresh(&a, seed, 1000)).collect();
    assert!(at.len() > 10, "jittered: {at:?}");
    let windows = a.baseline_refresh_ns / a.window_ns;
    assert!(at
        .iter()
        .all(|&i| i >= 1000 + windows * 3 / 4 && i <= 1000 + windows * 5 / 4));
}

#[test]
fn the_control_state_round_trips_through_shared_data_once_per_window() {
    let store = SharedStore::new();
    let host = FakeHost::new(store.clone());
    let p = policy(100, "{}");
    let dep = match p.dependency(0) {
        Some(d) => d.clone(),
        None => panic!("no dependency"),
    };
    let a = settings(&p);
    let mut buffers = table::Buffers::default();
    let s = summary(T0 / W, 500, 80, 100);
    let first = apply(&host, &dep, &a, &s, T0, &mut buffers);
    assert!(matches!(first, Ok(Some(st)) if st.phase == Phase::Draining));
    // The same window again (a second closer cannot exist, but a retried
    // apply must not move the limit twice).
    assert_eq!(apply(&host, &dep, &a, &s, T0, &mut buffers), Ok(None));
    let read_back = read(&host, "db");
    assert_eq!(read_back, first.ok().flatten());
}
