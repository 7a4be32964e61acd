//! `make bench-service`: key reports processed per second by the central
//! service, per core, for the embedded store and for Redis.
//!
//! 1. In process, one thread (a current-thread runtime): `Service::sync`
//!    on batched requests, as the HTTP handler calls it. 20 nodes, each
//!    reporting the same 100 keys every interval (2,000 keys), the clock
//!    moved one interval per pass. Per core is per CPU-second of that
//!    thread (its on-CPU time from `/proc/thread-self/schedstat`), so a
//!    machine shared with other work gives the same figure as an idle one;
//!    the wall-clock rate is printed beside it. Both count the service's
//!    calls only: each pass's requests are built before its clock starts.
//!    Target: ≥ 400,000 key reports/s per core with the embedded store
//!    (PASS/MISS).
//! 2. The same against a `redis-server` started here (it runs on the other
//!    core; the figure is per core of the service), with Redis's own CPU
//!    per report (`INFO cpu`) beside the service's. Target: ≥ 100,000.
//! 3. The same against a Redis Cluster started here (three masters, each
//!    with a replica, on loopback: six `redis-server`s sharing the other
//!    core with the service's machine), twice: writes acknowledged after
//!    `WAIT` for the replica (the default, `?replicas=1`) and without
//!    (`?replicas=0`); the cluster's CPU per report is all six nodes'.
//!    No target: the figure to size a cluster with.
//! 4. Over HTTP on loopback (embedded store), a bounded number of requests
//!    from 4 concurrent clients: end to end, client included, both cores.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a benchmark

/// The allocator `tenantgate serve` runs with.
#[global_allocator]
static ALLOCATOR: tenantgate_central::ServiceAllocator = tenantgate_central::ServiceAllocator;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tenantgate::sync::{Report, SyncRequest, PROTOCOL_VERSION};
use tenantgate_central::service::{
    policy, serve_on, Auth, Listeners, ManualClock, ServeOptions, Service, Settings,
};
use tenantgate_central::store::{EmbeddedStore, RedisClusterStore, RedisStore, Store};
use tenantgate_central::testing::{redis_cpu_ns, RedisCluster, RedisServer};

const POLICY: &str = r#"
version: "bench"
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
sync: { cluster: tenantgate }
"#;

const NODES: usize = 20;
const KEYS_PER_NODE: usize = 100;
const TARGET: f64 = 400_000.0;
const TARGET_REDIS: f64 = 100_000.0;

/// This thread's time on a CPU so far, in ns.
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A run: key reports, wall time, and this thread's CPU time.
struct Run {
    reports: u64,
    wall: Duration,
    cpu_ns: u64,
}

impl Run {
    fn per_core(&self) -> f64 {
        self.reports as f64 / (self.cpu_ns.max(1) as f64 / 1e9)
    }
    fn per_wall_s(&self) -> f64 {
        per_s(self.reports, self.wall)
    }
}

fn requests(seq: u64) -> Vec<SyncRequest> {
    (0..NODES)
        .map(|n| SyncRequest {
            version: PROTOCOL_VERSION,
            node_id: format!("node-{n}"),
            region: format!("region-{}", n % 3),
            policy_version: "bench".into(),
            seq,
            boot: 0,
            acked_seq: seq - 1,
            reports: (0..KEYS_PER_NODE)
                .map(|k| Report {
                    // Keys are shared by 4 nodes each, as tenants are.
                    key: format!("tenant-{}|api", (n % 5) * KEYS_PER_NODE + k),
                    limit: "per-min".into(),
                    consumed: 3,
                    unleased: 0,
                    demand: 4,
                    failure_mode: None,
                    started_ms: None,
                })
                .collect(),
            settings: None,
        })
        .collect()
}

fn service(store: Arc<dyn Store>, clock: Arc<ManualClock>) -> Arc<Service> {
    let s = Service::new(store, clock, Settings::default());
    s.set_policy(&policy::parse(POLICY).unwrap());
    Arc::new(s)
}

/// Passes over every node until `budget` has elapsed (at least `min_passes`).
async fn run_in_process(store: Arc<dyn Store>, budget: Duration, min_passes: u64) -> Run {
    let clock = Arc::new(ManualClock::new(1_000_000_000_000));
    let svc = service(store, clock.clone());
    // Warm up: create every key.
    for req in requests(1) {
        svc.sync(&req).await.unwrap();
    }
    let started = Instant::now();
    let mut cpu_ns = 0u64;
    let mut wall = Duration::ZERO;
    let mut reports = 0u64;
    let mut seq = 2;
    while started.elapsed() < budget || seq < 2 + min_passes {
        // The nodes' requests are built outside the measured time: the
        // figure is the service's, not this loop's formatting.
        let batch = requests(seq);
        let pass = Instant::now();
        let cpu = thread_cpu_ns();
        clock.advance(svc.interval());
        for req in &batch {
            svc.sync(req).await.unwrap();
            reports += req.reports.len() as u64;
        }
        cpu_ns += thread_cpu_ns().saturating_sub(cpu);
        wall += pass.elapsed();
        seq += 1;
    }
    Run {
        reports,
        wall,
        cpu_ns,
    }
}

async fn http_post(addr: std::net::SocketAddr, body: &str) -> u16 {
    tenantgate_central::testing::http(addr, "POST", "/v1/sync", body)
        .await
        .map_or(0, |(status, _)| status)
}

fn per_s(reports: u64, took: Duration) -> f64 {
    reports as f64 / took.as_secs_f64()
}

fn main() {
    let one_thread = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };

    let run = one_thread().block_on(run_in_process(
        Arc::new(EmbeddedStore::new()),
        Duration::from_secs(3),
        5,
    ));
    let embedded = run.per_core();
    let verdict = if embedded >= TARGET { "PASS" } else { "MISS" };
    println!(
        "embedded, in process, 1 core: {embedded:>10.0} key reports/s per core ({} in {:.2} s of CPU, {:.2} s wall: {:.0}/s; batches of {KEYS_PER_NODE}) [{verdict}: target {TARGET:.0}]",
        run.reports,
        run.cpu_ns as f64 / 1e9,
        run.wall.as_secs_f64(),
        run.per_wall_s(),
    );

    let redis = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let store: Arc<dyn Store> = Arc::new(RedisStore::new(&redis.url(), "bench").unwrap());
    let rt = one_thread();
    let redis_before = redis_cpu_ns(&redis.url()).unwrap();
    let run = rt.block_on(run_in_process(store, Duration::from_secs(3), 5));
    let redis_cpu = redis_cpu_ns(&redis.url()).unwrap().saturating_sub(redis_before);
    let per_core = run.per_core();
    println!(
        "redis,    in process, 1 core: {per_core:>10.0} key reports/s per core of the service ({} in {:.2} s of CPU, {:.2} s wall: {:.0}/s) [{}: target {TARGET_REDIS:.0}]; \
         CPU per report: service {:.2} us, redis-server {:.2} us",
        run.reports,
        run.cpu_ns as f64 / 1e9,
        run.wall.as_secs_f64(),
        run.per_wall_s(),
        if per_core >= TARGET_REDIS { "PASS" } else { "MISS" },
        run.cpu_ns as f64 / 1e3 / run.reports.max(1) as f64,
        redis_cpu as f64 / 1e3 / run.reports.max(1) as f64,
    );
    drop(redis);

    let cluster = RedisCluster::start().unwrap_or_else(|e| panic!("{e}"));
    for replicas in [1, 0] {
        let url = format!("{}?replicas={replicas}", cluster.url());
        let store: Arc<dyn Store> =
            Arc::new(RedisClusterStore::new(&url, &format!("bench{replicas}")).unwrap());
        let cpu = || -> u64 { cluster.node_urls().iter().map(|u| redis_cpu_ns(u).unwrap()).sum() };
        let rt = one_thread();
        let before = cpu();
        let run = rt.block_on(run_in_process(store, Duration::from_secs(3), 5));
        let cluster_cpu = cpu().saturating_sub(before);
        println!(
            "cluster (3 masters + 3 replicas, WAIT for {replicas}), in process, 1 core: {:>10.0} key reports/s per core of the service ({} in {:.2} s of CPU, {:.2} s wall: {:.0}/s); \
             CPU per report: service {:.2} us, the cluster's 6 redis-servers {:.2} us",
            run.per_core(),
            run.reports,
            run.cpu_ns as f64 / 1e9,
            run.wall.as_secs_f64(),
            run.per_wall_s(),
            run.cpu_ns as f64 / 1e3 / run.reports.max(1) as f64,
            cluster_cpu as f64 / 1e3 / run.reports.max(1) as f64,
        );
    }
    drop(cluster);

    // HTTP, embedded store, bounded count.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let clock = Arc::new(ManualClock::new(1_000_000_000_000));
        let svc = service(Arc::new(EmbeddedStore::new()), clock.clone());
        let sync = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = sync.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let opts = ServeOptions {
            listen: addr,
            admin: admin.local_addr().unwrap(),
            policy: std::path::PathBuf::from("/nonexistent/policy.yaml"),
            policy_poll: Duration::from_secs(3600),
            grpc: None,
            limits: Default::default(),
            auth: Auth::default(),
        };
        let server = tokio::spawn(serve_on(svc.clone(), Listeners { sync, admin }, opts, async {
            let _ = rx.await;
        }));
        let passes = 100u64;
        let started = Instant::now();
        let mut reports = 0u64;
        for seq in 1..=passes {
            clock.advance(svc.interval());
            let bodies: Vec<String> = requests(seq).iter().map(|r| r.to_json()).collect();
            let mut tasks = Vec::new();
            for chunk in bodies.chunks(NODES / 4) {
                let chunk = chunk.to_vec();
                tasks.push(tokio::spawn(async move {
                    for b in chunk {
                        assert_eq!(http_post(addr, &b).await, 200);
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
            reports += (NODES * KEYS_PER_NODE) as u64;
        }
        let took = started.elapsed();
        println!(
            "embedded, HTTP loopback, 2 cores (client included): {:>10.0} key reports/s ({} requests of {KEYS_PER_NODE} in {:.2} s, {:.2} ms per request)",
            per_s(reports, took),
            passes * NODES as u64,
            took.as_secs_f64(),
            took.as_secs_f64() * 1000.0 / (passes * NODES as u64) as f64
        );
        let _ = tx.send(());
        let _ = server.await;
    });
}
