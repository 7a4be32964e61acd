//! Sliding window log: exact over every rolling window.
//!
//! # Semantics
//! The state lists admitted requests as `(timestamp_ns, cost)` entries,
//! sorted by timestamp, one entry per instant (costs admitted at the same
//! nanosecond are merged). With `W = window_ns`, an entry counts at `now` iff
//! `timestamp > now − W`: it expires at `timestamp + W`. With `used` the sum
//! of the costs that count, a request of cost `c` is admitted iff
//! `used + c ≤ limit`; then expired entries are dropped and `(now, c)` is
//! recorded (a cost of 0 records nothing). A denied request changes nothing
//! and may retry after exactly `wait = e − now`, where `e` is the expiry of
//! the first entry, in timestamp order, at which the expired costs add up to
//! `used + c − limit` (never, `u64::MAX`, if `c > limit`). `reset_ns` is the
//! time until the newest counting entry expires.
//!
//! Counting entries cost at least 1 each and sum to at most `limit`, so a
//! key holds at most `limit` entries. `limit` is therefore capped at
//! [`MAX_LOG_ENTRIES`], which bounds the memory (16 bytes an entry; at most
//! 12 encoded, typically 3 to 6) and the work per request (linear in the
//! entries); larger limits belong to the sliding window counter.
//!
//! A clock that steps backwards is saturated, as in the token bucket:
//! entries stamped ahead of `now` (recorded while the clock ran ahead, e.g.
//! during a forward excursion since corrected) are merged into one entry at
//! `now` ([`SlidingWindowLog::saturate`], which the caller persists). They
//! count for one window from then, never until the clock catches up with
//! them, so a key that used up its limit during the excursion waits at most
//! `W`. Entries already dropped as expired do not come back; they were
//! admitted at least `W` earlier in real time.
//!
//! # Error and over-admission bound
//! None: the log is exact. For every `t`, the admitted cost in the rolling
//! window `(t − W, t]` is at most `limit` (over-admission 0), and a request is
//! denied only if admitting it would put the window ending now over
//! `limit`. Any `d` consecutive nanoseconds admit at most
//! `limit × ceil(d / W)`. With a clock that steps backwards the bound
//! holds in real time: an entry admitted less than `W` ago in real time is
//! less than `W` old on the clock, or was moved to a `now` after its
//! admission, so it still counts.

use super::codec::{get_u64, get_varint, put_u64, put_varint};
use super::{ns_until, Verdict};

/// The largest `limit` (and so the most entries) a log may keep per key.
pub const MAX_LOG_ENTRIES: usize = 1024;

/// The immutable parameters of one sliding-window-log limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindowLog {
    limit: u64,
    window_ns: u64,
}

/// Per-key state; `Default` is a fresh key. Built only by `check` and
/// `decode`, so its entries are always sorted by strictly increasing
/// timestamp, have non-zero costs and number at most [`MAX_LOG_ENTRIES`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    entries: Vec<(u64, u64)>,
}

impl State {
    /// The recorded `(timestamp_ns, cost)` entries, oldest first; some may
    /// have expired (they are dropped on the next admission).
    pub fn entries(&self) -> &[(u64, u64)] {
        &self.entries
    }

    /// Gives back `cost` units admitted at `at` (a later check in the chain
    /// refused the request): taken from the entry recorded at `at`, else
    /// from the latest entry (where a clock step backwards recorded it).
    /// Keeps the invariants: an entry whose cost reaches 0 is removed.
    pub fn refund(&mut self, at: u64, cost: u64) {
        let found = self.entries.iter().rposition(|(t, _)| *t == at);
        let Some(i) = found.or_else(|| self.entries.len().checked_sub(1)) else {
            return;
        };
        let Some(entry) = self.entries.get_mut(i) else {
            return;
        };
        entry.1 = entry.1.saturating_sub(cost);
        if entry.1 == 0 {
            self.entries.remove(i);
        }
    }
}

impl SlidingWindowLog {
    /// `limit` units per rolling `window_ns` nanoseconds; `None` if either
    /// is 0 or `limit` exceeds [`MAX_LOG_ENTRIES`].
    pub fn new(limit: u64, window_ns: u64) -> Option<SlidingWindowLog> {
        if limit == 0 || window_ns == 0 || limit > MAX_LOG_ENTRIES as u64 {
            return None;
        }
        Some(SlidingWindowLog { limit, window_ns })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn window_ns(&self) -> u64 {
        self.window_ns
    }

    /// The most any rolling window of `window_ns` can admit: `limit`.
    pub fn max_per_rolling_window(&self) -> u64 {
        self.limit
    }

    /// The largest encoded state: at most `limit` entries, each a delta of
    /// at most 10 varint bytes (8 for the first timestamp) and a cost of at
    /// most `limit` (costs sum to at most `limit`), after the count.
    pub fn max_state_len(&self) -> usize {
        let limit = usize::try_from(self.limit).unwrap_or(usize::MAX);
        let mut cost_len = 1;
        while self.limit >> (7 * cost_len) > 0 {
            cost_len += 1;
        }
        limit.saturating_mul(10 + cost_len).saturating_add(10 + 8)
    }

    /// When an entry stamped `ts` stops counting.
    fn expiry(&self, ts: u64) -> u128 {
        u128::from(ts) + u128::from(self.window_ns)
    }

    /// The entries that count at `now`: a suffix, as they are sorted.
    fn live<'a>(&self, state: &'a State, now: u64) -> &'a [(u64, u64)] {
        let first = state
            .entries
            .partition_point(|&(ts, _)| self.expiry(ts) <= u128::from(now));
        &state.entries[first..]
    }

    /// Nanoseconds from `now` until every entry of `live` has expired.
    fn reset_ns(&self, live: &[(u64, u64)], now: u64) -> u64 {
        live.last().map_or(0, |&(ts, _)| ns_until(self.expiry(ts), now))
    }

    /// Whether a request of `cost` units is admitted at `now`.
    pub fn check(&self, state: &State, now: u64, cost: u64) -> Verdict<State> {
        let live = self.live(state, now);
        let used: u128 = live.iter().map(|&(_, c)| u128::from(c)).sum();
        let total = used + u128::from(cost);
        let limit = u128::from(self.limit);
        if total <= limit {
            let mut entries = live.to_vec();
            if cost > 0 {
                let at = entries.partition_point(|&(ts, _)| ts < now);
                match entries.get_mut(at) {
                    // cost ≤ total ≤ limit, so the merged cost cannot overflow.
                    Some(entry) if entry.0 == now => entry.1 = entry.1.saturating_add(cost),
                    _ => entries.insert(at, (now, cost)),
                }
            }
            let reset_ns = self.reset_ns(&entries, now);
            return Verdict::Admit {
                state: State { entries },
                remaining: self.limit - total as u64,
                reset_ns,
            };
        }
        let wait_ns = if cost > self.limit {
            u64::MAX
        } else {
            // Entries expire oldest first; wait for enough of them to go.
            let excess = total - limit;
            let mut freed = 0u128;
            live.iter()
                .find(|&&(_, c)| {
                    freed += u128::from(c);
                    freed >= excess
                })
                .map_or(u64::MAX, |&(ts, _)| ns_until(self.expiry(ts), now))
        };
        Verdict::Deny {
            wait_ns,
            remaining: u64::try_from(limit.saturating_sub(used)).unwrap_or(0),
            reset_ns: self.reset_ns(live, now),
        }
    }

    /// Charges `units` more without admission (a cost settled after the
    /// response) to the entry recorded at `charged_at` (the request's own,
    /// as [`State::refund`] finds it), else the latest counting entry, else
    /// a new one at `now`: an exact log has no debt, so the counting costs
    /// never pass `limit`, and what does not fit is written off (returned).
    /// No entry is added while one counts, so the log's bound on its
    /// entries (and its encoded length) holds.
    pub fn settle_more(&self, state: &State, units: u64, charged_at: u64, now: u64) -> (State, u64) {
        let live = self.live(state, now);
        let used: u64 = live.iter().fold(0, |sum, &(_, c)| sum.saturating_add(c));
        let add = units.min(self.limit.saturating_sub(used));
        let mut entries = live.to_vec();
        if add > 0 {
            let own = entries.iter().rposition(|&(ts, _)| ts == charged_at);
            match own.or_else(|| entries.len().checked_sub(1)) {
                Some(i) => {
                    if let Some(e) = entries.get_mut(i) {
                        e.1 = e.1.saturating_add(add);
                    }
                }
                None => entries.push((now, add)),
            }
        }
        (State { entries }, units - add)
    }

    /// `state` with the entries stamped after `now` (the clock stepped
    /// back) merged into one at `now`; `None` if there are none. Keeps the
    /// invariants: sorted, non-zero costs, no more entries than before.
    pub fn saturate(&self, state: &State, now: u64) -> Option<State> {
        if state.entries.last().is_none_or(|&(ts, _)| ts <= now) {
            return None;
        }
        let at = state.entries.partition_point(|&(ts, _)| ts < now);
        let moved = state.entries[at..]
            .iter()
            .fold(0u64, |sum, &(_, c)| sum.saturating_add(c));
        let mut entries = state.entries[..at].to_vec();
        entries.push((now, moved));
        Some(State { entries })
    }

    /// Whether nothing in `state` still counts at `now`.
    pub fn is_idle(&self, state: &State, now: u64) -> bool {
        self.live(state, now).is_empty()
    }

    /// Appends `state`: the entry count as a LEB128 varint, then the first
    /// timestamp as 8 little-endian bytes and each later one as a varint
    /// delta from the previous, each followed by its cost as a varint.
    pub fn encode(state: &State, out: &mut Vec<u8>) {
        put_varint(out, state.entries.len() as u64);
        let mut prev = None;
        for &(ts, cost) in &state.entries {
            match prev {
                None => put_u64(out, ts),
                Some(p) => put_varint(out, ts.wrapping_sub(p)),
            }
            put_varint(out, cost);
            prev = Some(ts);
        }
    }

    /// Reads a state written by [`SlidingWindowLog::encode`] from the start
    /// of `bytes`; returns it and the bytes consumed, or `None` if malformed:
    /// more than [`MAX_LOG_ENTRIES`] entries, a zero cost, or timestamps not
    /// strictly increasing.
    pub fn decode(bytes: &[u8]) -> Option<(State, usize)> {
        let mut pos = 0;
        let n = usize::try_from(get_varint(bytes, &mut pos)?).ok()?;
        if n > MAX_LOG_ENTRIES {
            return None;
        }
        let mut entries = Vec::with_capacity(n);
        let mut prev: Option<u64> = None;
        for _ in 0..n {
            let ts = match prev {
                None => get_u64(bytes, &mut pos)?,
                Some(p) => match get_varint(bytes, &mut pos)? {
                    0 => return None,
                    delta => p.checked_add(delta)?,
                },
            };
            let cost = get_varint(bytes, &mut pos)?;
            if cost == 0 {
                return None;
            }
            entries.push((ts, cost));
            prev = Some(ts);
        }
        Some((State { entries }, pos))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::testkit::{self, max_rolling, take, Algo, XorShift, S, T0};

    impl Algo for SlidingWindowLog {
        type State = State;
        fn limit(&self) -> u64 {
            self.limit
        }
        fn check(&self, state: &State, now: u64, cost: u64) -> Verdict<State> {
            SlidingWindowLog::check(self, state, now, cost)
        }
        fn is_idle(&self, state: &State, now: u64) -> bool {
            SlidingWindowLog::is_idle(self, state, now)
        }
        fn encode(state: &State, out: &mut Vec<u8>) {
            SlidingWindowLog::encode(state, out)
        }
        fn decode(bytes: &[u8]) -> Option<(State, usize)> {
            SlidingWindowLog::decode(bytes)
        }
    }

    fn log(limit: u64, window_ns: u64) -> SlidingWindowLog {
        SlidingWindowLog::new(limit, window_ns).unwrap()
    }

    #[test]
    fn a_settled_cost_fills_the_requests_own_entry_up_to_the_limit() {
        let log = SlidingWindowLog::new(10, S).unwrap();
        let mut st = State::default();
        assert!(take(&log, &mut st, T0, 2));
        assert!(take(&log, &mut st, T0 + 1, 3));
        // The first request really cost 7: its own entry, capped at the limit.
        let (settled, lost) = log.settle_more(&st, 5, T0, T0 + 2);
        assert_eq!((settled.entries(), lost), (&[(T0, 7), (T0 + 1, 3)][..], 0));
        let (full, lost) = log.settle_more(&settled, 4, T0, T0 + 2);
        assert_eq!((full.entries(), lost), (&[(T0, 7), (T0 + 1, 3)][..], 4));
        // Its entry expired: the latest counting one takes it.
        let (late, lost) = log.settle_more(&st, 1, T0, T0 + S);
        assert_eq!((late.entries(), lost), (&[(T0 + 1, 4)][..], 0));
        // Nothing counts any more: one new entry at now.
        let (fresh, lost) = log.settle_more(&st, 12, T0, T0 + 5 * S);
        assert_eq!((fresh.entries(), lost), (&[(T0 + 5 * S, 10)][..], 2));
    }

    #[test]
    fn the_rolling_window_frees_each_unit_exactly_when_it_leaves() {
        let l = log(3, 10 * S);
        let mut st = State::default();
        assert!(take(&l, &mut st, T0, 1));
        assert!(take(&l, &mut st, T0 + 2 * S, 2));
        assert_eq!(
            l.check(&st, T0 + 5 * S, 1),
            Verdict::Deny {
                wait_ns: 5 * S,
                remaining: 0,
                reset_ns: 7 * S
            }
        );
        // The unit from T0 leaves at T0 + 10 s; two more need T0 + 12 s.
        assert!(!take(&l, &mut st, T0 + 10 * S - 1, 1));
        assert!(take(&l, &mut st, T0 + 10 * S, 1));
        assert!(!l.check(&st, T0 + 10 * S, 2).is_admit());
        match l.check(&st, T0 + 11 * S, 3) {
            Verdict::Deny { wait_ns, .. } => assert_eq!(wait_ns, 9 * S),
            other => panic!("expected a denial, got {other:?}"),
        }
        // No boundary burst: 3 at the end of one window, none just after.
        assert_eq!(st.entries(), &[(T0 + 2 * S, 2), (T0 + 10 * S, 1)]);
    }

    #[test]
    fn same_instant_costs_share_one_entry_and_the_log_stays_bounded() {
        let l = log(MAX_LOG_ENTRIES as u64, S);
        let mut st = State::default();
        let mut now = T0;
        for i in 0..5 * MAX_LOG_ENTRIES as u64 {
            now += 1 + i % 3 * 1_000_000;
            take(&l, &mut st, now, 1);
            take(&l, &mut st, now, 1);
            assert!(st.entries().len() <= MAX_LOG_ENTRIES);
        }
        let mut bytes = Vec::new();
        SlidingWindowLog::encode(&st, &mut bytes);
        assert!(bytes.len() <= 8 + 6 * st.entries().len());
        assert!(SlidingWindowLog::new(MAX_LOG_ENTRIES as u64 + 1, S).is_none());
    }

    #[test]
    fn random_traffic_is_exact_against_a_brute_force_reference() {
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        for round in 0..50 {
            let limit = rng.below(16) + 1;
            let w = if round % 2 == 0 {
                rng.below(40) + 1
            } else {
                rng.below(5 * S) + 1
            };
            let l = log(limit, w);
            // Every admission so far, on the (monotonic) clock.
            let mut history: Vec<(u64, u64)> = Vec::new();
            let admitted = testkit::simulate(&l, &mut rng, w, 300, false, |now, cost, admit| {
                let in_window: u64 = history
                    .iter()
                    .filter(|&&(t, _)| t + w > now)
                    .map(|&(_, c)| c)
                    .sum();
                // Admitted iff the rolling window ending now stays ≤ limit.
                assert_eq!(admit, in_window + cost <= limit, "at {now}");
                if admit && cost > 0 {
                    history.push((now, cost));
                }
            });
            assert!(max_rolling(&admitted, w) <= limit);
            assert!(max_rolling(&history, w) <= limit);
        }
    }

    #[test]
    fn a_clock_stepping_backwards_stays_exact_in_real_time() {
        let mut rng = XorShift(0x2545_F491_4F6C_DD1D);
        for round in 0..50 {
            let limit = rng.below(16) + 1;
            let w = if round % 2 == 0 {
                rng.below(40) + 1
            } else {
                rng.below(5 * S) + 1
            };
            let l = log(limit, w);
            let admitted = testkit::simulate(&l, &mut rng, w, 300, true, |_, _, _| {});
            assert!(max_rolling(&admitted, w) <= limit);
        }
    }

    #[test]
    fn entries_from_the_future_are_moved_to_now_and_count_one_window_from_then() {
        let l = log(3, 10 * S);
        // One unit at T0 − 5 s, two recorded while the clock ran a minute
        // ahead (as a step back leaves them); the clock is back at T0.
        let st = State {
            entries: vec![(T0 - 5 * S, 1), (T0 + 60 * S, 2)],
        };
        let back = T0;
        // `check` alone keeps a future entry until its own expiry (70 s)...
        match l.check(&st, back, 1) {
            Verdict::Deny { wait_ns, .. } => assert_eq!(wait_ns, 5 * S),
            other => panic!("expected a denial, got {other:?}"),
        }
        // ...saturating (what `Algo::load` does) moves it to `now`: past
        // entries stay, the future ones merge, nothing is forgotten.
        let saturated = l.saturate(&st, back).unwrap();
        assert_eq!(saturated.entries(), &[(T0 - 5 * S, 1), (back, 2)]);
        assert_eq!(l.saturate(&saturated, back), None, "idempotent");
        let mut bytes = Vec::new();
        SlidingWindowLog::encode(&saturated, &mut bytes);
        assert_eq!(
            SlidingWindowLog::decode(&bytes),
            Some((saturated.clone(), bytes.len()))
        );
        // The moved units count one window from `back`, not until T0 + 70 s.
        let mut st = saturated;
        assert!(!take(&l, &mut st, back + 9 * S, 2));
        assert!(take(&l, &mut st, back + 10 * S, 3));
    }

    #[test]
    fn decode_never_panics_and_refuses_malformed_logs() {
        let mut rng = XorShift(7);
        let l = log(5, S);
        let mut st = State::default();
        for i in 0..5 {
            take(&l, &mut st, T0 + i * 1000, 1);
        }
        testkit::fuzz_decode::<SlidingWindowLog>(&mut rng, &[State::default(), st.clone()]);

        // A length prefix beyond the cap is refused before reading entries.
        let mut long = Vec::new();
        put_varint(&mut long, MAX_LOG_ENTRIES as u64 + 1);
        assert_eq!(SlidingWindowLog::decode(&long), None);
        let mut huge = Vec::new();
        put_varint(&mut huge, u64::MAX);
        assert_eq!(SlidingWindowLog::decode(&huge), None);
        // Zero cost, or a repeated timestamp (delta 0).
        let mut zero_cost = Vec::new();
        put_varint(&mut zero_cost, 1);
        put_u64(&mut zero_cost, T0);
        put_varint(&mut zero_cost, 0);
        assert_eq!(SlidingWindowLog::decode(&zero_cost), None);
        let mut repeated = Vec::new();
        put_varint(&mut repeated, 2);
        put_u64(&mut repeated, T0);
        put_varint(&mut repeated, 1);
        put_varint(&mut repeated, 0);
        put_varint(&mut repeated, 1);
        assert_eq!(SlidingWindowLog::decode(&repeated), None);
        // A delta that runs past the end of time.
        let mut past_end = Vec::new();
        put_varint(&mut past_end, 2);
        put_u64(&mut past_end, u64::MAX);
        put_varint(&mut past_end, 1);
        put_varint(&mut past_end, 1);
        put_varint(&mut past_end, 1);
        assert_eq!(SlidingWindowLog::decode(&past_end), None);
    }

    #[test]
    fn invalid_parameters_are_refused() {
        assert!(SlidingWindowLog::new(0, S).is_none());
        assert!(SlidingWindowLog::new(1, 0).is_none());
        assert!(SlidingWindowLog::new(1025, S).is_none());
        assert!(SlidingWindowLog::new(1024, u64::MAX).is_some());
    }
}
