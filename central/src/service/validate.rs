//! Intake: what the service accepts from a node before the allocator sees
//! it. Everything a node sends is bounded here, so that no value from the
//! network can make the allocator's work or state grow without bound, or
//! overflow.
//!
//! # Refused (answered `4xx`, nothing counted, no state changed)
//! * a body over [`IntakeLimits::max_body_bytes`] (`413`, before parsing);
//! * more than [`IntakeLimits::max_reports`] reports (the node's own
//!   maximum, `tenantgate::sync::shared::MAX_REPORTS`);
//! * a key over [`MAX_KEY_BYTES`] or a node id, region, limit or policy
//!   version over [`MAX_NAME_BYTES`] (the node's keys are at most 255
//!   bytes: its key table stores their length in one byte);
//! * a region not in the configured list ([`IntakeLimits::regions`]) or not
//!   the one the node's identity names;
//! * a count above [`MAX_COUNT`] (2^53: no node admits that many, and the
//!   allocator's demand average is exact below it);
//! * a `node_id` other than the one the node's identity names (`403`).
//!
//! # Clamped (answered, counted in `tenantgate_sync_clamped_total`)
//! A report's `consumed`, `unleased` and `demand` are cumulative since the
//! node's last acknowledged report. For a limit of `L` per window `W` with
//! burst `B`, an honest node cannot admit more than the burst plus the
//! refill over the longest it can go without an acknowledgement (its lease
//! life plus its local fallback, `D + ttl + local_max`, with the `D` and
//! `local_max` the node reports, see `alloc::NodeTerms`), so each count is
//! clamped to
//!
//! ```text
//!     plausible = SLACK · (B + L · ⌈(W + D + ttl + local_max) / W⌉)      SLACK = 4
//! ```
//!
//! The slack covers clock rates, a burst per window, and demand (which
//! counts denied requests too: above the whole flow it cannot change the
//! max-min split). A node in `fail_open` past that can admit more than the
//! plausible count; what it admits beyond it is not charged (that failure
//! mode's overrun is unbounded anyway, see the allocator's bound). Reports
//! naming a limit the policy does not know get no lease and are left as
//! they are.
//!
//! `unleased > consumed` is refused by the protocol itself.

use crate::listener::Identity;
use std::collections::BTreeSet;

use tenantgate::sync::SyncRequest;

use crate::alloc::{AllocConfig, NodeTerms};

/// The longest key a report may name, in bytes.
pub const MAX_KEY_BYTES: usize = 255;

/// The longest node id, region, limit name or policy version, in bytes.
pub const MAX_NAME_BYTES: usize = 128;

/// The largest count a report may carry (see the module header).
pub const MAX_COUNT: u64 = 1 << 53;

/// The plausibility slack (see the module header).
pub const SLACK: u64 = 4;

/// Defaults of [`IntakeLimits`] (each defined once; docs/central-service.md and docs/security.md list them).
pub const DEFAULT_MAX_BODY_BYTES: usize = 2 * 1024 * 1024;
pub const DEFAULT_MAX_REPORTS: usize = 4096;
pub use crate::listener::DEFAULT_MAX_IN_FLIGHT;

/// What the service accepts per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntakeLimits {
    /// The largest sync body (bytes). 4096 reports of the longest keys fit.
    pub max_body_bytes: usize,
    /// The most reports in one request.
    pub max_reports: usize,
    /// The most sync requests worked on at once; beyond, `503`.
    pub max_in_flight: usize,
    /// The regions nodes may report from (`None`: any, unless the node's
    /// identity names one).
    pub regions: Option<BTreeSet<String>>,
}

impl Default for IntakeLimits {
    fn default() -> IntakeLimits {
        IntakeLimits {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_reports: DEFAULT_MAX_REPORTS,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            regions: None,
        }
    }
}

/// Defaults of [`StateLimits`].
pub const DEFAULT_MAX_SESSIONS: u64 = 100_000;
pub const DEFAULT_MAX_KEYS: u64 = 1_000_000;

/// How long a node's session lives after its last applied request: longer
/// than any lease and local fallback (`D + ttl + local_max + settle`,
/// 68.5 s with the defaults, with the `D` and `local_max` each node
/// reports), so a session never expires while anything it counted can
/// still matter. Fifteen minutes.
pub const DEFAULT_SESSION_IDLE_NS: u64 = 900 * 1_000_000_000;

/// How much state the service keeps. Beyond a cap, a new node (`429`,
/// counted) or a new (key, limit) (no lease, counted) is refused; what is
/// already kept is served as before. The caps are checked against the
/// counts as last seen, so requests in flight together may pass them by a
/// few each.
///
/// Expiry (by the timer's sweep): a session after [`StateLimits::session_idle_ns`]
/// with no applied request (a node back after that starts a new session,
/// its counts taken whole); a (key, limit) record as soon as it holds
/// nothing a new record would not (no node, whose entries go
/// `D + ttl + max(settle, local_max)` after their last grant; a full bucket;
/// no debt), which changes no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateLimits {
    /// The most node sessions.
    pub max_sessions: u64,
    /// The most (key, limit) records.
    pub max_keys: u64,
    /// A session expires this long after its node's last applied request
    /// (at least `D + ttl + local_max + settle`; raised to that if lower).
    pub session_idle_ns: u64,
}

impl Default for StateLimits {
    fn default() -> StateLimits {
        StateLimits {
            max_sessions: DEFAULT_MAX_SESSIONS,
            max_keys: DEFAULT_MAX_KEYS,
            session_idle_ns: DEFAULT_SESSION_IDLE_NS,
        }
    }
}

/// Why a request was refused before the allocator saw it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("{0}")]
    Invalid(String),
    /// The request names another node (or region) than its identity.
    #[error("{0}")]
    Identity(String),
}

fn too_long(what: &str, value: &str, max: usize) -> Result<(), Refusal> {
    if value.len() > max {
        return Err(Refusal::Invalid(format!(
            "{what} is {} bytes (at most {max})",
            value.len()
        )));
    }
    Ok(())
}

/// Checks a parsed request against the limits and the sender's identity.
pub fn check(req: &SyncRequest, limits: &IntakeLimits, identity: Option<&Identity>) -> Result<(), Refusal> {
    if req.reports.len() > limits.max_reports {
        return Err(Refusal::Invalid(format!(
            "{} reports in one request (at most {})",
            req.reports.len(),
            limits.max_reports
        )));
    }
    too_long("node_id", &req.node_id, MAX_NAME_BYTES)?;
    too_long("region", &req.region, MAX_NAME_BYTES)?;
    too_long("policy_version", &req.policy_version, MAX_NAME_BYTES)?;
    for r in &req.reports {
        too_long("a report's key", &r.key, MAX_KEY_BYTES)?;
        too_long("a report's limit", &r.limit, MAX_NAME_BYTES)?;
        if r.consumed.max(r.unleased).max(r.demand) > MAX_COUNT {
            return Err(Refusal::Invalid(format!(
                "a report's count is above {MAX_COUNT}: no node admits that many"
            )));
        }
    }
    if let Some(id) = identity {
        if req.node_id != id.node_id {
            return Err(Refusal::Identity(format!(
                "node_id {:?} is not this client's identity ({:?})",
                req.node_id, id.node_id
            )));
        }
        if let Some(region) = &id.region {
            if &req.region != region {
                return Err(Refusal::Identity(format!(
                    "region {:?} is not this client's region ({region:?})",
                    req.region
                )));
            }
        }
    }
    if let Some(regions) = &limits.regions {
        if !regions.contains(&req.region) {
            return Err(Refusal::Invalid(format!(
                "region {:?} is not one of the configured regions",
                req.region
            )));
        }
    }
    Ok(())
}

/// The most a report may carry for `limit` from a node that enforces
/// `terms` (see the module header).
pub fn plausible(cfg: &AllocConfig, terms: &NodeTerms, limit: &crate::GlobalLimit) -> u64 {
    let span = u128::from(limit.window_ns)
        .saturating_add(u128::from(terms.lease_life_ns(cfg)))
        .saturating_add(u128::from(terms.local_max_ns));
    let windows = span.div_ceil(u128::from(limit.window_ns.max(1)));
    let refill = u128::from(limit.limit).saturating_mul(windows);
    let total = refill
        .saturating_add(u128::from(limit.burst))
        .saturating_mul(u128::from(SLACK));
    u64::try_from(total).unwrap_or(u64::MAX)
}

/// Clamps every count to what is plausible for its limit; returns how many
/// values were clamped.
pub fn clamp(req: &mut SyncRequest, cfg: &AllocConfig) -> u64 {
    let mut clamped = 0u64;
    let (terms, _) = cfg.terms_of(req);
    for r in &mut req.reports {
        let Some(limit) = cfg.limits.get(&r.limit) else {
            continue;
        };
        let max = plausible(cfg, &terms, limit);
        for v in [&mut r.consumed, &mut r.unleased, &mut r.demand] {
            if *v > max {
                *v = max;
                clamped = clamped.saturating_add(1);
            }
        }
    }
    clamped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::{PolicyLimits, Settings};
    use crate::GlobalLimit;
    use tenantgate::sync::{Report, PROTOCOL_VERSION};

    fn cfg() -> AllocConfig {
        let limit = GlobalLimit {
            limit: 100,
            window_ns: 60_000_000_000,
            burst: 100,
            max_cost: 1,
            month: 0,
        };
        Settings::default().alloc_config(&PolicyLimits {
            version: "v".into(),
            limits: [("per-min".to_owned(), limit)].into_iter().collect(),
            sync: None,
            ambiguous: vec![],
            quotas: Default::default(),
            rls: Default::default(),
        })
    }

    fn req(reports: Vec<Report>) -> SyncRequest {
        SyncRequest {
            version: PROTOCOL_VERSION,
            node_id: "n1".into(),
            region: "eu".into(),
            policy_version: "v".into(),
            seq: 1,
            boot: 0,
            acked_seq: 0,
            reports,
            settings: None,
        }
    }

    fn report(key: &str, n: u64) -> Report {
        Report {
            key: key.into(),
            limit: "per-min".into(),
            consumed: n,
            unleased: n,
            demand: n,
            failure_mode: None,
            started_ms: None,
        }
    }

    #[test]
    fn overflowing_counts_are_clamped_to_the_plausible() {
        let c = cfg();
        // 100/min, burst 100, W + D + ttl + local_max = 123.5 s (the
        // filter's local_max, 60 s): 3 windows.
        let max = plausible(&c, &c.terms(), &c.limits["per-min"]);
        assert_eq!(max, 4 * (100 + 100 * 3));
        // A node that reports a longer fallback may report more.
        let longer = NodeTerms {
            local_max_ns: 300_000_000_000,
            ..c.terms()
        };
        assert_eq!(plausible(&c, &longer, &c.limits["per-min"]), 4 * (100 + 100 * 7));
        let mut r = req(vec![report("t|a", MAX_COUNT), report("t|b", 10)]);
        assert!(check(&r, &IntakeLimits::default(), None).is_ok());
        assert_eq!(clamp(&mut r, &c), 3);
        assert_eq!(r.reports[0].consumed, max);
        assert_eq!(r.reports[1].consumed, 10);
    }

    #[test]
    fn sizes_regions_and_identity_are_checked() {
        let limits = IntakeLimits {
            regions: Some(["eu".to_owned()].into_iter().collect()),
            ..IntakeLimits::default()
        };
        assert!(check(&req(vec![report("t|a", 1)]), &limits, None).is_ok());
        let overflowing = req(vec![report("t|a", u64::MAX)]);
        assert!(matches!(
            check(&overflowing, &limits, None),
            Err(Refusal::Invalid(_))
        ));
        let many = req((0..4097).map(|i| report(&format!("t{i}"), 1)).collect());
        assert!(matches!(check(&many, &limits, None), Err(Refusal::Invalid(_))));
        let long = req(vec![report(&"k".repeat(256), 1)]);
        assert!(matches!(check(&long, &limits, None), Err(Refusal::Invalid(_))));
        let mut elsewhere = req(vec![]);
        elsewhere.region = "us".into();
        assert!(matches!(
            check(&elsewhere, &limits, None),
            Err(Refusal::Invalid(_))
        ));
        let other = Identity {
            node_id: "n2".into(),
            region: None,
        };
        assert!(matches!(
            check(&req(vec![]), &limits, Some(&other)),
            Err(Refusal::Identity(_))
        ));
        let in_us = Identity {
            node_id: "n1".into(),
            region: Some("us".into()),
        };
        assert!(matches!(
            check(&req(vec![]), &limits, Some(&in_us)),
            Err(Refusal::Identity(_))
        ));
    }
}
