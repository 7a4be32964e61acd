//! A worker's lease taken with a charge: which limits can be leased, and
//! taking `extra` units beyond the request's cost from every limit of a
//! key at once (see `crate::pipeline::lease`).

use super::*;

/// Whether a plan's limits can be leased to a worker (see
/// [`charge_leased`]): every one enforced, hard (a soft limit's marking is
/// decided request by request) and not a sliding log (whose log of instants
/// a lease spent later would make inexact). A global limit leases only from
/// the node's live service lease.
pub(super) fn leasable(limits: &[Limit]) -> bool {
    limits
        .iter()
        .all(|l| !l.shadow && !l.soft && !matches!(l.algo, Algo::SlidingWindowLog(_)))
}

/// Takes `extra` units more than the request's cost from every limit, the
/// most all of them have (at most `want − cost`): each limit's state and
/// standing become the charge of `cost + extra`. Nothing changes unless
/// every limit admits the larger charge.
pub(super) fn lease_states(
    limits: &[Limit],
    ctx: &Ctx,
    applied: &mut Applied,
    states: &mut [Option<Loaded>; MAX_RECORDS],
) {
    let mut extra = ctx.want.saturating_sub(ctx.cost);
    for (i, loaded) in states.iter().take(limits.len()).enumerate() {
        match loaded {
            Some(Loaded::Local(live, Some(_))) if !matches!(live.algo, Algo::SlidingWindowLog(_)) => {
                extra = extra.min(applied.report.get(i).map_or(0, |r| r.remaining));
            }
            Some(Loaded::Global(_, Some(charged))) => extra = extra.min(charged.leasable(ctx.now)),
            _ => extra = 0,
        }
    }
    if extra == 0 {
        return;
    }
    let cost = ctx.cost.saturating_add(extra);
    let mut leased: [Option<(Leased, Standing)>; MAX_RECORDS] = Default::default();
    for (slot, loaded) in leased.iter_mut().zip(states.iter()).take(limits.len()) {
        *slot = match loaded {
            Some(Loaded::Local(live, _)) => match live.algo.check(&live.state, live.now, cost) {
                Outcome::Admit { state, remaining, .. } => {
                    let t_ns = window(ctx.headers, live.now, &live.algo, &state, remaining);
                    Some((Leased::Local(state), Standing { remaining, t_ns }))
                }
                Outcome::Deny { .. } => return,
            },
            Some(Loaded::Global(_, Some(charged))) => {
                let (Some(view), mut more) = (ctx.sync.as_ref(), *charged) else {
                    return;
                };
                if more.take(view, extra, ctx.now) != Ok(Admitted::Lease) {
                    return;
                }
                let standing = Standing {
                    remaining: more.available(ctx.now),
                    t_ns: view.interval_ns,
                };
                Some((Leased::Global(more), standing))
            }
            _ => return,
        };
    }
    for (i, (slot, lease)) in states.iter_mut().zip(leased).enumerate().take(limits.len()) {
        match (slot, lease) {
            (Some(Loaded::Local(_, charged)), Some((Leased::Local(state), standing))) => {
                *charged = Some(state);
                applied.report[i] = standing;
            }
            (Some(Loaded::Global(_, charged)), Some((Leased::Global(a), standing))) => {
                *charged = Some(a);
                applied.report[i] = standing;
            }
            _ => {}
        }
    }
    applied.extra = extra;
}

/// A limit's state after a lease's take (see [`lease_states`]).
enum Leased {
    Local(State),
    Global(Allowance),
}
