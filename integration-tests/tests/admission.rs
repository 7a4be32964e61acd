//! Admission control in a real Envoy 1.40 (`--concurrency 2`) in front of
//! the controllable test upstream (`upstream::Upstream`): the in-flight
//! limit of a dependency across both workers, system traffic through a
//! saturated dependency, forged criticality headers, slots coming back
//! after client resets and a policy reload in the middle of traffic,
//! 1,000 simultaneous rejections with spread `Retry-After`, and the request
//! checks (body size, timeout budget), and the queues: a full level
//! refuses at once, a held request never waits past its `max_wait`, and
//! held requests get the slots that free up; and an API action's in-flight
//! limit (`actions:`) across both workers with a slow upstream.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use tenantgate_integration_tests::upstream::Upstream;
use tenantgate_integration_tests::{get, on_both_hosts, percentile, wait_for, Conn, Envoy, Response};

const CLASSES: [&str; 8] = [
    "orders", "health", "upload", "shared", "jobs", "urgent", "feed", "metered",
];
const WAIT: Duration = Duration::from_secs(20);

/// `db`: 5 slots, 1 reserved for system (normal traffic gets 4).
fn policy(version: &str, max_in_flight: u32) -> String {
    format!(
        r#"
version: "{version}"
identity: {{ header: x-tenant-id }}
plans:
  free: {{ limits: [ {{ rate: 1000000, per: 1s }} ] }}
  tight: {{ limits: [ {{ rate: 1, per: 1h, burst: 2 }} ] }}
tenants: [ {{ id: capped, plan: tight }} ]
default_plan: free
anonymous: {{ plan: free }}
dependencies:
  db: {{ max_in_flight: {max_in_flight}, reserved: {{ system: 1 }} }}
  files: {{ max_in_flight: 50, tenant_max_share: 2 }}
  events: {{ max_in_flight: 10, max_streams: 2 }}
  batch:
    max_in_flight: 2
    queues: {{ normal: {{ max_queue: 1, max_wait: 400ms }}, critical: {{ max_queue: 10, max_wait: 10s }} }}
routes:
  jobs: {{ dependency: batch }}
  feed: {{ dependency: events, streaming: true }}
  metered: {{ dependency: events }}
  urgent: {{ criticality: critical, dependency: batch }}
  orders: {{ dependency: db }}
  health: {{ criticality: system, dependency: db }}
  upload: {{ dependency: files, max_body_bytes: 100, min_timeout_budget: 200ms }}
  shared: {{ dependency: files }}
  api: {{}}
"#
    )
}

fn start() -> (Upstream, Envoy) {
    let upstream = Upstream::start();
    let envoy = Envoy::start_with_upstream(&policy("adm-1", 5), upstream.port, &CLASSES);
    (upstream, envoy)
}

/// A request on its own connection, in its own thread (it may be held).
fn spawn_get(
    port: u16,
    path: &'static str,
    tenant: &'static str,
    tx: &mpsc::Sender<Response>,
) -> JoinHandle<()> {
    let tx = tx.clone();
    std::thread::spawn(move || {
        let r = get(port, path, &[("x-tenant-id", tenant)]);
        let _ = tx.send(r);
    })
}

fn gauge(envoy: &Envoy, dependency: &str) -> Option<u64> {
    envoy.stat(&format!("wasmcustom.tenantgate.admission.in_flight.{dependency}"))
}

fn assert_refused(r: &Response, reason: &str) {
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.header("x-tenantgate-reason"), Some(reason), "{r:?}");
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let retry: u64 = r.header("retry-after").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!((1..=10).contains(&retry), "Retry-After {retry}");
    assert_eq!(r.json()["reason"], reason);
}

#[test]
fn the_in_flight_limit_holds_across_workers_system_passes_and_forged_headers_change_nothing() {
    let (upstream, envoy) = start();
    upstream.hold();
    let (tx, rx) = mpsc::channel();
    let held: Vec<JoinHandle<()>> = (0..6)
        .map(|_| spawn_get(envoy.port, "/up/orders", "acme", &tx))
        .collect();
    // 4 reach the upstream, 2 are refused at once.
    let mut refused = Vec::new();
    assert!(
        wait_for(WAIT, || {
            refused.extend(rx.try_iter());
            upstream.in_flight() == 4 && refused.len() == 2
        }),
        "in flight {}, refused {refused:?}",
        upstream.in_flight()
    );
    for r in &refused {
        assert_refused(r, "concurrency_limit");
    }
    // Forged criticality and priority headers change nothing.
    let forged = get(
        envoy.port,
        "/up/orders",
        &[
            ("x-tenant-id", "acme"),
            ("x-tenantgate-criticality", "system"),
            ("x-criticality", "system"),
            ("x-envoy-priority", "high"),
            ("priority", "u=0"),
            ("x-tenantgate-class", "health"),
        ],
    );
    assert_refused(&forged, "concurrency_limit");
    // System traffic is admitted while everything else is saturated...
    let system = spawn_get(envoy.port, "/up/health", "ops", &tx);
    assert!(wait_for(WAIT, || upstream.in_flight() == 5));
    // ...up to its reservation.
    assert_refused(
        &get(envoy.port, "/up/health", &[("x-tenant-id", "ops")]),
        "concurrency_limit",
    );
    assert_eq!(upstream.max_in_flight(), 5);
    assert!(
        wait_for(WAIT, || gauge(&envoy, "db") == Some(5)),
        "gauge {:?}",
        gauge(&envoy, "db")
    );

    upstream.release();
    for h in held.into_iter().chain([system]) {
        h.join().unwrap();
    }
    let answered: Vec<u16> = rx.try_iter().map(|r| r.status).collect();
    assert_eq!(answered, [200; 5], "{answered:?}");
    assert!(
        wait_for(WAIT, || gauge(&envoy, "db") == Some(0)),
        "gauge {:?}",
        gauge(&envoy, "db")
    );
    assert_eq!(upstream.max_in_flight(), 5);
    assert_eq!(envoy.tg_stat("admission.admitted.normal"), 4);
    assert_eq!(envoy.tg_stat("admission.admitted.system"), 1);
    assert_eq!(envoy.tg_stat("admission.concurrency_limit.normal"), 3);
    assert_eq!(envoy.tg_stat("admission.concurrency_limit.system"), 1);
    assert_eq!(envoy.tg_stat("decisions.concurrency_limit"), 4);
    // Both workers took part (the test's 9 connections spread over them):
    // the limit held node-wide, not per worker.
    let [w0, w1] = envoy.worker_connections();
    assert!(w0 > 0 && w1 > 0, "connections per worker: {w0}, {w1}");
}

/// Sends a request on a raw connection and leaves it open.
fn open_request(port: u16, path: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nhost: t\r\nx-tenant-id: acme\r\n\r\n").unwrap();
    s
}

#[test]
fn slots_come_back_after_client_resets_and_a_reload_mid_traffic() {
    let (upstream, envoy) = start();
    upstream.hold();
    // Four clients take every normal slot, then go away: two close, two
    // reset (linger 0).
    let clients: Vec<TcpStream> = (0..4).map(|_| open_request(envoy.port, "/up/orders")).collect();
    assert!(wait_for(WAIT, || upstream.in_flight() == 4));
    assert!(wait_for(WAIT, || gauge(&envoy, "db") == Some(4)));
    for (i, c) in clients.into_iter().enumerate() {
        if i % 2 == 0 {
            socket2::SockRef::from(&c)
                .set_linger(Some(Duration::ZERO))
                .unwrap();
        }
        drop(c);
    }
    // The slots come back although the upstream still holds the requests.
    assert!(
        wait_for(WAIT, || gauge(&envoy, "db") == Some(0)),
        "gauge {:?} after the clients left",
        gauge(&envoy, "db")
    );
    let (tx, rx) = mpsc::channel();
    let mut held: Vec<JoinHandle<()>> = (0..4)
        .map(|_| spawn_get(envoy.port, "/up/orders", "acme", &tx))
        .collect();
    assert!(wait_for(WAIT, || gauge(&envoy, "db") == Some(4)));
    assert_refused(
        &get(envoy.port, "/up/orders", &[("x-tenant-id", "acme")]),
        "concurrency_limit",
    );

    // A reload in the middle of traffic: 4 requests in flight across it.
    let loads = envoy.tg_stat("config.loads");
    let (ok, err) = envoy.apply(&policy("adm-2", 7));
    assert!(ok, "{err}");
    assert!(wait_for(WAIT, || envoy.tg_stat("config.loads") >= loads + 2));
    // The new limit counts the slots taken under the old policy: 6 for
    // normal traffic, 4 already held.
    held.extend((0..2).map(|_| spawn_get(envoy.port, "/up/orders", "acme", &tx)));
    assert!(
        wait_for(WAIT, || gauge(&envoy, "db") == Some(6)),
        "gauge {:?}",
        gauge(&envoy, "db")
    );
    assert_refused(
        &get(envoy.port, "/up/orders", &[("x-tenant-id", "acme")]),
        "concurrency_limit",
    );

    upstream.release();
    for h in held {
        h.join().unwrap();
    }
    let statuses: Vec<u16> = rx.try_iter().map(|r| r.status).collect();
    assert_eq!(statuses, [200; 6], "{statuses:?}");
    // Traffic stopped: the gauge is back to 0.
    assert!(
        wait_for(WAIT, || gauge(&envoy, "db") == Some(0)),
        "gauge {:?}",
        gauge(&envoy, "db")
    );
}

/// One answer of the thousand.
struct Refused {
    status: u16,
    retry_after: Option<u64>,
    request_id_echoed: bool,
}

#[test]
fn a_thousand_simultaneous_rejections_carry_spread_retry_after() {
    let (upstream, envoy) = start();
    upstream.hold();
    let (tx, rx) = mpsc::channel();
    let held: Vec<JoinHandle<()>> = (0..4)
        .map(|_| spawn_get(envoy.port, "/up/orders", "acme", &tx))
        .collect();
    assert!(wait_for(WAIT, || upstream.in_flight() == 4));
    // 10 clients × 100 requests on keep-alive connections, all at once.
    let port = envoy.port;
    let clients: Vec<JoinHandle<Vec<Refused>>> = (0..10)
        .map(|c| {
            std::thread::spawn(move || {
                let mut conn = Conn::open(port).unwrap();
                (0..100)
                    .map(|i| {
                        let id = format!("req-{c}-{i}");
                        let r = conn
                            .get("/up/orders", &[("x-tenant-id", "acme"), ("x-request-id", &id)])
                            .unwrap();
                        let retry = r.header("retry-after").and_then(|v| v.parse().ok());
                        // Envoy replaces an external client's id with its
                        // own: the reply echoes the one Envoy gave the request.
                        let header = r.header("x-request-id").map(str::to_owned);
                        let echoed =
                            header.is_some_and(|h| !h.is_empty() && r.json()["request_id"] == h.as_str());
                        Refused {
                            status: r.status,
                            retry_after: retry,
                            request_id_echoed: echoed,
                        }
                    })
                    .collect()
            })
        })
        .collect();
    let answers: Vec<_> = clients.into_iter().flat_map(|h| h.join().unwrap()).collect();
    assert_eq!(answers.len(), 1000);
    assert!(answers.iter().all(|a| a.status == 503));
    assert!(answers.iter().all(|a| a.request_id_echoed), "request ids echoed");
    let mut seen = [0usize; 11];
    for a in &answers {
        let v = a.retry_after.unwrap_or(0);
        assert!((1..=10).contains(&v), "Retry-After {v}");
        seen[v as usize] += 1;
    }
    let most = seen.iter().max().copied().unwrap_or(0);
    println!("Retry-After histogram over 1..=10 s: {:?}", &seen[1..]);
    assert!(most <= 200, "one Retry-After value for {most} of 1,000: {seen:?}");
    upstream.release();
    for h in held {
        h.join().unwrap();
    }
    assert_eq!(rx.try_iter().count(), 4);
    assert!(wait_for(WAIT, || gauge(&envoy, "db") == Some(0)));
}

/// A raw request and the response's status and reason header (the
/// connection is closed by the request).
fn raw(port: u16, head: &str, body: &[u8]) -> (u16, Option<String>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // Head and body in one write, so that Envoy reads them together: a
    // chunk that reached the filter only after the upstream had answered
    // the head could no longer be refused (the answer would be the
    // upstream's 200). The filter may answer before the whole body is read.
    let mut request = head.as_bytes().to_vec();
    request.extend_from_slice(body);
    let _ = s.write_all(&request);
    let mut text = Vec::new();
    let _ = s.read_to_end(&mut text);
    let text = String::from_utf8_lossy(&text).into_owned();
    let status = text.split(' ').nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
    let reason = text
        .lines()
        .find_map(|l| l.strip_prefix("x-tenantgate-reason: "))
        .map(|v| v.trim().to_owned());
    (status, reason)
}

#[test]
fn oversized_bodies_short_timeout_budgets_and_tenant_shares_are_refused() {
    let (upstream, envoy) = start();
    let port = envoy.port;
    let post = |headers: &str| {
        format!(
            "POST /up/upload HTTP/1.1\r\nhost: t\r\nx-tenant-id: acme\r\nconnection: close\r\n{headers}\r\n"
        )
    };
    // A declared size over max_body_bytes: 413 before the body is read.
    let (status, reason) = raw(port, &post("content-length: 101\r\n"), &[b'x'; 101]);
    assert_eq!((status, reason.as_deref()), (413, Some("request_too_large")));
    assert_eq!(raw(port, &post("content-length: 100\r\n"), &[b'x'; 100]).0, 200);
    // A chunked body is counted as it streams.
    let chunk = format!("3c\r\n{}\r\n", "y".repeat(60));
    let body = format!("{chunk}{chunk}0\r\n\r\n");
    let (status, reason) = raw(port, &post("transfer-encoding: chunked\r\n"), body.as_bytes());
    assert_eq!((status, reason.as_deref()), (413, Some("request_too_large")));
    let small = format!("{chunk}0\r\n\r\n");
    assert_eq!(
        raw(port, &post("transfer-encoding: chunked\r\n"), small.as_bytes()).0,
        200
    );
    // The remaining timeout budget.
    let short = get(
        port,
        "/up/upload",
        &[("x-tenant-id", "acme"), ("x-envoy-expected-rq-timeout-ms", "150")],
    );
    assert_eq!(short.status, 503);
    assert_eq!(short.header("x-tenantgate-reason"), Some("timeout_budget"));
    let enough = get(
        port,
        "/up/upload",
        &[("x-tenant-id", "acme"), ("x-envoy-expected-rq-timeout-ms", "250")],
    );
    assert_eq!(enough.status, 200);

    // One tenant holds at most 2 of `files`; another is not affected.
    // Each tenant's key-table entry is created first, by a request that
    // ends: Envoy's shared data has no create-if-absent, so two workers
    // creating one entry at once can lose a count until its worker
    // republishes it (docs/admission.md, "What happens to slots when a
    // worker goes away"). That window is its own claim, not this one.
    for tenant in ["flood", "quiet"] {
        assert_eq!(get(port, "/up/shared", &[("x-tenant-id", tenant)]).status, 200);
    }
    upstream.hold();
    let (tx, rx) = mpsc::channel();
    let held: Vec<JoinHandle<()>> = (0..2)
        .map(|_| spawn_get(port, "/up/shared", "flood", &tx))
        .collect();
    assert!(wait_for(WAIT, || upstream.in_flight() == 2));
    assert_refused(
        &get(port, "/up/shared", &[("x-tenant-id", "flood")]),
        "tenant_share",
    );
    let quiet = spawn_get(port, "/up/shared", "quiet", &tx);
    assert!(wait_for(WAIT, || upstream.in_flight() == 3));
    upstream.release();
    for h in held.into_iter().chain([quiet]) {
        h.join().unwrap();
    }
    assert_eq!(rx.try_iter().filter(|r| r.status == 200).count(), 3);
    assert!(wait_for(WAIT, || gauge(&envoy, "files") == Some(0)));
    assert_eq!(envoy.tg_stat("admission.request_too_large.normal"), 2);
    assert_eq!(envoy.tg_stat("admission.timeout_budget.normal"), 1);
    assert_eq!(envoy.tg_stat("admission.tenant_share.normal"), 1);
}

/// A request on its own connection, timed from send to answer.
fn spawn_timed(port: u16, path: &'static str, tx: &mpsc::Sender<(Response, Duration)>) -> JoinHandle<()> {
    let tx = tx.clone();
    std::thread::spawn(move || {
        let start = std::time::Instant::now();
        let r = get(port, path, &[("x-tenant-id", "acme")]);
        let _ = tx.send((r, start.elapsed()));
    })
}

on_both_hosts!(a_full_queue_refuses_at_once_and_nobody_waits_past_max_wait);
fn a_full_queue_refuses_at_once_and_nobody_waits_past_max_wait() {
    let (upstream, envoy) = start();
    upstream.hold();
    let (tx, rx) = mpsc::channel();
    let held: Vec<JoinHandle<()>> = (0..2)
        .map(|_| spawn_get(envoy.port, "/up/jobs", "acme", &tx))
        .collect();
    assert!(wait_for(WAIT, || upstream.in_flight() == 2));
    // 6 more: at most one held per worker (max_queue 1), the rest refused.
    let (ttx, trx) = mpsc::channel();
    let waiting: Vec<JoinHandle<()>> = (0..6)
        .map(|_| spawn_timed(envoy.port, "/up/jobs", &ttx))
        .collect();
    let mut answers: Vec<(Response, Duration)> = Vec::new();
    let answered = wait_for(Duration::from_secs(5), || {
        answers.extend(trx.try_iter());
        answers.len() == 6
    });
    assert!(
        answered,
        "{} of 6 answered; upstream in flight {}, admitted {}, queued {}, gauge {:?}",
        answers.len(),
        upstream.in_flight(),
        envoy.tg_stat("admission.admitted.normal"),
        envoy.tg_stat("admission.queued.normal"),
        gauge(&envoy, "batch")
    );
    for h in waiting {
        h.join().unwrap();
    }
    assert_eq!(answers.len(), 6);
    let full: Vec<&(Response, Duration)> = answers
        .iter()
        .filter(|(r, _)| r.header("x-tenantgate-reason") == Some("queue_full"))
        .collect();
    let timed_out: Vec<&(Response, Duration)> = answers
        .iter()
        .filter(|(r, _)| r.header("x-tenantgate-reason") == Some("queue_timeout"))
        .collect();
    assert_eq!(full.len() + timed_out.len(), 6, "{answers:?}");
    assert!((1..=2).contains(&timed_out.len()), "{} held", timed_out.len());
    for (r, waited) in &full {
        assert_refused(r, "queue_full");
        assert!(
            *waited < Duration::from_millis(300),
            "a full queue refused after {waited:?}"
        );
    }
    for (r, waited) in &timed_out {
        assert_refused(r, "queue_timeout");
        // Answered at the last tick before its 400 ms deadline (plus the
        // client's own round trip on a loaded machine).
        println!("held for {waited:?} (max_wait 400 ms)");
        assert!(
            *waited >= Duration::from_millis(300),
            "answered early: {waited:?}"
        );
        assert!(
            *waited <= Duration::from_millis(400 + 100),
            "waited past max_wait: {waited:?}"
        );
    }
    assert_eq!(upstream.max_in_flight(), 2);
    upstream.release();
    for h in held {
        h.join().unwrap();
    }
    assert_eq!(rx.try_iter().filter(|r| r.status == 200).count(), 2);
    assert!(wait_for(WAIT, || gauge(&envoy, "batch") == Some(0)));
    assert_eq!(envoy.tg_stat("admission.queue_full.normal"), full.len() as u64);
    assert_eq!(
        envoy.tg_stat("admission.queue_timeout.normal"),
        timed_out.len() as u64
    );
}

#[test]
fn held_requests_get_the_slots_that_free_up() {
    let (upstream, envoy) = start();
    upstream.hold();
    let (tx, rx) = mpsc::channel();
    let mut all: Vec<JoinHandle<()>> = (0..2)
        .map(|_| spawn_get(envoy.port, "/up/jobs", "acme", &tx))
        .collect();
    assert!(wait_for(WAIT, || upstream.in_flight() == 2));
    // Critical work finds the pool full (no reservation) and is held.
    all.extend((0..3).map(|_| spawn_get(envoy.port, "/up/urgent", "acme", &tx)));
    assert!(wait_for(WAIT, || envoy.tg_stat("admission.queued.critical") == 3));
    assert_eq!(upstream.in_flight(), 2);
    // Slots free up: the held requests take them (never more than 2).
    upstream.release();
    for h in all {
        h.join().unwrap();
    }
    let statuses: Vec<u16> = rx.try_iter().map(|r| r.status).collect();
    assert_eq!(statuses, [200; 5], "{statuses:?}");
    assert_eq!(upstream.max_in_flight(), 2);
    assert_eq!(envoy.tg_stat("admission.admitted.critical"), 3);
    assert!(wait_for(WAIT, || gauge(&envoy, "batch") == Some(0)));
}

#[test]
fn the_queue_depth_gauge_counts_held_requests_node_wide_and_returns_to_zero() {
    let (upstream, envoy) = start();
    upstream.hold();
    let (tx, rx) = mpsc::channel();
    let mut all: Vec<JoinHandle<()>> = (0..2)
        .map(|_| spawn_get(envoy.port, "/up/jobs", "acme", &tx))
        .collect();
    assert!(wait_for(WAIT, || upstream.in_flight() == 2));
    let depth = || envoy.stat("wasmcustom.tenantgate.admission.queue_depth.batch");
    let oldest = || envoy.stat("wasmcustom.tenantgate.admission.queue_oldest_ms.batch");
    assert_eq!(depth(), Some(0));
    // Four critical requests on fresh connections (both workers) are held.
    all.extend((0..4).map(|_| spawn_get(envoy.port, "/up/urgent", "acme", &tx)));
    assert!(wait_for(WAIT, || depth() == Some(4)), "depth {:?}", depth());
    // The oldest held request's age grows while it waits.
    assert!(
        wait_for(WAIT, || oldest().is_some_and(|ms| ms >= 200)),
        "oldest {:?}",
        oldest()
    );
    upstream.release();
    for h in all {
        h.join().unwrap();
    }
    assert_eq!(rx.try_iter().filter(|r| r.status == 200).count(), 6);
    assert!(wait_for(WAIT, || depth() == Some(0)), "depth {:?}", depth());
    assert!(wait_for(WAIT, || oldest() == Some(0)), "oldest {:?}", oldest());
    assert!(wait_for(WAIT, || gauge(&envoy, "batch") == Some(0)));
}

#[test]
fn shadow_mode_counts_admission_refusals_and_enforces_none() {
    let upstream = Upstream::start();
    let shadow = policy("adm-shadow", 5).replace("identity:", "mode: shadow\nidentity:");
    let envoy = Envoy::start_with_upstream(&shadow, upstream.port, &CLASSES);
    upstream.hold();
    let (tx, rx) = mpsc::channel();
    let held: Vec<JoinHandle<()>> = (0..6)
        .map(|_| spawn_get(envoy.port, "/up/orders", "acme", &tx))
        .collect();
    // All six reach the upstream; the two over the limit are counted.
    assert!(
        wait_for(WAIT, || upstream.in_flight() == 6),
        "in flight {}",
        upstream.in_flight()
    );
    assert!(wait_for(WAIT, || envoy
        .tg_stat("admission.concurrency_limit.normal")
        == 2));
    upstream.release();
    for h in held {
        h.join().unwrap();
    }
    assert_eq!(rx.try_iter().filter(|r| r.status == 200).count(), 6);
    assert!(wait_for(WAIT, || gauge(&envoy, "db") == Some(0)));
}

#[test]
fn under_sustained_load_with_a_slow_upstream_the_limit_always_holds() {
    let (upstream, envoy) = start();
    upstream.set_latency(Duration::from_millis(30));
    let port = envoy.port;
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    // 12 clients, fresh connections (both workers), for 2 s, at most 200
    // requests each.
    let clients: Vec<JoinHandle<Vec<u16>>> = (0..12)
        .map(|_| {
            std::thread::spawn(move || {
                let mut statuses = Vec::new();
                while std::time::Instant::now() < deadline && statuses.len() < 200 {
                    statuses.push(get(port, "/up/orders", &[("x-tenant-id", "acme")]).status);
                }
                statuses
            })
        })
        .collect();
    let statuses: Vec<u16> = clients.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let refused = statuses.iter().filter(|s| **s == 503).count();
    println!(
        "{} requests: {ok} admitted, {refused} refused; upstream at most {} in flight (limit 4)",
        statuses.len(),
        upstream.max_in_flight()
    );
    assert_eq!(ok + refused, statuses.len(), "only 200 and 503");
    assert!(ok > 0 && refused > 0, "{ok} admitted, {refused} refused");
    // The upstream never saw more than the normal share of the limit.
    assert!(
        upstream.max_in_flight() <= 4,
        "{} in flight",
        upstream.max_in_flight()
    );
    assert_eq!(upstream.served(), ok as u64);
    assert!(wait_for(WAIT, || gauge(&envoy, "db") == Some(0)));
    assert_eq!(envoy.tg_stat("admission.admitted.normal"), ok as u64);
    // Refusals are the limit's, or (counted, never an admission) a
    // compare-and-swap that stayed conflicted.
    let limit = envoy.tg_stat("admission.concurrency_limit.normal");
    let contention = envoy.tg_stat("admission.contention.normal");
    println!("refused: {limit} concurrency_limit, {contention} contention");
    assert_eq!(limit + contention, refused as u64);
}

#[test]
fn streams_have_their_own_budget_and_no_slot_outlives_a_rate_limit_denial() {
    let (upstream, envoy) = start();
    upstream.hold();
    let (tx, rx) = mpsc::channel();
    let streams: Vec<JoinHandle<()>> = (0..2)
        .map(|_| spawn_get(envoy.port, "/up/feed", "acme", &tx))
        .collect();
    assert!(wait_for(WAIT, || upstream.in_flight() == 2));
    assert_refused(
        &get(envoy.port, "/up/feed", &[("x-tenant-id", "acme")]),
        "stream_limit",
    );
    // Streams never take request slots: requests of the same dependency pass.
    let request = spawn_get(envoy.port, "/up/metered", "acme", &tx);
    assert!(wait_for(WAIT, || upstream.in_flight() == 3));
    assert!(wait_for(WAIT, || gauge(&envoy, "events") == Some(3)));
    upstream.release();
    for h in streams.into_iter().chain([request]) {
        h.join().unwrap();
    }
    assert_eq!(rx.try_iter().filter(|r| r.status == 200).count(), 3);

    // A tenant over its rate limit (burst 2): no slot outlives its 429.
    let statuses: Vec<u16> = (0..5)
        .map(|_| get(envoy.port, "/up/metered", &[("x-tenant-id", "capped")]).status)
        .collect();
    assert_eq!(statuses, [200, 200, 429, 429, 429]);
    assert!(wait_for(WAIT, || gauge(&envoy, "events") == Some(0)));
    assert_eq!(envoy.tg_stat("admission.stream_limit.normal"), 1);
}

on_both_hosts!(the_decision_record_reaches_the_access_log);
fn the_decision_record_reaches_the_access_log() {
    let upstream = Upstream::start();
    let log = Envoy::temp_dir().join("access.log");
    let envoy = Envoy::start_with_upstream_logged(&policy("adm-log", 5), upstream.port, &CLASSES, Some(&log));
    upstream.hold();
    let (tx, rx) = mpsc::channel();
    let held: Vec<JoinHandle<()>> = (0..4)
        .map(|_| spawn_get(envoy.port, "/up/orders", "acme", &tx))
        .collect();
    assert!(wait_for(WAIT, || upstream.in_flight() == 4));
    assert_refused(
        &get(envoy.port, "/up/orders", &[("x-tenant-id", "acme")]),
        "concurrency_limit",
    );
    upstream.release();
    for h in held {
        h.join().unwrap();
    }
    assert_eq!(rx.try_iter().count(), 4);
    // A class without admission labels writes no record.
    assert_eq!(get(envoy.port, "/api/x", &[("x-tenant-id", "acme")]).status, 200);
    let lines = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(wait_for(WAIT, || lines().lines().count() >= 6), "{}", lines());
    let text = lines();
    println!("{text}");
    assert!(
        text.contains("/up/orders 503 outcome=concurrency_limit criticality=normal dependency=db in_flight=4 queue_wait_ms=0 policy=adm-log key=orders|t|acme limit=dependency:db"),
        "{text}"
    );
    assert_eq!(
        text.lines()
            .filter(|l| l
                .starts_with("/up/orders 200 outcome=admitted criticality=normal dependency=db in_flight="))
            .count(),
        4,
        "{text}"
    );
    assert!(text.contains("/api/x 200 -"), "{text}");
}

/// The spike test's dependency: `svc`, 8 slots (the upstream's capacity),
/// 4 reserved for critical work, one slot per tenant, queues for normal
/// and sheddable work.
const SPIKE_POLICY: &str = r#"
version: "spike-1"
identity: { header: x-tenant-id }
plans:
  free: { limits: [ { rate: 1000000, per: 1s } ] }
default_plan: free
anonymous: { plan: free }
dependencies:
  svc:
    max_in_flight: 8
    reserved: { critical: 4 }
    tenant_max_share: 1
    queues:
      normal: { max_queue: 8, max_wait: 300ms }
      sheddable: { max_queue: 8, max_wait: 250ms }
routes:
  checkout: { criticality: critical, dependency: svc }
  browse: { dependency: svc }
  report: { criticality: sheddable, dependency: svc }
"#;

/// The upstream's concurrency capacity and latency: 160 requests/s.
const SPIKE_CAPACITY: u64 = 8;
const SPIKE_LATENCY: Duration = Duration::from_millis(50);
const STEADY: Duration = Duration::from_secs(5);
const SPIKE: Duration = Duration::from_secs(8);
/// The p99 bound's absolute slack, for a shared 2-core machine.
const P99_SLACK: Duration = Duration::from_millis(5);

/// One answer of the spike test's load.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Sent after the flood started.
    during: bool,
    ok: bool,
    sheddable: bool,
    latency: Duration,
}

/// A client on its own keep-alive connection: one request every `period`
/// (never two at once: a late request is sent at once, with no catch-up
/// burst), from `from` until `until`, at most `max` requests.
#[allow(clippy::too_many_arguments)]
fn paced(
    port: u16,
    path: &'static str,
    tenant: String,
    period: Duration,
    t0: std::time::Instant,
    from: Duration,
    until: Duration,
    max: usize,
) -> JoinHandle<Vec<Sample>> {
    std::thread::spawn(move || {
        while t0.elapsed() < from {
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut conn = Conn::open(port).unwrap();
        let mut out = Vec::new();
        let mut next = t0 + from;
        while t0.elapsed() < until && out.len() < max {
            let now = std::time::Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
            next = std::time::Instant::now().max(next) + period;
            let sent = std::time::Instant::now();
            let during = t0.elapsed() >= STEADY;
            let r = match conn.get(path, &[("x-tenant-id", &tenant)]) {
                Ok(r) => r,
                Err(_) => {
                    conn = Conn::open(port).unwrap();
                    continue;
                }
            };
            out.push(Sample {
                during,
                ok: r.status == 200,
                sheddable: path.contains("report"),
                latency: sent.elapsed(),
            });
            if r.header("connection") == Some("close") {
                conn = Conn::open(port).unwrap();
            }
        }
        out
    })
}

fn p99(samples: &[Sample]) -> Duration {
    percentile(samples.iter().map(|s| s.latency), 99)
}

fn success(samples: &[Sample]) -> f64 {
    samples.iter().filter(|s| s.ok).count() as f64 / samples.len().max(1) as f64
}

on_both_hosts!(a_twenty_fold_spike_on_a_sheddable_route_spares_critical_work_and_the_quiet_tenant);
/// Issue #10's 20× spike: steady mixed traffic at 0.6× the upstream's
/// capacity, then one tenant floods the sheddable route at 20× capacity.
fn a_twenty_fold_spike_on_a_sheddable_route_spares_critical_work_and_the_quiet_tenant() {
    let upstream = Upstream::start();
    upstream.set_capacity(SPIKE_CAPACITY);
    upstream.set_latency(SPIKE_LATENCY);
    let envoy = Envoy::start_with_upstream(SPIKE_POLICY, upstream.port, &["checkout", "browse", "report"]);
    let port = envoy.port;
    // Warm up every route (and both workers' key tables).
    for path in ["/up/checkout", "/up/browse", "/up/report"] {
        assert_eq!(get(port, path, &[("x-tenant-id", "warm")]).status, 200);
    }
    let capacity_rps = SPIKE_CAPACITY as f64 / SPIKE_LATENCY.as_secs_f64();
    let end = STEADY + SPIKE;
    let t0 = std::time::Instant::now();
    let cap = |rps: f64| (rps * end.as_secs_f64()) as usize + 10;
    // Steady load, 0.6 × 8 = 4.8 slots busy on average: critical 3.0
    // (4 clients × 15/s), normal 1.3 (3 × 26/3 per s), the quiet tenant's
    // sheddable reports 0.5 (10/s).
    let mut critical = Vec::new();
    for i in 0..4 {
        critical.push(paced(
            port,
            "/up/checkout",
            format!("shop-{i}"),
            Duration::from_micros(66_667),
            t0,
            Duration::ZERO,
            end,
            cap(15.0),
        ));
    }
    let mut normal = Vec::new();
    for i in 0..3 {
        normal.push(paced(
            port,
            "/up/browse",
            format!("browser-{i}"),
            Duration::from_micros(115_385),
            t0,
            Duration::ZERO,
            end,
            cap(8.7),
        ));
    }
    let quiet = paced(
        port,
        "/up/report",
        "quiet".to_owned(),
        Duration::from_millis(100),
        t0,
        Duration::ZERO,
        end,
        cap(10.0),
    );
    // The flood: 20 × capacity (3,200/s), 48 clients × 67/s, from 5 s on
    // (many clients: one whose request is held waits for its answer).
    let flood_rps = 20.0 * capacity_rps;
    let flood_clients = 48;
    let flood: Vec<_> = (0..flood_clients)
        .map(|_| {
            let per_client = flood_rps / f64::from(flood_clients);
            paced(
                port,
                "/up/report",
                "flood".to_owned(),
                Duration::from_secs_f64(1.0 / per_client),
                t0,
                STEADY,
                end,
                cap(per_client),
            )
        })
        .collect();

    let join = |hs: Vec<JoinHandle<Vec<Sample>>>| -> Vec<Sample> {
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    };
    let critical = join(critical);
    let normal = join(normal);
    let quiet = quiet.join().unwrap();
    let flood = join(flood);
    let split = |s: &[Sample]| -> (Vec<Sample>, Vec<Sample>) { s.iter().partition(|x| !x.during) };
    let (crit_before, crit_during) = split(&critical);
    let (quiet_before, quiet_during) = split(&quiet);
    let all: Vec<&Sample> = critical
        .iter()
        .chain(&normal)
        .chain(&quiet)
        .chain(&flood)
        .collect();
    let rejected: Vec<&&Sample> = all.iter().filter(|s| !s.ok).collect();
    let rejected_sheddable = rejected.iter().filter(|s| s.sheddable).count();
    let sheddable_share = rejected_sheddable as f64 / rejected.len().max(1) as f64;
    let flood_sent = flood.len() as f64 / SPIKE.as_secs_f64();
    let mut fl: Vec<Duration> = flood.iter().map(|s| s.latency).collect();
    fl.sort_unstable();
    println!(
        "flood: answered in {:?} (median), {:?} (p90); {} admitted",
        fl.get(fl.len() / 2).copied().unwrap_or_default(),
        fl.get(fl.len() * 9 / 10).copied().unwrap_or_default(),
        flood.iter().filter(|s| s.ok).count()
    );
    println!(
        "capacity {capacity_rps:.0}/s ({SPIKE_CAPACITY} at {} ms); flood offered {flood_sent:.0}/s (target {flood_rps:.0}/s, {} requests)",
        SPIKE_LATENCY.as_millis(),
        flood.len()
    );
    println!(
        "critical: success {:.2} % before ({} requests), {:.2} % during ({}); p99 {:.1} ms before, {:.1} ms during",
        100.0 * success(&crit_before),
        crit_before.len(),
        100.0 * success(&crit_during),
        crit_during.len(),
        p99(&crit_before).as_secs_f64() * 1e3,
        p99(&crit_during).as_secs_f64() * 1e3,
    );
    println!(
        "normal: success {:.2} % ({} requests); rejections {}: {:.2} % sheddable",
        100.0 * success(&normal),
        normal.len(),
        rejected.len(),
        100.0 * sheddable_share
    );
    println!(
        "quiet tenant: success {:.2} % before ({}), {:.2} % during ({})",
        100.0 * success(&quiet_before),
        quiet_before.len(),
        100.0 * success(&quiet_during),
        quiet_during.len()
    );
    let fair_drops: u64 = (0..16)
        .map(|b| envoy.tg_stat(&format!("admission.fair_drops.b{b:02}")))
        .sum();
    println!(
        "sheddable refusals: tenant_share {} concurrency_limit {} queue_full {} (of which {fair_drops} fair-queue drops) queue_timeout {} contention {}; upstream at most {} in flight",
        envoy.tg_stat("admission.tenant_share.sheddable"),
        envoy.tg_stat("admission.concurrency_limit.sheddable"),
        envoy.tg_stat("admission.queue_full.sheddable"),
        envoy.tg_stat("admission.queue_timeout.sheddable"),
        envoy.tg_stat("admission.contention.sheddable"),
        upstream.max_in_flight()
    );
    assert!(
        crit_before.len() >= 100 && crit_during.len() >= 100,
        "{} / {}",
        crit_before.len(),
        crit_during.len()
    );
    assert!(success(&crit_during) >= 0.99, "critical success during the spike");
    let bound = p99(&crit_before).mul_f64(1.5) + P99_SLACK;
    assert!(
        p99(&crit_during) <= bound,
        "critical p99 {:?} > {bound:?}",
        p99(&crit_during)
    );
    assert!(
        !rejected.is_empty() && sheddable_share >= 0.95,
        "{sheddable_share}"
    );
    assert!(
        success(&quiet_during) >= 0.9 * success(&quiet_before),
        "the quiet tenant's success fell"
    );
    // The flood was a flood: at least 10× capacity offered.
    assert!(flood_sent >= 10.0 * capacity_rps, "flood {flood_sent:.0}/s");
    assert!(upstream.max_in_flight() <= SPIKE_CAPACITY);
    assert!(wait_for(WAIT, || gauge(&envoy, "svc") == Some(0)));
}

/// `search` (action, 3 in flight) through `db` and without a dependency
/// (`search-bulk`); `lookup` is another action of `db`, not limited by it.
fn action_policy() -> String {
    r#"
version: "adm-act"
identity: { header: x-tenant-id }
plans:
  free: { limits: [ { rate: 1000000, per: 1s } ] }
default_plan: free
anonymous: { plan: free }
dependencies:
  db: { max_in_flight: 50 }
actions:
  search: { max_in_flight: 3 }
routes:
  search: { dependency: db }
  search-bulk: { action: search, criticality: sheddable }
  lookup: { dependency: db }
"#
    .to_owned()
}

fn action_gauge(envoy: &Envoy, action: &str) -> Option<u64> {
    envoy.stat(&format!(
        "wasmcustom.tenantgate.admission.action_in_flight.{action}"
    ))
}

#[test]
fn an_action_in_flight_limit_holds_across_workers_and_its_slots_come_back() {
    let upstream = Upstream::start();
    let log = Envoy::temp_dir().join("access.log");
    let envoy = Envoy::start_with_upstream_logged(
        &action_policy(),
        upstream.port,
        &["search", "search-bulk", "lookup"],
        Some(&log),
    );
    // Held upstream: 3 of 5 `search` requests (both classes) reach it.
    upstream.hold();
    let (tx, rx) = mpsc::channel();
    let paths = [
        "/up/search",
        "/up/search-bulk",
        "/up/search",
        "/up/search-bulk",
        "/up/search",
    ];
    let held: Vec<JoinHandle<()>> = paths
        .iter()
        .map(|p| spawn_get(envoy.port, p, "acme", &tx))
        .collect();
    let mut refused = Vec::new();
    assert!(
        wait_for(WAIT, || {
            refused.extend(rx.try_iter());
            upstream.in_flight() == 3 && refused.len() == 2
        }),
        "in flight {}, refused {refused:?}",
        upstream.in_flight()
    );
    for r in &refused {
        assert_refused(r, "concurrency_limit");
        assert_eq!(r.json()["limit"], "action:search", "{r:?}");
    }
    assert!(wait_for(WAIT, || action_gauge(&envoy, "search") == Some(3)));
    // Another action of the same dependency is not limited by it.
    let lookup = spawn_get(envoy.port, "/up/lookup", "acme", &tx);
    assert!(wait_for(WAIT, || upstream.in_flight() == 4));
    upstream.release();
    for h in held.into_iter().chain([lookup]) {
        h.join().unwrap();
    }
    let answered: Vec<u16> = rx.try_iter().map(|r| r.status).collect();
    assert_eq!(answered, [200; 4], "{answered:?}");
    assert!(wait_for(WAIT, || action_gauge(&envoy, "search") == Some(0)));
    // The decision record names the action that refused.
    let lines = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(wait_for(WAIT, || lines().lines().count() >= 6), "{}", lines());
    let text = lines();
    let refusals: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("outcome=concurrency_limit"))
        .collect();
    assert_eq!(refusals.len(), 2, "{text}");
    for l in refusals {
        assert!(
            l.contains(" in_flight=3 ") && l.ends_with(" key=search|t|acme limit=action:search"),
            "{l}"
        );
    }

    // A slow upstream (150 ms) under 8 concurrent clients of `search`, each
    // on a new connection per request (spread over both workers): the
    // upstream never sees more than 3 at once, node-wide.
    upstream.set_latency(Duration::from_millis(150));
    upstream.reset_max();
    let port = envoy.port;
    let clients: Vec<JoinHandle<Vec<u16>>> = (0..8)
        .map(|c| {
            std::thread::spawn(move || {
                let path = if c % 2 == 0 {
                    "/up/search"
                } else {
                    "/up/search-bulk"
                };
                (0..6)
                    .map(|_| {
                        let r = get(port, path, &[("x-tenant-id", "acme")]);
                        if r.status == 503 {
                            assert_eq!(r.header("x-tenantgate-reason"), Some("concurrency_limit"));
                        }
                        r.status
                    })
                    .collect()
            })
        })
        .collect();
    let statuses: Vec<u16> = clients.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let limited = statuses.iter().filter(|s| **s == 503).count();
    assert_eq!(ok + limited, 48, "{statuses:?}");
    assert!(ok >= 3 && limited >= 1, "{ok} admitted, {limited} refused");
    assert!(
        upstream.max_in_flight() <= 3,
        "upstream saw {} at once",
        upstream.max_in_flight()
    );
    let [w0, w1] = envoy.worker_connections();
    assert!(w0 > 0 && w1 > 0, "connections per worker: {w0}, {w1}");
    // Traffic stopped: every slot is back.
    assert!(
        wait_for(WAIT, || action_gauge(&envoy, "search") == Some(0)),
        "gauge {:?}",
        action_gauge(&envoy, "search")
    );
    assert!(wait_for(WAIT, || gauge(&envoy, "db") == Some(0)));
    assert_eq!(
        envoy.tg_stat("admission.concurrency_limit.normal")
            + envoy.tg_stat("admission.concurrency_limit.sheddable"),
        2 + limited as u64
    );
}
