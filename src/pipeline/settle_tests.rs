//! Costs settled after the response and soft limits, through the pipeline
//! over the in-memory host: two workers over one store, explicit time,
//! every event a host delivers; and THE BOUND of `crate::cost` under
//! seeded random schedules.

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::rc::Rc;

use super::*;
use crate::limiter::NANOS_PER_SEC;
use crate::memory::{MemoryHost, MemoryStats, SharedStore};

const S: u64 = NANOS_PER_SEC;
const MS: u64 = 1_000_000;
const T0: u64 = 1_796_000_000 * S;

/// `tokens`: 10,000 a minute, burst 10,000 (debt up to 10,000, the default);
/// `chat`: estimate 100 (or `x-estimate`), ceiling 1,000, OpenAI usage;
/// `tiered`: three `plain` requests a minute on its primary (soft), five in
/// all (hard); `fast` (tenant `load`, the random schedules): 10,000 a
/// second, burst 10,000, debt up to 10,000.
const POLICY: &str = r#"{
    "version": "settle-pipe-1",
    "identity": {"header": "x-tenant-id"},
    "plans": {"tokens": {"limits": [{"rate": 10000, "per": "1m"}]},
              "fast": {"limits": [{"rate": 600000, "per": "1m", "burst": 10000}]},
              "tiered": {"limits": [{"name": "primary", "rate": 300, "per": "1m", "on_limit": "soft"},
                                    {"name": "hard", "rate": 500, "per": "1m"}]}},
    "tenants": [{"id": "tiered", "plan": "tiered"}, {"id": "load", "plan": "fast"}],
    "default_plan": "tokens",
    "anonymous": {"plan": "tokens"},
    "routes": {
        "chat": {"cost": 100, "settle": {"usage": "openai_total", "ceiling": 1000,
                                         "estimate_header": "x-estimate"}},
        "stream": {"action": "chat", "cost": 100, "settle": {"usage": "openai_total", "ceiling": 1000,
                                                              "on_missing": "estimate"}},
        "metered": {"action": "chat", "cost": 10, "settle": {"header": "x-usage", "ceiling": 1000}},
        "bodyest": {"action": "chat", "cost": 100, "settle": {"usage": "openai_total", "ceiling": 1000,
                                                               "estimate_body_field": "max_tokens"}},
        "messages": {"action": "chat", "cost": 100, "settle": {"usage": "anthropic", "ceiling": 1000}},
        "nested": {"action": "chat", "cost": 100, "settle": {"usage": "gemini", "ceiling": 1000,
                   "estimate_body_field": "/generationConfig/maxOutputTokens",
                   "estimate_input_bytes_per_token": 4}},
        "askusage": {"action": "chat", "cost": 100, "settle": {"usage": "openai_total", "ceiling": 1000,
                     "include_usage": true, "estimate_body_field": "max_tokens"}},
        "models": {"action": "chat", "cost": 100, "settle": {"usage": "openai_total", "ceiling": 1000,
                   "methods": ["post"], "paths": ["/v1/chat/", "/v1/responses"],
                   "on_outcome": {"upstream_4xx": "estimate", "no_response": "ceiling"}}},
        "plain": {"cost": 100}
    }
}"#;

struct Node {
    store: Rc<RefCell<SharedStore>>,
    stats: MemoryStats,
}

struct Worker {
    pipeline: Pipeline,
    policy: Rc<Policy>,
}

impl Node {
    fn new() -> Node {
        Node {
            store: SharedStore::new(),
            stats: MemoryStats::default(),
        }
    }

    fn worker(&self, now: u64) -> Worker {
        let mut pipeline = Pipeline::default();
        let host = MemoryHost::new(self.store.clone());
        let policy = pipeline
            .configure(&host, &now, &mut self.stats.clone(), POLICY.as_bytes())
            .unwrap_or_else(|e| panic!("{e}"));
        Worker { pipeline, policy }
    }

    /// A `POST` (the metered operation's method by default).
    fn request(&self, class: &str, tenant: &str) -> MemoryHost {
        MemoryHost::new(self.store.clone())
            .route_class(class)
            .header(":method", "POST")
            .header(":path", "/v1/chat/completions")
            .header("x-tenant-id", tenant)
    }

    fn stat(&self, name: &str) -> i64 {
        self.stats.value(name)
    }
}

/// How a response ends.
#[derive(Debug, Clone, Copy)]
enum Answer {
    /// A JSON body with `usage.total_tokens` = this.
    Usage(u64),
    /// A JSON body without usage.
    NoUsage,
    /// The stream is reset after half its body.
    Reset,
}

impl Worker {
    fn headers(&mut self, host: &MemoryHost, stream: StreamId, now: u64) -> Directive {
        let policy = self.policy.clone();
        self.pipeline.on_request_headers(host, &now, &policy, stream)
    }

    /// The upstream's whole answer, in 7-byte chunks, then the stream's
    /// end; returns the cost record.
    fn respond(&mut self, node: &Node, stream: StreamId, answer: Answer, now: u64) -> Option<String> {
        let body = match answer {
            Answer::Usage(n) => {
                format!(r#"{{"choices":[],"usage":{{"prompt_tokens":1,"total_tokens":{n}}}}}"#)
            }
            Answer::NoUsage | Answer::Reset => r#"{"choices":[{"message":{"content":"hi"}}]}"#.to_owned(),
        };
        let mut host =
            MemoryHost::new(node.store.clone()).response_header("content-type", "application/json");
        let mut record = None;
        let r = self.pipeline.on_response_headers(&host, &now, stream, false);
        // A settling stream's body is still to be read: a host must not
        // skip it.
        assert!(!r.finished || r.cost_record.is_some(), "{r:?}");
        record = record.or(r.cost_record);
        let bytes = body.as_bytes();
        let cut = match answer {
            Answer::Reset => bytes.len() / 2,
            _ => bytes.len(),
        };
        let chunks: Vec<&[u8]> = bytes[..cut].chunks(7).collect();
        for (i, c) in chunks.iter().enumerate() {
            host.response_body = c.to_vec();
            let eos = i + 1 == chunks.len() && !matches!(answer, Answer::Reset);
            record = record.or(self.pipeline.on_response_body(&host, &now, stream, c.len(), eos));
        }
        record.or(self.pipeline.on_stream_end(&host, &now, stream))
    }
}

/// A field of a cost record.
fn field(record: &str, name: &str) -> u64 {
    record
        .split(' ')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} in {record}"))
}

fn admitted(d: &Directive) -> bool {
    d.verdict == Verdict::Continue
}

#[test]
fn a_json_answer_settles_its_real_cost_both_ways_and_counts_it() {
    let node = Node::new();
    let mut w = node.worker(T0);
    let h = node.request("chat", "acme");
    assert!(admitted(&w.headers(&h, 1, T0)));
    let record = w.respond(&node, 1, Answer::Usage(40), T0 + S).unwrap();
    assert_eq!(
        record,
        "class=chat key=chat|t|acme estimate=100 figure=40 cost=40 written_off=0 owed=0"
    );
    assert!(admitted(&w.headers(&h, 2, T0 + S)));
    let record = w.respond(&node, 2, Answer::Usage(5000), T0 + 2 * S).unwrap();
    assert_eq!((field(&record, "figure"), field(&record, "cost")), (5000, 1000));
    w.pipeline.on_tick(
        &MemoryHost::new(node.store.clone()),
        &(T0 + 2 * S),
        &mut node.stats.clone(),
        None,
    );
    assert_eq!(node.stat("tenantgate.cost.settles.chat"), 2);
    assert_eq!(node.stat("tenantgate.cost.estimated_units.chat"), 200);
    assert_eq!(node.stat("tenantgate.cost.settled_units.chat"), 1040);
    assert_eq!(node.stat("tenantgate.cost.under_units.chat"), 60);
    assert_eq!(node.stat("tenantgate.cost.over_units.chat"), 900);
    assert_eq!(node.stat("tenantgate.cost.cut_to_ceiling.chat"), 1);
    // The key holds 10,000 − 1,040 (the refill of two seconds aside).
    let peeked = crate::engine::peek(
        &w.policy,
        &crate::engine::KeyOf {
            action: "chat",
            subject: &crate::decision::Subject::Tenant("acme".into()),
            plan: w.policy.plan_of_tenant("acme"),
        },
        &MemoryHost::new(node.store.clone()),
        T0 + 2 * S,
        None,
        &mut crate::engine::Scratch::default(),
    )
    .unwrap();
    // Full again when the second one ended (the first gave back 60 of a
    // bucket that refilled anyway), less the 900 its answer added.
    assert_eq!(peeked[0].remaining, 10_000 - 900);
}

#[test]
fn an_answer_without_a_usable_figure_settles_by_the_rule() {
    let node = Node::new();
    let mut w = node.worker(T0);
    let h = node.request("chat", "acme");
    let mut costs = Vec::new();
    for (i, a) in [Answer::NoUsage, Answer::Reset].into_iter().enumerate() {
        let stream = i as u32 + 1;
        assert!(admitted(&w.headers(&h, stream, T0)));
        let r = w.respond(&node, stream, a, T0 + S).unwrap_or_default();
        costs.push(r);
    }
    // `chat`: on_missing ceiling; a reset stream is settled at its end.
    assert_eq!(field(&costs[0], "cost"), 1000);
    assert!(costs[0].contains("figure=unusable:missing"));
    assert_eq!(field(&costs[1], "cost"), 1000);
    assert!(costs[1].contains("figure=unusable:reset"));
    // `stream`: on_missing estimate: an answer without usage costs its
    // estimate, a stream cut short the ceiling all the same (the abort rule).
    let s = node.request("stream", "bob");
    assert!(admitted(&w.headers(&s, 9, T0)));
    let r = w.respond(&node, 9, Answer::Reset, T0 + S).unwrap();
    assert_eq!(field(&r, "cost"), 1000);
    assert!(admitted(&w.headers(&s, 10, T0)));
    let r = w.respond(&node, 10, Answer::NoUsage, T0 + S).unwrap();
    assert_eq!(field(&r, "cost"), 100);
    w.pipeline.on_tick(
        &MemoryHost::new(node.store.clone()),
        &(T0 + S),
        &mut node.stats.clone(),
        None,
    );
    assert_eq!(node.stat("tenantgate.cost.unusable_missing.chat"), 1);
    assert_eq!(node.stat("tenantgate.cost.unusable_reset.chat"), 1);
    assert_eq!(node.stat("tenantgate.cost.settled_units.chat"), 2000);
    assert_eq!(node.stat("tenantgate.cost.unusable_reset.stream"), 1);
    assert_eq!(node.stat("tenantgate.cost.settled_units.stream"), 1100);
    assert_eq!(node.stat("tenantgate.cost.over_units.stream"), 900);
}

/// An Anthropic stream (`src/cost/recorded/anthropic.sse`) through the
/// pipeline, its first `cut` bytes in 16-byte chunks; `whole`: the upstream
/// ended it. Returns the cost record.
fn anthropic(w: &mut Worker, node: &Node, stream: StreamId, cut: usize, whole: bool) -> String {
    let body = include_str!("../cost/recorded/anthropic.sse").as_bytes();
    // A tenant per stream: each cut costs 1,000 of its 10,000.
    let h = node.request("messages", &format!("claude-{stream}"));
    assert!(admitted(&w.headers(&h, stream, T0)));
    let mut host = MemoryHost::new(node.store.clone()).response_header("content-type", "text/event-stream");
    let mut record = w
        .pipeline
        .on_response_headers(&host, &T0, stream, false)
        .cost_record;
    let chunks: Vec<&[u8]> = body[..cut].chunks(16).collect();
    for (i, c) in chunks.iter().enumerate() {
        host.response_body = c.to_vec();
        let eos = whole && i + 1 == chunks.len();
        record = record.or(w.pipeline.on_response_body(&host, &T0, stream, c.len(), eos));
    }
    record
        .or(w.pipeline.on_stream_end(&host, &T0, stream))
        .unwrap_or_default()
}

#[test]
fn an_anthropic_stream_closed_after_its_content_costs_the_ceiling_not_message_start() {
    // The issue's attack: every content delta read, closed before the
    // cumulative `message_delta`: `message_start` said 25 + 1.
    let node = Node::new();
    let mut w = node.worker(T0);
    let body = include_str!("../cost/recorded/anthropic.sse");
    let before_delta = body.find("event: message_delta").unwrap();
    let r = anthropic(&mut w, &node, 1, before_delta, false);
    assert!(r.contains("figure=unusable:reset"), "{r}");
    assert_eq!(field(&r, "cost"), 1000);
    // At every event boundary, and after the last event while the
    // response has not ended: the ceiling.
    let mut stream = 2;
    for (at, _) in body.match_indices("event: ").chain([(body.len(), "")]) {
        let r = anthropic(&mut w, &node, stream, at, false);
        assert_eq!(field(&r, "cost"), 1000, "cut at {at}: {r}");
        stream += 1;
    }
    // Whole: 25 input + 15 output.
    let r = anthropic(&mut w, &node, stream, body.len(), true);
    assert_eq!(field(&r, "cost"), 40, "{r}");
}

#[test]
fn the_estimate_comes_from_a_trusted_header_cut_to_the_ceiling() {
    let node = Node::new();
    let mut w = node.worker(T0);
    let h = node.request("chat", "acme").header("x-estimate", "400");
    assert!(admitted(&w.headers(&h, 1, T0)));
    let r = w.respond(&node, 1, Answer::Usage(400), T0 + S).unwrap();
    assert_eq!((field(&r, "estimate"), field(&r, "cost")), (400, 400));
    let h = node.request("chat", "acme").header("x-estimate", "999999");
    assert!(admitted(&w.headers(&h, 2, T0)));
    assert_eq!(
        field(
            &w.respond(&node, 2, Answer::Usage(1), T0 + S).unwrap(),
            "estimate"
        ),
        1000
    );
    let h = node.request("chat", "acme").header("x-estimate", "lots");
    assert!(admitted(&w.headers(&h, 3, T0)));
    assert_eq!(
        field(
            &w.respond(&node, 3, Answer::Usage(1), T0 + S).unwrap(),
            "estimate"
        ),
        100
    );
}

#[test]
fn a_cost_in_a_response_header_settles_and_nothing_the_client_sends_changes_it() {
    let node = Node::new();
    let mut w = node.worker(T0);
    // The client sends the header the upstream's answer carries, and a body
    // with a usage block: neither is read.
    let mut h = node.request("metered", "acme").header("x-usage", "1");
    h.request_body = br#"{"usage":{"total_tokens":1}}"#.to_vec();
    assert!(admitted(&w.headers(&h, 1, T0)));
    let _ = w
        .pipeline
        .on_request_body(&h, &T0, &w.policy.clone(), 1, h.request_body.len());
    let answer = MemoryHost::new(node.store.clone()).response_header("x-usage", "750");
    let r = w.pipeline.on_response_headers(&answer, &T0, 1, true);
    let record = r.cost_record.unwrap();
    assert_eq!((field(&record, "estimate"), field(&record, "cost")), (10, 750));
}

#[test]
fn a_key_in_debt_is_refused_with_the_wait_of_its_repayment_and_admitted_then() {
    let node = Node::new();
    let mut w = node.worker(T0);
    let h = node.request("chat", "acme");
    // 100 requests of estimate 100 use the whole burst of 10,000 ...
    for s in 0..100 {
        assert!(admitted(&w.headers(&h, s, T0)), "{s}");
    }
    assert!(!admitted(&w.headers(&h, 1000, T0)));
    // ... and each really cost 250: 15,000 more, 10,000 owed (the debt
    // allowance), 5,000 written off.
    let mut written_off = 0;
    for s in 0..100 {
        let r = w.respond(&node, s, Answer::Usage(250), T0).unwrap();
        written_off += field(&r, "written_off");
    }
    assert_eq!(written_off, 5000);
    // 10,000 owed and 100 for the next: 10,100 units at 6 ms each: 60.6 s.
    let d = w.headers(&h, 1001, T0);
    let retry: u64 = match &d.verdict {
        Verdict::Reply(r) => r.header("retry-after").unwrap().parse().unwrap(),
        other => panic!("{other:?}"),
    };
    assert_eq!(retry, 61);
    assert!(!admitted(&w.headers(&h, 1002, T0 + 60_600 * MS - 1)));
    assert!(admitted(&w.headers(&h, 1003, T0 + 60_600 * MS)));
}

#[test]
fn the_estimate_from_the_request_body_is_charged_as_the_body_passes() {
    let node = Node::new();
    let mut w = node.worker(T0);
    let policy = w.policy.clone();
    let mut h = node.request("bodyest", "acme");
    assert!(admitted(&w.headers(&h, 1, T0)));
    let body = br#"{"model":"m","max_tokens":700,"messages":[]}"#;
    for c in body.chunks(5) {
        h.request_body = c.to_vec();
        assert_eq!(
            w.pipeline.on_request_body(&h, &T0, &policy, 1, c.len()).verdict,
            Verdict::Continue
        );
    }
    let r = w.respond(&node, 1, Answer::Usage(650), T0).unwrap();
    assert_eq!((field(&r, "estimate"), field(&r, "cost")), (700, 650));
    // A body estimate that does not fit: 429 on the body, and the headers'
    // estimate given back. 10,000 − 650 left: 9 requests of 1,000 fit.
    for s in 2..11 {
        assert!(admitted(&w.headers(&h, s, T0)));
        h.request_body = br#"{"max_tokens":1000}"#.to_vec();
        let d = w
            .pipeline
            .on_request_body(&h, &T0, &policy, s, h.request_body.len());
        assert_eq!(d.verdict, Verdict::Continue, "{s}");
    }
    assert!(
        admitted(&w.headers(&h, 11, T0)),
        "250 left: its estimate of 100 fits"
    );
    h.request_body = br#"{"max_tokens":1000}"#.to_vec();
    let d = w
        .pipeline
        .on_request_body(&h, &T0, &policy, 11, h.request_body.len());
    match d.verdict {
        Verdict::Reply(r) => assert_eq!(r.status, 429),
        other => panic!("{other:?}"),
    }
    w.pipeline.on_stream_end(&h, &T0, 11);
    // Its 100 came back: 350 left, three requests of estimate 100 fit.
    for s in 12..15 {
        assert!(admitted(&w.headers(&h, s, T0)), "{s}");
    }
    assert!(!admitted(&w.headers(&h, 15, T0)));
}

#[test]
fn a_soft_limit_marks_before_routing_and_the_response_and_strips_a_clients_copy() {
    let node = Node::new();
    let mut w = node.worker(T0);
    let mark = |d: &Directive| d.mark.as_ref().map(|m| (m.header.clone(), m.value.clone()));
    let h = node.request("plain", "tiered");
    for s in 0..3 {
        assert_eq!(mark(&w.headers(&h, s, T0)), None);
    }
    for s in 3..5 {
        let d = w.headers(&h, s, T0);
        assert_eq!(d.verdict, Verdict::Continue);
        assert_eq!(
            mark(&d),
            Some(("x-tenantgate-soft-limit".into(), Some("primary".into())))
        );
        let record = d.record.unwrap();
        assert!(record.starts_with("outcome=soft_limited "), "{record}");
        assert!(record.contains(" limit=primary"), "{record}");
        let r = w.pipeline.on_response_headers(&h, &T0, s, true);
        assert_eq!(r.soft, Some(("x-tenantgate-soft-limit".into(), "primary".into())));
    }
    // The hard limit above it refuses.
    assert!(!admitted(&w.headers(&h, 5, T0)));
    // A client's own marker is removed, on any route of the policy.
    let forged = node
        .request("plain", "other")
        .header("x-tenantgate-soft-limit", "primary");
    let d = w.headers(&forged, 6, T0);
    assert_eq!(mark(&d), Some(("x-tenantgate-soft-limit".into(), None)));
    let unclassified = MemoryHost::new(node.store.clone()).header("x-tenantgate-soft-limit", "x");
    assert_eq!(
        mark(&w.headers(&unclassified, 7, T0)),
        Some(("x-tenantgate-soft-limit".into(), None))
    );
    w.pipeline.on_tick(
        &MemoryHost::new(node.store.clone()),
        &T0,
        &mut node.stats.clone(),
        None,
    );
    assert_eq!(node.stat("tenantgate.decisions.soft_limited"), 2);
}

/// One request of a random schedule.
#[derive(Debug, Clone, Copy)]
struct Run {
    admitted_at: u64,
    settled_at: u64,
    estimate: u64,
    cost: u64,
    written_off: u64,
}

/// A small xorshift: seeded, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Drives `n` requests of `chat` for one tenant over two workers: arrivals
/// `gap` apart on average, random estimates (header, 50–500), stream
/// lengths up to `max_stream`, and answers from `answer`. Returns every
/// admitted request's run, by admission time.
fn schedule(
    tenant: &str,
    seed: u64,
    n: u32,
    gap: u64,
    max_stream: u64,
    answer: impl Fn(&mut Rng, u64) -> Answer,
) -> Vec<Run> {
    let node = Node::new();
    let mut workers = [node.worker(T0), node.worker(T0)];
    let mut rng = Rng(seed);
    // Events by time: (time, request, is_end).
    let mut events = BinaryHeap::new();
    let mut t = T0;
    let mut plans = Vec::new();
    for i in 0..n {
        t += rng.below(2 * gap);
        let estimate = 50 + rng.below(451);
        let w = rng.below(2) as usize;
        let end = t + rng.below(max_stream);
        let a = answer(&mut rng, estimate);
        plans.push((w, estimate, a, end));
        events.push(Reverse((t, i, false)));
    }
    let mut runs: Vec<Option<Run>> = vec![None; n as usize];
    while let Some(Reverse((now, i, is_end))) = events.pop() {
        let (w, estimate, a, end) = plans[i as usize];
        let worker = &mut workers[w];
        if !is_end {
            let h = node
                .request("chat", tenant)
                .header("x-estimate", estimate.to_string());
            if admitted(&worker.headers(&h, i, now)) {
                runs[i as usize] = Some(Run {
                    admitted_at: now,
                    settled_at: end,
                    estimate,
                    cost: 0,
                    written_off: 0,
                });
                events.push(Reverse((end, i, true)));
            }
        } else {
            let record = worker.respond(&node, i, a, now);
            let run = runs[i as usize].as_mut().unwrap();
            let r = record.unwrap_or_else(|| panic!("request {i} was not settled"));
            run.cost = field(&r, "cost");
            run.written_off = field(&r, "written_off");
        }
    }
    let mut runs: Vec<Run> = runs.into_iter().flatten().collect();
    runs.sort_by_key(|r| r.admitted_at);
    runs
}

/// Checks THE BOUND of `crate::cost` over every interval whose ends are
/// admission or settlement instants: the real cost of the requests
/// admitted in it is at most `B + D + r·d + Σ unsettled (C − E) +
/// Σ returned + W`. Returns the largest share of the bound reached, and
/// the largest real cost over the plain `B + r·d` (the late-settlement
/// overrun actually seen).
fn check_bound(runs: &[Run], rate_per_minute: u64) -> (f64, u64) {
    // The `fast` and `tokens` plans' burst and debt, and `chat`'s ceiling.
    const B: u64 = 10_000;
    const D: u64 = 10_000;
    const C: u64 = 1000;
    let t_ns = (60 * S).div_ceil(rate_per_minute);
    // Every admission and settlement, by time: (instant, run, is_settlement).
    let mut events: Vec<(u64, usize, bool)> = runs
        .iter()
        .enumerate()
        .flat_map(|(i, r)| [(r.admitted_at, i, false), (r.settled_at, i, true)])
        .collect();
    events.sort_unstable();
    let (mut worst, mut overrun) = (0.0f64, 0u64);
    for start in 0..events.len() {
        let t1 = events[start].0;
        if start > 0 && events[start - 1].0 == t1 {
            continue;
        }
        // Sweep t2 over the later instants, one batch of equal instants at
        // a time, keeping each term of the bound.
        let (mut real, mut unsettled, mut returned, mut w) = (0u64, 0u64, 0u64, 0u64);
        let mut k = start;
        while k < events.len() {
            let t2 = events[k].0;
            while k < events.len() && events[k].0 == t2 {
                let (_, i, settled) = events[k];
                let r = &runs[i];
                let ours = r.admitted_at >= t1;
                match (settled, ours) {
                    (false, _) => {
                        real += r.cost;
                        unsettled += C - r.estimate;
                    }
                    (true, true) => unsettled -= C - r.estimate,
                    (true, false) => returned += r.estimate.saturating_sub(r.cost),
                }
                if settled {
                    w += r.written_off;
                }
                k += 1;
            }
            let refill = (t2 - t1) / t_ns;
            let bound = B + D + refill + unsettled + returned + w;
            assert!(real <= bound, "[{t1}, {t2}]: {real} > {bound}");
            worst = worst.max(real as f64 / bound as f64);
            overrun = overrun.max(real.saturating_sub(B + refill));
        }
    }
    (worst, overrun)
}

#[test]
fn the_late_settlement_bound_holds_under_seeded_random_schedules_on_two_workers() {
    for seed in [1, 7, 42] {
        // Mixed answers: under, over, at and past the ceiling, none, resets.
        let runs = schedule(
            "load",
            seed * 0x9E37_79B9,
            400,
            40 * MS,
            20 * S,
            |rng, e| match rng.below(10) {
                0 => Answer::Reset,
                1 => Answer::NoUsage,
                2 | 3 => Answer::Usage(rng.below(e)),
                4 => Answer::Usage(1000 + rng.below(5000)),
                _ => Answer::Usage(e + rng.below(1000 - e)),
            },
        );
        assert!(runs.len() > 100, "{}", runs.len());
        let (worst, overrun) = check_bound(&runs, 600_000);
        let written_off: u64 = runs.iter().map(|r| r.written_off).sum();
        eprintln!(
            "seed {seed}: {} admitted, {:.3} of the bound at most, overrun {overrun} over B + r·d, {written_off} written off",
            runs.len(),
            worst
        );
    }
}

#[test]
fn the_adversary_at_the_ceiling_with_low_estimates_and_many_in_flight_stays_within_the_bound() {
    // Every real cost at the ceiling, estimates as low as the header lets
    // the client claim (50–500), streams of up to 30 s: many in flight. On
    // `fast` (10,000 a second) the debt is repaid as it comes; on `tokens`
    // (10,000 a minute) it fills its allowance and the rest is written off.
    for (tenant, rate) in [("load", 600_000), ("acme", 10_000)] {
        let runs = schedule(tenant, 0xAD7E_25A1, 600, 20 * MS, 30 * S, |_, _| {
            Answer::Usage(1000)
        });
        let (worst, overrun) = check_bound(&runs, rate);
        let in_flight_max = runs
            .iter()
            .map(|r| {
                runs.iter()
                    .filter(|o| o.admitted_at <= r.admitted_at && o.settled_at > r.admitted_at)
                    .count()
            })
            .max()
            .unwrap_or(0);
        let written_off: u64 = runs.iter().map(|r| r.written_off).sum();
        eprintln!(
            "adversary at {rate}/min: {} admitted, at most {in_flight_max} in flight, {:.3} of the bound at most, overrun {overrun} over B + r·d, {written_off} written off",
            runs.len(),
            worst
        );
        assert!(overrun > 0, "the schedule must overrun B + r·d to test anything");
    }
}

/// A request's answer that is only headers: `status`, from the upstream
/// or (`local`) Envoy; returns the cost record.
fn status_only(w: &mut Worker, node: &Node, stream: StreamId, status: &str, local: bool) -> String {
    let details = if local {
        "no_healthy_upstream"
    } else {
        "via_upstream"
    };
    let host = MemoryHost::new(node.store.clone())
        .response_header(":status", status)
        .response_header("content-type", "application/json")
        .property(&["response", "code_details"], details);
    let r = w.pipeline.on_response_headers(&host, &T0, stream, false);
    r.cost_record
        .or_else(|| w.pipeline.on_response_body(&host, &T0, stream, 0, true))
        .or_else(|| w.pipeline.on_stream_end(&host, &T0, stream))
        .unwrap_or_default()
}

#[test]
fn errors_cost_by_outcome_and_never_lock_an_honest_tenant_out() {
    let node = Node::new();
    let mut w = node.worker(T0);
    // `chat`: the defaults. Upstream 500, 503, 429, 400 and Envoy's own
    // 503: nothing (the estimate back); no response at all: the estimate.
    let h = node.request("chat", "unlucky");
    let mut stream = 1;
    for (status, local) in [
        ("500", false),
        ("503", false),
        ("429", false),
        ("400", false),
        ("503", true),
    ] {
        assert!(admitted(&w.headers(&h, stream, T0)));
        let r = status_only(&mut w, &node, stream, status, local);
        assert_eq!(
            (field(&r, "estimate"), field(&r, "cost")),
            (100, 0),
            "{status}: {r}"
        );
        stream += 1;
    }
    assert!(admitted(&w.headers(&h, stream, T0)));
    let r = w
        .pipeline
        .on_stream_end(&node.request("chat", "unlucky"), &T0, stream)
        .unwrap();
    assert!(r.contains("figure=unusable:no_response"), "{r}");
    assert_eq!(field(&r, "cost"), 100);
    // A hundred upstream 503s in a row leave the tenant its budget (10,000
    // a minute, estimates of 100): the next is admitted at once.
    for _ in 0..100 {
        stream += 1;
        assert!(admitted(&w.headers(&h, stream, T0)));
        status_only(&mut w, &node, stream, "503", false);
    }
    assert!(admitted(&w.headers(&h, stream + 1, T0)));
    // `models`: the policy's own charges.
    let m = node.request("models", "strict");
    assert!(admitted(&w.headers(&m, 900, T0)));
    assert_eq!(field(&status_only(&mut w, &node, 900, "400", false), "cost"), 100);
    assert!(admitted(&w.headers(&m, 901, T0)));
    assert_eq!(field(&status_only(&mut w, &node, 901, "500", false), "cost"), 0);
    assert!(admitted(&w.headers(&m, 902, T0)));
    let r = w.pipeline.on_stream_end(&m, &T0, 902).unwrap();
    assert_eq!(field(&r, "cost"), 1000, "{r}");
    w.pipeline.on_tick(
        &MemoryHost::new(node.store.clone()),
        &T0,
        &mut node.stats.clone(),
        None,
    );
    assert_eq!(node.stat("tenantgate.cost.unusable_upstream_5xx.chat"), 102);
    assert_eq!(node.stat("tenantgate.cost.unusable_upstream_4xx.chat"), 2);
    assert_eq!(node.stat("tenantgate.cost.unusable_local_reply.chat"), 1);
    assert_eq!(node.stat("tenantgate.cost.unusable_no_response.chat"), 1);
}

#[test]
fn requests_outside_the_metered_operation_are_not_charged_at_all() {
    let node = Node::new();
    let mut w = node.worker(T0);
    let on = |method: &str, path: &str| {
        MemoryHost::new(node.store.clone())
            .route_class("models")
            .header(":method", method)
            .header(":path", path)
            .header("x-tenant-id", "lister")
    };
    // GET /v1/models, OPTIONS, a POST elsewhere: passed, nothing kept.
    let mut stream = 1;
    for (method, path) in [
        ("GET", "/v1/models"),
        ("OPTIONS", "/v1/chat/completions"),
        ("POST", "/v1/embeddings"),
    ] {
        for _ in 0..200 {
            let d = w.headers(&on(method, path), stream, T0);
            assert!(admitted(&d), "{method} {path}");
            let r = status_only(&mut w, &node, stream, "200", false);
            assert_eq!(r, "", "{method} {path}: nothing to settle");
            stream += 1;
        }
    }
    // The metered operation (the query aside) is charged: 100 of 10,000.
    let d = w.headers(&on("POST", "/v1/chat/completions?x=1"), stream, T0);
    assert!(admitted(&d));
    w.pipeline.on_tick(
        &MemoryHost::new(node.store.clone()),
        &T0,
        &mut node.stats.clone(),
        None,
    );
    assert_eq!(node.stat("tenantgate.decisions.unmetered"), 600);
    assert_eq!(node.stat("tenantgate.cost.estimated_units.models"), 100);
    // `chat` has no `methods`: POST only by default.
    let get = MemoryHost::new(node.store.clone())
        .route_class("chat")
        .header(":method", "GET")
        .header(":path", "/v1/chat/completions")
        .header("x-tenant-id", "getter");
    let d = w.headers(&get, stream + 1, T0);
    assert!(admitted(&d));
    w.pipeline.on_tick(
        &MemoryHost::new(node.store.clone()),
        &T0,
        &mut node.stats.clone(),
        None,
    );
    assert_eq!(node.stat("tenantgate.decisions.unmetered"), 601);
}

#[test]
fn a_metered_request_asks_its_upstream_for_an_uncompressed_answer() {
    let node = Node::new();
    let mut w = node.worker(T0);
    let d = w.headers(
        &node
            .request("chat", "gzip-client")
            .header("accept-encoding", "gzip, br"),
        1,
        T0,
    );
    assert!(admitted(&d) && d.identity_encoding, "{d:?}");
    // Not metered (a GET), not settled (`plain`), refused: untouched.
    let get = MemoryHost::new(node.store.clone())
        .route_class("models")
        .header(":method", "GET")
        .header(":path", "/v1/models")
        .header("x-tenant-id", "gzip-client");
    let d = w.headers(&get, 2, T0);
    assert!(admitted(&d) && !d.identity_encoding, "{d:?}");
    let d = w.headers(&node.request("plain", "gzip-client"), 3, T0);
    assert!(admitted(&d) && !d.identity_encoding, "{d:?}");
    let big = node.request("chat", "poor").header("x-estimate", "1000");
    for stream in 10..30 {
        let d = w.headers(&big, stream, T0);
        assert_eq!(d.identity_encoding, admitted(&d), "{d:?}");
    }
}

/// A body through `on_request_body` in chunks of `size`, as each host
/// delivers it: the module gives each chunk alone (offset 0); the wasm
/// filter's host gives, after a `Buffer`, what it kept and the new chunk
/// (offset: what it kept). Returns each chunk's directive.
fn send_body(
    w: &mut Worker,
    h: &mut MemoryHost,
    stream: StreamId,
    body: &[u8],
    size: usize,
    wasm: bool,
) -> Vec<Directive> {
    let policy = w.policy.clone();
    let mut kept = 0;
    let mut out = Vec::new();
    let mut start = 0;
    while start < body.len() {
        let end = (start + size).min(body.len());
        h.request_body = if wasm {
            body[start - kept..end].to_vec()
        } else {
            body[start..end].to_vec()
        };
        let chunk = Chunk {
            offset: if wasm { kept } else { 0 },
            len: end - start,
            end_of_stream: end == body.len(),
        };
        let d = w.pipeline.on_request_body(h, &T0, &policy, stream, chunk);
        kept = if d.verdict == Verdict::Buffer {
            kept + (end - start)
        } else {
            0
        };
        out.push(d);
        start = end;
    }
    out
}

#[test]
fn a_streamed_request_is_sent_asking_for_its_usage_on_both_hosts_body_models() {
    let body =
        br#"{"model":"gpt-4o","max_tokens":300,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    for wasm in [false, true] {
        for size in [1, 7, body.len()] {
            let node = Node::new();
            let mut w = node.worker(T0);
            let mut h = node
                .request("askusage", "acme")
                .header("content-length", body.len().to_string());
            let d = w.headers(&h, 1, T0);
            assert!(admitted(&d));
            assert_eq!(
                d.body,
                BodyEdit::Unsized,
                "content-length goes: the body changes length"
            );
            let ds = send_body(&mut w, &mut h, 1, body, size, wasm);
            let (last, kept) = ds.split_last().unwrap();
            assert!(kept
                .iter()
                .all(|d| d.verdict == Verdict::Buffer && d.body == BodyEdit::None));
            assert_eq!(last.verdict, Verdict::Continue);
            let BodyEdit::Replace(sent) = &last.body else {
                panic!("wasm {wasm}, chunks of {size}: {last:?}")
            };
            let v: serde_json::Value = serde_json::from_slice(sent).unwrap();
            assert_eq!(v["stream_options"]["include_usage"], true);
            assert_eq!(v["max_tokens"], 300);
            assert_eq!(v["messages"][0]["content"], "hi");
            // The estimate was read from the same chunks; the usage settles.
            let r = w.respond(&node, 1, Answer::Usage(280), T0).unwrap();
            assert_eq!((field(&r, "estimate"), field(&r, "cost")), (300, 280));
            w.pipeline.on_tick(&h, &T0, &mut node.stats.clone(), None);
            assert_eq!(node.stat("tenantgate.cost.usage_requested.askusage"), 1);
        }
    }
}

#[test]
fn a_body_that_is_not_a_streamed_request_or_too_large_goes_unchanged() {
    let node = Node::new();
    let mut w = node.worker(T0);
    // Not streamed: kept, then sent as it was.
    let plain = br#"{"model":"m","max_tokens":10,"messages":[]}"#;
    let mut h = node.request("askusage", "acme");
    assert_eq!(w.headers(&h, 1, T0).body, BodyEdit::Unsized);
    let ds = send_body(&mut w, &mut h, 1, plain, 8, true);
    assert_eq!(ds.last().unwrap().verdict, Verdict::Continue);
    assert_eq!(ds.last().unwrap().body, BodyEdit::None);
    w.pipeline.on_stream_end(&h, &T0, 1);
    // Declared too large: its content-length stays, nothing is kept.
    let max = crate::cost::rewrite::MAX_REWRITE_BYTES;
    let mut big = node
        .request("askusage", "acme")
        .header("content-length", (max + 1).to_string());
    let d = w.headers(&big, 2, T0);
    assert!(admitted(&d));
    assert_eq!(d.body, BodyEdit::None);
    let huge = format!(r#"{{"stream":true,"pad":"{}"}}"#, "x".repeat(max));
    let ds = send_body(&mut w, &mut big, 2, huge.as_bytes(), 64 * 1024, true);
    assert!(ds
        .iter()
        .all(|d| d.verdict == Verdict::Continue && d.body == BodyEdit::None));
    w.pipeline.on_stream_end(&big, &T0, 2);
    // Undeclared (chunked) and growing past the bound: kept until then,
    // then let go unchanged (the host sends what it kept and the rest).
    let mut chunked = node.request("askusage", "acme");
    assert_eq!(w.headers(&chunked, 3, T0).body, BodyEdit::Unsized);
    let ds = send_body(&mut w, &mut chunked, 3, huge.as_bytes(), 64 * 1024, true);
    let first_go = ds.iter().position(|d| d.verdict == Verdict::Continue).unwrap();
    assert_eq!(first_go, max / (64 * 1024));
    assert!(ds[first_go..]
        .iter()
        .all(|d| d.verdict == Verdict::Continue && d.body == BodyEdit::None));
    w.pipeline.on_stream_end(&chunked, &T0, 3);
    // Another class's request is never kept.
    let other = node.request("bodyest", "acme");
    assert_eq!(w.headers(&other, 4, T0).body, BodyEdit::None);
}

#[test]
fn the_estimate_is_the_requests_own_output_bound_plus_a_bounded_input_estimate() {
    let node = Node::new();
    let mut w = node.worker(T0);
    let policy = w.policy.clone();
    // Gemini's `generationConfig.maxOutputTokens` (a pointer), and one unit
    // per 4 bytes of the declared body: 400 bytes, 100 units.
    let mut body = br#"{"generationConfig":{"maxOutputTokens":300},"contents":[{"parts":[{"text":""#.to_vec();
    body.resize(400 - 6, b'x');
    body.extend_from_slice(br#""}]}]}"#);
    assert_eq!(body.len(), 400);
    let mut h = node
        .request("nested", "acme")
        .header("content-length", body.len().to_string());
    assert!(admitted(&w.headers(&h, 1, T0)));
    // On the headers: the class's cost and the input estimate.
    w.pipeline.on_tick(&h, &T0, &mut node.stats.clone(), None);
    assert_eq!(node.stat("tenantgate.cost.estimated_units.nested"), 200);
    for c in body.chunks(9) {
        h.request_body = c.to_vec();
        let d = w.pipeline.on_request_body(&h, &T0, &policy, 1, c.len());
        assert_eq!(d.verdict, Verdict::Continue);
    }
    let answer = r#"{"usageMetadata":{"promptTokenCount":90,"totalTokenCount":350}}"#;
    let mut a = MemoryHost::new(node.store.clone()).response_header("content-type", "application/json");
    let r = w.pipeline.on_response_headers(&a, &T0, 1, false);
    assert!(r.cost_record.is_none());
    a.response_body = answer.as_bytes().to_vec();
    let record = w
        .pipeline
        .on_response_body(&a, &T0, 1, answer.len(), true)
        .unwrap();
    assert_eq!(
        (field(&record, "estimate"), field(&record, "cost")),
        (400, 350),
        "{record}"
    );
    // A liar's `maxOutputTokens: 1` still reserves its input (1 + 1,000,
    // cut to the ceiling).
    let lie = br#"{"generationConfig":{"maxOutputTokens":1},"contents":[]}"#;
    let mut h = node.request("nested", "acme").header("content-length", "4000");
    assert!(admitted(&w.headers(&h, 2, T0)));
    h.request_body = lie.to_vec();
    w.pipeline.on_request_body(&h, &T0, &policy, 2, lie.len());
    let record = w.respond(&node, 2, Answer::NoUsage, T0).unwrap();
    assert_eq!(field(&record, "estimate"), 1000, "{record}");
}
