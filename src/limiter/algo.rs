//! A limit's algorithm as the engine uses it: one enum over every algorithm,
//! with the operations the key table needs. Loading a stored record,
//! migrating it when a reload changed the limit, checking a request,
//! encoding the new state, telling whether a state is idle (reclaimable),
//! and refunding a charge.

use super::token_bucket::{Check, Gcra};
use crate::state::Record;

/// Stored `kind` byte of each algorithm (never reuse a value).
pub const KIND_TOKEN_BUCKET: u8 = 1;

/// A compiled limit's algorithm and parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    TokenBucket(Gcra),
}

/// One limit's state for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// The theoretical arrival time (see [`Gcra`]).
    TokenBucket { tat: u64 },
}

/// What a limit says about one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Admitted: store `state`; `remaining` whole units left; the limit is
    /// fully available again in `reset_ns`.
    Admit {
        state: State,
        remaining: u64,
        reset_ns: u64,
    },
    /// Denied, nothing charged; admitted after `wait_ns` if nothing else
    /// arrives.
    Deny {
        wait_ns: u64,
        remaining: u64,
        reset_ns: u64,
    },
}

impl Algo {
    pub fn kind(&self) -> u8 {
        match self {
            Algo::TokenBucket(_) => KIND_TOKEN_BUCKET,
        }
    }

    /// The parameters stored beside the state (`p1`, `p2`).
    pub fn params(&self) -> (u64, u64) {
        match self {
            Algo::TokenBucket(g) => (g.interval_ns(), g.tolerance_ns()),
        }
    }

    pub fn fresh(&self) -> State {
        match self {
            Algo::TokenBucket(_) => State::TokenBucket { tat: 0 },
        }
    }

    /// This limit's state from its stored record (`None`: a new key, or a
    /// new limit: fresh). A record written under other parameters is
    /// migrated as of `effective_from`, when the current policy took effect;
    /// a record of another algorithm starts fresh. Also normalises the state
    /// for `now` (a clock step backwards is saturated). Returns the state and
    /// whether it differs from what is stored.
    pub fn load(&self, record: Option<&Record<'_>>, effective_from: u64, now: u64) -> (State, bool) {
        let Some(r) = record else {
            return (self.fresh(), false);
        };
        match self {
            Algo::TokenBucket(g) => {
                let Some(stored) = read_u64(r.state).filter(|_| r.kind == KIND_TOKEN_BUCKET) else {
                    return (self.fresh(), true);
                };
                let migrated = if (r.p1, r.p2) == self.params() {
                    stored
                } else {
                    match Gcra::from_stored(r.p1, r.p2) {
                        Some(old) => g.migrate_tat(&old, stored, effective_from),
                        // Unusable stored parameters: be conservative, start empty.
                        None => effective_from.saturating_add(g.tolerance_ns()),
                    }
                };
                let tat = g.saturate(migrated, now);
                (State::TokenBucket { tat }, tat != stored)
            }
        }
    }

    pub fn check(&self, state: &State, now: u64, cost: u64) -> Outcome {
        match (self, state) {
            (Algo::TokenBucket(g), State::TokenBucket { tat }) => match g.check(*tat, now, cost) {
                Check::Admit { new_tat, remaining } => Outcome::Admit {
                    state: State::TokenBucket { tat: new_tat },
                    remaining,
                    reset_ns: g.time_to_full_ns(new_tat, now),
                },
                Check::Deny { wait_ns } => Outcome::Deny {
                    wait_ns,
                    remaining: g.available(*tat, now),
                    reset_ns: g.time_to_full_ns(*tat, now),
                },
            },
        }
    }

    /// Gives back a charge of `cost` made at `charged_at` (a later limit in
    /// the chain denied the request).
    pub fn refund(&self, state: &State, cost: u64, _charged_at: u64) -> State {
        match (self, state) {
            (Algo::TokenBucket(g), State::TokenBucket { tat }) => State::TokenBucket {
                tat: tat.saturating_sub(cost.saturating_mul(g.interval_ns())),
            },
        }
    }

    pub fn encode(state: &State, out: &mut Vec<u8>) {
        match state {
            State::TokenBucket { tat } => out.extend_from_slice(&tat.to_le_bytes()),
        }
    }
}

fn read_u64(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

/// Whether a stored record is back to its fresh state at `now`: then its
/// slot can be reclaimed without losing anything. A record this version
/// cannot read counts as idle.
pub fn record_is_idle(record: &Record<'_>, now: u64) -> bool {
    match record.kind {
        KIND_TOKEN_BUCKET => read_u64(record.state).is_none_or(|tat| tat <= now),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;
    const T0: u64 = 1_796_000_000 * S;

    fn record(state: &[u8], p: (u64, u64)) -> Record<'_> {
        Record {
            name_hash: 1,
            kind: KIND_TOKEN_BUCKET,
            p1: p.0,
            p2: p.1,
            state,
        }
    }

    #[test]
    fn a_token_bucket_round_trips_through_its_record() {
        let algo = Algo::TokenBucket(Gcra::new(10, S, 5).unwrap());
        let (fresh, changed) = algo.load(None, T0, T0);
        assert!(!changed);
        let Outcome::Admit {
            state,
            remaining,
            reset_ns,
        } = algo.check(&fresh, T0, 2)
        else {
            panic!()
        };
        assert_eq!((remaining, reset_ns), (3, 200_000_000));
        let mut bytes = Vec::new();
        Algo::encode(&state, &mut bytes);
        let (loaded, changed) = algo.load(Some(&record(&bytes, algo.params())), T0, T0);
        assert_eq!(loaded, state);
        assert!(!changed);
        assert!(!record_is_idle(&record(&bytes, algo.params()), T0));
        assert!(record_is_idle(&record(&bytes, algo.params()), T0 + 200_000_000));
        // Refunding the charge restores the fresh level.
        let refunded = algo.refund(&state, 2, T0);
        let Outcome::Admit { remaining, .. } = algo.check(&refunded, T0, 1) else {
            panic!()
        };
        assert_eq!(remaining, 4);
    }

    #[test]
    fn unreadable_or_foreign_records_start_fresh_and_are_reclaimable() {
        let algo = Algo::TokenBucket(Gcra::new(10, S, 5).unwrap());
        let junk = Record {
            name_hash: 1,
            kind: 99,
            p1: 0,
            p2: 0,
            state: &[1, 2],
        };
        assert_eq!(algo.load(Some(&junk), T0, T0), (algo.fresh(), true));
        assert!(record_is_idle(&junk, T0));
        let short = record(&[1, 2, 3], algo.params());
        assert_eq!(algo.load(Some(&short), T0, T0), (algo.fresh(), true));
    }
}
