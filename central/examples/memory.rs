//! `make bench-service-memory`: the service's resident memory under a flood
//! of distinct node ids and keys, and after expiry (issue #8, "bounded
//! state"). Not a timed test: it prints the figures.
//!
//! The embedded store, in process, on the service's own clock (moved by
//! hand). Each round: `NODES` new node ids, each reporting `KEYS_PER_NODE`
//! new keys once (NODES × KEYS_PER_NODE distinct (key, limit)s), then the
//! clock moves past the session idle time and the sweep runs until the
//! records are gone. Memory is flat when the RSS with each round's records
//! in place stays where the first round's was (a leak would grow it). The
//! RSS right after expiry is printed too: the allocator keeps freed pages a
//! while (mimalloc, the service's, returns them after a delay, at once with
//! `MIMALLOC_PURGE_DELAY=0`), so it moves from round to round.
//!
//! Per (key, limit): the RSS growth over the keys (everything: records,
//! sessions, tables, malloc's overhead), and the store's own account of
//! its key records alone (each record with its name, version and table
//! slot, `EmbeddedStore::footprint`); sessions are per node (here each
//! holds 10 keys, so a tenth of one is charged to each key in the RSS
//! figure). Target: ≤ 256 B per (key, limit) record.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a benchmark

/// The allocator `tenantgate serve` runs with.
#[global_allocator]
static ALLOCATOR: tenantgate_central::ServiceAllocator = tenantgate_central::ServiceAllocator;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tenantgate::sync::{Report, SyncRequest, PROTOCOL_VERSION};
use tenantgate_central::service::{policy, IntakeLimits, ManualClock, Service, Settings, StateLimits};
use tenantgate_central::store::{EmbeddedStore, RedisStore, Store};
use tenantgate_central::testing::RedisServer;

const POLICY: &str = r#"
version: "memory"
identity: { header: x-tenant-id }
plans:
  free:
    limits:
      - { name: per-min, rate: 6000, per: 1m, burst: 1000, global: true }
tenants: []
default_plan: free
anonymous: { plan: free }
routes:
  api: {}
"#;

const NODES: u64 = 100_000;
/// Node ids the Redis phase fills (× `KEYS_PER_NODE` keys).
const REDIS_NODES: u64 = 100_000;
const KEYS_PER_NODE: u64 = 10;
const ROUNDS: u64 = 3;
/// 2026-12-01 in ns since the epoch: the service's clock is the system
/// clock, and its timestamps are this large in every record.
const NOW_2026_NS: u64 = 1_796_083_200_000_000_000;

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

fn request(round: u64, n: u64) -> SyncRequest {
    SyncRequest {
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
    }
}

/// Redis: `MEMORY USAGE` of the records (a sample of 1,000 of each kind)
/// and `used_memory`'s growth per key, with every key of the embedded
/// phase's first round in one `redis-server`.
async fn redis_phase(clock: Arc<ManualClock>) {
    let server = RedisServer::start().unwrap();
    let store = Arc::new(RedisStore::new(&server.url(), "tg").unwrap());
    let service = Service::with_limits(
        store.clone(),
        clock,
        Settings::default(),
        IntakeLimits::default(),
        StateLimits {
            max_sessions: REDIS_NODES * 2,
            max_keys: REDIS_NODES * KEYS_PER_NODE * 2,
            ..StateLimits::default()
        },
    );
    service.set_policy(&policy::parse(POLICY).unwrap());
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let used = |info: String| -> f64 {
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let before: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn)
        .await
        .unwrap();
    let started = Instant::now();
    for n in 0..REDIS_NODES {
        service.sync(&request(0, n)).await.unwrap();
    }
    let after: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn)
        .await
        .unwrap();
    let keys = REDIS_NODES * KEYS_PER_NODE;
    let usage = |names: Vec<String>| {
        let mut conn = conn.clone();
        async move {
            let mut pipe = redis::pipe();
            for n in &names {
                pipe.cmd("MEMORY").arg("USAGE").arg(n).arg("SAMPLES").arg(0);
            }
            let sizes: Vec<u64> = pipe.query_async(&mut conn).await.unwrap();
            sizes.iter().sum::<u64>() as f64 / sizes.len().max(1) as f64
        }
    };
    let per_key = usage(
        (0..1000u64)
            .map(|i| {
                format!(
                    "tg:{{tenant-0-{}-{}|api}}:per-min",
                    i * 97 % REDIS_NODES,
                    i % KEYS_PER_NODE
                )
            })
            .collect(),
    )
    .await;
    let per_session = usage(
        (0..1000u64)
            .map(|i| format!("tg:n:{{node-0-{}}}", i * 97 % REDIS_NODES))
            .collect(),
    )
    .await;
    let grown = used(after) - used(before);
    println!(
        "redis: {keys} keys, {REDIS_NODES} sessions ({:.1} s): MEMORY USAGE {per_key:.0} B per (key, limit) [{}: target 256], \
         {per_session:.0} B per session of {KEYS_PER_NODE} keys; used_memory grew {:.0} MiB ({:.0} B per key, sessions and the nodes set included)",
        started.elapsed().as_secs_f64(),
        if per_key <= 256.0 { "PASS" } else { "MISS" },
        grown / 1024.0 / 1024.0,
        grown / keys as f64,
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = Arc::new(EmbeddedStore::new());
        let clock = Arc::new(ManualClock::new(NOW_2026_NS));
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
        let start = rss_mib();
        println!("start: RSS {start:.0} MiB");
        let mut after_expiry = Vec::new();
        let mut full = Vec::new();
        for round in 0..ROUNDS {
            let started = Instant::now();
            for n in 0..NODES {
                let req = request(round, n);
                service.sync(&req).await.unwrap();
            }
            let filled = rss_mib();
            full.push(filled);
            let f = store.footprint();
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
                "round {}: {keys} keys, {sessions} sessions → RSS {filled:.0} MiB ({:.0} B per key, sessions included); \
                 records: {:.0} B per (key, limit) [{}: target 256], {:.0} B per session of {KEYS_PER_NODE} keys; \
                 after expiry ({sweeps} sweeps) 0 keys, 0 sessions → RSS {expired:.0} MiB ({:.1} s)",
                round + 1,
                (filled - start) * 1024.0 * 1024.0 / keys.max(1) as f64,
                f.key_bytes as f64 / f.keys.max(1) as f64,
                if f.key_bytes <= 256 * f.keys { "PASS" } else { "MISS" },
                f.session_bytes as f64 / f.sessions.max(1) as f64,
                started.elapsed().as_secs_f64()
            );
        }
        redis_phase(clock.clone()).await;
        // Flat: the RSS with a round's records in place does not grow
        // from round to round (what a leak would do). The figure right
        // after expiry is printed too, but it depends on when the
        // allocator returns freed pages (mimalloc: after a delay).
        let (first, last) = (full[0], full[full.len() - 1]);
        let (low, high) = after_expiry
            .iter()
            .fold((f64::MAX, 0.0f64), |(l, h), &v| (l.min(v), h.max(v)));
        println!(
            "RSS filled: first round {first:.0} MiB, last round {last:.0} MiB ({:+.1}%): {}; right after expiry {low:.0}-{high:.0} MiB",
            (last - first) / first * 100.0,
            if last <= first * 1.1 { "FLAT" } else { "GROWING" }
        );
    });
}
