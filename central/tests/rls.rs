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
    let long = "x".repeat(300);
    let err = rls[0]
        .decide(&request(&[&[("tenant", &long)]], 1))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let p: RlsPolicy = parse(POLICY).unwrap().rls;
    assert!(p.descriptors.has_domain("shop"));
}
