//! Worker leases: a hot key's units taken out of its node-wide entry in
//! one update and spent in the worker's own memory, so that most of its
//! requests touch no shared data (they read the clock: a lease expires).
//!
//! # The rule
//! The node-wide entry of a key (its key-table slot, through
//! [`crate::table::update`]) stays the single source of truth. A worker
//! whose request finds no lease for its key charges the entry as always,
//! and in the same update takes up to `want` units of every limit of the
//! key ([`crate::engine::charge_leased`]): the request's cost, and the rest
//! for its **lease**. Later requests of the key on this worker spend the
//! lease (no shared data; one clock read, for its expiry) until it cannot
//! pay their cost or expires; the worker's next
//! tick gives what is left back to the entry ([`crate::engine::give_back`])
//! and forgets the lease. So **units are moved, never copied**: a unit is
//! in the entry or in exactly one worker's lease, and the node never admits
//! more than its entry gave.
//!
//! * `want` is the key's cost on this worker in its last tick (a count per
//!   key hash, [`HEAT_SLOTS`] of them, so cold keys cost no entry): 1 cost
//!   (today's exact path) for a cold key, what one tick consumes for a hot
//!   one, at most [`max_lease`] (an eighth of the smallest burst of the
//!   key's limits, at most [`MAX_LEASE_UNITS`]). A key whose entry is low
//!   gets what it has: the update takes the most every limit has.
//! * Only keys whose limits are all enforced and not sliding logs are
//!   leased, never beside a guard, never in shadow mode: a guard's
//!   aggregate and a log's instants are charged request by request.
//! * **Global limits**: the entry's allowance draws from the node's live
//!   lease of the central service (never from the provisional allowance
//!   or a failure mode), the worker's lease from the entry. Units taken
//!   count as consumed in the node's report until given back, and the
//!   units the lease's requests spent count as demand when it goes back
//!   ([`crate::sync::Allowance::give_back_lease`]). **The global bound is
//!   unchanged**: it counts units, and a unit is in the service's lease,
//!   the entry's allowance or one worker's lease, never two; a unit given
//!   back goes to the node's live service lease (whose units the bound's
//!   lease term already counts), or is dropped if none is live, and a
//!   report made while it sat in a worker counts it consumed, which errs
//!   toward the service granting less.
//! * A reload never duplicates a unit: a lease belongs to the policy it was
//!   taken under (a request of another policy never spends it), and its
//!   units go back to the same entry, at most what was taken (a limit's
//!   capacity caps them), and only to a record still under the parameters
//!   they were taken under: once a reload migrated it, they are dropped
//!   (counted as lost units), because the fill level the migration carried
//!   over already counts them spent. So from a reload on, a key admits at
//!   most the new limit's `B + r·(d + τ)`, plus the units held then by the
//!   leases of workers that have not loaded the new policy yet (each at most
//!   [`max_lease`] of the old limits, spent within `τ` of its take);
//!   tested by the adversary of `lease_reload_tests.rs`.
//!
//! # THE BOUND
//! A unit taken at `a` is spent before `a + τ`, `τ` = [`LEASE_TTL_NS`]
//! (10 ms): the lease carries its expiry, and a request after it goes to
//! the entry, however late the worker's tick (ticks are late under load:
//! a worker waiting for a core); the expired units wait for the tick,
//! which gives them back. An admission is shifted in time by at most `τ`.
//! For a token bucket of rate `r` and burst `B`, requests
//! admitted over any interval of length `t` are at most `B + r·(t + τ)`;
//! for a fixed window or a sliding counter, the window's count moves at
//! most `τ` earlier. Several limits of a key stay all or nothing: a lease's
//! units were charged to every limit at once.
//!
//! **False denials**: a request is refused although its key's limits have
//! room only while that room sits in other workers' leases: at most
//! `(W − 1) · max_lease` units for `W` workers, each for at most one tick
//! of its holder; and a refusal a worker remembers (below) lasts at most
//! until its own next tick.
//!
//! # Refusals
//! A worker that found a key exhausted remembers its refusal until the
//! refused limit's next unit (exact: the limiter's wait) or its own next
//! tick, whichever comes first: a flood of over-limit requests of one
//! tenant reads the clock and no shared data. Its `Retry-After` is the
//! remembered wait less the time since, rounded up: never earlier than the
//! entry itself would admit the request. A nested level's refusal is not
//! remembered: its budget is kept under the request's level values, which
//! the tenant's key does not name.
//!
//! # Headers
//! A request a lease serves reports, per limit, what the entry had left
//! after the lease was taken plus what the lease has left: what the key
//! had at that instant, at most one tick ago; its reset is the entry's
//! then. Formatted only when the policy sends `RateLimit` headers.

use std::rc::Rc;

use hashbrown::HashMap;

use crate::decision::{write_logical_key, Decision, RateLimitHeaders, Reason, Standings};
use crate::engine::{self, Prepared, Scratch};
use crate::host::{Clock, Host};
use crate::limiter::NANOS_PER_SEC;
use crate::policy::{Limit, Policy};
use crate::stats::{LeaseStat, Metric, Stats};

/// Key hashes whose last tick's cost is counted (the heat of a key).
pub const HEAT_SLOTS: usize = 1024;
/// The most units one lease takes, whatever the key's burst.
pub const MAX_LEASE_UNITS: u64 = 4096;
/// The most keys with a lease or a remembered refusal on one worker.
pub const MAX_LEASED_KEYS: usize = 4096;
/// How long a lease's units may be spent after its take: one tick period.
/// The lease carries its expiry, so a tick late under load (a worker
/// waiting for a core) never lengthens it: τ in THE BOUND is this.
pub const LEASE_TTL_NS: u64 = super::TICK_NS;

/// A lease, or a remembered refusal, of one key on this worker.
#[derive(Debug)]
struct Lease {
    policy: Rc<Policy>,
    prepared: Prepared,
    /// Units left (charged to every limit of the key).
    units: u64,
    /// Units its requests spent (a global limit counts them as demand
    /// when the lease goes back).
    spent: u64,
    /// Units of a take that expired unspent: no request spends them; they
    /// go back with the rest on the next tick.
    expired: u64,
    /// The key's plan has a global limit (whose spent units must be told).
    global: bool,
    taken_at: u64,
    /// Its units may be spent until this instant ([`LEASE_TTL_NS`] after
    /// the take), whenever the worker's tick comes.
    expires_at: u64,
    /// The entry's standing after the take (for headers).
    standings: Option<Box<Standings>>,
    /// A refusal remembered until this instant (0: none), and its decision.
    refused_until: u64,
    refusal: Option<Decision>,
}

/// A worker's leases (see the module header).
#[derive(Debug)]
pub struct Leases {
    /// Policy (its address, kept alive by each lease's `Rc`) → key → lease.
    keys: HashMap<usize, HashMap<String, Lease>>,
    held: usize,
    /// Cost per key hash, this tick and the last.
    heat: Box<[u32; HEAT_SLOTS]>,
    last: Box<[u32; HEAT_SLOTS]>,
    /// The request's logical key (reused: a lease's path allocates nothing).
    key: String,
    /// When the worker's next tick is due (a refusal is remembered until then at most).
    next_tick: u64,
    /// Counts for the stats: requests served from a lease, refusals served
    /// from memory, leases taken, leases given back, units lost.
    served: u64,
    remembered: u64,
    taken: u64,
    returned: u64,
    lost: u64,
}

impl Default for Leases {
    fn default() -> Leases {
        Leases {
            keys: HashMap::new(),
            held: 0,
            heat: Box::new([0; HEAT_SLOTS]),
            last: Box::new([0; HEAT_SLOTS]),
            key: String::new(),
            next_tick: 0,
            served: 0,
            remembered: 0,
            taken: 0,
            returned: 0,
            lost: 0,
        }
    }
}

/// The most units a lease of `limits` may hold: an eighth of the smallest
/// burst (so small limits stay exact), at most [`MAX_LEASE_UNITS`].
pub fn max_lease(limits: &[Limit]) -> u64 {
    limits
        .iter()
        .map(|l| l.burst / 8)
        .min()
        .unwrap_or(0)
        .min(MAX_LEASE_UNITS)
}

fn policy_id(policy: &Rc<Policy>) -> usize {
    Rc::as_ptr(policy) as usize
}

fn slot(key: &str) -> usize {
    usize::try_from(crate::table::fnv1a64(key.as_bytes()) % HEAT_SLOTS as u64).unwrap_or(0)
}

impl Leases {
    /// Checks and charges a request's rate limits (see the module header):
    /// from its key's lease if the lease can pay and has not expired (the clock, no shared
    /// data), else a remembered refusal (the clock), else `charge(now,
    /// want)`, which charges the entry and takes up to `want` units.
    /// `now` is set if the clock was read; `Err`: the clock could not be.
    pub fn charge(
        &mut self,
        policy: &Rc<Policy>,
        prepared: &Prepared,
        now: &mut Now<'_, impl Clock>,
        charge: impl FnOnce(u64, u64) -> Decision,
    ) -> Result<Decision, NoClock> {
        write_logical_key(&mut self.key, &prepared.class.action, &prepared.subject);
        let cost = prepared.cost;
        let heat = &mut self.heat[slot(&self.key)];
        *heat = heat.saturating_add(u32::try_from(cost).unwrap_or(u32::MAX));
        let at = now.get().ok_or(NoClock)?;
        if let Some(d) = self.spend(policy, prepared, at) {
            self.served = self.served.saturating_add(1);
            return Ok(d);
        }
        if let Some(d) = self.refused(policy, at) {
            self.remembered = self.remembered.saturating_add(1);
            return Ok(d);
        }
        let want = self.want(policy, prepared);
        let d = charge(at, want);
        self.took(policy, prepared, &d, at);
        Ok(d)
    }

    /// Serves a request from its key's lease at `now`, if the lease has
    /// not expired and can pay its cost.
    fn spend(&mut self, policy: &Rc<Policy>, prepared: &Prepared, now: u64) -> Option<Decision> {
        let cost = prepared.cost;
        let lease = self
            .keys
            .get_mut(&policy_id(policy))?
            .get_mut(self.key.as_str())?;
        if lease.units < cost || lease.prepared.plan != prepared.plan || now >= lease.expires_at {
            return None;
        }
        lease.units = lease.units.saturating_sub(cost);
        lease.spent = lease.spent.saturating_add(cost);
        let mut d = Decision::pass(Reason::Allowed, prepared.subject.clone());
        if policy.ratelimit_headers {
            d.headers = lease_headers(policy, prepared.plan, lease.standings.as_deref(), lease.units);
        }
        Some(d)
    }

    /// A refusal this worker remembers for the key at `now`, with its
    /// `Retry-After` from now (see the module header).
    fn refused(&self, policy: &Rc<Policy>, now: u64) -> Option<Decision> {
        let lease = self.keys.get(&policy_id(policy))?.get(self.key.as_str())?;
        if now >= lease.refused_until {
            return None;
        }
        let mut d = lease.refusal.clone()?;
        d.wait_ns = lease.refused_until.saturating_sub(now);
        d.retry_after_secs = d.wait_ns.div_ceil(NANOS_PER_SEC).max(1);
        d.cas_retries = 0;
        d.table = crate::table::TableEvent::None;
        Some(d)
    }

    /// The units to ask for with the key (its cost when cold).
    fn want(&self, policy: &Policy, prepared: &Prepared) -> u64 {
        let cost = prepared.cost;
        let Some(plan) = policy.plan(prepared.plan) else {
            return cost;
        };
        let heat = u64::from(self.last[slot(&self.key)]);
        heat.min(max_lease(&plan.limits)).max(cost)
    }

    /// What a charge of the key gave: a lease to keep, or a refusal to
    /// remember until `min(its wait, the next tick)`.
    fn took(&mut self, policy: &Rc<Policy>, prepared: &Prepared, d: &Decision, now: u64) {
        // A nested level's refusal is of a budget the tenant shares, kept
        // under the request's path of level values, which the tenant's key
        // does not name: it is not remembered under that key.
        let by_level = d.limit.as_ref().is_some_and(|l| l.level().is_some());
        let refused = d.reason == Reason::RateLimited && !by_level;
        if d.leased == 0 && !refused {
            return;
        }
        let next_tick = self.next_tick.max(now.saturating_add(1));
        let held = self.held;
        let keys = self.keys.entry(policy_id(policy)).or_default();
        let lease = match keys.get_mut(self.key.as_str()) {
            Some(l) => l,
            None if held >= MAX_LEASED_KEYS => return,
            None => {
                self.held += 1;
                keys.entry(self.key.clone()).or_insert(Lease {
                    policy: policy.clone(),
                    prepared: prepared.clone(),
                    units: 0,
                    spent: 0,
                    expired: 0,
                    global: policy
                        .plan(prepared.plan)
                        .is_some_and(|p| p.limits.iter().any(|l| l.global)),
                    taken_at: now,
                    expires_at: 0,
                    standings: None,
                    refused_until: 0,
                    refusal: None,
                })
            }
        };
        if refused {
            lease.refused_until = now.saturating_add(d.wait_ns).min(next_tick);
            lease.refusal = Some(d.clone());
        } else {
            // Units left from an earlier take stay (they are still charged)
            // unless that take expired: then they wait for the tick.
            if now >= lease.expires_at {
                lease.expired = lease.expired.saturating_add(std::mem::take(&mut lease.units));
            }
            lease.units = lease.units.saturating_add(d.leased);
            lease.expires_at = now.saturating_add(LEASE_TTL_NS);
            if lease.expired == 0 {
                lease.taken_at = now;
            }
            lease.standings.clone_from(&d.standings);
            lease.refused_until = 0;
            self.taken = self.taken.saturating_add(1);
        }
    }

    /// The worker's tick at `now`: every lease's units go back to their
    /// entry, every remembered refusal is forgotten, and the keys' heat
    /// turns over. Several host configurations (filter instances) sharing one worker
    /// each tick it: only the first tick of a tick period counts.
    pub fn on_tick<H: Host>(&mut self, host: &H, now: u64, scratch: &mut Scratch) {
        let period_start = self.next_tick.saturating_sub(super::TICK_NS / 2);
        if self.next_tick != 0 && now < period_start {
            return;
        }
        self.next_tick = now.saturating_add(super::TICK_NS);
        std::mem::swap(&mut self.heat, &mut self.last);
        self.heat.fill(0);
        for (_, keys) in self.keys.drain() {
            for (_, lease) in keys {
                let units = lease.units.saturating_add(lease.expired);
                if units == 0 && !(lease.global && lease.spent > 0) {
                    continue;
                }
                let p = &lease.prepared;
                let spent = lease.spent;
                let back =
                    engine::give_back(&lease.policy, p, host, units, spent, lease.taken_at, now, scratch);
                if back.written {
                    self.returned = self.returned.saturating_add(1);
                    self.lost = self.lost.saturating_add(back.dropped);
                } else {
                    self.lost = self.lost.saturating_add(units);
                }
            }
        }
        self.held = 0;
    }

    /// Units this worker holds in its lease of `action`'s key for `subject`
    /// under `policy`.
    pub fn held(&mut self, policy: &Rc<Policy>, action: &str, subject: &crate::decision::Subject) -> u64 {
        write_logical_key(&mut self.key, action, subject);
        self.keys
            .get(&policy_id(policy))
            .and_then(|k| k.get(self.key.as_str()))
            .map_or(0, |l| l.units)
    }

    /// Refusals this worker served from memory so far (reset by
    /// [`Leases::flush`]).
    pub fn remembered(&self) -> u64 {
        self.remembered
    }

    /// Units this worker holds in leases now.
    pub fn units(&self) -> u64 {
        self.keys
            .values()
            .flat_map(|k| k.values())
            .map(|l| l.units)
            .fold(0, u64::saturating_add)
    }

    /// Gives the counts since the last call to `stats`.
    pub fn flush(&mut self, stats: &mut dyn Stats) {
        for (metric, n) in [
            (LeaseStat::Served, std::mem::take(&mut self.served)),
            (LeaseStat::Remembered, std::mem::take(&mut self.remembered)),
            (LeaseStat::Taken, std::mem::take(&mut self.taken)),
            (LeaseStat::Returned, std::mem::take(&mut self.returned)),
            (LeaseStat::LostUnits, std::mem::take(&mut self.lost)),
        ] {
            if n > 0 {
                stats.add(&Metric::Lease(metric), i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    }
}

/// The clock could not be read when the request needed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoClock;

/// The clock, read at most once and only when a step needs it.
pub struct Now<'c, C: Clock> {
    clock: &'c C,
    at: Option<u64>,
}

impl<'c, C: Clock> Now<'c, C> {
    pub fn new(clock: &'c C) -> Now<'c, C> {
        Now { clock, at: None }
    }

    /// The time, read now if it was not yet.
    pub fn get(&mut self) -> Option<u64> {
        if self.at.is_none() {
            self.at = self.clock.now();
        }
        self.at
    }

    /// The time if it was read.
    pub fn read(&self) -> Option<u64> {
        self.at
    }
}

/// The `RateLimit` headers of a request a lease served: per limit, the
/// entry's remaining after the take plus the lease's units left.
fn lease_headers(
    policy: &Policy,
    plan: usize,
    standings: Option<&Standings>,
    left: u64,
) -> Option<RateLimitHeaders> {
    let plan = policy.plan(plan)?;
    let s = standings?;
    let mut ratelimit = String::new();
    for (i, l) in plan.limits.iter().enumerate().take(s.len) {
        if i > 0 {
            ratelimit.push_str(", ");
        }
        let remaining = s.remaining[i].saturating_add(left);
        // The node's standing after the lease's take, plus what this
        // worker still holds: no more than that within the node's `t`.
        let t = crate::decision::t_secs(remaining, s.t_ns[i]);
        ratelimit.push_str(&format!("\"{}\";r={remaining};t={t}", l.name));
    }
    Some(RateLimitHeaders {
        policy: plan.ratelimit_policy.clone(),
        ratelimit,
    })
}
