//! Per-node request bookkeeping: which counts of a report are new.
//!
//! A node's counts run from its last *acknowledged* report (its
//! `acked_seq`), so a report whose response was lost is merged into the
//! next one. The session remembers, per (key, limit), what it has already
//! counted since that base; a new request counts only the difference:
//!
//! * `acked_seq == last applied seq`: the node got our last response, so
//!   its counts are all new (the base moves on);
//! * `acked_seq == base`: our last response was lost; subtract what we
//!   counted since the base;
//! * anything else (we lost our state, or the node restarted): take the
//!   counts whole. That can count some units twice, never zero times: the
//!   error is toward admitting less.
//!
//! A request whose `seq` is not above the last applied one is a duplicate
//! or arrived out of order; it is refused and counts nothing.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use tenantgate::sync::{Counts, SyncRequest};

/// A (key, limit).
pub type KeyId = (String, String);

/// What a request brings, once deduplicated.
#[derive(Debug, Clone)]
pub struct Intake {
    /// New counts per reported (key, limit), in the request's order.
    pub deltas: Vec<(KeyId, Counts)>,
    /// The node applied our previous response (the one to `prev_seq`).
    pub acked_last: bool,
    pub prev_seq: u64,
    /// When we applied and answered the node's previous request (service
    /// clock).
    pub prev_heard_at: Option<u64>,
}

/// What the service keeps of one node: the record a store holds and
/// updates atomically. Opaque outside the allocator; serializable so that a
/// shared store can keep it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Session {
    pub region: String,
    last_seq: u64,
    base: u64,
    counted: BTreeMap<KeyId, Tally>,
    /// When the last request was applied (and answered).
    pub heard_at: Option<u64>,
    /// The (key, limit)s this node was ever granted a lease for and that
    /// still hold state.
    pub held: BTreeSet<KeyId>,
}

/// [`Counts`] as a session stores them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Tally {
    consumed: u64,
    unleased: u64,
    demand: u64,
}

impl Session {
    pub fn new(region: &str) -> Session {
        Session {
            region: region.to_owned(),
            last_seq: 0,
            base: 0,
            counted: BTreeMap::new(),
            heard_at: None,
            held: BTreeSet::new(),
        }
    }

    /// Deduplicates `req`'s counts; `None` if it is stale.
    pub fn intake(&mut self, req: &SyncRequest, now: u64) -> Option<Intake> {
        if req.seq <= self.last_seq {
            return None;
        }
        let acked_last = self.last_seq != 0 && req.acked_seq == self.last_seq;
        if acked_last || req.acked_seq != self.base {
            self.base = req.acked_seq;
            self.counted.clear();
        }
        // A (key, limit) named twice in one report carries two parts of
        // its counts (two slots, a retried scan): they are summed first.
        let mut totals: Vec<(KeyId, Tally)> = Vec::with_capacity(req.reports.len());
        for r in &req.reports {
            let part = Tally {
                consumed: r.consumed,
                unleased: r.unleased,
                demand: r.demand,
            };
            match totals.iter_mut().find(|(id, _)| id.0 == r.key && id.1 == r.limit) {
                Some((_, t)) => {
                    t.consumed = t.consumed.saturating_add(part.consumed);
                    t.unleased = t.unleased.saturating_add(part.unleased);
                    t.demand = t.demand.saturating_add(part.demand);
                }
                None => totals.push(((r.key.clone(), r.limit.clone()), part)),
            }
        }
        let mut deltas = Vec::with_capacity(totals.len());
        for (id, total) in totals {
            let before = self.counted.insert(id.clone(), total).unwrap_or_default();
            let delta = Counts {
                consumed: total.consumed.saturating_sub(before.consumed),
                unleased: total.unleased.saturating_sub(before.unleased),
                demand: total.demand.saturating_sub(before.demand),
            };
            deltas.push((id, delta));
        }
        let intake = Intake {
            deltas,
            acked_last,
            prev_seq: self.last_seq,
            prev_heard_at: self.heard_at,
        };
        self.last_seq = req.seq;
        self.heard_at = Some(now);
        self.region.clone_from(&req.region);
        Some(intake)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenantgate::sync::{Report, PROTOCOL_VERSION};

    fn req(seq: u64, acked_seq: u64, consumed: u64) -> SyncRequest {
        SyncRequest {
            version: PROTOCOL_VERSION,
            node_id: "n".into(),
            region: "r".into(),
            policy_version: "v".into(),
            seq,
            acked_seq,
            reports: vec![Report {
                key: "k".into(),
                limit: "l".into(),
                consumed,
                unleased: 0,
                demand: consumed,
            }],
        }
    }

    fn consumed(i: &Intake) -> u64 {
        i.deltas[0].1.consumed
    }

    #[test]
    fn a_lost_response_is_not_counted_twice() {
        let mut s = Session::new("r");
        assert_eq!(consumed(&s.intake(&req(10, 0, 5), 1).unwrap()), 5);
        // Our answer to 10 was lost: 11 carries 5 again, plus 3.
        let i = s.intake(&req(11, 0, 8), 2).unwrap();
        assert!(!i.acked_last);
        assert_eq!(consumed(&i), 3);
        // The node got our answer to 11: 12's counts are all new.
        let i = s.intake(&req(12, 11, 4), 3).unwrap();
        assert!(i.acked_last);
        assert_eq!(consumed(&i), 4);
    }

    #[test]
    fn a_lost_request_is_counted_once_when_its_counts_come_again() {
        let mut s = Session::new("r");
        s.intake(&req(10, 0, 5), 1).unwrap();
        // 11 (acked 10, counts 2) was lost; 12 carries them with 1 more.
        assert_eq!(consumed(&s.intake(&req(12, 10, 3), 3).unwrap()), 3);
    }

    #[test]
    fn duplicates_and_reordered_requests_count_nothing() {
        let mut s = Session::new("r");
        s.intake(&req(10, 0, 5), 1).unwrap();
        assert!(s.intake(&req(10, 0, 5), 2).is_none());
        assert!(s.intake(&req(9, 0, 5), 2).is_none());
    }

    #[test]
    fn a_key_named_twice_in_one_report_is_summed_not_subtracted() {
        // Regression: the second occurrence was taken as "already counted"
        // and only the difference (here 0) was counted.
        let mut s = Session::new("r");
        let mut r = req(10, 0, 5);
        r.reports.push(r.reports[0].clone());
        let i = s.intake(&r, 1).unwrap();
        assert_eq!(i.deltas.len(), 1);
        assert_eq!(consumed(&i), 10);
        // The next report carries the sum again (lost answer): nothing new.
        let mut again = req(11, 0, 5);
        again.reports.push(again.reports[0].clone());
        assert_eq!(consumed(&s.intake(&again, 2).unwrap()), 0);
    }

    #[test]
    fn an_unknown_base_takes_the_counts_whole() {
        // We restarted (or the node did): count everything, erring low.
        let mut s = Session::new("r");
        assert_eq!(consumed(&s.intake(&req(50, 42, 7), 1).unwrap()), 7);
    }
}
