//! One key's limits checked, and charged all or nothing, over its stored
//! records as bytes: for a caller that keeps a key's records in a store of
//! its own rather than in the key table, namely the central service's
//! answers to Envoy's rate limit service protocol (RLS). The bytes are the
//! key table's slot encoding (a count, then one record per limit:
//! [`crate::table::layout::push_record`]), each record stamped as the
//! engine stamps it, and every step is the one the filter's engine takes
//! inside `table::update` (`engine::apply`): [`Algo::load`] (the reload
//! rule), [`Algo::check`], [`Algo::encode_stored`], and records of limits
//! only a newer policy has kept as they are. So a limit decides exactly as
//! it does in the filter, with the same bound.
//!
//! All or nothing: [`check_key`] only checks; the caller writes
//! [`KeyCheck::charged`] for every key of a request when no key is
//! [`KeyCheck::denied`], and writes nothing otherwise (a denied request
//! charges nothing, in every key).

use super::algo::{Algo, Outcome, Stamp, State};
use crate::table::layout::{decode_records, push_record, push_record_with, MAX_RECORDS};

/// A limit as [`check_key`] needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyLimit {
    /// Identifies the limit's record in the key (the policy's name hash).
    pub name_hash: u32,
    pub algo: Algo,
    /// Checked and reported, never denies.
    pub shadow: bool,
}

/// One limit's standing after the check (as charged if it admitted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    pub remaining: u64,
    /// Until the limit is whole again.
    pub reset_ns: u64,
    /// The exact `t` of the `RateLimit` field ([`Algo::quota_window_ns`]).
    pub t_ns: u64,
    /// `Some(wait)`: this limit refuses the request (shadow or not).
    pub refused_for_ns: Option<u64>,
}

/// What [`check_key`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyCheck {
    /// One per limit, in the order given.
    pub standings: Vec<Standing>,
    /// An enforced limit refuses.
    pub denied: bool,
    /// A shadow limit refuses (the request is not denied for it).
    pub shadow_denied: bool,
    /// The key's records with the request charged (what to write if the
    /// request is admitted).
    pub charged: Vec<u8>,
}

/// Checks `cost` against every limit of a key whose records are `stored`
/// (`None`, or bytes that do not decode: a fresh key), under a policy
/// effective from `effective_from`, at `now`.
pub fn check_key(
    stored: Option<&[u8]>,
    limits: &[KeyLimit],
    effective_from: u64,
    now: u64,
    cost: u64,
) -> KeyCheck {
    let records = stored.and_then(decode_records);
    let limits = &limits[..limits.len().min(MAX_RECORDS)];
    let mut standings = Vec::with_capacity(limits.len());
    let mut denied = false;
    let mut shadow_denied = false;
    let mut charged = vec![0u8];
    let mut count = 0u8;
    for l in limits {
        let record = records
            .as_ref()
            .and_then(|rs| rs.iter().find(|r| r.name_hash == l.name_hash));
        let live = l.algo.load(record, effective_from, now);
        let (state, standing): (&State, Standing) = match live.algo.check(&live.state, live.now, cost) {
            Outcome::Admit {
                state,
                remaining,
                reset_ns,
            } => {
                let standing = Standing {
                    remaining,
                    reset_ns,
                    t_ns: live.algo.quota_window_ns(&state, live.now, remaining),
                    refused_for_ns: None,
                };
                push_local(
                    &mut charged,
                    l.name_hash,
                    &live.algo,
                    live.epoch,
                    &state,
                    live.now,
                );
                count += 1;
                standings.push(standing);
                continue;
            }
            Outcome::Deny {
                wait_ns,
                remaining,
                reset_ns,
            } => {
                if l.shadow {
                    shadow_denied = true;
                } else {
                    denied = true;
                }
                (
                    &live.state,
                    Standing {
                        remaining,
                        reset_ns,
                        t_ns: live.algo.quota_window_ns(&live.state, live.now, remaining),
                        refused_for_ns: Some(wait_ns),
                    },
                )
            }
        };
        push_local(&mut charged, l.name_hash, &live.algo, live.epoch, state, live.now);
        count += 1;
        standings.push(standing);
    }
    keep_newer(
        records.as_deref(),
        limits,
        effective_from,
        now,
        &mut charged,
        count,
    );
    KeyCheck {
        standings,
        denied,
        shadow_denied,
        charged,
    }
}

/// A key's records with `units` given back to every limit at `now` (Envoy's
/// `is_negative_hits`: a charge returned), each by its algorithm's own
/// refund ([`Algo::refund`]): a token bucket never holds more than its
/// burst, a window gives back only what its current window counted. No
/// limit is checked: giving back never refuses.
pub fn refund_key(
    stored: Option<&[u8]>,
    limits: &[KeyLimit],
    effective_from: u64,
    now: u64,
    units: u64,
) -> Vec<u8> {
    let records = stored.and_then(decode_records);
    let limits = &limits[..limits.len().min(MAX_RECORDS)];
    let mut out = vec![0u8];
    let mut count = 0u8;
    for l in limits {
        let record = records
            .as_ref()
            .and_then(|rs| rs.iter().find(|r| r.name_hash == l.name_hash));
        let live = l.algo.load(record, effective_from, now);
        let state = live.algo.refund(&live.state, units, live.now);
        push_local(&mut out, l.name_hash, &live.algo, live.epoch, &state, live.now);
        count += 1;
    }
    keep_newer(records.as_deref(), limits, effective_from, now, &mut out, count);
    out
}

/// Appends the records of limits `limits` lacks that a newer policy wrote
/// (they stay as they are), and sets the record count.
fn keep_newer(
    records: Option<&[crate::table::layout::Record<'_>]>,
    limits: &[KeyLimit],
    effective_from: u64,
    now: u64,
    out: &mut Vec<u8>,
    mut count: u8,
) {
    for r in records.into_iter().flatten() {
        if usize::from(count) < MAX_RECORDS
            && limits.iter().all(|l| l.name_hash != r.name_hash)
            && Algo::written_by_newer(r, effective_from, now)
        {
            push_record(out, r.name_hash, r.kind, r.p1, r.p2, r.state);
            count += 1;
        }
    }
    if let Some(first) = out.first_mut() {
        *first = count;
    }
}

/// How long a key's records must outlive their last write to stay exact:
/// past it, every limit of `limits` is back to its fresh state whatever the
/// write (a token bucket's TAT is never more than its tolerance and debt
/// ahead of its write; a window's count, or a sliding window's previous
/// one, never outlives two windows), so a store may drop the records then.
pub fn idle_after_ns(limits: &[KeyLimit]) -> u64 {
    limits
        .iter()
        .map(|l| match l.algo {
            Algo::TokenBucket(g) => g
                .tolerance_ns()
                .saturating_add(g.max_debt().saturating_mul(g.interval_ns())),
            Algo::FixedWindow(a) => a.window_ns().saturating_mul(2),
            Algo::SlidingWindowLog(a) => a.window_ns().saturating_mul(2),
            Algo::SlidingWindowCounter(a) => a.window_ns().saturating_mul(2),
        })
        .max()
        .unwrap_or(0)
}

fn push_local(out: &mut Vec<u8>, name_hash: u32, algo: &Algo, epoch: u64, state: &State, now: u64) {
    let (p1, p2) = algo.params();
    let stamp = Stamp {
        epoch,
        written_at: now,
    };
    push_record_with(out, name_hash, algo.kind(), p1, p2, |o| {
        Algo::encode_stored(state, stamp, o)
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::limiter::{FixedWindow, Gcra};

    const S: u64 = 1_000_000_000;

    #[test]
    fn a_key_is_charged_all_or_nothing_and_decides_like_its_algorithms() {
        let limits = [
            KeyLimit {
                name_hash: 1,
                algo: Algo::FixedWindow(FixedWindow::new(3, 60 * S).unwrap()),
                shadow: false,
            },
            KeyLimit {
                name_hash: 2,
                algo: Algo::TokenBucket(Gcra::new(10, S, 10).unwrap()),
                shadow: false,
            },
        ];
        let now = 600 * S;
        let mut stored: Option<Vec<u8>> = None;
        for i in 0..3 {
            let c = check_key(stored.as_deref(), &limits, 0, now + i, 1);
            assert!(!c.denied, "request {i}");
            assert_eq!(c.standings[0].remaining, 2 - i);
            stored = Some(c.charged);
        }
        let c = check_key(stored.as_deref(), &limits, 0, now + 3, 1);
        assert!(c.denied);
        assert_eq!(c.standings[0].refused_for_ns, Some(60 * S - 3));
        // The token bucket admitted it, but nothing is written on a denial:
        // the caller keeps the stored bytes. The next window admits again.
        let c = check_key(stored.as_deref(), &limits, 0, now + 60 * S, 1);
        assert!(!c.denied);
        assert_eq!(c.standings[1].remaining, 9, "the bucket refilled to 10, less 1");
    }

    #[test]
    fn a_check_of_cost_zero_charges_nothing_and_a_refund_gives_back() {
        let limits = [
            KeyLimit {
                name_hash: 1,
                algo: Algo::FixedWindow(FixedWindow::new(3, 60 * S).unwrap()),
                shadow: false,
            },
            KeyLimit {
                name_hash: 2,
                algo: Algo::TokenBucket(Gcra::new(3, 60 * S, 3).unwrap()),
                shadow: false,
            },
        ];
        let now = 600 * S;
        // 25 checks of cost 0, each written back: still 3 to use.
        let mut stored: Option<Vec<u8>> = None;
        for i in 0..25 {
            let c = check_key(stored.as_deref(), &limits, 0, now + i, 0);
            assert!(!c.denied, "check {i}");
            assert_eq!((c.standings[0].remaining, c.standings[1].remaining), (3, 3));
            stored = Some(c.charged);
        }
        for i in 0..3 {
            let c = check_key(stored.as_deref(), &limits, 0, now + 30 + i, 1);
            assert!(!c.denied, "request {i}");
            stored = Some(c.charged);
        }
        let full = check_key(stored.as_deref(), &limits, 0, now + 40, 1);
        assert!(full.denied);
        // At the limit, a check of cost 0 still answers (nothing to charge).
        assert!(!check_key(stored.as_deref(), &limits, 0, now + 40, 0).denied);
        // Two given back: two more admitted, then refused again.
        stored = Some(refund_key(stored.as_deref(), &limits, 0, now + 41, 2));
        for i in 0..2 {
            let c = check_key(stored.as_deref(), &limits, 0, now + 42 + i, 1);
            assert!(!c.denied, "after the refund {i}");
            stored = Some(c.charged);
        }
        assert!(check_key(stored.as_deref(), &limits, 0, now + 45, 1).denied);
        // More given back than was used: never above the limit or the burst.
        let over = refund_key(stored.as_deref(), &limits, 0, now + 46, 1_000);
        let c = check_key(Some(&over), &limits, 0, now + 46, 0);
        assert_eq!((c.standings[0].remaining, c.standings[1].remaining), (3, 3));
        // A refund to a fresh key changes nothing.
        let c = check_key(Some(&refund_key(None, &limits, 0, now, 5)), &limits, 0, now, 0);
        assert_eq!((c.standings[0].remaining, c.standings[1].remaining), (3, 3));
    }

    #[test]
    fn records_outlive_every_limits_refill() {
        let bucket = KeyLimit {
            name_hash: 1,
            // 10 per second with a burst of 100: 10 s to refill.
            algo: Algo::TokenBucket(Gcra::new(10, S, 100).unwrap()),
            shadow: false,
        };
        let window = KeyLimit {
            name_hash: 2,
            algo: Algo::FixedWindow(FixedWindow::new(3, 60 * S).unwrap()),
            shadow: false,
        };
        assert_eq!(idle_after_ns(&[bucket]), 10 * S);
        assert_eq!(idle_after_ns(&[bucket, window]), 120 * S);
        assert_eq!(idle_after_ns(&[]), 0);
        // A bucket emptied at t is full again (a fresh record) at t + 10 s.
        let c = check_key(None, &[bucket], 0, 0, 100);
        let full = check_key(Some(&c.charged), &[bucket], 0, idle_after_ns(&[bucket]), 100);
        assert!(!full.denied);
    }

    #[test]
    fn a_shadow_limit_refuses_without_denying_and_a_cost_counts_whole() {
        let limits = [KeyLimit {
            name_hash: 7,
            algo: Algo::FixedWindow(FixedWindow::new(5, S).unwrap()),
            shadow: true,
        }];
        let c = check_key(None, &limits, 0, 10 * S, 6);
        assert!(!c.denied && c.shadow_denied);
        let c = check_key(None, &limits, 0, 10 * S, 5);
        assert!(!c.denied && !c.shadow_denied);
        assert_eq!(c.standings[0].remaining, 0);
        // Garbage reads as a fresh key.
        assert!(!check_key(Some(&[9, 9, 9]), &limits, 0, 10 * S, 1).denied);
    }
}
