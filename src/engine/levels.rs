//! Charging a request's nested levels (`levels:`, see
//! [`crate::policy::levels`]): after its tenant's key, each level from the
//! one nearest the tenant up to the root, all or nothing. A level that
//! refuses gives back what the levels below it and the tenant were
//! charged, and its denial names it. At each level a member with a
//! guaranteed share takes it first and the pool only when it is spent.
//!
//! Not atomic across keys (shared data has no transaction): a request
//! between another's charge and its give-back may see that charge and be
//! refused. That errs toward admitting less, never more: no key is ever
//! charged past its limits.

use std::rc::Rc;

use super::back::{refund, Back};
use super::fair;
use super::{apply, Ctx, Decision, LimitName, Reason};
use crate::decision::LevelsCharged;
use crate::engine::Prepared;
use crate::host::Host;
use crate::limiter::fair::Fairness;
use crate::policy::levels::{write_key, Budget, Level, Share};
use crate::policy::{Limit, Policy};
use crate::table::{self, Overflow, Place};

/// Charges every level of `req` after its tenant was charged in
/// `decision`: what each level charged goes into
/// `decision.levels_charged`, its `RateLimit` items into
/// `decision.headers`. `Err`: a level refused (or could not decide), with
/// its decision; what the levels below it were charged is given back.
pub(super) fn charge<H: Host>(
    policy: &Policy,
    req: &Prepared,
    host: &H,
    ctx: &Ctx,
    key: &mut String,
    table: &mut table::Buffers,
    decision: &mut Decision,
) -> Result<(), Box<Decision>> {
    for (l, level) in policy.levels.chain.iter().enumerate().rev() {
        let mut refused: Option<Decision> = None;
        for (budget, share) in budgets(level, l, &req.levels) {
            let at = place(policy, &req.class.action, &req.levels, level, l, budget, key);
            let applied = apply(host, &at, &share.limits, ctx, table);
            let mut d = applied.decision(&share.limits, &share.ratelimit_policy, Reason::RateLimited, ctx);
            decision.cas_retries = decision.cas_retries.saturating_add(d.cas_retries);
            d.limit = d.limit.map(|n| LimitName::Level {
                level: level.name.clone(),
                name: n.name().to_owned(),
                fair_share: false,
            });
            let fair = if level.fair && budget == Budget::Pool {
                fair::ask(
                    policy,
                    req,
                    host,
                    ctx,
                    level,
                    l,
                    &share.limits,
                    &applied,
                    key,
                    table,
                )
            } else {
                Fairness::Within
            };
            if d.deny_status().is_some() {
                refused = Some(nearer(refused.take(), d, applied.failure.is_none()));
                continue;
            }
            if let Fairness::Over { limit, wait_ns } = fair {
                // Over its member's fair share: the pool's charge goes back.
                let at = place(policy, &req.class.action, &req.levels, level, l, budget, key);
                let back = Back {
                    charged: applied.charged,
                    units: ctx.cost,
                    charged_at: ctx.now,
                    lease: None,
                };
                refund(host, &at, &share.limits, &back, ctx, table);
                if let Some(limit) = share.limits.get(limit) {
                    let denied = fair::refusal(&d, level, limit, wait_ns, ctx);
                    refused = Some(nearer(refused.take(), denied, true));
                }
                continue;
            }
            refused = None;
            if let Some(slot) = decision.levels_charged.limits.get_mut(l) {
                *slot = applied.charged;
            }
            if let Some(g) = decision.levels_charged.guaranteed.get_mut(l) {
                *g = matches!(budget, Budget::Guaranteed { .. });
            }
            merge_allowed(decision, d);
            break;
        }
        if let Some(denied) = refused {
            refund_all(policy, req, host, &decision.levels_charged, ctx, key, table);
            return Err(Box::new(denied));
        }
    }
    Ok(())
}

/// The refusal of a level with two budgets (a member's guaranteed share,
/// then the pool): the nearer wait, since either admits then. `decided`:
/// the later refusal was decided (not a failure to decide).
fn nearer(earlier: Option<Decision>, later: Decision, decided: bool) -> Decision {
    match earlier {
        Some(e) if decided && e.wait_ns <= later.wait_ns => e,
        _ => later,
    }
}

/// A level's denial as the request's decision: who was charged, the
/// key-table events and retries of the whole request, and whether the
/// tenant's charge was given back.
pub(super) fn denial(mut denied: Decision, charged: &Decision, refunded: bool) -> Decision {
    denied.subject = charged.subject.clone();
    denied.table = charged.table;
    denied.refunded = refunded;
    denied.cas_retries = charged.cas_retries;
    denied
}

/// An admitting level's decision folded into the request's: its
/// `RateLimit` items after the tenant's, and its shadow denial if the
/// request has none yet.
fn merge_allowed(decision: &mut Decision, level: Decision) {
    if level.reason == Reason::ShadowLimited && decision.reason == Reason::Allowed {
        decision.reason = Reason::ShadowLimited;
        decision.limit = level.limit;
    }
    if let (Some(h), Some(l)) = (decision.headers.as_mut(), level.headers) {
        for (into, from) in [(&mut h.policy, l.policy), (&mut h.ratelimit, l.ratelimit)] {
            if !into.is_empty() && !from.is_empty() {
                into.push_str(", ");
            }
            into.push_str(&from);
        }
    }
}

/// Gives back what the levels in `charged` took for `req` (a later level
/// or the guard refused). Best effort, like every refund.
pub(super) fn refund_all<H: Host>(
    policy: &Policy,
    req: &Prepared,
    host: &H,
    charged: &LevelsCharged,
    ctx: &Ctx,
    key: &mut String,
    table: &mut table::Buffers,
) {
    each_charged(policy, req, charged, key, |place, limits, bits| {
        let back = Back {
            charged: bits,
            units: ctx.cost,
            charged_at: ctx.now,
            lease: None,
        };
        refund(host, place, limits, &back, ctx, table);
    });
}

/// Calls `f` with the key, the limits and the charged bits of every
/// level `charged` says `req` was charged at.
pub(super) fn each_charged(
    policy: &Policy,
    req: &Prepared,
    charged: &LevelsCharged,
    key: &mut String,
    mut f: impl FnMut(&Place<'_>, &[Limit], u32),
) {
    for (l, level) in policy.levels.chain.iter().enumerate() {
        let bits = charged.limits.get(l).copied().unwrap_or(0);
        if bits == 0 {
            continue;
        }
        let guaranteed = charged.guaranteed.get(l).copied().unwrap_or(false);
        let Some((budget, share)) = budgets(level, l, &req.levels)
            .find(|(b, _)| matches!(b, Budget::Guaranteed { .. }) == guaranteed)
        else {
            continue;
        };
        let place = place(policy, &req.class.action, &req.levels, level, l, budget, key);
        f(&place, &share.limits, bits);
    }
}

/// The budgets a request whose level values are `values` tries at level
/// `l`, in order: its value's ceiling alone if it has one; else the
/// guaranteed share of its member one level down (if it has one), then
/// the pool. None if the level has no budget of its own. At most two, in
/// place (nothing allocated per request).
pub fn budgets<'p>(
    level: &'p Level,
    l: usize,
    values: &'p [Option<Rc<str>>],
) -> impl Iterator<Item = (Budget<'p>, &'p Share)> {
    let value = values.get(l).and_then(|v| v.as_deref());
    let member = values.get(l.saturating_add(1)).and_then(|v| v.as_deref());
    let tried: [Option<(Budget<'p>, &'p Share)>; 2] = match value.and_then(|v| level.ceilings.get(v)) {
        Some(ceiling) => [Some((Budget::Pool, ceiling)), None],
        None if level.pool.limits.is_empty() => [None, None],
        None => [
            member
                .and_then(|m| level.guaranteed.get_key_value(m))
                .map(|(member, share)| (Budget::Guaranteed { member }, share)),
            Some((Budget::Pool, &level.pool)),
        ],
    };
    tried.into_iter().flatten()
}

/// Where level `l`'s `budget` for the level values `values` lives on
/// `action`: its key (written into `key`) in the policy's key table,
/// falling back to the level's overflow entry for the action.
pub(super) fn place<'a>(
    policy: &Policy,
    action: &'a str,
    values: &[Option<Rc<str>>],
    level: &'a Level,
    l: usize,
    budget: Budget<'_>,
    key: &'a mut String,
) -> Place<'a> {
    write_key(key, action, l, &policy.levels, values, budget);
    Place::Table {
        logical: key.as_bytes(),
        entries: policy.key_table_entries,
        overflow: Overflow {
            action,
            plan: &level.overflow,
        },
    }
}
