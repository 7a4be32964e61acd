//! What admission control does to a class's requests, decided by the
//! filter's own request pipeline ([`Pipeline`]) over the in-memory host:
//! one worker of one node, configured with the policy's JSON as Envoy's
//! worker is, at a fixed instant with explicit ticks, fixed stream ids and
//! fixed tenant ids. Nothing here decides: every line is a directive, an
//! answer, a decision record or a count the pipeline produced (in flight
//! from shared data, a breaker's phase from its gauge).
//!
//! Each scenario starts from an empty node:
//! 1. **The first request** of the class: its directive, its decision
//!    record and its `RateLimit` headers.
//! 2. **Saturation**: requests of the class that never end, each from its
//!    own tenant (`fill-1`, `fill-2`, …, so no tenant's share or rate limit
//!    binds first), until one is not admitted; then one more request of
//!    each criticality whose class uses the same dependency (or action
//!    limit); then the worker ticks every 10 ms, with no slot freed, until
//!    every held request is answered.
//! 3. **The circuit breaker** (a class whose dependency has one): the
//!    breaker's `min_volume` requests answered 503 by the upstream and
//!    ended; the worker ticks until the breaker's gauge says open; then one
//!    more request of the class.

use std::cell::RefCell;
use std::fmt::Write;
use std::rc::Rc;

use tenantgate::admission::breaker::Phase;
use tenantgate::admission::{self, Counts};
use tenantgate::memory::{MemoryHost, MemoryStats, SharedStore};
use tenantgate::pipeline::{Directive, Pipeline, StreamId, Verdict, TICK_NS};
use tenantgate::policy::admission::{Criticality, Dependency, MAX_QUEUE_WAIT_NS};
use tenantgate::policy::{Policy, RouteClass};
use tenantgate::response::REASON_HEADER;
use tenantgate::stats::Metric;

use super::{Request, EXPLAIN_NOW_NS};

/// Most requests a saturation or a breaker sends: explain stays quick on
/// any policy (`max_in_flight` and `min_volume` go up to 1,000,000).
const MAX_REQUESTS: u32 = 100_000;
/// Most ticks the held requests are given: past the longest `max_wait`.
const MAX_HOLD_TICKS: u64 = MAX_QUEUE_WAIT_NS / TICK_NS + 2;
const NS_PER_MS: u64 = 1_000_000;

/// The class's admission labels and what they name in the policy (its
/// configuration, as written; what it does comes from the pipeline).
pub(super) fn labels(policy: &Policy, class: &RouteClass, out: &mut String) {
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
    if let Some(a) = l.action_limit.and_then(|i| policy.action_limit(i)) {
        let _ = writeln!(
            out,
            "  action limit: {} (max_in_flight {}, node-wide, every class of the action)",
            a.name, a.max_in_flight
        );
    }
    match l.dependency.and_then(|i| policy.dependency(i)) {
        Some(d) => {
            let _ = writeln!(out, "  dependency: {}", dependency_line(d, class));
        }
        None => {
            let _ = writeln!(out, "  dependency: none");
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
                    ns / NS_PER_MS
                )
            },
        );
        let _ = writeln!(out, "  request checks: {body}; {budget}");
    }
}

/// A dependency's settings that a request of `class` meets.
fn dependency_line(d: &Dependency, class: &RouteClass) -> String {
    let level = class.labels.criticality;
    let mut line = format!("{} (max_in_flight {} node-wide", d.name, d.max_in_flight);
    if d.reserved_critical > 0 || d.reserved_system > 0 {
        let _ = write!(
            line,
            ", reserved critical {} and system {}",
            d.reserved_critical, d.reserved_system
        );
    }
    if class.labels.streaming {
        let _ = write!(line, ", max_streams {}", d.max_streams.unwrap_or(0));
    }
    if let Some(n) = d.tenant_max {
        let _ = write!(line, ", at most {n} per tenant");
    }
    match d.queues.get(level.index()).filter(|q| q.max_queue > 0) {
        Some(q) => {
            let _ = write!(
                line,
                ", {} queue ({} per worker, max wait {} ms)",
                level.as_str(),
                q.max_queue,
                q.max_wait_ns / NS_PER_MS
            );
        }
        None => {
            let _ = write!(line, ", no {} queue", level.as_str());
        }
    }
    for (set, what) in [
        (d.breaker.is_some(), "circuit breaker"),
        (d.adaptive.is_some(), "adaptive limit"),
        (d.retry_budget.is_some(), "retry budget"),
        (d.paused, "paused"),
    ] {
        if set {
            let _ = write!(line, ", {what}");
        }
    }
    line.push(')');
    line
}

/// The pipeline's answers for `req` and the scenarios of its class (see
/// the module header). `json`: the policy's plugin configuration.
pub(super) fn explain(json: &str, req: &Request<'_>, out: &mut String) {
    let mut node = match Node::start(json, req) {
        Ok(n) => n,
        Err(e) => {
            let _ = writeln!(out, "pipeline: the policy was refused: {e}");
            return;
        }
    };
    let Some(class) = node.policy.route_class(Some(req.class)).cloned() else {
        return;
    };
    first_request(&mut node, out);
    if class.labels.dependency.is_some() || class.labels.action_limit.is_some() {
        saturate(json, req, &class, out);
    }
    if let Some(d) = class.labels.dependency.and_then(|i| node.policy.dependency(i)) {
        if d.breaker.is_some() {
            breaker(json, req, &class, d, out);
        }
    }
}

/// One node with one worker: its shared data and stats, the worker's
/// pipeline, the policy it loaded, and the node's clock.
struct Node<'r> {
    req: &'r Request<'r>,
    store: Rc<RefCell<SharedStore>>,
    stats: MemoryStats,
    pipeline: Pipeline,
    policy: Rc<Policy>,
    now: u64,
    next_stream: StreamId,
}

/// A request sent, and the pipeline's directive for it.
struct Sent {
    stream: StreamId,
    host: MemoryHost,
    directive: Directive,
}

impl<'r> Node<'r> {
    /// An empty node at [`EXPLAIN_NOW_NS`] whose worker loaded `json`.
    fn start(json: &str, req: &'r Request<'r>) -> Result<Node<'r>, String> {
        let store = SharedStore::new();
        let stats = MemoryStats::default();
        let mut pipeline = Pipeline::default();
        let host = MemoryHost::new(Rc::clone(&store));
        let policy = pipeline
            .configure(&host, &EXPLAIN_NOW_NS, &mut stats.clone(), json.as_bytes())
            .map_err(|e| e.to_string())?;
        Ok(Node {
            req,
            store,
            stats,
            pipeline,
            policy,
            now: EXPLAIN_NOW_NS,
            next_stream: 1,
        })
    }

    /// Sends a request of `class` from `tenant` (with the explained
    /// request's headers and source) on the next stream.
    fn send(&mut self, class: &str, tenant: Option<&str>) -> Sent {
        let host = self.req.host(&self.policy, &self.store, class, tenant);
        let stream = self.next_stream;
        self.next_stream = self.next_stream.saturating_add(1);
        let policy = Rc::clone(&self.policy);
        let directive = self
            .pipeline
            .on_request_headers(&host, &self.now, &policy, stream);
        Sent {
            stream,
            host,
            directive,
        }
    }

    /// The worker's next tick, 10 ms on; the answers it gave held streams.
    fn tick(&mut self) -> Vec<tenantgate::pipeline::Answer> {
        self.now = self.now.saturating_add(TICK_NS);
        let host = MemoryHost::new(Rc::clone(&self.store));
        let policy = Rc::clone(&self.policy);
        self.pipeline
            .on_tick(&host, &self.now, &mut self.stats.clone(), Some(&policy));
        self.pipeline.take_callouts();
        self.pipeline.take_answers()
    }

    /// Milliseconds since the scenario began.
    fn elapsed_ms(&self) -> u64 {
        self.now.saturating_sub(EXPLAIN_NOW_NS) / NS_PER_MS
    }

    /// A dependency's (or action's) live slots node-wide, from shared data.
    fn in_flight(&self, key: &str) -> Counts {
        let host = MemoryHost::new(Rc::clone(&self.store));
        admission::in_flight(&host, key, self.now).unwrap_or_default()
    }

    /// Who the explained request is, for a heading.
    fn caller(&self) -> String {
        match self.req.tenant {
            Some(t) => format!("tenant {t}"),
            None => format!("anonymous, from {}", self.req.source),
        }
    }
}

/// A directive in one line: `continue`, `pause (held)`, or the reply's
/// status, reason, limit and `Retry-After`.
fn verdict(d: &Directive) -> String {
    match &d.verdict {
        Verdict::Continue => String::from("continue"),
        Verdict::Pause => String::from("pause (held)"),
        Verdict::Buffer => String::from("buffer (the body is kept)"),
        Verdict::Reply(r) => {
            let mut line = format!(
                "reply {} (reason {})",
                r.status,
                r.header(REASON_HEADER).unwrap_or("-")
            );
            let problem: Option<serde_json::Value> = serde_json::from_slice(&r.body).ok();
            if let Some(limit) = problem.as_ref().and_then(|p| p["limit"].as_str()) {
                let _ = write!(line, ", limit {limit}");
            }
            if let Some(secs) = r.header("retry-after") {
                let _ = write!(line, ", retry-after {secs}");
            }
            line
        }
    }
}

/// A directive's decision record, on its own indented line.
fn record(d: &Directive, indent: &str, out: &mut String) {
    if let Some(r) = &d.record {
        let _ = writeln!(out, "{indent}record: {r}");
    }
}

/// Scenario 1: the first request on an empty node.
fn first_request(node: &mut Node<'_>, out: &mut String) {
    let class = node.req.class;
    let sent = node.send(class, node.req.tenant);
    let _ = writeln!(
        out,
        "first request (the filter's pipeline over the in-memory host, one worker, empty state):"
    );
    let _ = writeln!(out, "  directive: {}", verdict(&sent.directive));
    record(&sent.directive, "  ", out);
    let headers = match &sent.directive.verdict {
        Verdict::Continue => node
            .pipeline
            .on_response_headers(&sent.host, &node.now, sent.stream, true)
            .ratelimit
            .map(|h| (h.policy, h.ratelimit)),
        Verdict::Reply(r) => r
            .header("ratelimit-policy")
            .zip(r.header("ratelimit"))
            .map(|(p, l)| (p.to_owned(), l.to_owned())),
        Verdict::Pause | Verdict::Buffer => None,
    };
    match headers {
        Some((policy, ratelimit)) => {
            let _ = writeln!(out, "  ratelimit-policy: {policy}");
            let _ = writeln!(out, "  ratelimit: {ratelimit}");
        }
        None => {
            let _ = writeln!(out, "  (no RateLimit headers)");
        }
    }
}

/// The classes a saturation's "one more of each criticality" sends: per
/// level, the explained class at its own level, else the first by name
/// with the same dependency (or, without one, the same action limit) and
/// the same streaming label.
fn peers(policy: &Policy, class: &RouteClass) -> Vec<(Criticality, String)> {
    let l = class.labels;
    let shares = |c: &&RouteClass| {
        let same = match l.dependency {
            Some(d) => c.labels.dependency == Some(d),
            None => c.labels.action_limit == l.action_limit,
        };
        same && c.labels.streaming == l.streaming
    };
    let mut classes: Vec<&RouteClass> = policy.route_classes().filter(shares).collect();
    classes.sort_by(|a, b| a.name.cmp(&b.name));
    Criticality::ALL
        .iter()
        .rev()
        .filter_map(|level| {
            let name = if l.criticality == *level {
                class.name.clone()
            } else {
                classes
                    .iter()
                    .find(|c| c.labels.criticality == *level)?
                    .name
                    .clone()
            };
            Some((*level, name))
        })
        .collect()
}

/// The live slots of what the class is limited by, one line each.
fn in_flight_lines(node: &Node<'_>, class: &RouteClass, indent: &str, out: &mut String) {
    if let Some(d) = class.labels.dependency.and_then(|i| node.policy.dependency(i)) {
        let c = node.in_flight(&d.key);
        let _ = write!(
            out,
            "{indent}{} in flight: {} of max_in_flight {} (",
            d.name,
            c.in_flight(),
            d.max_in_flight
        );
        for (i, level) in Criticality::ALL.iter().rev().enumerate() {
            let n = c.levels.get(level.index()).copied().unwrap_or(0);
            let _ = write!(out, "{}{} {n}", if i > 0 { ", " } else { "" }, level.as_str());
        }
        let _ = writeln!(out, "), streams {}", c.streams);
    }
    if let Some(a) = class
        .labels
        .action_limit
        .and_then(|i| node.policy.action_limit(i))
    {
        let c = node.in_flight(&a.key);
        let _ = writeln!(
            out,
            "{indent}action {} in flight: {} of max_in_flight {}",
            a.name,
            c.total(),
            a.max_in_flight
        );
    }
}

/// A request the pipeline holds, for the answers of the hold.
struct Held {
    stream: StreamId,
    class: String,
}

/// Scenario 2: saturation, one more of each criticality, and the hold ticked to
/// its answers.
fn saturate(json: &str, req: &Request<'_>, class: &RouteClass, out: &mut String) {
    let Ok(mut node) = Node::start(json, req) else {
        return;
    };
    let _ = writeln!(
        out,
        "saturation (an empty node, one worker): requests of {} that never end, each from its own tenant (fill-1, fill-2, ...), until one is not admitted:",
        class.name
    );
    let mut held = Vec::new();
    let mut admitted = 0u32;
    loop {
        if admitted >= MAX_REQUESTS {
            let _ = writeln!(out, "  {admitted} admitted (explain stops there)");
            break;
        }
        let tenant = format!("fill-{}", admitted.saturating_add(1));
        let sent = node.send(&class.name, Some(&tenant));
        if sent.directive.verdict == Verdict::Continue {
            admitted = admitted.saturating_add(1);
            continue;
        }
        let _ = writeln!(
            out,
            "  {admitted} admitted; then {tenant}: {}",
            verdict(&sent.directive)
        );
        record(&sent.directive, "    ", out);
        if sent.directive.verdict == Verdict::Pause {
            held.push(Held {
                stream: sent.stream,
                class: class.name.clone(),
            });
        }
        break;
    }
    in_flight_lines(&node, class, "  ", out);
    one_more_of_each(&mut node, class, &mut held, out);
    in_flight_lines(&node, class, "  ", out);
    hold_to_answers(&mut node, &held, out);
}

/// One more request of each criticality (the explained request's caller).
fn one_more_of_each(node: &mut Node<'_>, class: &RouteClass, held: &mut Vec<Held>, out: &mut String) {
    let _ = writeln!(
        out,
        "  then one more request of each criticality ({}):",
        node.caller()
    );
    for (level, name) in peers(&node.policy, class) {
        let sent = node.send(&name, node.req.tenant);
        let _ = writeln!(
            out,
            "    {} ({name}): {}",
            level.as_str(),
            verdict(&sent.directive)
        );
        record(&sent.directive, "      ", out);
        if sent.directive.verdict == Verdict::Pause {
            held.push(Held {
                stream: sent.stream,
                class: name,
            });
        }
        for a in node.pipeline.take_answers() {
            let _ = writeln!(out, "      and stream {}: {}", a.stream, verdict(&a.directive));
        }
    }
}

/// The worker ticks every 10 ms, no slot freed, until the hold is empty.
fn hold_to_answers(node: &mut Node<'_>, held: &[Held], out: &mut String) {
    if node.pipeline.held() == 0 {
        let _ = writeln!(out, "  no request is held");
        return;
    }
    let _ = writeln!(
        out,
        "  held: {}; the worker ticks every 10 ms and no slot frees:",
        node.pipeline.held()
    );
    for _ in 0..MAX_HOLD_TICKS {
        for a in node.tick() {
            let class = held
                .iter()
                .find(|h| h.stream == a.stream)
                .map_or("?", |h| h.class.as_str());
            let _ = writeln!(
                out,
                "    at +{} ms, {class} (stream {}): {}",
                node.elapsed_ms(),
                a.stream,
                verdict(&a.directive)
            );
            record(&a.directive, "      ", out);
        }
        if node.pipeline.held() == 0 {
            return;
        }
    }
}

/// Scenario 3: the dependency's breaker: `min_volume` upstream failures, ticks
/// until it opens, then one more request.
fn breaker(json: &str, req: &Request<'_>, class: &RouteClass, dep: &Dependency, out: &mut String) {
    let (Some(settings), Ok(mut node)) = (dep.breaker, Node::start(json, req)) else {
        return;
    };
    let _ = writeln!(
        out,
        "circuit breaker of {} (an empty node, one worker; error_rate {}, min_volume {}, window {} ms):",
        dep.name,
        f64::from(settings.error_permille) / 1000.0,
        settings.min_volume,
        settings.window_ns / NS_PER_MS
    );
    let volume = settings.min_volume.min(MAX_REQUESTS);
    let mut failed = 0u32;
    while failed < volume {
        let tenant = format!("fail-{}", failed.saturating_add(1));
        let sent = node.send(&class.name, Some(&tenant));
        if sent.directive.verdict != Verdict::Continue {
            let _ = writeln!(out, "  {tenant}: {}", verdict(&sent.directive));
            break;
        }
        let host = sent
            .host
            .response_header(":status", "503")
            .property(&["response", "code_details"], "via_upstream");
        node.pipeline
            .on_response_headers(&host, &node.now, sent.stream, true);
        node.pipeline.on_stream_end(&host, &node.now, sent.stream);
        failed = failed.saturating_add(1);
    }
    let _ = writeln!(
        out,
        "  {failed} requests of {} (tenants fail-1, fail-2, ...) admitted, answered 503 by the upstream (code details via_upstream) and ended at +0 ms",
        class.name
    );
    let open = Phase::Open as i64;
    let gauge = {
        let mut name = String::new();
        Metric::BreakerState(&dep.name).name(&mut name);
        name
    };
    let ticks = settings.window_ns / TICK_NS + 1;
    for _ in 0..ticks {
        node.tick();
        if node.stats.value(&gauge) == open {
            break;
        }
    }
    let state = node.stats.value(&gauge);
    let _ = writeln!(
        out,
        "  the worker ticks every 10 ms: at +{} ms {gauge} is {state}{}",
        node.elapsed_ms(),
        if state == open { " (open)" } else { "" }
    );
    let sent = node.send(&class.name, node.req.tenant);
    let _ = writeln!(
        out,
        "  then a request of {} ({}): {}",
        class.name,
        node.caller(),
        verdict(&sent.directive)
    );
    record(&sent.directive, "    ", out);
}
