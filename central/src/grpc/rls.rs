//! Envoy's rate limit service (RLS, `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`)
//! answered by `tenantgate serve`, for Envoys that run the native
//! `envoy.filters.http.ratelimit` filter: the migration step between
//! envoyproxy/ratelimit and the tenantgate filter (docs/migrating.md).
//!
//! # Semantics
//! A request's descriptors are matched to the policy's `descriptors:` rules
//! by the mapping rule of `tenantgate::policy::descriptors` (that of
//! envoyproxy/ratelimit). A matched rule with a plan is a key (the rule's
//! path × the descriptor's values); every limit of the plan applies to it
//! with the plan's algorithm, through the same function the filter's
//! engine charges a key with (`tenantgate::limiter::charge::check_key`).
//! A descriptor's cost is its own `hits_addend` when set (0: a check that
//! charges nothing, as envoyproxy/ratelimit), else the request's
//! `hits_addend` (0 is "not set" in proto3, and Envoy's proto says an
//! unset value counts 1). A descriptor with `is_negative_hits` gives its
//! cost back to its key's limits instead (Envoy's way to return units: a
//! token bucket never above its burst, a window never below 0), applied
//! before the request's charges in the same update. `replaces` drops a replaced rule's descriptor from the
//! request. Then, unlike envoyproxy/ratelimit (which counts every
//! descriptor's hits even when the request is refused), the request is
//! **all or nothing**: if an enforced limit of any descriptor refuses, the
//! answer is `OVER_LIMIT` and no key is charged; otherwise every key is
//! charged in one atomic update of the store (embedded, or Redis shared by
//! every replica). A shadow limit's refusal is reported (`OK`), never
//! enforced, and so is a soft limit's (`on_limit: soft`: RLS has no
//! "admitted but marked"); `mode: shadow` answers `OK` for everything it would refuse,
//! and `mode: off` answers `OK` without touching state. A descriptor
//! that matches no rule, or an `unlimited` rule, is `OK` (unlimited with
//! `limit_remaining` = 2³²−1, as envoyproxy/ratelimit answers).
//!
//! Each descriptor's status carries the key's binding limit (the refusing
//! one, else the one with least remaining): `current_limit` (its name,
//! `requests_per_unit` and `unit` when its window is one of RLS's units,
//! else `UNKNOWN`), `limit_remaining` and `duration_until_reset`. The
//! response adds `RateLimit-Policy` and `RateLimit` headers (the draft-10
//! syntax the filter sends, `t` as draft-11 defines it and the filter
//! computes it: `tenantgate::decision::t_secs`) for the request's binding
//! limit, which Envoy's filter adds to the client's response.
//!
//! # THE BOUND
//! The service is the only decider of an RLS key and each request's update
//! is atomic in the store, so every limit admits exactly what its
//! algorithm admits (a `fixed_window` of `L`: at most `L` per aligned
//! window, `2L` across a boundary; a token bucket: `burst + rate × d /
//! per` over any `d`), across every Envoy and every replica sharing the
//! store, with no lease or provisional term. What it cannot bound is
//! Envoy's side: when the service is unreachable or slower than the
//! filter's `timeout` (20 ms by default), the filter admits
//! (`failure_mode_deny: false`, its default) or refuses every request
//! (`true`) on its own.
//!
//! # Limits
//! Every value from the network is bounded: a message over 4 MiB
//! (`crate::bounded`'s gRPC message cap) is refused unread (`OUT_OF_RANGE`), one that is not
//! protobuf `INTERNAL`; beyond [`MAX_DESCRIPTORS`], the policy's depth
//! ([`MAX_DEPTH`] entries) or text lengths ([`MAX_TEXT_LEN`] bytes),
//! `INVALID_ARGUMENT`. A cost is at most `u64::MAX` and adds up
//! saturating, so a huge `hits_addend` is refused, never wrapped. A store
//! that fails answers `UNAVAILABLE`, and Envoy applies its failure mode.
//! Envoy's per-descriptor `limit` override is not supported (ignored: the
//! policy decides).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tenantgate::decision::t_secs;
use tenantgate::limiter::charge::{check_key, idle_after_ns, refund_key, KeyCheck, KeyLimit};
use tenantgate::policy::descriptors::{Descriptors, MAX_DEPTH, MAX_TEXT_LEN};
use tenantgate::policy::{Mode, Policy};

use super::counters::Counters;
use crate::clock::Clock;

/// Most descriptors in one request.
pub const MAX_DESCRIPTORS: usize = 64;
const NANOS_PER_SEC: u64 = 1_000_000_000;

/// One limit of a plan, as the RLS answers with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RlsLimit {
    pub name: String,
    pub key: KeyLimit,
    pub rate: u64,
    pub per_secs: u64,
    /// The capacity (a window's is its rate): what RLQS's token buckets
    /// hold together.
    pub burst: u64,
}

/// What the RLS decides with: the policy's rules and its plans' limits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RlsPolicy {
    pub version: String,
    pub mode: Mode,
    pub descriptors: Descriptors,
    /// By plan index (the rules' `plan`).
    pub plans: Vec<Vec<RlsLimit>>,
}

impl RlsPolicy {
    pub fn of(policy: &Policy) -> RlsPolicy {
        RlsPolicy {
            version: policy.version.clone(),
            mode: policy.mode,
            descriptors: policy.descriptors.clone(),
            plans: policy
                .plans()
                .iter()
                .map(|p| {
                    p.limits
                        .iter()
                        .map(|l| RlsLimit {
                            name: l.name.clone(),
                            key: KeyLimit {
                                name_hash: l.name_hash,
                                algo: l.algo,
                                // A soft limit never refuses; RLS has no
                                // "admitted but marked", so it is reported
                                // as a shadow limit is.
                                shadow: l.shadow || l.soft,
                            },
                            rate: l.rate,
                            per_secs: l.per_secs,
                            burst: l.burst,
                        })
                        .collect()
                })
                .collect(),
        }
    }
}

/// Answers by result, for `/metrics`.
#[derive(Debug, Default)]
pub struct RlsMetrics {
    pub ok: AtomicU64,
    pub over_limit: AtomicU64,
    pub invalid: AtomicU64,
    pub unavailable: AtomicU64,
    /// Keys a shadow (or soft) limit would have refused, the request
    /// answered `OK` (envoyproxy/ratelimit's `shadow_mode` stat).
    pub shadow_over_limit: AtomicU64,
}

impl RlsMetrics {
    /// Prometheus text (`tenantgate_rls_requests_total{result}`).
    pub fn render(&self) -> String {
        let mut out = String::from(
            "# HELP tenantgate_rls_requests_total Envoy rate limit service (RLS) answers by result.\n# TYPE tenantgate_rls_requests_total counter\n",
        );
        for (result, n) in [
            ("ok", &self.ok),
            ("over_limit", &self.over_limit),
            ("invalid", &self.invalid),
            ("unavailable", &self.unavailable),
        ] {
            out.push_str(&format!(
                "tenantgate_rls_requests_total{{result=\"{result}\"}} {}\n",
                n.load(Relaxed)
            ));
        }
        out.push_str(&format!(
            "# HELP tenantgate_rls_shadow_over_limit_total Keys a shadow or soft limit would have refused (answered OK).\n# TYPE tenantgate_rls_shadow_over_limit_total counter\ntenantgate_rls_shadow_over_limit_total {}\n",
            self.shadow_over_limit.load(Relaxed)
        ));
        out
    }
}

/// The rate limit service of one replica.
pub struct Rls {
    counters: Arc<dyn Counters>,
    clock: Arc<dyn Clock>,
    in_force: super::PolicyInForce,
    pub metrics: RlsMetrics,
}

/// One key of a request: its records' name, its limits, its cost, and
/// the units its negative descriptors give back.
struct KeyWork<'a> {
    key: String,
    limits: &'a [RlsLimit],
    cost: u64,
    refund: u64,
}

/// A matched descriptor's units: charged, or (`is_negative_hits`) given back.
#[derive(Clone, Copy)]
struct Hits {
    units: u64,
    negative: bool,
}

/// How a descriptor of the request was matched.
enum Matched {
    None,
    Unlimited,
    /// Index into the request's keys.
    Key(usize),
}

impl Rls {
    pub fn new(counters: Arc<dyn Counters>, clock: Arc<dyn Clock>) -> Rls {
        Rls {
            counters,
            clock,
            in_force: Default::default(),
            metrics: RlsMetrics::default(),
        }
    }

    /// Puts a policy in force (a reload of the same rules keeps its epoch).
    pub fn set_policy(&self, policy: RlsPolicy) {
        self.in_force.set(policy, self.clock.now_ns());
    }

    fn in_force(&self) -> (Arc<RlsPolicy>, u64) {
        self.in_force.get()
    }

    /// Decides one request (see the module header).
    pub async fn decide(&self, req: &RateLimitRequest) -> Result<RateLimitResponse, tonic::Status> {
        let (policy, effective_from) = self.in_force();
        if let Err(why) = check_bounds(req) {
            self.metrics.invalid.fetch_add(1, Relaxed);
            return Err(tonic::Status::invalid_argument(why));
        }
        if policy.mode == Mode::Off {
            self.metrics.ok.fetch_add(1, Relaxed);
            return Ok(ok_response(req.descriptors.len()));
        }
        let (matched, keys) = match_request(&policy, req);
        tracing::debug!(domain = %req.domain, hits_addend = req.hits_addend, descriptors = ?req.descriptors, keys = keys.len(), "RLS request");
        let now = self.clock.now_ns();
        let mut checks: Vec<KeyCheck> = Vec::new();
        let names: Vec<String> = keys.iter().map(|k| k.key.clone()).collect();
        // Records live until every limit of theirs is back to fresh, and 1 s
        // more (the store's clock is not ours).
        let ttl = keys
            .iter()
            .map(|k| idle_after_ns(&k.limits.iter().map(|l| l.key).collect::<Vec<_>>()))
            .max()
            .map_or(Duration::from_secs(1), |ns| {
                Duration::from_nanos(ns).saturating_add(Duration::from_secs(1))
            });
        let mut decide = |stored: &[Option<Vec<u8>>]| {
            checks = keys
                .iter()
                .zip(stored)
                .map(|(k, s)| {
                    let limits: Vec<KeyLimit> = k.limits.iter().map(|l| l.key).collect();
                    if k.refund == 0 {
                        return check_key(s.as_deref(), &limits, effective_from, now, k.cost);
                    }
                    let back = refund_key(s.as_deref(), &limits, effective_from, now, k.refund);
                    check_key(Some(&back), &limits, effective_from, now, k.cost)
                })
                .collect();
            if checks.iter().any(|c| c.denied) {
                None
            } else {
                Some(checks.iter().map(|c| c.charged.clone()).collect())
            }
        };
        if let Err(e) = self.counters.update(&names, ttl, now, &mut decide).await {
            self.metrics.unavailable.fetch_add(1, Relaxed);
            return Err(tonic::Status::unavailable(format!("rate limit state: {e}")));
        }
        let shadowed = checks.iter().filter(|c| c.shadow_denied).count();
        self.metrics
            .shadow_over_limit
            .fetch_add(u64::try_from(shadowed).unwrap_or(u64::MAX), Relaxed);
        let response = respond(&policy, &matched, &keys, &checks);
        if response.overall_code == Code::OverLimit as i32 {
            self.metrics.over_limit.fetch_add(1, Relaxed);
        } else {
            self.metrics.ok.fetch_add(1, Relaxed);
        }
        Ok(response)
    }
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        self.decide(request.get_ref()).await.map(tonic::Response::new)
    }
}

fn check_bounds(req: &RateLimitRequest) -> Result<(), String> {
    if req.domain.is_empty() || req.domain.len() > MAX_TEXT_LEN {
        return Err(format!("the domain must be 1 to {MAX_TEXT_LEN} bytes"));
    }
    if req.descriptors.len() > MAX_DESCRIPTORS {
        return Err(format!("at most {MAX_DESCRIPTORS} descriptors"));
    }
    for d in &req.descriptors {
        if d.entries.len() > MAX_DEPTH {
            return Err(format!("at most {MAX_DEPTH} entries per descriptor"));
        }
        if d.entries
            .iter()
            .any(|e| e.key.len() > MAX_TEXT_LEN || e.value.len() > MAX_TEXT_LEN)
        {
            return Err(format!("keys and values are at most {MAX_TEXT_LEN} bytes"));
        }
    }
    Ok(())
}

/// Each descriptor's match, and the request's keys (a key two descriptors
/// share counts once, with their costs added).
fn match_request<'p>(policy: &'p RlsPolicy, req: &RateLimitRequest) -> (Vec<Matched>, Vec<KeyWork<'p>>) {
    let request_cost = u64::from(req.hits_addend.max(1));
    let found: Vec<_> = req
        .descriptors
        .iter()
        .map(|d| {
            let entries: Vec<(&str, &str)> = d
                .entries
                .iter()
                .map(|e| (e.key.as_str(), e.value.as_str()))
                .collect();
            let hits = Hits {
                units: d.hits_addend.as_ref().map_or(request_cost, |h| h.value),
                negative: d.is_negative_hits,
            };
            policy.descriptors.find(&req.domain, &entries).map(|f| (f, hits))
        })
        .collect();
    let replaced: Vec<&str> = found
        .iter()
        .flatten()
        .flat_map(|(f, _)| f.rule.replaces.iter().map(String::as_str))
        .collect();
    let mut keys: Vec<KeyWork<'p>> = Vec::new();
    let mut index: BTreeMap<String, usize> = BTreeMap::new();
    let matched = found
        .into_iter()
        .map(|f| {
            let Some((f, hits)) = f else {
                return Matched::None;
            };
            if f.rule.name.as_deref().is_some_and(|n| replaced.contains(&n)) {
                return Matched::None;
            }
            let Some(limits) = f.rule.plan.and_then(|p| policy.plans.get(p)) else {
                return Matched::Unlimited;
            };
            let key = super::record_key(&f.rule.path, &f.tenant);
            let i = *index.entry(key.clone()).or_insert_with(|| {
                keys.push(KeyWork {
                    key,
                    limits,
                    cost: 0,
                    refund: 0,
                });
                keys.len() - 1
            });
            if let Some(k) = keys.get_mut(i) {
                if hits.negative {
                    k.refund = k.refund.saturating_add(hits.units);
                } else {
                    k.cost = k.cost.saturating_add(hits.units);
                }
            }
            Matched::Key(i)
        })
        .collect();
    (matched, keys)
}

fn ok_response(descriptors: usize) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: Code::Ok as i32,
        statuses: (0..descriptors)
            .map(|_| DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// A key's binding limit: the refusing enforced one with the longest wait,
/// else the one with the least remaining.
fn binding(limits: &[RlsLimit], check: &KeyCheck) -> Option<usize> {
    let refusing = check
        .standings
        .iter()
        .zip(limits)
        .enumerate()
        .filter(|(_, (s, l))| s.refused_for_ns.is_some() && !l.key.shadow)
        .max_by_key(|(_, (s, _))| s.refused_for_ns)
        .map(|(i, _)| i);
    refusing.or_else(|| {
        check
            .standings
            .iter()
            .enumerate()
            .min_by_key(|(_, s)| s.remaining)
            .map(|(i, _)| i)
    })
}

/// RLS's unit of a window, as envoyproxy/ratelimit divides time
/// (`UNKNOWN` for any other window).
fn unit_of(per_secs: u64) -> Unit {
    match per_secs {
        1 => Unit::Second,
        60 => Unit::Minute,
        3_600 => Unit::Hour,
        86_400 => Unit::Day,
        604_800 => Unit::Week,
        2_592_000 => Unit::Month,
        31_536_000 => Unit::Year,
        _ => Unit::Unknown,
    }
}

fn duration(ns: u64) -> envoy_types::pb::google::protobuf::Duration {
    envoy_types::pb::google::protobuf::Duration {
        seconds: i64::try_from(ns / NANOS_PER_SEC).unwrap_or(i64::MAX),
        nanos: i32::try_from(ns % NANOS_PER_SEC).unwrap_or(0),
    }
}

fn respond(
    policy: &RlsPolicy,
    matched: &[Matched],
    keys: &[KeyWork<'_>],
    checks: &[KeyCheck],
) -> RateLimitResponse {
    let denied = checks.iter().any(|c| c.denied);
    let enforce = policy.mode == Mode::Enforce;
    let mut headline: Option<(&RlsLimit, u64, u64, bool)> = None;
    let statuses = matched
        .iter()
        .map(|m| match m {
            Matched::None => DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            },
            Matched::Unlimited => DescriptorStatus {
                code: Code::Ok as i32,
                limit_remaining: u32::MAX,
                ..Default::default()
            },
            Matched::Key(i) => {
                let (Some(k), Some(c)) = (keys.get(*i), checks.get(*i)) else {
                    return DescriptorStatus::default();
                };
                let Some(b) = binding(k.limits, c) else {
                    return DescriptorStatus::default();
                };
                let (Some(limit), Some(s)) = (k.limits.get(b), c.standings.get(b)) else {
                    return DescriptorStatus::default();
                };
                let refuses = c.denied && enforce;
                // Admitted requests report the charged standing; a denied
                // request charged nothing, and reports the standing before.
                let remaining = if denied && s.refused_for_ns.is_none() {
                    s.remaining.saturating_add(k.cost)
                } else {
                    s.remaining
                };
                let rank = (refuses, u64::MAX - remaining);
                if headline.is_none_or(|(_, r, _, was)| rank > (was, u64::MAX - r)) {
                    headline = Some((limit, remaining, t_secs(remaining, s.t_ns), refuses));
                }
                let unit = unit_of(limit.per_secs);
                DescriptorStatus {
                    code: if refuses { Code::OverLimit } else { Code::Ok } as i32,
                    current_limit: Some(RateLimit {
                        name: limit.name.clone(),
                        requests_per_unit: u32::try_from(limit.rate).unwrap_or(u32::MAX),
                        unit: unit as i32,
                    }),
                    limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
                    duration_until_reset: Some(duration(s.reset_ns)),
                    quota: None,
                }
            }
        })
        .collect();
    let mut response_headers_to_add = Vec::new();
    if let Some((limit, remaining, t, _)) = headline {
        let header = |key: &str, value: String| HeaderValue {
            key: key.to_owned(),
            value,
            ..Default::default()
        };
        response_headers_to_add.push(header(
            "ratelimit-policy",
            format!("\"{}\";q={};w={}", limit.name, limit.rate, limit.per_secs),
        ));
        response_headers_to_add.push(header(
            "ratelimit",
            format!("\"{}\";r={};t={}", limit.name, remaining, t),
        ));
    }
    RateLimitResponse {
        overall_code: if denied && enforce {
            Code::OverLimit
        } else {
            Code::Ok
        } as i32,
        statuses,
        response_headers_to_add,
        ..Default::default()
    }
}
