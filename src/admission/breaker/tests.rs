//! The breaker on explicit time: the state machine on an exact sequence,
//! the ramp's curve, the re-open backoff, the bounds on upstream calls
//! (through the shipped admission path over the in-memory host), and
//! adversarial inputs.

use std::cell::RefCell;
use std::rc::Rc;

use super::*;
use crate::admission::Worker;
use crate::engine::{self, Reason};
use crate::host::Host;
use crate::limiter::NANOS_PER_SEC;
use crate::memory::{MemoryHost, SharedStore};
use crate::policy::Policy;
use crate::table;

const S: u64 = NANOS_PER_SEC;
const MS: u64 = 1_000_000;
const T0: u64 = 1_796_000_000 * S;

/// 50 %, volume 10, 1 s windows, open 1 s doubling to 8 s, 2 probes,
/// a 10 s ramp from 10 %.
fn settings() -> BreakerSettings {
    BreakerSettings {
        error_permille: 500,
        min_volume: 10,
        window_ns: S,
        open_for_ns: S,
        max_open_for_ns: 8 * S,
        probes: 2,
        ramp_ns: 10 * S,
        ramp_floor_permille: 100,
    }
}

fn fresh(now: u64) -> Breaker {
    Breaker {
        window_start: now,
        ..Breaker::default()
    }
}

fn seen(completed: u64, failures: u64) -> Observed {
    Observed { completed, failures }
}

fn phases(t: Transitions) -> Vec<(Phase, Phase)> {
    t.iter().map(|t| (t.from, t.to)).collect()
}

#[test]
fn every_transition_on_an_exact_failure_sequence() {
    use Phase::*;
    let s = settings();
    let mut b = fresh(T0);
    // 9 failures: under the minimum volume, stays closed.
    assert!(phases(b.observe(&s, seen(9, 9), T0 + 100 * MS, 1)).is_empty());
    assert_eq!(b.gate(&s, T0 + 100 * MS), Gate::Free);
    // The 10th completion, a success: 9/10 = 90 % ≥ 50 % over volume 10: opens.
    let t1 = T0 + 200 * MS;
    assert_eq!(phases(b.observe(&s, seen(1, 0), t1, 1)), [(Closed, Open)]);
    assert_eq!(b.reopens, 0);
    let wait = b.until - t1;
    assert!((800 * MS..=S).contains(&wait), "{wait}");
    assert_eq!(
        b.gate(&s, t1),
        Gate::Open {
            half_open_at: b.until
        }
    );
    assert_eq!(
        b.gate(&s, b.until - 1),
        Gate::Open {
            half_open_at: b.until
        }
    );
    // Stream ends while open (admitted before) are ignored.
    assert!(phases(b.observe(&s, seen(100, 100), t1 + 10 * MS, 1)).is_empty());
    assert_eq!(b.window, Observed::default());
    // Half-open at `until`: two probe tickets, then none.
    let t2 = b.until;
    assert_eq!(b.gate(&s, t2), Gate::Probe { probes: 2, left: 2 });
    assert_eq!(
        b.advance(&s, t2),
        Some(Transition {
            from: Open,
            to: HalfOpen
        })
    );
    assert!(b.take_probe(&s, t2));
    assert!(b.take_probe(&s, t2));
    assert!(!b.take_probe(&s, t2 + MS));
    assert_eq!(b.gate(&s, t2 + MS), Gate::Probe { probes: 2, left: 0 });
    // One probe fails: re-opens, longer (1 re-open: 2 s, jittered).
    let t3 = t2 + 50 * MS;
    assert_eq!(phases(b.observe(&s, seen(1, 1), t3, 2)), [(HalfOpen, Open)]);
    assert_eq!(b.reopens, 1);
    assert!((1600 * MS..=2 * S).contains(&(b.until - t3)));
    // Half-open again; both probes succeed: slow start.
    let t4 = b.until;
    // (Taking a probe makes the time-based transition itself.)
    assert!(b.take_probe(&s, t4));
    assert_eq!(b.phase, HalfOpen);
    assert!(b.take_probe(&s, t4));
    assert!(phases(b.observe(&s, seen(1, 0), t4 + 10 * MS, 3)).is_empty());
    assert_eq!(
        phases(b.observe(&s, seen(1, 0), t4 + 20 * MS, 3)),
        [(HalfOpen, Ramping)]
    );
    let t5 = t4 + 20 * MS;
    assert_eq!(b.gate(&s, t5), Gate::Ramp { permille: 100 });
    assert_eq!(b.gate(&s, t5 + 5 * S), Gate::Ramp { permille: 550 });
    // A failure over the threshold during the ramp re-opens, longer still
    // (volume at 55 %: max(probes, 10 · 0.55) = 5).
    let mut failing = b;
    // (The first fold ends the ramp's first window: its counts reset.)
    assert!(phases(failing.observe(&s, seen(4, 4), t5 + 5 * S, 4)).is_empty());
    assert_eq!(failing.window, Observed::default());
    assert!(phases(failing.observe(&s, seen(4, 4), t5 + 5 * S + MS, 4)).is_empty());
    let t6 = t5 + 5 * S + 2 * MS;
    assert_eq!(phases(failing.observe(&s, seen(1, 1), t6, 4)), [(Ramping, Open)]);
    assert_eq!(failing.reopens, 2);
    assert!((3200 * MS..=4 * S).contains(&(failing.until - t6)));
    // Healthy through the ramp: closed at its end, the backoff forgotten.
    assert!(phases(b.observe(&s, seen(50, 1), t5 + 5 * S, 4)).is_empty());
    assert_eq!(b.gate(&s, t5 + 10 * S), Gate::Free);
    assert_eq!(
        phases(b.observe(&s, seen(0, 0), t5 + 10 * S, 4)),
        [(Ramping, Closed)]
    );
    assert_eq!((b.phase, b.reopens), (Closed, 0));
    // Closed again: a window under the rate never opens, however large.
    assert!(phases(b.observe(&s, seen(1000, 499), t5 + 10 * S + MS, 5)).is_empty());
    // A window's counts reset at its end.
    assert!(phases(b.observe(&s, seen(0, 0), t5 + 12 * S, 5)).is_empty());
    assert_eq!(b.window, Observed::default());
    assert!(phases(b.observe(&s, seen(9, 9), t5 + 12 * S + MS, 5)).is_empty());
}

#[test]
fn a_half_open_window_with_a_success_and_no_trip_ramps_at_its_end() {
    let s = settings();
    let mut b = fresh(T0);
    b.observe(&s, seen(10, 10), T0, 1);
    let half = b.until;
    b.advance(&s, half);
    assert!(b.take_probe(&s, half));
    // One probe of two answered, a success; the other never reports.
    assert!(phases(b.observe(&s, seen(1, 0), half + 10 * MS, 1)).is_empty());
    assert_eq!(
        phases(b.observe(&s, seen(0, 0), half + S, 1)),
        [(Phase::HalfOpen, Phase::Ramping)]
    );
}

#[test]
fn lost_probes_end_their_period_after_two_folds_without_an_answer_since_the_last_ticket() {
    use Phase::*;
    let s = settings();
    let mut b = fresh(T0);
    b.observe(&s, seen(10, 10), T0, 1);
    let half = b.until;
    assert!(b.take_probe(&s, half));
    let period = b.since;
    // One fold without an answer (the window open when the probe was taken
    // may close before its answer): the period goes on.
    assert!(phases(b.observe(&s, seen(0, 0), half + 20 * MS, 1)).is_empty());
    // A ticket taken restarts the count: one more fold is not enough.
    assert!(b.take_probe(&s, half + 25 * MS));
    assert!(phases(b.observe(&s, seen(0, 0), half + 30 * MS, 1)).is_empty());
    assert!(
        !b.take_probe(&s, half + 30 * MS),
        "the period's tickets are spent"
    );
    // However long the period: no ticket comes back by time alone.
    assert!(!b.take_probe(&s, half + 10 * S));
    // Two folds in a row without an answer since the last ticket: the
    // probes are lost and a new period begins, with its own tickets; the
    // old period's tickets are never handed out again.
    assert_eq!(
        phases(b.observe(&s, seen(0, 0), half + 40 * MS, 1)),
        [(HalfOpen, HalfOpen)]
    );
    assert_ne!(b.since, period);
    assert!(b.take_probe(&s, half + 40 * MS));
    assert!(b.take_probe(&s, half + 40 * MS));
    assert!(!b.take_probe(&s, half + 40 * MS));
    // A half-open period nobody took a ticket in is not lost.
    let mut idle = fresh(T0);
    idle.observe(&s, seen(10, 10), T0, 1);
    let at = idle.until;
    idle.advance(&s, at);
    for i in 1..=5 {
        assert!(phases(idle.observe(&s, seen(0, 0), at + i * 100 * MS, 1)).is_empty());
    }
}

#[test]
fn a_ticket_given_back_is_taken_again_only_in_its_own_period() {
    use Phase::*;
    let s = settings();
    let mut b = fresh(T0);
    b.observe(&s, seen(10, 10), T0, 1);
    let half = b.until;
    assert!(b.take_probe(&s, half));
    assert!(b.take_probe(&s, half));
    let period = b.since;
    // A request refused after its ticket gives it back: another takes it.
    assert!(b.give_back(period));
    assert!(b.take_probe(&s, half + MS));
    assert!(!b.take_probe(&s, half + MS));
    // Never below zero, never into another period.
    assert!(b.give_back(period));
    assert!(b.give_back(period));
    assert!(!b.give_back(period));
    assert!(!b.give_back(period + 1));
    // Once the period is over (a probe failed), a late give-back does nothing.
    assert!(b.take_probe(&s, half + 2 * MS));
    assert_eq!(
        phases(b.observe(&s, seen(1, 1), half + 10 * MS, 1)),
        [(HalfOpen, Open)]
    );
    let reopened = b;
    assert!(!b.give_back(period));
    assert_eq!(b, reopened);
}

#[test]
fn the_ramp_follows_its_line_within_ten_percent() {
    let s = settings();
    let since = T0;
    for target in [10u32, 100, 1000] {
        let mut last = 0;
        for step in 0..=100u64 {
            let now = since + step * s.ramp_ns / 100;
            let b = Breaker {
                phase: Phase::Ramping,
                since,
                window_start: since,
                ..Breaker::default()
            };
            let cap = b.gate(&s, now).cap(target);
            // The stated line: 10 % + 90 % · t / ramp of the target.
            let expected = f64::from(target) * (0.1 + 0.9 * step as f64 / 100.0);
            let err = (f64::from(cap) - expected).abs() / expected;
            // Rounding up to whole requests: within 10 %, or one request
            // at a small target.
            assert!(
                err <= 0.10 || (f64::from(cap) - expected).abs() <= 1.0,
                "target {target} at {step}%: cap {cap}, expected {expected:.1}"
            );
            assert!(cap >= last, "the ramp never falls");
            assert!(cap >= 1);
            last = cap;
        }
        assert_eq!(last, target);
    }
    // Not one step: at a 100 target, the cap takes many distinct values.
    let b = Breaker {
        phase: Phase::Ramping,
        since,
        ..Breaker::default()
    };
    let mut levels: Vec<u32> = (0..=20u64)
        .map(|i| b.gate(&s, since + i * s.ramp_ns / 20).cap(100))
        .collect();
    levels.dedup();
    assert!(levels.len() >= 19, "{levels:?}");
    assert_eq!(ramp_permille(&s, since, since + s.ramp_ns / 2), 550);
}

#[test]
fn each_re_open_waits_longer_up_to_max_open_for() {
    let s = settings();
    // The stated bound: min(8 s, 1 s · 2^k).
    let bounds: Vec<u64> = (0..6).map(|k| open_wait_ns(&s, k)).collect();
    assert_eq!(bounds, [S, 2 * S, 4 * S, 8 * S, 8 * S, 8 * S]);
    assert_eq!(open_wait_ns(&s, u32::MAX), 8 * S);
    for seed in 0..200u64 {
        let mut b = fresh(T0);
        let mut now = T0;
        b.observe(&s, seen(10, 10), now, seed);
        let mut waits = vec![b.until - now];
        for k in 1..6u32 {
            now = b.until;
            b.advance(&s, now);
            assert!(b.take_probe(&s, now));
            b.observe(
                &s,
                seen(1, 1),
                now,
                seed.wrapping_mul(31).wrapping_add(u64::from(k)),
            );
            assert_eq!((b.phase, b.reopens), (Phase::Open, k));
            waits.push(b.until - now);
        }
        for (k, w) in waits.iter().enumerate() {
            let bound = open_wait_ns(&s, k as u32);
            assert!(*w <= bound && *w >= bound - bound / 5, "k {k}: {w}");
        }
        // Strictly longer at every re-open until the cap.
        assert!(waits[0] < waits[1] && waits[1] < waits[2] && waits[2] < waits[3]);
    }
    // Jittered: open periods differ between seeds.
    let until = |seed| {
        let mut b = fresh(T0);
        b.observe(&s, seen(10, 10), T0, seed);
        b.until
    };
    let distinct: std::collections::BTreeSet<u64> = (0..20).map(until).collect();
    assert!(distinct.len() >= 15);
}

#[test]
fn adversarial_counts_and_empty_windows() {
    let s = settings();
    let mut b = fresh(T0);
    // A window with no volume never trips, even with "failures".
    assert!(!seen(0, 0).trips(0, 1));
    assert!(!seen(0, 5).trips(0, 1));
    assert!(phases(b.observe(&s, seen(0, 0), T0 + S, 1)).is_empty());
    assert!(phases(b.observe(&s, seen(0, u64::MAX), T0 + S, 1)).is_empty());
    // u64 counts: exact, no overflow; failures above completed count as completed.
    assert!(seen(u64::MAX, u64::MAX).trips(u64::MAX, 1000));
    assert!(seen(u64::MAX, u64::MAX / 2 + 1).trips(1, 500));
    assert!(!seen(u64::MAX, u64::MAX / 2 - 1).trips(1, 500));
    let mut big = fresh(T0);
    big.observe(&s, seen(u64::MAX, 0), T0, 1);
    big.observe(&s, seen(u64::MAX, u64::MAX), T0, 1);
    // Saturated at MAX completed, MAX failures: 100 %, opens, no overflow.
    assert_eq!(big.phase, Phase::Open);
    // Settings at their extremes: 1000 re-opens, a 1 h max.
    let extreme = BreakerSettings {
        max_open_for_ns: 3600 * S,
        ..s
    };
    let mut e = fresh(T0);
    e.reopens = u32::MAX - 1;
    e.phase = Phase::HalfOpen;
    e.observe(&extreme, seen(1, 1), T0, 9);
    assert!(e.until - T0 <= 3600 * S);
    assert_eq!(e.reopens, u32::MAX);
    e.phase = Phase::HalfOpen;
    e.observe(&extreme, seen(1, 1), T0, 9);
    assert_eq!(e.reopens, u32::MAX);
}

#[test]
fn a_clock_that_jumps_never_holds_it_open_past_max_open_for_nor_skips_the_probes() {
    let s = settings();
    let mut b = fresh(T0);
    b.observe(&s, seen(10, 10), T0, 1);
    // Backwards by an hour: still at most max_open_for from now.
    let back = T0 - 3600 * S;
    match b.gate(&s, back) {
        Gate::Open { half_open_at } => assert!(half_open_at - back <= s.max_open_for_ns),
        other => panic!("{other:?}"),
    }
    b.advance(&s, back);
    assert!(b.until - back <= s.max_open_for_ns);
    assert!(b.window_start <= back);
    // Forwards by a day: half-open, and still only `probes` tickets.
    let ahead = T0 + 86_400 * S;
    assert_eq!(b.gate(&s, ahead), Gate::Probe { probes: 2, left: 2 });
    let taken = (0..100).filter(|_| b.take_probe(&s, ahead)).count();
    assert_eq!(taken, 2);
    // A ramp whose start is in the future (clock went back): at the floor,
    // re-anchored at the next fold, never stuck.
    let mut r = Breaker {
        phase: Phase::Ramping,
        since: T0,
        window_start: T0,
        ..Breaker::default()
    };
    assert_eq!(r.gate(&s, T0 - 100 * S), Gate::Ramp { permille: 100 });
    r.observe(&s, seen(0, 0), T0 - 100 * S, 1);
    assert_eq!(r.since, T0 - 100 * S);
    assert_eq!(r.gate(&s, T0 - 90 * S), Gate::Free);
}

#[test]
fn the_record_round_trips_and_garbage_reads_as_closed() {
    let b = Breaker {
        phase: Phase::Ramping,
        since: 1,
        until: 2,
        reopens: 3,
        window_start: 4,
        window: seen(5, 6),
        probes_taken: 7,
        empty_folds: 1,
    };
    let mut out = Vec::new();
    encode(&b, &mut out);
    assert_eq!(out.len(), ENCODED_LEN);
    assert_eq!(decode(&out), Some(b));
    assert_eq!(decode(&out[1..]), None);
    let mut bad_phase = out.clone();
    bad_phase[1] = 9;
    assert_eq!(decode(&bad_phase), None);
    let mut bad_version = out;
    bad_version[0] = 2;
    assert_eq!(decode(&bad_version), None);
    // An unreadable entry in shared data: a fresh, closed breaker.
    let store = SharedStore::new();
    let host = MemoryHost::new(store.clone());
    host.shared_set("tg2|b|db", b"garbage", None).unwrap();
    assert_eq!(read(&host, "tg2|b|db", T0), Some(fresh(T0)));
}

/// `db`: 20 slots (2 reserved for critical), a breaker with `settings()`.
fn policy(extra: &str) -> Rc<Policy> {
    let json = format!(
        r#"{{
        "version": "brk-1",
        "identity": {{"header": "x-tenant-id"}},
        "plans": {{"free": {{"limits": [{{"rate": 1000000, "per": "1s"}}]}}}},
        "default_plan": "free",
        "anonymous": {{"plan": "free"}},
        "dependencies": {{
            "db": {{"max_in_flight": 20, "reserved": {{"critical": 2}},
                    "circuit_breaker": {{"error_rate": 0.5, "min_volume": 10, "window": "1s", "open_for": "1s",
                                        "max_open_for": "8s", "probes": 2, "ramp": "10s", "ramp_floor": 0.1}}
                    {extra}}}
        }},
        "routes": {{
            "orders": {{"dependency": "db"}},
            "pay": {{"criticality": "critical", "dependency": "db"}}
        }},
        "default_route": "orders"
    }}"#
    );
    match Policy::from_json(json.as_bytes()) {
        Ok(p) => Rc::new(p),
        Err(e) => panic!("test policy invalid: {e}"),
    }
}

/// A node of `workers` worker VMs over one shared store, each with its
/// own copy of the breaker (its `Control`), read on its tick.
struct Node {
    store: Rc<RefCell<SharedStore>>,
    workers: Vec<Worker>,
    policy: Rc<Policy>,
}

impl Node {
    fn new(workers: u64, policy: Rc<Policy>) -> Node {
        Node {
            store: SharedStore::new(),
            workers: (1..=workers).map(Worker::with_id).collect(),
            policy,
        }
    }

    fn host(&self, class: &str) -> MemoryHost {
        MemoryHost::new(self.store.clone())
            .route_class(class)
            .header("x-tenant-id", "acme")
    }

    /// Every worker's tick: fold its part (as the worker closing a signal
    /// window does with the window's summary), then read the node's state.
    fn tick(&mut self, parts: &[Observed], now: u64) -> Vec<Transition> {
        let host = MemoryHost::new(self.store.clone());
        let dep = self.policy.dependency(0).unwrap().clone();
        let s = dep.breaker.unwrap();
        let mut made = Vec::new();
        let mut buffers = table::Buffers::default();
        for (i, w) in self.workers.iter_mut().enumerate() {
            let part = parts.get(i).copied().unwrap_or_default();
            let folded = fold(&host, &dep.breaker_key, &s, part, now, w.id() ^ now, &mut buffers).unwrap();
            made.extend(folded.transitions.iter());
            w.renew(&host, now);
            let b = read(&host, &dep.breaker_key, now);
            w.update_control(&dep.key, |c| c.breaker = b);
        }
        made
    }

    /// One request on worker `i`: its ticket, or the refusal's reason and Retry-After.
    fn request(
        &mut self,
        i: usize,
        class: &str,
        now: u64,
    ) -> Result<crate::admission::Ticket, (Reason, u64)> {
        let host = self.host(class);
        let prep = engine::prepare(&self.policy, &host).unwrap();
        let policy = self.policy.clone();
        match self.workers[i].acquire(&host, &policy, &prep.class, &prep.subject, now) {
            Ok(Some(t)) => Ok(t),
            Ok(None) => panic!("no dependency"),
            Err(r) => Err((r.reason, r.retry_after_secs)),
        }
    }

    fn release(&mut self, i: usize, t: crate::admission::Ticket, now: u64) {
        let host = MemoryHost::new(self.store.clone());
        self.workers[i].release(&host, t, now);
    }
}

#[test]
fn no_upstream_call_while_open_and_at_most_probes_while_half_open_node_wide() {
    let mut node = Node::new(4, policy(""));
    let mut now = T0;
    node.tick(&[], now);
    // 100 % failures: 3 workers × 4 completions ≥ 10: opens at that tick.
    let made = node.tick(&[seen(4, 4), seen(4, 4), seen(4, 4)], now + 10 * MS);
    assert_eq!(
        made,
        [Transition {
            from: Phase::Closed,
            to: Phase::Open
        }]
    );
    now += 10 * MS;
    // Workers that read before the fold that tripped it see it on their
    // next tick (the copy is at most one tick stale).
    node.tick(&[], now);
    let copy = |w: &Worker| w.control("tg2|d|db").breaker;
    let b = copy(&node.workers[0]).unwrap();
    assert!(node.workers.iter().all(|w| copy(w) == Some(b)));
    assert_eq!(b.phase, Phase::Open);
    // Open: every request on every worker refused, with a Retry-After that
    // is never earlier than half-open.
    let mut calls = 0;
    while now < b.until {
        for i in 0..4 {
            match node.request(i, "orders", now) {
                Ok(_) => calls += 1,
                Err((reason, secs)) => {
                    assert_eq!(reason, Reason::CircuitOpen);
                    assert!(now + secs * S >= b.until, "Retry-After {secs} s too early");
                }
            }
        }
        now += 10 * MS;
        node.tick(&[], now);
    }
    assert_eq!(calls, 0, "upstream calls while open");
    // Half-open: 40 requests per worker per tick, none released (slow
    // probes): at most 2 node-wide in the window, the rest `circuit_probe_limit`.
    let mut admitted = Vec::new();
    let window_end = now + S;
    while now < window_end {
        for i in 0..4 {
            for _ in 0..10 {
                match node.request(i, "orders", now) {
                    Ok(t) => admitted.push((i, t)),
                    Err((reason, _)) => assert_eq!(
                        reason,
                        Reason::CircuitProbeLimit,
                        "worker {i} at {} ms: {:?}",
                        (now - T0) / MS,
                        node.workers[i].control("tg2|d|db")
                    ),
                }
            }
        }
        now += 10 * MS;
        node.tick(&[], now);
    }
    assert_eq!(admitted.len(), 2, "probes in a half-open window");
    // Both probes succeed: ramping at 10 % of 20 = 2 slots (the probes still hold them).
    let made = node.tick(&[seen(2, 0)], now);
    for (i, t) in admitted.drain(..) {
        node.release(i, t, now);
    }
    assert!(made.contains(&Transition {
        from: Phase::HalfOpen,
        to: Phase::Ramping
    }));
    let mut held = Vec::new();
    for _ in 0..10 {
        if let Ok(t) = node.request(1, "orders", now) {
            held.push(t);
        }
    }
    assert_eq!(held.len(), 2, "10 % of 20 at the ramp's start");
    // Half-way up the ramp (55 % of 20 = 11), critical still gets its
    // (scaled) reservation and the total stays under the cap.
    now += 5 * S;
    node.tick(&[], now);
    for _ in 0..20 {
        if let Ok(t) = node.request(2, "orders", now) {
            held.push(t);
        }
    }
    assert_eq!(
        held.len(),
        10,
        "normal: 11 less the scaled critical reservation (1)"
    );
    assert_eq!(
        node.request(0, "orders", now).map(|_| ()),
        Err((Reason::ConcurrencyLimit, 1))
    );
    let critical = node.request(3, "pay", now);
    assert!(critical.is_ok());
    assert_eq!(
        node.request(3, "pay", now).map(|_| ()),
        Err((Reason::ConcurrencyLimit, 1))
    );
}

#[test]
fn paused_refuses_at_once_and_takes_nothing() {
    let mut node = Node::new(1, policy(r#", "paused": true"#));
    node.tick(&[], T0);
    let keys_before: Vec<String> = node.store.borrow().keys().cloned().collect();
    assert_eq!(
        node.request(0, "orders", T0).map(|_| ()),
        Err((Reason::Paused, 1))
    );
    assert_eq!(node.request(0, "pay", T0).map(|_| ()), Err((Reason::Paused, 1)));
    assert_eq!(node.workers[0].places(), 0);
    let keys_after: Vec<String> = node.store.borrow().keys().cloned().collect();
    assert_eq!(keys_before, keys_after, "no slot written");
    // Unpaused by a reload: admitted.
    node.policy = policy("");
    assert!(node.request(0, "orders", T0).is_ok());
}

#[test]
fn the_effective_limit_is_the_least_of_the_controllers_and_the_breakers() {
    use crate::admission::{effective_limit, effective_limits, Control, Limits};
    let p = policy("");
    let db = p.dependency(0).unwrap();
    // No controller, breaker closed: the policy's limits, unchanged.
    assert_eq!(
        effective_limits(db, db.max_in_flight, &Gate::Free),
        Limits::of(db)
    );
    // The controller at 10 of 20: the reservation (2) stays, the pool is 8.
    let control = Control {
        limit: Some(10),
        breaker: None,
    };
    let at = effective_limits(db, effective_limit(db, &control), &Gate::Free);
    assert_eq!(
        (at.max_in_flight, at.reserved_critical, at.general(), at.capped),
        (10, 2, 8, false)
    );
    // Ramping at 50 % of the controller's 10: 5, the reservation scaled to 1.
    let ramp = effective_limits(db, 10, &Gate::Ramp { permille: 500 });
    assert_eq!(
        (
            ramp.max_in_flight,
            ramp.reserved_critical,
            ramp.general(),
            ramp.capped
        ),
        (5, 1, 4, true)
    );
    // Half-open: the probe count, whatever the controller says; no reservation
    // survives a cap of 2 (2 · 2 / 20 rounds down to 0).
    let probe = effective_limits(db, 20, &Gate::Probe { probes: 2, left: 2 });
    assert_eq!(
        (probe.max_in_flight, probe.reserved_critical, probe.general()),
        (2, 0, 2)
    );
    // The floor is at least one request.
    assert_eq!(
        effective_limits(db, 1, &Gate::Ramp { permille: 1 }).max_in_flight,
        1
    );
}

#[test]
fn a_failing_dependency_opens_at_the_first_fold_that_brings_min_volume_not_at_the_windows_close() {
    use crate::admission::window::{Outcome, OutcomeKind, Windows};
    let p = policy("");
    let dep = p.dependency(0).unwrap();
    // A breaker alone: signal windows of its window (1 s) up to 500 ms.
    assert_eq!(dep.signal_window_ns(), Some(500 * MS));
    let store = SharedStore::new();
    let host = MemoryHost::new(store.clone());
    let mut workers = [Worker::with_id(1), Worker::with_id(2)];
    let mut windows = [Windows::default(), Windows::default()];
    let mut buffers = table::Buffers::default();
    // Window-aligned start; 6 + 3 upstream errors: one short of min_volume.
    let start = (T0 / (500 * MS)) * (500 * MS);
    let error = Outcome {
        latency_ns: MS,
        kind: OutcomeKind::Error,
        in_flight: 1,
    };
    for (w, n) in windows.iter_mut().zip([6, 3]) {
        for k in 0..n {
            w.record(&dep.name, 500 * MS, error, start + k * MS);
        }
    }
    let mut tick_all = |windows: &mut [Windows; 2], now: u64| -> Vec<Ticked> {
        let mut all = Vec::new();
        for (w, win) in workers.iter_mut().zip(windows.iter_mut()) {
            all.extend(tick(&host, &p, w, win, &[], now, &mut buffers));
        }
        all
    };
    // Folded, 9 < 10: still closed.
    let t = tick_all(&mut windows, start + 10 * MS);
    assert!(t.iter().all(|t| t.transitions.iter().count() == 0));
    assert!(t
        .iter()
        .all(|t| t.breaker.map(|b| b.phase) == Some(Phase::Closed)));
    // The 10th error, on the second worker: its next fold (one tick later,
    // 480 ms before the signal window closes) brings the node's count to
    // min_volume at 100 %: open, made once.
    windows[1].record(&dep.name, 500 * MS, error, start + 15 * MS);
    let t = tick_all(&mut windows, start + 20 * MS);
    let made: Vec<Transition> = t.iter().flat_map(|t| t.transitions.iter()).collect();
    assert_eq!(
        made,
        [Transition {
            from: Phase::Closed,
            to: Phase::Open
        }]
    );
    // The window's close later folds its 10 errors into the open breaker:
    // nothing more happens (open ignores stream ends).
    let t = tick_all(&mut windows, start + 560 * MS);
    assert!(t.iter().all(|t| t.transitions.iter().count() == 0));
    // Both workers hold it (the second read it in the same tick) and refuse.
    let mut node = Node {
        store: store.clone(),
        workers: workers.into_iter().collect(),
        policy: p.clone(),
    };
    for i in 0..2 {
        assert_eq!(
            node.workers[i].control(&dep.key).breaker.map(|b| b.phase),
            Some(Phase::Open)
        );
        assert!(matches!(
            node.request(i, "orders", start + 570 * MS),
            Err((Reason::CircuitOpen, _))
        ));
    }
}
