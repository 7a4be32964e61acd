//! Workers whose clock readings are stale (issue 31): the invariant of
//! [`crate::limiter::algo::reading`] through the shipped engine and
//! `table::update`, on seeded random schedules.
//!
//! A worker reads `now`, then waits (for a core, when Envoy runs more
//! workers than it has cores; for a lost compare-and-swap): by the time
//! its update runs, other workers have written the key at later instants.
//! Each event here is one such update: it really happens at `t` (the
//! order of the events), charges with a reading up to `lag` older, and
//! some lose their first compare-and-swaps (forced conflicts) and retry
//! with the same stale reading. **THE BOUND checked**, over every
//! interval of every run, in real time: what the limit alone admits over
//! the interval stretched by `lag` (an admission is charged at an instant
//! it lived through, at most `lag` before it happened). Before the fix, a
//! denial at a stale reading persisted a saturated state and forgave the
//! units between the stale and the real clock, so the excess grew with
//! the interval's length.

use super::reload::{limit_policy, max_in, Spec};
use super::*;

const MS: u64 = 1_000_000;
const MIN: u64 = 60 * S;

/// What one schedule charged: every admission's real instant, in order.
struct Schedule {
    admitted: Vec<u64>,
    span: u64,
}

/// `workers` workers flood one key on `policy`: `events` updates, the
/// clock advancing 0–`step` ns between them, each reading up to `lag` ns
/// stale (0: fresh), a quarter of them losing 1–3 compare-and-swaps first.
fn schedule(policy: &Policy, workers: usize, events: u64, step: u64, lag: u64, seed: u64) -> Schedule {
    let store = SharedStore::new();
    let hosts: Vec<MemoryHost> = (0..workers).map(|_| req(&store, "api", "acme")).collect();
    let mut rng = crate::admission::splitmix64(seed);
    let mut next = |n: u64| {
        rng = crate::admission::splitmix64(rng);
        rng % n.max(1)
    };
    let mut scratch: Vec<Scratch> = (0..workers).map(|_| Scratch::default()).collect();
    let mut t = T0;
    let mut admitted = Vec::new();
    for _ in 0..events {
        t += next(step + 1);
        let w = usize::try_from(next(workers as u64)).unwrap_or(0);
        let reading = t - next(lag + 1);
        if next(4) == 0 {
            *hosts[w].forced_conflicts.borrow_mut() = 1 + u32::try_from(next(3)).unwrap_or(0);
        }
        if decide(policy, &hosts[w], reading, &mut scratch[w]).reason == Reason::Allowed {
            admitted.push(t);
        }
    }
    Schedule {
        admitted,
        span: t - T0,
    }
}

/// The worst excess over `spec`'s bound stretched by `lag`, over every
/// interval length in `lengths` and the whole run (≤ 0: within).
fn worst_excess(spec: Spec, sched: &Schedule, lag: u64, lengths: &[u64]) -> i64 {
    lengths
        .iter()
        .chain([sched.span + 1].iter())
        .map(|&d| max_in(&sched.admitted, d) as i64 - spec.alone(d + lag) as i64)
        .max()
        .unwrap_or(0)
}

#[test]
fn stale_readings_never_admit_more_than_the_limit_over_any_interval() {
    // The key (1,000/s, burst 80), users' sizes (100/min burst 20,
    // 10,000/min burst 200) and the window algorithms; 2 to 8 workers;
    // readings up to 20 ms stale; 1,600 schedules.
    let specs = [
        (
            Spec::Bucket {
                rate: 1000,
                per: S,
                burst: 80,
            },
            400_000,
        ),
        (
            Spec::Bucket {
                rate: 100,
                per: MIN,
                burst: 20,
            },
            1_500 * MS,
        ),
        (
            Spec::Bucket {
                rate: 10_000,
                per: MIN,
                burst: 200,
            },
            20 * MS,
        ),
        (
            Spec::Window {
                algorithm: "fixed_window",
                rate: 100,
                per: S,
            },
            5 * MS,
        ),
        (
            Spec::Window {
                algorithm: "sliding_window_counter",
                rate: 100,
                per: S,
            },
            5 * MS,
        ),
    ];
    let lag = 20 * MS;
    let mut schedules = 0;
    for (i, (spec, step)) in specs.iter().enumerate() {
        let policy = limit_policy("s-1", &spec.json(), T0 - MIN);
        let lengths = [MS, 10 * MS, 100 * MS, S, 10 * S, 60 * S];
        for workers in [2, 3, 4, 8] {
            for seed in 0..80 {
                let sched = schedule(&policy, workers, 400, *step, lag, seed * 31 + i as u64);
                let excess = worst_excess(*spec, &sched, lag, &lengths);
                assert!(
                    excess <= 0,
                    "{spec:?}, {workers} workers, seed {seed}: {excess} over the bound"
                );
                schedules += 1;
            }
        }
    }
    assert_eq!(schedules, 1_600);
}

#[test]
fn a_long_flood_at_stale_readings_gains_nothing_with_the_interval() {
    // The measurement, natively: a never-leased key at 1,000/s
    // burst 80 flooded for 60 s by four workers whose readings are up to
    // 5 ms stale. Before the fix the excess grew with the interval (38 units
    // at 60 s in a real Envoy); now the whole minute admits at most
    // burst + rate × (60 s + lag).
    let spec = Spec::Bucket {
        rate: 1000,
        per: S,
        burst: 80,
    };
    let policy = limit_policy("s-2", &spec.json(), T0 - MIN);
    let lag = 5 * MS;
    let sched = schedule(&policy, 4, 120_000, MS, lag, 7);
    assert!(sched.span >= 59 * S, "{} s", sched.span / S);
    let excess = worst_excess(spec, &sched, lag, &[100 * MS, S, 10 * S, 30 * S]);
    assert!(excess <= 0, "{excess} over the bound");
    // And it is not starved: the flood gets the rate.
    let rate_admitted = spec.alone(sched.span) as i64 - 80 - max_in(&sched.admitted, sched.span + 1) as i64;
    assert!(rate_admitted <= 10, "{rate_admitted} units short of the rate");
}

#[test]
fn a_fresh_reading_is_exact_and_a_clock_step_back_still_saturates() {
    // With no lag the bound is the limiter's own, exactly; a reading more
    // than MAX_STALE_NS behind the record's write is a clock step back:
    // at most one refill forgiven, as before (never blocked for the step).
    let spec = Spec::Bucket {
        rate: 10,
        per: S,
        burst: 5,
    };
    let policy = limit_policy("s-3", &spec.json(), T0 - MIN);
    let sched = schedule(&policy, 4, 2_000, 30 * MS, 0, 3);
    assert!(worst_excess(spec, &sched, 0, &[100 * MS, S, 10 * S]) <= 0);
    let store = SharedStore::new();
    let h = req(&store, "api", "acme");
    assert_eq!(admitted(&policy, &h, T0, 10), 5);
    // 500 ms stale: read at the write, so still empty.
    assert_eq!(run(&policy, &h, T0 - 500 * MS).reason, Reason::RateLimited);
    assert_eq!(run(&policy, &h, T0 + 99 * MS).reason, Reason::RateLimited);
    assert_eq!(run(&policy, &h, T0 + 100 * MS).reason, Reason::Allowed);
    // An hour back: saturated, one token 100 ms after the step.
    let back = T0 - 3600 * S;
    assert_eq!(run(&policy, &h, back).reason, Reason::RateLimited);
    assert_eq!(run(&policy, &h, back + 100 * MS).reason, Reason::Allowed);
}
