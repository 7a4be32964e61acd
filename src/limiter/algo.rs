//! A limit's algorithm as the engine uses it: one enum over every algorithm,
//! with the operations the key table needs. Loading a stored record,
//! migrating it when a reload changed the limit, checking a request,
//! encoding the new state, telling whether a state is idle (reclaimable),
//! and refunding a charge.
//!
//! What a reload that changes a live limit does, per algorithm (the stored
//! record carries the parameters it was written under):
//! * token bucket: the bucket keeps its fill level in tokens, capped at the
//!   new burst, as of the instant the new policy took effect; it refills at
//!   the new rate from then. A reload never adds tokens.
//! * fixed window: the count of the window current at the reload carries
//!   into the new window current at the reload (a changed window length
//!   never opens a fresh window); a changed limit applies to that count.
//! * sliding window log and counter: the recorded admissions stay as they
//!   are and are read under the new limit and window.
//!
//! A record of another algorithm (the limit's `algorithm` changed) starts
//! fresh.

use super::fixed_window::{self, FixedWindow};
use super::sliding_window_counter::{self, SlidingWindowCounter};
use super::sliding_window_log::{self, SlidingWindowLog};
use super::token_bucket::{Check, Gcra};
use super::Verdict;
use crate::table::Record;

/// Stored `kind` byte of each algorithm (never reuse a value).
pub const KIND_TOKEN_BUCKET: u8 = 1;
pub const KIND_FIXED_WINDOW: u8 = 2;
pub const KIND_SLIDING_WINDOW_LOG: u8 = 3;
pub const KIND_SLIDING_WINDOW_COUNTER: u8 = 4;
/// A global limit's allowance on this node (leases from the central
/// cluster), stored beside the algorithms' records; only its kind byte is
/// defined here.
pub const KIND_GLOBAL_ALLOWANCE: u8 = 5;

/// A compiled limit's algorithm and parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    TokenBucket(Gcra),
    FixedWindow(FixedWindow),
    SlidingWindowLog(SlidingWindowLog),
    SlidingWindowCounter(SlidingWindowCounter),
}

/// What a reload does to a limit's live state (see [`Algo::carry_from`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carry {
    /// Same algorithm and parameters: the state is used as it is.
    Keeps,
    /// Same algorithm, other parameters: the fill level (count) carries
    /// over, capped at the new burst (limit), as of the reload.
    Migrated,
    /// Another algorithm wrote it: it starts fresh.
    Fresh,
}

/// One limit's state for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// The theoretical arrival time (see [`Gcra`]).
    TokenBucket {
        tat: u64,
    },
    FixedWindow(fixed_window::State),
    SlidingWindowLog(sliding_window_log::State),
    SlidingWindowCounter(sliding_window_counter::State),
}

/// What a limit says about one request (see [`Verdict`]).
pub type Outcome = Verdict<State>;

fn read_u64(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

/// Decodes a whole stored state (trailing bytes make it unreadable).
fn whole<S>(decoded: Option<(S, usize)>, len: usize) -> Option<S> {
    decoded.filter(|(_, used)| *used == len).map(|(s, _)| s)
}

fn map<S>(verdict: Verdict<S>, wrap: impl FnOnce(S) -> State) -> Outcome {
    match verdict {
        Verdict::Admit {
            state,
            remaining,
            reset_ns,
        } => Verdict::Admit {
            state: wrap(state),
            remaining,
            reset_ns,
        },
        Verdict::Deny {
            wait_ns,
            remaining,
            reset_ns,
        } => Verdict::Deny {
            wait_ns,
            remaining,
            reset_ns,
        },
    }
}

impl Algo {
    pub fn kind(&self) -> u8 {
        match self {
            Algo::TokenBucket(_) => KIND_TOKEN_BUCKET,
            Algo::FixedWindow(_) => KIND_FIXED_WINDOW,
            Algo::SlidingWindowLog(_) => KIND_SLIDING_WINDOW_LOG,
            Algo::SlidingWindowCounter(_) => KIND_SLIDING_WINDOW_COUNTER,
        }
    }

    /// The parameters stored beside the state (`p1`, `p2`).
    pub fn params(&self) -> (u64, u64) {
        match self {
            Algo::TokenBucket(g) => (g.interval_ns(), g.tolerance_ns()),
            Algo::FixedWindow(a) => (a.limit(), a.window_ns()),
            Algo::SlidingWindowLog(a) => (a.limit(), a.window_ns()),
            Algo::SlidingWindowCounter(a) => (a.limit(), a.window_ns()),
        }
    }

    /// The most bytes [`Algo::encode`] writes for any state of this limit.
    pub fn max_state_len(&self) -> usize {
        match self {
            Algo::TokenBucket(_) => 8,
            // Two varints.
            Algo::FixedWindow(_) => 20,
            Algo::SlidingWindowLog(a) => a.max_state_len(),
            // A u64 and two varints.
            Algo::SlidingWindowCounter(_) => 28,
        }
    }

    pub fn fresh(&self) -> State {
        match self {
            Algo::TokenBucket(_) => State::TokenBucket { tat: 0 },
            Algo::FixedWindow(_) => State::FixedWindow(Default::default()),
            Algo::SlidingWindowLog(_) => State::SlidingWindowLog(Default::default()),
            Algo::SlidingWindowCounter(_) => State::SlidingWindowCounter(Default::default()),
        }
    }

    /// Decodes a record written by this algorithm (any parameters).
    fn decode(&self, r: &Record<'_>) -> Option<State> {
        if r.kind != self.kind() {
            return None;
        }
        let len = r.state.len();
        Some(match self {
            Algo::TokenBucket(_) => State::TokenBucket {
                tat: read_u64(r.state)?,
            },
            Algo::FixedWindow(_) => State::FixedWindow(whole(FixedWindow::decode(r.state), len)?),
            Algo::SlidingWindowLog(_) => {
                State::SlidingWindowLog(whole(SlidingWindowLog::decode(r.state), len)?)
            }
            Algo::SlidingWindowCounter(_) => {
                State::SlidingWindowCounter(whole(SlidingWindowCounter::decode(r.state), len)?)
            }
        })
    }

    /// This limit's state from its stored record (`None`: a new key, or a
    /// new limit: fresh). A record written under other parameters is
    /// migrated as of `effective_from`, when the current policy took effect
    /// (see the module header). Every algorithm is also normalised for
    /// `now`: a clock step backwards is saturated (a state left ahead of
    /// `now` by a clock that ran ahead keeps what it counted, but waits at
    /// most one refill or window from `now`, not for the clock). Returns the
    /// state and whether it differs from what is stored (the caller then
    /// persists it, on a denial too).
    pub fn load(&self, record: Option<&Record<'_>>, effective_from: u64, now: u64) -> (State, bool) {
        let (state, changed) = self.load_migrated(record, effective_from, now);
        let saturated = match (self, &state) {
            (Algo::FixedWindow(a), State::FixedWindow(s)) => a.saturate(s, now).map(State::FixedWindow),
            (Algo::SlidingWindowLog(a), State::SlidingWindowLog(s)) => {
                a.saturate(s, now).map(State::SlidingWindowLog)
            }
            (Algo::SlidingWindowCounter(a), State::SlidingWindowCounter(s)) => {
                a.saturate(s, now).map(State::SlidingWindowCounter)
            }
            // The token bucket saturates in `load_migrated`.
            _ => None,
        };
        match saturated {
            Some(s) => (s, true),
            None => (state, changed),
        }
    }

    /// What a reload does to a live state written by a limit of the same
    /// name with `kind` and `params` (what [`Algo::load`] then does with
    /// such a record): [`Carry::Keeps`] it, [`Carry::Migrated`] to the new
    /// parameters (never adding tokens: capped at the new burst or limit),
    /// or [`Carry::Fresh`] (another algorithm wrote it).
    pub fn carry_from(&self, kind: u8, params: (u64, u64)) -> Carry {
        if kind != self.kind() {
            Carry::Fresh
        } else if params == self.params() {
            Carry::Keeps
        } else {
            Carry::Migrated
        }
    }

    fn load_migrated(&self, record: Option<&Record<'_>>, effective_from: u64, now: u64) -> (State, bool) {
        let Some(r) = record else {
            return (self.fresh(), false);
        };
        let Some(stored) = self.decode(r) else {
            return (self.fresh(), true);
        };
        let same_params = self.carry_from(r.kind, (r.p1, r.p2)) == Carry::Keeps;
        match (self, stored) {
            (Algo::TokenBucket(g), State::TokenBucket { tat }) => {
                let migrated = if same_params {
                    tat
                } else {
                    match Gcra::from_stored(r.p1, r.p2) {
                        Some(old) => g.migrate_tat(&old, tat, effective_from),
                        // Unusable stored parameters: be conservative, start empty.
                        None => effective_from.saturating_add(g.tolerance_ns()),
                    }
                };
                let saturated = g.saturate(migrated, now);
                (State::TokenBucket { tat: saturated }, saturated != tat)
            }
            (Algo::FixedWindow(a), State::FixedWindow(s)) if !same_params && r.p2 != a.window_ns() => {
                // A new window length: the count of the window current at
                // the reload moves into the new window current then.
                let current_then = r.p2 > 0 && s.window == effective_from / r.p2;
                let count = if current_then { s.count } else { 0 };
                let moved = fixed_window::State {
                    window: effective_from / a.window_ns(),
                    count,
                };
                (State::FixedWindow(moved), true)
            }
            (_, stored) => (stored, false),
        }
    }

    pub fn check(&self, state: &State, now: u64, cost: u64) -> Outcome {
        match (self, state) {
            (Algo::TokenBucket(g), State::TokenBucket { tat }) => match g.check(*tat, now, cost) {
                Check::Admit { new_tat, remaining } => Verdict::Admit {
                    state: State::TokenBucket { tat: new_tat },
                    remaining,
                    reset_ns: g.time_to_full_ns(new_tat, now),
                },
                Check::Deny { wait_ns } => Verdict::Deny {
                    wait_ns,
                    remaining: g.available(*tat, now),
                    reset_ns: g.time_to_full_ns(*tat, now),
                },
            },
            (Algo::FixedWindow(a), State::FixedWindow(s)) => map(a.check(s, now, cost), State::FixedWindow),
            (Algo::SlidingWindowLog(a), State::SlidingWindowLog(s)) => {
                map(a.check(s, now, cost), State::SlidingWindowLog)
            }
            (Algo::SlidingWindowCounter(a), State::SlidingWindowCounter(s)) => {
                map(a.check(s, now, cost), State::SlidingWindowCounter)
            }
            // A state of another algorithm: `load` never returns one.
            _ => self.check(&self.fresh(), now, cost),
        }
    }

    /// Gives back a charge of `cost` made at `charged_at` (a later limit in
    /// the chain denied the request).
    pub fn refund(&self, state: &State, cost: u64, charged_at: u64) -> State {
        match (self, state) {
            (Algo::TokenBucket(g), State::TokenBucket { tat }) => State::TokenBucket {
                tat: tat.saturating_sub(cost.saturating_mul(g.interval_ns())),
            },
            (Algo::FixedWindow(a), State::FixedWindow(s)) => {
                let mut s = *s;
                if s.window == charged_at / a.window_ns() {
                    s.count = s.count.saturating_sub(cost);
                }
                State::FixedWindow(s)
            }
            (Algo::SlidingWindowLog(_), State::SlidingWindowLog(s)) => {
                let mut s = s.clone();
                s.refund(charged_at, cost);
                State::SlidingWindowLog(s)
            }
            (Algo::SlidingWindowCounter(a), State::SlidingWindowCounter(s)) => {
                let mut s = *s;
                if s.last_ns / a.window_ns() == charged_at / a.window_ns() {
                    s.curr = s.curr.saturating_sub(cost);
                }
                State::SlidingWindowCounter(s)
            }
            (_, other) => other.clone(),
        }
    }

    pub fn encode(state: &State, out: &mut Vec<u8>) {
        match state {
            State::TokenBucket { tat } => out.extend_from_slice(&tat.to_le_bytes()),
            State::FixedWindow(s) => FixedWindow::encode(s, out),
            State::SlidingWindowLog(s) => SlidingWindowLog::encode(s, out),
            State::SlidingWindowCounter(s) => SlidingWindowCounter::encode(s, out),
        }
    }

    /// Whether a record of one of these algorithms is back to its fresh
    /// state at `now` (see [`crate::engine::record_is_idle`], the key
    /// table's test, which also knows global allowances). A record no
    /// algorithm here can read counts as idle.
    pub fn record_is_idle(record: &Record<'_>, now: u64) -> bool {
        let Some(algo) = Algo::of_record(record) else {
            return true;
        };
        match (algo, algo.decode(record)) {
            (_, None) => true,
            (Algo::TokenBucket(_), Some(State::TokenBucket { tat })) => tat <= now,
            (Algo::FixedWindow(a), Some(State::FixedWindow(s))) => a.is_idle(&s, now),
            (Algo::SlidingWindowLog(a), Some(State::SlidingWindowLog(s))) => a.is_idle(&s, now),
            (Algo::SlidingWindowCounter(a), Some(State::SlidingWindowCounter(s))) => a.is_idle(&s, now),
            _ => true,
        }
    }

    /// The algorithm a stored record was written by, from its parameters.
    fn of_record(r: &Record<'_>) -> Option<Algo> {
        Some(match r.kind {
            KIND_TOKEN_BUCKET => Algo::TokenBucket(Gcra::from_stored(r.p1, r.p2)?),
            KIND_FIXED_WINDOW => Algo::FixedWindow(FixedWindow::new(r.p1, r.p2)?),
            KIND_SLIDING_WINDOW_LOG => Algo::SlidingWindowLog(SlidingWindowLog::new(r.p1, r.p2)?),
            KIND_SLIDING_WINDOW_COUNTER => Algo::SlidingWindowCounter(SlidingWindowCounter::new(r.p1, r.p2)?),
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;
    const T0: u64 = 1_796_000_000 * S;

    fn record<'a>(algo: &Algo, state: &'a [u8]) -> Record<'a> {
        let (p1, p2) = algo.params();
        Record {
            name_hash: 1,
            kind: algo.kind(),
            p1,
            p2,
            state,
        }
    }

    fn all() -> [Algo; 4] {
        [
            Algo::TokenBucket(Gcra::new(5, S, 5).unwrap()),
            Algo::FixedWindow(FixedWindow::new(5, S).unwrap()),
            Algo::SlidingWindowLog(SlidingWindowLog::new(5, S).unwrap()),
            Algo::SlidingWindowCounter(SlidingWindowCounter::new(5, S).unwrap()),
        ]
    }

    #[test]
    fn every_algorithm_round_trips_through_its_record_refunds_and_goes_idle() {
        for algo in all() {
            let (fresh, changed) = algo.load(None, T0, T0);
            assert!(!changed);
            let Verdict::Admit { state, remaining, .. } = algo.check(&fresh, T0, 2) else {
                panic!("{algo:?}")
            };
            assert_eq!(remaining, 3, "{algo:?}");
            let mut bytes = Vec::new();
            Algo::encode(&state, &mut bytes);
            let stored = record(&algo, &bytes);
            assert_eq!(
                algo.load(Some(&stored), T0, T0),
                (state.clone(), false),
                "{algo:?}"
            );
            assert!(!Algo::record_is_idle(&stored, T0), "{algo:?}");
            assert!(Algo::record_is_idle(&stored, T0 + 3 * S), "{algo:?}");
            // Refunding the charge restores the fresh level.
            let refunded = algo.refund(&state, 2, T0);
            let Verdict::Admit { remaining, .. } = algo.check(&refunded, T0, 1) else {
                panic!("{algo:?}")
            };
            assert_eq!(remaining, 4, "{algo:?}");
        }
    }

    #[test]
    fn no_state_encodes_longer_than_max_state_len() {
        // The fullest states: a log of `limit` entries spread over a year
        // (7-byte deltas), and the other algorithms' varints at their largest.
        let year = 366 * 86_400 * S;
        let log = SlidingWindowLog::new(1024, year).unwrap();
        let mut st = Algo::SlidingWindowLog(log).fresh();
        let algo = Algo::SlidingWindowLog(log);
        for i in 0..1024u64 {
            let Verdict::Admit { state, .. } = algo.check(&st, T0 + i * (year / 1024), 1) else {
                panic!("{i}")
            };
            st = state;
        }
        let mut out = Vec::new();
        Algo::encode(&st, &mut out);
        assert!(
            out.len() <= algo.max_state_len(),
            "{} > {}",
            out.len(),
            algo.max_state_len()
        );
        let big = u64::MAX;
        for (algo, state) in [
            (
                Algo::TokenBucket(Gcra::new(5, S, 5).unwrap()),
                State::TokenBucket { tat: big },
            ),
            (
                Algo::FixedWindow(FixedWindow::new(5, S).unwrap()),
                State::FixedWindow(fixed_window::State {
                    window: big,
                    count: big,
                }),
            ),
            (
                Algo::SlidingWindowCounter(SlidingWindowCounter::new(5, S).unwrap()),
                State::SlidingWindowCounter(sliding_window_counter::State {
                    last_ns: big,
                    prev: big,
                    curr: big,
                }),
            ),
        ] {
            out.clear();
            Algo::encode(&state, &mut out);
            assert_eq!(out.len(), algo.max_state_len(), "{algo:?}");
        }
    }

    #[test]
    fn unreadable_or_foreign_records_start_fresh_and_are_reclaimable() {
        for algo in all() {
            let junk = Record {
                name_hash: 1,
                kind: 99,
                p1: 0,
                p2: 0,
                state: &[1, 2],
            };
            assert_eq!(algo.load(Some(&junk), T0, T0), (algo.fresh(), true));
            assert!(Algo::record_is_idle(&junk, T0));
            let short = record(&algo, &[0xff; 3]);
            let (state, _) = algo.load(Some(&short), T0, T0);
            assert!(
                matches!(algo.check(&state, T0, 1), Verdict::Admit { .. }),
                "{algo:?}"
            );
        }
    }

    #[test]
    fn a_forward_clock_excursion_blocks_a_window_limit_for_two_windows_at_most() {
        // Regression: admissions made while the clock ran an hour ahead kept
        // the window algorithms shut for the hour after it came back (the
        // token bucket already saturated: at most one refill).
        let hour = 3600 * S;
        for algo in all() {
            if matches!(algo, Algo::TokenBucket(_)) {
                continue;
            }
            // The limit (5) used up at T0 + 1 h, the clock ahead.
            let mut st = algo.fresh();
            for i in 0..5 {
                let Verdict::Admit { state, .. } = algo.check(&st, T0 + hour + i, 1) else {
                    panic!("{algo:?}")
                };
                st = state;
            }
            let mut bytes = Vec::new();
            Algo::encode(&st, &mut bytes);
            // The clock comes back to T0: what the key used still counts (no
            // fresh limit), and the engine persists the normalised state.
            let (loaded, changed) = algo.load(Some(&record(&algo, &bytes)), T0, T0);
            assert!(changed, "{algo:?}: normalised, so a denial persists it");
            assert!(
                matches!(algo.check(&loaded, T0, 1), Verdict::Deny { .. }),
                "{algo:?}"
            );
            bytes.clear();
            Algo::encode(&loaded, &mut bytes);
            // Two windows later, not an hour: admitted again.
            let later = T0 + 2 * S;
            let (loaded, _) = algo.load(Some(&record(&algo, &bytes)), T0, later);
            assert!(
                matches!(algo.check(&loaded, later, 1), Verdict::Admit { .. }),
                "{algo:?} still blocked by the excursion"
            );
        }
    }

    #[test]
    fn a_fixed_window_whose_length_changes_keeps_its_count() {
        let old = Algo::FixedWindow(FixedWindow::new(5, S).unwrap());
        let Verdict::Admit { state, .. } = old.check(&old.fresh(), T0, 5) else {
            panic!()
        };
        let mut bytes = Vec::new();
        Algo::encode(&state, &mut bytes);
        let new = Algo::FixedWindow(FixedWindow::new(5, 60 * S).unwrap());
        let (moved, changed) = new.load(Some(&record(&old, &bytes)), T0, T0);
        assert!(changed);
        assert!(
            matches!(new.check(&moved, T0, 1), Verdict::Deny { .. }),
            "no fresh window on reload"
        );
    }
}
