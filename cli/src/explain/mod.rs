//! `tenantgate policy explain` and `tenantgate policy diff`: what a policy
//! does to one request, and what a reload does to live state. Both read the
//! filter's own compiled [`Policy`]. `explain` decides the request at a
//! fixed instant over the in-memory host (`tenantgate::memory`): with the
//! filter's engine for a class without admission checks, with the filter's
//! whole request pipeline (`tenantgate::pipeline`) for a class with them,
//! then runs that pipeline through admission scenarios ([`admission`]).
//! `diff` ([`diff()`]) classifies each limit with the rule the engine's state
//! loader applies. Nothing here re-implements a decision; the output is
//! plain text, one fact per line, stable for golden tests (every listing is
//! sorted, time and ids are fixed).

mod admission;
mod diff;
mod levels;

use std::cell::RefCell;
use std::fmt::Write;
use std::rc::Rc;

use tenantgate::engine::{self, Prepared, Subject};
use tenantgate::limiter::algo::Algo;
use tenantgate::memory::{MemoryHost, SharedStore};
use tenantgate::policy::levels::LevelSource;
use tenantgate::policy::settle::{Estimate, Source, WEIGHT_SCALE};
use tenantgate::policy::spec::OnMissing;
use tenantgate::policy::{FailureMode, Identity, Limit, OnLimit, Policy, RouteClass};

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
    /// The request's value at nested levels, `level=value` (`--level`):
    /// set where each level reads it (its header or its claim).
    pub levels: &'a [(String, String)],
}

impl Request<'_> {
    /// This request's view of the in-memory host over `store`, as a request
    /// of `class` from `tenant` (the request's own headers and source).
    fn host(
        &self,
        policy: &Policy,
        store: &Rc<RefCell<SharedStore>>,
        class: &str,
        tenant: Option<&str>,
    ) -> MemoryHost {
        let mut host = MemoryHost::new(Rc::clone(store))
            .route_class(class)
            .source(self.source);
        for (k, v) in self.headers {
            host = host.header(k, v.as_bytes());
        }
        // A class that settles its cost: a request of its metered operation.
        if let Some(s) = policy.route_class(Some(class)).and_then(|c| c.settle.as_ref()) {
            if let Some(m) = s.methods.first() {
                host = host.header(":method", m.as_bytes());
            }
            let path = s.paths.first().map_or("/", String::as_str);
            host = host.header(":path", path.as_bytes());
        }
        for (name, value) in self.levels {
            let Some(level) = policy.levels.chain.iter().find(|l| &*l.name == name) else {
                continue;
            };
            host = match &level.source {
                LevelSource::Header(h) => host.header(h, value.as_bytes()),
                claim => match claim.property_path() {
                    Some(path) => host.property(&path, value.as_bytes()),
                    None => host,
                },
            };
        }
        let Some(t) = tenant else { return host };
        match &policy.identity {
            Identity::Header(h) => host.header(h, t.as_bytes()),
            id @ Identity::JwtClaim { .. } => match id.property_path() {
                Some(path) => host.property(&path, t.as_bytes()),
                None => host,
            },
        }
    }
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
    let per = match &l.algo {
        Algo::FixedWindow(w) => w
            .calendar_zone()
            .map(|zone| match (zone.name(), zone.fixed_offset()) {
                (Some(name), _) => format!("calendar month ({name})"),
                (None, off) => {
                    let off = off.unwrap_or(0);
                    let (sign, off) = if off < 0 { ('-', -off) } else { ('+', off) };
                    format!(
                        "calendar month (UTC{sign}{:02}:{:02})",
                        off / 3600,
                        off % 3600 / 60
                    )
                }
            }),
        _ => None,
    }
    .unwrap_or_else(|| format!("{} s", l.per_secs));
    let mut line = format!(
        "{} {} {} per {per}, burst {}",
        l.name,
        algorithm(&l.algo),
        l.rate,
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
    if l.soft {
        line.push_str(", soft (over it: admitted uncharged, marked for a fallback route)");
    }
    if l.max_debt > 0 {
        let _ = write!(line, ", may owe {} after the response", l.max_debt);
    }
    line
}

/// A settling class's reserve and settle rule (see `tenantgate::cost`).
fn settle_lines(policy: &Policy, class: &RouteClass, out: &mut String) {
    let Some(s) = &class.settle else { return };
    let estimate = match &s.estimate {
        Estimate::Cost => String::from("the cost"),
        Estimate::Header(h) => format!("the request header {h} (from a trusted hop), else the cost"),
        Estimate::BodyField { name: f, .. } => format!(
            "the cost on the request headers, then the request body's {f} when it passes (the difference charged, 429 if it does not fit, or given back)"
        ),
    };
    let _ = writeln!(
        out,
        "  reserve: {estimate}, cut to the ceiling {} and to the smallest burst of the request's limits; charged on the exact path (no worker lease)",
        s.ceiling
    );
    let source = match &s.source {
        Source::Header(h) => format!("the response header {h}"),
        Source::Trailer(t) => format!("the response trailer {t}"),
        Source::Body(fields) => {
            let mut sum = String::new();
            for (i, f) in fields.iter().enumerate() {
                let w = f.weight_milli as f64 / WEIGHT_SCALE as f64;
                let term = if f.weight_milli == WEIGHT_SCALE {
                    f.name.clone()
                } else {
                    format!("{w} × {}", f.name)
                };
                let sign = match (i, f.negative) {
                    (0, false) => "",
                    (0, true) => "− ",
                    (_, false) => " + ",
                    (_, true) => " − ",
                };
                let optional = if f.optional { " (0 if absent)" } else { "" };
                let _ = write!(sum, "{sign}{term}{optional}");
            }
            format!(
                "the response body's {sum} (JSON, or the last value in a text/event-stream; at most {} bytes read, rounded up)",
                s.max_body_bytes
            )
        }
    };
    if let Some(model) = &s.price {
        let _ = writeln!(
            out,
            "  price: {model} (prices {}): the figure, the estimate, the ceiling and every limit the class is charged against count micro-{}",
            policy.prices.version, policy.prices.currency
        );
    }
    let missing = match s.on_missing {
        OnMissing::Ceiling => format!("the ceiling ({})", s.ceiling),
        OnMissing::Estimate => String::from("the estimate (nothing more)"),
    };
    let _ = writeln!(
        out,
        "  settle: at the response's end, {source}, cut to the ceiling {}; the difference to the estimate charged (into debt up to each limit's max_debt, the rest written off) or given back, to every limit charged",
        s.ceiling
    );
    let _ = writeln!(
        out,
        "  no usable figure (missing, malformed, too large): {missing}; a stream cut before its response ended: the ceiling ({})",
        s.ceiling
    );
    let paths = if s.paths.is_empty() {
        String::from("any path")
    } else {
        s.paths.join(", ")
    };
    let _ = writeln!(
        out,
        "  metered: {} on {paths}; other requests pass charged nothing",
        s.methods.join(", ")
    );
    let o = &s.outcomes;
    let _ = writeln!(
        out,
        "  by outcome: upstream 5xx {}, upstream 4xx {}, Envoy's local reply {}, no response {}",
        o.upstream_5xx.as_str(),
        o.upstream_4xx.as_str(),
        o.local_reply.as_str(),
        o.no_response.as_str()
    );
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

/// How the policy decides `req`, as text: its class, identity and plan,
/// key, limits and guard, then the first request (and, for a class with
/// admission checks, the admission scenarios). `json`: the policy's plugin
/// configuration, which the pipeline is configured with, as Envoy's is.
pub fn explain(policy: &Policy, json: &str, req: &Request<'_>) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "policy: {} (mode {})", policy.version, mode(policy));
    let Some(class) = explain_class(policy, req, &mut out) else {
        return out;
    };
    let store = SharedStore::new();
    let host = req.host(policy, &store, req.class, req.tenant);
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
    explain_identity(policy, &prepared, &mut out);
    explain_limits(policy, class, &prepared, &mut out);
    levels::explain(policy, &prepared, &mut out);
    if class.labels.checks_anything() {
        admission::explain(json, req, &mut out);
    } else {
        first_request(policy, &prepared, &host, &mut out);
        levels::first_refusal(policy, &prepared, &host, &mut out);
    }
    out
}

/// The request's route class and its labels (`None`: it has none, and
/// passes unlimited).
fn explain_class<'p>(policy: &'p Policy, req: &Request<'_>, out: &mut String) -> Option<&'p RouteClass> {
    let Some(class) = policy.route_class(Some(req.class)) else {
        let _ = writeln!(
            out,
            "class: none ({:?} is not a class and there is no default_route): the request passes unlimited (reason unclassified)",
            req.class
        );
        return None;
    };
    let _ = if class.name == req.class {
        writeln!(
            out,
            "class: {} (from the route's metadata filter_metadata.tenantgate.class, or its route name)",
            class.name
        )
    } else {
        writeln!(
            out,
            "class: {} (default_route: {:?} is not a class)",
            class.name, req.class
        )
    };
    let _ = writeln!(out, "  action: {}", class.action);
    if class.settle.is_some() {
        let _ = writeln!(
            out,
            "  cost: {} (an estimate: settled after the response)",
            class.cost
        );
    } else {
        let _ = writeln!(out, "  cost: {}", class.cost);
    }
    settle_lines(policy, class, out);
    let _ = writeln!(out, "  on limit: {}", on_limit(class.on_limit));
    admission::labels(policy, class, out);
    Some(class)
}

/// The identity and plan, as the engine resolved them, and the limit key.
fn explain_identity(policy: &Policy, prepared: &Prepared, out: &mut String) {
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
        engine::logical_key(&prepared.class.action, &prepared.subject)
    );
}

/// The plan's limits (with a global limit's failure mode) and the class's guard.
fn explain_limits(policy: &Policy, class: &RouteClass, prepared: &Prepared, out: &mut String) {
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
}

/// The first request of a class without admission checks, decided by the
/// engine on an empty state.
fn first_request(policy: &Policy, prepared: &Prepared, host: &MemoryHost, out: &mut String) {
    let mut scratch = engine::Scratch::default();
    let d = engine::charge(policy, prepared, host, EXPLAIN_NOW_NS, &mut scratch);
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
}
