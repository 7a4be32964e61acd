//! `make bench-service` (second part): quota reserve+commit pairs per
//! second, for the SQLite store (synchronous=FULL, WAL) and a PostgreSQL
//! started here with its default settings (fsync on).
//!
//! 8 concurrent callers in process (no HTTP), each pair a reserve then a
//! commit of the whole amount, spread over 4 tenants × 4 projects of one
//! resource (so every pair contends on the global counter, as it does in
//! production). Bounded: 3 s or 50,000 pairs, whichever comes first.
//! Printed: pairs/s (wall) and pairs per CPU-second of this process (the
//! service's own CPU; PostgreSQL's server processes are not counted).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a benchmark

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tenantgate::policy::quota::LevelLimits;
use tenantgate_central::quota::{PostgresStore, QuotaStore, ReserveRequest, SqliteStore};
use tenantgate_central::testing::PostgresServer;

const CALLERS: u64 = 8;
const MAX_PAIRS: u64 = 50_000;
const SECONDS: u64 = 3;

/// This process's user+system CPU time (Linux, 100 ticks per second).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

async fn run(store: Arc<dyn QuotaStore>) -> (u64, Duration, f64) {
    let limits = LevelLimits {
        global: u64::MAX / 4,
        tenant: u64::MAX / 4,
        project: u64::MAX / 4,
    };
    let done = Arc::new(AtomicU64::new(0));
    let cpu0 = cpu_seconds();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(SECONDS);
    let mut tasks = Vec::new();
    for c in 0..CALLERS {
        let store = store.clone();
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < deadline && done.load(Relaxed) < MAX_PAIRS {
                let id = format!("b{c}-{i}");
                let r = ReserveRequest {
                    reservation_id: id.clone(),
                    resource: "gpu".into(),
                    tenant: format!("t{}", i % 4),
                    project: format!("p{}", (i / 4) % 4),
                    amount: 1,
                    ttl_ms: 60_000,
                };
                let now = 1_764_547_200_000_000_000 + i;
                assert_eq!(store.reserve(&r, limits, now).await.unwrap().status, 201);
                assert_eq!(store.commit(&id, None, now).await.unwrap().status, 200);
                done.fetch_add(1, Relaxed);
                i += 1;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    (done.load(Relaxed), started.elapsed(), cpu_seconds() - cpu0)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let sqlite: Arc<dyn QuotaStore> = Arc::new(SqliteStore::open(dir.path()).await.unwrap());
        let (n, took, cpu) = run(sqlite).await;
        println!(
            "quota sqlite:   {:>8.0} reserve+commit pairs/s, {:>8.0} per CPU-second of the service ({n} pairs in {:.2} s, {CALLERS} callers, synchronous=FULL)",
            n as f64 / took.as_secs_f64(),
            n as f64 / cpu.max(0.01),
            took.as_secs_f64()
        );
        let pg = PostgresServer::start().unwrap_or_else(|e| panic!("PostgreSQL did not start: {e}"));
        let store: Arc<dyn QuotaStore> = Arc::new(PostgresStore::connect(&pg.url(), 8).await.unwrap());
        store.ping().await.unwrap();
        let (n, took, cpu) = run(store).await;
        println!(
            "quota postgres: {:>8.0} reserve+commit pairs/s, {:>8.0} per CPU-second of the service ({n} pairs in {:.2} s, {CALLERS} callers, pool of 8, fsync on)",
            n as f64 / took.as_secs_f64(),
            n as f64 / cpu.max(0.01),
            took.as_secs_f64()
        );
    });
}
