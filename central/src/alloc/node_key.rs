//! What the service keeps per (key, limit) and node: its reservation,
//! lease, share and demand. See the `alloc` module header for the rules.

use serde::{Deserialize, Serialize};

use tenantgate::sync::{Counts, FailureMode};

use super::session::Tally;
use super::{AllocConfig, NodeTerms};

/// Shares and allowances are counted in thousandths of a unit.
const MILLI: u64 = 1_000;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct NodeKey {
    pub(super) region: String,
    /// `R`: what the node may still admit on leases since its last applied
    /// report was sent.
    pub(super) reserve: u64,
    pub(super) lease_tokens: u64,
    pub(super) lease_seq: u64,
    /// The reservation already fell to `lease_tokens − consumed`.
    pub(super) collapsed: bool,
    pub(super) granted_at: u64,
    /// This interval's allocation (`None`: not allocated yet).
    pub(super) share: Option<u64>,
    /// Left out of this interval's allocation as silent (its share kept).
    pub(super) kept_local: bool,
    pub(super) level: u64,
    pub(super) share_sent: u64,
    /// The share the node acknowledged, and the largest sent since.
    pub(super) share_acked: u64,
    pub(super) share_unacked: u64,
    /// Demand, units per interval (moving average).
    pub(super) demand: f64,
    pub(super) last_report_at: u64,
    /// Charged for its local limit, not yet matched by reported `unleased`.
    pub(super) assumed: u64,
    pub(super) charged_until: u64,
    pub(super) charge_carry: u128,
    /// Reservation written off; later lease consumption is taken from it.
    pub(super) written_off: u64,
    /// When the service last applied a request of this node (its session's
    /// `heard_at`, mirrored here so a (key, limit) is updated from its own
    /// record alone: every applied request of a node visits every key it
    /// holds, see `alloc::begin`).
    pub(super) heard_at: Option<u64>,
    /// This interval's allocation in thousandths of a unit: shares below
    /// one unit per interval (100/min across 3 nodes) are carried, not
    /// rounded away.
    #[serde(default)]
    pub(super) share_milli: u64,
    /// The fraction of a unit of share not yet sent (thousandths).
    #[serde(default)]
    pub(super) share_carry: u64,
    /// What the node may still draw from the bucket (thousandths): its
    /// share accrues here every interval, up to its level plus one share;
    /// it may draw one share ahead (down to `−share_milli`).
    #[serde(default)]
    pub(super) credit: i64,
    /// What the node enforces for its last lease (`None`: a record older
    /// than the field, or a node that reported none: the policy's).
    #[serde(default)]
    pub(super) terms: Option<NodeTerms>,
    #[serde(default)]
    pub(super) mode: Option<FailureMode>,
    /// The outage allowance (thousandths of a unit per interval) sent with
    /// the last lease, the one the node acknowledged, and the largest sent
    /// since: what a node that runs it may admit under `fail_open_local`
    /// (see the `alloc` module header, "Outage allowances").
    #[serde(default)]
    pub(super) outage_sent: u64,
    #[serde(default)]
    pub(super) outage_acked: u64,
    #[serde(default)]
    pub(super) outage_unacked: u64,
    /// Deduplication of the node's counts at this record (see
    /// [`NodeKey::intake`]): the `boot` and the last `seq` of the node this
    /// record applied, the base (`acked_seq`) its counts ran from, and
    /// what the record counted since that base.
    #[serde(default)]
    pub(super) boot: u64,
    #[serde(default)]
    pub(super) applied_seq: u64,
    #[serde(default)]
    pub(super) base: u64,
    #[serde(default)]
    pub(super) counted: Tally,
}

/// Where a request stands in its node's order, as one record sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// After the last request of the node this record applied.
    Next,
    /// The request this record applied last, again (a store ran its update
    /// twice, or a retry whose first try landed here): nothing is counted.
    Duplicate,
    /// Older than what this record applied (a later request of the node
    /// carried its counts): nothing is counted, nothing is written.
    Stale,
}

/// A request's `boot`, `seq` and `acked_seq`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestSeq {
    pub boot: u64,
    pub seq: u64,
    pub acked: u64,
}

/// What one record made of a request (see [`NodeKey::intake`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub order: Order,
    /// The counts this record had not counted yet.
    pub delta: Counts,
    /// The node applied this record's previous answer (the one to
    /// `prev_seq`).
    pub acked_last: bool,
    /// The last `seq` this record applied before this request.
    pub prev_seq: u64,
    /// When this record applied that request.
    pub prev_heard_at: Option<u64>,
}

impl NodeKey {
    pub(super) fn new(region: &str, now: u64) -> NodeKey {
        NodeKey {
            region: region.to_owned(),
            reserve: 0,
            lease_tokens: 0,
            lease_seq: 0,
            collapsed: true,
            granted_at: now,
            share: None,
            kept_local: false,
            level: 0,
            share_sent: 0,
            share_acked: 0,
            share_unacked: 0,
            demand: 0.0,
            last_report_at: now,
            assumed: 0,
            charged_until: now,
            charge_carry: 0,
            written_off: 0,
            heard_at: Some(now),
            share_milli: 0,
            share_carry: 0,
            credit: 0,
            terms: None,
            mode: None,
            outage_sent: 0,
            outage_acked: 0,
            outage_unacked: 0,
            boot: 0,
            applied_seq: 0,
            base: 0,
            counted: Tally::default(),
        }
    }

    /// Which of a request's counts (`total`: the node's counts since its
    /// acknowledged base; `None` for a held key the request does not
    /// report) this record has not counted yet, by the rules of the
    /// `alloc::session` header; records the request as applied here
    /// (unless [`Order::Stale`]). Linear in nothing: four numbers and a
    /// tally per node, so a record's size does not grow with how a node
    /// reports.
    pub(super) fn intake(&mut self, req: RequestSeq, total: Option<Counts>) -> Seen {
        if req.boot != self.boot {
            // Another life of the node (or a record older than the field):
            // nothing of its previous life deduplicates this one.
            self.boot = req.boot;
            self.applied_seq = 0;
            self.base = 0;
            self.counted = Tally::default();
        }
        let seen = |order, delta, acked_last| Seen {
            order,
            delta,
            acked_last,
            prev_seq: self.applied_seq,
            prev_heard_at: self.heard_at,
        };
        if self.applied_seq != 0 && req.seq <= self.applied_seq {
            let order = if req.seq == self.applied_seq {
                Order::Duplicate
            } else {
                Order::Stale
            };
            return seen(order, Counts::default(), false);
        }
        let acked_last = self.applied_seq != 0 && req.acked == self.applied_seq;
        if acked_last || req.acked != self.base {
            self.base = req.acked;
            self.counted = Tally::default();
        }
        let delta = match total {
            Some(t) => {
                let d = self.counted.new_in(t);
                self.counted = Tally::of(t);
                d
            }
            None => Counts::default(),
        };
        let out = seen(Order::Next, delta, acked_last);
        self.applied_seq = req.seq;
        out
    }

    pub(super) fn terms(&self, cfg: &AllocConfig) -> NodeTerms {
        self.terms.unwrap_or_else(|| cfg.terms())
    }

    /// `granted_at + D + ttl` with the node's `D`: its last lease is dead.
    pub(super) fn lease_dead_at(&self, cfg: &AllocConfig) -> u64 {
        self.granted_at.saturating_add(self.terms(cfg).lease_life_ns(cfg))
    }

    /// Whether the node may admit on a local limit once its lease expired
    /// (`fail_open_local`, or `fail_open`, which admits at least that):
    /// then its share is reserved and charged while it is silent. A
    /// `fail_closed` key admits nothing without a lease and needs neither.
    pub(super) fn falls_back(&self, cfg: &AllocConfig) -> bool {
        self.mode.unwrap_or(cfg.failure_mode) != FailureMode::FailClosed
    }

    pub(super) fn local_until(&self, cfg: &AllocConfig) -> u64 {
        self.lease_dead_at(cfg)
            .saturating_add(self.terms(cfg).local_max_ns)
    }

    /// The most the node may admit per interval under `fail_open_local`,
    /// in thousandths of a unit: the largest outage allowance it may hold
    /// (or, for a node older than allowances, the largest whole share; 0
    /// once its local limit has run out, and for a key that fails closed).
    pub(super) fn local_bound_milli(&self, now: u64, cfg: &AllocConfig) -> u64 {
        if !self.falls_back(cfg) || now >= self.local_until(cfg) {
            0
        } else if self.runs_outage_allowance(cfg) {
            self.outage_acked.max(self.outage_unacked)
        } else {
            self.share_acked.max(self.share_unacked).saturating_mul(MILLI)
        }
    }

    /// The node runs `fail_open_local` at its outage allowance (it said so
    /// in its last request), not at its whole share.
    pub(super) fn runs_outage_allowance(&self, cfg: &AllocConfig) -> bool {
        self.terms(cfg).outage_allowance
    }

    /// Silent since its last grant and within its local limit's time: it
    /// may be admitting on its local limit, so its allowance stays
    /// reserved (see the `alloc` module header).
    pub(super) fn on_local(&self, now: u64, cfg: &AllocConfig) -> bool {
        self.falls_back(cfg) && self.silent(now, cfg) && now < self.local_until(cfg)
    }

    /// Its last lease not yet acknowledged by a report (the answer was
    /// lost, came after the node's callout timeout, or crossed its retry).
    pub(super) fn lease_unacknowledged(&self) -> bool {
        self.lease_seq != 0 && !self.collapsed
    }

    /// Not heard from since its last grant, and past the earliest instant
    /// that lease can have expired: it may be on its local limit.
    pub(super) fn silent(&self, now: u64, cfg: &AllocConfig) -> bool {
        self.lease_seq != 0
            && now >= self.granted_at.saturating_add(cfg.lease_ttl_ns)
            && self.heard_at.is_none_or(|h| h <= self.granted_at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(seq: u64, acked: u64) -> RequestSeq {
        RequestSeq { boot: 0, seq, acked }
    }

    fn c(consumed: u64) -> Option<Counts> {
        Some(Counts {
            consumed,
            unleased: 0,
            demand: consumed,
        })
    }

    fn fresh() -> NodeKey {
        NodeKey::new("r", 1)
    }

    #[test]
    fn a_lost_response_is_not_counted_twice() {
        let mut nk = fresh();
        assert_eq!(nk.intake(seq(10, 0), c(5)).delta.consumed, 5);
        // Our answer to 10 was lost: 11 carries 5 again, plus 3.
        let s = nk.intake(seq(11, 0), c(8));
        assert!(!s.acked_last);
        assert_eq!(s.delta.consumed, 3);
        // The node got our answer to 11: 12's counts are all new.
        let s = nk.intake(seq(12, 11), c(4));
        assert!(s.acked_last);
        assert_eq!(s.prev_seq, 11);
        assert_eq!(s.delta.consumed, 4);
    }

    #[test]
    fn a_lost_request_is_counted_once_when_its_counts_come_again() {
        let mut nk = fresh();
        nk.intake(seq(10, 0), c(5));
        // 11 (acked 10, counts 2) was lost; 12 carries them with 1 more.
        assert_eq!(nk.intake(seq(12, 10), c(3)).delta.consumed, 3);
    }

    #[test]
    fn the_same_request_twice_counts_once_and_an_older_one_counts_nothing() {
        // What makes one record's update idempotent on its own: a store
        // that ran it twice (Redis Cluster: a script retried after a lost
        // answer), or the node's retry of a request that landed here but
        // not in another record.
        let mut nk = fresh();
        nk.intake(seq(10, 0), c(5));
        let again = nk.intake(seq(10, 0), c(5));
        assert_eq!(again.order, Order::Duplicate);
        assert_eq!(again.delta, Counts::default());
        // 12 landed here first (a replica raced 11's slow write).
        nk.intake(seq(12, 0), c(9));
        let late = nk.intake(seq(11, 0), c(7));
        assert_eq!(late.order, Order::Stale);
        assert_eq!(late.delta, Counts::default());
        assert_eq!(nk.applied_seq, 12);
        assert_eq!(nk.counted.consumed, 9);
    }

    #[test]
    fn a_record_that_missed_a_request_counts_its_carried_counts_once() {
        // 11 landed in the session and other records but not here (its
        // slot's write failed); 12 still acknowledges 10 and carries 11's
        // counts: all new here.
        let mut nk = fresh();
        nk.intake(seq(10, 0), c(5));
        let s = nk.intake(seq(12, 10), c(6));
        assert!(s.acked_last);
        assert_eq!(s.delta.consumed, 6);
    }

    #[test]
    fn a_new_boot_or_an_unknown_base_takes_the_counts_whole() {
        let mut nk = fresh();
        assert_eq!(nk.intake(seq(50, 42), c(7)).delta.consumed, 7);
        nk.intake(seq(51, 42), c(9));
        // Restarted: a lower seq, another boot.
        let s = nk.intake(
            RequestSeq {
                boot: 3,
                seq: 2,
                acked: 0,
            },
            c(4),
        );
        assert_eq!(s.order, Order::Next);
        assert_eq!(s.delta.consumed, 4);
    }

    #[test]
    fn a_held_key_not_reported_keeps_its_tally_until_the_base_moves() {
        let mut nk = fresh();
        nk.intake(seq(10, 0), c(5));
        // 11 does not report it, and its answer to 10 was lost.
        assert_eq!(nk.intake(seq(11, 0), None).delta, Counts::default());
        // 12 reports it again from the same base: only what is new.
        assert_eq!(nk.intake(seq(12, 0), c(6)).delta.consumed, 1);
    }
}
