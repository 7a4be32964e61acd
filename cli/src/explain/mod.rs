//! `tenantgate policy explain` and `tenantgate policy diff`: what a policy
//! does to one request, and what a reload does to live state. Both read the
//! filter's own compiled [`Policy`]; `explain` decides the request with the
//! filter's engine over the in-memory host (`tenantgate::memory`) at a fixed
//! instant, and `diff` classifies each limit with [`Algo::carry_from`], the
//! rule the engine's state loader applies. Nothing here re-implements a
//! decision; the output is plain text, one fact per line, stable for golden
//! tests (every listing is sorted).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::rc::Rc;

use tenantgate::engine::{self, Subject};
use tenantgate::keys::kind;
use tenantgate::limiter::algo::{Algo, Carry};
use tenantgate::memory::{MemoryHost, SharedStore};
use tenantgate::policy::{FailureMode, Identity, Limit, OnLimit, Policy};

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

/// What a reload from `old` to `new` does, as text; `true` if they differ
/// in anything it reports.
pub fn diff(old: &Policy, new: &Policy) -> (String, bool) {
    let mut out = String::new();
    let mut differs = false;
    if old.version != new.version {
        let _ = writeln!(out, "version: {} -> {}", old.version, new.version);
        differs = true;
    }
    if old.mode != new.mode {
        let _ = writeln!(out, "mode: {} -> {}", mode(old), mode(new));
        differs = true;
    }

    // Limits, per plan (a key's state is matched by limit name within it).
    let plans = |p: &Policy| -> BTreeMap<String, Vec<String>> {
        p.plans()
            .iter()
            .map(|plan| {
                (
                    plan.name.clone(),
                    plan.limits.iter().map(|l| l.name.clone()).collect(),
                )
            })
            .collect()
    };
    let find = |p: &Policy, plan: &str, limit: &str| -> Option<(u8, String, Algo)> {
        let plan = p.plans().iter().find(|x| x.name == plan)?;
        let l = plan.limits.iter().find(|l| l.name == limit)?;
        let kind = if l.global {
            kind::GLOBAL_ALLOWANCE
        } else {
            l.algo.kind()
        };
        Some((kind, limit_line(l), l.algo))
    };
    let (old_plans, new_plans) = (plans(old), plans(new));
    let mut plan_names: Vec<&String> = old_plans.keys().chain(new_plans.keys()).collect();
    plan_names.sort();
    plan_names.dedup();
    for plan in plan_names {
        let mut lines = Vec::new();
        let mut limit_names: Vec<&String> = old_plans
            .get(plan)
            .into_iter()
            .flatten()
            .chain(new_plans.get(plan).into_iter().flatten())
            .collect();
        limit_names.sort();
        limit_names.dedup();
        for name in limit_names {
            let before = find(old, plan, name);
            let after = find(new, plan, name);
            let line = match (&before, &after) {
                (Some(b), Some(a)) => {
                    let global = a.0 == kind::GLOBAL_ALLOWANCE;
                    // A global limit's record is its allowance (kind 5),
                    // whatever its algorithm; a local one's, its algorithm's.
                    let carry = if b.0 != a.0 {
                        Carry::Fresh
                    } else if global {
                        Carry::Keeps
                    } else {
                        a.2.carry_from(b.2.kind(), b.2.params())
                    };
                    let (b, a) = ((b.0, b.1.clone()), (a.0, a.1.clone()));
                    let carry = Some(carry);
                    match carry {
                        Some(Carry::Keeps) if global && b.1 != a.1 => format!(
                            "  {name}: keeps its allowance; the service splits the new limit from the next sync\n    - {}\n    + {}",
                            b.1, a.1
                        ),
                        Some(Carry::Keeps) if b.1 == a.1 => continue,
                        Some(Carry::Keeps) => format!("  {name}: keeps its state\n    - {}\n    + {}", b.1, a.1),
                        Some(Carry::Migrated) => format!(
                            "  {name}: keeps its fill level, capped to the new burst (never adds tokens)\n    - {}\n    + {}",
                            b.1, a.1
                        ),
                        _ if b.0 == kind::GLOBAL_ALLOWANCE || a.0 == kind::GLOBAL_ALLOWANCE => format!(
                            "  {name}: starts fresh (local <-> global)\n    - {}\n    + {}",
                            b.1, a.1
                        ),
                        _ => format!(
                            "  {name}: starts fresh (the algorithm changed)\n    - {}\n    + {}",
                            b.1, a.1
                        ),
                    }
                }
                (None, Some(a)) => format!("  {name}: starts fresh (a new name)\n    + {}", a.1),
                (Some(b), None) => format!("  {name}: removed (its state is no longer read)\n    - {}", b.1),
                (None, None) => continue,
            };
            lines.push(line);
        }
        let status = match (old_plans.contains_key(plan), new_plans.contains_key(plan)) {
            (false, true) => " (added)",
            (true, false) => " (removed)",
            _ => "",
        };
        if !lines.is_empty() || !status.is_empty() {
            differs = true;
            let _ = writeln!(out, "plan {plan}{status}:");
            for l in lines {
                let _ = writeln!(out, "{l}");
            }
        }
    }

    // Tenants that change plan (listed ones, and the default).
    let plan_name = |p: &Policy, i: usize| p.plan(i).map_or_else(|| String::from("?"), |x| x.name.clone());
    let directory = |p: &Policy| -> BTreeMap<String, String> {
        p.tenants()
            .map(|(t, i)| (t.to_owned(), plan_name(p, i)))
            .collect()
    };
    let (old_dir, new_dir) = (directory(old), directory(new));
    let (old_default, new_default) = (
        plan_name(old, old.default_plan()),
        plan_name(new, new.default_plan()),
    );
    let mut tenant_names: Vec<&String> = old_dir.keys().chain(new_dir.keys()).collect();
    tenant_names.sort();
    tenant_names.dedup();
    let mut moved = Vec::new();
    for t in tenant_names {
        let b = old_dir.get(t).unwrap_or(&old_default);
        let a = new_dir.get(t).unwrap_or(&new_default);
        if a != b {
            // A key's limit states are matched by name in its new plan.
            let before = old_plans.get(b).cloned().unwrap_or_default();
            let after = new_plans.get(a).cloned().unwrap_or_default();
            let (kept, fresh): (Vec<&String>, Vec<&String>) = after.iter().partition(|l| before.contains(l));
            let mut what = Vec::new();
            if !kept.is_empty() {
                what.push(format!("carries the state of {}", join(&kept)));
            }
            if !fresh.is_empty() {
                what.push(format!("{} starts fresh", join(&fresh)));
            }
            moved.push(format!("  {t}: {b} -> {a} ({})", what.join("; ")));
        }
    }
    if old_default != new_default {
        moved.push(format!(
            "  (unlisted tenants, default_plan): {old_default} -> {new_default}"
        ));
    }
    if !moved.is_empty() {
        differs = true;
        let _ = writeln!(out, "tenants that change plan:");
        for m in moved {
            let _ = writeln!(out, "{m}");
        }
    }

    // Route classes.
    let classes = |p: &Policy| -> BTreeMap<String, String> {
        p.route_classes()
            .map(|c| {
                let guard = c
                    .guard
                    .and_then(|g| p.guard(g))
                    .map_or("none", |g| g.name.as_str());
                let mode = c.failure_mode.map_or("sync.failure_mode", failure_mode);
                let mut summary = format!(
                    "action {}, cost {}, guard {guard}, on limit {}, failure mode {mode}",
                    c.action,
                    c.cost,
                    on_limit(c.on_limit)
                );
                let l = c.labels;
                if l != tenantgate::policy::admission::Labels::default() {
                    let dependency = l
                        .dependency
                        .and_then(|d| p.dependency(d))
                        .map_or("none", |d| d.name.as_str());
                    let _ = write!(
                        summary,
                        ", criticality {}, retryable {}, streaming {}, dependency {dependency}, max_body_bytes {}, min_timeout_budget {}",
                        l.criticality.as_str(),
                        l.retryable,
                        l.streaming,
                        l.max_body_bytes.map_or_else(|| "none".to_owned(), |n| n.to_string()),
                        l.min_timeout_budget_ns
                            .map_or_else(|| "none".to_owned(), |ns| format!("{} ms", ns / 1_000_000)),
                    );
                    if let Some(a) = l.action_limit.and_then(|i| p.action_limit(i)) {
                        let _ = write!(summary, ", action max_in_flight {}", a.max_in_flight);
                    }
                }
                if let Some(d) = &c.degradable {
                    let _ = write!(
                        summary,
                        ", degradable max_stale {} ms, version_header {}, max_body_bytes {}, slots {}, anonymous {}, refresh {} ms",
                        d.max_stale_ns / 1_000_000,
                        d.version_header,
                        d.max_body_bytes,
                        d.slots,
                        d.anonymous,
                        d.refresh_ns / 1_000_000
                    );
                }
                (c.name.clone(), summary)
            })
            .collect()
    };
    let (old_classes, new_classes) = (classes(old), classes(new));
    let mut class_lines = Vec::new();
    let mut class_names: Vec<&String> = old_classes.keys().chain(new_classes.keys()).collect();
    class_names.sort();
    class_names.dedup();
    for c in class_names {
        match (old_classes.get(c), new_classes.get(c)) {
            (None, Some(a)) => class_lines.push(format!("  {c}: added ({a})")),
            (Some(b), None) => class_lines.push(format!(
                "  {c}: removed (was {b}); its routes fall to default_route"
            )),
            (Some(b), Some(a)) if a != b => class_lines.push(format!("  {c}: changed\n    - {b}\n    + {a}")),
            _ => {}
        }
    }
    if old.default_route() != new.default_route() {
        class_lines.push(format!(
            "  default_route: {} -> {}",
            old.default_route().unwrap_or("none"),
            new.default_route().unwrap_or("none")
        ));
    }
    if !class_lines.is_empty() {
        differs = true;
        let _ = writeln!(out, "route classes:");
        for l in class_lines {
            let _ = writeln!(out, "{l}");
        }
    }
    if old.sync != new.sync {
        differs = true;
        let _ = writeln!(
            out,
            "sync: changed (global limits use the new settings from the next sync)"
        );
    }
    if old.dependencies != new.dependencies {
        differs = true;
        let names = |p: &Policy| {
            p.dependencies
                .iter()
                .map(|d| d.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            out,
            "dependencies: changed ({} -> {}): slots in flight carry over and count against the new limits",
            names(old),
            names(new)
        );
    }
    if old.actions != new.actions {
        differs = true;
        let limits = |p: &Policy| {
            p.actions
                .iter()
                .map(|a| format!("{} {}", a.name, a.max_in_flight))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            out,
            "actions: in-flight limits changed ({} -> {}): slots in flight carry over and count against the new limits",
            limits(old),
            limits(new)
        );
    }
    if !differs {
        let _ = writeln!(out, "no change to live state");
    }
    (out, differs)
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
