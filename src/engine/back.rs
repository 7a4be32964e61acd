//! Giving back and settling: a refused request's charge, a worker lease's
//! unspent units and a settled cost's difference go back through the key
//! table's one update primitive, only to records still under the
//! parameters they were charged under.

use super::*;
use crate::decision::LevelsCharged;

/// What [`refund`] gives back: `units` of the limits in `charged`, charged
/// at `charged_at`. `lease`: a worker's lease going back, whose `spent`
/// units its requests used (a global limit's allowance takes it back too,
/// and counts them as demand); otherwise a refused request's charge, which
/// a global limit keeps (it errs toward admitting less).
pub(super) struct Back {
    pub(super) charged: u32,
    pub(super) units: u64,
    pub(super) charged_at: u64,
    pub(super) lease: Option<Spent>,
}

/// The units a worker's requests spent from its lease.
#[derive(Debug, Clone, Copy)]
pub(super) struct Spent(pub(super) u64);

/// A change to a key's charged limits after its charge ([`adjust`]).
#[derive(Debug, Clone, Copy)]
enum Change {
    /// Give `units` back (a refusal later in the chain, a settled cost
    /// below its estimate).
    Back(u64),
    /// A worker's lease returned: `units` it did not spend go back, and
    /// the `spent` units its requests took count as demand on a global
    /// limit ([`Allowance::give_back_lease`]); a local limit takes the
    /// units back as from a refusal.
    LeaseBack { units: u64, spent: u64 },
    /// Charge `units` more without admission (a settled cost above its
    /// estimate), into debt up to each limit's `max_debt`.
    More(u64),
}

impl Change {
    /// The units this change moves.
    fn units(self) -> u64 {
        match self {
            Change::Back(units) | Change::LeaseBack { units, .. } | Change::More(units) => units,
        }
    }
}

/// What a settlement (or a refund) did to a key's limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Adjusted {
    /// The key's entry was written.
    pub written: bool,
    /// The most units any limit could not take (its debt allowance full).
    pub written_off: u64,
    /// The most units any adjusted limit owes afterwards (0: none in debt).
    pub owed: u64,
    /// The most units of a give-back a limit did not take because a reload
    /// changed its parameters since the charge (see [`Algo::charged_under`]).
    pub dropped: u64,
}

/// Gives back a charge (a later check denied the request, or a worker
/// returns its lease's unused units). Best effort: returns what was
/// written and what a reload made it drop.
pub(super) fn refund<H: Host>(
    host: &H,
    place: &Place<'_>,
    limits: &[Limit],
    back: &Back,
    ctx: &Ctx,
    buffers: &mut table::Buffers,
) -> Adjusted {
    let change = match back.lease {
        Some(Spent(spent)) => Change::LeaseBack {
            units: back.units,
            spent,
        },
        None => Change::Back(back.units),
    };
    adjust(
        host,
        place,
        limits,
        back.charged,
        change,
        back.charged_at,
        ctx,
        buffers,
    )
}

/// Applies `change` to the limits in `charged` (bit i: `limits[i]`) of the
/// key at `place`, charged at `charged_at`: one update of the key table
/// (see [`table::update`]); records of other limits are kept as they are.
/// A global limit's allowance takes it on its lease (see
/// `crate::sync::node`, "Costs settled after the response"). Giving back
/// needs the key in the table; charging more takes a slot if the key lost
/// its own (idle and reclaimed during a long stream) and starts a missing
/// local record fresh (a missing allowance is not: none of this node's
/// lease is in it any more). Best effort: returns what was written.
#[allow(clippy::too_many_arguments)]
fn adjust<H: Host>(
    host: &H,
    place: &Place<'_>,
    limits: &[Limit],
    charged: u32,
    change: Change,
    charged_at: u64,
    ctx: &Ctx,
    buffers: &mut table::Buffers,
) -> Adjusted {
    let limits = &limits[..limits.len().min(MAX_LIMITS_PER_PLAN).min(MAX_RECORDS)];
    let more = matches!(change, Change::More(_));
    let giving_back = !more;
    let reach = if more { &CHARGE } else { &Reach::Existing };
    let is_charged = |i: usize, l: &Limit| charged & (1 << i) != 0 && !l.global;
    let updated = table::update(host, place, reach, ctx.now, buffers, |records, out| {
        let mut adjusted = Adjusted::default();
        if records.is_none() && !more {
            return (Commit::Skip, adjusted);
        }
        let count_at = out.len();
        out.push(0);
        let mut count = 0u8;
        for r in records.iter().flat_map(|rs| rs.iter()) {
            let limit = limits
                .iter()
                .enumerate()
                .find(|(_, l)| l.name_hash == r.name_hash);
            match limit {
                Some((i, l)) if is_charged(i, l) && giving_back && !l.algo.charged_under(r) => {
                    // A give-back goes only to a record still under the
                    // parameters it was charged under: a reload migrated
                    // this one, and what the old policy charged is already
                    // accounted in the fill level it carried over.
                    adjusted.dropped = adjusted.dropped.max(change.units());
                    push_record(out, r.name_hash, r.kind, r.p1, r.p2, r.state);
                }
                Some((i, l)) if is_charged(i, l) && r.kind != kind::GLOBAL_ALLOWANCE => {
                    let current = l.algo.load(Some(r), ctx.effective_from, ctx.now);
                    let state = change_state(&current, change, charged_at, &mut adjusted);
                    push_local(out, r.name_hash, &current, &state);
                }
                Some((i, l)) if l.global && charged & (1 << i) != 0 && r.kind == kind::GLOBAL_ALLOWANCE => {
                    match stored::decode_allowance(r.state) {
                        Some(mut a) => {
                            change_allowance(&mut a, l, change, ctx.now, &mut adjusted);
                            push_record_with(out, r.name_hash, r.kind, r.p1, r.p2, |o| {
                                stored::encode_allowance(&a, o)
                            });
                        }
                        None => push_record(out, r.name_hash, r.kind, r.p1, r.p2, r.state),
                    }
                }
                _ => push_record(out, r.name_hash, r.kind, r.p1, r.p2, r.state),
            }
            count = count.saturating_add(1);
        }
        if more {
            for (i, l) in limits.iter().enumerate() {
                let stored = records.is_some_and(|rs| rs.iter().any(|r| r.name_hash == l.name_hash));
                if stored || !is_charged(i, l) || usize::from(count) >= MAX_RECORDS {
                    continue;
                }
                let fresh = l.algo.load(None, ctx.effective_from, ctx.now);
                let state = change_state(&fresh, change, charged_at, &mut adjusted);
                push_local(out, l.name_hash, &fresh, &state);
                count += 1;
            }
        }
        out[count_at] = count;
        (Commit::Write, adjusted)
    });
    match updated {
        Ok(u) => Adjusted {
            written: u.written,
            ..u.result
        },
        Err(_) => Adjusted::default(),
    }
}

/// One limit's state after `change`, noting what it wrote off and owes.
fn change_state(live: &Live, change: Change, charged_at: u64, adjusted: &mut Adjusted) -> State {
    let now = live.now;
    let state = match change {
        Change::Back(units) | Change::LeaseBack { units, .. } => {
            live.algo.refund(&live.state, units, charged_at)
        }
        Change::More(units) => {
            let (state, lost) = live.algo.settle_more(&live.state, units, charged_at, now);
            adjusted.written_off = adjusted.written_off.max(lost);
            state
        }
    };
    adjusted.owed = adjusted.owed.max(live.algo.debt(&state, now));
    state
}

/// A global limit's allowance after `change` (see `crate::sync::node`,
/// "Costs settled after the response"), noting what it wrote off and owes.
fn change_allowance(a: &mut Allowance, l: &Limit, change: Change, now: u64, adjusted: &mut Adjusted) {
    match change {
        Change::Back(units) => a.give_back(units, now),
        Change::LeaseBack { units, spent } => a.give_back_lease(units, spent, now),
        Change::More(units) => {
            let lost = a.settle_more(units, l.max_debt, now);
            adjusted.written_off = adjusted.written_off.max(lost);
        }
    }
    adjusted.owed = adjusted.owed.max(a.owed);
}

/// A late-settled cost's difference to what the request was charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Difference {
    /// The real cost was this much more: charged without admission.
    More(u64),
    /// The real cost was this much less: given back.
    Less(u64),
}

/// What a request was charged, for its late settlement (see `crate::cost`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charged {
    /// Bit i: the plan's limit i ([`Decision::charged`]).
    pub limits: u32,
    /// The class's guard too ([`Decision::guard_charged`]).
    pub guard: bool,
    /// Its nested levels ([`Decision::levels_charged`]).
    pub levels: LevelsCharged,
    /// When.
    pub at: u64,
}

/// Settles the difference between a request's real cost and what it was
/// charged: charged without admission (into debt, up to each limit's
/// `max_debt`) or given back, through the key table's update, to every
/// limit it was charged against, then to its class's guard. Best effort
/// (a failed write is lost, like a refund's). Returns the tenant's
/// key's [`Adjusted`] (the guard's write-offs and debt are not reported).
pub fn settle<H: Host>(
    policy: &Policy,
    req: &Prepared,
    host: &H,
    charged: &Charged,
    difference: Difference,
    now: u64,
    scratch: &mut Scratch,
) -> Adjusted {
    let Some(plan) = policy.plan(req.plan) else {
        return Adjusted::default();
    };
    let change = match difference {
        Difference::More(0) | Difference::Less(0) => return Adjusted::default(),
        Difference::More(units) => Change::More(units),
        Difference::Less(units) => Change::Back(units),
    };
    let ctx = Ctx {
        now,
        effective_from: policy.effective_from_ns,
        shadow_mode: false,
        cost: 0,
        want: 0,
        headers: false,
        sync: None,
    };
    let Scratch {
        key,
        level_key,
        table,
    } = scratch;
    let place = key_place(policy, &plan.name, &req.class.action, &req.subject, key);
    let adjusted = adjust(
        host,
        &place,
        &plan.limits,
        charged.limits,
        change,
        charged.at,
        &ctx,
        table,
    );
    if let (true, Some(guard)) = (charged.guard, req.class.guard.and_then(|g| policy.guard(g))) {
        let every = 1u32
            .checked_shl(u32::try_from(guard.limits.len()).unwrap_or(32))
            .map_or(u32::MAX, |b| b.wrapping_sub(1));
        let place = Place::Fixed { key: &guard.key };
        adjust(
            host,
            &place,
            &guard.limits,
            every,
            change,
            charged.at,
            &ctx,
            table,
        );
    }
    super::levels::each_charged(policy, req, &charged.levels, level_key, |place, limits, bits| {
        adjust(host, place, limits, bits, change, charged.at, &ctx, table);
    });
    adjusted
}

/// Gives `units` of a worker's lease on `req`'s key back to every limit of
/// its plan, as charged at `taken_at` (a fixed window or a sliding counter
/// takes back only within the window they were charged in). Best effort:
/// units that cannot be given back are lost, which errs toward admitting
/// less, and so are units a reload made worthless ([`Algo::charged_under`]).
/// Returns what was written and dropped.
#[allow(clippy::too_many_arguments)]
pub fn give_back<H: Host>(
    policy: &Policy,
    req: &Prepared,
    host: &H,
    units: u64,
    spent: u64,
    taken_at: u64,
    now: u64,
    scratch: &mut Scratch,
) -> Adjusted {
    let Some(plan) = policy.plan(req.plan) else {
        return Adjusted::default();
    };
    let ctx = Ctx {
        now,
        effective_from: policy.effective_from_ns,
        shadow_mode: false,
        cost: units,
        want: units,
        headers: false,
        sync: None,
    };
    let Scratch { key, table, .. } = scratch;
    let place = key_place(policy, &plan.name, &req.class.action, &req.subject, key);
    let limits = &plan.limits[..plan.limits.len().min(MAX_LIMITS_PER_PLAN).min(MAX_RECORDS)];
    let back = Back {
        charged: 1u32
            .checked_shl(u32::try_from(limits.len()).unwrap_or(32))
            .map_or(u32::MAX, |b| b.wrapping_sub(1)),
        units,
        charged_at: taken_at,
        lease: Some(Spent(spent)),
    };
    refund(host, &place, limits, &back, &ctx, table)
}
