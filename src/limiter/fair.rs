//! Max-min fair shares of a nested level's pool while it is contended.
//!
//! A level's pool (an organisation's budget, after its teams' guarantees)
//! is shared by its members: the values one level down, or the tenants
//! below the last level. A bucket alone shares it first come: a member that
//! floods takes every token the moment it refills, and a member that asks
//! a little finds the pool empty. This module keeps, per pool, what each
//! member asked of it (its **demand**, refused requests included) and what
//! it took (its **use**), and gives the rule that shares the pool max-min
//! fairly while it is short:
//!
//! - Demand and use are exponentially decaying sums, one per pool limit:
//!   use with that limit's period as the time constant, so a member that
//!   takes `r` units per period steadily has used `r`; demand with an
//!   eighth of it, scaled to the same rate, so a member that stopped
//!   asking soon claims nothing and the pool goes to those who ask now.
//!   Stored in milli-units.
//! - The **fair share** of a limit is the water level that splits the
//!   limit's rate over the members' demands: members that ask less than it
//!   get all they ask, the others it (max-min fairness, as water-filling
//!   computes it).
//! - A limit is **contended** while its pool holds less than half its
//!   burst. Then a member that asks more than its fair share and has used
//!   it already is refused; it may ask again when its use has decayed to
//!   the share (the refusal's exact wait, if nothing else changes). A
//!   member within its share is never refused by this rule, and while the
//!   pool holds half its burst or more nobody is.
//! - At least two members must be asking; a member alone takes the pool.
//!
//! The pool's own limits stay the bound: this rule only refuses, never
//! admits past the pool. What it changes is who the pool's refill goes
//! to: the pool hovers near half its burst, kept for those within their
//! share, instead of being emptied by the member that asks fastest.
//!
//! # Bounded state
//! The table tracks [`FAIR_MEMBERS`] members. A new member takes a free
//! entry, else the one whose demand is least (relative to the rates); the
//! demand of the untracked members is the total's remainder, counted in the
//! water-filling as one more member and never refused. So the members that
//! ask most (the ones the rule exists to hold back) are always tracked.
//!
//! Pure arithmetic on explicit time, like every algorithm here; the engine
//! keeps the table in the pool's key-table entry (`crate::engine`'s
//! `fair`).

use super::calendar::Month;
use crate::table::layout::Reader;
use crate::table::MAX_RECORDS;

/// Members tracked per pool.
pub const FAIR_MEMBERS: usize = 16;

/// Sums are kept in milli-units.
const MILLI: u64 = 1000;

/// Table format, first byte of the state.
const VERSION: u8 = 1;

/// Demand is measured over an eighth of a period: a member that stopped
/// asking stops claiming a share within a fraction of the period, so the
/// pool goes to those asking now (the rule conserves work), while use is
/// measured over the whole period the share is a rate of.
const DEMAND_SPEEDUP: u64 = 8;

/// One limit of the pool as the rule sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLimit {
    /// Units per period.
    pub rate: u64,
    /// The period, in nanoseconds (the sums' time constant).
    pub per_ns: u64,
    /// Whether the limit is contended.
    pub contended: Contended,
    /// A calendar month's limit: the current month. Use counted before it
    /// began is forgotten (the pool is whole again), and no refusal waits
    /// past its end.
    pub window: Option<Month>,
}

/// When a pool limit is contended (the rule applies only then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contended {
    Yes,
    No,
    /// While the members ask more than its rate (their demands add up to
    /// more): a global limit, whose standing on a node is a lease of a
    /// request or two per interval, too coarse to say.
    WhenAskedOver,
}

/// What the rule says about one request the pool admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fairness {
    /// Within its fair share (or the pool is not contended): take it.
    Within,
    /// Over its fair share of pool limit `limit` while it is contended:
    /// refused, for `wait_ns` (until its use has decayed to the share).
    Over { limit: usize, wait_ns: u64 },
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Member {
    /// FNV-1a of the member's value (never 0: 0 marks a free entry).
    id: u64,
    demand: [u64; MAX_RECORDS],
    used: [u64; MAX_RECORDS],
}

/// One pool's members, their demand and use (see the module's header).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FairTable {
    /// How many pool limits the sums are kept for.
    limits: usize,
    /// When the sums were last decayed.
    at: u64,
    /// Every member's demand, tracked or not.
    total: [u64; MAX_RECORDS],
    members: [Member; FAIR_MEMBERS],
}

impl FairTable {
    /// A pool nobody has asked of yet.
    pub fn fresh(limits: usize) -> FairTable {
        FairTable {
            limits: limits.min(MAX_RECORDS),
            at: 0,
            total: [0; MAX_RECORDS],
            members: [Member::default(); FAIR_MEMBERS],
        }
    }

    /// The member id of a value (never 0).
    pub fn member_id(value: &[u8]) -> u64 {
        crate::table::fnv1a64(value).max(1)
    }

    /// Records that `member` asked the pool for `cost` units at `now` and
    /// says whether it may take them. `pool_admitted`: the pool's limits
    /// admitted the request (and charged it); if not, only the demand is
    /// recorded (the pool refuses anyway). Use is recorded only for a
    /// request the pool admitted and the rule lets through.
    pub fn ask(
        &mut self,
        member: u64,
        cost: u64,
        pool: &[PoolLimit],
        pool_admitted: bool,
        now: u64,
    ) -> Fairness {
        self.decay(pool, now);
        let cost = cost.saturating_mul(MILLI);
        let n = self.limits.min(pool.len());
        for t in self.total.iter_mut().take(n) {
            *t = t.saturating_add(cost);
        }
        let Some(i) = self.entry(member, pool) else {
            return Fairness::Within;
        };
        let Some(m) = self.members.get_mut(i) else {
            return Fairness::Within;
        };
        for d in m.demand.iter_mut().take(n) {
            *d = d.saturating_add(cost);
        }
        let me = *m;
        if !pool_admitted {
            return Fairness::Within;
        }
        let mut verdict = Fairness::Within;
        for (l, limit) in pool.iter().enumerate().take(n) {
            let contended = match limit.contended {
                Contended::Yes => true,
                Contended::No => false,
                Contended::WhenAskedOver => {
                    let total = self.total.get(l).copied().unwrap_or(0);
                    rate_of(total) > limit.rate.saturating_mul(MILLI)
                }
            };
            if !contended {
                continue;
            }
            let Some(level) = self.fair_share(l, limit.rate) else {
                continue;
            };
            let (Some(&demand), Some(&used)) = (me.demand.get(l), me.used.get(l)) else {
                continue;
            };
            if rate_of(demand) > level && used >= level {
                let mut wait_ns = decay_time(used, level.max(1), limit.per_ns);
                if let Some(w) = limit.window {
                    wait_ns = wait_ns.min(w.until_end(now).max(1));
                }
                if !matches!(verdict, Fairness::Over { wait_ns: w, .. } if w >= wait_ns) {
                    verdict = Fairness::Over { limit: l, wait_ns };
                }
            }
        }
        if verdict == Fairness::Within {
            if let Some(m) = self.members.get_mut(i) {
                for u in m.used.iter_mut().take(n) {
                    *u = u.saturating_add(cost);
                }
            }
        }
        verdict
    }

    /// Limit `l`'s fair share (milli-units per period): the water level of
    /// its rate over the members' demands. `None`: fewer than two members
    /// ask, or the rate covers every demand.
    fn fair_share(&self, l: usize, rate: u64) -> Option<u64> {
        let mut wants = [0u64; FAIR_MEMBERS + 1];
        let mut n = 0;
        let mut tracked = 0u64;
        for m in self.members.iter().filter(|m| m.id != 0) {
            let d = m.demand.get(l).copied().unwrap_or(0);
            tracked = tracked.saturating_add(d);
            let d = rate_of(d);
            if d >= MILLI {
                if let Some(w) = wants.get_mut(n) {
                    *w = d;
                    n += 1;
                }
            }
        }
        let others = rate_of(self.total.get(l).copied().unwrap_or(0).saturating_sub(tracked));
        if others >= MILLI {
            if let Some(w) = wants.get_mut(n) {
                *w = others;
                n += 1;
            }
        }
        if n < 2 {
            return None;
        }
        water_level(rate.saturating_mul(MILLI), wants.get_mut(..n)?)
    }

    /// The entry of `member`, taking one if it has none: a free entry, else
    /// the one with the least demand relative to the rates. `None` only
    /// for a table without entries.
    fn entry(&mut self, member: u64, pool: &[PoolLimit]) -> Option<usize> {
        if let Some(i) = self.members.iter().position(|m| m.id == member) {
            return Some(i);
        }
        let n = self.limits.min(pool.len());
        let weight = |m: &Member| -> u128 {
            if m.id == 0 {
                return 0;
            }
            m.demand
                .iter()
                .zip(pool)
                .take(n)
                .map(|(&d, p)| u128::from(d) / u128::from(p.rate.max(1)).saturating_add(1))
                .fold(1u128, u128::saturating_add)
        };
        let i = (0..FAIR_MEMBERS).min_by_key(|&i| self.members.get(i).map_or(u128::MAX, weight))?;
        if let Some(m) = self.members.get_mut(i) {
            *m = Member {
                id: member,
                ..Member::default()
            };
        }
        Some(i)
    }

    /// Decays every sum from `self.at` to `now`.
    fn decay(&mut self, pool: &[PoolLimit], now: u64) {
        let (before, dt) = (self.at, now.saturating_sub(self.at));
        self.at = self.at.max(now);
        if dt == 0 {
            return;
        }
        for (l, p) in pool.iter().enumerate().take(self.limits) {
            // A window began since the sums were last touched: nothing of
            // it has been used yet.
            if p.window.is_some_and(|w| u128::from(before) < w.start) {
                for m in self.members.iter_mut() {
                    if let Some(u) = m.used.get_mut(l) {
                        *u = 0;
                    }
                }
            }
            let (fd, fu) = (factor(dt, demand_per(p.per_ns)), factor(dt, p.per_ns));
            if let Some(t) = self.total.get_mut(l) {
                *t = scaled(*t, fd);
            }
            for m in self.members.iter_mut() {
                if let (Some(d), Some(u)) = (m.demand.get_mut(l), m.used.get_mut(l)) {
                    *d = scaled(*d, fd);
                    *u = scaled(*u, fu);
                }
            }
        }
        for m in self.members.iter_mut() {
            let quiet = |v: &[u64; MAX_RECORDS]| v.iter().take(self.limits).all(|&x| x == 0);
            if quiet(&m.demand) && quiet(&m.used) {
                *m = Member::default();
            }
        }
    }

    /// Whether every demand has decayed below one unit by `now`, with
    /// `per_ns` the longest period of the pool's limits (the slowest
    /// decay): the entry can be reclaimed, which loses nothing the rule
    /// would use.
    pub fn is_idle(&self, per_ns: u64, now: u64) -> bool {
        let f = factor(now.saturating_sub(self.at), per_ns);
        self.total.iter().take(self.limits).all(|&t| scaled(t, f) < MILLI)
    }

    /// How many pool limits the table keeps sums for.
    pub fn limits(&self) -> usize {
        self.limits
    }

    /// Appends the table's bytes: version, limits, members in use, `at`,
    /// the totals, then each member's id, demands and uses.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let used: Vec<&Member> = self.members.iter().filter(|m| m.id != 0).collect();
        out.push(VERSION);
        out.push(u8::try_from(self.limits).unwrap_or(0));
        out.push(u8::try_from(used.len()).unwrap_or(0));
        out.extend_from_slice(&self.at.to_le_bytes());
        for t in self.total.iter().take(self.limits) {
            out.extend_from_slice(&t.to_le_bytes());
        }
        for m in used {
            out.extend_from_slice(&m.id.to_le_bytes());
            for v in m
                .demand
                .iter()
                .take(self.limits)
                .chain(m.used.iter().take(self.limits))
            {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }

    /// A table as [`FairTable::encode`] wrote it (`None`: another format).
    /// A caller whose pool has another number of limits (a reload) starts
    /// afresh, which only forgets history.
    pub fn decode(bytes: &[u8]) -> Option<FairTable> {
        let mut r = Reader(bytes);
        if r.u8()? != VERSION {
            return None;
        }
        let limits = usize::from(r.u8()?);
        if limits > MAX_RECORDS {
            return None;
        }
        let members = usize::from(r.u8()?);
        if members > FAIR_MEMBERS {
            return None;
        }
        let mut t = FairTable::fresh(limits);
        t.at = r.u64()?;
        for v in t.total.iter_mut().take(limits) {
            *v = r.u64()?;
        }
        for m in t.members.iter_mut().take(members) {
            m.id = r.u64()?;
            for v in m.demand.iter_mut().take(limits) {
                *v = r.u64()?;
            }
            for v in m.used.iter_mut().take(limits) {
                *v = r.u64()?;
            }
            if m.id == 0 {
                return None;
            }
        }
        r.is_empty().then_some(t)
    }
}

/// The water level that splits `capacity` over `wants` max-min fairly:
/// every want below it is met in full, the rest get it. `None`: the
/// capacity meets every want. Sorts `wants`.
pub fn water_level(capacity: u64, wants: &mut [u64]) -> Option<u64> {
    wants.sort_unstable();
    let mut left = capacity;
    let mut rest = wants.len() as u64;
    for &w in wants.iter() {
        let level = left.checked_div(rest)?;
        if w > level {
            return Some(level);
        }
        left = left.saturating_sub(w);
        rest = rest.saturating_sub(1);
    }
    None
}

/// The time constant of demand sums for a limit of period `per_ns`.
fn demand_per(per_ns: u64) -> u64 {
    (per_ns / DEMAND_SPEEDUP).max(1)
}

/// A demand sum as units per period (the use sums' scale).
fn rate_of(demand: u64) -> u64 {
    demand.saturating_mul(DEMAND_SPEEDUP)
}

/// `e^(−dt/per)`: what a sum keeps after `dt`.
fn factor(dt: u64, per_ns: u64) -> f64 {
    (-(dt as f64) / (per_ns.max(1) as f64)).exp()
}

fn scaled(v: u64, f: f64) -> u64 {
    // `as` saturates and maps NaN to 0: never a trap.
    (v as f64 * f) as u64
}

/// Nanoseconds until a sum of `from` decays to `to` (`to` ≤ `from`):
/// `per × ln(from / to)`, rounded up.
fn decay_time(from: u64, to: u64, per_ns: u64) -> u64 {
    let t = per_ns as f64 * (from as f64 / to as f64).ln();
    (t.ceil() as u64).max(1)
}

#[cfg(test)]
mod tests;
