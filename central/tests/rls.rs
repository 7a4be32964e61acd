//! The rate limit service's decisions (`grpc::rls`), each scenario written
//! once and run on every store: embedded and a real Redis (two replicas
//! sharing it). Limits per descriptor, the more specific rule, nested
//! rules, `replaces`, `shared`, `unlimited`, all or nothing across a
//! request's descriptors, shadow limits and `mode: shadow`, the cost,
//! bounds on the request.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tenantgate_central::clock::{Clock, ManualClock};
use tenantgate_central::grpc::counters::{Counters, MemoryCounters, RedisCounters};
use tenantgate_central::grpc::rls::{Rls, RlsPolicy};
use tenantgate_central::service::policy::parse;
use tenantgate_central::testing::RedisServer;

const POLICY: &str = r#"
version: "rls-native-1"
identity: { header: x-tenant-id }
plans:
  per_tenant: { limits: [ { algorithm: fixed_window, rate: 5, per: 1m } ] }
  vip: { limits: [ { algorithm: fixed_window, rate: 50, per: 1m } ] }
  specific: { limits: [ { rate: 2, per: 1m } ] }
  wider: { limits: [ { rate: 4, per: 1m } ] }
  files: { limits: [ { algorithm: fixed_window, rate: 3, per: 1h } ] }
  watch: { limits: [ { rate: 1, per: 1m, shadow: true } ] }
default_plan: per_tenant
anonymous: { plan: per_tenant }
routes: { api: {} }
default_route: api
descriptors:
  shop:
    - { key: tenant, plan: per_tenant }
    - { key: tenant, value: vip, plan: vip }
    - { key: ldap, unlimited: true }
    - { key: watched, plan: watch }
    - { key: files, value: "files/*", shared: true, plan: files }
    - key: key_1
      value: value_1
      descriptors: [ { key: user, value: bob, name: specific_limit, plan: specific } ]
    - key: key_2
      value: value_2
      descriptors: [ { key: user, value: bob, replaces: [specific_limit], plan: wider } ]
"#;

const T0: u64 = 1_800_000_000 * 1_000_000_000; // on a minute boundary

enum Backend {
    Embedded(Arc<dyn Counters>),
    Redis(RedisServer),
}

impl Backend {
    fn counters(&self) -> Arc<dyn Counters> {
        match self {
            Backend::Embedded(c) => c.clone(),
            Backend::Redis(r) => Arc::new(RedisCounters::new(&r.url(), "t").unwrap()),
        }
    }
}

fn backends() -> Vec<(&'static str, Backend)> {
    vec![
        (
            "embedded",
            Backend::Embedded(Arc::new(MemoryCounters::new(10_000))),
        ),
        (
            "redis",
            Backend::Redis(RedisServer::start().unwrap_or_else(|e| panic!("{e}"))),
        ),
    ]
}

/// Two replicas on one backend (the embedded one shares its records in
/// process, as one replica would).
fn replicas(backend: &Backend, policy: &str, clock: &Arc<ManualClock>) -> [Rls; 2] {
    let p = parse(policy).unwrap().rls;
    let make = || {
        let r = Rls::new(backend.counters(), clock.clone() as Arc<dyn Clock>);
        r.set_policy(p.clone());
        r
    };
    [make(), make()]
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).to_owned(),
                value: (*v).to_owned(),
            })
            .collect(),
        ..Default::default()
    }
}

fn request(descriptors: &[&[(&str, &str)]], hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: "shop".to_owned(),
        descriptors: descriptors.iter().map(|d| descriptor(d)).collect(),
        hits_addend: hits,
    }
}

async fn ask(rls: &Rls, descriptors: &[&[(&str, &str)]], hits: u32) -> RateLimitResponse {
    rls.decide(&request(descriptors, hits)).await.unwrap()
}

fn ok(r: &RateLimitResponse) -> bool {
    r.overall_code == Code::Ok as i32
}

async fn admitted(rls: &[Rls; 2], descriptors: &[&[(&str, &str)]], n: usize) -> usize {
    let mut count = 0;
    for i in 0..n {
        if ok(&ask(&rls[i % 2], descriptors, 1).await) {
            count += 1;
        }
    }
    count
}

#[tokio::test]
async fn every_store_decides_descriptors_like_the_policy_says() {
    for (name, backend) in backends() {
        let clock = Arc::new(ManualClock::new(T0));
        let rls = replicas(&backend, POLICY, &clock);
        // A tenant each, across two replicas: exactly 5 in the window.
        assert_eq!(admitted(&rls, &[&[("tenant", "a")]], 9).await, 5, "{name}");
        assert_eq!(admitted(&rls, &[&[("tenant", "b")]], 3).await, 3, "{name}");
        assert_eq!(
            admitted(&rls, &[&[("tenant", "vip")]], 9).await,
            9,
            "{name}: the specific rule"
        );
        // The answer: the descriptor's status, its limit and reset.
        let r = ask(&rls[0], &[&[("tenant", "a")]], 1).await;
        assert_eq!(r.statuses[0].code, Code::OverLimit as i32, "{name}");
        let limit = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!((limit.name.as_str(), limit.requests_per_unit), ("per_tenant", 5));
        assert_eq!(r.statuses[0].limit_remaining, 0);
        assert_eq!(r.statuses[0].duration_until_reset.unwrap().seconds, 60);
        // All or nothing: a refused request charges none of its keys.
        assert!(!ok(&ask(
            &rls[1],
            &[&[("tenant", "a")], &[("tenant", "fresh")]],
            1
        )
        .await));
        let r = ask(&rls[1], &[&[("tenant", "fresh")]], 1).await;
        assert_eq!(
            r.statuses[0].limit_remaining, 4,
            "{name}: the refused request took nothing"
        );
        // The cost: 3 then 3 of 5 is refused.
        assert!(ok(&ask(&rls[0], &[&[("tenant", "c")]], 3).await));
        assert!(!ok(&ask(&rls[0], &[&[("tenant", "c")]], 3).await), "{name}");
        // The next window admits again.
        clock.advance(Duration::from_secs(60));
        assert!(ok(&ask(&rls[0], &[&[("tenant", "a")]], 1).await), "{name}");
        // Unlimited, unknown and shadow.
        let r = ask(&rls[0], &[&[("ldap", "x")], &[("nothing", "y")]], 1).await;
        assert!(ok(&r));
        assert_eq!(r.statuses[0].limit_remaining, u32::MAX);
        assert!(r.statuses[1].current_limit.is_none());
        assert_eq!(
            admitted(&rls, &[&[("watched", "w")]], 4).await,
            4,
            "{name}: shadow never refuses"
        );
        // Shared: every value the pattern matches counts in one key.
        let shared = admitted(&rls, &[&[("files", "files/a")]], 2).await
            + admitted(&rls, &[&[("files", "files/b")]], 2).await;
        assert_eq!(shared, 3, "{name}");
        // Replaces: with both, only the wider rule applies (4, not 2).
        let both: &[&[(&str, &str)]] = &[
            &[("key_1", "value_1"), ("user", "bob")],
            &[("key_2", "value_2"), ("user", "bob")],
        ];
        assert_eq!(admitted(&rls, both, 6).await, 4, "{name}");
        assert_eq!(
            admitted(&rls, &[&[("key_1", "value_1"), ("user", "bob")]], 3).await,
            2,
            "{name}: untouched"
        );
    }
}

#[tokio::test]
async fn shadow_mode_answers_ok_and_bounds_refuse_what_is_too_big() {
    let clock = Arc::new(ManualClock::new(T0));
    let shadow = POLICY.replace("version: \"rls-native-1\"", "version: \"s\"\nmode: shadow");
    let backend = Backend::Embedded(Arc::new(MemoryCounters::new(100)));
    let rls = replicas(&backend, &shadow, &clock);
    assert_eq!(admitted(&rls, &[&[("tenant", "a")]], 8).await, 8);
    let many: Vec<&[(&str, &str)]> = (0..65).map(|_| &[("tenant", "a")][..]).collect();
    let err = rls[0].decide(&request(&many, 1)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let long = "x".repeat(tenantgate::policy::descriptors::MAX_TEXT_LEN + 1);
    let err = rls[0]
        .decide(&request(&[&[("tenant", &long)]], 1))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let p: RlsPolicy = parse(POLICY).unwrap().rls;
    assert!(p.descriptors.has_domain("shop"));
}

/// What a client controls cannot panic the service or charge past a
/// limit: the largest costs (`hits_addend` u32::MAX, a descriptor's
/// u64::MAX), a descriptor naming the same key many times, Envoy's limit
/// override, negative hits, the most descriptors and entries allowed.
#[tokio::test]
async fn adversarial_requests_are_answered_and_charge_nothing_they_should_not() {
    for (name, backend) in backends() {
        let clock = Arc::new(ManualClock::new(T0));
        let rls = replicas(&backend, POLICY, &clock);
        // Request-level u32::MAX: refused, nothing charged.
        assert!(
            !ok(&ask(&rls[0], &[&[("tenant", "x")]], u32::MAX).await),
            "{name}"
        );
        // Descriptor-level u64::MAX (and one at 0, a check).
        let mut req = request(&[&[("tenant", "x")], &[("tenant", "y")]], 1);
        req.descriptors[0].hits_addend =
            Some(envoy_types::pb::google::protobuf::UInt64Value { value: u64::MAX });
        req.descriptors[1].hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
        let r = rls[0].decide(&req).await.unwrap();
        assert!(!ok(&r), "{name}");
        assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
        assert_eq!(r.statuses[1].code, Code::Ok as i32, "{name}: y alone would pass");
        // The same key 64 times in one request: its costs add up (64 > 5).
        let same: Vec<&[(&str, &str)]> = (0..64).map(|_| &[("tenant", "x")][..]).collect();
        assert!(!ok(&ask(&rls[1], &same, 1).await), "{name}");
        // Nothing of the above was charged: x and y still have 5 each.
        let r = ask(&rls[1], &[&[("tenant", "x")], &[("tenant", "y")]], 5).await;
        assert!(ok(&r), "{name}: {r:?}");
        assert_eq!(
            (r.statuses[0].limit_remaining, r.statuses[1].limit_remaining),
            (0, 0)
        );
        // Envoy's per-descriptor limit override is not obeyed (the policy
        // decides); negative hits give back, never past the limit.
        let mut req = request(&[&[("tenant", "z")]], 1);
        req.descriptors[0].limit = Some(
            envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride {
                requests_per_unit: 1_000_000,
                unit: 1,
            },
        );
        assert_eq!(
            admitted_req(&rls, &req, 8).await,
            5,
            "{name}: the override is ignored"
        );
        req.descriptors[0].is_negative_hits = true;
        req.descriptors[0].limit = None;
        req.descriptors[0].hits_addend =
            Some(envoy_types::pb::google::protobuf::UInt64Value { value: u64::MAX });
        assert!(ok(&rls[0].decide(&req).await.unwrap()));
        assert_eq!(
            admitted(&rls, &[&[("tenant", "z")]], 8).await,
            5,
            "{name}: u64::MAX given back fills the window, no more"
        );
        // The most a request may carry: 64 descriptors of the deepest
        // entries, each key at most 256 bytes, answered.
        let key = "k".repeat(256);
        let deep: Vec<(&str, &str)> = (0..tenantgate::policy::descriptors::MAX_DEPTH)
            .map(|_| (key.as_str(), key.as_str()))
            .collect();
        let most: Vec<&[(&str, &str)]> = (0..64).map(|_| deep.as_slice()).collect();
        assert!(
            ok(&ask(&rls[0], &most, u32::MAX).await),
            "{name}: matches nothing, limits nothing"
        );
    }
}

/// Envoy's addends as its proto defines them (and envoyproxy/ratelimit
/// answers): a descriptor's `hits_addend: 0` checks and charges nothing
/// (after 25 such checks, all 5 of the limit are still there); the
/// request's 0 is proto3's "not set" and counts 1; a descriptor's addend
/// overrides the request's; `is_negative_hits` gives units back, on a
/// window and a token bucket alike, never past the limit.
#[tokio::test]
async fn addends_check_charge_and_give_back_as_envoys_proto_says() {
    use envoy_types::pb::google::protobuf::UInt64Value;
    for (name, backend) in backends() {
        let clock = Arc::new(ManualClock::new(T0));
        let rls = replicas(&backend, POLICY, &clock);
        let mut check = request(&[&[("tenant", "c")]], 3);
        check.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
        for i in 0..25 {
            let r = rls[i % 2].decide(&check).await.unwrap();
            assert!(ok(&r), "{name}: check {i}");
            assert_eq!(r.statuses[0].limit_remaining, 5, "{name}: check {i}");
        }
        assert_eq!(admitted(&rls, &[&[("tenant", "c")]], 7).await, 5, "{name}");
        // At the limit a check still answers OK, and reports 0 left.
        let r = rls[0].decide(&check).await.unwrap();
        assert!(ok(&r) && r.statuses[0].limit_remaining == 0, "{name}: {r:?}");

        // The request's 0 counts 1 (Envoy's proto: unset counts 1).
        let zero = request(&[&[("tenant", "d")]], 0);
        let r = rls[0].decide(&zero).await.unwrap();
        assert_eq!(r.statuses[0].limit_remaining, 4, "{name}");
        // A descriptor's 2 overrides the request's 3: 4 - 2 = 2 left.
        let mut two = request(&[&[("tenant", "d")]], 3);
        two.descriptors[0].hits_addend = Some(UInt64Value { value: 2 });
        let r = rls[1].decide(&two).await.unwrap();
        assert_eq!(r.statuses[0].limit_remaining, 2, "{name}");

        // Given back: 2 of d's window, then d admits 4 more (2 + 2).
        let mut back = request(&[&[("tenant", "d")]], 2);
        back.descriptors[0].is_negative_hits = true;
        let r = rls[0].decide(&back).await.unwrap();
        assert!(ok(&r), "{name}");
        assert_eq!(r.statuses[0].limit_remaining, 4, "{name}: {r:?}");
        assert_eq!(admitted(&rls, &[&[("tenant", "d")]], 6).await, 4, "{name}");
        // A token bucket (key_1/user bob: 2 per minute) the same way.
        let bob: &[(&str, &str)] = &[("key_1", "value_1"), ("user", "bob")];
        assert_eq!(admitted(&rls, &[bob], 3).await, 2, "{name}");
        let mut back = request(&[bob], 1);
        back.descriptors[0].is_negative_hits = true;
        assert!(ok(&rls[1].decide(&back).await.unwrap()), "{name}");
        assert_eq!(admitted(&rls, &[bob], 3).await, 1, "{name}: one given back");
    }
}

async fn admitted_req(rls: &[Rls; 2], req: &RateLimitRequest, n: usize) -> usize {
    let mut count = 0;
    for i in 0..n {
        if ok(&rls[i % 2].decide(req).await.unwrap()) {
            count += 1;
        }
    }
    count
}

/// One gRPC call on the wire (h2c): the frame as given, then the answer's
/// `grpc-status` (from the headers, or the trailers).
async fn call(addr: std::net::SocketAddr, body: Vec<u8>) -> Option<String> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let req = http::Request::post(format!(
        "http://{addr}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap();
    let (resp, mut send) = client.send_request(req, false).unwrap();
    send.reserve_capacity(body.len());
    send.send_data(bytes::Bytes::from(body), true).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), resp)
        .await
        .ok()?
        .ok()?;
    let status = |h: &http::HeaderMap| {
        h.get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    if let Some(s) = status(resp.headers()) {
        return Some(s);
    }
    let mut body = resp.into_body();
    while let Some(chunk) = body.data().await {
        let Ok(chunk) = chunk else { return None };
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    body.trailers().await.ok().flatten().as_ref().and_then(status)
}

fn frame(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8];
    out.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// Malformed gRPC and protobuf on the wire, and requests too big: each
/// answered with an error status, and the service goes on answering.
#[tokio::test]
async fn malformed_and_oversized_requests_on_the_wire_are_refused() {
    use prost::Message;
    let clock = Arc::new(ManualClock::new(T0));
    let backend = Backend::Embedded(Arc::new(MemoryCounters::new(100)));
    let [rls, _] = replicas(&backend, POLICY, &clock);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let services = tenantgate_central::grpc::Services {
        rls: Arc::new(rls),
        rlqs: Arc::new(tenantgate_central::grpc::rlqs::Rlqs::new(
            Arc::new(MemoryCounters::new(100)),
            clock.clone(),
            Default::default(),
        )),
    };
    tokio::spawn(async move { axum::serve(listener, tenantgate_central::grpc::router(services)).await });
    let valid = request(&[&[("tenant", "a")]], 1).encode_to_vec();
    assert_eq!(call(addr, frame(&valid)).await.as_deref(), Some("0"));
    // Not protobuf: an invalid wire type, a truncated varint, a field
    // longer than the message, a string that is not UTF-8.
    for garbage in [
        vec![0xff; 16],
        vec![0x0a, 0xff, 0xff, 0xff],
        vec![0x0a, 0x7f, b's'],
        vec![0x0a, 0x02, 0xc3, 0x28],
    ] {
        let s = call(addr, frame(&garbage)).await;
        assert!(s.as_deref().is_some_and(|s| s != "0"), "{garbage:?}: {s:?}");
    }
    // A compressed frame (no encoding was agreed), a frame shorter than
    // it says, a frame header alone.
    let mut compressed = frame(&valid);
    compressed[0] = 1;
    for bad in [compressed, frame(&valid)[..8].to_vec(), vec![0, 0, 0]] {
        let s = call(addr, bad.clone()).await;
        assert!(s.as_deref() != Some("0"), "{bad:?}: {s:?}");
    }
    // Past the message size limit (4 MiB): OUT_OF_RANGE, unread.
    let s = call(addr, frame(&vec![0u8; 5 << 20])).await;
    assert_eq!(s.as_deref(), Some("11"));
    // Under it, 100,000 descriptors: INVALID_ARGUMENT.
    let many: Vec<&[(&str, &str)]> = (0..100_000).map(|_| &[("tenant", "a")][..]).collect();
    let huge = request(&many, u32::MAX).encode_to_vec();
    assert!(huge.len() < 4 << 20);
    assert_eq!(call(addr, frame(&huge)).await.as_deref(), Some("3"));
    // And the service still answers, the tenant charged once.
    assert_eq!(call(addr, frame(&valid)).await.as_deref(), Some("0"));
    let r = rls_remaining(addr, &valid).await;
    assert_eq!(r, 2, "a: 5, less the three valid calls");
}

async fn rls_remaining(addr: std::net::SocketAddr, req: &[u8]) -> u32 {
    use prost::Message;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let http_req = http::Request::post(format!(
        "http://{addr}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap();
    let (resp, mut send) = client.send_request(http_req, false).unwrap();
    send.send_data(bytes::Bytes::from(frame(req)), true).unwrap();
    let mut body = resp.await.unwrap().into_body();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    RateLimitResponse::decode(&bytes[5..]).unwrap().statuses[0].limit_remaining
}

/// A reload puts new numbers in force under the filter's reload rule: a
/// window keeps its count, so raising a limit from 5 to 8 admits 3 more in
/// the same window, not 8; a reload with the same rules changes nothing.
#[tokio::test]
async fn a_reload_applies_the_new_limits_to_the_counts_so_far() {
    for (name, backend) in backends() {
        let clock = Arc::new(ManualClock::new(T0));
        let rls = replicas(&backend, POLICY, &clock);
        assert_eq!(admitted(&rls, &[&[("tenant", "a")]], 5).await, 5, "{name}");
        clock.advance(Duration::from_secs(1));
        let same = parse(POLICY).unwrap().rls;
        for r in &rls {
            r.set_policy(same.clone());
        }
        assert_eq!(
            admitted(&rls, &[&[("tenant", "a")]], 2).await,
            0,
            "{name}: unchanged"
        );
        let raised = POLICY.replace(
            "{ algorithm: fixed_window, rate: 5, per: 1m }",
            "{ algorithm: fixed_window, rate: 8, per: 1m }",
        );
        let raised = parse(&raised).unwrap().rls;
        for r in &rls {
            r.set_policy(raised.clone());
        }
        assert_eq!(
            admitted(&rls, &[&[("tenant", "a")]], 6).await,
            3,
            "{name}: 8 in the window, 5 used"
        );
    }
}

/// THE BOUND under concurrency, at the sizes users run: 3 and 10 replicas
/// (30 concurrent callers, flat out, on one hot key) on a key of 100/min
/// and one of 10,000/min, costs 1 to 3: the admitted cost never exceeds
/// the limit, every caller goes on until refused so it reaches it within
/// one request's cost, and no answer is an error (which Envoy would turn
/// into its failure mode) however many compare-and-sets replicas lose to
/// each other on Redis (printed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_replicas_admit_exactly_the_limit() {
    const POLICY_SIZES: &str = r#"
version: "sizes"
identity: { header: x-tenant-id }
plans:
  small: { limits: [ { algorithm: fixed_window, rate: 100, per: 1m } ] }
  large: { limits: [ { algorithm: fixed_window, rate: 10000, per: 1m } ] }
  bucket: { limits: [ { rate: 100, per: 1m } ] }
default_plan: small
anonymous: { plan: small }
routes: { api: {} }
default_route: api
descriptors:
  shop:
    - { key: small, plan: small }
    - { key: large, plan: large }
    - { key: bucket, plan: bucket }
"#;
    for (name, backend) in backends() {
        for (key, limit, n) in [
            ("small", 100u64, 3),
            ("large", 10_000, 3),
            ("bucket", 100, 3),
            ("small", 100, 10),
            ("large", 10_000, 10),
        ] {
            let prefix = format!("{key}{n}");
            let clock = Arc::new(ManualClock::new(T0));
            let p = parse(POLICY_SIZES).unwrap().rls;
            // Fresh records each run: a memory store, or a Redis prefix.
            let memory: Arc<dyn Counters> = Arc::new(MemoryCounters::new(10_000));
            let redis: Vec<Arc<RedisCounters>> = match &backend {
                Backend::Redis(r) => (0..n)
                    .map(|_| Arc::new(RedisCounters::new(&r.url(), &prefix).unwrap()))
                    .collect(),
                Backend::Embedded(_) => vec![],
            };
            let replicas: Vec<Arc<Rls>> = (0..n)
                .map(|i| {
                    let counters = redis
                        .get(i)
                        .map_or_else(|| memory.clone(), |r| r.clone() as Arc<dyn Counters>);
                    let r = Rls::new(counters, clock.clone() as Arc<dyn Clock>);
                    r.set_policy(p.clone());
                    Arc::new(r)
                })
                .collect();
            let tasks: Vec<_> = (0..30u32)
                .map(|i| {
                    let rls = replicas[i as usize % n].clone();
                    tokio::spawn(async move {
                        let (mut admitted, mut errors) = (0u64, 0u64);
                        let cost = i % 3 + 1;
                        loop {
                            match rls.decide(&request_to(key, cost)).await {
                                Ok(r) if ok(&r) => admitted += u64::from(cost),
                                Ok(_) => return (admitted, errors),
                                Err(_) => errors += 1,
                            }
                        }
                    })
                })
                .collect();
            let (mut admitted, mut errors) = (0, 0);
            for t in tasks {
                let (a, e) = t.await.unwrap();
                admitted += a;
                errors += e;
            }
            let conflicts: u64 = redis
                .iter()
                .map(|r| r.conflicts.load(std::sync::atomic::Ordering::Relaxed))
                .sum();
            let most = redis
                .iter()
                .map(|r| r.max_attempts.load(std::sync::atomic::Ordering::Relaxed))
                .max()
                .unwrap_or(0);
            println!("{name} {key} {limit}, {n} replicas: admitted {admitted}, errors {errors}, conflicts between replicas {conflicts}, most attempts of one request {most}");
            assert!(
                admitted <= limit && admitted + 3 > limit,
                "{name} {key}: {admitted} of {limit}"
            );
            assert_eq!(errors, 0, "{name} {key}");
        }
    }
}

fn request_to(key: &str, hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: "shop".to_owned(),
        descriptors: vec![descriptor(&[(key, "one")])],
        hits_addend: hits,
    }
}

/// The store down: `UNAVAILABLE` (Envoy applies its failure mode), counted,
/// answered within the store's deadline, never a guess.
#[tokio::test]
async fn a_store_that_does_not_answer_is_unavailable() {
    let clock = Arc::new(ManualClock::new(T0));
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let counters = Arc::new(RedisCounters::new(&format!("redis://127.0.0.1:{port}"), "t").unwrap());
    let rls = Rls::new(counters, clock.clone() as Arc<dyn Clock>);
    rls.set_policy(parse(POLICY).unwrap().rls);
    let started = std::time::Instant::now();
    let err = rls.decide(&request(&[&[("tenant", "a")]], 1)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        rls.metrics.unavailable.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // A request that touches no key needs no store.
    assert!(ok(&ask(&rls, &[&[("nothing", "x")]], 1).await));
    assert!(rls
        .metrics
        .render()
        .contains("tenantgate_rls_requests_total{result=\"unavailable\"} 1"));
}

/// envoyproxy/ratelimit's `requests_per_unit: 0` as `tenantgate policy
/// import` writes it (a `fixed_window` of 0), on every store: over the limit
/// from the first request, `OK` for a check of 0 units (a descriptor's
/// `hits_addend: 0`), `OK` and counted in shadow mode, dropped when an
/// unlimited rule replaces it; a window of 2³²−1 enforced at its value.
#[tokio::test]
async fn a_window_of_zero_refuses_every_request_as_requests_per_unit_zero_does() {
    const ZERO: &str = r#"
version: "rls-zero"
identity: { header: x-tenant-id }
plans:
  blocked: { limits: [ { algorithm: fixed_window, rate: 0, per: 1s } ] }
  trial: { limits: [ { algorithm: fixed_window, rate: 0, per: 1h, shadow: true } ] }
  huge: { limits: [ { algorithm: fixed_window, rate: 4294967295, per: 1s } ] }
  open: { limits: [ { rate: 100, per: 1s } ] }
default_plan: open
anonymous: { plan: open }
routes: { api: {} }
default_route: api
descriptors:
  shop:
    - { key: client, value: scraper, name: blocked_client, plan: blocked }
    - { key: client, value: "trial-*", plan: trial }
    - { key: pardon, unlimited: true, replaces: [blocked_client] }
    - { key: bytes, plan: huge }
"#;
    for (name, backend) in backends() {
        let clock = Arc::new(ManualClock::new(T0));
        let rls = replicas(&backend, ZERO, &clock);
        let blocked: &[(&str, &str)] = &[("client", "scraper")];
        let r = ask(&rls[0], &[blocked], 1).await;
        assert!(!ok(&r), "{name}: over the limit from the first request");
        assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().requests_per_unit, 0);
        let mut check = request(&[blocked], 1);
        check.descriptors[0].hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
        assert!(
            ok(&rls[1].decide(&check).await.unwrap()),
            "{name}: a check of 0 units"
        );
        let r = ask(&rls[1], &[blocked, &[("pardon", "x")]], 1).await;
        assert!(ok(&r), "{name}: replaced by the unlimited rule");
        assert_eq!(r.statuses[1].limit_remaining, u32::MAX);
        let before = rls[0]
            .metrics
            .shadow_over_limit
            .load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            ok(&ask(&rls[0], &[&[("client", "trial-1")]], 1).await),
            "{name}: shadow"
        );
        let after = rls[0]
            .metrics
            .shadow_over_limit
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(after - before, 1, "{name}: the shadow refusal counted");
        let bytes: &[(&str, &str)] = &[("bytes", "up")];
        assert!(ok(&ask(&rls[0], &[bytes], u32::MAX).await), "{name}: 2^32-1 fits");
        assert!(!ok(&ask(&rls[1], &[bytes], 1).await), "{name}: and not one more");
    }
}

/// Redis: each replica decides on its records as it last saw them and
/// Redis checks them in the same script that writes, so a call is one
/// round trip (`EVALSHA`, no script text) once its records are known; a
/// record another replica wrote, one that expired and was written anew
/// (the same count of writes: a version counter would not see it), and a
/// script Redis forgot (`SCRIPT FLUSH`) are each noticed and re-decided,
/// never over-admitted.
#[tokio::test]
async fn redis_replicas_decide_in_one_round_trip_and_notice_every_change() {
    let redis = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let clock = Arc::new(ManualClock::new(T0));
    let p = parse(POLICY).unwrap().rls;
    let counters: Vec<Arc<RedisCounters>> = (0..2)
        .map(|_| Arc::new(RedisCounters::new(&redis.url(), "t").unwrap()))
        .collect();
    let [a, b] = [0, 1].map(|i| {
        let r = Rls::new(counters[i].clone(), clock.clone() as Arc<dyn Clock>);
        r.set_policy(p.clone());
        r
    });
    let mut admin = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let tenant: &[(&str, &str)] = &[("tenant", "rt")];

    // One replica: one round trip per call, decided or refused.
    assert!(ok(&ask(&a, &[tenant], 1).await));
    counters[0].profile.take();
    for _ in 0..4 {
        assert!(ok(&ask(&a, &[tenant], 1).await));
    }
    assert!(!ok(&ask(&a, &[tenant], 1).await), "the limit of 5");
    let p = counters[0].profile.take();
    assert_eq!((p.calls, p.round_trips, p.script_bytes), (5, 5, 0), "{p}");

    // The other replica's writes are seen: a limit of 5 across both.
    let other: &[(&str, &str)] = &[("tenant", "both")];
    let mut admitted = 0;
    for i in 0..8 {
        if ok(&ask(if i % 2 == 0 { &a } else { &b }, &[other], 1).await) {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 5);

    // Written anew after it vanished, as many times as before: A still
    // sees that its record is not the one it wrote.
    let anew: &[(&str, &str)] = &[("tenant", "anew")];
    assert!(ok(&ask(&a, &[anew], 4).await));
    redis::cmd("FLUSHALL")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    assert!(ok(&ask(&b, &[anew], 1).await));
    assert!(ok(&ask(&a, &[anew], 1).await), "2 of 5");
    assert!(ok(&ask(&b, &[anew], 3).await), "5 of 5");
    assert!(!ok(&ask(&a, &[anew], 1).await), "over 5");

    // Redis forgot the script: loaded again, the call answered.
    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    counters[0].profile.take();
    let fresh: &[(&str, &str)] = &[("tenant", "flushed")];
    assert!(ok(&ask(&a, &[fresh], 5).await));
    assert!(!ok(&ask(&a, &[fresh], 1).await));
    let p = counters[0].profile.take();
    assert_eq!(p.round_trips, 4, "EVALSHA, SCRIPT LOAD, EVALSHA, then one: {p}");
    assert!(p.script_bytes > 0, "{p}");
}
