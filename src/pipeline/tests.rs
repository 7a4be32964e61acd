//! The pipeline over the in-memory host: two workers (two [`Pipeline`]s
//! over one [`SharedStore`], as two worker VMs of one Envoy), explicit
//! time, every event a host delivers.

use std::cell::RefCell;
use std::rc::Rc;

use super::*;
use crate::limiter::NANOS_PER_SEC;
use crate::memory::{MemoryHost, MemoryStats, SharedStore};
use crate::response::LocalReply;

const S: u64 = NANOS_PER_SEC;
const MS: u64 = 1_000_000;
const T0: u64 = 1_796_000_000 * S;

/// `db`: 2 slots, normal requests queue (2 held, 100 ms), 1 per tenant
/// with `tenant_max_share` in the `share` variant; `free`: 5 requests a
/// second with a burst of 5.
const POLICY: &str = r#"{
    "version": "pipe-1",
    "identity": {"header": "x-tenant-id"},
    "plans": {"free": {"limits": [{"name": "free", "rate": 5, "per": "1s", "burst": 5}]}},
    "default_plan": "free",
    "anonymous": {"plan": "free"},
    "dependencies": {
        "db": {"max_in_flight": 2, "retry_after_window": "1s",
               "queues": {"normal": {"max_queue": 2, "max_wait": "100ms"}}},
        "shared": {"max_in_flight": 10, "tenant_max_share": 1}
    },
    "routes": {
        "orders": {"dependency": "db"},
        "reports": {"criticality": "sheddable", "dependency": "db"},
        "upload": {"dependency": "db", "max_body_bytes": 10},
        "deadline": {"dependency": "db", "min_timeout_budget": "200ms"},
        "fair": {"dependency": "shared"},
        "jobs": {"on_limit": "queue", "max_wait": "250ms", "max_queue": 3},
        "plain": {}
    }
}"#;

/// One Envoy node: shared data, node-wide stats, and its workers.
struct Node {
    store: Rc<RefCell<SharedStore>>,
    stats: MemoryStats,
}

/// A worker: its pipeline and the policy in force on it.
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

    fn worker(&self, json: &str, now: u64) -> Worker {
        let mut pipeline = Pipeline::default();
        let host = MemoryHost::new(self.store.clone());
        let policy = match pipeline.configure(&host, &now, &mut self.stats.clone(), json.as_bytes()) {
            Ok(p) => p,
            Err(e) => panic!("test policy refused: {e}"),
        };
        Worker { pipeline, policy }
    }

    fn request(&self, class: &str, tenant: &str) -> MemoryHost {
        MemoryHost::new(self.store.clone())
            .route_class(class)
            .header("x-tenant-id", tenant)
    }

    /// A dependency's live slots, node-wide.
    fn in_flight(&self, dependency: &str, now: u64) -> u32 {
        let host = MemoryHost::new(self.store.clone());
        crate::admission::in_flight(&host, &crate::keys::dependency(dependency), now).map_or(0, |c| c.total())
    }

    fn stat(&self, name: &str) -> i64 {
        self.stats.value(name)
    }
}

impl Worker {
    fn headers(&mut self, host: &MemoryHost, stream: StreamId, now: u64) -> Directive {
        let policy = self.policy.clone();
        self.pipeline.on_request_headers(host, &now, &policy, stream)
    }

    fn end(&mut self, node: &Node, stream: StreamId, now: u64) {
        let host = MemoryHost::new(node.store.clone());
        self.pipeline.on_stream_end(&host, &now, stream);
    }

    fn tick(&mut self, node: &Node, now: u64) -> Vec<Answer> {
        let host = MemoryHost::new(node.store.clone());
        let policy = self.policy.clone();
        self.pipeline
            .on_tick(&host, &now, &mut node.stats.clone(), Some(&policy));
        self.pipeline.take_answers()
    }
}

/// The reply of a directive, or a panic.
fn reply(d: &Directive) -> &LocalReply {
    match &d.verdict {
        Verdict::Reply(r) => r,
        other => panic!("not a reply: {other:?}"),
    }
}

fn reason(d: &Directive) -> &str {
    reply(d).header(crate::response::REASON_HEADER).unwrap_or("")
}

fn retry_after(d: &Directive) -> u64 {
    reply(d)
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[test]
fn admission_comes_before_the_rate_limit_and_a_rate_limit_denial_gives_the_slot_back() {
    let node = Node::new();
    let mut w = node.worker(POLICY, T0);
    let host = node.request("orders", "acme");
    // The burst of 5: every request takes a slot; streams end at once.
    for id in 1..=5 {
        assert_eq!(w.headers(&host, id, T0).verdict, Verdict::Continue);
        assert_eq!(node.in_flight("db", T0), 1);
        w.end(&node, id, T0);
        assert_eq!(node.in_flight("db", T0), 0);
    }
    // The sixth is over the rate: 429, and its slot is back at once.
    let d = w.headers(&host, 6, T0);
    assert_eq!(reason(&d), "rate_limited");
    assert_eq!(reply(&d).status, 429);
    assert_eq!(node.in_flight("db", T0), 0);
    // Its record says the rate limit refused it, and which.
    assert!(
        d.record
            .as_deref()
            .is_some_and(|r| r.starts_with("outcome=rate_limited ") && r.ends_with(" limit=free")),
        "{d:?}"
    );
    // A request check comes before both: a short timeout budget is refused
    // without a slot or a token.
    let short = node
        .request("deadline", "other")
        .header("x-envoy-expected-rq-timeout-ms", "50");
    let d = w.headers(&short, 7, T0);
    assert_eq!((reply(&d).status, reason(&d)), (503, "timeout_budget"));
    assert_eq!(node.in_flight("db", T0), 0);
    w.end(&node, 6, T0);
    w.end(&node, 7, T0);
    assert_eq!(w.pipeline.streams(), 0);
}

#[test]
fn a_held_request_takes_a_slot_freed_on_another_worker() {
    let node = Node::new();
    let mut a = node.worker(POLICY, T0);
    let mut b = node.worker(POLICY, T0);
    // Both slots on worker b.
    assert_eq!(
        b.headers(&node.request("orders", "t1"), 1, T0).verdict,
        Verdict::Continue
    );
    assert_eq!(
        b.headers(&node.request("orders", "t2"), 2, T0).verdict,
        Verdict::Continue
    );
    // Worker a's request is held (normal has a queue), a sheddable one is
    // refused at once (no queue at its level).
    assert_eq!(
        a.headers(&node.request("orders", "t3"), 3, T0).verdict,
        Verdict::Pause
    );
    let shed = a.headers(&node.request("reports", "t4"), 4, T0);
    assert_eq!(reason(&shed), "concurrency_limit");
    assert!(retry_after(&shed) >= 1);
    assert!(a.tick(&node, T0 + 10 * MS).is_empty(), "no slot yet");
    // A slot frees on worker b: worker a's next tick resumes its request.
    b.end(&node, 1, T0 + 15 * MS);
    let answers = a.tick(&node, T0 + 20 * MS);
    assert_eq!(answers.len(), 1);
    assert_eq!(answers[0].stream, 3);
    assert_eq!(answers[0].directive.verdict, Verdict::Continue);
    let record = answers[0].directive.record.as_deref().unwrap_or("");
    assert!(record.contains("queue_wait_ms=20"), "{record}");
    assert_eq!(node.in_flight("db", T0 + 20 * MS), 2);
    // Its stream ends: the slot it got from the hold is given back.
    a.end(&node, 3, T0 + 30 * MS);
    b.end(&node, 2, T0 + 30 * MS);
    assert_eq!(node.in_flight("db", T0 + 30 * MS), 0);
    assert_eq!((a.pipeline.streams(), b.pipeline.streams()), (0, 0));
}

#[test]
fn the_slot_lane_is_bounded_and_never_waits_past_max_wait() {
    let node = Node::new();
    let mut w = node.worker(POLICY, T0);
    for id in 1..=2 {
        assert_eq!(
            w.headers(&node.request("orders", "busy"), id, T0).verdict,
            Verdict::Continue
        );
    }
    // Two held (max_queue 2); the third of the same tenant is refused at once.
    assert_eq!(
        w.headers(&node.request("orders", "t1"), 3, T0).verdict,
        Verdict::Pause
    );
    assert_eq!(
        w.headers(&node.request("orders", "t1"), 4, T0).verdict,
        Verdict::Pause
    );
    let full = w.headers(&node.request("orders", "t1"), 5, T0);
    assert_eq!(reason(&full), "queue_full");
    assert_eq!(w.pipeline.held(), 2);
    // No slot frees: both are answered 503 queue_timeout by their deadline
    // (100 ms), never after.
    let mut timed_out = Vec::new();
    let mut now = T0;
    while now <= T0 + 100 * MS {
        now += TICK_NS;
        for a in w.tick(&node, now) {
            assert_eq!(reason(&a.directive), "queue_timeout");
            timed_out.push((a.stream, now));
        }
    }
    assert_eq!(timed_out.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [3, 4]);
    assert!(
        timed_out.iter().all(|(_, at)| *at <= T0 + 100 * MS),
        "{timed_out:?}"
    );
    assert_eq!(w.pipeline.held(), 0);
    w.tick(&node, now + TICK_NS);
    assert_eq!(node.stat("tenantgate.admission.queue_timeout.normal"), 2);
    assert_eq!(node.stat("tenantgate.admission.queue_full.normal"), 1);
}

#[test]
fn every_way_a_stream_ends_gives_back_exactly_what_it_took() {
    let node = Node::new();
    let mut w = node.worker(POLICY, T0);
    let mut other = node.worker(POLICY, T0);
    let mut now = T0;
    // Admitted then ended twice (Envoy's on_log and on_done).
    assert_eq!(
        w.headers(&node.request("orders", "a"), 1, now).verdict,
        Verdict::Continue
    );
    w.end(&node, 1, now);
    w.end(&node, 1, now);
    assert_eq!(node.in_flight("db", now), 0);
    // A body over max_body_bytes: 413 mid-stream, its slot back at its end.
    let upload = node.request("upload", "b");
    assert_eq!(w.headers(&upload, 2, now).verdict, Verdict::Continue);
    let policy = w.policy.clone();
    let d = w.pipeline.on_request_body(&upload, &now, &policy, 2, 11);
    assert_eq!((reply(&d).status, reason(&d)), (413, "request_too_large"));
    assert_eq!(node.in_flight("db", now), 1);
    w.end(&node, 2, now);
    assert_eq!(node.in_flight("db", now), 0);
    // Held, then the client goes away: out of the hold, nothing taken.
    for id in 10..12 {
        assert_eq!(
            other.headers(&node.request("orders", "x"), id, now).verdict,
            Verdict::Continue
        );
    }
    assert_eq!(
        w.headers(&node.request("orders", "c"), 3, now).verdict,
        Verdict::Pause
    );
    w.end(&node, 3, now);
    assert_eq!(w.pipeline.held(), 0);
    // Held, resumed from the hold, then reset: the slot it got goes back.
    assert_eq!(
        w.headers(&node.request("orders", "d"), 4, now).verdict,
        Verdict::Pause
    );
    other.end(&node, 10, now);
    now += TICK_NS;
    let answers = w.tick(&node, now);
    assert_eq!(answers.iter().map(|a| a.stream).collect::<Vec<_>>(), [4]);
    assert_eq!(node.in_flight("db", now), 2);
    w.end(&node, 4, now);
    other.end(&node, 11, now);
    assert_eq!(node.in_flight("db", now), 0);
    // Refused at once: nothing was taken, nothing is kept.
    for id in 20..22 {
        assert_eq!(
            other.headers(&node.request("orders", "y"), id, now).verdict,
            Verdict::Continue
        );
    }
    let shed = w.headers(&node.request("reports", "e"), 5, now);
    assert_eq!(reason(&shed), "concurrency_limit");
    w.end(&node, 5, now);
    for id in 20..22 {
        other.end(&node, id, now);
    }
    assert_eq!(node.in_flight("db", now), 0);
    assert_eq!((w.pipeline.streams(), other.pipeline.streams()), (0, 0));
}

#[test]
fn the_rate_lane_resumes_in_order_and_answers_429_by_max_wait() {
    let node = Node::new();
    let mut w = node.worker(POLICY, T0);
    let host = node.request("jobs", "acme");
    for id in 1..=5 {
        assert_eq!(w.headers(&host, id, T0).verdict, Verdict::Continue);
    }
    // Over the rate: three held (max_queue 3), the fourth refused at once.
    for id in 6..=8 {
        assert_eq!(w.headers(&host, id, T0).verdict, Verdict::Pause);
    }
    assert_eq!(reason(&w.headers(&host, 9, T0)), "rate_limited");
    // A token every 200 ms: 6 at 200 ms; 7 could only pass at 400 ms,
    // after its 250 ms deadline: answered 429 as soon as that is known.
    let mut answered = Vec::new();
    let mut now = T0;
    while w.pipeline.held() > 0 {
        now += TICK_NS;
        for a in w.tick(&node, now) {
            let what = match &a.directive.verdict {
                Verdict::Continue => "resumed",
                Verdict::Reply(r) if r.status == 429 => "429",
                other => panic!("{other:?}"),
            };
            answered.push((a.stream, what, (now - T0) / MS));
        }
    }
    assert_eq!(answered, [(6, "resumed", 200), (7, "429", 200), (8, "429", 200)]);
    // A resumed request carries its RateLimit headers to its response.
    let headers = w.pipeline.on_response_headers(&host, &now, 6, true);
    assert!(headers.ratelimit.is_some_and(|h| h.policy.contains("\"free\"")));
    w.tick(&node, now + TICK_NS);
    assert_eq!(node.stat("tenantgate.queue.held"), 3);
    assert_eq!(node.stat("tenantgate.queue.admitted"), 1);
    assert_eq!(node.stat("tenantgate.queue.rejected"), 2);
}

#[test]
fn a_held_request_answered_from_the_tick_echoes_its_own_request_id() {
    // The one conclusion answers a request on its headers and a held one
    // alike: a 429 from the rate lane carries the id its client sent (read
    // when it was held, never another stream's).
    let node = Node::new();
    let mut w = node.worker(POLICY, T0);
    let host = node.request("jobs", "acme");
    for id in 1..=5 {
        assert_eq!(w.headers(&host, id, T0).verdict, Verdict::Continue);
    }
    let held = node.request("jobs", "acme").header("x-request-id", "req-7");
    assert_eq!(w.headers(&held, 7, T0).verdict, Verdict::Pause);
    let with_id = host.clone().header("x-request-id", "req-8");
    assert_eq!(w.headers(&with_id, 8, T0).verdict, Verdict::Pause);
    assert_eq!(w.headers(&host, 9, T0).verdict, Verdict::Pause);
    let mut answers = Vec::new();
    let mut now = T0;
    while w.pipeline.held() > 0 && now < T0 + S {
        now += TICK_NS;
        answers.extend(w.tick(&node, now));
    }
    let id_of = |stream: StreamId| {
        let a = answers.iter().find(|a| a.stream == stream);
        a.and_then(|a| match &a.directive.verdict {
            Verdict::Reply(r) => r.header("x-request-id").map(str::to_owned),
            _ => None,
        })
    };
    // 7 resumed at 200 ms; 8 and 9 answered 429 with their own ids (9 sent none).
    assert!(answers
        .iter()
        .any(|a| a.stream == 7 && a.directive.verdict == Verdict::Continue));
    assert_eq!(id_of(8).as_deref(), Some("req-8"));
    assert_eq!(id_of(9), None);
}

#[test]
fn refusals_carry_their_reason_limit_and_an_honest_retry_after() {
    let node = Node::new();
    let mut w = node.worker(POLICY, T0);
    // The tenant's share of `shared` is one slot.
    assert_eq!(
        w.headers(&node.request("fair", "t"), 1, T0).verdict,
        Verdict::Continue
    );
    let d = w.headers(&node.request("fair", "t"), 2, T0);
    assert_eq!((reply(&d).status, reason(&d)), (503, "tenant_share"));
    let body: serde_json::Value = serde_json::from_slice(&reply(&d).body).unwrap();
    assert_eq!(body["limit"], "shared");
    assert!(
        d.record
            .as_deref()
            .is_some_and(|r| r.contains(" limit=tenant:shared")),
        "{d:?}"
    );
    // A rate limit's Retry-After is the exact wait to the next token,
    // rounded up: never earlier than a request could pass.
    let host = node.request("plain", "r");
    for id in 10..15 {
        assert_eq!(w.headers(&host, id, T0).verdict, Verdict::Continue);
    }
    let d = w.headers(&host, 15, T0);
    assert_eq!((reason(&d), retry_after(&d)), ("rate_limited", 1));
    let body: serde_json::Value = serde_json::from_slice(&reply(&d).body).unwrap();
    assert_eq!(body["limit"], "free");
    // Concurrency refusals spread their Retry-After over the dependency's
    // window (1 s here: exactly 1).
    let node2 = Node::new();
    let mut w2 = node2.worker(POLICY, T0);
    for id in 1..=2 {
        w2.headers(&node2.request("orders", "busy"), id, T0);
    }
    let d = w2.headers(&node2.request("reports", "z"), 3, T0);
    assert_eq!((reason(&d), retry_after(&d)), ("concurrency_limit", 1));
}

#[test]
fn shadow_mode_counts_and_records_refusals_and_enforces_nothing() {
    let node = Node::new();
    let shadow = POLICY.replace(
        "\"version\": \"pipe-1\",",
        "\"version\": \"pipe-1\", \"mode\": \"shadow\",",
    );
    let mut w = node.worker(&shadow, T0);
    let host = node.request("reports", "acme");
    // Slots are full at 2 for everything after: shadow refuses nothing.
    for id in 1..=8 {
        let d = w.headers(&host, id, T0);
        assert_eq!(d.verdict, Verdict::Continue, "request {id}");
    }
    // Held in no lane, over the rate limit too, with every refusal recorded.
    assert_eq!(w.pipeline.held(), 0);
    let d = w.headers(&host, 9, T0);
    assert_eq!(d.verdict, Verdict::Continue);
    assert!(
        d.record
            .as_deref()
            .is_some_and(|r| r.starts_with("outcome=concurrency_limit ")),
        "{d:?}"
    );
    w.tick(&node, T0 + TICK_NS);
    assert_eq!(node.stat("tenantgate.decisions.shadow_limited"), 4);
    assert!(node.stat("tenantgate.admission.concurrency_limit.sheddable") >= 7);
    for id in 1..=9 {
        w.end(&node, id, T0);
    }
    assert_eq!(node.in_flight("db", T0), 0);
}

#[test]
fn a_full_level_drops_the_longest_tenant_line_for_a_quiet_tenant() {
    let node = Node::new();
    let mut w = node.worker(POLICY, T0);
    for id in 1..=2 {
        w.headers(&node.request("orders", "busy"), id, T0);
    }
    // A flood holds both places; a quiet tenant displaces its newest.
    assert_eq!(
        w.headers(&node.request("orders", "flood"), 3, T0).verdict,
        Verdict::Pause
    );
    assert_eq!(
        w.headers(&node.request("orders", "flood"), 4, T0).verdict,
        Verdict::Pause
    );
    let quiet = node
        .request("orders", "quiet")
        .header("x-request-id", "req-quiet");
    assert_eq!(w.headers(&quiet, 5, T0).verdict, Verdict::Pause);
    let answers = w.pipeline.take_answers();
    assert_eq!(answers.iter().map(|a| a.stream).collect::<Vec<_>>(), [4]);
    assert_eq!(reason(&answers[0].directive), "queue_full");
    assert_eq!(w.pipeline.held(), 2);
    w.tick(&node, T0 + TICK_NS);
    let drops: i64 = (0..16)
        .map(|b| node.stat(&format!("tenantgate.admission.fair_drops.b{b:02}")))
        .sum();
    assert_eq!(drops, 1);
}

/// The self-service limits endpoint over the pipeline.
mod limits_endpoint {
    use super::*;

    const POLICY: &str = r#"{
        "version": "self-1",
        "identity": {"header": "x-tenant-id"},
        "limits_endpoint": "/.well-known/ratelimit",
        "plans": {
            "free": {"limits": [{"name": "per_min", "rate": 100, "per": "1m", "burst": 100},
                                {"name": "per_day", "rate": 1000, "per": "1d"}]},
            "paid": {"limits": [{"name": "paid", "rate": 10000, "per": "1m"}]}
        },
        "tenants": [{"id": "acme", "plan": "free"}, {"id": "rich", "plan": "paid"}],
        "default_plan": "free",
        "anonymous": {"plan": "free"},
        "routes": {"orders": {}, "search": {"action": "search", "cost": 5}}
    }"#;

    fn limits(
        w: &mut Worker,
        node: &Node,
        tenant: Option<&str>,
        extra: &[(&str, &str)],
        now: u64,
    ) -> serde_json::Value {
        let mut host = MemoryHost::new(node.store.clone())
            .header(":path", "/.well-known/ratelimit?tenant=rich")
            .source("203.0.113.7:4000");
        if let Some(t) = tenant {
            host = host.header("x-tenant-id", t);
        }
        for (k, v) in extra {
            host = host.header(k, *v);
        }
        let d = w.headers(&host, 9_999, now);
        let r = reply(&d);
        assert_eq!(r.status, 200);
        assert!(r.header("ratelimit").is_some_and(|v| v.starts_with("\"orders/")));
        serde_json::from_slice(&r.body).unwrap()
    }

    fn remaining(v: &serde_json::Value, action: &str, limit: &str) -> u64 {
        v["limits"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["action"] == action && i["limit"] == limit)
            .and_then(|i| i["remaining"].as_u64())
            .unwrap()
    }

    #[test]
    fn a_tenant_sees_its_own_limits_only_and_asking_costs_nothing() {
        let node = Node::new();
        let mut w = node.worker(POLICY, T0);
        // acme spends 3 orders and one search (cost 5).
        for id in 1..=3 {
            let host = node.request("orders", "acme");
            assert_eq!(w.headers(&host, id, T0).verdict, Verdict::Continue);
        }
        assert_eq!(
            w.headers(&node.request("search", "acme"), 4, T0).verdict,
            Verdict::Continue
        );
        let v = limits(&mut w, &node, Some("acme"), &[], T0);
        assert_eq!(
            (v["tenant"].as_str(), v["plan"].as_str()),
            (Some("acme"), Some("free"))
        );
        assert_eq!(remaining(&v, "orders", "per_min"), 97);
        assert_eq!(remaining(&v, "search", "per_min"), 95);
        assert_eq!(remaining(&v, "orders", "per_day"), 997);
        // Asking a hundred times charges nothing.
        for _ in 0..100 {
            limits(&mut w, &node, Some("acme"), &[], T0);
        }
        assert_eq!(
            remaining(&limits(&mut w, &node, Some("acme"), &[], T0), "orders", "per_min"),
            97
        );
        // Whatever else it sends (a query, plan and class headers), acme
        // sees acme; another tenant sees its own whole limits.
        let forged = [("x-tenant-plan", "paid"), ("x-tenantgate-class", "search")];
        let v = limits(&mut w, &node, Some("acme"), &forged, T0);
        assert_eq!(
            (v["tenant"].as_str(), remaining(&v, "orders", "per_min")),
            (Some("acme"), 97)
        );
        let rich = limits(&mut w, &node, Some("rich"), &[], T0);
        assert_eq!(
            (rich["plan"].as_str(), remaining(&rich, "orders", "paid")),
            (Some("paid"), 10_000)
        );
        // No identity: its own address group, never a tenant.
        let anon = limits(&mut w, &node, None, &[], T0);
        assert_eq!(
            (anon["tenant"].is_null(), anon["anonymous"].as_str()),
            (true, Some("203.0.113.7"))
        );
        assert_eq!(remaining(&anon, "orders", "per_min"), 100);
        w.tick(&node, T0 + TICK_NS);
        assert_eq!(node.stat("tenantgate.limits_endpoint.answers"), 105);
        assert_eq!(
            node.stat("tenantgate.decisions.allowed"),
            4,
            "answers are not decisions"
        );
    }

    #[test]
    fn off_by_default_the_path_is_an_ordinary_request() {
        let node = Node::new();
        let policy = POLICY.replace("\"limits_endpoint\": \"/.well-known/ratelimit\",", "");
        let mut w = node.worker(&policy, T0);
        let host = node
            .request("orders", "acme")
            .header(":path", "/.well-known/ratelimit");
        let d = w.headers(&host, 1, T0);
        assert_eq!(
            d.verdict,
            Verdict::Continue,
            "charged and sent on like any request"
        );
    }
}

#[test]
fn response_headers_say_when_the_pipeline_keeps_nothing_of_a_stream() {
    let node = Node::new();
    let mut w = node.worker(POLICY, T0);
    // A plain rate-limited request: its RateLimit headers are all it kept.
    let plain = node.request("plain", "p");
    assert_eq!(w.headers(&plain, 1, T0).verdict, Verdict::Continue);
    let r = w.pipeline.on_response_headers(&plain, &T0, 1, false);
    assert!(r.ratelimit.is_some() && r.finished, "{r:?}");
    assert_eq!(w.pipeline.streams(), 0);
    // Its later events find nothing, as `finished` promised.
    assert_eq!(
        w.pipeline.on_response_body(&plain, &T0, 1, 10, true).cost_record,
        None
    );
    assert_eq!(w.pipeline.on_stream_end(&plain, &T0, 1), None);
    // A request holding a slot of `db` still has its end to come.
    let orders = node.request("orders", "o");
    assert_eq!(w.headers(&orders, 2, T0).verdict, Verdict::Continue);
    let r = w.pipeline.on_response_headers(&orders, &T0, 2, false);
    assert!(!r.finished, "{r:?}");
    assert_eq!(node.in_flight("db", T0), 1);
    w.end(&node, 2, T0);
    assert_eq!(node.in_flight("db", T0), 0);
    // A stream the pipeline never saw (or already ended).
    assert!(w.pipeline.on_response_headers(&orders, &T0, 3, true).finished);
}

/// A refusal by a nested level is not remembered under the tenant's key:
/// the same tenant in another organisation is decided on its own budget
/// at once (the worker remembers a tenant's own refusals only).
#[test]
fn a_levels_refusal_is_not_remembered_for_the_tenant() {
    let json = r#"{"version": "levels-1", "identity": {"header": "x-tenant-id"},
        "plans": {"user": {"limits": [{"rate": 100, "per": "1m"}]}},
        "default_plan": "user", "anonymous": {"plan": "user"},
        "levels": [{"name": "org", "header": "x-org", "limits": [{"rate": 3, "per": "1m"}]}],
        "routes": {"plain": {}}}"#;
    let node = Node::new();
    let mut w = node.worker(json, T0);
    let acme = node.request("plain", "bot").header("x-org", "acme");
    for id in 1..=3 {
        assert_eq!(w.headers(&acme, id, T0).verdict, Verdict::Continue);
    }
    let d = w.headers(&acme, 4, T0);
    assert_eq!(reply(&d).status, 429);
    let body: serde_json::Value = serde_json::from_slice(&reply(&d).body).unwrap();
    assert_eq!(body["level"], "org");
    // Refused by its own plan, a tenant is remembered; by acme, not.
    let globex = node.request("plain", "bot").header("x-org", "globex");
    for id in 5..=7 {
        assert_eq!(w.headers(&globex, id, T0).verdict, Verdict::Continue, "{id}");
    }
}

/// The limits endpoint shows a user its own levels: read from the same
/// trusted source as for charging, what it may use of each in all (its
/// member's guaranteed share plus the pool), never another's.
#[test]
fn the_limits_endpoint_shows_a_users_own_levels() {
    let json = r#"{"version": "levels-2", "identity": {"header": "x-tenant-id"},
        "plans": {"user": {"limits": [{"rate": 100, "per": "1m"}]}},
        "default_plan": "user", "anonymous": {"plan": "user"},
        "limits_endpoint": "/.well-known/ratelimit",
        "levels": [{"name": "org", "header": "x-org", "limits": [{"name": "req", "rate": 10, "per": "1m"}]},
                   {"name": "team", "parent": "org", "header": "x-team",
                    "members": {"search": {"guarantee": 30}}}],
        "routes": {"plain": {}}}"#;
    let node = Node::new();
    let mut w = node.worker(json, T0);
    let ads = node
        .request("plain", "bot")
        .header("x-org", "acme")
        .header("x-team", "ads");
    for id in 1..=3 {
        assert_eq!(w.headers(&ads, id, T0).verdict, Verdict::Continue);
    }
    let ask = |team: &str, org: &str| {
        node.request("plain", "carol")
            .header("x-org", org)
            .header("x-team", team)
            .header(":path", "/.well-known/ratelimit?org=globex")
    };
    let body = |d: &Directive| -> serde_json::Value { serde_json::from_slice(&reply(d).body).unwrap() };
    // `search` in acme: its 3 guaranteed + what the pool of 7 has left (4).
    let d = w.headers(&ask("search", "acme"), 10, T0);
    let item = &body(&d)["limits"][1];
    assert_eq!(
        (item["level"].as_str(), item["limit"].as_str()),
        (Some("org"), Some("org:req"))
    );
    assert_eq!(
        (item["quota"].as_u64(), item["remaining"].as_u64()),
        (Some(10), Some(7)),
        "{item}"
    );
    // `ads` in acme: the pool only. Its query names no one else.
    let d = w.headers(&ask("ads", "acme"), 11, T0);
    assert_eq!(body(&d)["limits"][1]["remaining"], 4);
    assert_eq!(body(&d)["limits"][1]["quota"], 7);
    // globex is whole.
    let d = w.headers(&ask("ads", "globex"), 12, T0);
    assert_eq!(body(&d)["limits"][1]["remaining"], 7);
    assert!(reply(&d)
        .header("ratelimit")
        .unwrap()
        .contains(r#""plain/org:req";r=7"#));
}
