//! The allocator: splits each global limit among regions and nodes as
//! leases, and reconciles what the nodes report.
//!
//! # THE BOUND
//! Terms: a global limit of `L` units per window `W` (rate `r = L/W`) with
//! burst `B`; `N` nodes; the sync interval `I`; each node's callout timeout
//! `D` and `fail_open_local` duration `local_max`, as the node reports
//! them in its requests ([`NodeTerms`]: the values it enforces, never the
//! service's copy; the policy's `sync:` values only for a node that
//! reports none); leases of
//! TTL `ttl`; the provisional allowance `P` (`sync.provisional`, units per
//! node and key start); `S` the most key starts one node makes within one
//! window (see below; 1 for a key the node keeps in its table); a central
//! outage of length `T`; `A` the aggregate demand rate; `a_i` node `i`'s
//! outage allowance (units per interval, see "Outage allowances") and `c`
//! the limit's largest route cost (`max_cost`). The units admitted across
//! all nodes in **any** window of length `W` are at most
//!
//! ```text
//!     L + B + N·S·P + X(T)
//!
//!     X(T) = 0                             fail_closed, or no outage (T = 0)
//!     X(T) = Σ (a_i + c) ≤ r·I + N·c       fail_open_local, for any T
//!     X(T) = A·min(T + I + D, W)           fail_open
//! ```
//!
//! with each (key, limit)'s failure mode as its node reports it (a route
//! class may override `sync.failure_mode`; of the classes sharing a key's
//! action the node reports the most permissive). `fail_open` is outside
//! the `fail_open_local` term: only its own term bounds it.
//!
//! whatever the clients' timing. Leases do not appear: every lease is
//! carved out of the bucket, so the unexpired leases of all nodes never
//! hold more than `B` together (lease size and TTL change utilisation, not
//! the bound). A **key start** is a (key, limit) the node's state did not
//! hold: first sight, or after its entry was forgotten or reclaimed as idle
//! (nothing to report, lease expired). Only a start grants `P`; a lease
//! expiry never does (the node waits for its next lease), so a client
//! timing its requests to lease expiries cannot farm it. `T` and `ttl`
//! only decide whether a failure mode runs at all. [`crate::bound`]
//! computes the value.
//!
//! **Costs settled after the response** (a route class with `settle:`,
//! the filter's `cost` module): nodes charge an estimate `E` per request
//! and settle its real cost (at most the ceiling `C`) at the stream's end,
//! on their lease, or owed (at most the limit's `max_debt` `D` per node,
//! paid out of later leases first; beyond, written off): what a node
//! reports never exceeds its leases on account of it, so this allocator is
//! unchanged, and counting each request's real cost at its admission a
//! window admits at most the bound above plus `M·(C − E) + N·D + W_off`
//! (`M` requests in flight at once over all nodes, `W_off` units written
//! off in the window). The simulator measures it with
//! `SimConfig::late` (`tests/sim.rs`, `late_settlement_…`).
//!
//! Outside the bound: a key the service cannot lease (a limit its policy
//! lacks, a key the node's full table charges to its overflow entry, which
//! is never reported). After waiting `2·I + D` for a lease such a key runs
//! its failure mode (`tenantgate.sync.no_lease` counts it): `fail_closed`
//! admits nothing, `fail_open_local` at most its last outage allowance
//! or share (or `P`) per `I` per node, `fail_open` everything.
//!
//! # Fair shares
//! Shares are computed in thousandths of a unit and each node's share
//! accrues as **credit** every interval (capped at its lease level plus one
//! share), so a flow per interval below the number of nodes (100/min is
//! 1.67 units per 1 s interval) is split exactly over time instead of
//! rounded to whole units with a fixed tie-break. What the bucket holds
//! beyond the promised (every node's credit, and the refill since the
//! interval began) is *surplus*, free for any node to draw; once the bucket
//! is scarce a node draws only its credit (one share ahead at most). So
//! among nodes of one region with equal demand, admissions over any window
//! in which each node's share sums to at least 10 units are equal within
//! one unit per node plus one share (Jain's index ≥ 0.95: the simulator's
//! `users_sizes` scenarios and `alloc::tests`), and the refill is never
//! handed to whoever asks first. A lease's level is at least the limit's
//! largest route cost (`max_cost`, at most `B`), so every cost up to `B`
//! is admitted at the limit's rate: credit accrues until the lease can
//! carry it.
//!
//! # Why
//! Per (key, limit) the service holds a token bucket `b` (refilled at `r`,
//! exactly, from the service's own clock) and, per node, a reservation
//! `R_i`: an upper bound on what the node can still admit on leases,
//! counted from the send of its last applied report. Invariant:
//! `b + Σ R_i ≤ B`. A grant moves tokens from `b` to `R_i`; reported lease
//! consumption leaves `R_i`; a reservation proven too high goes back to `b`
//! (*reclaim*); the refill stops while the sum is at `B`. Lease consumption
//! in a window is then at most what the sum held at its start (`≤ B`) plus
//! the refill during it (`≤ L`). What nodes admit without a lease is
//! charged to `b` when reported (or becomes debt), hence the extra terms:
//! * provisional allowances: at most `P` per node and key start, `S`
//!   starts per node and window;
//! * `fail_open_local`: each cut-off node admits at most its outage
//!   allowance `a_i` per interval from a local bucket that starts empty and
//!   holds at most `a_i + c` (one interval's allowance and one request of
//!   any cost, so requests arriving unevenly lose nothing), for
//!   the node's own `local_max` after its lease died. The service keeps the
//!   allowances of nodes it has not heard from reserved (until that node's
//!   `answered_at + D + ttl + local_max`, with its reported values) and
//!   charges them to `b` as time passes (before any grant), for every key
//!   that does not fail closed (a `fail_closed` key admits nothing without
//!   a lease: nothing is kept for it), and it never sends allowances that
//!   could sum above `r·I`, so local admissions come out of the refill
//!   except for what the local buckets saved up: `≤ Σ (a_i + c) ≤ r·I +
//!   N·c`. (Stated as `Σ shares ≤ r·I` before issue 21, which missed that
//!   a local bucket holds at least one request: below one unit per node
//!   and interval, 100/min over three nodes, that is more than a share.)
//! * `fail_open`: everything demanded while in the failure mode, which lasts
//!   at most the outage plus one sync (`T + I + D`) and at most `W` of it
//!   falls in one window.
//!
//! The reservation rule: a node applies a lease of `tokens` as "`tokens`
//! minus what I admitted on leases since I sent the request", replacing the
//! old lease. So from that send on it admits at most
//! `max(R_old − reported, tokens)` on leases; the service sets
//! `R := max(R − consumed, tokens)` and draws only the increase from `b`.
//! Once the node acknowledges that response, its next report proves the
//! old lease gone and `R := tokens − consumed` (the rest is reclaimed).
//! A lease is dead by `answered_at + D + ttl` in the service's clock, with
//! the `D` its node reported: the node measures `ttl` from receipt and
//! discards responses older than its `D`.
//! No timestamps travel, so node clocks (offset or skewed) cannot move the
//! bound. A node silent past that keeps its reservation for `settle_ns`
//! more, then it is written off as consumed.
//!
//! # Outage allowances
//! Each lease carries the node's outage allowance `a_i` (thousandths of a
//! unit per interval): what its `fail_open_local` admits once the lease
//! expired with no new one. The rule: the rate `r·I` (in thousandths,
//! rounded down), less the allowances kept for silent nodes, split
//! **equally** among the nodes active on the key (that reported it within
//! the last three intervals: a node reports a key for a minute after its
//! last request), whatever their demand; each capped at `r·I` less every
//! other node's largest allowance it may still hold (acknowledged, or sent
//! since), so `Σ a_i ≤ r·I` at every instant, as nodes join and leave (a
//! joining node gets what is left until the others acknowledged their
//! smaller allowances, within two intervals). Why equal: during an outage
//! the service sees no demand, and the demand at its last answer is no
//! guide once demand moved. With last shares, three Envoys whose demand
//! had just shifted to one of them admitted 0 and 55 of 100 over an
//! outage's minute. Utilisation: the nodes admit `Σ_i min(d_i, a_i)` per
//! interval over an outage (`d_i` node `i`'s demand), so all of the rate
//! once every active node asks for at least `r·I / n`, and at least
//! `min(d_i, r·I / n)` on every active node. A node with no request in the
//! minute before the outage has neither an allowance nor a lease to fall
//! back from. A node older than allowances (no `outage_allowance` in its
//! settings) runs its local limit at its whole share: that is what is
//! reserved, charged and capped for it instead.
//!
//! # A cold key's burst
//! While the bucket holds **surplus** (beyond every node's credit and this
//! interval's refill: a key that starts with its bucket full, or one idle
//! long enough), a lease is topped up to one interval of the node's demand,
//! out of the surplus only; credit still fills a lease up to its share's
//! level and no further. (One interval, not the lease factor's 1.5: the
//! next lease tops it up an interval later, and half an interval more
//! would be taken from nodes whose first report comes later.) A key's
//! first report from a node says how long ago the key started on it
//! (`Report::started_ms`): its demand came within that time (at least a
//! tenth of an interval), so a burst seen a tenth of an interval in is
//! leased at ten times that per interval. So the first leases of a cold
//! key hand out the bucket by demand, not one share per interval each (a
//! burst of 100 from cold admitted 44 in two Envoys before). The bound does not move: every lease
//! is carved out of the bucket, and `b + Σ R_i ≤ B` holds whoever draws
//! it. Once the bucket is scarce the surplus is gone, and the refill is
//! split by shares as before.
//!
//! # Allocation
//! Once per service interval (`now / I`), per (key, limit): the interval's
//! flow `r·I`, less the outage allowances reserved for silent nodes, is split among
//! regions by recent demand, max-min fair with a floor per region and a cap
//! of an equal share plus the borrowing ceiling; each region's part is split
//! among its nodes the same way (floor per node), all in thousandths of a
//! unit (see "Fair shares"). A node's lease is topped up to its level,
//! `max(share × lease_factor, max_cost)` (to last until the next lease
//! arrives), plus half a share when the node's report did not acknowledge
//! its last lease (that answer was lost or came too late: the next may
//! miss it too, and the lease must last through a retry's delay; issue
//! 35), out of the surplus and then its credit, and beyond it to one
//! interval of its demand out of the surplus only (see "A cold key's
//! burst"), never beyond what `b` holds. Demand is an average of reported demand
//! (denials included) per unit of the service's time.
//!
//! # Debt
//! Units admitted beyond grants (provisional allowances, local or open
//! failure modes beyond what was charged for them, lease consumption beyond
//! a reservation) are booked to the node's region as debt. Debt is repaid
//! from `b` at once while `b` has tokens, then out of the region's own
//! allocation in later intervals (at most `repay_pct` of it per interval);
//! repaid tokens are destroyed, not given to other regions.
//!
//! Assumes the service keeps its state through an outage. A service that
//! loses it starts buckets full and forgets reservations: up to `B + Σ R`
//! more in the window of the restart. The service keeps it in a store
//! (`crate::store`): Redis survives a restart of the service replicas, the
//! embedded store does not.
//!
//! # Records
//! The state is one record per node ([`Session`]) and one per (key, limit)
//! ([`KeyState`], which also holds the key's per-region allocation and
//! debt). A request is three steps, each on one record: [`begin`] on the
//! session, [`visit`] on every (key, limit) the node reports or holds, and
//! [`finish`] on the session. A (key, limit) never reads another record:
//! whether a node is silent is decided from a copy of its `heard_at` kept in
//! the key's record, which every applied request of the node refreshes
//! (it visits every key the node holds), and what the node enforces
//! ([`NodeTerms`], its failure mode) is kept with its lease in the key's
//! record. So a store that updates each record atomically gives the same
//! answers as [`Allocator`]; the service's stores run a request's steps as
//! one transaction besides (`crate::store::Txn`), so that a request that
//! fails mid-way counts nothing rather than part of its report.

mod fair;
mod key;
mod node_key;
mod record;
mod session;
#[cfg(test)]
mod tests;
pub mod tuning;

use std::collections::{BTreeMap, BTreeSet};

// hashbrown's hasher (foldhash, seeded at random per process), as the
// embedded store's tables: SipHash was 7 % of a key report's CPU.
use hashbrown::{HashMap, HashSet};

use serde::{Deserialize, Serialize};
use tenantgate::limiter::calendar::Zone;
use tenantgate::sync::{Counts, FailureMode, Lease, SyncRequest, SyncResponse, PROTOCOL_VERSION};

use crate::error::{AllocError, ConfigError};
pub use fair::{max_min_fair, Claim};
pub use key::{Enforced, KeyState, KeyStats, RegionView, Span};
pub use node_key::{Order, RequestSeq, Seen};
use session::Intake;
pub use session::{KeyId, SeqCheck, Session, MAX_SEQ_AHEAD_NS, MAX_SEQ_STEP};

const NANOS_PER_MS: u64 = 1_000_000;

/// A global limit: `limit` units per `window_ns`, holding at most `burst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobalLimit {
    pub limit: u64,
    pub window_ns: u64,
    pub burst: u64,
    /// The largest cost one request of this limit may have (policy:
    /// the largest route cost, at most `burst`). A lease is sized to
    /// carry at least this much, so every cost up to it is admissible.
    #[serde(default = "one")]
    pub max_cost: u64,
    /// A calendar month's budget (`per: month`): its time zone's
    /// [`Zone::tag`] plus one; 0 for a token bucket. The bucket then
    /// refills only when a month starts there, to `burst` (see
    /// [`KeyState::advance`]).
    #[serde(default)]
    pub month: u64,
}

fn one() -> u64 {
    1
}

impl GlobalLimit {
    /// The zone of a calendar month's budget (`None`: a token bucket, or
    /// a zone this build's table does not have).
    pub fn calendar(&self) -> Option<Zone> {
        let tag = u32::try_from(self.month.checked_sub(1)?).ok()?;
        Zone::from_tag(tag)
    }
}

/// The service's reconciliation settings (all times in nanoseconds).
#[derive(Debug, Clone, PartialEq)]
pub struct AllocConfig {
    pub policy_version: String,
    /// Global limits by limit name (later: compiled from the policy).
    pub limits: BTreeMap<String, GlobalLimit>,
    /// `I`: the sync interval nodes are told to use, and the allocation
    /// interval.
    pub interval_ns: u64,
    /// `ttl`: lease lifetime from receipt.
    pub lease_ttl_ns: u64,
    /// `D`: the policy's callout timeout, assumed for a node that reports
    /// none (each node's own is in [`NodeTerms`]).
    pub response_timeout_ns: u64,
    /// A lease is topped up to `share × lease_factor_pct / 100`.
    pub lease_factor_pct: u64,
    /// Units per interval every active node gets before demand is served.
    pub node_floor: u64,
    /// Units per interval every active region gets before demand is served.
    pub region_floor: u64,
    /// How much of an interval's flow (%) a region may get beyond an equal
    /// share.
    pub borrow_ceiling_pct: u64,
    /// At most this % of a region's allocation goes to its debt per interval.
    pub repay_pct: u64,
    /// How long after its leases died a silent node's reservation waits for
    /// its report before it is written off.
    pub settle_ns: u64,
    /// How long `fail_open_local` lasts, per the policy (the filter's
    /// `LOCAL_MAX_NS`), assumed for a node that reports none.
    pub local_max_ns: u64,
    /// The policy's `sync.failure_mode`, assumed for a node that reports
    /// none (each node reports its own, per (key, limit)).
    pub failure_mode: FailureMode,
}

impl AllocConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("interval_ns", self.interval_ns),
            ("lease_ttl_ns", self.lease_ttl_ns),
            ("lease_factor_pct", self.lease_factor_pct),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(ConfigError::new(field, "must be > 0"));
            }
        }
        if self.interval_ns % NANOS_PER_MS != 0 {
            return Err(ConfigError::new("interval_ns", "must be whole milliseconds"));
        }
        if self.lease_ttl_ns < self.interval_ns {
            return Err(ConfigError::new("lease_ttl_ns", "must be at least interval_ns"));
        }
        if self.repay_pct > 100 {
            return Err(ConfigError::new("repay_pct", "must be <= 100"));
        }
        for (name, l) in &self.limits {
            if l.limit == 0 || l.window_ns == 0 || l.burst == 0 {
                return Err(ConfigError::new(
                    format!("limits.{name}"),
                    "limit, window and burst must be > 0",
                ));
            }
            if l.max_cost == 0 || l.max_cost > l.burst {
                return Err(ConfigError::new(
                    format!("limits.{name}.max_cost"),
                    "must be in 1..=burst: a larger cost could never be admitted",
                ));
            }
        }
        Ok(())
    }

    /// The longest a lease granted at `t` can be used, with the policy's
    /// `D`: `t + D + ttl` (a node's own: [`NodeTerms::lease_life_ns`]).
    pub fn lease_life_ns(&self) -> u64 {
        self.response_timeout_ns.saturating_add(self.lease_ttl_ns)
    }
}

/// The shared settings one node enforces for its leases: what it reported
/// in its request ([`tenantgate::sync::NodeSettings`]), or the policy's
/// when it reported none. The allocator computes that node's terms of THE
/// BOUND from these, never from a second copy: a lease is dead by
/// `answered_at + timeout + ttl`, its local fallback ends `local_max` later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeTerms {
    /// `D`: the node's callout timeout.
    pub timeout_ns: u64,
    /// How long the node's `fail_open_local` lasts.
    pub local_max_ns: u64,
    /// The node runs `fail_open_local` at each lease's outage allowance
    /// (`false`: a node older than it, which runs it at its whole share).
    #[serde(default)]
    pub outage_allowance: bool,
}

/// How a request's reported settings compare with the service's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettingsCheck {
    /// The node enforces what the policy says.
    Same,
    /// The node enforces other values (a rollout, another filter build):
    /// the service uses the node's.
    Differs,
    /// A node older than the field: the policy's values are assumed.
    Unreported,
}

impl AllocConfig {
    /// The policy's shared settings (assumed for a node that reports none).
    pub fn terms(&self) -> NodeTerms {
        NodeTerms {
            timeout_ns: self.response_timeout_ns,
            local_max_ns: self.local_max_ns,
            outage_allowance: false,
        }
    }

    /// What `req`'s node enforces, and how that compares with the policy.
    pub fn terms_of(&self, req: &SyncRequest) -> (NodeTerms, SettingsCheck) {
        let Some(s) = &req.settings else {
            return (self.terms(), SettingsCheck::Unreported);
        };
        let terms = NodeTerms::reported(s);
        // The node reports whole milliseconds, rounded up.
        let ms = |ns: u64| ns.div_ceil(NANOS_PER_MS);
        let same = s.timeout_ms == ms(self.response_timeout_ns)
            && s.local_max_ms == ms(self.local_max_ns)
            && s.failure_mode == self.failure_mode
            && req
                .reports
                .iter()
                .all(|r| r.failure_mode.is_none_or(|m| m == self.failure_mode));
        (
            terms,
            if same {
                SettingsCheck::Same
            } else {
                SettingsCheck::Differs
            },
        )
    }
}

impl NodeTerms {
    /// What a node's reported settings say it enforces.
    pub fn reported(s: &tenantgate::sync::NodeSettings) -> NodeTerms {
        NodeTerms {
            timeout_ns: s.timeout_ms.saturating_mul(NANOS_PER_MS),
            local_max_ns: s.local_max_ms.saturating_mul(NANOS_PER_MS),
            outage_allowance: s.outage_allowance,
        }
    }

    /// The longest a lease granted at `t` can be used: `t + D + ttl`.
    pub fn lease_life_ns(&self, cfg: &AllocConfig) -> u64 {
        self.timeout_ns.saturating_add(cfg.lease_ttl_ns)
    }
}

/// Service-wide counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct AllocStats {
    pub requests: u64,
    pub stale: u64,
    pub unknown_limits: u64,
    pub policy_mismatches: u64,
}

/// What the service knows of one (key, limit), for stats and tests.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KeyView {
    pub bucket: u64,
    /// Σ of the nodes' reservations.
    pub reserved: u64,
    pub flow: u64,
    pub stats: KeyStats,
    pub regions: BTreeMap<String, RegionView>,
    /// Each node's current share (units per interval).
    pub shares: BTreeMap<String, u64>,
    /// Each node's last outage allowance sent, thousandths of a unit per
    /// interval (nodes that run it only).
    pub outage_milli: BTreeMap<String, u64>,
}

/// The reconciliation state of the central cluster, in memory: the
/// reference the simulator drives. The service (`crate::service`) runs the
/// same steps ([`begin`], [`visit`], [`finish`]) with its records in a
/// [`crate::store::Store`].
#[derive(Debug, Clone)]
pub struct Allocator {
    cfg: AllocConfig,
    keys: BTreeMap<KeyId, KeyState>,
    sessions: BTreeMap<String, Session>,
    stats: AllocStats,
}

impl Allocator {
    pub fn new(cfg: AllocConfig) -> Result<Allocator, ConfigError> {
        cfg.validate()?;
        Ok(Allocator {
            cfg,
            keys: BTreeMap::new(),
            sessions: BTreeMap::new(),
            stats: AllocStats::default(),
        })
    }

    pub fn config(&self) -> &AllocConfig {
        &self.cfg
    }

    pub fn stats(&self) -> AllocStats {
        self.stats
    }

    /// Brings every key's state to `now` (service clock): refill, charges
    /// for silent nodes, write-offs, and a new allocation when a new
    /// interval began. [`Allocator::handle`] does this too; a timer calls it
    /// so allocation goes on while no node reports.
    pub fn tick(&mut self, now: u64) {
        for ks in self.keys.values_mut() {
            advance(&self.cfg, ks, now);
        }
    }

    /// Answers one sync request.
    pub fn handle(&mut self, req: &SyncRequest, now: u64) -> Result<SyncResponse, AllocError> {
        self.stats.requests += 1;
        if req.version != PROTOCOL_VERSION {
            return Err(AllocError::Version(req.version));
        }
        if req.policy_version != self.cfg.policy_version {
            // Nodes and service disagree during a rollout; limits are looked
            // up by name in the service's policy.
            self.stats.policy_mismatches += 1;
        }
        self.tick(now);
        let mut slot = self.sessions.remove(&req.node_id);
        let begun = begin(&mut slot, req, now);
        if let Some(session) = slot {
            self.sessions.insert(req.node_id.clone(), session);
        }
        let Some(begun) = begun else {
            self.stats.stale += 1;
            return Err(AllocError::Stale { seq: req.seq });
        };
        let nodes_hint = self.sessions.len() as u64;
        let mut visits = Vec::new();
        for (id, delta) in begun.visits() {
            let mut slot = self.keys.remove(&id);
            let v = visit(&self.cfg, &mut slot, &id, delta, &begun, nodes_hint, now);
            if let Some(ks) = slot {
                self.keys.insert(id.clone(), ks);
            }
            if matches!(v, Visit::UnknownLimit { .. }) {
                self.stats.unknown_limits += 1;
            }
            visits.push((id, v));
        }
        if let Some(session) = self.sessions.get_mut(&req.node_id) {
            finish(session, &visits);
        }
        Ok(respond(&self.cfg, req, visits))
    }

    /// [`Allocator::handle`] on a JSON body, answering JSON.
    pub fn handle_json(&mut self, body: &[u8], now: u64) -> Result<String, AllocError> {
        let req = SyncRequest::from_json(body).map_err(AllocError::Protocol)?;
        Ok(self.handle(&req, now)?.to_json())
    }

    /// The state of one (key, limit), if the service has seen it.
    pub fn view(&self, key: &str, limit: &str) -> Option<KeyView> {
        let ks = self.keys.get(&(key.to_owned(), limit.to_owned()))?;
        Some(ks.view())
    }
}

// The steps of one request. Each takes one record, so a store can run it
// as one atomic read-modify-write of that record (and run it again on a
// conflict: every step is a pure function of the record and its inputs).

/// A request whose counts were deduplicated against its node's session.
#[derive(Debug, Clone)]
pub struct Begun {
    intake: Intake,
    node: String,
    region: String,
    seq: RequestSeq,
    /// The (key, limit)s the node held before this request.
    held: BTreeSet<KeyId>,
    /// The node's settings (`None`: unreported, the policy's apply).
    terms: Option<NodeTerms>,
    /// The request's default failure mode, and the reports that name
    /// another (rare: indexed only then).
    mode: Option<FailureMode>,
    modes: HashMap<KeyId, FailureMode>,
    /// The reports of keys that started on the node since their last lease
    /// and how long ago (`Report::started_ms`, in ns; rare: indexed only
    /// then).
    started: HashMap<KeyId, u64>,
}

impl Begun {
    /// The records this request updates, each once, with the request's
    /// counts since the node's acknowledged base (`None`: a held key the
    /// request does not mention, settled with zero counts). Each record
    /// deduplicates them itself ([`visit`]).
    pub fn visits(&self) -> Vec<(KeyId, Option<Counts>)> {
        // Indexed, so a request's work is linear in its size (a hostile
        // request of thousands of reports must not cost their square).
        let reported: HashSet<&KeyId> = self.intake.totals.iter().map(|(d, _)| d).collect();
        let mut out: Vec<(KeyId, Option<Counts>)> =
            Vec::with_capacity(self.held.len().saturating_add(self.intake.totals.len()));
        for id in &self.held {
            if !reported.contains(id) {
                out.push((id.clone(), None));
            }
        }
        // The intake holds each (key, limit) once (duplicates summed).
        for (id, total) in &self.intake.totals {
            out.push((id.clone(), Some(*total)));
        }
        out
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// The settings the node enforces.
    pub fn terms(&self, cfg: &AllocConfig) -> NodeTerms {
        self.terms.unwrap_or_else(|| cfg.terms())
    }

    /// How long before the request `id` started on the node, if it has had
    /// no lease since (see `Report::started_ms`).
    pub fn started_ns(&self, id: &KeyId) -> Option<u64> {
        self.started.get(id).copied()
    }

    /// The failure mode the node runs for `id` once its lease expired.
    pub fn mode_of(&self, id: &KeyId, cfg: &AllocConfig) -> FailureMode {
        self.modes
            .get(id)
            .copied()
            .or(self.mode)
            .unwrap_or(cfg.failure_mode)
    }
}

/// Step 1, on the node's session (created if absent): orders the request
/// after the node's last one and sums its counts per (key, limit). `None`
/// if the request is stale (overtaken, or the last one with another base;
/// the last one again is a repeat, answered again: `SeqCheck::Repeat`):
/// then the session is unchanged and nothing may be counted. (Which counts are new, each
/// (key, limit) record decides in [`visit`].)
pub fn begin(session: &mut Option<Session>, req: &SyncRequest, now: u64) -> Option<Begun> {
    let s = session.get_or_insert_with(|| Session::new(&req.region));
    let held = s.held.clone();
    let intake = s.intake(req, now)?;
    let mut modes = HashMap::new();
    let mut started = HashMap::new();
    for r in &req.reports {
        if let Some(m) = r.failure_mode {
            modes.entry((r.key.clone(), r.limit.clone())).or_insert(m);
        }
        if let Some(ms) = r.started_ms {
            started
                .entry((r.key.clone(), r.limit.clone()))
                .or_insert(ms.saturating_mul(NANOS_PER_MS));
        }
    }
    let terms = req.settings.as_ref().map(NodeTerms::reported);
    if let Some(t) = terms {
        s.enforced(t);
    }
    Some(Begun {
        intake,
        node: req.node_id.clone(),
        region: req.region.clone(),
        seq: RequestSeq {
            boot: req.boot,
            seq: req.seq,
            acked: req.acked_seq,
        },
        held,
        terms,
        mode: req.settings.map(|st| st.failure_mode),
        modes,
        started,
    })
}

/// What [`visit`] did to one (key, limit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Visit {
    /// A held key with no record left.
    Absent,
    /// A held key settled with zero counts; whether the node still holds it.
    Settled { holds: bool },
    /// A reported key: the node's new lease, and the counts this record
    /// had not counted before (what the request added here).
    Leased { lease: Lease, counted: Counts },
    /// A reported limit the policy does not know: no lease.
    UnknownLimit { holds: bool },
    /// The record already applied a later request of the node (which
    /// carried this one's counts): nothing counted, nothing to write, no
    /// lease.
    Stale,
}

impl Visit {
    fn holds(&self) -> bool {
        match self {
            Visit::Absent => false,
            Visit::Settled { holds } | Visit::UnknownLimit { holds } => *holds,
            Visit::Leased { .. } | Visit::Stale => true,
        }
    }
}

/// What a request's visits counted, per reported (key, limit): after each
/// record's deduplication (a retried request adds only what its lost
/// answer had not counted).
pub fn counted(visits: &[(KeyId, Visit)]) -> impl Iterator<Item = (&KeyId, Counts)> {
    visits.iter().filter_map(|(id, v)| match v {
        Visit::Leased { counted, .. } => Some((id, *counted)),
        _ => None,
    })
}

/// Step 2, on one (key, limit)'s record: brings it to `now`, deduplicates
/// the node's counts against what this record counted of it (so the step
/// is idempotent on its own: run twice for one request, it counts once),
/// settles them and, for a reported key, grants its lease. `total`: the
/// node's counts since its acknowledged base (`None`: a held key the
/// request does not report). `nodes_hint` is the number of nodes the
/// service has a session for.
pub fn visit(
    cfg: &AllocConfig,
    slot: &mut Option<KeyState>,
    id: &KeyId,
    total: Option<Counts>,
    begun: &Begun,
    nodes_hint: u64,
    now: u64,
) -> Visit {
    let node = begun.node.as_str();
    let limit = cfg.limits.get(&id.1).copied();
    if let Some(ks) = slot.as_mut() {
        advance(cfg, ks, now);
        if let Some(limit) = limit {
            ks.retarget(limit, now);
        }
    }
    let Some(total) = total else {
        let Some(ks) = slot.as_mut() else {
            return Visit::Absent;
        };
        let Some(seen) = ks.intake(node, begun.seq, None) else {
            return Visit::Settled { holds: false };
        };
        if seen.order == Order::Stale {
            return Visit::Stale;
        }
        ks.settle(node, Counts::default(), &seen, cfg);
        ks.heard(node, now);
        return Visit::Settled {
            holds: ks.holds(node),
        };
    };
    let Some(limit) = limit else {
        return Visit::UnknownLimit {
            holds: slot.as_ref().is_some_and(|ks| ks.holds(node)),
        };
    };
    let ks = slot.get_or_insert_with(|| KeyState::new(limit, now));
    ks.advance(now, cfg);
    ks.join(node, &begun.region, now);
    let Some(seen) = ks.intake(node, begun.seq, Some(total)) else {
        return Visit::Stale;
    };
    match seen.order {
        Order::Stale => return Visit::Stale,
        // Its demand was recorded when the request was applied here.
        Order::Duplicate => {}
        Order::Next => {
            let span = Span {
                prev_heard_at: begun.intake.prev_heard_at,
                started_ns: begun.started_ns(id),
            };
            ks.touch(node, &begun.region, seen.delta, span, now, cfg);
        }
    }
    ks.settle(node, seen.delta, &seen, cfg);
    ks.heard(node, now);
    let enforced = Enforced {
        seq: begun.seq.seq,
        terms: begun.terms(cfg),
        mode: begun.mode_of(id, cfg),
    };
    Visit::Leased {
        lease: ks.grant(id, node, nodes_hint, enforced, now, cfg),
        counted: seen.delta,
    }
}

/// Step 3, on the node's session: the keys it holds from now on.
pub fn finish(session: &mut Session, visits: &[(KeyId, Visit)]) {
    for (id, v) in visits {
        if v.holds() {
            if !session.held.contains(id) {
                session.held.insert(id.clone());
            }
        } else {
            session.held.remove(id);
        }
    }
}

/// Brings one (key, limit) to `now` with no request: what a timer does so
/// allocation goes on while no node reports (see [`Allocator::tick`]).
pub fn advance(cfg: &AllocConfig, ks: &mut KeyState, now: u64) {
    ks.advance(now, cfg);
}

/// The response to a request whose visits are done: a lease per reported
/// (key, limit) the policy knows, in the request's order.
pub fn respond(cfg: &AllocConfig, req: &SyncRequest, visits: Vec<(KeyId, Visit)>) -> SyncResponse {
    let mut leases: Vec<Lease> = Vec::with_capacity(req.reports.len());
    for (_, v) in visits {
        if let Visit::Leased { lease, .. } = v {
            leases.push(lease);
        }
    }
    // Visits list held keys first; answer in the request's order (indexed:
    // linear in the request's size, not its square).
    let mut position: HashMap<(&str, &str), usize> = HashMap::with_capacity(req.reports.len());
    for (i, r) in req.reports.iter().enumerate() {
        position.entry((r.key.as_str(), r.limit.as_str())).or_insert(i);
    }
    leases.sort_by_cached_key(|l| {
        position
            .get(&(l.key.as_str(), l.limit.as_str()))
            .copied()
            .unwrap_or(usize::MAX)
    });
    SyncResponse {
        version: PROTOCOL_VERSION,
        ack_seq: req.seq,
        interval_ms: cfg.interval_ns / NANOS_PER_MS,
        leases,
    }
}
