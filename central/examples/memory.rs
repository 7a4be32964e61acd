//! `make bench-service-memory`: the service's resident memory under a flood
//! of distinct node ids and keys, and after expiry (issue #8, "bounded
//! state"). Not a timed test: it prints the figures.
//!
//! The embedded store, in process, on the service's own clock (moved by
//! hand). Each round: `NODES` new node ids, each reporting `KEYS_PER_NODE`
//! new keys once (NODES × KEYS_PER_NODE distinct (key, limit)s), then the
//! clock moves past the session idle time and the sweep runs until the
//! records are gone. Memory is flat when the RSS after each round's expiry
//! stays where the first round's was (the allocator keeps freed pages for
//! reuse, so RSS does not drop to the start; it must not grow).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a benchmark

use std::sync::Arc;
use std::time::{Duration, Instant};

use tenantgate::sync::{Report, SyncRequest, PROTOCOL_VERSION};
use tenantgate_central::service::{policy, IntakeLimits, ManualClock, Service, Settings, StateLimits};
use tenantgate_central::store::{EmbeddedStore, Store};

const POLICY: &str = r#"
version: "memory"
identity: { header: x-tenant-id }
plans:
  free:
    limits:
      - { name: per-min, rate: 6000, per: 1m, burst: 1000 }
tenants: []
default_plan: free
anonymous: { plan: free }
routes:
  api: {}
"#;

const NODES: u64 = 100_000;
const KEYS_PER_NODE: u64 = 10;
const ROUNDS: u64 = 3;

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = Arc::new(EmbeddedStore::new());
        let clock = Arc::new(ManualClock::new(1_000_000_000_000));
        let service = Service::with_limits(
            store.clone(),
            clock.clone(),
            Settings::default(),
            IntakeLimits::default(),
            StateLimits {
                max_sessions: NODES * 2,
                max_keys: NODES * KEYS_PER_NODE * 2,
                ..StateLimits::default()
            },
        );
        service.set_policy(&policy::parse(POLICY).unwrap());
        println!(
            "{NODES} node ids × {KEYS_PER_NODE} keys per round ({} distinct keys), {ROUNDS} rounds",
            NODES * KEYS_PER_NODE
        );
        println!("start: RSS {:.0} MiB", rss_mib());
        let mut after_expiry = Vec::new();
        for round in 0..ROUNDS {
            let started = Instant::now();
            for n in 0..NODES {
                let req = SyncRequest {
                    version: PROTOCOL_VERSION,
                    node_id: format!("node-{round}-{n}"),
                    region: format!("region-{}", n % 3),
                    policy_version: "memory".into(),
                    seq: 1,
                    boot: 1,
                    acked_seq: 0,
                    reports: (0..KEYS_PER_NODE)
                        .map(|k| Report {
                            key: format!("tenant-{round}-{n}-{k}|api"),
                            limit: "per-min".into(),
                            consumed: 1,
                            unleased: 0,
                            demand: 1,
                            failure_mode: None,
                            started_ms: None,
                        })
                        .collect(),
                    settings: None,
                };
                service.sync(&req).await.unwrap();
            }
            let filled = rss_mib();
            let (keys, sessions) = (
                store.key_count().await.unwrap(),
                store.session_count().await.unwrap(),
            );
            // Past every lease, local fallback and the session idle time;
            // then the sweep (once per interval in production) until the
            // buckets have refilled and the records are dropped.
            clock.advance(Duration::from_secs(1_000));
            let mut sweeps = 0;
            while store.key_count().await.unwrap() > 0 || store.session_count().await.unwrap() > 0 {
                service.sweep().await.unwrap();
                clock.advance(Duration::from_secs(1));
                sweeps += 1;
                assert!(sweeps < 100, "records did not expire");
            }
            let expired = rss_mib();
            after_expiry.push(expired);
            println!(
                "round {}: {keys} keys, {sessions} sessions → RSS {filled:.0} MiB; after expiry ({sweeps} sweeps) 0 keys, 0 sessions → RSS {expired:.0} MiB ({:.1} s)",
                round + 1,
                started.elapsed().as_secs_f64()
            );
        }
        let first = after_expiry[0];
        let last = after_expiry[after_expiry.len() - 1];
        println!(
            "RSS after expiry: first round {first:.0} MiB, last round {last:.0} MiB ({:+.1}%): {}",
            (last - first) / first * 100.0,
            if last <= first * 1.1 { "FLAT" } else { "GROWING" }
        );
    });
}
