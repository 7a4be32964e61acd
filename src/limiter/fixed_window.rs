//! Fixed window: at most `limit` units in each window aligned to the epoch.
//!
//! # Semantics
//! With `W = window_ns`, the window of `now` is `k = now / W`, covering
//! `[k·W, (k+1)·W)`. The state is a window index and the units admitted in
//! it. At `now`, `used` is the state's count if its window is the current one
//! and 0 if it is older; a request of cost `c` is admitted iff
//! `used + c ≤ limit`, and then `used += c`. A denied request changes
//! nothing; nothing frees up before the window ends, so it may retry after
//! exactly `wait = (k+1)·W − now` (never, `u64::MAX`, if `c > limit`).
//! `reset_ns` is that same instant while anything is counted, else 0.
//!
//! A clock that steps backwards is saturated, as in the token bucket: a
//! stored window ahead of the current one (counted while the clock ran
//! ahead, e.g. during a forward excursion since corrected) is read as the
//! current window with its count ([`FixedWindow::saturate`], which the
//! caller persists). A key that used up its limit during the excursion so
//! waits at most until the end of the window current when the clock came
//! back, never for the length of the excursion.
//!
//! # Error and over-admission bound
//! Exact per aligned window: each `[k·W, (k+1)·W)` admits at most `limit`,
//! and a request is denied only if it would take its window past `limit`.
//! Rolling windows are not enforced. `d ≥ 1` consecutive nanoseconds
//! `(t − d, t]` meet at most `1 + ceil((d − 1) / W)` aligned windows, so they
//! admit at most
//!
//! `limit × (1 + ceil((d − 1) / W))`,
//!
//! which for every rolling window of length `W` (and any `2 ≤ d ≤ W`) is
//! `2 × limit`: an over-admission of up to `limit`, 100 %. The bound is
//! tight: `limit` at `(k+1)·W − 1` and `limit` more at `(k+1)·W` admit
//! `2 × limit` within 2 ns. Over long intervals the average rate is exact.
//!
//! With a clock that steps backwards the price of saturating is paid in
//! real time: the clock passes again through windows it had counted, each
//! with a fresh limit, so each step back can add up to `limit` to the
//! admissions of the rolling windows around it (at most `3 × limit` in one
//! of length `W`), once per step. Instants past `u64::MAX` (year 2554)
//! saturate.

use super::calendar::Zone;
use super::codec::{get_varint, put_varint};
use super::{ns_until, Verdict};

/// The immutable parameters of one fixed-window limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedWindow {
    limit: u64,
    window_ns: u64,
    /// Windows of `window_ns` aligned to the epoch, or calendar months in
    /// this zone.
    calendar: Option<Zone>,
    /// How far late-settled costs may take a window's count past `limit`
    /// (see [`FixedWindow::settle_more`]); 0 without a debt allowance.
    max_debt: u64,
}

/// Per-key state; `Default` is a fresh key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct State {
    /// The window `count` belongs to: the largest `now / window_ns` admitted.
    pub window: u64,
    /// Units admitted in `window`.
    pub count: u64,
}

impl FixedWindow {
    /// `limit` units per `window_ns` nanoseconds; `None` if `window_ns`
    /// is 0. A `limit` of 0 admits only costs of 0 (envoyproxy/ratelimit's
    /// `requests_per_unit: 0`: every request over the limit).
    pub fn new(limit: u64, window_ns: u64) -> Option<FixedWindow> {
        if window_ns == 0 {
            return None;
        }
        Some(FixedWindow {
            limit,
            window_ns,
            calendar: None,
            max_debt: 0,
        })
    }

    /// `limit` units per calendar month in `zone`: each window runs from
    /// a month's first midnight there to the next's, whatever the month's
    /// length (28 to 31 days) or the zone's changes of clock
    /// ([`calendar`](super::calendar) says when a month starts). A
    /// window's index is the months since January 1970 there.
    pub fn calendar_month(limit: u64, zone: Zone) -> FixedWindow {
        FixedWindow {
            limit,
            // Its parameter beside the state (`Algo::params`): never a
            // length a window of the epoch can have (at most 366 days).
            window_ns: CALENDAR_TAG | u64::from(zone.tag()),
            calendar: Some(zone),
            max_debt: 0,
        }
    }

    /// A calendar month's time zone (`None`: windows of `window_ns`
    /// aligned to the epoch).
    pub fn calendar_zone(&self) -> Option<Zone> {
        self.calendar
    }

    /// The window of `now`: its index.
    fn index(&self, now: u64) -> u64 {
        match self.calendar {
            None => now / self.window_ns,
            Some(c) => c.month_of(now),
        }
    }

    /// The instant window `window` ends (ns since the epoch, unbounded).
    fn end_of(&self, window: u64) -> u128 {
        match self.calendar {
            None => (u128::from(window) + 1) * u128::from(self.window_ns),
            Some(c) => c.month_start(window.saturating_add(1)),
        }
    }

    /// These parameters with a debt allowance of `max_debt` units.
    pub fn with_debt(self, max_debt: u64) -> FixedWindow {
        FixedWindow { max_debt, ..self }
    }

    /// Charges `units` more to `now`'s window without admission (a cost
    /// settled after the response): its count may pass `limit` by at most
    /// `max_debt`, and the window's later requests are refused until it
    /// ends (the debt is not carried into the next window). Returns the
    /// new state and the units written off.
    pub fn settle_more(&self, state: &State, units: u64, now: u64) -> (State, u64) {
        let (window, used) = self.current(state, now);
        let cap = self.limit.saturating_add(self.max_debt).max(used);
        let total = used.saturating_add(units);
        let count = total.min(cap);
        let written_off = units - (count - used);
        let state = if count == 0 {
            State::default()
        } else {
            State { window, count }
        };
        (state, written_off)
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn window_ns(&self) -> u64 {
        self.window_ns
    }

    /// The most any rolling window of `window_ns` can admit: `2 × limit`.
    pub fn max_per_rolling_window(&self) -> u64 {
        self.limit.saturating_mul(2)
    }

    /// The window that counts at `now` and the units used in it. An empty
    /// count means a fresh key, whatever window it names.
    fn current(&self, state: &State, now: u64) -> (u64, u64) {
        let k = self.index(now);
        if state.count == 0 || state.window < k {
            (k, 0)
        } else {
            (state.window, state.count)
        }
    }

    /// Nanoseconds from `now` to the end of `window`.
    fn until_end(&self, window: u64, now: u64) -> u64 {
        ns_until(self.end_of(window), now)
    }

    /// Units `now`'s window is past its limit (its debt; 0 if none).
    pub fn debt(&self, state: &State, now: u64) -> u64 {
        self.current(state, now).1.saturating_sub(self.limit)
    }

    /// Whether a request of `cost` units is admitted at `now`. A count in
    /// debt (past `limit`) denies until its window ends.
    pub fn check(&self, state: &State, now: u64, cost: u64) -> Verdict<State> {
        let (window, used) = self.current(state, now);
        let end = self.until_end(window, now);
        match used.checked_add(cost) {
            Some(total) if total <= self.limit => Verdict::Admit {
                state: if total == 0 {
                    State::default()
                } else {
                    State { window, count: total }
                },
                remaining: self.limit - total,
                reset_ns: if total == 0 { 0 } else { end },
            },
            _ => Verdict::Deny {
                wait_ns: if cost > self.limit { u64::MAX } else { end },
                remaining: self.limit.saturating_sub(used),
                reset_ns: if used == 0 { 0 } else { end },
            },
        }
    }

    /// `state` with a window ahead of `now`'s (the clock stepped back) read
    /// as `now`'s window, its count kept; `None` if nothing changes.
    pub fn saturate(&self, state: &State, now: u64) -> Option<State> {
        let k = self.index(now);
        (state.count > 0 && state.window > k).then_some(State {
            window: k,
            count: state.count,
        })
    }

    /// Whether nothing in `state` still counts at `now`.
    pub fn is_idle(&self, state: &State, now: u64) -> bool {
        self.current(state, now).1 == 0
    }

    /// Appends `state`: window and count as LEB128 varints (2 to 20 bytes).
    pub fn encode(state: &State, out: &mut Vec<u8>) {
        put_varint(out, state.window);
        put_varint(out, state.count);
    }

    /// Reads a state written by [`FixedWindow::encode`] from the start of
    /// `bytes`; returns it and the bytes consumed, or `None` if malformed.
    pub fn decode(bytes: &[u8]) -> Option<(State, usize)> {
        let mut pos = 0;
        let window = get_varint(bytes, &mut pos)?;
        let count = get_varint(bytes, &mut pos)?;
        Some((State { window, count }, pos))
    }
}

/// Marks a calendar window's parameter (see [`FixedWindow::calendar_month`]).
const CALENDAR_TAG: u64 = 1 << 63;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::calendar::days_from_civil;
    use crate::limiter::testkit::{self, max_rolling, take, Algo, XorShift, S, T0};

    impl Algo for FixedWindow {
        type State = State;
        fn limit(&self) -> u64 {
            self.limit
        }
        fn check(&self, state: &State, now: u64, cost: u64) -> Verdict<State> {
            FixedWindow::check(self, state, now, cost)
        }
        fn is_idle(&self, state: &State, now: u64) -> bool {
            FixedWindow::is_idle(self, state, now)
        }
        fn encode(state: &State, out: &mut Vec<u8>) {
            FixedWindow::encode(state, out)
        }
        fn decode(bytes: &[u8]) -> Option<(State, usize)> {
            FixedWindow::decode(bytes)
        }
    }

    fn fw(limit: u64, window_ns: u64) -> FixedWindow {
        FixedWindow::new(limit, window_ns).unwrap()
    }

    /// 2026-12-06T00:00:00Z and the starts of the months around it.
    const DEC_6_2026: u64 = 1_796_515_200 * S;

    fn utc(y: i128, m: i128) -> u64 {
        (days_from_civil(y, m, 1) as u64) * 86_400 * S
    }

    #[test]
    fn calendar_months_have_their_exact_lengths_in_their_time_zone() {
        assert_eq!(utc(2026, 12), 1_796_083_200 * S);
        assert_eq!(utc(1970, 1), 0);
        // Every month of four years: 28, 29, 30 or 31 days, as the calendar.
        let c = Zone::fixed(0).unwrap();
        for k in 0..48u64 {
            let index = (2024 - 1970) * 12 + k;
            let days = (c.month_start(index + 1) - c.month_start(index)) / (86_400 * u128::from(S));
            let (y, m) = (2024 + (k / 12) as i128, (k % 12 + 1) as i128);
            let expect = match m {
                2 if y % 4 == 0 => 29,
                2 => 28,
                4 | 6 | 9 | 11 => 30,
                _ => 31,
            };
            assert_eq!(days, expect, "{y}-{m}");
            assert_eq!(c.month_of(c.month_start(index) as u64), index);
            assert_eq!(c.month_of(c.month_start(index) as u64 - 1), index - 1);
        }
        // 2026-12-06 is December; in UTC+14 December ends 14 h earlier.
        let f = FixedWindow::calendar_month(100, Zone::fixed(0).unwrap());
        let mut st = State::default();
        assert_eq!((0..150).filter(|_| take(&f, &mut st, DEC_6_2026, 1)).count(), 100);
        let Verdict::Deny { wait_ns, .. } = f.check(&st, DEC_6_2026, 1) else {
            panic!("over its month")
        };
        assert_eq!(
            u128::from(DEC_6_2026) + u128::from(wait_ns),
            u128::from(utc(2027, 1))
        );
        let east = FixedWindow::calendar_month(100, Zone::fixed(14 * 3600).unwrap());
        let mut st = State::default();
        assert!(take(&east, &mut st, DEC_6_2026, 100));
        let Verdict::Deny { wait_ns, .. } = east.check(&st, DEC_6_2026, 1) else {
            panic!("over its month")
        };
        assert_eq!(DEC_6_2026 + wait_ns, utc(2027, 1) - 14 * 3600 * S);
        // The last nanosecond of December there, and the first of January.
        let new_year = utc(2027, 1) - 14 * 3600 * S;
        assert!(!take(&east, &mut st, new_year - 1, 1));
        assert!(take(&east, &mut st, new_year, 100));
        assert_ne!(f, east);
        assert_ne!(f.window_ns(), east.window_ns());
    }

    #[test]
    fn each_aligned_window_admits_exactly_its_limit() {
        let f = fw(5, S);
        let mut st = State::default();
        let start = T0 + 300_000_000; // 0.3 s into a window
        assert_eq!((0..9).filter(|_| take(&f, &mut st, start, 1)).count(), 5);
        assert_eq!(
            f.check(&st, start, 1),
            Verdict::Deny {
                wait_ns: 700_000_000,
                remaining: 0,
                reset_ns: 700_000_000
            }
        );
        assert!(!take(&f, &mut st, T0 + S - 1, 1));
        assert_eq!((0..9).filter(|_| take(&f, &mut st, T0 + S, 1)).count(), 5);
    }

    #[test]
    fn a_settled_cost_takes_the_window_into_debt_until_it_ends() {
        let f = fw(10, S).with_debt(5);
        let mut st = State::default();
        let at = T0 + 200_000_000;
        assert!(take(&f, &mut st, at, 4));
        let (owed, lost) = f.settle_more(&st, 13, at);
        assert_eq!((owed.count, lost), (15, 2));
        assert_eq!(
            f.check(&owed, at, 1),
            Verdict::Deny {
                wait_ns: 800_000_000,
                remaining: 0,
                reset_ns: 800_000_000
            }
        );
        // The next window starts afresh.
        assert!(f.check(&owed, T0 + S, 10).is_admit());
        // A settlement after the window ended counts in the current one.
        let (later, lost) = f.settle_more(&st, 3, T0 + S);
        assert_eq!(
            (later, lost),
            (
                State {
                    window: (T0 + S) / S,
                    count: 3
                },
                0
            )
        );
        // Without an allowance nothing passes the limit.
        let (full, lost) = fw(10, S).settle_more(&st, 9, at);
        assert_eq!((full.count, lost), (10, 3));
    }

    #[test]
    fn a_burst_across_a_boundary_admits_twice_the_limit_in_two_nanoseconds() {
        let (limit, w) = (100, 60 * S);
        let f = fw(limit, w);
        let boundary = (T0 / w + 1) * w;
        let mut st = State::default();
        let mut admitted = Vec::new();
        for now in [boundary - 1, boundary] {
            for _ in 0..3 * limit {
                if take(&f, &mut st, now, 1) {
                    admitted.push((now, 1));
                }
            }
        }
        // 2 × limit inside (boundary − 2, boundary]: a rolling interval of
        // 2 ns, far shorter than one window, and exactly the stated bound.
        assert_eq!(admitted.len() as u64, 2 * limit);
        assert_eq!(max_rolling(&admitted, 2), 2 * limit);
        assert_eq!(max_rolling(&admitted, w), f.max_per_rolling_window());
    }

    #[test]
    fn wait_is_exact_and_never_for_a_cost_above_the_limit() {
        let f = fw(10, S);
        let mut st = State::default();
        assert!(take(&f, &mut st, T0 + 1, 8));
        let now = T0 + 250_000_000;
        match f.check(&st, now, 3) {
            Verdict::Deny {
                wait_ns, remaining, ..
            } => {
                assert_eq!((wait_ns, remaining), (750_000_000, 2));
                assert!(!take(&f, &mut st.clone(), now + wait_ns - 1, 3));
                assert!(take(&f, &mut st.clone(), now + wait_ns, 3));
            }
            other => panic!("expected a denial, got {other:?}"),
        }
        match f.check(&State::default(), now, 11) {
            Verdict::Deny { wait_ns, .. } => assert_eq!(wait_ns, u64::MAX),
            other => panic!("expected a denial, got {other:?}"),
        }
    }

    #[test]
    fn a_clock_step_backwards_stays_in_the_latest_window() {
        let f = fw(10, S);
        let mut st = State::default();
        assert!(take(&f, &mut st, T0 + 5 * S, 7));
        let back = T0 + S / 2; // 4.5 s back, four windows earlier
                               // Still window T0 + 5 s: three left, then nothing until it ends.
        assert!(!f.is_idle(&st, back));
        assert!(take(&f, &mut st, back, 3));
        assert_eq!(st.window, (T0 + 5 * S) / S);
        match f.check(&st, back, 1) {
            Verdict::Deny { wait_ns, .. } => assert_eq!(wait_ns, 5 * S + S / 2),
            other => panic!("expected a denial, got {other:?}"),
        }
        assert!(!take(&f, &mut st, T0 + 6 * S - 1, 1));
        assert!(take(&f, &mut st, T0 + 6 * S, 1));
    }

    #[test]
    fn random_traffic_is_exact_per_window_and_within_twice_the_limit_rolling() {
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        for round in 0..60 {
            let limit = rng.below(12) + 1;
            let w = if round % 2 == 0 {
                rng.below(40) + 1
            } else {
                rng.below(5 * S) + 1
            };
            let f = fw(limit, w);
            // A reference count per aligned window (the clock is monotonic).
            let (mut ref_window, mut ref_used) = (u64::MAX, 0);
            let admitted = testkit::simulate(&f, &mut rng, w, 400, false, |now, cost, admit| {
                if now / w != ref_window {
                    (ref_window, ref_used) = (now / w, 0);
                }
                assert_eq!(admit, ref_used + cost <= limit);
                if admit {
                    ref_used += cost;
                }
            });
            assert!(max_rolling(&admitted, w) <= f.max_per_rolling_window());
        }
    }

    #[test]
    fn a_clock_stepping_backwards_never_beats_the_bound_in_real_time() {
        let mut rng = XorShift(0x2545_F491_4F6C_DD1D);
        for round in 0..60 {
            let limit = rng.below(12) + 1;
            let w = if round % 2 == 0 {
                rng.below(40) + 1
            } else {
                rng.below(5 * S) + 1
            };
            let f = fw(limit, w);
            let admitted = testkit::simulate(&f, &mut rng, w, 400, true, |_, _, _| {});
            assert!(max_rolling(&admitted, w) <= f.max_per_rolling_window());
        }
    }

    #[test]
    fn decode_never_panics_and_round_trips() {
        let mut rng = XorShift(7);
        let states = [
            State::default(),
            State {
                window: T0 / S,
                count: 3,
            },
            State {
                window: u64::MAX,
                count: u64::MAX,
            },
        ];
        testkit::fuzz_decode::<FixedWindow>(&mut rng, &states);
        assert_eq!(FixedWindow::decode(&[]), None);
        assert_eq!(FixedWindow::decode(&[0, 0, 9]), Some((State::default(), 2)));
    }

    #[test]
    fn invalid_parameters_are_refused() {
        assert!(FixedWindow::new(1, 0).is_none());
        // A limit of 0 is a window that admits only costs of 0.
        let zero = FixedWindow::new(0, S).unwrap();
        assert!(matches!(
            zero.check(&State::default(), S, 1),
            Verdict::Deny { .. }
        ));
        assert!(matches!(
            zero.check(&State::default(), S, 0),
            Verdict::Admit { .. }
        ));
        assert!(FixedWindow::new(u64::MAX, u64::MAX).is_some());
    }
}
