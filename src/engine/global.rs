//! A global limit's allowance (a regional share from the central
//! service), checked beside the local limits.

use super::*;

/// What [`check_global`] found.
pub(super) struct GlobalChecked {
    pub(super) outcome: Outcome,
    /// The stored allowance with this request's demand counted.
    pub(super) demanded: Allowance,
    /// The allowance charged, if it admits.
    pub(super) charged: Option<Allowance>,
    /// It decided by its failure mode for want of a lease.
    pub(super) no_lease: bool,
}

/// Checks a global limit's allowance.
///
/// A denial's wait is never shorter than when the request could really
/// pass: an exhausted lease grows by about its share per interval, so a
/// request of `cost` waits `ceil((cost − left) / share)` intervals, with
/// the exact (fractional) share the service sent: at 100/min over nine
/// nodes a share is 0.19 units per 1 s interval, and a cost of 5 waits
/// 28 intervals, not 5 ([`Allowance::intervals_for`]; one at least: the
/// next lease comes with the next answer).
///
/// A calendar month's budget (`per: month`) never makes a request wait
/// past the month's end (the service's bucket fills then). A month the
/// service said is spent (a live lease granted this month with
/// `bucket_milli` 0: every unit admitted) waits until its end; otherwise
/// the wait is the lease's (docs/global-limits.md, "Calendar months across
/// nodes").
pub(super) fn check_global(
    record: Option<&Record<'_>>,
    limit: &Limit,
    view: &NodeView,
    ctx: &Ctx,
) -> GlobalChecked {
    let mut demanded = record
        .filter(|r| r.kind == kind::GLOBAL_ALLOWANCE)
        .and_then(|r| stored::decode_allowance(r.state))
        .unwrap_or_else(|| Allowance::fresh(view.provisional));
    demanded.note_demand(ctx.cost);
    let mut charged = demanded;
    let taken = charged.take(view, ctx.cost, ctx.now);
    let no_lease = charged.no_lease(view, ctx.now);
    match taken {
        Ok(_) => GlobalChecked {
            outcome: Outcome::Admit {
                state: State::TokenBucket { tat: 0 },
                remaining: charged.available(ctx.now),
                reset_ns: view.interval_ns,
            },
            demanded,
            charged: Some(charged),
            no_lease,
        },
        Err(_) => {
            let missing = ctx.cost.saturating_sub(demanded.available(ctx.now));
            let intervals = demanded.intervals_for(missing);
            let mut wait_ns = view.interval_ns.saturating_mul(intervals);
            if let Some(m) = limit.algo.calendar_month(ctx.now) {
                let until_end = m.until_end(ctx.now);
                wait_ns = if demanded.told_spent_since(m.start, view.max_ttl_ns, ctx.now) {
                    until_end
                } else {
                    wait_ns.min(until_end)
                };
            }
            GlobalChecked {
                outcome: Outcome::Deny {
                    wait_ns,
                    remaining: demanded.available(ctx.now),
                    reset_ns: view.interval_ns,
                },
                // Keeps what deciding normalised (the wait for a lease, the
                // local bucket); a denial charges nothing.
                demanded: charged,
                charged: None,
                no_lease,
            }
        }
    }
}
