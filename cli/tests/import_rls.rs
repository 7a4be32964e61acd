//! An imported policy answers Envoy's rate limit service as
//! envoyproxy/ratelimit answers from the source file: `requests_per_unit:
//! 0` is over the limit from the first request, `unlimited` is `OK`
//! (remaining 2³²−1) and replaces what it names, `shadow_mode` answers `OK`
//! with the refusal counted, a rate above 10⁹ is enforced at its value, a
//! rule nine levels deep and a 300-byte value match. The source is this
//! crate's fixtures (`tests/golden/import/`), written in that project's
//! format.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tenantgate_central::clock::{Clock, ManualClock};
use tenantgate_central::grpc::counters::MemoryCounters;
use tenantgate_central::grpc::rls::Rls;
use tenantgate_central::service::policy::parse;
use tenantgate_cli::import::{import, Source};

/// On a day boundary, so every window starts fresh.
const T0: u64 = 1_800_028_800 * 1_000_000_000;

fn rls_of(fixtures: &[&str]) -> Rls {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/import");
    let texts: Vec<(String, String)> = fixtures
        .iter()
        .map(|f| ((*f).to_owned(), std::fs::read_to_string(dir.join(f)).unwrap()))
        .collect();
    let sources: Vec<Source<'_>> = texts.iter().map(|(name, text)| Source { name, text }).collect();
    let imported = import(&sources, "v").unwrap();
    let policy = parse(&imported.policy_yaml).unwrap().rls;
    let clock = Arc::new(ManualClock::new(T0));
    let rls = Rls::new(Arc::new(MemoryCounters::new(10_000)), clock as Arc<dyn Clock>);
    rls.set_policy(policy);
    rls
}

async fn ask(rls: &Rls, domain: &str, descriptors: &[&[(&str, &str)]], hits: u32) -> RateLimitResponse {
    let req = RateLimitRequest {
        domain: domain.to_owned(),
        descriptors: descriptors
            .iter()
            .map(|d| RateLimitDescriptor {
                entries: d
                    .iter()
                    .map(|(k, v)| Entry {
                        key: (*k).to_owned(),
                        value: (*v).to_owned(),
                    })
                    .collect(),
                ..Default::default()
            })
            .collect(),
        hits_addend: hits,
    };
    rls.decide(&req).await.unwrap()
}

fn over(r: &RateLimitResponse) -> bool {
    r.overall_code == Code::OverLimit as i32
}

#[tokio::test]
async fn requests_per_unit_zero_unlimited_replaces_and_shadow_answer_as_the_source_would() {
    let rls = rls_of(&["zero.yaml"]);
    let blocked: &[(&str, &str)] = &[("client", "scraper-7")];
    let r = ask(&rls, "blocklist", &[blocked], 1).await;
    assert!(
        over(&r),
        "requests_per_unit 0: over the limit from the first request"
    );
    let limit = r.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!(limit.requests_per_unit, 0);
    assert!(over(&ask(&rls, "blocklist", &[blocked], 1).await));
    // Any other client: its 30 per minute.
    let other: &[(&str, &str)] = &[("client", "someone")];
    for _ in 0..30 {
        assert!(!over(&ask(&rls, "blocklist", &[other], 1).await));
    }
    assert!(over(&ask(&rls, "blocklist", &[other], 1).await));
    // The unlimited pardon replaces the blocking rule in the same request.
    let pardon: &[(&str, &str)] = &[("pardon", "scraper-7")];
    let r = ask(&rls, "blocklist", &[blocked, pardon], 1).await;
    assert!(!over(&r), "the replaced rule does not apply");
    assert_eq!(r.statuses[1].limit_remaining, u32::MAX, "unlimited");
    // Shadow mode on a rule of 0: OK, and the refusal counted.
    let before = rls.metrics.shadow_over_limit.load(Relaxed);
    let trial: &[(&str, &str)] = &[("client", "trial-42")];
    for _ in 0..3 {
        assert!(!over(&ask(&rls, "blocklist", &[trial], 1).await));
    }
    assert_eq!(rls.metrics.shadow_over_limit.load(Relaxed) - before, 3);
    // quota_mode (a soft limit): answered OK.
    assert!(!over(
        &ask(&rls, "blocklist", &[&[("batch", "nightly")]], 1).await
    ));
}

#[tokio::test]
async fn rates_beyond_a_billion_deep_rules_and_long_values_are_enforced_at_their_values() {
    let rls = rls_of(&["wide.yaml", "deep.yaml"]);
    let bytes: &[(&str, &str)] = &[("bytes", "upload")];
    assert!(!over(&ask(&rls, "metering", &[bytes], 4_000_000_000).await));
    let r = ask(&rls, "metering", &[bytes], 294_967_295).await;
    assert!(!over(&r), "4294967295 per second, exactly");
    assert_eq!(r.statuses[0].limit_remaining, 0);
    assert!(over(&ask(&rls, "metering", &[bytes], 1).await));
    // Nine levels, the limit at the ninth (9 per minute).
    let levels: Vec<(String, String)> = (1..=9).map(|i| (format!("level{i}"), "x".to_owned())).collect();
    let nine: Vec<(&str, &str)> = levels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    for _ in 0..9 {
        assert!(!over(&ask(&rls, "deep", &[&nine], 1).await));
    }
    assert!(over(&ask(&rls, "deep", &[&nine], 1).await));
    // The 300-byte value: its own 3 per second.
    let long = format!("{}-{}", "v".repeat(150), "w".repeat(149));
    let header: &[(&str, &str)] = &[("header", &long)];
    for _ in 0..3 {
        assert!(!over(&ask(&rls, "deep", &[header], 1).await));
    }
    assert!(over(&ask(&rls, "deep", &[header], 1).await));
}
