//! Reading a key's standing without charging it (`GET /limits`, the
//! RLS's headers, `policy explain`).

use super::*;

/// A key of the key table: an action's, for a subject on its plan.
#[derive(Debug, Clone, Copy)]
pub struct KeyOf<'a> {
    pub action: &'a str,
    pub subject: &'a Subject,
    pub plan: usize,
}

/// One limit's standing on a key, read without charging it (see [`peek()`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peeked {
    /// What could be admitted now, in cost units.
    pub remaining: u64,
    /// Nanoseconds until the limit is whole again.
    pub reset_ns: u64,
    /// The exact `t` of the `RateLimit` field ([`Algo::quota_window_ns`]).
    pub t_ns: u64,
}

/// What each limit of `plan` has left for `subject` on `action`'s key, as
/// this node's entry says at `now`: read, never charged, never written (a
/// key not in the table has every limit whole). A global limit reports its
/// allowance on this node (`sync`, as for [`charge_synced`]). `None`:
/// shared data could not be read.
pub fn peek<H: Host>(
    policy: &Policy,
    key: &KeyOf<'_>,
    host: &H,
    now: u64,
    sync: Option<&SyncState>,
    scratch: &mut Scratch,
) -> Option<Vec<Peeked>> {
    let (action, subject) = (key.action, key.subject);
    let plan = policy.plan(key.plan)?;
    let Scratch { key, table, .. } = scratch;
    let place = super::key_place(policy, &plan.name, action, subject, key);
    peek_at(policy, &place, &plan.limits, host, now, sync, table)
}

/// One nested level's standing for a caller (see [`peek_levels`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LevelPeeked {
    pub level: Rc<str>,
    /// The limit, as `RateLimit` items name it (`<level>:<limit>`).
    pub limit: String,
    /// What the caller may use of it in all: its ceiling, or its member's
    /// guaranteed share plus the pool.
    pub quota: u64,
    pub window_secs: u64,
    pub peeked: Peeked,
}

/// What each limit of each nested level has left for a caller whose level
/// values are `values`, on `action`, summed over the budgets it may take
/// (its ceiling; or its member's guaranteed share, then the pool): read,
/// never charged. `None`: shared data could not be read.
pub fn peek_levels<H: Host>(
    policy: &Policy,
    action: &str,
    values: &[Option<Rc<str>>],
    host: &H,
    now: u64,
    scratch: &mut Scratch,
) -> Option<Vec<LevelPeeked>> {
    let mut out: Vec<LevelPeeked> = Vec::new();
    if values.is_empty() {
        return Some(out);
    }
    let Scratch { level_key, table, .. } = scratch;
    for (l, level) in policy.levels.chain.iter().enumerate() {
        let first = out.len();
        for (budget, share) in super::levels::budgets(level, l, values) {
            let place = super::levels::place(policy, action, values, level, l, budget, level_key);
            let peeked = peek_at(policy, &place, &share.limits, host, now, None, table)?;
            // A member's guaranteed share and the pool are the same limits
            // of the level (in the same order), scaled: summed, named as
            // the pool's (the last).
            for (i, (limit, p)) in share.limits.iter().zip(peeked).enumerate() {
                match out.get_mut(first.saturating_add(i)) {
                    Some(o) => {
                        o.limit.clone_from(&limit.name);
                        o.quota = o.quota.saturating_add(limit.rate);
                        o.peeked.remaining = o.peeked.remaining.saturating_add(p.remaining);
                        o.peeked.reset_ns = o.peeked.reset_ns.max(p.reset_ns);
                        o.peeked.t_ns = o.peeked.t_ns.max(p.t_ns);
                    }
                    None => out.push(LevelPeeked {
                        level: level.name.clone(),
                        limit: limit.name.clone(),
                        quota: limit.rate,
                        window_secs: limit.per_secs,
                        peeked: p,
                    }),
                }
            }
        }
    }
    Some(out)
}

/// Each of `limits`' standing on the key at `place`, read without
/// charging it (a key not in the table has every limit whole).
fn peek_at<H: Host>(
    policy: &Policy,
    place: &Place<'_>,
    limits: &[Limit],
    host: &H,
    now: u64,
    sync: Option<&SyncState>,
    table: &mut table::Buffers,
) -> Option<Vec<Peeked>> {
    let effective_from = policy.effective_from_ns.min(now);
    let view = policy.sync.as_ref().map(|s| {
        let state = sync
            .copied()
            .unwrap_or_else(|| SyncState::new(effective_from, s.interval_ns, s.timeout_ns));
        state.view(
            s.failure_mode,
            s.provisional,
            s.local_max_ns,
            s.timeout_ns,
            s.max_ttl_ns,
            now,
        )
    });
    let peek_all = |records: Option<&Records<'_>>| -> Vec<Peeked> {
        limits
            .iter()
            .map(|l| {
                let record = records.and_then(|rs| rs.iter().find(|r| r.name_hash == l.name_hash));
                peek_limit(l, record, view.as_ref(), policy.effective_from_ns, now)
            })
            .collect()
    };
    match table::update(host, place, &Reach::Existing, now, table, |records, _| {
        (Commit::Skip, peek_all(records))
    }) {
        Ok(u) => Some(u.result),
        // Not in the table: every limit whole.
        Err(Failure::Absent) => Some(peek_all(None)),
        Err(_) => None,
    }
}

/// One limit's standing from its record (`None`: whole).
fn peek_limit(
    l: &Limit,
    record: Option<&Record<'_>>,
    view: Option<&NodeView>,
    effective_from: u64,
    now: u64,
) -> Peeked {
    if let (true, Some(view)) = (l.global, view) {
        let a = record
            .filter(|r| r.kind == kind::GLOBAL_ALLOWANCE)
            .and_then(|r| stored::decode_allowance(r.state))
            .unwrap_or_else(|| Allowance::fresh(view.provisional));
        return Peeked {
            remaining: a.available(now),
            reset_ns: view.interval_ns,
            t_ns: view.interval_ns,
        };
    }
    let live = l.algo.load(record, effective_from, now);
    match live.algo.check(&live.state, live.now, 0) {
        Outcome::Admit {
            remaining, reset_ns, ..
        }
        | Outcome::Deny {
            remaining, reset_ns, ..
        } => Peeked {
            remaining,
            reset_ns,
            t_ns: live.algo.quota_window_ns(&live.state, live.now, remaining),
        },
    }
}
