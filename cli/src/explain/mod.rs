//! `tenantgate policy explain` and `tenantgate policy diff`: what a policy
//! does to one request, and what a reload does to live state. Both read the
//! filter's own compiled [`Policy`]; `explain` decides the request with the
//! filter's engine over the in-memory host (`tenantgate::memory`) at a fixed
//! instant, and `diff` classifies each limit with [`Algo::carry_from`], the
//! rule the engine's state loader applies. Nothing here re-implements a
//! decision; the output is plain text, one fact per line, stable for golden
//! tests (every listing is sorted).

mod diff;

use std::fmt::Write;
use std::rc::Rc;

use tenantgate::engine::{self, Subject};
use tenantgate::limiter::algo::Algo;
use tenantgate::memory::{MemoryHost, SharedStore};
use tenantgate::policy::{FailureMode, Identity, Limit, OnLimit, Policy};

pub use diff::diff;

/// The instant `explain` decides at (2026-01-01T00:00:00Z, in ns): any
/// instant gives the same first request, this one keeps output stable.
const EXPLAIN_NOW_NS: u64 = 1_767_225_600_000_000_000;
/// The connection address of an anonymous request when `--source` is not given.
pub const DEFAULT_SOURCE: &str = "192.0.2.10:40000";

/// One request to explain.
pub struct Request<'a> {
    pub tenant: Option<&'a str>,
    pub class: &'a str,
    /// Extra request headers (`--header k=v`).
    pub headers: &'a [(String, String)],
    /// The connection's address (`ip:port`), for anonymous requests.
    pub source: &'a str,
}

fn algorithm(algo: &Algo) -> &'static str {
    match algo {
        Algo::TokenBucket(_) => "token_bucket",
        Algo::FixedWindow(_) => "fixed_window",
        Algo::SlidingWindowLog(_) => "sliding_window_log",
        Algo::SlidingWindowCounter(_) => "sliding_window_counter",
    }
}

fn failure_mode(mode: FailureMode) -> &'static str {
    match mode {
        FailureMode::FailOpenLocal => "fail_open_local",
        FailureMode::FailClosed => "fail_closed",
        FailureMode::FailOpen => "fail_open",
    }
}

fn limit_line(l: &Limit) -> String {
    let mut line = format!(
        "{} {} {} per {} s, burst {}",
        l.name,
        algorithm(&l.algo),
        l.rate,
        l.per_secs,
        l.burst
    );
    line.push_str(if l.global {
        ", global"
    } else {
        ", local (this node)"
    });
    if l.shadow {
        line.push_str(", shadow (counted, never denies)");
    }
    line
}

fn on_limit(o: OnLimit) -> String {
    match o {
        OnLimit::Reject => String::from("reject"),
        OnLimit::Queue {
            max_wait_ns,
            max_queue,
        } => format!(
            "queue (max wait {} ms, at most {max_queue} held per worker)",
            max_wait_ns / 1_000_000
        ),
    }
}

fn join(names: &[&String]) -> String {
    names.iter().map(|n| n.as_str()).collect::<Vec<_>>().join(", ")
}

fn mode(p: &Policy) -> String {
    format!("{:?}", p.mode).to_lowercase()
}

/// How the policy decides `req`, as text.
pub fn explain(policy: &Policy, req: &Request<'_>) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "policy: {} (mode {})", policy.version, mode(policy));

    let store = SharedStore::new();
    let mut host = MemoryHost::new(Rc::clone(&store))
        .route_class(req.class)
        .source(req.source);
    for (k, v) in req.headers {
        host = host.header(k, v.as_bytes());
    }
    if let Some(t) = req.tenant {
        host = match &policy.identity {
            Identity::Header(h) => host.header(h, t.as_bytes()),
            id @ Identity::JwtClaim { .. } => match id.property_path() {
                Some(path) => host.property(&path, t.as_bytes()),
                None => host,
            },
        };
    }

    // Class.
    let named = policy
        .route_class(Some(req.class))
        .filter(|c| c.name == req.class);
    let class = policy.route_class(Some(req.class));
    match (named, class) {
        (Some(c), _) => {
            let _ = writeln!(
                out,
                "class: {} (from the route's metadata filter_metadata.tenantgate.class, or its route name)",
                c.name
            );
        }
        (None, Some(c)) => {
            let _ = writeln!(
                out,
                "class: {} (default_route: {:?} is not a class)",
                c.name, req.class
            );
        }
        (None, None) => {
            let _ = writeln!(
                out,
                "class: none ({:?} is not a class and there is no default_route): the request passes unlimited (reason unclassified)",
                req.class
            );
            return out;
        }
    }
    let Some(class) = class else { return out };
    let _ = writeln!(out, "  action: {}", class.action);
    let _ = writeln!(out, "  cost: {}", class.cost);
    let _ = writeln!(out, "  on limit: {}", on_limit(class.on_limit));
    explain_admission(policy, class, &mut out);

    // Identity and plan, as the engine resolves them.
    let prepared = match engine::prepare(policy, &host) {
        Ok(p) => p,
        Err(reason) => {
            let _ = writeln!(
                out,
                "decision: passes without limits (reason {})",
                reason.as_str()
            );
            return out;
        }
    };
    let source = match &policy.identity {
        Identity::Header(h) => format!("header {h}"),
        Identity::JwtClaim {
            filter,
            payload_in_metadata,
            claim,
        } => format!("JWT claim {claim} (metadata {filter}.{payload_in_metadata})"),
    };
    let plan_name = policy.plan(prepared.plan).map_or("?", |p| p.name.as_str());
    match &prepared.subject {
        Subject::Tenant(t) => {
            let _ = writeln!(out, "identity: tenant {t} (from the {source})");
            let listed = policy.tenants().any(|(id, _)| id == &**t);
            let why = if listed {
                "tenant directory"
            } else {
                "default_plan"
            };
            let _ = writeln!(out, "plan: {plan_name} ({why})");
        }
        Subject::Anonymous {
            address,
            invalid_identity,
        } => {
            let why = if *invalid_identity {
                "the identity is not a valid tenant id"
            } else {
                "no identity"
            };
            let _ = writeln!(
                out,
                "identity: anonymous, client {address} (from the {source}: {why})"
            );
            let _ = writeln!(out, "plan: {plan_name} (anonymous.plan)");
        }
        Subject::None => {}
    }
    let _ = writeln!(
        out,
        "limit key: {}",
        engine::logical_key(&class.action, &prepared.subject)
    );

    // Limits.
    let _ = writeln!(out, "limits (all must admit; charged all or nothing):");
    let sync_mode = policy.sync.as_ref().map(|s| s.failure_mode);
    if let Some(plan) = policy.plan(prepared.plan) {
        for l in &plan.limits {
            let _ = write!(out, "  {}, cost {}", limit_line(l), class.cost);
            if l.global {
                let (mode, from) = match (class.failure_mode, sync_mode) {
                    (Some(m), _) => (Some(m), "the route class"),
                    (None, m) => (m, "sync.failure_mode"),
                };
                if let Some(m) = mode {
                    let _ = write!(out, ", failure mode {} ({from})", failure_mode(m));
                }
            }
            let _ = writeln!(out);
        }
    }
    match class.guard.and_then(|g| policy.guard(g)) {
        Some(g) => {
            let _ = writeln!(
                out,
                "guard: {} (one aggregate per node, every tenant of the class)",
                g.name
            );
            for l in &g.limits {
                let _ = writeln!(out, "  {}, cost {}", limit_line(l), class.cost);
            }
        }
        None => {
            let _ = writeln!(out, "guard: none");
        }
    }

    // The first request, decided by the engine.
    let mut scratch = engine::Scratch::default();
    let d = engine::charge(policy, &prepared, &host, EXPLAIN_NOW_NS, &mut scratch);
    let global = policy
        .plan(prepared.plan)
        .is_some_and(|p| p.limits.iter().any(|l| l.global));
    let _ = writeln!(
        out,
        "first request (the engine over the fake host, empty state{}):",
        if global {
            "; global limits: a node with no lease yet, on its provisional units"
        } else {
            ""
        }
    );
    match d.deny_status() {
        Some(status) => {
            let _ = writeln!(out, "  status: {status} (reason {})", d.reason.as_str());
            let _ = writeln!(out, "  x-tenantgate-reason: {}", d.reason.as_str());
            if let Some(l) = &d.limit {
                let _ = writeln!(out, "  limit: {}", l.problem_name());
            }
            let _ = writeln!(out, "  retry-after: {}", d.retry_after_secs);
        }
        None => {
            let _ = writeln!(out, "  decision: passes (reason {})", d.reason.as_str());
        }
    }
    match (&d.headers, policy.ratelimit_headers) {
        (Some(h), true) => {
            let _ = writeln!(out, "  ratelimit-policy: {}", h.policy);
            let _ = writeln!(out, "  ratelimit: {}", h.ratelimit);
        }
        _ => {
            let _ = writeln!(out, "  (no RateLimit headers)");
        }
    }
    out
}

/// The class's admission labels, when it has any (see docs/admission.md).
fn explain_admission(policy: &Policy, class: &tenantgate::policy::RouteClass, out: &mut String) {
    use tenantgate::policy::admission::Criticality;
    let l = class.labels;
    if l == tenantgate::policy::admission::Labels::default() {
        return;
    }
    let _ = writeln!(
        out,
        "  admission: criticality {}{}{}",
        l.criticality.as_str(),
        if l.retryable { ", retryable" } else { "" },
        if l.streaming { ", streaming" } else { "" }
    );
    let action = l.action_limit.and_then(|i| policy.action_limit(i));
    if let Some(a) = action {
        let _ = writeln!(
            out,
            "  action limit: {} (max_in_flight {}, node-wide, every class of the action; 503 concurrency_limit when full)",
            a.name, a.max_in_flight
        );
    }
    match l.dependency.and_then(|i| policy.dependency(i)) {
        None if action.is_some() => {
            let _ = writeln!(out, "  dependency: none");
        }
        None => {
            let _ = writeln!(out, "  dependency: none (no in-flight limit)");
        }
        Some(d) => {
            let general = u64::from(d.general());
            let uses = if l.streaming {
                format!("a stream slot of max_streams {}", d.max_streams.unwrap_or(0))
            } else {
                match l.criticality {
                    Criticality::System => format!(
                        "reserved.system ({}) then the pool ({general})",
                        d.reserved_system
                    ),
                    Criticality::Critical => {
                        format!(
                            "reserved.critical ({}) then the pool ({general})",
                            d.reserved_critical
                        )
                    }
                    level => format!(
                        "the pool up to {} of {general} (shed before higher levels)",
                        tenantgate::admission::ceiling(general, level, l.retryable)
                    ),
                }
            };
            let share = d.tenant_max.map_or_else(
                || String::from("no cap per tenant"),
                |n| format!("at most {n} per tenant"),
            );
            let queue = d.queues.get(l.criticality.index()).copied().unwrap_or_default();
            let queue = if queue.max_queue == 0 {
                String::from("refused at once when full (503 concurrency_limit)")
            } else {
                format!(
                    "held when full, up to {} per worker for at most {} ms",
                    queue.max_queue,
                    queue.max_wait_ns / 1_000_000
                )
            };
            let _ = writeln!(
                out,
                "  dependency: {} (max_in_flight {}, node-wide): uses {uses}; {share}; {queue}",
                d.name, d.max_in_flight
            );
        }
    }
    if l.max_body_bytes.is_some() || l.min_timeout_budget_ns.is_some() {
        let body = l.max_body_bytes.map_or_else(
            || String::from("any body size"),
            |n| format!("body at most {n} bytes (413)"),
        );
        let budget = l.min_timeout_budget_ns.map_or_else(
            || String::from("no timeout budget"),
            |ns| {
                format!(
                    "at least {} ms of timeout left (503 timeout_budget)",
                    ns / 1_000_000
                )
            },
        );
        let _ = writeln!(out, "  request checks: {body}; {budget}");
    }
}
