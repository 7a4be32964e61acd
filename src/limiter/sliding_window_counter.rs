//! Sliding window counter: a rolling window estimated from two fixed ones.
//!
//! # Semantics
//! With `W = window_ns` and `L = limit`, time is cut into windows aligned to
//! the epoch as in the fixed window: `k = now / W`, elapsed `e = now − k·W`.
//! The state counts the units admitted in the current window (`curr`) and in
//! the one before (`prev`, 0 if that window is older). The rolling window
//! `(now − W, now]` is estimated by assuming the previous window's
//! admissions were spread evenly over it:
//!
//! `estimate = prev × (W − e) / W + curr`
//!
//! and a request of cost `c` is admitted iff `estimate + c ≤ L`; then
//! `curr += c`. The state is constant-size whatever the limit. A denied
//! request changes nothing, and the estimate never grows while nothing is
//! admitted, so `wait_ns` is the first nanosecond at which the test passes:
//! later in this window once the `prev` weight has shrunk enough, else in the
//! next window (where `curr` has become `prev`), else at the start of the one
//! after (never, `u64::MAX`, if `c > L`). `reset_ns` is the time until the
//! estimate is 0. `remaining` is `floor(L − estimate)`.
//!
//! The state keeps `last_ns`, the running maximum of `now` over
//! admissions, and evaluates at `max(now, last_ns)`. A clock that steps
//! backwards is saturated, as in the token bucket: a `last_ns` ahead of
//! `now` (admissions while the clock ran ahead, e.g. during a forward
//! excursion since corrected) is moved back to `now` with its counts
//! ([`SlidingWindowCounter::saturate`], which the caller persists), so the
//! counts decay from then: a key that used up its limit during the
//! excursion waits at most two windows, never for the excursion.
//!
//! # Rounding
//! None where it matters: the test is evaluated exactly, multiplied through
//! by `W` in `u128` (no overflow for any `u64` inputs), as
//! `prev × (W − e) + (curr + c) × W ≤ L × W`; a fraction of a unit in the
//! weighted term counts in full against the request. Only the reported
//! numbers round, both toward admitting less: `remaining` down to whole
//! units, `wait_ns` up to the first whole nanosecond at which the exact test
//! passes.
//!
//! # Error and over-admission bound
//! Each aligned window admits at most `L` (the estimate is at least `curr`).
//! Over any rolling window `(t − W, t]` at most
//!
//! `2·L − min(L, ceil(2·L / W))`
//!
//! units are admitted: for `W ≥ 2` that is `L + floor(L·(W − 2) / W)`, an
//! over-admission of `L − ceil(2·L / W)`; for windows much longer than `L`
//! nanoseconds, `2·L − 1`, just under 100 %. For `W ≤ 2`, exactly `L`.
//! Derivation: let `t` lie at elapsed `e` in window `k`, so `(t − W, t]` is
//! the last `W − e − 1` ns of window `k − 1` plus the first `e + 1` ns of
//! window `k`. Window `k − 1` admitted `p ≤ L` units, so at most `p` lie in
//! that tail. Window `k`'s last admission by `t`, at elapsed `e' ≤ e`, passed
//! `p·(W − e')/W + curr ≤ L`, so window `k` admitted at most
//! `L − ceil(p·(W − e)/W)` by `t`. Hence the rolling window holds at most
//! `p + L − ceil(p·(W − e)/W) = L + floor(p·e/W)`, where a non-empty tail
//! needs `e ≤ W − 2`; the maximum is at `p = L`, `e = W − 2`. It is tight:
//! `L` units in the last nanosecond of a window (after an idle one), then
//! `L − ceil(2·L / W)` at elapsed `W − 2` of the next.
//!
//! Under uniform arrivals the estimate's assumption holds and the error
//! vanishes: if every tail of `d` ns of the previous window holds at most
//! `p·d/W + 1` of its `p` units (evenly spread to within one unit), the
//! tail in the rolling window holds at most `p·(W − e − 1)/W + 1`, and the
//! rolling window at most `L + 1 − p/W`, i.e. never more than `L`. A steady
//! arrival rate at or below the limit behaves so (checked by the tests).
//! Bursts at window ends are what approach the worst case. The estimate errs
//! the other way too: when the previous window's admissions came early, it
//! over-counts and denies while the true rolling count is below `L` (down to
//! 0 just after a boundary, for a burst at the previous window's start).
//!
//! With a clock that never steps backwards by more than the latest
//! admission's lead the bound holds in real time: the effective times of
//! admissions never decrease and advance no faster than real time, so
//! admissions less than `W` apart in real time are less than `W` apart in
//! effective time. Saturating a larger step back moves the windows the
//! counts belong to, so each such step can add up to `limit` to the
//! rolling windows around it, once per step.

use super::codec::{get_u64, get_varint, put_u64, put_varint};
use super::{ns_until, Verdict};

/// The immutable parameters of one sliding-window-counter limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindowCounter {
    limit: u64,
    window_ns: u64,
    /// How far late-settled costs may take a window's count past `limit`
    /// (see [`SlidingWindowCounter::settle_more`]); 0 without a debt allowance.
    max_debt: u64,
}

/// Per-key state; `Default` is a fresh key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct State {
    /// The effective time of the latest admission: the running maximum of
    /// `now` over admissions. Its window is the one `curr` counts.
    pub last_ns: u64,
    /// Units admitted in the window before `last_ns`'s.
    pub prev: u64,
    /// Units admitted in `last_ns`'s window.
    pub curr: u64,
}

/// The state as it stands at one effective instant.
struct At {
    /// The effective time: `now`, or the latest admission if later.
    tau: u64,
    /// `tau`'s window index.
    window: u64,
    /// Nanoseconds from that window's start to `tau`.
    elapsed: u64,
    prev: u64,
    curr: u64,
}

impl SlidingWindowCounter {
    /// `limit` units per rolling `window_ns` nanoseconds; `None` if either
    /// is 0. (Everything else is computed in `u128` and cannot overflow.)
    pub fn new(limit: u64, window_ns: u64) -> Option<SlidingWindowCounter> {
        if limit == 0 || window_ns == 0 {
            return None;
        }
        Some(SlidingWindowCounter {
            limit,
            window_ns,
            max_debt: 0,
        })
    }

    /// These parameters with a debt allowance of `max_debt` units.
    pub fn with_debt(self, max_debt: u64) -> SlidingWindowCounter {
        SlidingWindowCounter { max_debt, ..self }
    }

    /// Charges `units` more to `now`'s window without admission (a cost
    /// settled after the response): `curr` may pass `limit` by at most
    /// `max_debt`. The estimate then stays above `limit` (requests are
    /// refused, with the exact wait) until the debt's weight has decayed
    /// over the next window. Returns the new state and the units written
    /// off.
    pub fn settle_more(&self, state: &State, units: u64, now: u64) -> (State, u64) {
        let at = self.at(state, now);
        let cap = self.limit.saturating_add(self.max_debt).max(at.curr);
        let curr = at.curr.saturating_add(units).min(cap);
        let written_off = units - (curr - at.curr);
        let state = if at.prev == 0 && curr == 0 {
            State::default()
        } else {
            State {
                last_ns: at.tau,
                prev: at.prev,
                curr,
            }
        };
        (state, written_off)
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn window_ns(&self) -> u64 {
        self.window_ns
    }

    /// The most any rolling window of `window_ns` can admit:
    /// `2·limit − min(limit, ceil(2·limit / window_ns))`.
    pub fn max_per_rolling_window(&self) -> u64 {
        let two_l = 2 * u128::from(self.limit);
        let bound = two_l - two_l.div_ceil(self.w()).min(u128::from(self.limit));
        u64::try_from(bound).unwrap_or(u64::MAX)
    }

    fn w(&self) -> u128 {
        u128::from(self.window_ns)
    }

    /// The counts that apply at `now`. A key with nothing counted is fresh
    /// whatever its `last_ns`; otherwise time is the running maximum.
    fn at(&self, state: &State, now: u64) -> At {
        let (prev, curr, tau) = if state.prev == 0 && state.curr == 0 {
            (0, 0, now)
        } else {
            let tau = now.max(state.last_ns);
            let (k, s) = (tau / self.window_ns, state.last_ns / self.window_ns);
            match k - s {
                0 => (state.prev, state.curr, tau),
                1 => (state.curr, 0, tau),
                _ => (0, 0, tau),
            }
        };
        let window = tau / self.window_ns;
        At {
            tau,
            window,
            elapsed: tau - window * self.window_ns,
            prev,
            curr,
        }
    }

    /// Units the current window's count is past the limit (its debt; the
    /// previous window's weight is not counted).
    pub fn debt(&self, state: &State, now: u64) -> u64 {
        self.at(state, now).curr.saturating_sub(self.limit)
    }

    /// `state` with a `last_ns` ahead of `now` (the clock stepped back)
    /// moved to `now`, its counts kept; `None` if nothing changes.
    pub fn saturate(&self, state: &State, now: u64) -> Option<State> {
        let counted = state.prev > 0 || state.curr > 0;
        (counted && state.last_ns > now).then_some(State {
            last_ns: now,
            ..*state
        })
    }

    /// `W × estimate` for `prev` and `curr` at `elapsed`: exact, saturating.
    fn scaled(&self, prev: u64, curr: u128, elapsed: u64) -> u128 {
        let weight = u128::from(self.window_ns - elapsed);
        (u128::from(prev) * weight).saturating_add(curr.saturating_mul(self.w()))
    }

    /// Nanoseconds from `now` to the start of window `window + ahead`.
    fn until_window(&self, window: u64, ahead: u128, now: u64) -> u64 {
        ns_until((u128::from(window) + ahead) * self.w(), now)
    }

    /// Nanoseconds from `now` until the estimate is 0 again.
    fn reset_ns(&self, at: &At, curr: u64, now: u64) -> u64 {
        if curr > 0 {
            self.until_window(at.window, 2, now)
        } else if at.prev > 0 {
            self.until_window(at.window, 1, now)
        } else {
            0
        }
    }

    /// Whether a request of `cost` units is admitted at `now`.
    pub fn check(&self, state: &State, now: u64, cost: u64) -> Verdict<State> {
        let at = self.at(state, now);
        let budget = u128::from(self.limit) * self.w();
        let total = u128::from(at.curr) + u128::from(cost);
        let after = self.scaled(at.prev, total, at.elapsed);
        if after <= budget {
            // total ≤ after / W ≤ limit, so it fits.
            let curr = u64::try_from(total).unwrap_or(u64::MAX);
            let state = if at.prev == 0 && curr == 0 {
                State::default()
            } else {
                State {
                    last_ns: at.tau,
                    prev: at.prev,
                    curr,
                }
            };
            return Verdict::Admit {
                state,
                remaining: self.whole_units(budget - after),
                reset_ns: self.reset_ns(&at, curr, now),
            };
        }
        let before = self.scaled(at.prev, u128::from(at.curr), at.elapsed);
        Verdict::Deny {
            wait_ns: if cost > self.limit {
                u64::MAX
            } else {
                self.wait_ns(&at, cost, now)
            },
            remaining: self.whole_units(budget.saturating_sub(before)),
            reset_ns: self.reset_ns(&at, at.curr, now),
        }
    }

    /// `scaled / W`, rounded down.
    fn whole_units(&self, scaled: u128) -> u64 {
        u64::try_from(scaled / self.w()).unwrap_or(u64::MAX)
    }

    /// The first instant, as nanoseconds from `now`, at which a denied
    /// request of `cost ≤ limit` passes. The estimate never grows while
    /// nothing is admitted, so this is the first instant the exact test
    /// passes: in `at`'s window once the `prev` weight has shrunk enough,
    /// else in the next (where `curr` has become `prev`), else the one after.
    fn wait_ns(&self, at: &At, cost: u64, now: u64) -> u64 {
        let (w, budget) = (self.w(), u128::from(self.limit) * self.w());
        // Largest `W − e` whose `prev × (W − e)` fits `slack`: 0 if none
        // does (the window's last nanosecond still has weight 1).
        let weight_fitting = |prev: u64, slack: u128| -> u128 {
            if prev == 0 {
                w
            } else {
                (slack / u128::from(prev)).min(w)
            }
        };
        let start = |ahead: u128| (u128::from(at.window) + ahead) * w;
        let this_window = (u128::from(at.curr) + u128::from(cost))
            .checked_mul(w)
            .and_then(|fixed| budget.checked_sub(fixed))
            .map(|slack| weight_fitting(at.prev, slack))
            .filter(|&keep| keep > 0);
        let instant = if let Some(keep) = this_window {
            // keep < W − elapsed, or the request would have passed now.
            start(1) - keep
        } else {
            let slack = budget - u128::from(cost) * w;
            match weight_fitting(at.curr, slack) {
                0 => start(2),
                keep => start(2) - keep,
            }
        };
        ns_until(instant, now)
    }

    /// Whether nothing in `state` still counts at `now`.
    pub fn is_idle(&self, state: &State, now: u64) -> bool {
        let at = self.at(state, now);
        at.prev == 0 && at.curr == 0
    }

    /// Appends `state`: `last_ns` as 8 little-endian bytes, then `prev` and
    /// `curr` as LEB128 varints (10 to 28 bytes; 10 to 14 below 2^21).
    pub fn encode(state: &State, out: &mut Vec<u8>) {
        put_u64(out, state.last_ns);
        put_varint(out, state.prev);
        put_varint(out, state.curr);
    }

    /// Reads a state written by [`SlidingWindowCounter::encode`] from the
    /// start of `bytes`; returns it and the bytes consumed, or `None` if
    /// malformed.
    pub fn decode(bytes: &[u8]) -> Option<(State, usize)> {
        let mut pos = 0;
        let last_ns = get_u64(bytes, &mut pos)?;
        let prev = get_varint(bytes, &mut pos)?;
        let curr = get_varint(bytes, &mut pos)?;
        Some((State { last_ns, prev, curr }, pos))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::testkit::{self, max_rolling, take, Algo, XorShift, S, T0};

    impl Algo for SlidingWindowCounter {
        type State = State;
        fn limit(&self) -> u64 {
            self.limit
        }
        fn check(&self, state: &State, now: u64, cost: u64) -> Verdict<State> {
            SlidingWindowCounter::check(self, state, now, cost)
        }
        fn is_idle(&self, state: &State, now: u64) -> bool {
            SlidingWindowCounter::is_idle(self, state, now)
        }
        fn encode(state: &State, out: &mut Vec<u8>) {
            SlidingWindowCounter::encode(state, out)
        }
        fn decode(bytes: &[u8]) -> Option<(State, usize)> {
            SlidingWindowCounter::decode(bytes)
        }
    }

    fn swc(limit: u64, window_ns: u64) -> SlidingWindowCounter {
        SlidingWindowCounter::new(limit, window_ns).unwrap()
    }

    #[test]
    fn a_settled_cost_goes_into_debt_that_decays_over_the_next_window() {
        let c = swc(10, S).with_debt(10);
        let mut st = State::default();
        assert!(take(&c, &mut st, T0, 5));
        let (owed, lost) = c.settle_more(&st, 20, T0);
        assert_eq!((owed.curr, lost), (20, 5));
        assert!(!c.check(&owed, T0 + S - 1, 1).is_admit());
        // 20 in the previous window weigh 20·(W − e)/W: one unit fits once
        // that is at most 9, i.e. from e = 0.55 s of the next window, as
        // the denial said.
        let Verdict::Deny { wait_ns, .. } = c.check(&owed, T0, 1) else {
            panic!()
        };
        assert_eq!(wait_ns, S + 550_000_000);
        assert!(!c.check(&owed, T0 + S + 550_000_000 - 1, 1).is_admit());
        assert!(c.check(&owed, T0 + S + 550_000_000, 1).is_admit());
        let (capped, lost) = swc(10, S).settle_more(&st, 20, T0);
        assert_eq!((capped.curr, lost), (10, 15));
    }

    #[test]
    fn the_previous_window_counts_by_its_remaining_share() {
        let c = swc(10, 10 * S);
        let k = T0 / (10 * S) + 1;
        let mut st = State::default();
        assert!(take(&c, &mut st, k * 10 * S - 1, 10));
        // 2.5 s into the next window: estimate 10 × 0.75 = 7.5.
        let now = (k * 10 + 2) * S + S / 2;
        assert!(take(&c, &mut st, now, 2));
        assert_eq!(
            c.check(&st, now, 1),
            Verdict::Deny {
                // 7.5 + 2 + 1 ≤ 10 once the weight is 0.7: at 3 s.
                wait_ns: S / 2,
                remaining: 0,
                reset_ns: 17 * S + S / 2,
            }
        );
        assert!(!take(&c, &mut st, now + S / 2 - 1, 1));
        assert!(take(&c, &mut st, now + S / 2, 1));
    }

    #[test]
    fn a_fraction_of_a_unit_counts_in_full() {
        // W = 3 ns: one unit in the previous window weighs 2/3 at elapsed 1.
        let c = swc(3, 3);
        let k = T0 / 3 + 1;
        let st = State {
            last_ns: 3 * k - 1,
            prev: 0,
            curr: 1,
        };
        // 2/3 + 3 > 3 although floor(2/3) + 3 = 3 would pass; it passes
        // when that unit's window is over, 2 ns later.
        assert!(!c.check(&st, 3 * k + 1, 3).is_admit());
        assert!(c.check(&st, 3 * k + 1, 3 - 1).is_admit());
        match c.check(&st, 3 * k + 1, 3) {
            Verdict::Deny {
                wait_ns, remaining, ..
            } => assert_eq!((wait_ns, remaining), (2, 2)),
            other => panic!("expected a denial, got {other:?}"),
        }
    }

    #[test]
    fn the_worst_case_is_reached_exactly() {
        for (limit, w) in [(10, 1000), (100, 60 * S), (7, 5), (3, 2), (5, 1)] {
            let c = swc(limit, w);
            let k = T0 / w + 2;
            let mut st = State::default();
            let mut admitted = Vec::new();
            // All of one window's admissions at its very end...
            for now in [k * w - 1, (k + 1) * w - 2] {
                while take(&c, &mut st, now, 1) {
                    admitted.push((now, 1));
                }
            }
            // ...and the most the next window allows W − 2 ns later.
            let bound = c.max_per_rolling_window();
            assert_eq!(max_rolling(&admitted, w), bound, "{limit}/{w}");
            if w > 2 * limit {
                assert_eq!(bound, 2 * limit - 1);
            }
        }
        assert_eq!(swc(100, 3).max_per_rolling_window(), 133);
    }

    /// Random limits and windows, half tiny so boundaries are hit often.
    fn random_params(rng: &mut XorShift, round: u64) -> SlidingWindowCounter {
        let limit = rng.below(12) + 1;
        let w = if round % 2 == 0 {
            rng.below(40) + 1
        } else {
            rng.below(5 * S) + 1
        };
        swc(limit, w)
    }

    #[test]
    fn random_traffic_stays_within_the_stated_bound() {
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        let mut tight = 0;
        for round in 0..80 {
            let c = random_params(&mut rng, round);
            let (w, limit) = (c.window_ns(), c.limit());
            let (mut window, mut used) = (u64::MAX, 0);
            let admitted = testkit::simulate(&c, &mut rng, w, 400, false, |now, cost, admit| {
                if now / w != window {
                    (window, used) = (now / w, 0);
                }
                if admit {
                    used += cost;
                    assert!(used <= limit, "aligned window over the limit");
                }
            });
            let max = max_rolling(&admitted, w);
            assert!(max <= c.max_per_rolling_window(), "{max} for {c:?}");
            if max == c.max_per_rolling_window() {
                tight += 1;
            }
        }
        // The traffic is sharp enough to reach the bound, not just stay under.
        assert!(tight >= 5, "bound reached in only {tight} rounds");
    }

    #[test]
    fn a_clock_stepping_backwards_never_beats_the_bound_in_real_time() {
        let mut rng = XorShift(0x2545_F491_4F6C_DD1D);
        for round in 0..80 {
            let c = random_params(&mut rng, round);
            let admitted = testkit::simulate(&c, &mut rng, c.window_ns(), 400, true, |_, _, _| {});
            assert!(max_rolling(&admitted, c.window_ns()) <= c.max_per_rolling_window());
        }
    }

    #[test]
    fn a_clock_step_backwards_stands_at_the_latest_admission() {
        let c = swc(10, S);
        let mut st = State::default();
        assert!(take(&c, &mut st, T0 + 5 * S + S / 2, 10));
        let back = T0; // 5.5 s back
        assert!(!c.is_idle(&st, back));
        // As at T0 + 5.5 s: the 10 count fully until T0 + 6 s, and one unit
        // fits once their weight is 0.9, at T0 + 6.1 s.
        match c.check(&st, back, 1) {
            Verdict::Deny {
                wait_ns, reset_ns, ..
            } => assert_eq!((wait_ns, reset_ns), (6 * S + S / 10, 7 * S)),
            other => panic!("expected a denial, got {other:?}"),
        }
        assert!(take(&c, &mut st, T0 + 6 * S + S / 10, 1));
    }

    #[test]
    fn evenly_spread_windows_never_exceed_the_limit() {
        let mut rng = XorShift(0xD1B5_4A32_D192_ED03);
        for _ in 0..300 {
            let limit = rng.below(50) + 1;
            let w = rng.below(10_000) + 2;
            let c = swc(limit, w);
            // A steady rate at or below the limit, from a random phase.
            let period = w.div_ceil(limit) + rng.below(3 * w / limit + 1);
            let mut now = T0 + rng.below(w);
            let mut st = State::default();
            let mut admitted = Vec::new();
            for _ in 0..(4 * w / period + 10).min(2000) {
                if take(&c, &mut st, now, 1) {
                    admitted.push((now, 1));
                }
                now += period;
            }
            assert!(max_rolling(&admitted, w) <= limit, "{c:?} every {period}");
        }
    }

    #[test]
    fn an_evenly_spread_previous_window_keeps_the_rolling_count_within_the_limit() {
        // The header's claim, checked wherever random traffic happens to
        // satisfy its premise: windows ending in window k hold at most L if
        // every tail of window k − 1 holds at most p·d/W + 1 of its p units.
        let mut rng = XorShift(0x94D0_49BB_1331_11EB);
        let mut premise_held = 0;
        for round in 0..80 {
            let c = random_params(&mut rng, round);
            let (w, limit) = (c.window_ns(), c.limit());
            let on_clock: Vec<(u64, u64)> = testkit::simulate(&c, &mut rng, w, 300, false, |_, _, _| {})
                .into_iter()
                .map(|(real, cost)| (T0 + real, cost))
                .collect();
            for (j, &(t, _)) in on_clock.iter().enumerate() {
                let k = t / w;
                let prev: Vec<(u64, u64)> = on_clock
                    .iter()
                    .copied()
                    .filter(|&(x, _)| x / w + 1 == k)
                    .collect();
                let p: u64 = prev.iter().map(|&(_, c)| c).sum();
                let even = prev.iter().all(|&(x, _)| {
                    let d = k * w - x; // the tail from x to the window's end
                    let tail: u64 = prev.iter().filter(|&&(y, _)| y >= x).map(|&(_, c)| c).sum();
                    u128::from(tail) * u128::from(w) <= u128::from(p) * u128::from(d) + u128::from(w)
                });
                if p > 0 && even {
                    premise_held += 1;
                    let rolling: u64 = on_clock[..=j]
                        .iter()
                        .filter(|&&(x, _)| x + w > t)
                        .map(|&(_, c)| c)
                        .sum();
                    assert!(rolling <= limit, "{rolling} at {t} for {c:?}");
                }
            }
        }
        assert!(premise_held > 100, "premise held only {premise_held} times");
    }

    #[test]
    fn decode_never_panics_and_round_trips() {
        let mut rng = XorShift(7);
        let states = [
            State::default(),
            State {
                last_ns: T0,
                prev: 3,
                curr: 200,
            },
            State {
                last_ns: u64::MAX,
                prev: u64::MAX,
                curr: u64::MAX,
            },
        ];
        testkit::fuzz_decode::<SlidingWindowCounter>(&mut rng, &states);
        assert_eq!(SlidingWindowCounter::decode(&[0; 9]), None);
        assert_eq!(
            SlidingWindowCounter::decode(&[0; 11]),
            Some((State::default(), 10))
        );
    }

    #[test]
    fn extreme_states_and_times_neither_panic_nor_admit_past_the_limit() {
        let c = swc(u64::MAX, u64::MAX);
        let full = State {
            last_ns: u64::MAX,
            prev: u64::MAX,
            curr: u64::MAX,
        };
        for now in [0, T0, u64::MAX - 1, u64::MAX] {
            for cost in [0, 1, u64::MAX] {
                assert!(!c.check(&full, now, cost).is_admit());
                let _ = c.check(&State::default(), now, cost);
            }
        }
        let small = swc(3, 7);
        assert!(!small.check(&full, 0, 0).is_admit());
        assert!(small.check(&State::default(), u64::MAX, 3).is_admit());
    }

    #[test]
    fn invalid_parameters_are_refused() {
        assert!(SlidingWindowCounter::new(0, S).is_none());
        assert!(SlidingWindowCounter::new(1, 0).is_none());
        assert_eq!(swc(u64::MAX, 1).max_per_rolling_window(), u64::MAX);
    }
}
