//! The per-request decision: classify → identify → limit.
//!
//! Pure: everything from the proxy comes through [`Host`], time comes in as
//! `now` (nanoseconds since the Unix epoch, from the host's wall clock).

use crate::host::{CasResult, Host};
use crate::limiter::{Check, NANOS_PER_SEC};
use crate::policy::{
    self, Mode, Plan, Policy, RouteClass, MAX_LIMITS_PER_PLAN, ROUTE_METADATA_CLASS_FIELD,
    ROUTE_METADATA_NAMESPACE,
};
use crate::state;

/// How many times a request re-reads and retries its compare-and-swap
/// before giving up. When the bound is hit the request is denied with
/// [`Reason::Contention`] (503) and counted: never a silent allow.
pub const MAX_CAS_ATTEMPTS: u32 = 16;

/// Why a request got its verdict; `as_str` is the stable machine-readable
/// reason (the `x-tenantgate-reason` header, the problem body, stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Within every limit.
    Allowed,
    /// Over a limit: 429.
    RateLimited,
    /// Over a limit in shadow mode: allowed, counted.
    ShadowLimited,
    /// The route has no class and the policy has no `default_route`.
    Unclassified,
    /// `mode: off`.
    Disabled,
    /// The CAS bound was exhausted: 503.
    Contention,
    /// Shared data could not be read or written: 503.
    StateUnavailable,
}

impl Reason {
    pub const ALL: [Reason; 7] = [
        Reason::Allowed,
        Reason::RateLimited,
        Reason::ShadowLimited,
        Reason::Unclassified,
        Reason::Disabled,
        Reason::Contention,
        Reason::StateUnavailable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Allowed => "allowed",
            Reason::RateLimited => "rate_limited",
            Reason::ShadowLimited => "shadow_limited",
            Reason::Unclassified => "unclassified",
            Reason::Disabled => "disabled",
            Reason::Contention => "contention",
            Reason::StateUnavailable => "state_unavailable",
        }
    }

    /// The HTTP status of a denial, `None` if the request goes on.
    pub fn deny_status(self) -> Option<u32> {
        match self {
            Reason::RateLimited => Some(429),
            Reason::Contention | Reason::StateUnavailable => Some(503),
            _ => None,
        }
    }
}

/// Who the request was counted against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// Not looked up (unclassified or disabled).
    None,
    Tenant(String),
    /// No usable identity: grouped by client address.
    Anonymous {
        address: String,
        invalid_identity: bool,
    },
}

/// The `RateLimit` / `RateLimit-Policy` field values (draft-10 syntax).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitHeaders {
    pub policy: String,
    pub ratelimit: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub reason: Reason,
    pub subject: Subject,
    /// The denying (or would-be denying) limit's name.
    pub limit: Option<String>,
    /// Whole seconds until the request would be admitted (denials only).
    pub retry_after_secs: u64,
    pub headers: Option<RateLimitHeaders>,
    /// CAS conflicts this request retried through.
    pub cas_retries: u32,
}

impl Decision {
    fn pass(reason: Reason, subject: Subject) -> Decision {
        Decision {
            reason,
            subject,
            limit: None,
            retry_after_secs: 0,
            headers: None,
            cas_retries: 0,
        }
    }

    /// The host could not give the time or state needed to decide: 503.
    pub fn unavailable() -> Decision {
        Decision {
            retry_after_secs: 1,
            ..Decision::pass(Reason::StateUnavailable, Subject::None)
        }
    }

    /// The status of the local reply, if the request is denied.
    pub fn deny_status(&self) -> Option<u32> {
        self.reason.deny_status()
    }
}

/// Property path of the route's class in its `filter_metadata`.
pub const ROUTE_CLASS_PROPERTY: [&str; 5] = [
    "xds",
    "route_metadata",
    "filter_metadata",
    ROUTE_METADATA_NAMESPACE,
    ROUTE_METADATA_CLASS_FIELD,
];
/// Property path of the route's name (what Istio users can set).
pub const ROUTE_NAME_PROPERTY: [&str; 2] = ["xds", "route_name"];
/// Property path of the downstream address (`ip:port`).
pub const SOURCE_ADDRESS_PROPERTY: [&str; 2] = ["source", "address"];

/// Decides one request. `scratch` is reused for the encoded state.
pub fn decide<H: Host>(policy: &Policy, host: &H, now: u64, scratch: &mut Vec<u8>) -> Decision {
    if policy.mode == Mode::Off {
        return Decision::pass(Reason::Disabled, Subject::None);
    }
    let Some(class) = classify(policy, host) else {
        return Decision::pass(Reason::Unclassified, Subject::None);
    };
    let (subject, plan_index) = identify(policy, host);
    let Some(plan) = policy.plan(plan_index) else {
        // Unreachable by construction (compile checks every reference);
        // pass rather than trap if it ever were.
        return Decision::pass(Reason::Unclassified, subject);
    };
    let key = state_key(&class.action, &subject);
    let shadow = policy.mode == Mode::Shadow;
    let effective_from = policy.effective_from_ns.min(now);
    let mut decision = limit(plan, class.cost, &key, host, now, effective_from, scratch, shadow);
    decision.subject = subject;
    decision
}

/// The route class from trusted route metadata, else the route name, else
/// the policy's default class. Nothing the client sends is consulted.
fn classify<'p, H: Host>(policy: &'p Policy, host: &H) -> Option<&'p RouteClass> {
    let name = host
        .property(&ROUTE_CLASS_PROPERTY)
        .or_else(|| host.property(&ROUTE_NAME_PROPERTY));
    policy.route_class(name.as_deref().and_then(|b| core::str::from_utf8(b).ok()))
}

fn identify<H: Host>(policy: &Policy, host: &H) -> (Subject, usize) {
    let raw = match &policy.identity {
        policy::Identity::Header(name) => host.request_header(name),
        id @ policy::Identity::JwtClaim { .. } => id.property_path().and_then(|p| host.property(&p)),
    };
    if let Some(id) = raw.as_deref().and_then(policy::tenant_id) {
        return (Subject::Tenant(id.to_owned()), policy.plan_of_tenant(id));
    }
    let invalid_identity = raw.is_some_and(|r| !r.is_empty());
    let address = host
        .property(&SOURCE_ADDRESS_PROPERTY)
        .and_then(|a| client_ip(&a).map(str::to_owned))
        .unwrap_or_else(|| String::from("unknown"));
    (
        Subject::Anonymous {
            address,
            invalid_identity,
        },
        policy.anonymous_plan(),
    )
}

/// The IP part of Envoy's `ip:port` / `[v6]:port` address text.
pub fn client_ip(address: &[u8]) -> Option<&str> {
    let text = core::str::from_utf8(address).ok()?;
    let ip = if let Some(rest) = text.strip_prefix('[') {
        rest.split(']').next()?
    } else if text.bytes().filter(|b| *b == b':').count() == 1 {
        text.split(':').next()?
    } else {
        text
    };
    let plausible = !ip.is_empty()
        && ip.len() <= 64
        && ip
            .bytes()
            .all(|b| b.is_ascii_hexdigit() || b == b'.' || b == b':');
    plausible.then_some(ip)
}

/// The shared-data key of one (subject × action). Actions are names (no
/// `|`), tenant ids have no whitespace, addresses are hex, dots and colons.
pub fn state_key(action: &str, subject: &Subject) -> String {
    match subject {
        Subject::Tenant(id) => format!("tg1|{action}|t|{id}"),
        Subject::Anonymous { address, .. } => format!("tg1|{action}|a|{address}"),
        Subject::None => format!("tg1|{action}|-"),
    }
}

fn ceil_secs(ns: u64) -> u64 {
    ns.div_ceil(NANOS_PER_SEC)
}

/// Checks and charges every limit of `plan` at once: admitted only if all
/// admit, and then all are charged with one compare-and-swap.
#[allow(clippy::too_many_arguments)]
fn limit<H: Host>(
    plan: &Plan,
    cost: u64,
    key: &str,
    host: &H,
    now: u64,
    effective_from: u64,
    scratch: &mut Vec<u8>,
    shadow: bool,
) -> Decision {
    let n = plan.limits.len().min(MAX_LIMITS_PER_PLAN);
    let limits = &plan.limits[..n];
    let mut outcome = Decision::pass(Reason::Allowed, Subject::None);
    for attempt in 0..MAX_CAS_ATTEMPTS {
        outcome.cas_retries = attempt;
        let Ok((value, cas)) = host.shared_get(key) else {
            outcome.reason = Reason::StateUnavailable;
            outcome.retry_after_secs = 1;
            return outcome;
        };
        let stored = value.as_deref().and_then(state::decode).unwrap_or_default();

        let mut new_tats = [0u64; MAX_LIMITS_PER_PLAN];
        let mut remaining = [0u64; MAX_LIMITS_PER_PLAN];
        // The limit that needs the longest wait binds the denial.
        let mut binding: Option<(usize, u64)> = None;
        // Whether the state read differs from the state stored: a clock
        // step backwards was forgiven or a reload migrated a limit.
        let mut changed = false;
        for (i, l) in limits.iter().enumerate() {
            let (stored_tat, migrated) = state::tat_for(l, &stored, effective_from);
            let tat = l.gcra.saturate(stored_tat, now);
            changed |= migrated || tat != stored_tat;
            match l.gcra.check(tat, now, cost) {
                Check::Admit {
                    new_tat,
                    remaining: r,
                } => {
                    new_tats[i] = new_tat;
                    remaining[i] = r;
                }
                Check::Deny { wait_ns } => {
                    if binding.is_none_or(|(_, w)| wait_ns > w) {
                        binding = Some((i, wait_ns));
                    }
                    new_tats[i] = tat;
                    remaining[i] = l.gcra.available(tat, now);
                }
            }
        }

        if let Some((i, wait_ns)) = binding {
            let l = &limits[i];
            outcome.reason = if shadow {
                Reason::ShadowLimited
            } else {
                Reason::RateLimited
            };
            outcome.limit = Some(l.name.clone());
            outcome.retry_after_secs = ceil_secs(wait_ns).max(1);
            outcome.headers = Some(RateLimitHeaders {
                policy: format!("\"{}\";q={};w={}", l.name, l.rate, l.per_secs),
                ratelimit: format!(
                    "\"{}\";r={};t={}",
                    l.name,
                    remaining[i],
                    ceil_secs(l.gcra.time_to_full_ns(new_tats[i], now))
                ),
            });
            // Nothing is charged for a denied request. A migrated or
            // forgiven state is persisted (best effort: a conflict means
            // another worker wrote a fresher state).
            if changed {
                state::encode(limits, &new_tats[..n], scratch);
                let _ = host.shared_set(key, scratch, cas);
            }
            return outcome;
        }

        state::encode(limits, &new_tats[..n], scratch);
        match host.shared_set(key, scratch, cas) {
            Ok(CasResult::Written) => {
                outcome.headers = Some(RateLimitHeaders {
                    policy: plan.ratelimit_policy.clone(),
                    ratelimit: limits
                        .iter()
                        .enumerate()
                        .map(|(i, l)| {
                            format!(
                                "\"{}\";r={};t={}",
                                l.name,
                                remaining[i],
                                ceil_secs(l.gcra.time_to_full_ns(new_tats[i], now))
                            )
                        })
                        .collect::<Vec<_>>()
                        .join(", "),
                });
                return outcome;
            }
            Ok(CasResult::Conflict) => continue,
            Err(_) => {
                outcome.reason = Reason::StateUnavailable;
                outcome.retry_after_secs = 1;
                return outcome;
            }
        }
    }
    outcome.reason = Reason::Contention;
    outcome.cas_retries = MAX_CAS_ATTEMPTS;
    outcome.retry_after_secs = 1;
    outcome
}

#[cfg(test)]
mod tests;
