//! Global limits with real processes on loopback: three Envoys (two
//! regions, two workers each) share one tenant's global limit through two
//! `tenantgate serve` replicas on one Redis. Then the replicas are killed,
//! restarted, replaced by a service that answers after 1 s, and by one that
//! answers garbage. Requests never wait for the service.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tenantgate_central::testing::RedisServer;
use tenantgate_integration_tests::cluster::Serve;
use tenantgate_integration_tests::{free_port, wait_for, Conn, Envoy, NodeSpec, SyncMode, SyncServer};

const RATE: f64 = 20.0; // per second, global
const BURST: f64 = 20.0;
const PROVISIONAL: f64 = 2.0;
const INTERVAL: Duration = Duration::from_millis(500);
/// The policy leaves `sync.breaker_max_backoff` at its default, two intervals.
const BREAKER_MAX_BACKOFF: Duration = Duration::from_millis(1000);
const NODES: f64 = 3.0;

const POLICY: &str = r#"
version: "multinode-1"
identity: { header: x-tenant-id }
plans:
  free: { limits: [ { name: global, rate: 20, per: 1s, burst: 20, global: true } ] }
default_plan: free
anonymous: { plan: free }
routes: { api: {} }
default_route: api
sync: { cluster: tenantgate, interval: 500ms, timeout: 200ms, provisional: 2, failure_mode: fail_open_local }
"#;

/// What one phase of load saw, over all nodes.
#[derive(Debug)]
struct Phase {
    admitted: u64,
    denied: u64,
    other: Vec<String>,
    p50: Duration,
    p99: Duration,
    elapsed: f64,
}

/// One tenant, one keep-alive connection per Envoy, a request every 5 ms
/// each (600 a second offered against a global 20), for `run_for`.
fn drive(ports: &[u16], run_for: Duration) -> Phase {
    let results = Arc::new(Mutex::new(Vec::<(u16, Duration)>::new()));
    let other = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let threads: Vec<_> = ports
        .iter()
        .map(|&port| {
            let (results, other) = (results.clone(), other.clone());
            std::thread::spawn(move || {
                let mut conn = Conn::open(port).unwrap();
                let mut next = Instant::now();
                while start.elapsed() < run_for {
                    let sent = Instant::now();
                    match conn.get("/api/orders", &[("x-tenant-id", "global-tenant")]) {
                        Ok(r) => results.lock().unwrap().push((r.status, sent.elapsed())),
                        Err(e) => {
                            other.lock().unwrap().push(e.to_string());
                            conn = Conn::open(port).unwrap();
                        }
                    }
                    next += Duration::from_millis(5);
                    if let Some(wait) = next.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let elapsed = start.elapsed().as_secs_f64();
    let results = results.lock().unwrap();
    let mut latencies: Vec<Duration> = results.iter().map(|r| r.1).collect();
    latencies.sort();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    let mut other = other.lock().unwrap().clone();
    other.extend(
        results
            .iter()
            .filter(|r| r.0 != 200 && r.0 != 429)
            .map(|r| format!("status {}", r.0)),
    );
    Phase {
        admitted: results.iter().filter(|r| r.0 == 200).count() as u64,
        denied: results.iter().filter(|r| r.0 == 429).count() as u64,
        other,
        p50: pct(0.50),
        p99: pct(0.99),
        elapsed,
    }
}

fn report(name: &str, p: &Phase) {
    println!(
        "{name:<28} {:>6.1} s  admitted {:>5} ({:>5.1}/s)  denied {:>6}  p50 {:>6.2} ms  p99 {:>6.2} ms",
        p.elapsed,
        p.admitted,
        p.admitted as f64 / p.elapsed,
        p.denied,
        p.p50.as_secs_f64() * 1e3,
        p.p99.as_secs_f64() * 1e3
    );
}

/// "Within 2× of before", with 2 ms of slack for sub-millisecond timer noise.
fn within_twice(before: Duration, now: Duration) -> bool {
    now <= before * 2 + Duration::from_millis(2)
}

#[test]
fn three_envoys_share_one_global_limit_through_two_replicas_on_redis() {
    let redis = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let dir = std::env::temp_dir().join(format!("tenantgate-multinode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("policy.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let replica_ports = [free_port(), free_port()];
    let mut replicas: Vec<Serve> = replica_ports
        .iter()
        .enumerate()
        .map(|(i, &port)| {
            Serve::start(
                &policy,
                &redis.url(),
                INTERVAL.as_millis() as u64,
                port,
                &dir.join(format!("serve-{i}.log")),
            )
        })
        .collect();
    let envoys: Vec<Envoy> = [("envoy-eu-1", "eu"), ("envoy-eu-2", "eu"), ("envoy-us-1", "us")]
        .iter()
        .map(|(id, region)| {
            let node = NodeSpec {
                id: (*id).into(),
                region: Some((*region).into()),
                sync_ports: replica_ports.to_vec(),
                ..NodeSpec::default()
            };
            Envoy::start_node(POLICY, &node)
        })
        .collect();
    let ports: Vec<u16> = envoys.iter().map(|e| e.port).collect();

    // A. Steady: one tenant spread over the three nodes.
    let steady = drive(&ports, Duration::from_secs(10));
    report("steady (2 replicas, Redis)", &steady);
    assert!(steady.other.is_empty(), "{:?}", steady.other);
    let bound = RATE * steady.elapsed + BURST + NODES * PROVISIONAL;
    let alone = NODES * (RATE * steady.elapsed + BURST);
    println!("  bound r·E + B + N·P = {bound:.0}; per-node limits would admit {alone:.0}");
    assert!(
        (steady.admitted as f64) <= bound,
        "admitted {} > bound {bound:.0}",
        steady.admitted
    );
    assert!(
        (steady.admitted as f64) >= 0.8 * RATE * steady.elapsed,
        "utilisation: {}",
        steady.admitted
    );
    for e in &envoys {
        assert!(
            e.tg_stat("sync.ok") >= 10,
            "every node synced: {}",
            e.tg_stat("sync.ok")
        );
    }

    // B. Both replicas killed: requests are not slowed, and
    // fail_open_local keeps each node near its last share.
    for r in &mut replicas {
        r.stop();
    }
    let outage = drive(&ports, Duration::from_secs(5));
    report("replicas killed", &outage);
    assert!(outage.other.is_empty(), "{:?}", outage.other);
    assert!(
        within_twice(steady.p99, outage.p99),
        "p99 {:?} vs {:?} before",
        outage.p99,
        steady.p99
    );
    // fail_open_local's term: r·I + N·c (each local bucket holds its
    // outage allowance plus one request of cost 1).
    let local_term = RATE * INTERVAL.as_secs_f64() + NODES;
    let outage_bound = RATE * outage.elapsed + BURST + NODES * PROVISIONAL + local_term;
    assert!(
        (outage.admitted as f64) <= outage_bound,
        "admitted {} > {outage_bound:.0}",
        outage.admitted
    );
    assert!(
        outage.admitted > 0,
        "fail_open_local keeps admitting at the last shares"
    );

    // C. Replicas back: every node syncs again by its next probe. A
    // failed probe at `t` opens the breaker until the next report due
    // (`t + I`) plus the backoff (at most `breaker_max_backoff`, 2·I by
    // default), so a service back just after a failed probe is probed
    // again at most `I + 2·I` later; the tick (10 ms) and the callout add
    // a little more.
    let before: Vec<u64> = envoys.iter().map(|e| e.tg_stat("sync.ok")).collect();
    for r in &mut replicas {
        r.restart();
    }
    let restarted = Instant::now();
    let probe_period = INTERVAL + BREAKER_MAX_BACKOFF;
    for (e, b) in envoys.iter().zip(&before) {
        assert!(
            wait_for(probe_period + Duration::from_millis(300), || e.tg_stat("sync.ok")
                > *b),
            "a node did not sync within {} ms of the replicas being ready",
            (probe_period + Duration::from_millis(300)).as_millis()
        );
    }
    let converged = restarted.elapsed();
    println!(
        "  all nodes synced again {} ms after the replicas were ready",
        converged.as_millis()
    );
    let recovered = drive(&ports, Duration::from_secs(4));
    report("replicas back", &recovered);
    assert!(recovered.other.is_empty(), "{:?}", recovered.other);
    assert!(
        (recovered.admitted as f64) <= RATE * recovered.elapsed + BURST + NODES * PROVISIONAL + local_term
    );

    // D. A service that answers after 1 s (one replica's port), the other down.
    for r in &mut replicas {
        r.stop();
    }
    let stub = SyncServer::start_on(
        replica_ports[0],
        SyncMode::Slow(Duration::from_secs(1), 10),
        INTERVAL.as_millis() as u64,
    );
    let slow = drive(&ports, Duration::from_secs(3));
    report("service answers after 1 s", &slow);
    assert!(slow.other.is_empty(), "{:?}", slow.other);
    assert!(
        within_twice(steady.p99, slow.p99),
        "p99 {:?} vs {:?} before",
        slow.p99,
        steady.p99
    );
    assert!(envoys.iter().map(|e| e.tg_stat("sync.timeouts")).sum::<u64>() > 0);

    // E. A service that answers garbage.
    stub.set_mode(SyncMode::Garbage);
    let garbage = drive(&ports, Duration::from_secs(3));
    report("service answers garbage", &garbage);
    assert!(garbage.other.is_empty(), "{:?}", garbage.other);
    assert!(
        within_twice(steady.p99, garbage.p99),
        "p99 {:?} vs {:?} before",
        garbage.p99,
        steady.p99
    );
    for e in &envoys {
        assert!(e.tg_stat("sync.failed") > 0);
    }
    drop(redis);
    let _ = std::fs::remove_dir_all(&dir);
}
