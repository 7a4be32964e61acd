//! The self-service limits endpoint (`limits_endpoint:` in the policy, off
//! when absent): a request whose path (without its query) is the
//! endpoint's is answered by the filter itself, never counted against any
//! limit and never sent upstream, with the calling tenant's own limits:
//! for every API action of the policy, every limit of the tenant's plan,
//! with what it has left, when it is whole again, its quota and window,
//! as JSON and as the draft-10 `RateLimit` / `RateLimit-Policy` headers
//! (one item per action and limit, named `<action>/<limit>`).
//!
//! **A tenant sees only its own keys**: the caller is identified exactly as
//! for charging ([`crate::engine::identify`]: the trusted identity, else
//! its anonymous address group), so nothing it sends can name another
//! tenant. With nested levels (`levels:`), its own levels too, each read
//! from its trusted source as for charging (one item per level limit, with
//! its `level`): what the caller may use of it in all, its ceiling or its
//! member's guaranteed share plus the pool, so a user sees its own
//! organisation and team, never another's. What is reported is this node's: a local limit's entry plus the
//! units this worker holds in a lease of it, a global limit's allowance on
//! this node (`"global": true`: what the node knows, not the whole
//! cluster's). It reads shared data once per action and writes nothing.

use std::collections::BTreeSet;
use std::rc::Rc;

use serde::Serialize;

use super::{Clock, Directive, Pipeline};
use crate::decision::Subject;
use crate::engine;
use crate::host::Host;
use crate::limiter::NANOS_PER_SEC;
use crate::policy::Policy;
use crate::response::{LocalReply, RATELIMIT_HEADER, RATELIMIT_POLICY_HEADER};
use crate::stats::Metric;

#[derive(Serialize)]
struct Answer<'a> {
    tenant: Option<&'a str>,
    anonymous: Option<&'a str>,
    plan: &'a str,
    policy_version: &'a str,
    limits: Vec<Item<'a>>,
}

#[derive(Serialize)]
struct Item<'a> {
    action: &'a str,
    /// The nested level (`levels:`) this limit is of; absent for the plan's.
    #[serde(skip_serializing_if = "Option::is_none")]
    level: Option<String>,
    limit: String,
    quota: u64,
    window_secs: u64,
    remaining: u64,
    reset_secs: u64,
    global: bool,
    /// The `RateLimit` header's `t` (`crate::decision::t_secs`).
    #[serde(skip)]
    t_secs: u64,
}

/// Whether a request path (`:path`, its query ignored) is the endpoint's.
pub fn is_endpoint(policy: &Policy, path: Option<&[u8]>) -> bool {
    let (Some(endpoint), Some(path)) = (policy.limits_endpoint.as_deref(), path) else {
        return false;
    };
    let path = path.split(|b| *b == b'?').next().unwrap_or_default();
    path == endpoint.as_bytes()
}

impl Pipeline {
    /// Answers the limits endpoint for the calling tenant (see the module
    /// header): 200 with its limits, or 503 `state_unavailable` if shared
    /// data or the clock could not be read.
    pub(super) fn answer_limits<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        policy: &Rc<Policy>,
    ) -> Directive {
        let (subject, plan_index) = engine::identify(policy, host);
        let values = engine::identify_levels(policy, host, &subject);
        let (Some(now), Some(plan)) = (clock.now(), policy.plan(plan_index)) else {
            return unavailable(policy);
        };
        let actions: BTreeSet<&str> = policy.route_classes().map(|c| c.action.as_str()).collect();
        let mut limits = Vec::new();
        for action in actions {
            let view = self.view(policy);
            let key = engine::KeyOf {
                action,
                subject: &subject,
                plan: plan_index,
            };
            let Some(peeked) = engine::peek(policy, &key, host, now, view.as_ref(), &mut self.scratch) else {
                return unavailable(policy);
            };
            let leased = self.leases.held(policy, action, &subject);
            for (l, p) in plan.limits.iter().zip(peeked) {
                let remaining = p.remaining.saturating_add(if l.global { 0 } else { leased });
                limits.push(Item {
                    action,
                    level: None,
                    limit: l.name.clone(),
                    quota: l.rate,
                    window_secs: l.per_secs,
                    remaining,
                    reset_secs: p.reset_ns.div_ceil(NANOS_PER_SEC),
                    global: l.global,
                    t_secs: crate::decision::t_secs(remaining, p.t_ns),
                });
            }
            let Some(levels) = engine::peek_levels(policy, action, &values, host, now, &mut self.scratch)
            else {
                return unavailable(policy);
            };
            for l in levels {
                limits.push(Item {
                    action,
                    level: Some(l.level.to_string()),
                    limit: l.limit,
                    quota: l.quota,
                    window_secs: l.window_secs,
                    remaining: l.peeked.remaining,
                    reset_secs: l.peeked.reset_ns.div_ceil(NANOS_PER_SEC),
                    global: false,
                    t_secs: crate::decision::t_secs(l.peeked.remaining, l.peeked.t_ns),
                });
            }
        }
        let (tenant, anonymous) = match &subject {
            Subject::Tenant(t) => (Some(&**t), None),
            Subject::Anonymous { address, .. } => (None, Some(&**address)),
            Subject::None => (None, None),
        };
        let ratelimit_policy = join(&limits, |i| {
            format!("\"{}/{}\";q={};w={}", i.action, i.limit, i.quota, i.window_secs)
        });
        let ratelimit = join(&limits, |i| {
            format!("\"{}/{}\";r={};t={}", i.action, i.limit, i.remaining, i.t_secs)
        });
        let body = serde_json::to_vec(&Answer {
            tenant,
            anonymous,
            plan: &plan.name,
            policy_version: &policy.version,
            limits,
        })
        .unwrap_or_default();
        self.pending.rare(Metric::LimitsAnswered);
        Directive::reply(
            LocalReply {
                status: 200,
                headers: vec![
                    ("content-type".into(), String::from("application/json")),
                    ("cache-control".into(), String::from("no-store")),
                    (RATELIMIT_POLICY_HEADER.into(), ratelimit_policy),
                    (RATELIMIT_HEADER.into(), ratelimit),
                ],
                body,
            },
            None,
        )
    }
}

fn join(items: &[Item<'_>], f: impl Fn(&Item<'_>) -> String) -> String {
    items.iter().map(f).collect::<Vec<_>>().join(", ")
}

/// The endpoint could not read what it reports.
fn unavailable(policy: &Policy) -> Directive {
    let decision = crate::decision::Decision::unavailable();
    match crate::response::local_reply(&decision, &policy.version, false, None) {
        Some(reply) => Directive::reply(reply, None),
        None => Directive::go(),
    }
}
