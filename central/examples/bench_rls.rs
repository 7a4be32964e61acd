//! `make bench-service`, its RLS rows: Envoy's `ShouldRateLimit` answered
//! by the service over gRPC on loopback, as Envoy's ratelimit filter asks
//! it: h2c, a few connections (Envoy opens one per worker), many streams on
//! each, TCP_NODELAY on the client's side (Envoy sets it on every upstream
//! connection).
//!
//! For 1, 4 and 8 limited descriptors per request (each its own key, each
//! answered with its limit: 8 make an answer of about 400 bytes), a bounded
//! number of requests from `CLIENTS` concurrent callers over `CONNECTIONS`
//! connections: p50 and p99 latency (client side, request sent to answer
//! read) and throughput. Two listeners in the same run:
//!
//! - `serve`: the listener `tenantgate serve --grpc-listen` accepts on
//!   (`SyncListener`, TCP_NODELAY on every accepted connection);
//! - `no_nodelay`: the same router on a bare `TcpListener`, as serve did
//!   before issue 32 (Nagle's algorithm on): the baseline.
//!
//! On `serve`, 8 descriptors again at 16, 8 and 4 callers: the latency
//! below saturation (32 callers saturate this 2-core machine, where the
//! client, the service and Redis share the cores).
//!
//! The rows above are a closed loop: each caller sends its next call as
//! soon as the last one is answered, so the 32-caller rows measure the
//! machine's capacity and their latency is its queue. Envoy does not call
//! that way: it asks once per request it receives, at the rate requests
//! arrive. So serve's 8-descriptor row is also run **open loop** at offered
//! rates (`PACED`): 32 callers, each sending on its own schedule (call `k`
//! of caller `c` is due at `(k × 32 + c) / rate` s). A call sent late
//! because the caller's previous call was slow is charged the wait: its
//! latency counts from when it was due (no coordinated omission); any
//! other from when it was sent (tokio's timer wakes up to 1 ms late). Beside each of these rows: the CPU time per call
//! of this process (client and service together) and of `redis-server`,
//! and the machine's use of its cores (`/proc/stat`), which shows where
//! the capacity is spent.
//!
//! Stores: the embedded one, and a `redis-server` started here when one is
//! installed. Target: p99 ≤ 2 ms at 8 descriptors on `serve` (PASS/MISS);
//! Envoy's default timeout is 20 ms. A benchmark: it prints figures and
//! asserts nothing about time.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a benchmark

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use prost::Message;
use tenantgate_central::clock::{Clock, SystemClock};
use tenantgate_central::grpc::counters::{Counters, MemoryCounters, RedisCounters};
use tenantgate_central::grpc::rls::Rls;
use tenantgate_central::listener::SyncListener;
use tenantgate_central::testing::redis_cpu_ns;
use tokio::time::Instant;

/// The allocator `tenantgate serve` runs with.
#[global_allocator]
static ALLOCATOR: tenantgate_central::ServiceAllocator = tenantgate_central::ServiceAllocator;

const CONNECTIONS: usize = 4;
const CLIENTS: usize = 32;
/// Requests per row, and the most a row may take.
const REQUESTS: usize = 8_000;
const ROW_BUDGET: Duration = Duration::from_secs(20);
const TARGET_P99: Duration = Duration::from_millis(2);
/// The open-loop rows' offered rates, calls per second (32 callers).
const PACED: [u32; 3] = [4_000, 8_000, 10_000];

const POLICY: &str = r#"
version: "bench-rls"
identity: { header: x-tenant-id }
plans:
  wide: { limits: [ { rate: 100000000, per: 1s } ] }
default_plan: wide
anonymous: { plan: wide }
routes: { api: {} }
default_route: api
descriptors:
  bench:
    - { key: k1, plan: wide }
    - { key: k2, plan: wide }
    - { key: k3, plan: wide }
    - { key: k4, plan: wide }
    - { key: k5, plan: wide }
    - { key: k6, plan: wide }
    - { key: k7, plan: wide }
    - { key: k8, plan: wide }
"#;

fn request(descriptors: usize, client: usize) -> Vec<u8> {
    let req = RateLimitRequest {
        domain: "bench".to_owned(),
        descriptors: (1..=descriptors)
            .map(|k| RateLimitDescriptor {
                entries: vec![Entry {
                    key: format!("k{k}"),
                    value: format!("tenant-{client}"),
                }],
                ..Default::default()
            })
            .collect(),
        hits_addend: 1,
    };
    let message = req.encode_to_vec();
    let mut out = vec![0u8];
    out.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    out.extend_from_slice(&message);
    out
}

async fn connect(addr: SocketAddr) -> h2::client::SendRequest<bytes::Bytes> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    client
}

/// One call: the answer's size in bytes (the message, unframed).
async fn call(client: &mut h2::client::SendRequest<bytes::Bytes>, addr: SocketAddr, body: &[u8]) -> usize {
    let req = http::Request::post(format!(
        "http://{addr}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap();
    let mut ready = client.clone().ready().await.unwrap();
    let (resp, mut send) = ready.send_request(req, false).unwrap();
    send.send_data(bytes::Bytes::copy_from_slice(body), true).unwrap();
    let mut body = resp.await.unwrap().into_body();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    let _ = body.trailers().await;
    let answer = RateLimitResponse::decode(&bytes[5..]).unwrap();
    assert_eq!(answer.overall_code, 1, "the bench's limits never refuse");
    bytes.len().saturating_sub(5)
}

struct Row {
    p50: Duration,
    p99: Duration,
    per_s: f64,
    answer_bytes: usize,
    requests: usize,
}

/// `CONNECTIONS` connections, each warmed up by one call, and the size of
/// an answer.
async fn warm(addr: SocketAddr, descriptors: usize) -> (Vec<h2::client::SendRequest<bytes::Bytes>>, usize) {
    let mut conns = Vec::new();
    for _ in 0..CONNECTIONS {
        conns.push(connect(addr).await);
    }
    let mut answer_bytes = 0;
    for (i, c) in conns.iter_mut().enumerate() {
        answer_bytes = call(c, addr, &request(descriptors, i)).await;
    }
    (conns, answer_bytes)
}

/// The row of the latencies measured over `took`.
fn summary(mut all: Vec<Duration>, took: Duration, answer_bytes: usize) -> Row {
    all.sort();
    let at = |q: f64| all[((all.len() as f64 * q) as usize).min(all.len() - 1)];
    Row {
        p50: at(0.50),
        p99: at(0.99),
        per_s: all.len() as f64 / took.as_secs_f64(),
        answer_bytes,
        requests: all.len(),
    }
}

/// A row of `clients` callers. Closed loop (`rate` `None`): each sends
/// its next call when the last is answered, its latency counted from when
/// it was sent. Open loop: together they offer `rate` calls/s, call `k` of
/// caller `c` due at `(k × clients + c) / rate` s; a call late because the
/// caller's previous one was slow counts from when it was due, any other
/// from when it was sent (tokio's timer wakes up to 1 ms late: not the
/// service's).
async fn row(addr: SocketAddr, descriptors: usize, clients: usize, rate: Option<u32>) -> Row {
    let (conns, answer_bytes) = warm(addr, descriptors).await;
    let started = Instant::now();
    let per_client = REQUESTS / clients;
    // (the gap between one caller's calls, between two callers' first)
    let schedule = rate.map(|r| {
        (
            Duration::from_secs_f64(clients as f64 / f64::from(r)),
            Duration::from_secs_f64(1.0 / f64::from(r)),
        )
    });
    let mut tasks = Vec::new();
    for client in 0..clients {
        let mut conn = conns[client % CONNECTIONS].clone();
        let body = request(descriptors, client);
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(per_client);
            let mut last_done = started;
            for k in 0..per_client {
                if started.elapsed() > ROW_BUDGET {
                    break;
                }
                let mut from = Instant::now();
                if let Some((gap, offset)) = schedule {
                    let due = started + offset * client as u32 + gap * k as u32;
                    tokio::time::sleep_until(due).await;
                    from = if last_done > due { due } else { Instant::now() };
                }
                call(&mut conn, addr, &body).await;
                last_done = Instant::now();
                latencies.push(last_done - from);
            }
            latencies
        }));
    }
    let mut all = Vec::with_capacity(REQUESTS);
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    summary(all, started.elapsed(), answer_bytes)
}

/// This process's CPU time so far (every thread: the client's and the
/// service's), in ns.
fn process_cpu_ns() -> u64 {
    // Fields 14 and 15 of /proc/self/stat: user and system time in ticks
    // of 10 ms (the field after the command's closing parenthesis is 3).
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let ticks: u64 = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|f| f.parse::<u64>().ok())
        .sum();
    ticks * 10_000_000
}

/// The machine's busy and total time on all cores so far (`/proc/stat`,
/// ticks).
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().sum();
    // idle and iowait
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

fn services(counters: Arc<dyn Counters>) -> tenantgate_central::grpc::Services {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock::default());
    let rls = Rls::new(counters.clone(), clock.clone());
    rls.set_policy(tenantgate_central::service::policy::parse(POLICY).unwrap().rls);
    tenantgate_central::grpc::Services {
        rls: Arc::new(rls),
        rlqs: Arc::new(tenantgate_central::grpc::rlqs::Rlqs::new(
            counters,
            clock,
            Default::default(),
        )),
    }
}

/// Serves the gRPC router on a loopback port: through serve's listener, or
/// (the baseline) a bare one.
async fn listen(services: tenantgate_central::grpc::Services, nodelay: bool) -> SocketAddr {
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let router = tenantgate_central::grpc::router(services);
    if nodelay {
        // serve's loop: its caps (streams, windows, bytes in flight) included.
        let limits = tenantgate_central::bounded::ListenerLimits::default();
        let budget = tenantgate_central::bounded::Budget::new(limits.max_bytes_in_flight);
        tokio::spawn(tenantgate_central::bounded::serve(
            SyncListener::plain(tcp),
            router,
            limits,
            budget,
            std::future::pending(),
        ));
    } else {
        tokio::spawn(async move { axum::serve(tcp, router).await });
    }
    addr
}

/// `counters` makes a listener's store; `profile` tells where a row's time
/// went in it (Redis), since the last call.
async fn rows(
    store: &str,
    counters: impl Fn() -> Arc<dyn Counters>,
    profile: impl Fn() -> Option<String>,
    redis_url: Option<&str>,
) {
    for (listener, nodelay) in [("serve", true), ("no_nodelay", false)] {
        let addr = listen(services(counters()), nodelay).await;
        // Each descriptor count at CLIENTS callers, then (serve only) 8
        // descriptors at fewer callers: where p99 stands below saturation.
        let sweep: &[(usize, usize)] = if nodelay {
            &[(1, CLIENTS), (4, CLIENTS), (8, CLIENTS), (8, 16), (8, 8), (8, 4)]
        } else {
            &[(1, CLIENTS), (4, CLIENTS), (8, CLIENTS)]
        };
        for &(descriptors, clients) in sweep {
            let r = row(addr, descriptors, clients, None).await;
            let verdict = if !nodelay || descriptors != 8 {
                ""
            } else if r.p99 <= TARGET_P99 {
                "  PASS (p99 ≤ 2 ms)"
            } else {
                "  MISS (p99 > 2 ms)"
            };
            println!(
                "rls {store:<8} {listener:<10} {descriptors} descriptors ({:>3} B answer): p50 {:>7.3} ms  p99 {:>7.3} ms  {:>8.0} calls/s  ({} calls, {clients} callers on {CONNECTIONS} connections){verdict}",
                r.answer_bytes,
                r.p50.as_secs_f64() * 1e3,
                r.p99.as_secs_f64() * 1e3,
                r.per_s,
                r.requests,
            );
            if let Some(p) = profile() {
                println!("    {store} profile: {p}");
            }
        }
        if !nodelay {
            continue;
        }
        for rate in PACED {
            let redis_before = match redis_url {
                Some(u) => redis_cpu_ns(u).unwrap(),
                None => 0,
            };
            let cpu_before = process_cpu_ns();
            let (busy_before, total_before) = machine_ticks();
            let r = row(addr, 8, CLIENTS, Some(rate)).await;
            let cpu = process_cpu_ns().saturating_sub(cpu_before);
            let (busy, total) = machine_ticks();
            let busy_share = (busy - busy_before) as f64 / (total - total_before).max(1) as f64;
            let redis_cpu = match redis_url {
                Some(u) => redis_cpu_ns(u).unwrap().saturating_sub(redis_before),
                None => 0,
            };
            let calls = (r.requests + CONNECTIONS) as f64;
            let verdict = if r.p99 <= TARGET_P99 {
                "  PASS (p99 ≤ 2 ms)"
            } else {
                "  MISS (p99 > 2 ms)"
            };
            println!(
                "rls {store:<8} {listener:<10} 8 descriptors, open loop, offered {rate:>6} calls/s: p50 {:>7.3} ms  p99 {:>7.3} ms  {:>8.0} calls/s  ({} calls, {CLIENTS} callers){verdict}",
                r.p50.as_secs_f64() * 1e3,
                r.p99.as_secs_f64() * 1e3,
                r.per_s,
                r.requests,
            );
            println!(
                "    CPU per call: client + service {:.1} µs, redis-server {:.1} µs; the machine's cores {:.0} % busy",
                cpu as f64 / 1e3 / calls,
                redis_cpu as f64 / 1e3 / calls,
                busy_share * 100.0,
            );
            if let Some(p) = profile() {
                println!("    {store} profile: {p}");
            }
        }
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        rows(
            "embedded",
            || Arc::new(MemoryCounters::new(100_000)) as Arc<dyn Counters>,
            || None,
            None,
        )
        .await;
        match tenantgate_central::testing::RedisServer::start() {
            Ok(redis) => {
                let url = redis.url();
                let made: std::sync::Mutex<Vec<Arc<RedisCounters>>> = Default::default();
                rows(
                    "redis",
                    || {
                        let c = Arc::new(RedisCounters::new(&url, "bench").unwrap());
                        made.lock().unwrap().push(c.clone());
                        c as Arc<dyn Counters>
                    },
                    // The latest listener's store (the warm-up calls included).
                    || made.lock().unwrap().last().map(|c| c.profile.take().to_string()),
                    Some(&url),
                )
                .await;
            }
            Err(e) => println!("rls redis: skipped ({e})"),
        }
    });
}
