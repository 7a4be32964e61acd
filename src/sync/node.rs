//! The node side of allowance reconciliation: what one Envoy node may admit
//! for each (key, limit) between two syncs with the central cluster.
//!
//! # State per (key, limit)
//! * a **lease**: tokens left and an expiry in the node's own clock
//!   (receipt + `ttl_ms`). While it lives, it is the only source of
//!   admissions: an exhausted live lease denies.
//! * a **provisional allowance** of `provisional` units (the policy's `sync.provisional`) for a
//!   key the node has not seen (or has forgotten, below), so the first
//!   request never waits for the central cluster. What it admits is reported
//!   as `unleased` and the service books it as debt.
//! * **counts since the last acknowledged report**: `consumed`, `unleased`
//!   and `demand` (demand includes denials).
//! * the node's last **share** (units per sync interval) and **outage
//!   allowance** (thousandths of a unit per interval), for
//!   `fail_open_local`.
//!
//! # Reports and acknowledgement
//! `Node::report` (the model, in tests) builds one batched
//! [`SyncRequest`](super::SyncRequest) with every (key, limit) whose
//! counts are not zero, and remembers the counts it sent. At
//! most one report is in flight: `report` returns `None` until the previous
//! one is answered or its callout timeout has passed. Counts are reset only
//! by `Node::apply` of the response with `ack_seq` equal to that report's
//! `seq`, and only by what that report carried, so admissions made while it
//! was in flight stay counted. A report lost in either direction, a response
//! to an older report, or a response later than the timeout changes nothing:
//! the next report carries the same counts again, plus the new ones. The
//! request's `acked_seq` tells the service which counts it may already hold.
//!
//! # Leases
//! `tokens` count from when the request was sent: on receipt the node
//! subtracts what it admitted against its previous lease since then, and
//! the new lease replaces the old one. So from any report's sending on, the
//! node admits at most `max(what the old lease had left, tokens)` on leases,
//! which is the service's accounting rule.
//!
//! # The provisional allowance: once per key start
//! A **key start** is a (key, limit) the node's state did not hold (a new
//! key, or one whose entry was forgotten or reclaimed as idle). Only a
//! start grants the provisional allowance. A key whose lease expired is
//! never granted it again while the node is *connected* (it applied a
//! response within the longest lease TTL of that response, or started
//! less than one interval plus the callout timeout ago): it waits for its
//! next lease, which the next answer brings (its demand is reported). So
//! however a client times its requests against lease expiries, a node
//! admits at most `P` without a lease per key start (regression:
//! `a_paced_client_cannot_farm_the_provisional_allowance_on_lease_expiry`).
//!
//! # Keep-alive
//! A key asked for within [`LEASE_KEEP_ALIVE_NS`] is reported every
//! interval even with zero counts, so the service renews its lease and a
//! sparse client finds a live one. After a minute without a request its
//! lease is left to expire: a later request waits for its next lease
//! (one interval), it is not a key start.
//!
//! # Never waiting forever
//! A key that has waited for a lease for [`NodeView::await_max_ns`]
//! (two sync intervals plus the callout timeout) while connected gets
//! none the service will send: its limit is unknown to the service (a
//! rollout with policy skew), it lives in the key table's overflow entry
//! (never reported), or its report did not fit. It then runs its failure
//! mode like a key cut off, until a lease comes ([`Allowance::no_lease`]
//! says so, and the engine counts it). With `fail_open_local` and no
//! allowance or share yet, its local bucket runs at `P` per interval.
//!
//! # When the lease expired and no new one came
//! On a node that is not connected, the failure mode applies:
//! * `fail_closed`: deny;
//! * `fail_open`: admit everything (reported as `unleased`);
//! * `fail_open_local`: a local token bucket at the last lease's **outage
//!   allowance** `a` (rate `a` per sync interval, in thousandths of a unit,
//!   capacity `a + cost`), **empty** when the lease expired, for at most `local_max`
//!   (the filter's 60 s) after the lease expired; then fail closed. From a
//!   service older than the allowance, at the last whole `share` instead.
//!   Only for a lease that expired with no response applied since (the node
//!   was cut off while holding it); otherwise it denies.
//!   The service splits the limit's rate equally among the nodes active on
//!   the key at each answer, keeps a silent node's allowance reserved for
//!   as long, and never lets allowances sum above the rate, so local
//!   limits together admit at most the global rate plus what their buckets
//!   saved up (`Σ (a + cost)`, see `tenantgate-central`'s `alloc`).
//!
//! A key that never had a lease and has used its provisional allowance is
//! denied while the node is connected (its lease is on the way); on a node
//! cut off, the failure mode applies to it too (with no share,
//! `fail_open_local` denies).
//!
//! # Costs settled after the response
//! A class whose real cost is known only at its stream's end (see
//! `crate::cost`) charges its estimate like any cost, then settles the
//! difference here ([`Allowance::settle_more`], [`Allowance::give_back`]):
//! * more: taken from the live lease (counted as consumed on it, reported
//!   like any use); what the lease cannot hold the key **owes**, up to the
//!   limit's `max_debt` (the rest is written off and counted). A key that
//!   owes pays it out of its leases before it admits anything on them
//!   (the next lease pays it first, when it is installed). So what a node
//!   reports never exceeds its leases on account of late settlement: the
//!   service's accounting, and its bound, are unchanged, and each node owes
//!   at most `max_debt` per key.
//! * less: given back to the live lease (a debt first); the units are
//!   taken off the counts not yet reported where they still are. A unit
//!   given back after it was reported and spent again is reported twice:
//!   the service then counts more than the node used (it errs toward
//!   admitting less). With no live lease it is not given back.
//!
//! The node's report cycle and its circuit breaker are in [`super::cycle`].
//!
//! Pure: no clock, no I/O. `now` is the node's wall clock in nanoseconds;
//! only differences of it are used, so a node's clock offset changes
//! nothing.

use core::num::NonZeroU64;

use crate::limiter::token_bucket::{Check, Gcra};
pub use crate::policy::{BreakerConfig, FailureMode};

pub(super) const NANOS_PER_MS: u64 = 1_000_000;
/// Shares and allowances travel in thousandths of a unit.
const MILLI: u64 = 1_000;

/// How long after its last request a key keeps being reported (with
/// zero counts if need be) so that its lease is renewed: one minute.
pub const LEASE_KEEP_ALIVE_NS: u64 = 60_000 * NANOS_PER_MS;

/// A lease as the node installs it (from the answer, clamped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    pub tokens: u64,
    /// Units per interval.
    pub share: u64,
    /// Thousandths of a unit per interval (0: unknown).
    pub share_milli: u64,
    pub ttl_ns: u64,
    /// The outage allowance, thousandths of a unit per interval (`None`:
    /// the service sent none; `fail_open_local` runs at `share`).
    pub outage_milli: Option<u64>,
    /// How full the service's bucket was, thousandths of the burst
    /// (`None`: the service did not say; see `Lease::bucket_milli`).
    pub bucket_milli: Option<u16>,
}

impl Granted {
    /// The lease an answer carried, to last `ttl_ns` (its `ttl_ms`, clamped
    /// by the caller).
    pub fn from_wire(lease: &super::protocol::Lease, ttl_ns: u64) -> Granted {
        Granted {
            tokens: lease.tokens,
            share: lease.share,
            share_milli: lease.share_milli,
            ttl_ns,
            outage_milli: lease.outage_milli,
            bucket_milli: lease
                .bucket_milli
                .and_then(|v| u16::try_from(v.min(super::protocol::FULL_BUCKET_MILLI)).ok()),
        }
    }
}

impl Allowance {
    /// The service said nothing of the limit was left (`bucket_milli` 0:
    /// every unit admitted, none in its bucket or any node's lease) in a
    /// lease that is still live and was granted at or after `since_ns`
    /// (it expires at least `max_ttl_ns` after `since_ns`). For a bucket
    /// that does not refill until a calendar month ends, that month is
    /// spent.
    pub fn told_spent_since(&self, since_ns: u128, max_ttl_ns: u64, now: u64) -> bool {
        self.bucket_milli == Some(0)
            && self.lease.is_some_and(|l| {
                now < l.expires_at && u128::from(l.expires_at.saturating_sub(max_ttl_ns)) >= since_ns
            })
    }

    /// How many intervals until the lease can carry `missing` more units,
    /// at the share's pace (one at least: the next lease comes with the
    /// next answer). The exact share when the service sent it, else the
    /// whole-unit share (at least one unit per interval).
    pub fn intervals_for(&self, missing: u64) -> u64 {
        let intervals = if self.share_milli > 0 {
            missing.saturating_mul(MILLI).div_ceil(self.share_milli)
        } else {
            missing.div_ceil(self.share.max(1))
        };
        intervals.max(1)
    }
}

/// Why a request was admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    Lease,
    Provisional,
    FailOpenLocal,
    FailOpen,
}

/// Why a request was denied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denied {
    /// The live lease has fewer tokens than the cost.
    LeaseExhausted,
    /// Connected, no lease yet, provisional allowance used up.
    AwaitingLease,
    /// The lease expired and the mode is `fail_closed` (or `fail_open_local`
    /// ran out of time).
    FailClosed,
    /// `fail_open_local`'s local limit is exhausted (or there is no share).
    LocalLimit,
}

/// Counts since the last acknowledged report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub consumed: u64,
    pub unleased: u64,
    pub demand: u64,
}

impl Counts {
    pub fn is_zero(&self) -> bool {
        *self == Counts::default()
    }

    fn minus(&self, acked: &Counts) -> Counts {
        Counts {
            consumed: self.consumed.saturating_sub(acked.consumed),
            unleased: self.unleased.saturating_sub(acked.unleased),
            demand: self.demand.saturating_sub(acked.demand),
        }
    }
}

/// A live or expired lease: tokens left and its expiry (node clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseState {
    pub tokens_left: u64,
    pub expires_at: u64,
}

/// What one decision needs to know about the node as a whole (derived
/// from [`SyncState`](super::SyncState) and the settings; see
/// [`SyncState::view`](super::SyncState::view)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeView {
    /// The node applied a response recently enough to expect leases.
    pub connected: bool,
    /// When the last response was applied.
    pub last_applied_at: Option<u64>,
    /// The current sync interval.
    pub interval_ns: u64,
    pub mode: FailureMode,
    pub provisional: u64,
    pub local_max_ns: u64,
    /// How long a key waits for a lease while connected before its
    /// failure mode applies: two intervals plus the callout timeout.
    pub await_max_ns: u64,
    /// The longest a lease lasts (`sync`'s maximum TTL): a live lease was
    /// granted at most this long before it expires.
    pub max_ttl_ns: u64,
}

/// The allowance state of one (key, limit): plain data, so it can live in
/// memory (the model `Node`, in tests) or in a shared-data record (the filter), with the
/// same decisions. See the module header for its parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allowance {
    pub lease: Option<LeaseState>,
    pub provisional_left: u64,
    /// Counts since the last acknowledged report.
    pub pending: Counts,
    /// Units ever admitted on leases (wrapping): the difference of two
    /// readings is what was admitted on leases in between.
    pub lease_used: u64,
    /// The last share, units per sync interval.
    pub share: u64,
    /// The last share exactly, in thousandths of a unit per interval (0:
    /// the service did not say; see `Lease::share_milli`).
    pub share_milli: u64,
    /// The last lease's outage allowance, thousandths of a unit per
    /// interval (`None`: the service sent none; see `Lease::outage_milli`).
    pub outage_milli: Option<u64>,
    /// How full the service's bucket was at the last lease, thousandths
    /// of the burst (`None`: the service did not say; see
    /// `Lease::bucket_milli`): whether a pool limit is short.
    pub bucket_milli: Option<u16>,
    /// `fail_open_local`'s bucket (rate `share` per interval, capacity
    /// `share`): its theoretical arrival time, once started.
    pub local_tat: Option<u64>,
    /// Since when a request has waited for a lease (none live, the
    /// provisional allowance used up) on a connected node; cleared by a
    /// lease.
    pub awaiting_since: Option<u64>,
    /// When a request last asked for this key (admitted or not).
    pub last_demand_at: Option<u64>,
    /// When the key started (its first request since the node holds it),
    /// until its first lease: reported as `started_ms`, so the service
    /// knows over how long its first demand came. (Non-zero: the engine
    /// keeps an allowance and its charged copy per global limit on the
    /// stack for every request; eight bytes less each.)
    pub started_at: Option<NonZeroU64>,
    /// Units a late-settled cost took beyond the lease, to be paid out of
    /// the next lease tokens before anything is admitted on them (see
    /// "Costs settled after the response").
    pub owed: u64,
}

impl Allowance {
    /// A (key, limit) the node has not seen.
    pub fn fresh(provisional: u64) -> Allowance {
        Allowance {
            lease: None,
            provisional_left: provisional,
            pending: Counts::default(),
            lease_used: 0,
            share: 0,
            share_milli: 0,
            outage_milli: None,
            bucket_milli: None,
            local_tat: None,
            awaiting_since: None,
            last_demand_at: None,
            started_at: None,
            owed: 0,
        }
    }

    /// For a key with no lease since it started, how long before `now` it
    /// started, in milliseconds rounded up (see `Report::started_ms`).
    pub fn started_ms(&self, now: u64) -> Option<u64> {
        let at = self.started_at.filter(|_| self.lease.is_none())?;
        Some(now.saturating_sub(at.get()).div_ceil(NANOS_PER_MS))
    }

    /// The rate `fail_open_local` runs at, thousandths of a unit per
    /// interval: the outage allowance, or the whole share from a service
    /// that sent none.
    pub fn local_rate_milli(&self) -> u64 {
        self.outage_milli
            .unwrap_or_else(|| self.share.saturating_mul(MILLI))
    }

    /// Whether the next report must carry this key: it has counts to
    /// report, or it was asked for within [`LEASE_KEEP_ALIVE_NS`], so its
    /// lease is renewed every interval and a sparse client (one request
    /// every few lease TTLs) finds a live lease instead of an expired one.
    pub fn wants_report(&self, now: u64) -> bool {
        !self.pending.is_zero()
            || self
                .last_demand_at
                .is_some_and(|at| now < at.saturating_add(LEASE_KEEP_ALIVE_NS))
    }

    /// Whether this key has waited for a lease longer than the view allows
    /// while connected: it runs its failure mode (see the module header).
    pub fn no_lease(&self, view: &NodeView, now: u64) -> bool {
        view.connected
            && self
                .awaiting_since
                .is_some_and(|since| now >= since.saturating_add(view.await_max_ns))
    }

    /// Counts a request of `cost` units as demand, then [`Allowance::take`].
    pub fn decide(&mut self, view: &NodeView, cost: u64, now: u64) -> Result<Admitted, Denied> {
        self.note_demand(cost);
        self.take(view, cost, now)
    }

    /// Counts `cost` units of demand (admitted or not).
    pub fn note_demand(&mut self, cost: u64) {
        self.pending.demand = self.pending.demand.saturating_add(cost);
    }

    /// Whether `cost` units are admitted now, charging them if so. The
    /// request's demand must already be counted ([`Allowance::note_demand`]).
    pub fn take(&mut self, view: &NodeView, cost: u64, now: u64) -> Result<Admitted, Denied> {
        self.last_demand_at = Some(now);
        if self.lease.is_none() && self.started_at.is_none() {
            self.started_at = NonZeroU64::new(now);
        }
        self.pay_owed(now);
        if let Some(ref mut lease) = self.lease {
            if now < lease.expires_at {
                if self.owed > 0 || lease.tokens_left < cost {
                    return Err(Denied::LeaseExhausted);
                }
                lease.tokens_left -= cost;
                self.pending.consumed = self.pending.consumed.saturating_add(cost);
                self.lease_used = self.lease_used.wrapping_add(cost);
                return Ok(Admitted::Lease);
            }
        }
        // Only a key start holds a provisional allowance: an expired lease
        // never brings it back (the module header, "once per key start").
        if self.lease.is_none() && self.provisional_left >= cost {
            self.provisional_left -= cost;
            self.count_unleased(cost);
            return Ok(Admitted::Provisional);
        }
        if view.connected {
            let since = *self.awaiting_since.get_or_insert(now);
            if now < since.saturating_add(view.await_max_ns) {
                return Err(Denied::AwaitingLease);
            }
            return self.no_lease_mode(view, cost, now);
        }
        let admitted = match view.mode {
            FailureMode::FailClosed => return Err(Denied::FailClosed),
            FailureMode::FailOpen => Admitted::FailOpen,
            FailureMode::FailOpenLocal => {
                // Only a lease that expired with no response since (the
                // node was cut off while it held it): the service reserves
                // the shares of nodes it has not heard from since their
                // grant, and of no others.
                let Some(expired_at) = self.lease.map(|l| l.expires_at) else {
                    return Err(Denied::LocalLimit);
                };
                if view.last_applied_at.is_some_and(|a| a >= expired_at) {
                    return Err(Denied::LocalLimit);
                }
                if now >= expired_at.saturating_add(view.local_max_ns) {
                    return Err(Denied::FailClosed);
                }
                // Empty when the lease expired, accruing from then.
                self.local_take(self.local_rate_milli(), expired_at.min(now), view, cost, now)?;
                Admitted::FailOpenLocal
            }
        };
        self.count_unleased(cost);
        Ok(admitted)
    }

    /// The failure mode of a connected node's key that got no lease in
    /// time (see the module header, "Never waiting forever").
    fn no_lease_mode(&mut self, view: &NodeView, cost: u64, now: u64) -> Result<Admitted, Denied> {
        let admitted = match view.mode {
            FailureMode::FailClosed => return Err(Denied::FailClosed),
            FailureMode::FailOpen => Admitted::FailOpen,
            FailureMode::FailOpenLocal => {
                let rate = match self.local_rate_milli() {
                    0 => view.provisional.saturating_mul(MILLI),
                    rate => rate,
                };
                self.local_take(rate, now, view, cost, now)?;
                Admitted::FailOpenLocal
            }
        };
        self.count_unleased(cost);
        Ok(admitted)
    }

    /// `fail_open_local`'s bucket at `rate_milli` thousandths of a unit per
    /// interval, holding one interval's worth plus the request's cost (so
    /// any cost can pass, and an allowance below one unit per interval
    /// loses nothing to requests that arrive unevenly), empty at `from`: it
    /// admits only what accrues from then on. Counted in thousandths, so an
    /// allowance of 0.56 units per interval (100/min over three nodes)
    /// admits at its exact pace.
    fn local_take(
        &mut self,
        rate_milli: u64,
        from: u64,
        view: &NodeView,
        cost: u64,
        now: u64,
    ) -> Result<(), Denied> {
        let cost_milli = cost.saturating_mul(MILLI);
        let capacity = rate_milli.saturating_add(cost_milli);
        let Some(gcra) = Gcra::new(rate_milli, view.interval_ns.max(1), capacity) else {
            return Err(Denied::LocalLimit);
        };
        let tat = *self
            .local_tat
            .get_or_insert(from.saturating_add(gcra.tolerance_ns()));
        match gcra.check(tat, now, cost_milli) {
            Check::Admit { new_tat, .. } => {
                self.local_tat = Some(new_tat);
                Ok(())
            }
            Check::Deny { .. } => {
                self.local_tat = Some(gcra.saturate(tat, now));
                Err(Denied::LocalLimit)
            }
        }
    }

    /// Charges `units` more, without admission: a cost settled after the
    /// response above its estimate (see "Costs settled after the
    /// response"). Taken from the live lease, the rest owed up to
    /// `max_debt`; returns the units written off.
    pub fn settle_more(&mut self, units: u64, max_debt: u64, now: u64) -> u64 {
        self.pending.demand = self.pending.demand.saturating_add(units);
        let mut rest = units;
        if let Some(ref mut lease) = self.lease {
            if now < lease.expires_at {
                let take = rest.min(lease.tokens_left);
                lease.tokens_left -= take;
                self.pending.consumed = self.pending.consumed.saturating_add(take);
                self.lease_used = self.lease_used.wrapping_add(take);
                rest -= take;
            }
        }
        let owed = self.owed.saturating_add(rest);
        self.owed = owed.min(max_debt.max(self.owed));
        owed - self.owed
    }

    /// Gives `units` back: a cost settled after the response below its
    /// estimate. A debt is lowered first, then the live lease gets them
    /// (and the counts not yet reported lose them); with no live lease
    /// they are not given back.
    pub fn give_back(&mut self, units: u64, now: u64) {
        let forgiven = units.min(self.owed);
        self.owed -= forgiven;
        let rest = units - forgiven;
        if let Some(ref mut lease) = self.lease {
            if now < lease.expires_at {
                lease.tokens_left = lease.tokens_left.saturating_add(rest);
                self.pending.consumed = self.pending.consumed.saturating_sub(rest);
            }
        }
    }

    /// Pays what the key owes out of its live lease (counted as consumed
    /// on it).
    fn pay_owed(&mut self, now: u64) {
        if self.owed == 0 {
            return;
        }
        if let Some(ref mut lease) = self.lease {
            if now < lease.expires_at {
                let pay = self.owed.min(lease.tokens_left);
                lease.tokens_left -= pay;
                self.owed -= pay;
                self.pending.consumed = self.pending.consumed.saturating_add(pay);
                self.lease_used = self.lease_used.wrapping_add(pay);
            }
        }
    }

    /// Units a request of `cost` lacks now: its cost and what the key
    /// owes, less what it could take (see [`Allowance::available`]).
    pub fn missing(&self, cost: u64, now: u64) -> u64 {
        let raw = match self.lease {
            Some(l) if now < l.expires_at => l.tokens_left,
            Some(_) => 0,
            None => self.provisional_left,
        };
        cost.saturating_add(self.owed).saturating_sub(raw)
    }

    fn count_unleased(&mut self, cost: u64) {
        self.pending.consumed = self.pending.consumed.saturating_add(cost);
        self.pending.unleased = self.pending.unleased.saturating_add(cost);
    }

    /// Units a request could take now without a failure mode: the live
    /// lease's tokens less what the key owes, else what is left of the
    /// provisional allowance.
    pub fn available(&self, now: u64) -> u64 {
        match self.lease {
            Some(l) if now < l.expires_at => l.tokens_left.saturating_sub(self.owed),
            Some(_) => 0,
            None => self.provisional_left,
        }
    }

    /// Units a worker's lease may take now beyond a request's cost: only
    /// from a live lease of the service, never the provisional allowance
    /// nor a failure mode (see `crate::pipeline::lease`).
    pub fn leasable(&self, now: u64) -> u64 {
        match self.lease {
            Some(l) if now < l.expires_at => l.tokens_left.saturating_sub(self.owed),
            _ => 0,
        }
    }

    /// A worker gives back `units` of its lease it did not spend (they
    /// were counted consumed when taken: no longer), and counts as demand
    /// the `spent` units its requests took from the lease (a request a
    /// lease serves never reads this record). Units go back to the live
    /// lease, whichever it is now; with none live they are dropped, which
    /// errs toward admitting less.
    pub fn give_back_lease(&mut self, units: u64, spent: u64, now: u64) {
        if let Some(l) = self.lease.as_mut().filter(|l| now < l.expires_at) {
            l.tokens_left = l.tokens_left.saturating_add(units);
        }
        self.pending.consumed = self.pending.consumed.saturating_sub(units);
        self.lease_used = self.lease_used.wrapping_sub(units);
        if spent > 0 {
            self.note_demand(spent);
            self.last_demand_at = Some(now);
        }
    }

    /// The report in flight carried `sent` and was acknowledged.
    pub fn ack(&mut self, sent: &Counts) {
        self.pending = self.pending.minus(sent);
    }

    /// Installs a lease of `tokens` (counted from when the report was
    /// sent; `used_since_send` were admitted on leases since then) with
    /// `ttl_ns` from `now`.
    pub fn install(&mut self, lease: Granted, used_since_send: u64, now: u64) {
        self.lease = Some(LeaseState {
            tokens_left: lease.tokens.saturating_sub(used_since_send),
            expires_at: now.saturating_add(lease.ttl_ns),
        });
        self.share = lease.share;
        self.share_milli = lease.share_milli;
        self.outage_milli = lease.outage_milli;
        self.bucket_milli = lease.bucket_milli;
        self.local_tat = None;
        self.awaiting_since = None;
        self.started_at = None;
        // A late settlement's debt is paid first.
        self.pay_owed(now);
    }

    /// Nothing to report and a lease that expired longer ago than
    /// `fail_open_local` could still use it (`keep_ns`): can be forgotten.
    pub fn forgettable(&self, now: u64, keep_ns: u64) -> bool {
        let gone = self
            .lease
            .is_some_and(|l| now >= l.expires_at.saturating_add(keep_ns));
        gone && self.pending.is_zero() && self.owed == 0
    }

    /// Back to what a fresh key would do, with nothing to report and
    /// nothing owed: a slot holding it can be reused without losing
    /// anything the service needs.
    pub fn is_idle(&self, now: u64) -> bool {
        self.pending.is_zero() && self.owed == 0 && self.lease.is_none_or(|l| now >= l.expires_at)
    }
}

#[cfg(test)]
mod model;
#[cfg(test)]
pub use model::{Node, NodeConfig, NodeStats};

#[cfg(test)]
mod tests;
