//! The per-request decision: classify → identify → limit.
//!
//! Pure: everything from the proxy comes through [`Host`], time comes in as
//! `now` (nanoseconds since the Unix epoch, from the host's wall clock).
//!
//! Split by what it does: this file decides (limits, leases, the key
//! table's records); [`back`] gives back and settles; [`classify`]
//! classifies and identifies; [`peek()`] reads a key without charging it;
//! [`global`] checks a global limit's allowance.

mod back;
mod classify;
mod fair;
mod global;
mod levels;
mod peek;
mod worker_lease;

pub use back::{give_back, settle, Adjusted, Charged, Difference};
use back::{refund, Back};
pub use classify::{
    class_of, client_address, client_ip, identify, identify_levels, ROUTE_CLASS_PROPERTY,
    ROUTE_NAME_PROPERTY, SOURCE_ADDRESS_PROPERTY,
};
use global::check_global;
pub use levels::budgets as level_budgets;
pub use peek::{peek, peek_levels, KeyOf, LevelPeeked, Peeked};
use worker_lease::{leasable, lease_states};

use std::rc::Rc;

use crate::decision::write_logical_key;
pub use crate::decision::{
    logical_key, t_secs, Decision, LimitName, RateLimitHeaders, Reason, Standings, Subject,
};
use crate::host::Host;
use crate::keys::kind;
use crate::limiter::algo::{Algo, Live, Outcome, Stamp, State};
use crate::limiter::NANOS_PER_SEC;
use crate::policy::{Limit, Mode, Policy, RouteClass, MAX_LIMITS_PER_PLAN};
use crate::sync::{stored, Admitted, Allowance, NodeView, SyncState};
use crate::table::{
    self, push_record, push_record_with, Commit, Failure, Overflow, Place, Reach, Record, Records,
    MAX_RECORDS, MAX_RECORDS_LEN, RECORD_HEADER_LEN,
};

pub use crate::table::TableEvent;
/// How many times a request re-reads and retries its compare-and-swap
/// before giving up. When the bound is hit the request is denied with
/// [`Reason::Contention`] (503) and counted: never a silent allow.
pub use crate::table::MAX_CAS_ATTEMPTS;

/// What a worker reuses from one charge to the next, so that charging a
/// known key allocates nothing (see [`charge_synced`]).
#[derive(Debug, Default)]
pub struct Scratch {
    /// The logical key being charged.
    key: String,
    /// A nested level's key (`levels:`), charged while `key` is held.
    level_key: String,
    table: table::Buffers,
}

/// A request classified and identified: everything needed to charge it,
/// again if it is queued and retried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    /// Shared with the policy: preparing a request copies nothing.
    pub class: Rc<RouteClass>,
    pub subject: Subject,
    pub plan: usize,
    /// What this request is charged on its way in: the class's `cost`, or
    /// for a class that settles after the response its estimate (see
    /// `crate::cost`).
    pub cost: u64,
    /// The request's value at each nested level (`levels:`, root first;
    /// `None`: missing or unusable). Empty for an anonymous request or a
    /// policy without levels.
    pub levels: Vec<Option<Rc<str>>>,
}

/// Decides one request.
pub fn decide<H: Host>(policy: &Policy, host: &H, now: u64, scratch: &mut Scratch) -> Decision {
    match prepare(policy, host) {
        Ok(prepared) => charge(policy, &prepared, host, now, scratch),
        Err(reason) => Decision::pass(reason, Subject::None),
    }
}

/// Classifies and identifies a request; `Err` is the reason of a final
/// decision that needs no state (mode off, unclassified): the request goes on.
pub fn prepare<H: Host>(policy: &Policy, host: &H) -> Result<Prepared, Reason> {
    if policy.mode == Mode::Off {
        return Err(Reason::Disabled);
    }
    let Some(class) = class_of(policy, host) else {
        return Err(Reason::Unclassified);
    };
    let (subject, plan) = identify(policy, host);
    let levels = identify_levels(policy, host, &subject);
    Ok(Prepared {
        class: class.clone(),
        subject,
        plan,
        cost: class.cost,
        levels,
    })
}

/// Checks and charges a prepared request against its plan's limits, then
/// against its class's global guard, as a node that has just started
/// syncing (see [`charge_synced`]).
pub fn charge<H: Host>(
    policy: &Policy,
    req: &Prepared,
    host: &H,
    now: u64,
    scratch: &mut Scratch,
) -> Decision {
    charge_synced(policy, req, host, now, None, scratch)
}

/// [`charge`] with the node's sync state, which global limits decide with
/// (`None`: as if the node started syncing when the policy took effect).
/// Limits that are not global never look at it.
///
/// With `scratch` reused, an allowed request of a key already in the table
/// allocates nothing unless the policy sends `RateLimit` headers (they are
/// formatted only then); a denial formats its answer.
pub fn charge_synced<H: Host>(
    policy: &Policy,
    req: &Prepared,
    host: &H,
    now: u64,
    sync: Option<&SyncState>,
    scratch: &mut Scratch,
) -> Decision {
    charge_leased(policy, req, host, now, sync, req.cost, scratch)
}

/// [`charge_synced`], taking up to `want` units (≥ the request's cost) of
/// every limit of the key in the same update when they all have them: the
/// request's cost, and the rest for the worker's lease
/// ([`Decision::leased`]; see `crate::pipeline::lease`). Only keys whose
/// every limit is local, enforced, hard (not soft) and not a sliding log
/// are leased, never beside a guard nor for a class whose cost settles
/// after the response: anything else charges the cost alone.
pub fn charge_leased<H: Host>(
    policy: &Policy,
    req: &Prepared,
    host: &H,
    now: u64,
    sync: Option<&SyncState>,
    want: u64,
    scratch: &mut Scratch,
) -> Decision {
    let Some(plan) = policy.plan(req.plan) else {
        // Unreachable by construction (compile checks every reference).
        return Decision::pass(Reason::Unclassified, req.subject.clone());
    };
    let effective_from = policy.effective_from_ns.min(now);
    let view = policy.sync.as_ref().map(|s| {
        let state = sync
            .copied()
            .unwrap_or_else(|| SyncState::new(effective_from, s.interval_ns, s.timeout_ns));
        let mode = policy.failure_mode(Some(&req.class));
        state.view(
            mode,
            s.provisional,
            s.local_max_ns,
            s.timeout_ns,
            s.max_ttl_ns,
            now,
        )
    });
    let leasable = req.class.guard.is_none()
        && policy.levels.chain.is_empty()
        && req.class.settle.is_none()
        && policy.mode == Mode::Enforce
        && leasable(&plan.limits);
    let ctx = Ctx {
        now,
        effective_from: policy.effective_from_ns,
        shadow_mode: policy.mode == Mode::Shadow,
        cost: req.cost,
        want: if leasable { want.max(req.cost) } else { req.cost },
        headers: policy.ratelimit_headers,
        sync: view,
    };
    let Scratch {
        key,
        level_key,
        table,
    } = scratch;
    let tenant_place = key_place(policy, &plan.name, &req.class.action, &req.subject, key);
    let tenant = apply(host, &tenant_place, &plan.limits, &ctx, table);
    let mut decision = tenant.decision(&plan.limits, &plan.ratelimit_policy, Reason::RateLimited, &ctx);
    decision.subject = req.subject.clone();
    decision.leased = tenant.extra;
    decision.charged = tenant.charged;
    if tenant.extra > 0 {
        decision.standings = Some(Box::new(tenant.standings(plan.limits.len())));
    }
    if decision.deny_status().is_some() {
        return decision;
    }
    if !req.levels.is_empty() {
        let tenant_back = Back {
            charged: tenant.charged,
            units: ctx.cost,
            charged_at: now,
            lease: None,
        };
        if let Err(denied) = levels::charge(policy, req, host, &ctx, level_key, table, &mut decision) {
            // A level refused: give the tenant its tokens back.
            let refunded = refund(host, &tenant_place, &plan.limits, &tenant_back, &ctx, table).written;
            return levels::denial(*denied, &decision, refunded);
        }
    }
    let Some(guard) = req.class.guard.and_then(|g| policy.guard(g)) else {
        return decision;
    };
    let guarded = apply(
        host,
        &Place::Fixed { key: &guard.key },
        &guard.limits,
        &ctx,
        table,
    );
    let mut guard_decision =
        guarded.decision(&guard.limits, &guard.ratelimit_policy, Reason::GlobalGuard, &ctx);
    decision.cas_retries += guard_decision.cas_retries;
    if guard_decision.deny_status().is_some() {
        // The guard refused: give the tenant its tokens back.
        let back = Back {
            charged: tenant.charged,
            units: ctx.cost,
            charged_at: now,
            lease: None,
        };
        decision.refunded = refund(host, &tenant_place, &plan.limits, &back, &ctx, table).written;
        levels::refund_all(
            policy,
            req,
            host,
            &decision.levels_charged,
            &ctx,
            level_key,
            table,
        );
        guard_decision.subject = decision.subject;
        guard_decision.table = decision.table;
        guard_decision.refunded = decision.refunded;
        guard_decision.cas_retries = decision.cas_retries;
        return guard_decision;
    }
    if guard_decision.reason == Reason::ShadowLimited && decision.reason == Reason::Allowed {
        decision.reason = Reason::ShadowLimited;
        decision.limit = guard_decision.limit;
    }
    decision.guard_charged = guarded.charged != 0;
    decision
}

/// The request-independent inputs of one charge.
struct Ctx {
    now: u64,
    /// When the policy took effect, as loaded (may be ahead of `now`): what
    /// records are stamped and migrated with (see `crate::limiter::algo`).
    effective_from: u64,
    shadow_mode: bool,
    cost: u64,
    /// Units to take if every limit has them (the cost, plus a lease).
    want: u64,
    /// Whether decisions carry `RateLimit` headers (formatted only then).
    headers: bool,
    /// What global limits decide with (`None`: the policy has none).
    sync: Option<NodeView>,
}

/// One limit's state as read, and after charging this request if the
/// limit admits it.
enum Loaded {
    Local(Live, Option<State>),
    Global(Allowance, Option<Allowance>),
}

/// One limit's standing after this request: what `RateLimit` reports
/// (`t_ns`: its exact `t`, [`Algo::quota_window_ns`], computed only when
/// headers are on; a global limit's is the sync interval, within which
/// its lease is what the node has).
#[derive(Debug, Clone, Copy, Default)]
struct Standing {
    remaining: u64,
    t_ns: u64,
}

/// The denying limit whose wait is longest.
#[derive(Debug, Clone, Copy)]
struct Binding {
    limit: usize,
    wait_ns: u64,
}

/// Where a tenant key lives: `(action, subject)`'s logical key, written
/// into `key`, in the policy's key table, falling back to `plan`'s
/// overflow entry for `action`. The one place a charge, a settlement, a
/// lease given back and a peek find the key.
pub(crate) fn key_place<'a>(
    policy: &Policy,
    plan: &'a str,
    action: &'a str,
    subject: &Subject,
    key: &'a mut String,
) -> Place<'a> {
    write_logical_key(key, action, subject);
    Place::Table {
        logical: key.as_bytes(),
        entries: policy.key_table_entries,
        overflow: Overflow { action, plan },
    }
}

/// Whether a stored record is back to its fresh state at `now`: the key
/// table's idleness test (its slot can be reclaimed without losing
/// anything). A record this version cannot read counts as idle.
pub fn record_is_idle(record: &Record<'_>, now: u64) -> bool {
    if record.kind == kind::GLOBAL_ALLOWANCE {
        return stored::decode_allowance(record.state).is_none_or(|a| a.is_idle(now));
    }
    if record.kind == kind::IN_FLIGHT {
        return crate::inflight::record_is_idle(record, now);
    }
    if record.kind == kind::FAIR_TABLE {
        return fair::record_is_idle(record, now);
    }
    Algo::record_is_idle(record, now)
}

/// The key table's reach when charging: a new key takes a slot.
const CHARGE: Reach<'static> = Reach::Insert {
    is_idle: &record_is_idle,
};

/// The result of checking (and maybe charging) one set of limits.
struct Applied {
    /// Why nothing could be decided (contention, host failure).
    failure: Option<Reason>,
    /// Some enforced limit denies; with the shadow mode the request goes on.
    denied: bool,
    /// Some limit would deny but does not enforce (shadow limit or mode).
    shadow_denied: bool,
    /// The first soft limit (`on_limit: soft`) that would deny.
    soft: Option<usize>,
    binding: Option<Binding>,
    /// Per limit, after this request.
    report: [Standing; MAX_RECORDS],
    /// Bit i set: limit i was charged.
    charged: u32,
    cas_retries: u32,
    table: TableEvent,
    /// Some global limit decided by its failure mode for want of a lease.
    no_lease: bool,
    /// Units charged beyond the request's cost, for the worker's lease.
    extra: u64,
    /// Per global limit, the node's last share of it and how full the
    /// service's bucket was (a local limit, or no lease yet: nothing):
    /// what a pool's fairness shares on this node, and whether it is short.
    node_shares: [fair::NodeShare; MAX_RECORDS],
}

impl Applied {
    /// Nothing checked yet.
    fn new() -> Applied {
        Applied {
            failure: None,
            denied: false,
            shadow_denied: false,
            soft: None,
            binding: None,
            report: [Standing::default(); MAX_RECORDS],
            charged: 0,
            cas_retries: 0,
            table: TableEvent::None,
            no_lease: false,
            extra: 0,
            node_shares: [fair::NodeShare::default(); MAX_RECORDS],
        }
    }

    /// Each limit's standing after this charge (see [`Decision::standings`]).
    fn standings(&self, limits: usize) -> Standings {
        let mut s = Standings {
            len: limits.min(MAX_RECORDS),
            ..Standings::default()
        };
        for (i, r) in self.report.iter().enumerate().take(s.len) {
            s.remaining[i] = r.remaining;
            s.t_ns[i] = r.t_ns;
        }
        s
    }

    fn failed(reason: Reason, cas_retries: u32) -> Applied {
        Applied {
            failure: Some(reason),
            cas_retries,
            ..Applied::new()
        }
    }

    fn decision(&self, limits: &[Limit], policy_header: &str, deny_reason: Reason, ctx: &Ctx) -> Decision {
        let mut d = Decision::pass(Reason::Allowed, Subject::None);
        d.cas_retries = self.cas_retries;
        d.table = self.table;
        d.no_lease = self.no_lease;
        if let Some(reason) = self.failure {
            d.reason = reason;
            d.retry_after_secs = 1;
            return d;
        }
        // The `RateLimit` header's value for limits `which`: one string,
        // written in place (no string per limit, no join).
        let ratelimit = |which: std::ops::Range<usize>| -> String {
            let mut out = String::with_capacity(48 * which.len());
            for i in which {
                let (Some(l), s) = (limits.get(i), self.report.get(i).copied().unwrap_or_default()) else {
                    continue;
                };
                RateLimitHeaders::push_item(&mut out, &l.name, s.remaining, t_secs(s.remaining, s.t_ns));
            }
            out
        };
        match self.binding {
            // Over a soft limit only (and not in shadow mode): admitted,
            // marked with the soft limit, reported like any admission.
            _ if !self.denied && !ctx.shadow_mode && self.soft.is_some() => {
                d.reason = Reason::SoftLimited;
                d.limit = self
                    .soft
                    .and_then(|i| limits.get(i))
                    .map(|l| LimitName::Rate(l.name.clone()));
                if ctx.headers {
                    d.headers = Some(RateLimitHeaders {
                        policy: policy_header.to_owned(),
                        ratelimit: ratelimit(0..limits.len()),
                    });
                }
            }
            Some(b) if self.denied || self.shadow_denied => {
                if ctx.headers {
                    let l = &limits[b.limit];
                    d.headers = Some(RateLimitHeaders {
                        policy: l.policy_item(),
                        ratelimit: ratelimit(b.limit..b.limit.saturating_add(1)),
                    });
                }
                d.limit = limits.get(b.limit).map(|l| LimitName::Rate(l.name.clone()));
                d.wait_ns = b.wait_ns;
                d.retry_after_secs = ceil_secs(b.wait_ns).max(1);
                d.reason = if self.denied && !ctx.shadow_mode {
                    deny_reason
                } else {
                    Reason::ShadowLimited
                };
            }
            _ if ctx.headers => {
                d.headers = Some(RateLimitHeaders {
                    policy: policy_header.to_owned(),
                    ratelimit: ratelimit(0..limits.len()),
                });
            }
            _ => {}
        }
        d
    }
}

/// Checks `limits` for the key at `place` and charges them all if every
/// enforced limit admits: one update of the key table (see
/// [`table::update`]), retried on conflict. Each attempt checks every
/// limit ([`check_limits`]), then writes the records ([`write_records`]).
fn apply<H: Host>(
    host: &H,
    place: &Place<'_>,
    limits: &[Limit],
    ctx: &Ctx,
    buffers: &mut table::Buffers,
) -> Applied {
    let limits = &limits[..limits.len().min(MAX_LIMITS_PER_PLAN).min(MAX_RECORDS)];
    let updated = table::update(host, place, &CHARGE, ctx.now, buffers, |records, out| {
        let mut applied = Applied::new();
        // Per limit: its state as read (migrated, normalised), and the state
        // after charging this request if the limit admits it.
        let mut states: [Option<Loaded>; MAX_RECORDS] = Default::default();
        let changed = check_limits(records, limits, ctx, &mut applied, &mut states);
        if !applied.denied && ctx.want > ctx.cost {
            lease_states(limits, ctx, &mut applied, &mut states);
        }
        if applied.denied && ctx.shadow_mode {
            // Shadow mode: as if enforcing (nothing charged), but go on.
            applied.shadow_denied = true;
        }
        // A denial charges nothing; it writes only to persist a migrated or
        // normalised state (best effort).
        if applied.denied && !changed {
            return (Commit::Skip, applied);
        }
        write_records(out, records, limits, &states, ctx, &mut applied);
        // A denial's write is only a best-effort normalisation.
        let commit = if applied.denied {
            Commit::BestEffort
        } else {
            Commit::Write
        };
        (commit, applied)
    });
    match updated {
        Ok(u) => Applied {
            cas_retries: u.retries,
            table: u.event,
            ..u.result
        },
        Err(Failure::Exhausted) => Applied::failed(Reason::Contention, MAX_CAS_ATTEMPTS),
        Err(Failure::Unavailable { retries }) => Applied::failed(Reason::StateUnavailable, retries),
        Err(Failure::Absent | Failure::TooLarge) => Applied::failed(Reason::StateUnavailable, 0),
    }
}

/// Checks every limit against its record: its standing and the binding
/// limit go into `applied`, its state as read and as charged into
/// `states`. `true` if some record must be written even on a denial
/// (migrated, normalised, or a global limit's demand).
fn check_limits(
    records: Option<&Records<'_>>,
    limits: &[Limit],
    ctx: &Ctx,
    applied: &mut Applied,
    states: &mut [Option<Loaded>; MAX_RECORDS],
) -> bool {
    let mut changed = false;
    for (i, (l, slot)) in limits.iter().zip(states.iter_mut()).enumerate() {
        let record = records.and_then(|rs| rs.iter().find(|r| r.name_hash == l.name_hash));
        let (outcome, loaded, t_ns) = match (l.global, ctx.sync.as_ref()) {
            (true, Some(view)) => {
                // Demand is counted even when the request is denied, so
                // a global limit always writes.
                changed = true;
                let checked = check_global(record, l, view, ctx);
                applied.no_lease |= checked.no_lease;
                if let Some(share) = applied.node_shares.get_mut(i) {
                    *share = fair::NodeShare::of(&checked.demanded);
                }
                (
                    checked.outcome,
                    Loaded::Global(checked.demanded, checked.charged),
                    view.interval_ns,
                )
            }
            _ => {
                // Under the reload rule, the parameters may be a newer
                // policy's that wrote the record.
                let loaded = l.algo.load(record, ctx.effective_from, ctx.now);
                changed |= loaded.changed;
                match loaded.algo.check(&loaded.state, loaded.now, ctx.cost) {
                    Outcome::Admit {
                        state,
                        remaining,
                        reset_ns,
                    } => {
                        let t_ns = window(ctx.headers, loaded.now, &loaded.algo, &state, remaining);
                        (
                            Outcome::Admit {
                                state: State::TokenBucket { tat: 0 },
                                remaining,
                                reset_ns,
                            },
                            Loaded::Local(loaded, Some(state)),
                            t_ns,
                        )
                    }
                    deny => {
                        let remaining = match deny {
                            Outcome::Deny { remaining, .. } | Outcome::Admit { remaining, .. } => remaining,
                        };
                        let t_ns = window(ctx.headers, loaded.now, &loaded.algo, &loaded.state, remaining);
                        (deny, Loaded::Local(loaded, None), t_ns)
                    }
                }
            }
        };
        note_outcome(applied, limits, i, &outcome, t_ns);
        *slot = Some(loaded);
    }
    changed
}

/// Limit `i`'s outcome into `applied`: its standing, and whether it denies
/// (enforced or shadow) and binds: enforced limits first, then the
/// longest wait.
fn note_outcome(applied: &mut Applied, limits: &[Limit], i: usize, outcome: &Outcome, t_ns: u64) {
    match *outcome {
        Outcome::Admit { remaining, .. } => {
            applied.report[i] = Standing { remaining, t_ns };
        }
        Outcome::Deny {
            wait_ns, remaining, ..
        } => {
            applied.report[i] = Standing { remaining, t_ns };
            let soft = limits.get(i).is_some_and(|l| l.soft);
            let shadow = limits.get(i).is_some_and(|l| l.shadow) || soft;
            if soft {
                // Never denies; over it, the request is marked (or, in
                // shadow mode, counted as shadow_limited).
                applied.soft = applied.soft.or(Some(i));
                applied.shadow_denied = true;
            } else if shadow {
                applied.shadow_denied = true;
            } else {
                applied.denied = true;
            }
            let enforced = |l: &Limit| !l.shadow && !l.soft;
            let rank = (!shadow, wait_ns);
            if applied
                .binding
                .is_none_or(|b| rank > (enforced(&limits[b.limit]), b.wait_ns))
            {
                applied.binding = Some(Binding { limit: i, wait_ns });
            }
        }
    }
}

/// Writes the key's records into `out`: each limit's state, charged unless
/// the request is denied (its bit set in `applied.charged`), then the
/// records a newer policy wrote ([`keep_newer_records`]), after their count.
fn write_records(
    out: &mut Vec<u8>,
    records: Option<&Records<'_>>,
    limits: &[Limit],
    states: &[Option<Loaded>; MAX_RECORDS],
    ctx: &Ctx,
    applied: &mut Applied,
) {
    let count_at = out.len();
    out.push(0);
    let mut count = 0u8;
    for (i, (l, loaded)) in limits.iter().zip(states).enumerate() {
        match loaded {
            Some(Loaded::Local(loaded, charged)) => {
                let stored = match charged {
                    Some(charged) if !applied.denied => {
                        applied.charged |= 1 << i;
                        charged
                    }
                    _ => &loaded.state,
                };
                push_local(out, l.name_hash, loaded, stored);
            }
            Some(Loaded::Global(demanded, charged)) => {
                let (p1, p2) = l.algo.params();
                let stored = match charged {
                    Some(charged) if !applied.denied => {
                        applied.charged |= 1 << i;
                        charged
                    }
                    _ => demanded,
                };
                push_record_with(out, l.name_hash, kind::GLOBAL_ALLOWANCE, p1, p2, |o| {
                    stored::encode_allowance(stored, o)
                });
            }
            None => continue,
        }
        count += 1;
    }
    count = keep_newer_records(out, records, limits, ctx, count);
    out[count_at] = count;
}

/// Records of limits this plan lacks that a newer policy wrote (this
/// worker has not reloaded yet, or the request was queued under the old
/// policy) are kept as they are: dropping them would hand the newer
/// policy's limit a fresh start on its next charge. Returns the new count.
fn keep_newer_records(
    out: &mut Vec<u8>,
    records: Option<&Records<'_>>,
    limits: &[Limit],
    ctx: &Ctx,
    mut count: u8,
) -> u8 {
    for r in records.iter().flat_map(|rs| rs.iter()) {
        let room = usize::from(count) < MAX_RECORDS
            && out
                .len()
                .saturating_add(RECORD_HEADER_LEN)
                .saturating_add(r.state.len())
                <= MAX_RECORDS_LEN;
        if !room {
            break;
        }
        if limits.iter().all(|l| l.name_hash != r.name_hash)
            && Algo::written_by_newer(r, ctx.effective_from, ctx.now)
        {
            push_record(out, r.name_hash, r.kind, r.p1, r.p2, r.state);
            count += 1;
        }
    }
    count
}

/// Appends a local limit's record: `state` under the parameters `live`
/// was checked under, stamped with its epoch and the instant it was read
/// at (never earlier than the write it follows: [`crate::limiter::algo::reading`]).
fn push_local(out: &mut Vec<u8>, name_hash: u32, live: &Live, state: &State) {
    let (p1, p2) = live.algo.params();
    let stamp = Stamp {
        epoch: live.epoch,
        written_at: live.now,
    };
    push_record_with(out, name_hash, live.algo.kind(), p1, p2, |o| {
        Algo::encode_stored(state, stamp, o)
    });
}

/// A local limit's exact `t` on `state` (see [`Standing`]); 0 when the
/// policy sends no headers (nothing reads it).
fn window(headers: bool, now: u64, algo: &Algo, state: &State, remaining: u64) -> u64 {
    if headers {
        algo.quota_window_ns(state, now, remaining)
    } else {
        0
    }
}

fn ceil_secs(ns: u64) -> u64 {
    ns.div_ceil(NANOS_PER_SEC)
}

#[cfg(test)]
mod tests;
