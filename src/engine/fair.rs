//! A nested level's pool shared max-min fairly (`sharing: max_min`): the
//! rule is [`crate::limiter::fair`]; this keeps each pool's table in the
//! key table, beside the pool's budget (`…|f`), through the one update
//! primitive.
//!
//! The pool is charged first, as every budget; then its table records
//! what the request's member asked and says whether it may take it. A
//! request over its member's fair share is refused and the pool's charge
//! given back (as a level refusal gives back the levels below it): it errs
//! toward admitting less, never more. A table that overflowed into the
//! level's shared overflow entry mixes pools, so its verdict is not used
//! (the pool is shared first come for that request). A table that cannot
//! be read or written refuses nothing.
//!
//! A global pool limit (`global: true`) is shared on each node: the
//! capacity is the node's share of it (what the service last allocated
//! the node, per interval), contended while the service's bucket holds
//! less than half its burst (each lease says how full it was; a node's
//! own lease is often a request or two per interval, too coarse a
//! standing to say) and the members asking on the node ask more than the
//! node's share. The service allocates the pool over the nodes by their
//! demand; each node shares what it gets max-min fairly among the members
//! asking on it. A member whose requests are spread over the nodes is held
//! on each.

use std::rc::Rc;

use super::{Applied, Ctx, Decision, LimitName, Prepared, Reason};
use crate::decision::{RateLimitHeaders, Subject};
use crate::host::Host;
use crate::keys::kind;
use crate::limiter::fair::{Contended, FairTable, Fairness, PoolLimit};
use crate::limiter::NANOS_PER_SEC;
use crate::policy::levels::{write_key, Budget, Level};
use crate::policy::{Limit, Policy};
use crate::sync::{Allowance, FULL_BUCKET_MILLI};
use crate::table::{self, push_record_with, Commit, Overflow, Place, Reach, Record, TableEvent};

/// The name hash of a fairness table's record (FNV-1a of `fair`).
const FAIR_NAME_HASH: u32 = 0x0053_5833;

/// Whether a fairness table's record is idle: every demand decayed below
/// one unit by `now`, with `p1` the longest period of its pool's limits.
pub(super) fn record_is_idle(record: &Record<'_>, now: u64) -> bool {
    FairTable::decode(record.state).is_none_or(|t| t.is_idle(record.p1, now))
}

/// The member a request of level values `values` is at level `l`'s pool:
/// its value one level down, or below the last level its tenant.
fn member_id(levels: usize, l: usize, values: &[Option<Rc<str>>], subject: &Subject) -> u64 {
    let below = l.saturating_add(1);
    let value: &str = if below < levels {
        values.get(below).and_then(|v| v.as_deref()).unwrap_or("")
    } else {
        match subject {
            Subject::Tenant(t) => t,
            Subject::Anonymous { address, .. } => address,
            Subject::None => "",
        }
    };
    FairTable::member_id(value.as_bytes())
}

/// Records that `req` asked level `l`'s pool (limits `limits`, as
/// `pool` charged them or not) and says whether its member may take what
/// the pool admitted. `Fairness::Within` whenever the table cannot be used.
#[allow(clippy::too_many_arguments)]
pub(super) fn ask<H: Host>(
    policy: &Policy,
    req: &Prepared,
    host: &H,
    ctx: &Ctx,
    level: &Level,
    l: usize,
    limits: &[Limit],
    pool: &Applied,
    key: &mut String,
    buffers: &mut table::Buffers,
) -> Fairness {
    let admitted = !pool.denied && pool.failure.is_none();
    let mut pool_limits = [PoolLimit {
        rate: 0,
        per_ns: 0,
        contended: Contended::No,
        window: None,
    }; table::MAX_RECORDS];
    let n = limits.len().min(table::MAX_RECORDS);
    for (i, (p, limit)) in pool_limits.iter_mut().zip(limits).enumerate() {
        let remaining = pool.report.get(i).map_or(0, |s| s.remaining);
        let per_ns = limit.per_secs.saturating_mul(NANOS_PER_SEC);
        *p = if limit.global {
            let interval_ns = ctx.sync.as_ref().map_or(0, |v| v.interval_ns);
            node_share(limit, per_ns, pool, i, interval_ns, admitted)
        } else {
            PoolLimit {
                rate: limit.rate,
                per_ns,
                contended: if admitted && !limit.shadow && remaining < limit.burst / 2 {
                    Contended::Yes
                } else {
                    Contended::No
                },
                window: None,
            }
        };
        p.window = limit.algo.calendar_month(ctx.now);
    }
    let pool_limits = pool_limits.get(..n).unwrap_or(&[]);
    let slowest = pool_limits.iter().map(|p| p.per_ns).max().unwrap_or(0);
    let member = member_id(policy.levels.chain.len(), l, &req.levels, &req.subject);
    write_key(
        key,
        &req.class.action,
        l,
        &policy.levels,
        &req.levels,
        Budget::Fair,
    );
    let place = Place::Table {
        logical: key.as_bytes(),
        entries: policy.key_table_entries,
        overflow: Overflow {
            action: &req.class.action,
            plan: &level.fair_overflow,
        },
    };
    let reach = Reach::Insert {
        is_idle: &super::record_is_idle,
    };
    let updated = table::update(host, &place, &reach, ctx.now, buffers, |records, out| {
        let mut t = records
            .and_then(|rs| rs.iter().find(|r| r.kind == kind::FAIR_TABLE))
            .and_then(|r| FairTable::decode(r.state))
            .filter(|t| t.limits() == n)
            .unwrap_or_else(|| FairTable::fresh(n));
        let share = t.ask(member, ctx.cost, pool_limits, admitted, ctx.now);
        out.push(1);
        push_record_with(out, FAIR_NAME_HASH, kind::FAIR_TABLE, slowest, 0, |o| t.encode(o));
        (Commit::Write, share)
    });
    match updated {
        Ok(u) if u.event != TableEvent::Overflow => u.result,
        Ok(_) => Fairness::Within,
        Err(f) => {
            log::debug!(
                "tenantgate: fairness table of level {} not updated: {f:?}",
                level.name
            );
            Fairness::Within
        }
    }
}

/// What this node last heard of a global limit from the service.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct NodeShare {
    /// Its share, thousandths of a unit per sync interval (0: none yet).
    share_milli: u64,
    /// How full the service's bucket was, thousandths of the burst
    /// (`None`: an older service did not say).
    bucket_milli: Option<u16>,
}

impl NodeShare {
    /// From the node's allowance of the limit.
    pub(super) fn of(a: &Allowance) -> NodeShare {
        NodeShare {
            share_milli: a.share_milli.max(a.share.saturating_mul(1000)),
            bucket_milli: a.bucket_milli,
        }
    }

    /// The service's bucket holds half the burst or more: the pool is not
    /// short, whoever asks on this node.
    fn plenty(&self) -> bool {
        self.bucket_milli
            .is_some_and(|b| u64::from(b).saturating_mul(2) >= FULL_BUCKET_MILLI)
    }
}

/// A global pool limit as this node shares it: the node's share of it
/// (what the service last allocated it, per interval, as a rate per the
/// limit's period), contended while the service's bucket holds less than
/// half its burst (as a local pool) and the members on this node ask more
/// than the node's share. No share yet (no lease): not contended; a
/// service that does not say how full its bucket is: contended whenever
/// they ask more.
fn node_share(
    limit: &Limit,
    per_ns: u64,
    pool: &Applied,
    i: usize,
    interval_ns: u64,
    admitted: bool,
) -> PoolLimit {
    let node = pool.node_shares.get(i).copied().unwrap_or_default();
    let per_period =
        u128::from(node.share_milli) * u128::from(per_ns) / u128::from(interval_ns.max(1)) / 1000;
    PoolLimit {
        rate: u64::try_from(per_period).unwrap_or(u64::MAX).max(1),
        per_ns,
        contended: if admitted && !limit.shadow && node.share_milli > 0 && !node.plenty() {
            Contended::WhenAskedOver
        } else {
            Contended::No
        },
        window: None,
    }
}

/// The refusal of a request over its member's fair share of the pool's
/// limit `limit`, for `wait_ns`: as the pool's own refusal reads, with a
/// `RateLimit` item that has nothing left for it.
pub(super) fn refusal(
    admitted: &Decision,
    level: &Level,
    limit: &Limit,
    wait_ns: u64,
    ctx: &Ctx,
) -> Decision {
    let mut d = admitted.clone();
    d.reason = Reason::RateLimited;
    d.limit = Some(LimitName::Level {
        level: level.name.clone(),
        name: limit.name.clone(),
        fair_share: true,
    });
    d.wait_ns = wait_ns;
    d.retry_after_secs = super::ceil_secs(wait_ns).max(1);
    if ctx.headers {
        let mut ratelimit = String::new();
        RateLimitHeaders::push_item(&mut ratelimit, &limit.name, 0, d.retry_after_secs);
        d.headers = Some(RateLimitHeaders {
            policy: limit.policy_item(),
            ratelimit,
        });
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool limit of 60,000 a minute, global, and a node's share of it.
    fn shared(share_milli: u64, bucket_milli: Option<u16>, admitted: bool) -> Contended {
        let p = Policy::from_json(
            br#"{"version":"fair","identity":{"header":"x-tenant-id"},
            "plans":{"free":{"limits":[{"name":"g","rate":60000,"per":"1m","global":true}]}},
            "default_plan":"free","anonymous":{"plan":"free"},"routes":{"api":{}},
            "sync":{"interval":"1s"}}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let limit = &p.plans()[0].limits[0];
        let mut pool = Applied::new();
        pool.node_shares[0] = NodeShare {
            share_milli,
            bucket_milli,
        };
        let per_ns = 60 * NANOS_PER_SEC;
        let l = node_share(limit, per_ns, &pool, 0, NANOS_PER_SEC, admitted);
        // The capacity is the node's share, per the limit's period.
        assert_eq!(l.rate, (share_milli * 60 / 1000).max(1));
        l.contended
    }

    /// A global pool is short on a node only while the service's bucket
    /// holds less than half its burst (what no node has admitted yet, as
    /// its last lease said): a bucket at half or more refuses nobody
    /// whatever the members on the node ask, as a local pool does. A
    /// service that did not say leaves the node's own rule (its members
    /// asking more than its share).
    #[test]
    fn a_global_pool_is_short_only_while_the_services_bucket_holds_less_than_half() {
        assert_eq!(shared(250_000, Some(1000), true), Contended::No);
        assert_eq!(shared(250_000, Some(500), true), Contended::No);
        assert_eq!(shared(250_000, Some(499), true), Contended::WhenAskedOver);
        assert_eq!(shared(250_000, Some(0), true), Contended::WhenAskedOver);
        assert_eq!(shared(250_000, None, true), Contended::WhenAskedOver);
        // No share yet, or the pool refused the request anyway.
        assert_eq!(shared(0, Some(0), true), Contended::No);
        assert_eq!(shared(250_000, Some(0), false), Contended::No);
    }
}
