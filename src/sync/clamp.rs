//! What a node applies from a sync answer, clamped to what the policy
//! allows: the service decides each node's allowance, but never beyond
//! what the limit itself could grant one node.
//!
//! # The bounds
//! After [`answer`], whatever a `200` answer carried (a bug, version skew,
//! an impostor or compromised service):
//! * `interval_ms` is within the bounds of `sync.interval`
//!   ([`MIN_SYNC_INTERVAL_NS`] to [`MAX_SYNC_INTERVAL_NS`]: 100 ms to 10 min);
//! * a lease's `tokens` are at most the limit's `burst`: every lease is
//!   carved out of the service's bucket for the limit, which never holds
//!   more than `burst` (`tenantgate-central`'s `alloc`: `b + Σ R_i ≤ B`);
//! * a lease's `share` and its outage allowance (`outage_milli`) are at
//!   most the limit's flow per interval, `ceil(rate × interval / per)` for
//!   the (clamped) interval of the answer: the service never hands out
//!   allowances summing above that flow;
//! * a lease's `ttl_ms` is at most `sync`'s maximum TTL (ten intervals);
//! * a lease's `bucket_milli` (how full the service's bucket is) is at
//!   most 1,000 (a full bucket).
//!
//! So one answer can make a node admit at most `burst` on its lease plus
//! one flow per interval locally (`fail_open_local`) per (key, limit), and
//! never stop it reporting for more than 10 min. A correct service never
//! exceeds these bounds, so clamping changes nothing it sends; every value
//! clamped is counted (the glue's `sync.clamped`).
//!
//! A limit name used by global limits of several plans is bounded by the
//! largest burst and flow among them (the service itself allocates by the
//! strictest). A lease for a name that is no global limit of the policy is
//! left alone: it is never applied.

use hashbrown::HashMap;

use super::protocol::{Lease, SyncResponse, FULL_BUCKET_MILLI};
use crate::limiter::NANOS_PER_SEC;
use crate::policy::{Policy, SyncSettings, MAX_SYNC_INTERVAL_NS, MIN_SYNC_INTERVAL_NS};

const NANOS_PER_MS: u64 = 1_000_000;

/// What one global limit allows a single node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseBound {
    pub burst: u64,
    /// `rate` units per `per_ns` nanoseconds.
    pub rate: u64,
    pub per_ns: u64,
}

impl LeaseBound {
    /// The limit's flow over `interval_ns`, rounded up (at least 1 for a
    /// positive rate): the largest share a node may be given.
    pub fn flow_per(&self, interval_ns: u64) -> u64 {
        let units = u128::from(self.rate) * u128::from(interval_ns);
        let flow = units.div_ceil(u128::from(self.per_ns.max(1)));
        u64::try_from(flow).unwrap_or(u64::MAX)
    }

    /// The bound for both of two limits of the same name: the larger.
    fn widen(self, other: LeaseBound) -> LeaseBound {
        let faster = u128::from(other.rate) * u128::from(self.per_ns)
            > u128::from(self.rate) * u128::from(other.per_ns);
        let (rate, per_ns) = if faster {
            (other.rate, other.per_ns)
        } else {
            (self.rate, self.per_ns)
        };
        LeaseBound {
            burst: self.burst.max(other.burst),
            rate,
            per_ns,
        }
    }
}

/// The sync interval an answer may set, in milliseconds, and whether it
/// was clamped.
pub fn interval_ms(ms: u64) -> (u64, bool) {
    let clamped = ms.clamp(
        MIN_SYNC_INTERVAL_NS / NANOS_PER_MS,
        MAX_SYNC_INTERVAL_NS / NANOS_PER_MS,
    );
    (clamped, clamped != ms)
}

/// Clamps one lease (see the module header); returns how many of its
/// values were clamped.
pub fn lease(lease: &mut Lease, bound: &LeaseBound, interval_ns: u64, max_ttl_ms: u64) -> u32 {
    let mut clamped = 0;
    for (value, max) in [
        (&mut lease.tokens, bound.burst),
        (&mut lease.share, bound.flow_per(interval_ns)),
        (
            &mut lease.share_milli,
            bound.flow_per(interval_ns).saturating_mul(1000),
        ),
        (&mut lease.ttl_ms, max_ttl_ms),
    ]
    .into_iter()
    .chain(
        lease
            .outage_milli
            .as_mut()
            .map(|v| (v, bound.flow_per(interval_ns).saturating_mul(1000))),
    )
    .chain(lease.bucket_milli.as_mut().map(|v| (v, FULL_BUCKET_MILLI)))
    {
        if *value > max {
            *value = max;
            clamped += 1;
        }
    }
    clamped
}

/// Every global limit's bound, by limit name.
pub fn bounds(policy: &Policy) -> HashMap<&str, LeaseBound> {
    let mut out: HashMap<&str, LeaseBound> = HashMap::new();
    for l in policy
        .plans()
        .iter()
        .flat_map(|p| p.limits.iter())
        .filter(|l| l.global)
    {
        let b = LeaseBound {
            burst: l.burst,
            rate: l.rate,
            per_ns: l.per_secs.saturating_mul(NANOS_PER_SEC),
        };
        out.entry(l.name.as_str())
            .and_modify(|old| *old = old.widen(b))
            .or_insert(b);
    }
    out
}

/// Clamps a decoded answer in place (see the module header); returns how
/// many values were clamped.
pub fn answer(policy: &Policy, settings: &SyncSettings, resp: &mut SyncResponse) -> u32 {
    let (interval, interval_clamped) = interval_ms(resp.interval_ms);
    resp.interval_ms = interval;
    let mut clamped = u32::from(interval_clamped);
    let interval_ns = interval.saturating_mul(NANOS_PER_MS);
    let max_ttl_ms = settings.max_ttl_ns / NANOS_PER_MS;
    let bounds = bounds(policy);
    for l in &mut resp.leases {
        if let Some(b) = bounds.get(l.limit.as_str()) {
            clamped = clamped.saturating_add(lease(l, b, interval_ns, max_ttl_ms));
        }
    }
    clamped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::PROTOCOL_VERSION;

    const S: u64 = NANOS_PER_SEC;

    fn policy(plans: &str) -> Policy {
        Policy::from_json(
            format!(
                r#"{{"version":"clamp","identity":{{"header":"x-tenant-id"}},"plans":{plans},
                "default_plan":"free","anonymous":{{"plan":"free"}},"routes":{{"api":{{}}}},
                "sync":{{"interval":"1s"}}}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn global(rate: u64, per: &str, burst: u64) -> String {
        format!(
            r#"{{"free":{{"limits":[{{"name":"g","rate":{rate},"per":"{per}","burst":{burst},"global":true}}]}}}}"#
        )
    }

    fn lease_of(tokens: u64, share: u64, ttl_ms: u64) -> Lease {
        Lease {
            key: "api|t|a".into(),
            limit: "g".into(),
            tokens,
            share,
            share_milli: 0,
            ttl_ms,
            outage_milli: None,
            bucket_milli: None,
        }
    }

    fn answer_of(interval_ms: u64, leases: Vec<Lease>) -> SyncResponse {
        SyncResponse {
            version: PROTOCOL_VERSION,
            ack_seq: 1,
            interval_ms,
            leases,
        }
    }

    #[test]
    fn absurd_values_are_clamped_to_the_burst_the_flow_the_max_ttl_and_the_interval_bounds() {
        // 10,000/min, burst 500, syncing every second: flow 167 per interval.
        let p = policy(&global(10_000, "1m", 500));
        let settings = p.sync.clone().unwrap();
        let mut resp = answer_of(u64::MAX, vec![lease_of(u64::MAX, u64::MAX, u64::MAX)]);
        assert_eq!(answer(&p, &settings, &mut resp), 4);
        assert_eq!(resp.interval_ms, 600_000, "10 min at most");
        let l = &resp.leases[0];
        assert_eq!(l.tokens, 500, "the burst");
        // At the clamped interval of 10 min: the whole 100,000 flow.
        assert_eq!(l.share, 100_000);
        assert_eq!(l.ttl_ms, 10_000, "ten intervals of the policy's 1 s");

        let mut resp = answer_of(1, vec![lease_of(501, 2, 10_001)]);
        assert_eq!(answer(&p, &settings, &mut resp), 3);
        assert_eq!(resp.interval_ms, 100, "100 ms at least");
        // 10,000/min over 100 ms is 16.67: 17.
        assert_eq!(resp.leases[0], lease_of(500, 2, 10_000));
        let mut over = answer_of(100, vec![lease_of(5, 18, 1_000)]);
        assert_eq!(answer(&p, &settings, &mut over), 1);
        assert_eq!(over.leases[0].share, 17);
        // The outage allowance: at most the flow per interval (167 units
        // at 1 s), in thousandths.
        let mut outage = answer_of(
            1_000,
            vec![Lease {
                outage_milli: Some(u64::MAX),
                ..lease_of(5, 1, 1_000)
            }],
        );
        assert_eq!(answer(&p, &settings, &mut outage), 1);
        assert_eq!(outage.leases[0].outage_milli, Some(167_000));
        // How full the service's bucket is: at most full.
        let mut bucket = answer_of(
            1_000,
            vec![Lease {
                bucket_milli: Some(u64::MAX),
                ..lease_of(5, 1, 1_000)
            }],
        );
        assert_eq!(answer(&p, &settings, &mut bucket), 1);
        assert_eq!(bucket.leases[0].bucket_milli, Some(FULL_BUCKET_MILLI));
    }

    #[test]
    fn what_a_correct_service_sends_is_left_alone_and_not_counted() {
        let p = policy(&global(100, "1m", 100));
        let settings = p.sync.clone().unwrap();
        // 100/min every second: 1.67 per interval, so a share of 2 is fine.
        let sent = answer_of(1_000, vec![lease_of(100, 2, 3_000)]);
        let mut resp = sent.clone();
        assert_eq!(answer(&p, &settings, &mut resp), 0);
        assert_eq!(resp, sent);
        // A limit smaller than one unit per interval still gets one.
        assert_eq!(
            LeaseBound {
                burst: 1,
                rate: 7,
                per_ns: 86_400 * S
            }
            .flow_per(S),
            1
        );
        // A lease for a name that is no global limit is never applied: left alone.
        let mut other = answer_of(
            1_000,
            vec![Lease {
                limit: "nosuch".into(),
                ..lease_of(u64::MAX, u64::MAX, u64::MAX)
            }],
        );
        assert_eq!(answer(&p, &settings, &mut other), 0);
    }

    #[test]
    fn a_name_shared_by_several_plans_is_bounded_by_the_largest() {
        let plans = r#"{"free":{"limits":[{"name":"g","rate":100,"per":"1s","burst":50,"global":true}]},
            "paid":{"limits":[{"name":"g","rate":60000,"per":"1m","burst":20,"global":true}]}}"#;
        let p = policy(plans);
        let b = bounds(&p)["g"];
        assert_eq!(b.burst, 50);
        assert_eq!(b.flow_per(S), 1_000, "60,000/min beats 100/s");
    }
}
