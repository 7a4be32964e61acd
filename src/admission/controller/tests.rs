//! The controller on explicit time: its step function on exact windows
//! (here), a simulation of the code that ships ([`sim`]) and the
//! controller's guarantees measured on it over many seeds ([`bounds`]).

use std::rc::Rc;

use super::*;
use crate::admission::adaptive::{apply, read, tick, FIXED};
use crate::admission::window::Windows;
use crate::admission::Worker;
use crate::keys::kind;
use crate::memory::{MemoryHost, SharedStore};
use crate::policy::Policy;
use crate::table::{self, push_record_with, Commit, Place, Record};

mod bounds;
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
    // smoothed by 2α = 0.5 on the way down: 100 + 0.5·(50 − 100) = 75, but
    // latency alone stops at the floor, 25 % of the 99 slots above min
    // (1) below the anchor (100): 75.25.
    let down = step(&a, 1, &st, &summary(2, 500, 200, 100));
    assert_eq!(down.last_move, Move::Gradient);
    assert_eq!((down.limit_milli, down.anchor_milli), (75_250, 100_000));
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
    let host = MemoryHost::new(store.clone());
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

/// Windows of `completed` successes at `p95_ms`, with requests refused
/// (the limit used), from index `from`.
fn used(index: u64, completed: u32, p95_ms: u64) -> WindowSummary {
    WindowSummary {
        refused: 10,
        ..summary(index, completed, p95_ms, 1)
    }
}

/// Runs `windows` through [`step`] from `st`.
fn run(a: &Adaptive, st: State, windows: impl IntoIterator<Item = WindowSummary>) -> State {
    windows.into_iter().fold(st, |st, w| step(a, 1, &st, &w))
}

/// Used windows of `p95_ms` from index 2 until a refresh starts (at most
/// 20); the next index and the state.
fn until_refresh(a: &Adaptive, mut st: State, p95_ms: u64) -> (u64, State) {
    for i in 2..22 {
        st = step(a, 1, &st, &used(i, 500, p95_ms));
        if st.phase == Phase::Draining {
            return (i + 1, st);
        }
    }
    panic!("no refresh: {st:?}");
}

#[test]
fn latency_alone_stops_at_the_floor_where_a_flat_refresh_gives_the_limit_back() {
    // A baseline 20 % too low (20 ms; the upstream answers in 24 ms at any
    // concurrency): every window is bad.
    let p = policy(1000, "{}");
    let a = settings(&p);
    let (i, st) = until_refresh(&a, with_baseline(&a, 100), 24);
    // Down to the floor (75.25) and not below; the window at the floor
    // starts the experiment.
    assert_eq!((st.limit_milli, st.refresh_on_bad), (75_250, true));
    assert_eq!(st.cap(&a), 37);
    // At the cut the latency is the same (flat) and bad: the baseline is
    // contradicted and replaced by it; the limit comes back whole and then
    // to the anchor (100) by max_increase a window.
    let st = step(&a, 1, &st, &used(i, 500, 24));
    assert_eq!(st.phase, Phase::Measuring);
    let st = step(&a, 1, &st, &used(i + 1, 500, 24));
    assert_eq!(
        (st.phase, st.last_move, st.baseline_ns),
        (Phase::Normal, Move::Measured, 24 * MS)
    );
    assert_eq!((st.limit(&a), st.recover_milli), (75, 100_000));
    let back = run(&a, st, (i + 2..i + 4).map(|i| used(i, 500, 24)));
    assert_eq!(back.limit(&a), 100, "back at the anchor: {back:?}");
}

#[test]
fn a_descent_whose_latency_falls_with_the_limit_goes_on() {
    // The upstream queues: at 75 its p95 is 40 ms, at the cut (37) it is
    // the baseline's 20 ms: a clear fall. The limit goes on down from
    // about 75 by the window before's gradient (20·1.02/40 = 0.51): 75 +
    // 0.5·(38 − 75) ≈ 57, the anchor gone.
    let p = policy(1000, "{}");
    let a = settings(&p);
    let (i, st) = until_refresh(&a, with_baseline(&a, 100), 40);
    let st = run(&a, st, [used(i, 500, 20), used(i + 1, 500, 20)]);
    assert_eq!(
        (st.last_move, st.anchor_milli, st.baseline_ns),
        (Move::Gradient, 0, 20 * MS)
    );
    assert!((56_000..58_000).contains(&st.limit_milli), "{}", st.limit_milli);
    // Still queued at the cut and halved with it: the limit is the cut.
    let (i, st) = until_refresh(&a, with_baseline(&a, 100), 80);
    let st = run(&a, st, [used(i, 500, 40), used(i + 1, 500, 40)]);
    assert_eq!(
        (st.last_move, st.limit(&a), st.baseline_ns),
        (Move::Gradient, 37, 20 * MS)
    );
}

#[test]
fn a_refresh_during_a_step_keeps_the_steps_result() {
    // A scheduled refresh starts at 100 in a healthy window (20 ms); during
    // it the upstream slows: at the cut (50) the p95 is 30 ms, worse than
    // before beyond the band. The limit does not come back: it is the floor
    // below 100 (75.25), the baseline stays.
    let p = policy(1000, "{}");
    let a = settings(&p);
    let st = State {
        next_refresh: 2,
        ..with_baseline(&a, 100)
    };
    let st = step(&a, 1, &st, &used(2, 500, 20));
    assert_eq!((st.phase, st.refresh_on_bad), (Phase::Draining, false));
    let st = run(&a, st, [used(3, 500, 30), used(4, 500, 30)]);
    assert_eq!(
        (st.last_move, st.limit_milli, st.baseline_ns),
        (Move::Gradient, 75_250, 20 * MS)
    );
    // A healthy refresh gives the limit back and averages the baseline.
    let st = State {
        next_refresh: 2,
        ..with_baseline(&a, 100)
    };
    let st = run(&a, st, [used(2, 500, 20), used(3, 500, 21), used(4, 500, 21)]);
    assert_eq!(
        (st.last_move, st.limit(&a), st.baseline_ns),
        (Move::Measured, 100, 20_500_000)
    );
    // A refresh never starts in a bad window (it would measure a queue).
    let st = State {
        next_refresh: 2,
        ..with_baseline(&a, 100)
    };
    assert_eq!(step(&a, 1, &st, &used(2, 500, 40)).last_move, Move::Gradient);
}

#[test]
fn at_min_an_unhealthy_window_measures_the_baseline_again_for_free() {
    // At min (5 with 4 reserved), the windows 10 % over a baseline too
    // low: the experiment at once, with no cut (the cap stays 5); flat and
    // unhealthy, the two windows' mean replaces the baseline, with fewer
    // than MIN_BASELINE_SAMPLES.
    let p = policy(64, r#"{"min": 5}"#);
    let a = settings(&p);
    let st = State {
        limit_milli: 5_000,
        ..with_baseline(&a, 5)
    };
    let st = step(&a, 1, &st, &used(2, 80, 22));
    assert_eq!((st.phase, st.cap(&a)), (Phase::Draining, 5));
    let st = run(&a, st, [used(3, 80, 22), used(4, 80, 22)]);
    assert_eq!((st.last_move, st.baseline_ns), (Move::Measured, 22 * MS));
    // Now healthy: up by the gradient, a slot a window at least.
    let up = step(&a, 1, &st, &used(5, 80, 22));
    assert_eq!((up.last_move, up.limit(&a)), (Move::Increase, 6));
}

#[test]
fn errors_back_off_and_the_limit_comes_back_to_where_they_started() {
    let p = policy(1000, "{}");
    let a = settings(&p);
    let mut errs = used(2, 500, 20);
    errs.errors = 500;
    errs.successes = 0;
    let st = run(
        &a,
        with_baseline(&a, 100),
        (2..12).map(|i| WindowSummary { index: i, ..errs }),
    );
    assert_eq!((st.last_move, st.recover_milli), (Move::ErrorBackoff, 100_000));
    assert!(st.limit(&a) <= 11, "{}", st.limit(&a));
    // Healthy again: by max_increase (25 %, at least a slot) a window, to
    // 100 in 10 windows; then by the gradient.
    let mut limits = Vec::new();
    let mut st = st;
    for i in 12..30 {
        st = step(&a, 1, &st, &used(i, 500, 20));
        limits.push(st.limit(&a));
    }
    for pair in limits.windows(2) {
        assert!(pair[1] <= pair[0] + (pair[0] / 4).max(1) + 1, "{limits:?}");
    }
    assert_eq!(limits.iter().position(|&l| l == 100), Some(9), "{limits:?}");
    assert_eq!(st.recover_milli, 0);
}

#[test]
fn the_dead_zone_tries_one_slot_more_after_probe_windows() {
    // 21 ms over a 20 ms baseline: the dead zone. Held, then one slot
    // more every PROBE_WINDOWS windows while the limit is used.
    let p = policy(1000, "{}");
    let a = settings(&p);
    let st = run(
        &a,
        with_baseline(&a, 100),
        (2..2 + u64::from(PROBE_WINDOWS)).map(|i| used(i, 500, 21)),
    );
    assert_eq!((st.last_move, st.limit(&a)), (Move::Probe, 101));
    // Unused, it holds.
    let idle = run(
        &a,
        with_baseline(&a, 100),
        (2..40).map(|i| summary(i, 500, 21, 10)),
    );
    assert_eq!((idle.last_move, idle.limit(&a)), (Move::Held, 100));
}

#[test]
fn measured_noise_widens_the_thresholds() {
    // 6 % over the baseline: bad when the p95 is quiet (noise 0), held in
    // the dead zone when windows at one limit have differed by 12 % on
    // average (σ ≈ 10.6 %: ε = 5.3 %).
    let p = policy(1000, "{}");
    let a = settings(&p);
    let quiet = step(&a, 1, &with_baseline(&a, 100), &used(2, 500, 22));
    assert_eq!(quiet.last_move, Move::Gradient);
    let noisy = State {
        noise_ppm: 120_000,
        ..with_baseline(&a, 100)
    };
    assert_eq!(step(&a, 1, &noisy, &used(2, 500, 22)).last_move, Move::Held);
    // Two windows at one limit feed the measure; a step's jump is capped.
    let st = run(
        &a,
        with_baseline(&a, 100),
        [summary(2, 500, 21, 10), summary(3, 500, 42, 10)],
    );
    assert_eq!(st.noise_ppm, (NOISE_SAMPLE_CAP * f64::from(PPM) / 8.0) as u32);
}

#[test]
fn below_the_measurable_level_a_healthy_used_window_probes_a_slot() {
    // 200 ms answers and 500 ms windows: a window holds 20 completions
    // from 8 in flight. At 5 it has 12: too few to judge latency, yet
    // healthy and refused: one slot more (the controller never stays
    // blind at a limit it set).
    let p = policy(64, r#"{"min": 5}"#);
    let a = settings(&p);
    let st = State {
        limit_milli: 5_000,
        baseline_ns: 200 * MS,
        ..with_baseline(&a, 5)
    };
    let st = step(&a, 1, &st, &used(2, 12, 200));
    assert_eq!((st.last_move, st.limit(&a)), (Move::Probe, 6));
    // Latency well over the baseline: held.
    assert_eq!(step(&a, 1, &st, &used(3, 12, 400)).last_move, Move::Idle);
}

#[test]
fn a_version_1_control_record_still_decodes() {
    // The layout before #26: version 1, no noise, anchor, recovery level or
    // refresh window; it keeps its limit and baseline.
    let p = policy(100, "{}");
    let a = settings(&p);
    let mut v1 = vec![1u8];
    for v in [42_000u64, 20 * MS, 77, 10] {
        v1.extend_from_slice(&v.to_le_bytes());
    }
    v1.extend_from_slice(&[0, 0]);
    v1.extend_from_slice(&3u32.to_le_bytes());
    v1.extend_from_slice(&950_000u32.to_le_bytes());
    v1.push(Move::Held as u8);
    for v in [500u32, 0, 40] {
        v1.extend_from_slice(&v.to_le_bytes());
    }
    for v in [25 * MS, MS, 0u64] {
        v1.extend_from_slice(&v.to_le_bytes());
    }
    let record = Record {
        name_hash: CONTROL_NAME_HASH,
        kind: kind::CONTROL,
        p1: 0,
        p2: 0,
        state: &v1,
    };
    let st = State::decode(&record);
    assert!(
        st.is_some_and(|s| s.limit(&a) == 42 && s.baseline_ns == 20 * MS && s.anchor_milli == 0),
        "{st:?}"
    );
    // And the current layout round-trips.
    let now = State {
        noise_ppm: 7,
        anchor_milli: 9,
        recover_milli: 11,
        refresh_p95_ns: 13,
        refresh_samples: 15,
        refresh_on_bad: true,
        held_windows: 3,
        ..with_baseline(&a, 50)
    };
    let mut out = Vec::new();
    now.encode(&mut out);
    let record = Record {
        state: &out,
        ..record
    };
    assert_eq!(State::decode(&record), Some(now));
}

#[test]
fn a_refresh_cuts_no_lower_than_its_window_can_measure() {
    // 200 ms answers, 500 ms windows: 40 completions need 16 in flight.
    let p = policy(1000, "{}");
    let a = settings(&p);
    let refreshing = |limit: u32| State {
        phase: Phase::Measuring,
        baseline_ns: 200 * MS,
        ..with_baseline(&a, limit)
    };
    assert_eq!(refreshing(40).cap(&a), 20);
    assert_eq!(refreshing(20).cap(&a), 16);
    assert_eq!(refreshing(12).cap(&a), 12);
    // A cut that measured nothing (fewer than MIN_SAMPLES) gives the limit
    // back and moves the anchor to it: the next bad window is no floor's.
    let st = State {
        anchor_milli: 30_000,
        ..refreshing(20)
    };
    let st = step(&a, 1, &st, &used(2, MIN_SAMPLES - 1, 300));
    assert_eq!(
        (st.last_move, st.limit(&a), st.anchor_milli),
        (Move::Idle, 20, 20_000)
    );
}
