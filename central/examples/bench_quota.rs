//! `make bench-service` (second part): quota reserve+commit pairs per
//! second, for the SQLite store (synchronous=FULL, WAL) and a PostgreSQL
//! started here with its default settings (fsync on).
//!
//! 64 concurrent callers in process (no HTTP), each pair a reserve then a
//! commit of the whole amount, spread over 4 tenants × 4 projects of one
//! resource (so every pair contends on the global counter: a hot
//! resource). Each store twice in the same run: operations applied in
//! batches (one transaction per batch, `quota::batch`), and one
//! transaction per operation (`with_max_batch(1)`, the path before
//! batching), with the ratio. Bounded: 3 s or 50,000 pairs, whichever
//! comes first. Printed: pairs/s (wall) and pairs per CPU-second of this
//! process (the service's own CPU; PostgreSQL's server processes are not
//! counted). Targets (batched): ≥ 10,000 on SQLite (synchronous=FULL),
//! ≥ 5,000 on PostgreSQL (fsync on).
//!
//! The disk's flush latency is one bound on both (CPU the other, on a disk
//! that flushes in a fraction of a millisecond): each caller has one operation
//! outstanding and a pair is two, so a batch holds at most `CALLERS`
//! operations and pairs/s ≤ `CALLERS / 2` per flush. The median of 50
//! synced 4 KiB writes in the same directory is printed first, with that
//! ceiling.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a benchmark

/// The allocator `tenantgate serve` runs with.
#[global_allocator]
static ALLOCATOR: tenantgate_central::ServiceAllocator = tenantgate_central::ServiceAllocator;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tenantgate::policy::quota::LevelLimits;
use tenantgate_central::quota::{Kind, PostgresStore, QuotaStore, ReserveRequest, SqliteStore};
use tenantgate_central::testing::PostgresServer;

const CALLERS: u64 = 64;
const TARGET_SQLITE: f64 = 10_000.0;
const TARGET_POSTGRES: f64 = 5_000.0;
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

async fn run(store: Arc<dyn QuotaStore>, run_id: &'static str) -> (u64, Duration, f64) {
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
                let id = format!("{run_id}{c}-{i}");
                let r = ReserveRequest {
                    reservation_id: id.clone(),
                    resource: "gpu".into(),
                    tenant: format!("t{}", i % 4),
                    project: format!("p{}", (i / 4) % 4),
                    amount: 1,
                    ttl_ms: 60_000,
                };
                let now = 1_764_547_200_000_000_000 + i;
                assert_eq!(store.reserve(&r, limits, now).await.unwrap().kind, Kind::Created);
                assert_eq!(store.commit(&id, None, now).await.unwrap().kind, Kind::Done);
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

/// The median time of a synced 4 KiB write (`File::sync_data`) in `dir`.
fn flush_latency(dir: &std::path::Path) -> Duration {
    use std::io::Write;
    let mut f = std::fs::File::create(dir.join("flush-probe")).unwrap();
    let mut times: Vec<Duration> = (0..50)
        .map(|_| {
            let t = Instant::now();
            f.write_all(&[0u8; 4096]).unwrap();
            f.sync_data().unwrap();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let report = |store: &str, how: &str, (n, took, cpu): (u64, Duration, f64)| {
            let rate = n as f64 / took.as_secs_f64();
            println!(
                "quota {store:<8} {how:<13} {rate:>8.0} reserve+commit pairs/s, {:>8.0} per CPU-second of the service ({n} pairs in {:.2} s, {CALLERS} callers on one resource)",
                n as f64 / cpu.max(0.01),
                took.as_secs_f64()
            );
            rate
        };
        let verdict = |rate: f64, target: f64| if rate >= target { "PASS" } else { "MISS" };
        let dir = tempfile::tempdir().unwrap();
        let flush = flush_latency(dir.path());
        println!(
            "disk flush (synced 4 KiB write, median of 50): {:.2} ms: at most {:.0} pairs/s for {CALLERS} callers at one flush per batch",
            flush.as_secs_f64() * 1e3,
            (CALLERS / 2) as f64 / flush.as_secs_f64()
        );
        let batched: Arc<dyn QuotaStore> = Arc::new(SqliteStore::open(dir.path()).await.unwrap());
        let b = report("sqlite", "batched", run(batched, "b").await);
        let dir1 = tempfile::tempdir().unwrap();
        let one: Arc<dyn QuotaStore> = Arc::new(SqliteStore::open(dir1.path()).await.unwrap().with_max_batch(1));
        let o = report("sqlite", "per operation", run(one, "o").await);
        println!(
            "quota sqlite   batched / per operation: {:.1}x [{}: target {TARGET_SQLITE:.0} pairs/s batched, synchronous=FULL]",
            b / o.max(1.0),
            verdict(b, TARGET_SQLITE)
        );
        let pg = PostgresServer::start().unwrap_or_else(|e| panic!("PostgreSQL did not start: {e}"));
        let batched: Arc<dyn QuotaStore> = Arc::new(PostgresStore::connect(&pg.url(), 8).await.unwrap());
        batched.ping().await.unwrap();
        let b = report("postgres", "batched", run(batched, "b").await);
        let one: Arc<dyn QuotaStore> =
            Arc::new(PostgresStore::connect(&pg.url(), 8).await.unwrap().with_max_batch(1));
        let o = report("postgres", "per operation", run(one, "o").await);
        println!(
            "quota postgres batched / per operation: {:.1}x [{}: target {TARGET_POSTGRES:.0} pairs/s batched, fsync on, pool of 8]",
            b / o.max(1.0),
            verdict(b, TARGET_POSTGRES)
        );
    });
}
