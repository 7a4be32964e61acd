//! What the service keeps per (key, limit) and node: its reservation,
//! lease, share and demand. See the `alloc` module header for the rules.

use serde::{Deserialize, Serialize};

use tenantgate::sync::FailureMode;

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
        }
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

    /// Not heard from since its last grant, and past the earliest instant
    /// that lease can have expired: it may be on its local limit.
    pub(super) fn silent(&self, now: u64, cfg: &AllocConfig) -> bool {
        self.lease_seq != 0
            && now >= self.granted_at.saturating_add(cfg.lease_ttl_ns)
            && self.heard_at.is_none_or(|h| h <= self.granted_at)
    }
}
