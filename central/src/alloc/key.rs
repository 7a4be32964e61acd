//! One (key, limit) at the service: the bucket, each node's reservation and
//! share, and each region's allocation and debt. See the `alloc` module
//! header for the rules and the bound they give.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tenantgate::sync::{Counts, FailureMode, Lease, FULL_BUCKET_MILLI};

use super::fair::{max_min_fair, Claim};
use super::node_key::{NodeKey, RequestSeq, Seen};
use super::session::KeyId;
use super::{AllocConfig, GlobalLimit, KeyView, NodeTerms, NANOS_PER_MS};

mod grant;
use grant::{demand_beyond_share, entitlement, record_lease, Room};

/// The weight of the newest report in a node's demand average: high, so a
/// shift of demand is followed within about one interval, while one noisy
/// report does not swing the split.
const DEMAND_WEIGHT: f64 = 0.8;

/// Shares are split in thousandths of a unit.
const MILLI: u64 = 1_000;

/// Demand (units per interval) in thousandths of a unit, rounded up.
fn milli(demand: f64) -> u64 {
    (demand * MILLI as f64).ceil() as u64
}

/// The nodes an interval's split is among ([`KeyState::roll`]): by
/// region, and what the nodes on their local limit keep out of it.
struct Active {
    reserved_milli: u64,
    by_region: BTreeMap<String, Vec<String>>,
}

/// Cumulative counters of one (key, limit), in units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyStats {
    /// Drawn from the bucket into leases.
    pub granted: u64,
    /// Returned to the bucket from reservations proven unused.
    pub reclaimed: u64,
    /// Reservations and charges dropped as if consumed.
    pub written_off: u64,
    /// Charged for silent nodes' local limits.
    pub precharged: u64,
    /// Admitted beyond grants and charges.
    pub debt_booked: u64,
    pub repaid: u64,
    pub consumed: u64,
    pub unleased: u64,
    pub demand: u64,
}

/// One region's allocation (last interval) and debt.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionView {
    pub allocated: u64,
    pub fair: u64,
    pub debt: u64,
    /// Σ over intervals of what it got beyond an equal share.
    pub borrowed_total: u64,
    pub repaid_total: u64,
}

/// The request a lease answers: its `seq`, and what the node enforces
/// (see [`NodeTerms`]), kept with the lease, so its death, its local
/// fallback and its reservation follow the node's settings, not the
/// service's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enforced {
    pub seq: u64,
    pub terms: NodeTerms,
    pub mode: FailureMode,
}

/// Over how long a report's demand came: since the node's previous
/// request (`prev_heard_at`), or, for a key that started on the node since
/// its last lease, since it started (`started_ns` ago) if that is shorter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Span {
    pub prev_heard_at: Option<u64>,
    pub started_ns: Option<u64>,
}

/// What the service keeps of one (key, limit): the record a store holds
/// and updates atomically. Opaque outside the allocator; serializable so
/// that a shared store can keep it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KeyState {
    pub(super) limit: GlobalLimit,
    pub(super) bucket: u64,
    pub(super) origin: u64,
    /// Units refilled since `origin` (a token bucket), or the calendar
    /// month the bucket was last filled in (a calendar month's budget).
    pub(super) credited: u128,
    pub(super) nodes: BTreeMap<String, NodeKey>,
    pub(super) regions: BTreeMap<String, RegionView>,
    pub(super) interval: Option<u64>,
    pub(super) advanced_at: Option<u64>,
    pub(super) flow: u64,
    /// Debt repayments taken out of regions' allocations, destroyed out of
    /// the refill as it comes.
    pub(super) owed: u64,
    pub(super) stats: KeyStats,
}

impl KeyState {
    /// A key never seen: its bucket starts full.
    pub fn new(limit: GlobalLimit, now: u64) -> KeyState {
        KeyState {
            limit,
            bucket: limit.burst,
            origin: now,
            credited: first_credited(&limit, now),
            nodes: BTreeMap::new(),
            regions: BTreeMap::new(),
            interval: None,
            advanced_at: None,
            flow: 0,
            owed: 0,
            stats: KeyStats::default(),
        }
    }

    /// Nothing left that a fresh record would not have: no node, a full
    /// bucket, no debt. The service may then drop the record (a new one
    /// starts exactly like this).
    pub fn is_idle(&self) -> bool {
        self.nodes.is_empty()
            && self.owed == 0
            && self.bucket >= self.limit.burst
            && self.regions.values().all(|r| r.debt == 0)
    }

    pub fn holds(&self, node: &str) -> bool {
        self.nodes.contains_key(node)
    }

    pub fn limit(&self) -> GlobalLimit {
        self.limit
    }

    /// The service applied a request of `node` at `now` (mirrors the
    /// session's `heard_at`, which decides whether the node is silent).
    pub fn heard(&mut self, node: &str, now: u64) {
        if let Some(nk) = self.nodes.get_mut(node) {
            nk.heard_at = Some(now);
        }
    }

    /// A policy reload changed the limit's numbers (call after
    /// [`KeyState::advance`] to `now`). Like the filter's reloads it never
    /// adds tokens: the bucket keeps what it holds, capped so that bucket
    /// and reservations stay within the new burst, and refills at the new
    /// rate from `now`; the interval's allocation is redone with the new
    /// flow at the next advance.
    pub fn retarget(&mut self, limit: GlobalLimit, now: u64) {
        if self.limit == limit {
            return;
        }
        self.limit = limit;
        self.origin = now;
        self.credited = first_credited(&limit, now);
        self.bucket = self.bucket.min(limit.burst.saturating_sub(self.reserved()));
        self.interval = None;
        self.advanced_at = None;
    }

    fn reserved(&self) -> u64 {
        self.nodes
            .values()
            .fold(0u64, |sum, n| sum.saturating_add(n.reserve))
    }

    /// The flow of interval `k` in units of `1/scale`: `r·I`, exact over
    /// consecutive intervals.
    fn flow_of(&self, k: u64, scale: u64, cfg: &AllocConfig) -> u64 {
        let total = |k: u64| {
            u128::from(self.limit.limit)
                .saturating_mul(u128::from(cfg.interval_ns))
                .saturating_mul(u128::from(k))
                .saturating_mul(u128::from(scale))
                / u128::from(self.limit.window_ns.max(1))
        };
        u64::try_from(total(k.saturating_add(1)).saturating_sub(total(k))).unwrap_or(u64::MAX)
    }

    /// What the bucket holds beyond what is promised: every node's credit,
    /// and the refill since this interval began (the next interval's
    /// credits). Free for any node to draw (a new key's burst, demand
    /// that grew within the interval). Once the bucket is scarce, nodes
    /// draw only their credit, so the refill is split by shares, not by
    /// who asks first.
    fn surplus(&self, now: u64, cfg: &AllocConfig) -> u64 {
        let credits = self
            .nodes
            .values()
            .map(|n| u64::try_from(n.credit).unwrap_or(0))
            .sum::<u64>()
            .div_ceil(MILLI);
        let into = u128::from(now % cfg.interval_ns.max(1));
        let accrued = u128::from(self.flow) * into / u128::from(cfg.interval_ns.max(1));
        let accrued = u64::try_from(accrued).unwrap_or(u64::MAX);
        self.bucket.saturating_sub(credits.saturating_add(accrued))
    }

    /// Refill, charges for silent nodes, write-offs, pruning, and the
    /// allocation of a new interval.
    pub fn advance(&mut self, now: u64, cfg: &AllocConfig) {
        if self.advanced_at == Some(now) {
            return;
        }
        self.advanced_at = Some(now);
        let credit = match self.limit.calendar() {
            // A calendar month's budget: filled to its burst when a month
            // starts in its zone (`credited` is the month last filled),
            // nothing in between.
            Some(zone) => {
                let month = u128::from(zone.month_of(now));
                if month > self.credited {
                    self.credited = month;
                    self.limit.burst
                } else {
                    0
                }
            }
            None => {
                let elapsed = u128::from(now.saturating_sub(self.origin));
                let total = u128::from(self.limit.limit) * elapsed / u128::from(self.limit.window_ns.max(1));
                let credit = u64::try_from(total.saturating_sub(self.credited)).unwrap_or(u64::MAX);
                self.credited = self.credited.max(total);
                credit
            }
        };

        // Charge silent nodes' local limits as time passes, before any grant.
        let mut charges: Vec<(String, u64)> = Vec::new();
        for nk in self.nodes.values_mut() {
            if !nk.falls_back(cfg) || !nk.silent(now, cfg) {
                continue;
            }
            let from = nk
                .charged_until
                .max(nk.granted_at.saturating_add(cfg.lease_ttl_ns));
            let to = now.min(nk.local_until(cfg));
            if to > from {
                // Its allowance per interval, in thousandths, for as long.
                let rate = u128::from(nk.local_bound_milli(from, cfg));
                let per = u128::from(cfg.interval_ns.max(1)) * u128::from(MILLI);
                let units = rate * u128::from(to - from) + nk.charge_carry;
                nk.charge_carry = units % per;
                let amount = u64::try_from(units / per).unwrap_or(u64::MAX);
                nk.assumed = nk.assumed.saturating_add(amount);
                charges.push((nk.region.clone(), amount));
            }
            nk.charged_until = nk.charged_until.max(to);
        }
        let mut available = self.bucket.saturating_add(credit);
        let paid = self.owed.min(available);
        self.owed -= paid;
        available -= paid;
        for (region, amount) in charges {
            self.stats.precharged = self.stats.precharged.saturating_add(amount);
            let taken = amount.min(available);
            available -= taken;
            self.book_debt_raw(&region, amount - taken);
        }
        self.bucket = available.min(self.limit.burst.saturating_sub(self.reserved()));

        for nk in self.nodes.values_mut() {
            if nk.reserve > 0 && now >= nk.lease_dead_at(cfg).saturating_add(cfg.settle_ns) {
                nk.written_off = nk.written_off.saturating_add(nk.reserve);
                self.stats.written_off = self.stats.written_off.saturating_add(nk.reserve);
                nk.reserve = 0;
            }
        }
        self.nodes.retain(|_, nk| {
            let forget_at = nk
                .lease_dead_at(cfg)
                .saturating_add(cfg.settle_ns.max(nk.terms(cfg).local_max_ns));
            nk.reserve > 0
                || now < forget_at
                || now
                    < nk.last_report_at
                        .saturating_add(cfg.interval_ns.saturating_mul(3))
        });

        // Only a later interval is allocated: a request stamped earlier (a
        // replica whose clock lags) must not allocate an interval twice.
        let k = now / cfg.interval_ns;
        if self.interval.is_none_or(|i| k > i) {
            self.roll(k, now, cfg);
        }
    }

    /// Splits interval `k`'s flow among regions and nodes, in thousandths
    /// of a unit (see the `alloc` module header, "Fair shares").
    fn roll(&mut self, k: u64, now: u64, cfg: &AllocConfig) {
        self.interval = Some(k);
        self.flow = self.flow_of(k, 1, cfg);
        let flow_milli = self.flow_of(k, MILLI, cfg);
        let active = self.active_by_region(now, cfg);
        let budget = flow_milli.saturating_sub(active.reserved_milli);
        let regions = active.by_region.len() as u64;
        if regions == 0 {
            return;
        }
        let fair = budget / regions;
        let cap = fair.saturating_add(budget.saturating_mul(cfg.borrow_ceiling_pct) / 100);
        // Floors let an idle region or node start; they never take more
        // than half of what is split, or at small flows (100/min is 1.67
        // units per interval) they would split it evenly whatever the
        // demand.
        let region_floor = cfg.region_floor.saturating_mul(MILLI).min(budget / (2 * regions));
        let claims: Vec<Claim> = active
            .by_region
            .values()
            .map(|ids| Claim {
                floor: region_floor,
                demand: self.demand_milli(ids),
                cap,
            })
            .collect();
        let allocated = max_min_fair(budget, &claims);
        for ((region, ids), part) in active.by_region.into_iter().zip(allocated) {
            let part = self.book_region(region, part, fair, cfg);
            self.share_among(&ids, part, cfg);
        }
    }

    /// The nodes that take part in this interval's split, by region, and
    /// what the nodes on their local limit keep (they are not split: their
    /// local limit may be spending it). A node silent for two intervals
    /// has its demand halved; one silent for three has no share.
    fn active_by_region(&mut self, now: u64, cfg: &AllocConfig) -> Active {
        let recent = cfg.interval_ns.saturating_mul(3);
        let mut active = Active {
            reserved_milli: 0,
            by_region: BTreeMap::new(),
        };
        for (id, nk) in &mut self.nodes {
            let stale = now.saturating_sub(nk.last_report_at) > cfg.interval_ns.saturating_mul(2);
            if stale {
                nk.demand *= 0.5;
            }
            if nk.on_local(now, cfg) {
                // It keeps its allowance: its local limit may be spending it.
                active.reserved_milli = active
                    .reserved_milli
                    .saturating_add(nk.local_bound_milli(now, cfg));
                nk.share = Some(0);
                nk.share_milli = 0;
                nk.kept_local = true;
                continue;
            }
            nk.kept_local = false;
            if now.saturating_sub(nk.last_report_at) <= recent {
                active
                    .by_region
                    .entry(nk.region.clone())
                    .or_default()
                    .push(id.clone());
            } else {
                nk.share = None;
                nk.share_milli = 0;
                nk.credit = 0;
            }
        }
        active
    }

    /// The nodes' `ids` demand together, in thousandths.
    fn demand_milli(&self, ids: &[String]) -> u64 {
        ids.iter()
            .filter_map(|id| self.nodes.get(id))
            .map(|nk| milli(nk.demand))
            .fold(0u64, u64::saturating_add)
    }

    /// Books `region`'s `part` of the interval (what it borrowed beyond
    /// its `fair` part) and repays its debt out of it: returns what is
    /// left for its nodes.
    fn book_region(&mut self, region: String, mut part: u64, fair: u64, cfg: &AllocConfig) -> u64 {
        let rv = self.regions.entry(region).or_default();
        rv.allocated = part / MILLI;
        rv.fair = fair / MILLI;
        rv.borrowed_total = rv
            .borrowed_total
            .saturating_add(part.saturating_sub(fair) / MILLI);
        if rv.debt > 0 {
            // Repaid out of this region's own part: that much of the
            // refill is destroyed, not lent to other regions.
            let repay = rv.debt.min(
                u64::try_from(u128::from(part) * u128::from(cfg.repay_pct) / 100 / u128::from(MILLI))
                    .unwrap_or(u64::MAX),
            );
            self.owed = self.owed.saturating_add(repay);
            rv.debt -= repay;
            rv.repaid_total = rv.repaid_total.saturating_add(repay);
            self.stats.repaid = self.stats.repaid.saturating_add(repay);
            part = part.saturating_sub(repay.saturating_mul(MILLI));
        }
        part
    }

    /// Splits a region's `part` among its nodes `ids` (max-min fair over
    /// their demand, above the node floor): each node's share, lease level
    /// and credit.
    fn share_among(&mut self, ids: &[String], part: u64, cfg: &AllocConfig) {
        let max_cost = self.limit.max_cost.max(1);
        let node_floor = cfg
            .node_floor
            .saturating_mul(MILLI)
            .min(part / (2 * ids.len().max(1) as u64));
        let claims: Vec<Claim> = ids
            .iter()
            .filter_map(|id| self.nodes.get(id))
            .map(|nk| Claim {
                floor: node_floor,
                demand: milli(nk.demand),
                cap: u64::MAX,
            })
            .collect();
        for (id, share) in ids.iter().zip(max_min_fair(part, &claims)) {
            if let Some(nk) = self.nodes.get_mut(id) {
                let whole = nk.share_carry.saturating_add(share);
                nk.share = Some(whole / MILLI);
                nk.share_carry = whole % MILLI;
                nk.share_milli = share;
                nk.level = share
                    .saturating_mul(cfg.lease_factor_pct)
                    .div_ceil(100 * MILLI)
                    .max(max_cost);
                let cap = nk.level.saturating_mul(MILLI).saturating_add(share);
                let cap = i64::try_from(cap).unwrap_or(i64::MAX);
                nk.credit = nk.credit.saturating_add_unsigned(share).min(cap);
            }
        }
    }

    /// The node's entry, created for a node that reports the key for the
    /// first time (or since it was forgotten).
    pub fn join(&mut self, node: &str, region: &str, now: u64) {
        if !self.nodes.contains_key(node) {
            self.nodes.insert(node.to_owned(), NodeKey::new(region, now));
        }
    }

    /// Deduplicates a request's counts against what this record counted
    /// of the node (see `NodeKey::intake`); `None` if the node has no
    /// entry here (nothing to count against: see [`KeyState::join`]).
    pub fn intake(&mut self, node: &str, req: RequestSeq, total: Option<Counts>) -> Option<Seen> {
        self.nodes.get_mut(node).map(|nk| nk.intake(req, total))
    }

    /// Records a report's demand (units per interval, averaged).
    pub fn touch(
        &mut self,
        node: &str,
        region: &str,
        delta: Counts,
        span: Span,
        now: u64,
        cfg: &AllocConfig,
    ) {
        // Looked up before inserting: the node's name is copied only for
        // a node new to the key, not on every report.
        if !self.nodes.contains_key(node) {
            self.nodes.insert(node.to_owned(), NodeKey::new(region, now));
        }
        let Some(nk) = self.nodes.get_mut(node) else {
            return;
        };
        region.clone_into(&mut nk.region);
        if nk.kept_local {
            // Back from silence: an equal split until the next allocation.
            nk.kept_local = false;
            nk.share = None;
        }
        let since_heard = span
            .prev_heard_at
            .map(|h| now.saturating_sub(h))
            .filter(|&s| s > 0)
            .unwrap_or(cfg.interval_ns)
            .max(cfg.interval_ns / 4);
        // A key that started within that time asked for its demand since
        // it started (a cold burst seen a tenth of an interval in is ten
        // times that per interval); at least a tenth of an interval, so
        // one early request is not taken for a flood.
        let span = span
            .started_ns
            .map_or(since_heard, |s| s.max(cfg.interval_ns / 10).min(since_heard));
        let rate = delta.demand as f64 * cfg.interval_ns as f64 / span as f64;
        let fresh = nk.lease_seq == 0 && nk.demand == 0.0;
        nk.demand = if fresh {
            rate
        } else {
            DEMAND_WEIGHT * rate + (1.0 - DEMAND_WEIGHT) * nk.demand
        };
        nk.last_report_at = now;
    }

    /// Takes a node's new counts off its reservation and books what it
    /// admitted beyond grants and charges as debt.
    pub fn settle(&mut self, node: &str, delta: Counts, intake: &Seen, cfg: &AllocConfig) {
        let Some(nk) = self.nodes.get_mut(node) else {
            return;
        };
        self.stats.consumed = self.stats.consumed.saturating_add(delta.consumed);
        self.stats.unleased = self.stats.unleased.saturating_add(delta.unleased);
        self.stats.demand = self.stats.demand.saturating_add(delta.demand);
        let covered = delta.unleased.min(nk.assumed);
        nk.assumed -= covered;
        let mut debt = delta.unleased - covered;
        let on_leases = delta.consumed.saturating_sub(delta.unleased);
        let mut reclaim = 0;
        let excess;
        if intake.acked_last && nk.lease_seq == intake.prev_seq && !nk.collapsed {
            // It applied that lease, which replaced every older one.
            nk.collapsed = true;
            nk.share_acked = nk.share_sent;
            nk.share_unacked = 0;
            nk.outage_acked = nk.outage_sent;
            nk.outage_unacked = 0;
            let after = nk.reserve.saturating_sub(on_leases);
            let bound = nk.lease_tokens.saturating_sub(on_leases);
            excess = on_leases.saturating_sub(nk.reserve.max(nk.lease_tokens));
            reclaim += after.saturating_sub(bound);
            nk.reserve = bound.min(after);
            // On a lease since then: every local admission is reported.
            self.stats.written_off = self.stats.written_off.saturating_add(nk.assumed);
            nk.assumed = 0;
        } else {
            excess = on_leases.saturating_sub(nk.reserve);
            nk.reserve = nk.reserve.saturating_sub(on_leases);
        }
        // Sent after our answer from after its leases died: nothing more
        // can come from them.
        let dead_at = nk.lease_dead_at(cfg);
        if intake.acked_last && intake.prev_heard_at.is_some_and(|h| h >= dead_at) {
            reclaim = reclaim.saturating_add(nk.reserve);
            nk.reserve = 0;
        }
        let from_written_off = excess.min(nk.written_off);
        nk.written_off -= from_written_off;
        debt = debt.saturating_add(excess - from_written_off);
        let region = (debt > 0).then(|| nk.region.clone());
        self.bucket = self.bucket.saturating_add(reclaim);
        self.stats.reclaimed = self.stats.reclaimed.saturating_add(reclaim);
        if let Some(region) = region {
            self.stats.debt_booked = self.stats.debt_booked.saturating_add(debt);
            let now_repaid = debt.min(self.bucket);
            self.bucket -= now_repaid;
            self.stats.repaid = self.stats.repaid.saturating_add(now_repaid);
            let rv = self.regions.entry(region).or_default();
            rv.repaid_total = rv.repaid_total.saturating_add(now_repaid);
            rv.debt = rv.debt.saturating_add(debt - now_repaid);
        }
    }

    fn book_debt_raw(&mut self, region: &str, amount: u64) {
        if amount > 0 {
            self.stats.debt_booked = self.stats.debt_booked.saturating_add(amount);
            let rv = self.regions.entry(region.to_owned()).or_default();
            rv.debt = rv.debt.saturating_add(amount);
        }
    }

    /// The node's new lease: topped up toward its level from the bucket.
    pub fn grant(
        &mut self,
        id: &KeyId,
        node: &str,
        nodes_hint: u64,
        enforced: Enforced,
        now: u64,
        cfg: &AllocConfig,
    ) -> Lease {
        let flow = self.flow;
        let surplus = self.surplus(now, cfg);
        let max_cost = self.limit.max_cost.max(1);
        // What every other node may admit per interval on its local limit
        // (thousandths): this node's allowance (or, for an older node, its
        // share) must fit beside it within the rate.
        let others_milli: u64 = self
            .nodes
            .iter()
            .filter(|(n, _)| n.as_str() != node)
            .map(|(_, nk)| nk.local_bound_milli(now, cfg))
            .fold(0u64, u64::saturating_add);
        let room = Room {
            equal_milli: self.outage_split(now, cfg),
            room_milli: self.rate_milli(cfg).saturating_sub(others_milli),
        };
        let burst = self.limit.burst;
        let Some(nk) = self.nodes.get_mut(node) else {
            return Lease {
                key: id.0.clone(),
                limit: id.1.clone(),
                tokens: 0,
                share: 0,
                share_milli: 0,
                ttl_ms: 0,
                outage_milli: None,
                bucket_milli: None,
            };
        };
        let mut due = entitlement(nk, flow, nodes_hint, max_cost, cfg);
        // The request this lease answered, again (the node sent it twice,
        // or a store ran the update twice): the same lease, nothing drawn;
        // only its time is renewed (the node may take this answer).
        let repeat = nk.lease_seq != 0 && nk.lease_seq == enforced.seq;
        if !repeat && nk.lease_unacknowledged() {
            // The next answer may miss the node too, so its lease
            // holds half a share more, to last through a retry's delay
            // (two shares at the default lease factor of 1.5).
            due.level = due.level.saturating_add(due.share_milli.div_ceil(2 * MILLI));
        }
        let target = due.level.max(demand_beyond_share(nk, burst));
        let before = nk.reserve;
        let tokens = if repeat {
            nk.lease_tokens
        } else if target > before {
            // The surplus first, then the node's credit, which fills the
            // lease up to its share's level only.
            let credit = due.credit.min(due.level.saturating_sub(before));
            let draw = (target - before)
                .min(self.bucket)
                .min(surplus.saturating_add(credit));
            let from_credit = draw.saturating_sub(surplus);
            nk.credit = nk
                .credit
                .saturating_sub_unsigned(from_credit.saturating_mul(MILLI));
            self.bucket -= draw;
            self.stats.granted = self.stats.granted.saturating_add(draw);
            before + draw
        } else {
            target
        };
        let sent = record_lease(nk, &due, tokens, &enforced, &room, now);
        Lease {
            key: id.0.clone(),
            limit: id.1.clone(),
            tokens,
            share: sent.share,
            share_milli: sent.share_milli,
            ttl_ms: cfg.lease_ttl_ns / NANOS_PER_MS,
            outage_milli: sent.outage_milli,
            bucket_milli: Some(self.bucket_milli()),
        }
    }

    /// How full the bucket is, thousandths of the burst rounded up: what no
    /// node has admitted yet, in the bucket or in a lease (a lease says it,
    /// see `Lease::bucket_milli`). 0 only when nothing is left.
    fn bucket_milli(&self) -> u64 {
        let left = self.bucket.saturating_add(self.reserved());
        let v = u128::from(left)
            .saturating_mul(u128::from(FULL_BUCKET_MILLI))
            .div_ceil(u128::from(self.limit.burst.max(1)));
        u64::try_from(v).unwrap_or(u64::MAX).min(FULL_BUCKET_MILLI)
    }

    /// The limit's rate per interval in thousandths of a unit, rounded
    /// down: what all nodes' local limits may admit together.
    fn rate_milli(&self, cfg: &AllocConfig) -> u64 {
        let v = u128::from(self.limit.limit)
            .saturating_mul(u128::from(cfg.interval_ns))
            .saturating_mul(u128::from(MILLI))
            / u128::from(self.limit.window_ns.max(1));
        u64::try_from(v).unwrap_or(u64::MAX)
    }

    /// The outage allowance of a node active on the key now: the rate, less
    /// what silent nodes' local limits may be spending, split equally among
    /// the nodes that reported the key recently (the module header,
    /// "Outage allowances").
    fn outage_split(&self, now: u64, cfg: &AllocConfig) -> u64 {
        let recent = cfg.interval_ns.saturating_mul(3);
        let mut reserved = 0u64;
        let mut active = 0u64;
        for nk in self.nodes.values() {
            if nk.on_local(now, cfg) {
                reserved = reserved.saturating_add(nk.local_bound_milli(now, cfg));
            } else if now.saturating_sub(nk.last_report_at) <= recent {
                active += 1;
            }
        }
        self.rate_milli(cfg).saturating_sub(reserved) / active.max(1)
    }

    pub fn view(&self) -> KeyView {
        KeyView {
            bucket: self.bucket,
            reserved: self.reserved(),
            flow: self.flow,
            stats: self.stats,
            regions: self.regions.clone(),
            shares: self
                .nodes
                .iter()
                .map(|(id, nk)| (id.clone(), nk.share.unwrap_or(0)))
                .collect(),
            outage_milli: self
                .nodes
                .iter()
                .filter(|(_, nk)| nk.terms.is_some_and(|t| t.outage_allowance))
                .map(|(id, nk)| (id.clone(), nk.outage_sent))
                .collect(),
        }
    }
}

/// What `credited` starts at: nothing refilled yet (a token bucket), or
/// the calendar month current at `now` (its bucket starts full, and fills
/// again when the next one starts).
fn first_credited(limit: &GlobalLimit, now: u64) -> u128 {
    limit.calendar().map_or(0, |zone| u128::from(zone.month_of(now)))
}
