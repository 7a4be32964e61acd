//! T3: the service's scenarios, each written once and run against every
//! store: embedded, a real `redis-server` that each test starts on a free
//! loopback port (persistence off, a temp dir) and kills at the end, and a
//! real Redis Cluster (three masters, each with a replica, formed by
//! `redis-cli --cluster create`) started the same way. A missing
//! `redis-server` fails the Redis tests with a message saying how to
//! install it.
//!
//! Time is the service's [`ManualClock`]: a test moves it by whole
//! intervals. Conditions that depend on background tasks (the policy
//! watcher) are waited for with a deadline, never a bare sleep.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tenantgate::sync::{Report, SyncRequest, SyncResponse, PROTOCOL_VERSION};
use tenantgate_central::service::{
    serve_on, Auth, IntakeLimits, Listeners, ManualClock, ServeOptions, Service, Settings, StateLimits,
};
use tenantgate_central::store::{EmbeddedStore, KeySlot, RedisClusterStore, RedisStore, Store, Txn};
use tenantgate_central::testing::{RedisCluster, RedisServer};
use tokio::sync::oneshot;

const SEC: u64 = 1_000_000_000;
const T0: u64 = 1_000 * SEC;

const POLICY_V1: &str = r#"
version: "v1"
identity: { header: x-tenant-id }
plans:
  free:
    limits:
      - { name: per-10s, rate: 1000, per: 10s, burst: 200, global: true }
tenants: []
default_plan: free
anonymous: { plan: free }
routes:
  api: {}
sync: { cluster: tenantgate }
"#;

const POLICY_V2: &str = r#"
version: "v2"
identity: { header: x-tenant-id }
plans:
  free:
    limits:
      - { name: per-10s, rate: 1000, per: 10s, burst: 200, global: true }
  paid:
    limits:
      - { name: paid-per-10s, rate: 5000, per: 10s, burst: 900, global: true }
tenants: [{ id: t-paid, plan: paid }]
default_plan: free
anonymous: { plan: free }
routes:
  api: {}
sync: { cluster: tenantgate }
"#;

/// A store kind under test.
enum Backend {
    Embedded(Arc<EmbeddedStore>),
    Redis(RedisServer),
    Cluster(RedisCluster),
}

impl Backend {
    fn embedded() -> Backend {
        Backend::Embedded(Arc::new(EmbeddedStore::new()))
    }

    fn redis() -> Backend {
        Backend::Redis(RedisServer::start().unwrap_or_else(|e| panic!("{e}")))
    }

    fn cluster() -> Backend {
        Backend::Cluster(RedisCluster::start().unwrap_or_else(|e| panic!("{e}")))
    }

    /// Stops the store's servers (an outage); `false` for the embedded
    /// store, which cannot go away.
    fn stop(&mut self) -> bool {
        match self {
            Backend::Embedded(_) => false,
            Backend::Redis(r) => {
                r.stop();
                true
            }
            Backend::Cluster(c) => {
                c.stop_all();
                true
            }
        }
    }

    /// A store handle: the same one for embedded, a new client for Redis
    /// (as a second replica would have).
    fn store(&self) -> Arc<dyn Store> {
        match self {
            Backend::Embedded(s) => s.clone(),
            Backend::Redis(r) => Arc::new(RedisStore::new(&r.url(), "tgtest").unwrap()),
            Backend::Cluster(c) => Arc::new(RedisClusterStore::new(&cluster_url(c), "tgtest").unwrap()),
        }
    }
}

/// The cluster's URL for a test: `WAIT` up to the longest the store
/// accepts, so replicas that lag on a loaded 2-core machine (six
/// `redis-server`s beside the tests) answer late rather than fail a test
/// about something else (`503`, "a write reached 0 of 1 replicas").
fn cluster_url(c: &RedisCluster) -> String {
    format!("{}?wait_ms={}", c.url(), tenantgate_central::store::MAX_WAIT_MS)
}

/// One replica on loopback ports (sync and admin), with its own policy
/// watcher.
struct Instance {
    addr: SocketAddr,
    admin: SocketAddr,
    service: Arc<Service>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    /// The runtime the replica runs on, if not the test's.
    runtime: Option<Isolated>,
}

/// A runtime of its own, so a test's load generator does not queue in
/// front of the service's tasks (as a remote attacker would not).
struct Isolated(Option<tokio::runtime::Runtime>);

impl Drop for Isolated {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl Instance {
    async fn start(store: Arc<dyn Store>, clock: Arc<ManualClock>, policy: &Path) -> Instance {
        Instance::start_with(Service::new(store, clock, Settings::default()), policy).await
    }

    async fn start_with(service: Service, policy: &Path) -> Instance {
        Instance::start_on(service, policy, None, Auth::default()).await
    }

    /// On a runtime of its own, with two worker threads.
    async fn start_isolated(service: Service, policy: &Path) -> Instance {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        Instance::start_on(service, policy, Some(Isolated(Some(rt))), Auth::default()).await
    }

    async fn start_on(service: Service, policy: &Path, runtime: Option<Isolated>, auth: Auth) -> Instance {
        let service = Arc::new(service);
        let sync = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = sync.local_addr().unwrap();
        let admin_addr = admin.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let opts = ServeOptions {
            listen: addr,
            admin: admin_addr,
            policy: policy.to_owned(),
            policy_poll: Duration::from_millis(20),
            grpc: None,
            limits: Default::default(),
            auth,
        };
        let serving = serve_on(service.clone(), Listeners { sync, admin }, opts, async {
            let _ = rx.await;
        });
        let task = match runtime.as_ref().and_then(|r| r.0.as_ref()) {
            Some(rt) => {
                let _guard = rt.enter();
                // Listeners are registered with the runtime that polls them.
                rt.spawn(serving)
            }
            None => tokio::spawn(serving),
        };
        Instance {
            addr,
            admin: admin_addr,
            service,
            stop: Some(tx),
            task,
            runtime,
        }
    }

    /// On the admin listener.
    async fn get(&self, path: &str) -> (u16, String) {
        http(self.admin, "GET", path, "").await
    }

    async fn sync(&self, req: &SyncRequest) -> (u16, String) {
        http(self.addr, "POST", "/v1/sync", &req.to_json()).await
    }

    async fn lease(&self, req: &SyncRequest) -> SyncResponse {
        let (status, body) = self.sync(req).await;
        assert_eq!(status, 200, "{body}");
        SyncResponse::from_json(body.as_bytes()).unwrap()
    }

    async fn metric(&self, line_start: &str) -> Option<String> {
        let (_, text) = self.get("/metrics").await;
        text.lines()
            .find(|l| l.starts_with(line_start))
            .map(|l| l[line_start.len()..].trim().to_owned())
    }

    async fn shutdown(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        tokio::time::timeout(Duration::from_secs(5), &mut self.task)
            .await
            .expect("graceful shutdown within 5 s")
            .unwrap()
            .unwrap();
        drop(self.runtime.take());
    }
}

async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    tenantgate_central::testing::http(addr, method, path, body)
        .await
        .unwrap()
}

/// Waits for `cond` with a deadline.
async fn wait_for<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn request(node: &str, seq: u64, acked: u64, reports: &[(&str, &str, u64)]) -> SyncRequest {
    SyncRequest {
        version: PROTOCOL_VERSION,
        node_id: node.into(),
        region: format!("region-{}", node.len() % 2),
        policy_version: "v1".into(),
        seq,
        boot: 0,
        acked_seq: acked,
        reports: reports
            .iter()
            .map(|(key, limit, n)| Report {
                key: (*key).into(),
                limit: (*limit).into(),
                consumed: *n,
                unleased: 0,
                demand: *n,
                failure_mode: None,
                started_ms: None,
            })
            .collect(),
        settings: None,
    }
}

fn policy_file(text: &str) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), text).unwrap();
    f
}

// ---- scenarios -------------------------------------------------------------

async fn sync_round_trip(b: Backend) {
    let policy = policy_file(POLICY_V1);
    let clock = Arc::new(ManualClock::new(T0));
    let a = Instance::start(b.store(), clock.clone(), policy.path()).await;
    let resp = a.lease(&request("n1", 1, 0, &[("t|api", "per-10s", 3)])).await;
    assert_eq!(resp.ack_seq, 1);
    assert_eq!(resp.interval_ms, 1000);
    assert_eq!(resp.leases.len(), 1);
    let l = &resp.leases[0];
    assert_eq!(
        (l.key.as_str(), l.limit.as_str(), l.ttl_ms),
        ("t|api", "per-10s", 3000)
    );
    assert!(l.tokens > 0 && l.tokens <= 200, "{l:?}");

    // A batch: several keys in one request, answered in its order.
    clock.advance(Duration::from_secs(1));
    let keys: Vec<String> = (0..50).map(|i| format!("t{i}|api")).collect();
    let reports: Vec<(&str, &str, u64)> = keys.iter().map(|k| (k.as_str(), "per-10s", 1)).collect();
    let resp = a.lease(&request("n1", 2, 1, &reports)).await;
    assert_eq!(resp.leases.len(), 50);
    assert!(resp.leases.iter().zip(&keys).all(|(l, k)| &l.key == k));
    assert_eq!(b.store().key_count().await.unwrap(), 51);

    // Refusals: garbage, another version, a limit the policy lacks.
    assert_eq!(http(a.addr, "POST", "/v1/sync", "{nope").await.0, 400);
    let mut v2 = request("n1", 3, 2, &[]);
    v2.version = 2;
    assert_eq!(a.sync(&v2).await.0, 400);
    let resp = a
        .lease(&request("n1", 4, 2, &[("t|api", "no-such-limit", 1)]))
        .await;
    assert!(resp.leases.is_empty());
    assert_eq!(
        a.metric("tenantgate_sync_unknown_limits_total").await.as_deref(),
        Some("1")
    );
    a.shutdown().await;
}

/// Two replicas sharing one store: six nodes that each want far more than
/// the limit, spread over both replicas and sending at once. Whatever the
/// interleaving, the leases out at any time never sum above the burst, and
/// the tokens granted in total never exceed the burst plus the refill.
async fn two_instances_share_one_store(b: Backend) {
    let policy = policy_file(POLICY_V1);
    let clock = Arc::new(ManualClock::new(T0));
    let a = Arc::new(Instance::start(b.store(), clock.clone(), policy.path()).await);
    let c = Arc::new(Instance::start(b.store(), clock.clone(), policy.path()).await);
    let nodes: Vec<String> = (0..6).map(|i| format!("node-{i}")).collect();
    let mut last_tokens = vec![0u64; nodes.len()];
    let (limit, window_s, burst) = (1000u64, 10u64, 200u64);
    let rounds = 12u64;
    for round in 1..=rounds {
        let mut tasks = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            let inst = if (i as u64 + round) % 2 == 0 {
                a.clone()
            } else {
                c.clone()
            };
            // Each node used all of its last lease, and wants 500 more.
            let req = SyncRequest {
                reports: vec![Report {
                    key: "tenant-x|api".into(),
                    limit: "per-10s".into(),
                    consumed: last_tokens[i],
                    unleased: 0,
                    demand: 500,
                    failure_mode: None,
                    started_ms: None,
                }],
                ..request(node, round, round - 1, &[])
            };
            tasks.push(tokio::spawn(async move { inst.lease(&req).await }));
        }
        let mut sum = 0;
        for (i, t) in tasks.into_iter().enumerate() {
            let resp = t.await.unwrap();
            last_tokens[i] = resp.leases[0].tokens;
            sum += last_tokens[i];
        }
        assert!(sum <= burst, "round {round}: leases sum to {sum} > burst {burst}");
        let ks = b
            .store()
            .key(&("tenant-x|api".into(), "per-10s".into()))
            .await
            .unwrap()
            .unwrap();
        let view = ks.view();
        let elapsed_s = round - 1;
        let refill = limit * elapsed_s / window_s;
        assert!(
            view.stats.granted <= burst + refill,
            "round {round}: granted {} > burst {burst} + refill {refill}",
            view.stats.granted
        );
        assert!(view.bucket + view.reserved <= burst);
        println!(
            "round {round}: leases {sum} granted {} (≤ {})",
            view.stats.granted,
            burst + refill
        );
        clock.advance(Duration::from_secs(1));
    }
    // Both replicas answered, and the tokens kept flowing at the limit's rate.
    assert!(
        a.metric("tenantgate_sync_requests_total{result=\"ok\"}")
            .await
            .unwrap()
            != "0"
    );
    assert!(
        c.metric("tenantgate_sync_requests_total{result=\"ok\"}")
            .await
            .unwrap()
            != "0"
    );
    let view = b
        .store()
        .key(&("tenant-x|api".into(), "per-10s".into()))
        .await
        .unwrap()
        .unwrap()
        .view();
    assert!(view.stats.granted >= limit * (rounds - 2) / window_s, "{view:?}");
    for i in [a, c] {
        Arc::into_inner(i).unwrap().shutdown().await;
    }
}

/// A report whose answer was lost is merged into the next one and counted
/// once; a duplicate (even at the other replica) counts nothing.
async fn lost_and_duplicate_reports_counted_once(b: Backend) {
    let policy = policy_file(POLICY_V1);
    let clock = Arc::new(ManualClock::new(T0));
    let a = Instance::start(b.store(), clock.clone(), policy.path()).await;
    let c = Instance::start(b.store(), clock.clone(), policy.path()).await;
    let id = ("t|api".to_owned(), "per-10s".to_owned());
    let consumed = || async { b.store().key(&id).await.unwrap().unwrap().view().stats.consumed };

    let first = a.lease(&request("n1", 1, 0, &[("t|api", "per-10s", 5)])).await;
    assert_eq!(consumed().await, 5);
    // The same request again, at the other replica (the node's second
    // copy, issue 35): answered with the same lease, not counted.
    let again = c.lease(&request("n1", 1, 0, &[("t|api", "per-10s", 5)])).await;
    assert_eq!(again, first);
    assert_eq!(consumed().await, 5);
    // Our answer to 1 was lost: 2 still acknowledges 0 and carries 5 + 3.
    clock.advance(Duration::from_secs(1));
    c.lease(&request("n1", 2, 0, &[("t|api", "per-10s", 8)])).await;
    assert_eq!(consumed().await, 8);
    // An older request, late: refused, not counted.
    let (status, body) = c.sync(&request("n1", 1, 0, &[("t|api", "per-10s", 5)])).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(consumed().await, 8);
    // 3 was lost on its way; 4 acknowledges 2 and carries 3's 4 plus 2.
    clock.advance(Duration::from_secs(1));
    a.lease(&request("n1", 4, 2, &[("t|api", "per-10s", 6)])).await;
    assert_eq!(consumed().await, 14);
    assert_eq!(
        c.metric("tenantgate_sync_requests_total{result=\"stale\"}")
            .await
            .as_deref(),
        Some("1")
    );
    // `top` counts the same deduplicated demand: 5 + 6 at one replica, the
    // retry's 3 new at the other (not its 8), 14 in all.
    let top_demand = |i: &Instance| {
        let i = i.admin;
        async move {
            let (status, body) = http(i, "GET", "/v1/top", "").await;
            assert_eq!(status, 200, "{body}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            v["regions"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|r| r["by_demand"].as_array().unwrap().clone())
                .filter(|e| e["key"] == "t|api")
                .map(|e| e["count"].as_f64().unwrap())
                .sum::<f64>()
        }
    };
    assert_eq!(top_demand(&a).await, 11.0);
    assert_eq!(top_demand(&c).await, 3.0);
    a.shutdown().await;
    c.shutdown().await;
}

async fn policy_hot_reload(b: Backend) {
    let policy = policy_file(POLICY_V1);
    let clock = Arc::new(ManualClock::new(T0));
    let a = Instance::start(b.store(), clock.clone(), policy.path()).await;
    let version = "tenantgate_policy_info{version=\"v1\"}";
    assert_eq!(a.metric(version).await.as_deref(), Some("1"));
    // A limit the policy does not have yet: no lease.
    let resp = a
        .lease(&request("n1", 1, 0, &[("t-paid|api", "paid-per-10s", 1)]))
        .await;
    assert!(resp.leases.is_empty());

    std::fs::write(policy.path(), POLICY_V2).unwrap();
    wait_for("policy v2", || async {
        a.metric("tenantgate_policy_info{version=\"v2\"}")
            .await
            .as_deref()
            == Some("1")
    })
    .await;
    clock.advance(Duration::from_secs(1));
    let mut req = request("n1", 2, 1, &[("t-paid|api", "paid-per-10s", 1)]);
    req.policy_version = "v2".into();
    let resp = a.lease(&req).await;
    assert_eq!(resp.leases.len(), 1);
    assert!(resp.leases[0].tokens > 0);

    // An invalid policy is refused and logged; v2 stays, still ready.
    // (The watcher loads a file only once it reads the same twice, so it
    // never sees this one half-written.)
    std::fs::write(policy.path(), "version: v3\nplans: {}\n").unwrap();
    wait_for("the refusal", || async {
        a.metric("tenantgate_policy_reloads_total{result=\"error\"}")
            .await
            .is_some_and(|v| v != "0")
    })
    .await;
    assert_eq!(
        a.metric("tenantgate_policy_info{version=\"v2\"}")
            .await
            .as_deref(),
        Some("1")
    );
    assert_eq!(a.get("/readyz").await.0, 200);
    a.shutdown().await;
}

async fn health_ready_and_metrics(mut b: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    let clock = Arc::new(ManualClock::new(T0));
    // No policy yet: alive, not ready, syncs refused as "try again".
    let a = Instance::start(b.store(), clock.clone(), &path).await;
    assert_eq!(a.get("/healthz").await, (200, "ok\n".to_owned()));
    // Separate listeners: no sync API on the admin address, no metrics on
    // the sync address.
    assert_eq!(http(a.admin, "POST", "/v1/sync", "{}").await.0, 404);
    assert_eq!(http(a.addr, "GET", "/metrics", "").await.0, 404);
    assert_eq!(http(a.addr, "GET", "/healthz", "").await.0, 404);
    let (status, body) = a.get("/readyz").await;
    assert_eq!(status, 503);
    assert!(body.contains("no policy"), "{body}");
    assert_eq!(a.sync(&request("n1", 1, 0, &[])).await.0, 503);
    // A policy it cannot take: /readyz says why.
    std::fs::write(&path, "version: v1\nplans: {free: {limits: [{rate: ten}]}}\n").unwrap();
    wait_for("the refusal in /readyz", || async {
        let (status, body) = a.get("/readyz").await;
        status == 503 && body.contains("no policy loaded: ") && body.contains("rate")
    })
    .await;

    std::fs::write(&path, POLICY_V1).unwrap();
    wait_for("ready", || async { a.get("/readyz").await.0 == 200 }).await;

    // A node on another policy version is answered, and counted as skew.
    let mut req = request("n1", 2, 0, &[("t|api", "per-10s", 1)]);
    req.policy_version = "v0".into();
    a.lease(&req).await;
    let (status, text) = a.get("/metrics").await;
    assert_eq!(status, 200);
    for name in [
        "tenantgate_sync_requests_total{result=\"ok\"} 1",
        "tenantgate_sync_requests_total{result=\"not_ready\"} 1",
        "tenantgate_sync_reports_total 1",
        "tenantgate_policy_skew_total 1",
        "tenantgate_keys 1",
        "tenantgate_policy_info{version=\"v1\"} 1",
        "tenantgate_sync_duration_seconds_count 2",
        "tenantgate_store_errors_total{transient=\"true\"} 0",
    ] {
        assert!(text.lines().any(|l| l == name), "missing `{name}` in\n{text}");
    }

    // The store goes away (Redis, Redis Cluster): not ready, syncs
    // answered 503 (transient), and the error counted.
    let kind = b.store().kind();
    if b.stop() {
        wait_for("not ready", || async { a.get("/readyz").await.0 == 503 }).await;
        let (status, body) = a.sync(&request("n1", 3, 2, &[("t|api", "per-10s", 1)])).await;
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("\"transient\":true"), "{body}");
        // The sync's error, and any sweep pass that ran meanwhile.
        let errors = a
            .metric("tenantgate_store_errors_total{transient=\"true\"}")
            .await
            .and_then(|v| v.parse::<u64>().ok());
        assert!(errors.is_some_and(|n| n >= 1), "{errors:?}");
        assert_eq!(
            a.metric(&format!("tenantgate_store_up{{store=\"{kind}\"}}"))
                .await
                .as_deref(),
            Some("0")
        );
    }
    a.shutdown().await;
}

// ---- hostile nodes ------------------------------------------------------------

/// The reported crash, pinned below the intake checks: counts of
/// `u64::MAX` given straight to the allocator (twice, so every cumulative
/// counter would overflow) are absorbed, and the key keeps serving.
async fn overflowing_counts_do_not_panic_the_allocator(b: Backend) {
    let policy = policy_file(POLICY_V1);
    let clock = Arc::new(ManualClock::new(T0));
    let a = Instance::start(b.store(), clock.clone(), policy.path()).await;
    wait_for("ready", || async { a.get("/readyz").await.0 == 200 }).await;
    let mut req = request("n1", 1, 0, &[("t|api", "per-10s", u64::MAX)]);
    req.reports[0].unleased = u64::MAX;
    a.service.sync(&req).await.unwrap();
    clock.advance(Duration::from_secs(1));
    let mut again = request("n1", 2, 0, &[("t|api", "per-10s", u64::MAX)]);
    again.reports[0].unleased = u64::MAX;
    a.service.sync(&again).await.unwrap();
    let mut other = request("n2", 3, 1, &[("t|api", "per-10s", u64::MAX)]);
    other.reports[0].unleased = u64::MAX;
    a.service.sync(&other).await.unwrap();
    clock.advance(Duration::from_secs(1));
    a.service.sweep().await.unwrap();
    // The key still answers, over HTTP too.
    a.lease(&request("n3", 1, 0, &[("t|api", "per-10s", 1)])).await;
    a.shutdown().await;
}

/// The nearest-rank percentile: for 100 samples, p99 is the 99th smallest.
fn percentile(mut samples: Vec<Duration>, pct: usize) -> Duration {
    samples.sort();
    let rank = (samples.len() * pct).div_ceil(100);
    samples[rank.saturating_sub(1).min(samples.len().saturating_sub(1))]
}

/// An honest node's sync latencies: `n` requests, one at a time.
async fn honest_latencies(
    a: &Instance,
    node: &str,
    seq: &mut u64,
    n: usize,
) -> (Vec<Duration>, SyncResponse) {
    let mut out = Vec::with_capacity(n);
    let mut last = None;
    for _ in 0..n {
        *seq += 1;
        let req = request(node, *seq, *seq - 1, &[("honest|api", "per-10s", 0)]);
        let started = Instant::now();
        let resp = a.lease(&req).await;
        out.push(started.elapsed());
        last = Some(resp);
    }
    (out, last.unwrap())
}

/// Sends `total` requests (`body(i)`) from `workers` paced tasks (4,000
/// requests/s in all) while the honest node syncs; returns their statuses,
/// the honest node's latencies meanwhile, and its last answer.
async fn under_load(
    a: &Instance,
    seq: &mut u64,
    workers: u64,
    total: u64,
    body: &(dyn Fn(u64) -> String + Sync),
) -> (Vec<u16>, Vec<Duration>, SyncResponse) {
    let bodies: Vec<Vec<String>> = (0..workers)
        .map(|w| (w..total).step_by(workers as usize).map(body).collect())
        .collect();
    let addr = a.addr;
    let tasks: Vec<_> = bodies
        .into_iter()
        .map(|bodies| {
            tokio::spawn(async move {
                let mut pace = tokio::time::interval(Duration::from_millis(2));
                pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut statuses = Vec::with_capacity(bodies.len());
                for b in bodies {
                    pace.tick().await;
                    statuses.push(http(addr, "POST", "/v1/sync", &b).await.0);
                }
                statuses
            })
        })
        .collect();
    let mut latencies = Vec::new();
    let mut last = None;
    while !tasks.iter().all(|t| t.is_finished()) && latencies.len() < 2_000 {
        let (l, resp) = honest_latencies(a, "honest", seq, 10).await;
        latencies.extend(l);
        last = Some(resp);
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.extend(t.await.unwrap());
    }
    let last = match last {
        Some(l) => l,
        None => honest_latencies(a, "honest", seq, 1).await.1,
    };
    (statuses, latencies, last)
}

/// Issue #8's hostile-node suite. Each attack is answered with a clear
/// 4xx and changes no state; a sybil flood of 20,000 node ids stops at the
/// session cap; meanwhile an honest node's sync p90 stays under 2× what it
/// is under the same load from well-behaved nodes (p99 printed), and its
/// lease is unchanged.
async fn hostile_nodes_change_nothing(b: Backend) {
    const MAX_SESSIONS: u64 = 2_000;
    // A 1 s deadline (half the callout timeout): what is under test is that
    // hostile requests change nothing and leave the honest node served, not
    // the default 250 ms deadline on a loaded machine (CI saw an honest
    // request answered 503 at 250 ms with the load average at 11).
    let policy = policy_file(&POLICY_V1.replace(
        "sync: { cluster: tenantgate }",
        "sync: { cluster: tenantgate, interval: 4s, timeout: 2s }",
    ));
    let clock = Arc::new(ManualClock::new(T0));
    let service = Service::with_limits(
        b.store(),
        clock.clone(),
        Settings::default(),
        IntakeLimits::default(),
        StateLimits {
            max_sessions: MAX_SESSIONS,
            ..StateLimits::default()
        },
    );
    let a = Instance::start_isolated(service, policy.path()).await;
    let id = ("honest|api".to_owned(), "per-10s".to_owned());
    let mut seq = 1;
    let first = a
        .lease(&request("honest", seq, 0, &[("honest|api", "per-10s", 3)]))
        .await;
    assert_eq!(first.leases.len(), 1);
    honest_latencies(&a, "honest", &mut seq, 20).await;
    let view_before = b.store().key(&id).await.unwrap().unwrap().view();
    let sessions_before = b.store().session_count().await.unwrap();

    // Every attack: (what, body, status).
    let req = |node: &str, seq: u64| request(node, seq, 0, &[("honest|api", "per-10s", 1)]);
    let with = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value = serde_json::from_str(&req("mallory", 7).to_json()).unwrap();
        f(&mut v);
        v.to_string()
    };
    let mut overflow = req("mallory", 7);
    overflow.reports[0].consumed = u64::MAX;
    overflow.reports[0].unleased = u64::MAX;
    overflow.reports[0].demand = u64::MAX;
    let many: Vec<(String, &str, u64)> = (0..50_000).map(|i| (format!("k{i}"), "per-10s", 1)).collect();
    let many: Vec<(&str, &str, u64)> = many.iter().map(|(k, l, n)| (k.as_str(), *l, *n)).collect();
    let fits: Vec<(String, &str, u64)> = (0..4_097).map(|i| (format!("k{i}"), "per-10s", 1)).collect();
    let fits: Vec<(&str, &str, u64)> = fits.iter().map(|(k, l, n)| (k.as_str(), *l, *n)).collect();
    // The honest node sends no boot: its seq is bounded by the clock.
    let mut jump = req("honest", T0 + tenantgate_central::alloc::MAX_SEQ_AHEAD_NS + 1);
    jump.acked_seq = seq;
    let mut to_the_end = req("honest", u64::MAX);
    to_the_end.acked_seq = seq;
    let attacks: Vec<(&str, String, u16)> = vec![
        ("overflowing counts", overflow.to_json(), 400),
        (
            "an 8 MiB body",
            format!("{{\"pad\":\"{}\"}}", "x".repeat(8 << 20)),
            413,
        ),
        ("50,000 reports", request("mallory", 7, 0, &many).to_json(), 413),
        (
            "4,097 reports (within the body limit)",
            request("mallory", 7, 0, &fits).to_json(),
            400,
        ),
        ("not JSON", "{nope".into(), 400),
        ("JSON null", "null".into(), 400),
        ("an array", "[]".into(), 400),
        ("an empty object", "{}".into(), 400),
        (
            "a missing field",
            with(&|v| {
                v.as_object_mut().unwrap().remove("seq");
            }),
            400,
        ),
        (
            "reports not a list",
            with(&|v| v["reports"] = serde_json::json!({"a": 1})),
            400,
        ),
        (
            "a report not an object",
            with(&|v| v["reports"] = serde_json::json!([1])),
            400,
        ),
        (
            "a key of the wrong type",
            with(&|v| v["reports"][0]["key"] = serde_json::json!(12)),
            400,
        ),
        (
            "a negative count",
            with(&|v| v["reports"][0]["consumed"] = serde_json::json!(-1)),
            400,
        ),
        (
            "a fractional count",
            with(&|v| v["reports"][0]["demand"] = serde_json::json!(1.5)),
            400,
        ),
        (
            "a count as a string",
            with(&|v| v["reports"][0]["consumed"] = serde_json::json!("5")),
            400,
        ),
        (
            "a count past u64",
            with(&|v| v["reports"][0]["consumed"] = serde_json::json!(1e30)),
            400,
        ),
        ("a negative seq", with(&|v| v["seq"] = serde_json::json!(-5)), 400),
        (
            "a node id of the wrong type",
            with(&|v| v["node_id"] = serde_json::json!(["x"])),
            400,
        ),
        (
            "an empty node id",
            with(&|v| v["node_id"] = serde_json::json!("")),
            400,
        ),
        (
            "a 1 KiB node id",
            with(&|v| v["node_id"] = serde_json::json!("n".repeat(1024))),
            400,
        ),
        (
            "a 1 KiB key",
            with(&|v| v["reports"][0]["key"] = serde_json::json!("k".repeat(1024))),
            400,
        ),
        (
            "unleased above consumed",
            with(&|v| v["reports"][0]["unleased"] = serde_json::json!(2)),
            400,
        ),
        (
            "another protocol version",
            with(&|v| v["version"] = serde_json::json!(9)),
            400,
        ),
        ("a seq jump in the honest node's name", jump.to_json(), 400),
        (
            "seq u64::MAX in the honest node's name",
            to_the_end.to_json(),
            400,
        ),
    ];
    for (what, body, status) in &attacks {
        let (got, answer) = http(a.addr, "POST", "/v1/sync", body).await;
        assert_eq!(got, *status, "{what}: {}", &answer[..answer.len().min(300)]);
    }
    // A report in another node's name, from an authenticated node.
    let forged = tenantgate_central::service::Identity {
        node_id: "mallory".into(),
        region: None,
    };
    let e = a
        .service
        .sync_json(req("honest", seq + 1).to_json().into(), Some(forged))
        .await
        .unwrap_err();
    assert!(
        matches!(e, tenantgate_central::service::SyncError::Forbidden(_)),
        "{e}"
    );
    assert_eq!(
        a.metric("tenantgate_sync_requests_total{result=\"forbidden\"}")
            .await
            .as_deref(),
        Some("1")
    );
    // Nothing changed.
    assert_eq!(b.store().key(&id).await.unwrap().unwrap().view(), view_before);
    assert_eq!(b.store().session_count().await.unwrap(), sessions_before);

    // The sybil flood, with the honest node syncing all along, against the
    // same load from well-behaved nodes (the baseline: the load generator
    // shares this machine's cores with the service, which a remote attacker
    // would not).
    let workers = 8u64;
    let benign = |i: u64| request(&format!("benign-{}", i % 200), i / 200 + 1, i / 200, &[]).to_json();
    let (_, base, lease_before) = under_load(&a, &mut seq, workers, 8_000, &benign).await;
    let (base_p90, base_p99) = (percentile(base.clone(), 90), percentile(base, 99));
    let sessions_before = b.store().session_count().await.unwrap();
    let sybils = 20_000u64;
    let sybil = |i: u64| request(&format!("sybil-{i}"), 1, 0, &[]).to_json();
    let (statuses, during, lease_during) = under_load(&a, &mut seq, workers, sybils, &sybil).await;
    let refused = statuses.iter().filter(|s| **s == 429).count() as u64;
    assert!(statuses.iter().all(|s| *s == 200 || *s == 429), "{statuses:?}");
    let (during_p90, during_p99) = (percentile(during.clone(), 90), percentile(during.clone(), 99));
    println!(
        "honest sync p90 / p99: same load from known nodes {base_p90:?} / {base_p99:?}, during the sybil flood {during_p90:?} / {during_p99:?} ({} samples); sybils refused {refused}",
        during.len()
    );
    assert!(
        during.len() >= 100,
        "only {} honest samples during the flood",
        during.len()
    );
    // The cap is checked against the count as last seen: requests in
    // flight together (the flood's and the honest node's) may pass it by a
    // few each.
    let slack = 2 * (workers + 1);
    let room = MAX_SESSIONS - sessions_before;
    assert!(refused + room + slack >= sybils, "{refused} sybils refused");
    let sessions = b.store().session_count().await.unwrap();
    assert!(sessions <= MAX_SESSIONS + slack, "{sessions} sessions");
    // p90, not p99: of a few hundred samples on a shared 2-core machine,
    // the p99 is one or two requests a descheduled thread delayed (CI once
    // saw 51.7 ms against 23.3 ms with other builds running).
    //
    // With a floor: since records became compact (issue 22), a known
    // node's request on Redis costs about 7 ms at p90 here where it cost
    // 17 ms, while the flood's p90 stayed where it was on the build before
    // (17-20 ms on both, measured interleaved at load average 7-12): the
    // ratio alone had started to measure the store's speed-up, not the
    // flood's harm. The floor is the flood's p90 on the build before; a
    // starved node (the 250 ms deadline, or a multiple of the floor) still
    // fails.
    let floor = Duration::from_millis(25);
    assert!(
        during_p90 < (base_p90 * 2).max(floor),
        "honest p90 {during_p90:?} during the flood, {base_p90:?} under the same load from known nodes"
    );
    assert_eq!(lease_during.leases, lease_before.leases);
    a.shutdown().await;
}

/// A store whose `key_ids` panics once (a bug in a sweep pass).
struct PanicsOnce {
    inner: EmbeddedStore,
    panicked: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl Store for PanicsOnce {
    fn kind(&self) -> &'static str {
        "embedded"
    }
    async fn ping(&self) -> Result<(), tenantgate_central::store::StoreError> {
        self.inner.ping().await
    }
    async fn update_session(
        &self,
        node: &str,
        f: &mut tenantgate_central::store::SessionUpdate<'_>,
    ) -> Result<u64, tenantgate_central::store::StoreError> {
        self.inner.update_session(node, f).await
    }
    async fn update_request(
        &self,
        node: &str,
        txn: &mut (dyn Txn + '_),
    ) -> Result<u64, tenantgate_central::store::StoreError> {
        self.inner.update_request(node, txn).await
    }
    async fn update_keys(
        &self,
        ids: &[tenantgate_central::alloc::KeyId],
        f: &mut tenantgate_central::store::KeyUpdate<'_>,
    ) -> Result<(), tenantgate_central::store::StoreError> {
        self.inner.update_keys(ids, f).await
    }
    async fn key_ids(
        &self,
    ) -> Result<Vec<tenantgate_central::alloc::KeyId>, tenantgate_central::store::StoreError> {
        if !self.panicked.swap(true, std::sync::atomic::Ordering::SeqCst) {
            panic!("a bug in a sweep pass");
        }
        self.inner.key_ids().await
    }
    async fn key_count(&self) -> Result<u64, tenantgate_central::store::StoreError> {
        self.inner.key_count().await
    }
    async fn session_count(&self) -> Result<u64, tenantgate_central::store::StoreError> {
        self.inner.session_count().await
    }
    async fn session_ids(&self) -> Result<Vec<String>, tenantgate_central::store::StoreError> {
        self.inner.session_ids().await
    }
}

/// The reported hazard: a panic in the sweeper ended it for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_survives_a_panicking_pass() {
    let policy = policy_file(POLICY_V1);
    let store = Arc::new(PanicsOnce {
        inner: EmbeddedStore::new(),
        panicked: std::sync::atomic::AtomicBool::new(false),
    });
    let a = Instance::start(store, Arc::new(ManualClock::new(T0)), policy.path()).await;
    wait_for("a failed pass, then a good one", || async {
        a.metric("tenantgate_sweeps_total{result=\"error\"}")
            .await
            .as_deref()
            == Some("1")
            && a.metric("tenantgate_sweeps_total{result=\"ok\"}")
                .await
                .is_some_and(|v| v != "0")
    })
    .await;
    a.lease(&request("n1", 1, 0, &[("t|api", "per-10s", 1)])).await;
    a.shutdown().await;
}

/// Bounded state: a new (key, limit) beyond the cap gets no lease and is
/// counted; records and sessions expire after inactivity (the gauges
/// follow), and a node back after that starts afresh.
async fn state_is_capped_and_expires(b: Backend) {
    let policy = policy_file(POLICY_V1);
    let clock = Arc::new(ManualClock::new(T0));
    let service = Service::with_limits(
        b.store(),
        clock.clone(),
        Settings::default(),
        IntakeLimits::default(),
        StateLimits {
            max_keys: 3,
            ..StateLimits::default()
        },
    );
    let a = Instance::start_with(service, policy.path()).await;
    let three = [
        ("a|api", "per-10s", 1),
        ("b|api", "per-10s", 1),
        ("c|api", "per-10s", 1),
    ];
    assert_eq!(a.lease(&request("n1", 1, 0, &three)).await.leases.len(), 3);
    a.service.sweep().await.unwrap();
    clock.advance(Duration::from_secs(1));
    let four = [three[0], three[1], three[2], ("d|api", "per-10s", 1)];
    let resp = a.lease(&request("n1", 2, 1, &four)).await;
    assert_eq!(resp.leases.len(), 3, "{resp:?}");
    assert!(resp.leases.iter().all(|l| l.key != "d|api"));
    assert_eq!(
        a.metric("tenantgate_keys_refused_total").await.as_deref(),
        Some("1")
    );
    assert_eq!(a.metric("tenantgate_keys ").await.as_deref(), Some("3"));
    assert_eq!(a.metric("tenantgate_sessions ").await.as_deref(), Some("1"));

    // Past every lease, write-off and local fallback, and the session idle
    // time: nothing is left once the buckets refilled (the write-offs of
    // the last pass are refilled at the limit's rate: 150 of 200 here,
    // 100 per interval).
    clock.advance(Duration::from_secs(1_000));
    for _ in 0..4 {
        a.service.sweep().await.unwrap();
        clock.advance(Duration::from_secs(1));
    }
    assert_eq!(b.store().key_count().await.unwrap(), 0);
    assert_eq!(b.store().session_count().await.unwrap(), 0);
    assert_eq!(
        a.metric("tenantgate_expired_total{record=\"key\"}")
            .await
            .as_deref(),
        Some("3")
    );
    assert_eq!(
        a.metric("tenantgate_expired_total{record=\"session\"}")
            .await
            .as_deref(),
        Some("1")
    );
    // Back: a new session and fresh records (the cap counts as last seen:
    // none, so all four this time).
    let resp = a.lease(&request("n1", 3, 2, &four)).await;
    assert_eq!(resp.leases.len(), 4, "{resp:?}");
    a.shutdown().await;
}

/// A store whose sync requests take `delay` (a slow Redis).
struct SlowKeys {
    inner: EmbeddedStore,
    delay: Duration,
}

#[async_trait::async_trait]
impl Store for SlowKeys {
    fn kind(&self) -> &'static str {
        "embedded"
    }
    async fn ping(&self) -> Result<(), tenantgate_central::store::StoreError> {
        self.inner.ping().await
    }
    async fn update_session(
        &self,
        node: &str,
        f: &mut tenantgate_central::store::SessionUpdate<'_>,
    ) -> Result<u64, tenantgate_central::store::StoreError> {
        self.inner.update_session(node, f).await
    }
    async fn update_request(
        &self,
        node: &str,
        txn: &mut (dyn Txn + '_),
    ) -> Result<u64, tenantgate_central::store::StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.update_request(node, txn).await
    }
    async fn update_keys(
        &self,
        ids: &[tenantgate_central::alloc::KeyId],
        f: &mut tenantgate_central::store::KeyUpdate<'_>,
    ) -> Result<(), tenantgate_central::store::StoreError> {
        self.inner.update_keys(ids, f).await
    }
    async fn key_ids(
        &self,
    ) -> Result<Vec<tenantgate_central::alloc::KeyId>, tenantgate_central::store::StoreError> {
        self.inner.key_ids().await
    }
    async fn key_count(&self) -> Result<u64, tenantgate_central::store::StoreError> {
        self.inner.key_count().await
    }
    async fn session_count(&self) -> Result<u64, tenantgate_central::store::StoreError> {
        self.inner.session_count().await
    }
    async fn session_ids(&self) -> Result<Vec<String>, tenantgate_central::store::StoreError> {
        self.inner.session_ids().await
    }
}

/// The deadline answers 503 but never leaves a partial write: the
/// request's steps run to their end, and the node's retry (same counts,
/// same acknowledgement) counts nothing twice. Beyond the concurrency
/// limit, a clear 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_never_leaves_a_partial_write_and_excess_load_gets_503() {
    let policy = policy_file(POLICY_V1);
    let store = Arc::new(SlowKeys {
        inner: EmbeddedStore::new(),
        delay: Duration::from_millis(400),
    });
    let clock = Arc::new(ManualClock::new(T0));
    let service = Service::with_limits(
        store.clone(),
        clock.clone(),
        Settings::default(),
        IntakeLimits {
            max_in_flight: 1,
            ..IntakeLimits::default()
        },
        StateLimits::default(),
    );
    let a = Instance::start_with(service, policy.path()).await;
    let id = ("t|api".to_owned(), "per-10s".to_owned());
    let req = request("n1", 1, 0, &[("t|api", "per-10s", 5)]);
    let started = Instant::now();
    let (status, body) = a.sync(&req).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("no answer within"), "{body}");
    assert!(started.elapsed() < Duration::from_millis(400));
    // Its task still runs (and holds the only slot): another request is
    // told to retry.
    let (status, body) = a.sync(&request("n3", 1, 0, &[])).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("in progress"), "{body}");
    // The timed-out request's writes finish anyway: counted once, whole.
    let consumed = || async {
        store
            .key(&id)
            .await
            .unwrap()
            .map_or(0, |k| k.view().stats.consumed)
    };
    wait_for("the timed-out request's writes", || async {
        consumed().await == 5
    })
    .await;
    // The node never got our answer to 1: its retry carries the same 5
    // plus 2 more (and times out too); only the 2 are new.
    let retry = request("n1", 2, 0, &[("t|api", "per-10s", 7)]);
    wait_for("the retry taken (not refused as busy)", || async {
        let (status, body) = a.sync(&retry).await;
        assert_eq!(status, 503, "{body}");
        !body.contains("in progress")
    })
    .await;
    wait_for("the retry's writes", || async { consumed().await >= 7 }).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(consumed().await, 7);
    a.shutdown().await;
}

/// The settings each node reports are compared with the policy's and
/// counted (the node's are used: `alloc::tests` shows what they change);
/// an older node that sends none is assumed the policy's; a value no
/// policy produces is refused. The deadline follows the policy's
/// `sync.timeout` across a reload. Each sync must be answered within that
/// deadline, so the test first waits until the store answers (its first
/// connection, a Redis Cluster's to every node, is not one of them) and
/// the deadline is not tighter than a loaded machine needs (it was 100 ms,
/// and a cold Redis Cluster connection under load took longer: `503`).
async fn reported_settings_are_counted_and_the_deadline_follows_the_policy(b: Backend) {
    let policy = policy_file(&POLICY_V1.replace(
        "sync: { cluster: tenantgate }",
        "sync: { cluster: tenantgate, timeout: 800ms }",
    ));
    let clock = Arc::new(ManualClock::new(T0));
    let a = Instance::start(b.store(), clock.clone(), policy.path()).await;
    wait_for("the policy and the store", || async {
        a.service.ready().await.is_ok()
    })
    .await;
    assert_eq!(a.service.deadline(), Duration::from_millis(400));
    let cfg = a.service.config().unwrap();
    let ms = |ns: u64| ns / 1_000_000;
    let same = tenantgate::sync::NodeSettings {
        timeout_ms: ms(cfg.response_timeout_ns),
        local_max_ms: ms(cfg.local_max_ns),
        interval_ms: 1_000,
        failure_mode: cfg.failure_mode,
        outage_allowance: true,
    };
    let with = |node: &str, settings: Option<tenantgate::sync::NodeSettings>| SyncRequest {
        settings,
        ..request(node, 1, 0, &[("t|api", "per-10s", 1)])
    };
    a.lease(&with("n1", Some(same))).await;
    let longer = tenantgate::sync::NodeSettings {
        local_max_ms: 120_000,
        ..same
    };
    a.lease(&with("n2", Some(longer))).await;
    a.lease(&with("n3", None)).await;
    let (status, body) = a
        .sync(&with(
            "n4",
            Some(tenantgate::sync::NodeSettings {
                timeout_ms: 0,
                ..same
            }),
        ))
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("settings.timeout_ms"), "{body}");
    for (result, n) in [("same", "1"), ("differs", "1"), ("unreported", "1")] {
        assert_eq!(
            a.metric(&format!("tenantgate_sync_settings_total{{result=\"{result}\"}}"))
                .await
                .as_deref(),
            Some(n),
            "{result}"
        );
    }
    // A reload with another callout timeout moves the deadline.
    std::fs::write(
        policy.path(),
        POLICY_V1.replace(
            "sync: { cluster: tenantgate }",
            "sync: { cluster: tenantgate, timeout: 600ms }",
        ),
    )
    .unwrap();
    wait_for("the reload", || async {
        a.metric("tenantgate_policy_reloads_total{result=\"ok\"}")
            .await
            .as_deref()
            == Some("2")
    })
    .await;
    assert_eq!(a.service.deadline(), Duration::from_millis(300));
    a.shutdown().await;
}

/// A session lives at least as long as what its node reported can still
/// matter: a node that enforces a 10 min callout timeout and a 10 min local
/// fallback keeps its session past the 15 min idle time (until
/// `D + ttl + local_max + settle` = 1,208 s), one that reports the
/// policy's values does not.
async fn a_session_outlives_its_nodes_own_lease_and_fallback(b: Backend) {
    let policy = policy_file(POLICY_V1);
    let clock = Arc::new(ManualClock::new(T0));
    let a = Instance::start(b.store(), clock.clone(), policy.path()).await;
    wait_for("the policy", || async { a.service.config().is_some() }).await;
    let long = tenantgate::sync::NodeSettings {
        timeout_ms: 600_000,
        local_max_ms: 600_000,
        interval_ms: 1_000,
        failure_mode: tenantgate::sync::FailureMode::FailOpenLocal,
        outage_allowance: true,
    };
    a.lease(&SyncRequest {
        settings: Some(long),
        ..request("n-long", 1, 0, &[("t|api", "per-10s", 1)])
    })
    .await;
    a.lease(&request("n-short", 1, 0, &[("t|api", "per-10s", 1)]))
        .await;
    let sessions = || async { b.store().session_ids().await.unwrap() };
    clock.advance(Duration::from_secs(1_000));
    a.service.sweep().await.unwrap();
    assert_eq!(sessions().await, vec!["n-long".to_owned()]);
    clock.advance(Duration::from_secs(250));
    a.service.sweep().await.unwrap();
    assert!(sessions().await.is_empty());
    a.shutdown().await;
}

/// How [`FailsMidRequest`] breaks a request after every step ran, before
/// anything is written.
#[derive(Clone)]
enum Fault {
    /// A step panics (a bug, or any error inside the store's code).
    Panic,
    /// The store's connection is killed (`CLIENT KILL`): the write fails
    /// on a broken connection (Redis only).
    KillConnection(String),
}

/// A store that breaks the next `armed` sync requests mid-way: each
/// request's steps all run (every key visited) and then the fault hits.
struct FailsMidRequest {
    inner: Arc<dyn Store>,
    armed: std::sync::atomic::AtomicU32,
    fault: Fault,
}

struct Faulty<'a, 'b> {
    inner: &'a mut (dyn Txn + 'b),
    fault: Option<Fault>,
}

impl Txn for Faulty<'_, '_> {
    fn begin(
        &mut self,
        session: &mut Option<tenantgate_central::alloc::Session>,
        sessions: u64,
    ) -> Option<Vec<tenantgate_central::alloc::KeyId>> {
        self.inner.begin(session, sessions)
    }
    fn apply(
        &mut self,
        session: &mut Option<tenantgate_central::alloc::Session>,
        keys: &mut [KeySlot],
    ) -> bool {
        let write = self.inner.apply(session, keys);
        assert!(
            keys.iter().all(|k| k.write),
            "every key was visited and would be written"
        );
        match self.fault.take() {
            None => {}
            Some(Fault::Panic) => panic!("a failure in the middle of a request"),
            Some(Fault::KillConnection(url)) => {
                let mut c = ::redis::Client::open(url).unwrap().get_connection().unwrap();
                let killed: i64 = ::redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("normal")
                    .query(&mut c)
                    .unwrap();
                assert!(killed >= 1, "the store's connection was killed");
            }
        }
        write
    }
}

#[async_trait::async_trait]
impl Store for FailsMidRequest {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn ping(&self) -> Result<(), tenantgate_central::store::StoreError> {
        self.inner.ping().await
    }
    async fn update_session(
        &self,
        node: &str,
        f: &mut tenantgate_central::store::SessionUpdate<'_>,
    ) -> Result<u64, tenantgate_central::store::StoreError> {
        self.inner.update_session(node, f).await
    }
    async fn update_request(
        &self,
        node: &str,
        txn: &mut (dyn Txn + '_),
    ) -> Result<u64, tenantgate_central::store::StoreError> {
        use std::sync::atomic::Ordering::SeqCst;
        let fire = self
            .armed
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let mut faulty = Faulty {
            inner: txn,
            fault: fire.then(|| self.fault.clone()),
        };
        self.inner.update_request(node, &mut faulty).await
    }
    async fn update_keys(
        &self,
        ids: &[tenantgate_central::alloc::KeyId],
        f: &mut tenantgate_central::store::KeyUpdate<'_>,
    ) -> Result<(), tenantgate_central::store::StoreError> {
        self.inner.update_keys(ids, f).await
    }
    async fn key_ids(
        &self,
    ) -> Result<Vec<tenantgate_central::alloc::KeyId>, tenantgate_central::store::StoreError> {
        self.inner.key_ids().await
    }
    async fn key_count(&self) -> Result<u64, tenantgate_central::store::StoreError> {
        self.inner.key_count().await
    }
    async fn session_count(&self) -> Result<u64, tenantgate_central::store::StoreError> {
        self.inner.session_count().await
    }
    async fn session_ids(&self) -> Result<Vec<String>, tenantgate_central::store::StoreError> {
        self.inner.session_ids().await
    }
}

/// The reported hazard: a request that failed after its session step lost
/// that report's counts for the keys it had not reached (the session had
/// recorded them as seen, so the node's retry was not counted). Now a
/// request is one transaction: it fails whole, and the retry (the same
/// `seq`, or the next one still acknowledging the old base) books every
/// count exactly once, on every store, whatever breaks it mid-way.
async fn a_failed_request_counts_nothing_and_its_retry_counts_once(b: Backend) {
    let mut faults = vec![Fault::Panic];
    if let Backend::Redis(r) = &b {
        faults.push(Fault::KillConnection(r.url()));
    }
    let policy = policy_file(POLICY_V1);
    for (round, fault) in faults.into_iter().enumerate() {
        let store = Arc::new(FailsMidRequest {
            inner: b.store(),
            armed: std::sync::atomic::AtomicU32::new(0),
            fault,
        });
        let clock = Arc::new(ManualClock::new(T0));
        let a = Instance::start(store.clone(), clock.clone(), policy.path()).await;
        let node = format!("n{round}");
        let keys: Vec<String> = (0..6).map(|i| format!("k{i}-{round}|api")).collect();
        let reports =
            |n: u64| -> Vec<(&str, &str, u64)> { keys.iter().map(|k| (k.as_str(), "per-10s", n)).collect() };
        let consumed = || async {
            let mut out = Vec::new();
            for k in &keys {
                let id = (k.clone(), "per-10s".to_owned());
                out.push(
                    b.store()
                        .key(&id)
                        .await
                        .unwrap()
                        .map_or(0, |k| k.view().stats.consumed),
                );
            }
            out
        };
        a.lease(&request(&node, 1, 0, &reports(5))).await;
        assert_eq!(consumed().await, vec![5; 6]);

        // Seq 2 (acknowledging 1) breaks mid-way: nothing of it is booked.
        store.armed.store(1, std::sync::atomic::Ordering::SeqCst);
        clock.advance(Duration::from_secs(1));
        let (status, body) = a.sync(&request(&node, 2, 1, &reports(3))).await;
        assert!(status >= 500, "{status} {body}");
        assert_eq!(consumed().await, vec![5; 6], "a failed request writes nothing");
        // The node retries seq 2 with the same counts: booked once.
        a.lease(&request(&node, 2, 1, &reports(3))).await;
        assert_eq!(consumed().await, vec![8; 6]);

        // Seq 3 (acknowledging 2) breaks too; the node's next report, 4,
        // still acknowledges 2 and carries 3's counts (2) plus 1 more.
        store.armed.store(1, std::sync::atomic::Ordering::SeqCst);
        clock.advance(Duration::from_secs(1));
        let (status, body) = a.sync(&request(&node, 3, 2, &reports(2))).await;
        assert!(status >= 500, "{status} {body}");
        assert_eq!(consumed().await, vec![8; 6]);
        a.lease(&request(&node, 4, 2, &reports(3))).await;
        assert_eq!(consumed().await, vec![11; 6]);
        // And 5, acknowledging 4: only its own counts.
        clock.advance(Duration::from_secs(1));
        a.lease(&request(&node, 5, 4, &reports(1))).await;
        assert_eq!(consumed().await, vec![12; 6], "every count booked exactly once");
        a.shutdown().await;
    }
}

// ---- Redis Cluster: a master killed mid-run ----------------------------------

/// One node of [`a_master_killed_mid_run_loses_no_count`]: what it
/// admitted per key in all, and what it has not had acknowledged (its
/// counts since its acknowledged base, which every report carries).
struct CountingNode {
    name: String,
    seq: u64,
    acked: u64,
    since_acked: Vec<u64>,
    admitted: Vec<u64>,
}

impl CountingNode {
    /// Admits `units[k]` more of each key and reports; applies an answer.
    async fn round(&mut self, inst: &Instance, keys: &[String], units: &[u64]) -> bool {
        for (k, u) in units.iter().enumerate() {
            self.since_acked[k] += u;
            self.admitted[k] += u;
        }
        self.seq += 1;
        let reports: Vec<(&str, &str, u64)> = keys
            .iter()
            .zip(&self.since_acked)
            .map(|(k, n)| (k.as_str(), "per-10s", *n))
            .collect();
        let (status, _) = inst
            .sync(&request(&self.name, self.seq, self.acked, &reports))
            .await;
        if status == 200 {
            self.acked = self.seq;
            self.since_acked.iter_mut().for_each(|n| *n = 0);
        }
        status == 200
    }
}

/// Redis Cluster, the issue's failover test: two replicas of the service
/// share a cluster of three masters (each with a replica); four nodes
/// report 24 keys spread over every master, each admitting a few units per
/// round, and the master serving one key's slot is killed (SIGKILL) while
/// requests are in flight. Its replica takes over, the killed node comes
/// back as a replica, and once every node has had a report acknowledged
/// after that, every key's record holds exactly what the nodes admitted:
/// nothing acknowledged was lost with the master (each write waits for
/// its replica, `WAIT`), and nothing was counted twice however the
/// requests' slots landed in part (each record deduplicates its node's
/// counts). (With `?replicas=0`, no `WAIT`, nothing guarantees it: with
/// a pipeline and a `WAIT` per slot, an earlier version lost acknowledged
/// units in one run of three, 1,230 of 1,284 left for the killed slot;
/// with a pipeline per master, three runs lost none, the window being a
/// write on the killed master not yet sent to its replica.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_mid_run_loses_no_count() {
    let cluster = Arc::new(std::sync::Mutex::new(RedisCluster::start().unwrap()));
    let url = cluster_url(&cluster.lock().unwrap());
    let policy = policy_file(POLICY_V1);
    let clock = Arc::new(ManualClock::new(T0));
    let store = || Arc::new(RedisClusterStore::new(&url, "tgtest").unwrap()) as Arc<dyn Store>;
    let replicas = [
        Instance::start(store(), clock.clone(), policy.path()).await,
        Instance::start(store(), clock.clone(), policy.path()).await,
    ];
    let keys: Vec<String> = (0..24).map(|i| format!("tenant-{i}|api")).collect();
    let mut nodes: Vec<CountingNode> = (0..4)
        .map(|i| CountingNode {
            name: format!("node-{i}"),
            seq: 0,
            acked: 0,
            since_acked: vec![0; keys.len()],
            admitted: vec![0; keys.len()],
        })
        .collect();
    let victim = keys[0].clone();
    let killer = {
        let cluster = cluster.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let tag = format!("{{{victim}}}");
            let i = cluster.lock().unwrap().kill_master_of(&tag).unwrap();
            // The replica takes over (node timeout 1 s, then an election),
            // then the killed node rejoins as its replica.
            let deadline = Instant::now() + Duration::from_secs(20);
            while !cluster.lock().unwrap().failed_over(&tag, i) {
                assert!(Instant::now() < deadline, "no failover within 20 s");
                std::thread::sleep(Duration::from_millis(50));
            }
            cluster.lock().unwrap().restart(i).unwrap();
            cluster
                .lock()
                .unwrap()
                .wait_healthy(Duration::from_secs(20))
                .unwrap();
        })
    };
    let (mut ok, mut failed, mut round) = (0u32, 0u32, 0u64);
    let mut acked_after_recovery = vec![false; nodes.len()];
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(killer.is_finished() && acked_after_recovery.iter().all(|a| *a)) {
        assert!(
            Instant::now() < deadline,
            "the nodes were not all served again within 60 s"
        );
        let recovered = killer.is_finished();
        round += 1;
        clock.advance(Duration::from_secs(1));
        for (i, node) in nodes.iter_mut().enumerate() {
            let units: Vec<u64> = (0..keys.len() as u64)
                .map(|k| (k + round + i as u64) % 4)
                .collect();
            let inst = &replicas[(i + round as usize) % 2];
            if node.round(inst, &keys, &units).await {
                ok += 1;
                acked_after_recovery[i] |= recovered;
            } else {
                failed += 1;
            }
        }
    }
    killer.join().unwrap();
    assert!(failed > 0, "the kill failed some requests ({ok} ok)");
    // Every node's last counts acknowledged (a report that lands but is
    // not answered is counted by the records all the same).
    for node in &mut nodes {
        let none = vec![0; keys.len()];
        while !node.round(&replicas[0], &keys, &none).await {
            assert!(Instant::now() < deadline, "{} not served again", node.name);
        }
    }
    let reader = store();
    for (k, key) in keys.iter().enumerate() {
        let want: u64 = nodes.iter().map(|n| n.admitted[k]).sum();
        let got = reader
            .key(&(key.clone(), "per-10s".to_owned()))
            .await
            .unwrap()
            .map_or(0, |ks| ks.view().stats.consumed);
        assert_eq!(
            got, want,
            "{key}: the records hold every acknowledged unit once ({round} rounds, {ok} ok, {failed} failed)"
        );
    }
    eprintln!("{round} rounds: {ok} requests answered, {failed} failed during the failover");
    for r in replicas {
        r.shutdown().await;
    }
}

/// One round of every node, each through one of the `replicas` in turn;
/// how many were answered.
async fn every_node_reports(
    nodes: &mut [CountingNode],
    replicas: &[Instance],
    keys: &[String],
    round: u64,
) -> usize {
    let mut ok = 0;
    for (i, node) in nodes.iter_mut().enumerate() {
        let units: Vec<u64> = (0..keys.len() as u64)
            .map(|k| (k + round + i as u64) % 3)
            .collect();
        let inst = &replicas[(i + round as usize) % replicas.len()];
        ok += usize::from(node.round(inst, keys, &units).await);
    }
    ok
}

/// Redis Cluster: a key's slot moved to another master while nodes report
/// it, as `redis-cli --cluster reshard` moves it: the slot `MIGRATING` and
/// `IMPORTING` (the moved keys answered `ASK` by the old master), its keys
/// moved, then the slot given to the new master (the old one answers
/// `MOVED`; the store's map of which slots share a pipeline is stale).
/// Requests may fail (`503`) while it moves, never miscount: every key's
/// record ends holding exactly what the nodes admitted, and once the slot
/// has moved every request is answered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moved_mid_run_counts_once() {
    let cluster = RedisCluster::start().unwrap();
    let policy = policy_file(POLICY_V1);
    let clock = Arc::new(ManualClock::new(T0));
    let url = cluster_url(&cluster);
    let store = || Arc::new(RedisClusterStore::new(&url, "tgtest").unwrap()) as Arc<dyn Store>;
    let replicas = [
        Instance::start(store(), clock.clone(), policy.path()).await,
        Instance::start(store(), clock.clone(), policy.path()).await,
    ];
    let keys: Vec<String> = (0..24).map(|i| format!("tenant-{i}|api")).collect();
    let mut nodes: Vec<CountingNode> = (0..3)
        .map(|i| CountingNode {
            name: format!("node-{i}"),
            seq: 0,
            acked: 0,
            since_acked: vec![0; keys.len()],
            admitted: vec![0; keys.len()],
        })
        .collect();
    let mut round = 0u64;
    macro_rules! run {
        () => {{
            round += 1;
            clock.advance(Duration::from_secs(1));
            every_node_reports(&mut nodes, &replicas, &keys, round).await
        }};
    }
    // A round every node is answered in (the replicas in sync; a loaded
    // machine may miss a deadline or a `WAIT` now and then).
    let mut all_answered = false;
    for _ in 0..10 {
        if run!() == nodes.len() {
            all_answered = true;
            break;
        }
    }
    assert!(all_answered, "no round was answered whole before the move");
    let tag = format!("{{{}}}", keys[0]);
    let migration = cluster.begin_migration(&tag).unwrap();
    let mut during = run!();
    let moved = cluster.migrate_keys(&migration).unwrap();
    assert!(moved >= 1, "the slot's record moved");
    during += run!();
    during += run!();
    cluster.finish_migration(&migration).unwrap();
    during += run!();
    // Within a few rounds, every request is answered again (a stale slot
    // map costs one failed request per replica).
    let mut answered_again = false;
    for _ in 0..10 {
        if run!() == nodes.len() {
            answered_again = true;
            break;
        }
    }
    assert!(answered_again, "requests still fail after the slot moved");
    // Every node's last counts acknowledged.
    let deadline = Instant::now() + Duration::from_secs(20);
    for node in &mut nodes {
        let none = vec![0; keys.len()];
        while !node.round(&replicas[0], &keys, &none).await {
            assert!(Instant::now() < deadline, "{} not served again", node.name);
        }
    }
    let reader = store();
    for (k, key) in keys.iter().enumerate() {
        let want: u64 = nodes.iter().map(|n| n.admitted[k]).sum();
        let got = reader
            .key(&(key.clone(), "per-10s".to_owned()))
            .await
            .unwrap()
            .map_or(0, |ks| ks.view().stats.consumed);
        assert_eq!(got, want, "{key}: counted once across the move");
    }
    eprintln!(
        "slot {} moved ({moved} records): {during} of {} requests answered while it moved",
        migration.slot,
        4 * nodes.len()
    );
    for r in replicas {
        r.shutdown().await;
    }
}

// ---- mTLS ---------------------------------------------------------------------

/// One HTTPS request with (or without) a client certificate; `Err` when
/// the TLS handshake or the connection fails.
async fn https(
    addr: SocketAddr,
    ca: &Path,
    client: Option<(&Path, &Path)>,
    body: &str,
) -> Result<(u16, String), String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match client {
        Some((cert, key)) => {
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
                .unwrap()
                .map(|c| c.unwrap())
                .collect();
            builder
                .with_client_auth_cert(certs, PrivateKeyDer::from_pem_file(key).unwrap())
                .unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let name = ServerName::try_from("localhost").unwrap();
    let mut tls = tokio::time::timeout(Duration::from_secs(5), connector.connect(name, tcp))
        .await
        .map_err(|_| "handshake timed out".to_owned())?
        .map_err(|e| format!("handshake: {e}"))?;
    let req = format!(
        "POST /v1/sync HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(req.as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut out))
        .await
        .map_err(|_| "no answer".to_owned())?
        .map_err(|e| format!("read: {e}"))?;
    let text = String::from_utf8_lossy(&out);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no answer: {text}"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or("no status")?;
    Ok((status, body.to_owned()))
}

/// The sync listener with mTLS, certificates from `tenantgate certs`: a
/// node with its certificate syncs; the same certificate with another
/// node's id or region is refused and counted; no certificate, or one from
/// another CA, fails the handshake; plain HTTP gets nothing.
async fn mtls_binds_nodes_to_their_certificates(b: Backend) {
    use tenantgate_central::listener as tls;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tls::init_ca(d, &["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
    tls::issue_node(d, "tenantgate.local", "envoy-1", Some("eu")).unwrap();
    let other_ca = tempfile::tempdir().unwrap();
    tls::init_ca(other_ca.path(), &["localhost".to_owned()]).unwrap();
    tls::issue_node(other_ca.path(), "tenantgate.local", "envoy-1", Some("eu")).unwrap();

    let policy = policy_file(POLICY_V1);
    let clock = Arc::new(ManualClock::new(T0));
    let auth = Auth {
        tls: Some(tls::TlsFiles {
            cert: d.join("service.pem"),
            key: d.join("service.key"),
            client_ca: d.join("ca.pem"),
        }),
        insecure: false,
    };
    let service = Service::new(b.store(), clock, Settings::default());
    let a = Instance::start_on(service, policy.path(), None, auth).await;
    let ca = d.join("ca.pem");
    let cert = (d.join("envoy-1.pem"), d.join("envoy-1.key"));
    let mine = (cert.0.as_path(), cert.1.as_path());
    let mut req = request("envoy-1", 1, 0, &[("t|api", "per-10s", 1)]);
    req.region = "eu".into();
    let (status, body) = https(a.addr, &ca, Some(mine), &req.to_json()).await.unwrap();
    assert_eq!(status, 200, "{body}");

    let mut other = request("envoy-2", 1, 0, &[("t|api", "per-10s", 1)]);
    other.region = "eu".into();
    let (status, body) = https(a.addr, &ca, Some(mine), &other.to_json()).await.unwrap();
    assert_eq!(status, 403, "{body}");
    let mut elsewhere = request("envoy-1", 2, 1, &[("t|api", "per-10s", 1)]);
    elsewhere.region = "us".into();
    let (status, body) = https(a.addr, &ca, Some(mine), &elsewhere.to_json())
        .await
        .unwrap();
    assert_eq!(status, 403, "{body}");
    assert_eq!(
        a.metric("tenantgate_sync_requests_total{result=\"forbidden\"}")
            .await
            .as_deref(),
        Some("2")
    );
    // No session was made for the node named in the forged report.
    assert_eq!(b.store().session_count().await.unwrap(), 1);

    assert!(https(a.addr, &ca, None, &req.to_json()).await.is_err());
    let foreign = (
        other_ca.path().join("envoy-1.pem"),
        other_ca.path().join("envoy-1.key"),
    );
    assert!(https(a.addr, &ca, Some((&foreign.0, &foreign.1)), &req.to_json())
        .await
        .is_err());
    let plain = tenantgate_central::testing::http(a.addr, "POST", "/v1/sync", &req.to_json()).await;
    assert!(
        plain.is_err() || plain.as_ref().is_ok_and(|(s, _)| *s != 200),
        "{plain:?}"
    );
    // And the node still syncs after all that.
    let mut next = request("envoy-1", 3, 1, &[("t|api", "per-10s", 1)]);
    next.region = "eu".into();
    assert_eq!(
        https(a.addr, &ca, Some(mine), &next.to_json()).await.unwrap().0,
        200
    );
    a.shutdown().await;
}

/// Safe by default: beyond loopback, no authentication means no start.
#[test]
fn an_unauthenticated_sync_api_beyond_loopback_refuses_to_start() {
    use tenantgate_central::service::check_exposure;
    let open: SocketAddr = "0.0.0.0:10002".parse().unwrap();
    let e = check_exposure(open, &Auth::default()).unwrap_err();
    assert!(e.contains("--tls-cert") && e.contains("--insecure"), "{e}");
    assert!(check_exposure("127.0.0.1:10002".parse().unwrap(), &Auth::default()).is_ok());
    assert!(check_exposure("[::1]:10002".parse().unwrap(), &Auth::default()).is_ok());
    let insecure = Auth {
        insecure: true,
        ..Auth::default()
    };
    assert!(check_exposure(open, &insecure).is_ok());
}

// ---- each scenario against each store ---------------------------------------

macro_rules! both_stores {
    ($($scenario:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(super::Backend::embedded()).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(super::Backend::redis()).await;
                }
            )*
        }
        mod redis_cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(super::Backend::cluster()).await;
                }
            )*
        }
    };
}

both_stores!(
    sync_round_trip,
    two_instances_share_one_store,
    lost_and_duplicate_reports_counted_once,
    policy_hot_reload,
    health_ready_and_metrics,
    overflowing_counts_do_not_panic_the_allocator,
    hostile_nodes_change_nothing,
    mtls_binds_nodes_to_their_certificates,
    state_is_capped_and_expires,
    a_failed_request_counts_nothing_and_its_retry_counts_once,
    reported_settings_are_counted_and_the_deadline_follows_the_policy,
    a_session_outlives_its_nodes_own_lease_and_fallback,
);
