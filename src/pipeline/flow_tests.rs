//! Answers metered as they flow, through the pipeline over the in-memory
//! host (`crate::cost`, "Metered as it flows"): chunked reservations
//! through the one charge path, an answer ended at an event boundary with
//! its provider's terminal event when its limits refuse, settled at what
//! passed; and the adversary of the restated bound: 1,000 concurrent
//! streams of one tenant that claim `max_tokens: 1` and stream 3,000
//! tokens each, beside honest clients whose upstream respects their
//! `max_tokens`.

use std::cell::RefCell;
use std::rc::Rc;

use super::*;
use crate::limiter::NANOS_PER_SEC;
use crate::memory::{MemoryHost, MemoryStats, SharedStore};

const S: u64 = NANOS_PER_SEC;
const MS: u64 = 1_000_000;
const T0: u64 = 1_796_000_000 * S;

/// `tokens`: 60,000 a minute (1,000 a second), burst 10,000, debt up to
/// 10,000 (the default). `chat`: estimate `x-estimate` (the request's own
/// `max_tokens`, as a trusted filter would copy it), ceiling 10,000, chunks
/// of 100; `json` refuses a JSON answer over its reservation.
const POLICY: &str = r#"{
    "version": "flow-1",
    "identity": {"header": "x-tenant-id"},
    "plans": {"tokens": {"limits": [{"rate": 60000, "per": "1m", "burst": 10000}]}},
    "default_plan": "tokens",
    "anonymous": {"plan": "tokens"},
    "routes": {
        "chat": {"cost": 100, "settle": {"usage": "openai_total", "ceiling": 10000, "chunk": 100,
                                         "estimate_header": "x-estimate"}},
        "messages": {"action": "chat", "cost": 100, "settle": {"usage": "anthropic", "ceiling": 10000,
                     "chunk": 100, "estimate_header": "x-estimate"}},
        "gemini": {"action": "chat", "cost": 100, "settle": {"usage": "gemini", "ceiling": 10000,
                   "chunk": 100, "estimate_header": "x-estimate"}},
        "json": {"action": "chat", "cost": 100, "settle": {"usage": "openai_total", "ceiling": 10000,
                 "estimate_header": "x-estimate", "over_reservation": "refuse"}}
    }
}"#;

const BURST: u64 = 10_000;
const DEBT: u64 = 10_000;
const RATE_PER_S: u64 = 1_000;

struct Node {
    store: Rc<RefCell<SharedStore>>,
    stats: MemoryStats,
}

impl Node {
    fn new() -> Node {
        Node {
            store: SharedStore::new(),
            stats: MemoryStats::default(),
        }
    }

    fn pipeline(&self) -> (Pipeline, Rc<Policy>) {
        let mut pipeline = Pipeline::default();
        let host = MemoryHost::new(self.store.clone());
        let policy = pipeline
            .configure(&host, &T0, &mut self.stats.clone(), POLICY.as_bytes())
            .unwrap_or_else(|e| panic!("{e}"));
        (pipeline, policy)
    }

    fn host(&self) -> MemoryHost {
        MemoryHost::new(self.store.clone())
    }
}

/// One OpenAI chat chunk event carrying one token.
const TOKEN: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok\"}}],\"usage\":null}\n\n";

/// The end of an OpenAI stream of `tokens` output tokens and 20 input.
fn openai_end(tokens: u64) -> String {
    format!(
        "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":20,\"completion_tokens\":{tokens},\"total_tokens\":{}}}}}\n\ndata: [DONE]\n\n",
        tokens + 20
    )
}

/// A stream in flight: what its client has received.
struct Live {
    stream: StreamId,
    /// Token events the upstream has sent so far, and will send in all.
    sent: u64,
    total: u64,
    /// What reached the client.
    received: Vec<u8>,
    ended: bool,
    record: Option<String>,
}

fn admit(p: &mut Pipeline, policy: &Rc<Policy>, host: &MemoryHost, stream: StreamId) -> bool {
    let d = p.on_request_headers(host, &T0, policy, stream);
    if d.verdict != Verdict::Continue {
        return false;
    }
    let r = p.on_response_headers(
        &host.clone().response_header("content-type", "text/event-stream"),
        &T0,
        stream,
        false,
    );
    assert!(r.cost_record.is_none());
    true
}

/// One chunk of the upstream's answer through the pipeline; what the
/// client receives is appended to `live.received`.
fn pass(p: &mut Pipeline, node: &Node, live: &mut Live, chunk: &[u8], eos: bool, now: u64) {
    let mut h = node.host();
    h.response_body = chunk.to_vec();
    let body = p.on_response_body(&h, &now, live.stream, chunk.len(), eos);
    if body.cost_record.is_some() {
        live.record = body.cost_record;
    }
    match body.end {
        None => live.received.extend_from_slice(chunk),
        Some(end) => {
            live.received.extend_from_slice(&chunk[..end.keep]);
            live.received.extend_from_slice(end.terminal);
            live.ended = true;
        }
    }
}

fn tokens_in(received: &[u8]) -> u64 {
    String::from_utf8_lossy(received)
        .matches("\"content\":\"tok\"")
        .count() as u64
}

fn field(record: &str, name: &str) -> String {
    record
        .split(' ')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("{name} in {record}"))
        .to_owned()
}

#[test]
fn a_stream_past_its_reservation_reserves_chunks_and_ends_with_its_terminal_event_when_refused() {
    let node = Node::new();
    let (mut p, policy) = node.pipeline();
    // A tenant with 450 tokens left: an estimate of 100, then chunks of 100.
    let spend = node.request_host("chat", "spent", 9_650);
    assert!(admit(&mut p, &policy, &spend, 1));
    let mut end = node.host();
    end.response_body = openai_end(9_630).into_bytes();
    let b = p.on_response_body(&end, &T0, 1, end.response_body.len(), true);
    assert_eq!(field(&b.cost_record.unwrap(), "cost"), "9650");
    let h = node.request_host("chat", "spent", 100);
    assert!(admit(&mut p, &policy, &h, 2));
    let mut live = Live {
        stream: 2,
        sent: 0,
        total: 3_000,
        received: Vec::new(),
        ended: false,
        record: None,
    };
    // Seven tokens a chunk, the last one cut in two.
    while !live.ended && live.sent < live.total {
        let mut chunk = TOKEN.repeat(7);
        chunk.push_str(&TOKEN[..20]);
        pass(&mut p, &node, &mut live, chunk[..].as_bytes(), false, T0);
        live.sent += 7;
        let rest = TOKEN.as_bytes()[20..].to_vec();
        if !live.ended {
            pass(&mut p, &node, &mut live, &rest, false, T0);
            live.sent += 1;
        }
    }
    assert!(live.ended, "never cut");
    let text = String::from_utf8_lossy(&live.received).into_owned();
    // Ended at an event boundary, with OpenAI's terminal event.
    assert!(text.ends_with("\"usage\":null}\n\ndata: [DONE]\n\n"), "{text}");
    let served = tokens_in(&live.received);
    let record = live.record.unwrap();
    // 350 left: the estimate of 100, two chunks of 100, then refused (50
    // left): 300 reserved, ended right after the event that passed it.
    assert_eq!(served, 301, "{record}");
    assert_eq!(field(&record, "figure"), "ended:301");
    assert_eq!(field(&record, "cost"), "301");
    assert_eq!(field(&record, "estimate"), "300");
    // Later chunks of the upstream's answer go nowhere (the host drops
    // them): the pipeline keeps nothing of the stream.
    let mut h = node.host();
    h.response_body = TOKEN.as_bytes().to_vec();
    assert_eq!(
        p.on_response_body(&h, &T0, 2, TOKEN.len(), false),
        ResponseBody::default()
    );
    assert_eq!(p.on_stream_end(&h, &T0, 2), None);
    p.on_tick(&node.host(), &T0, &mut node.stats.clone(), None);
    assert_eq!(node.stats.value("tenantgate.cost.chunks.chat"), 2);
    assert_eq!(node.stats.value("tenantgate.cost.ended.chat"), 1);
}

#[test]
fn an_anthropic_stream_ends_with_message_stop_and_a_gemini_one_with_nothing_injected() {
    let node = Node::new();
    let (mut p, policy) = node.pipeline();
    let spend = node.request_host("messages", "claude", 9_800);
    assert!(admit(&mut p, &policy, &spend, 1));
    let h = node.request_host("messages", "claude", 100);
    assert!(admit(&mut p, &policy, &h, 2));
    let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n";
    let delta = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"tok\"}}\n\n";
    let mut live = Live {
        stream: 2,
        sent: 0,
        total: 1_000,
        received: Vec::new(),
        ended: false,
        record: None,
    };
    pass(&mut p, &node, &mut live, start.as_bytes(), false, T0);
    while !live.ended && live.sent < live.total {
        pass(&mut p, &node, &mut live, delta.repeat(5).as_bytes(), false, T0);
        live.sent += 5;
    }
    let text = String::from_utf8_lossy(&live.received).into_owned();
    assert!(
        text.ends_with("\"text\":\"tok\"}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"),
        "{:?}",
        live.record
    );
    // 200 left after the other stream's 9,800: 100 estimate + 100 chunk;
    // 25 + 1 from message_start, then one per delta: cut after the delta
    // that took it to 201.
    let record = live.record.unwrap();
    assert_eq!(field(&record, "figure"), "ended:201", "{record}");
    assert_eq!(
        String::from_utf8_lossy(&live.received)
            .matches("text_delta")
            .count(),
        175
    );
    // Gemini reports a running total in every chunk, and its stream has
    // no terminal event: ended after the chunk that passed, nothing added.
    let spend = node.request_host("gemini", "gem", 9_800);
    assert!(admit(&mut p, &policy, &spend, 3));
    let h = node.request_host("gemini", "gem", 100);
    assert!(admit(&mut p, &policy, &h, 4));
    let mut live = Live {
        stream: 4,
        sent: 0,
        total: 1_000,
        received: Vec::new(),
        ended: false,
        record: None,
    };
    while !live.ended && live.sent < live.total {
        live.sent += 30;
        let chunk = format!(
            "data: {{\"candidates\":[{{\"content\":{{\"parts\":[{{\"text\":\"tok\"}}]}}}}],\"usageMetadata\":{{\"promptTokenCount\":8,\"totalTokenCount\":{}}}}}\r\n\r\n",
            8 + live.sent
        );
        pass(&mut p, &node, &mut live, chunk.as_bytes(), false, T0);
    }
    let text = String::from_utf8_lossy(&live.received).into_owned();
    assert!(text.ends_with("\"totalTokenCount\":218}}\r\n\r\n"), "{text}");
    assert_eq!(field(&live.record.unwrap(), "figure"), "ended:218");
}

#[test]
fn a_json_answer_over_its_reservation_is_charged_or_refused_by_the_policy() {
    let node = Node::new();
    let (mut p, policy) = node.pipeline();
    // `chat` (over_reservation: charge): passed and charged into debt.
    let h = node.request_host("chat", "debtor", 100);
    assert!(p.on_request_headers(&h, &T0, &policy, 1).verdict == Verdict::Continue);
    let json = node.host().response_header("content-type", "application/json");
    assert!(p.on_response_headers(&json, &T0, 1, false).cost_record.is_none());
    let mut b = json.clone();
    b.response_body = br#"{"usage":{"total_tokens":3000}}"#.to_vec();
    let r = p.on_response_body(&b, &T0, 1, b.response_body.len(), true);
    assert_eq!(
        (r.end, field(&r.cost_record.unwrap(), "cost")),
        (None, "3000".to_owned())
    );
    // `json` (refuse): a tenant with 500 left after its estimate is refused
    // an answer of 3,000: its last chunk withheld, charged its reservation.
    let spend = node.request_host("json", "refused", 9_400);
    assert!(p.on_request_headers(&spend, &T0, &policy, 2).verdict == Verdict::Continue);
    p.on_stream_end(&spend, &T0, 2);
    let h = node.request_host("json", "refused", 100);
    assert!(p.on_request_headers(&h, &T0, &policy, 3).verdict == Verdict::Continue);
    assert!(p.on_response_headers(&json, &T0, 3, false).cost_record.is_none());
    let r = p.on_response_body(&b, &T0, 3, b.response_body.len(), true);
    assert_eq!(
        r.end,
        Some(EndAnswer {
            keep: 0,
            terminal: b"",
            reset: true
        })
    );
    assert_eq!(field(&r.cost_record.unwrap(), "figure"), "ended:100");
    // ... and one that fits is reserved and passed.
    let h = node.request_host("json", "rich", 100);
    assert!(p.on_request_headers(&h, &T0, &policy, 4).verdict == Verdict::Continue);
    assert!(p.on_response_headers(&json, &T0, 4, false).cost_record.is_none());
    let r = p.on_response_body(&b, &T0, 4, b.response_body.len(), true);
    assert_eq!(
        (r.end, field(&r.cost_record.unwrap(), "cost")),
        (None, "3000".to_owned())
    );
}

impl Node {
    /// A metered request of `class` by `tenant` claiming `estimate`.
    fn request_host(&self, class: &str, tenant: &str, estimate: u64) -> MemoryHost {
        self.host()
            .route_class(class)
            .header(":method", "POST")
            .header(":path", "/v1/chat/completions")
            .header("x-tenant-id", tenant)
            .header("x-estimate", estimate.to_string())
    }
}

/// What a run of the adversary measured.
struct Run {
    admitted: u64,
    served: u64,
    ended: u64,
    elapsed_ns: u64,
}

/// `streams` concurrent streams of `tenant` claiming `claim` tokens, each
/// streamed `tokens` tokens by an upstream that ignores the claim (`honest`:
/// it respects it), 10 tokens per stream every 10 ms, through two workers
/// over one store, until every stream has ended (at most 60 s of virtual
/// time).
fn storm(node: &Node, tenant: &str, streams: u32, claim: u64, tokens: u64) -> (Run, Vec<Live>) {
    let mut workers = [node.pipeline(), node.pipeline()];
    let mut lives = Vec::new();
    let mut admitted = 0;
    for i in 0..streams {
        let stream = i + 1;
        let (p, policy) = &mut workers[(stream % 2) as usize];
        if admit(p, policy, &node.request_host("chat", tenant, claim), stream) {
            admitted += 1;
            lives.push(Live {
                stream,
                sent: 0,
                total: tokens,
                received: Vec::new(),
                ended: false,
                record: None,
            });
        }
    }
    let mut now = T0;
    let mut ended = 0;
    while lives.iter().any(|l| l.record.is_none()) && now < T0 + 60 * S {
        now += 10 * MS;
        for l in lives.iter_mut().filter(|l| l.record.is_none()) {
            let (p, _) = &mut workers[(l.stream % 2) as usize];
            let n = (l.total - l.sent).min(10);
            l.sent += n;
            let done = l.sent == l.total;
            let mut chunk = TOKEN.repeat(n as usize);
            if done {
                chunk.push_str(&openai_end(l.total));
            }
            pass(p, node, l, chunk.as_bytes(), done, now);
            if l.ended {
                ended += 1;
            }
        }
    }
    let served = lives.iter().map(|l| tokens_in(&l.received)).sum();
    let run = Run {
        admitted,
        served,
        ended,
        elapsed_ns: now - T0,
    };
    (run, lives)
}

#[test]
fn a_thousand_streams_lying_about_max_tokens_are_served_within_the_restated_bound() {
    let node = Node::new();
    // The adversary: 1,200 streams at once, each claiming 1 token and
    // streamed 3,000.
    let (run, lives) = storm(&node, "liar", 1_200, 1, 3_000);
    let t_s = run.elapsed_ns.div_ceil(S);
    // THE BOUND, restated (`crate::cost`): from the key's first request,
    // tokens served ≤ B + D + r·t + N·e (N streams, e = one event's tokens,
    // here 1); the old bound's in-flight term was N·(C − E).
    let bound = BURST + DEBT + RATE_PER_S * t_s + run.admitted;
    let old = BURST + DEBT + RATE_PER_S * t_s + run.admitted * (10_000 - 1);
    eprintln!(
        "liar: {} streams admitted, {} ended by the filter, {} tokens served in {t_s} s \
         (bound {bound} = B {BURST} + D {DEBT} + r·t {} + N·e {}; the in-flight term \
         before: N·(C − E) = {}, bound {old}); asked for {}",
        run.admitted,
        run.ended,
        run.served,
        RATE_PER_S * t_s,
        run.admitted,
        run.admitted * 9_999,
        run.admitted * 3_000,
    );
    assert_eq!(run.admitted, 1_200);
    assert_eq!(run.ended, 1_200, "every lying stream is cut");
    assert!(run.served <= bound, "{} > {bound}", run.served);
    // Every cut stream ended on an event boundary with `[DONE]`.
    assert!(lives
        .iter()
        .all(|l| String::from_utf8_lossy(&l.received).ends_with("}\n\ndata: [DONE]\n\n")));
    // Honest clients on another tenant beside it: 10 streams claiming 500
    // and streamed 500 (their upstream respects `max_tokens`) are never
    // cut and are charged their usage (20 input tokens each on top).
    let (honest, lives) = storm(&node, "honest", 10, 500, 500);
    eprintln!(
        "honest beside it: {} of 10 admitted, {} cut, {} tokens served",
        honest.admitted, honest.ended, honest.served
    );
    assert_eq!((honest.admitted, honest.ended, honest.served), (10, 0, 5_000));
    for l in &lives {
        let record = l.record.as_deref().unwrap_or_default();
        assert_eq!(field(record, "cost"), "520", "{record}");
    }
}
