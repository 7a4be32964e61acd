//! Admission control part 2 in a real Envoy 1.40 (`--concurrency 2`) in
//! front of the controllable test upstream: the retry budget under 100 %
//! upstream errors with clients that retry every failure, and degraded
//! answers (the last good response, with its age, capture time, version
//! and a marker) for refused GETs of a degradable class.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tenantgate_integration_tests::upstream::Upstream;
use tenantgate_integration_tests::{get, on_both_hosts, request, wait_for, Conn, Envoy, Response};

const WAIT: Duration = Duration::from_secs(20);
const RETRY_HEADER: &str = "x-retry-attempt";
const CLASSES: [&str; 4] = ["items", "catalog", "shelf", "proxied"];

/// `db` with a retry budget (ratio 0.2, floor `min_per_second`), and `cat`
/// with 2 slots for the degradable `catalog` class.
fn policy(min_per_second: u32) -> String {
    format!(
        r#"
version: "deg-1"
identity: {{ header: x-tenant-id }}
plans:
  free: {{ limits: [ {{ rate: 1000000, per: 1s }} ] }}
default_plan: free
anonymous: {{ plan: free }}
dependencies:
  db:
    max_in_flight: 1000
    retry_budget: {{ ratio: 0.2, min_per_second: {min_per_second}, window: 10s, retry_header: {RETRY_HEADER} }}
  cat: {{ max_in_flight: 2 }}
  store:
    max_in_flight: 1
    queues: {{ normal: {{ max_queue: 4, max_wait: 300ms }} }}
    retry_budget: {{ ratio: 0.2, min_per_second: 0, retry_header: {RETRY_HEADER} }}
  edge:
    max_in_flight: 100
    retry_budget: {{ min_per_second: 0, envoy_attempt_count: true }}
routes:
  items: {{ dependency: db }}
  proxied: {{ dependency: edge }}
  catalog: {{ dependency: cat, degradable: {{ max_stale: 3s, slots: 64 }} }}
  shelf: {{ dependency: store, degradable: {{ max_stale: 30s }} }}
  api: {{}}
"#
    )
}

/// One client operation: the first attempt, then a retry (attempt number
/// in [`RETRY_HEADER`]) after every failure, up to `attempts` in all.
/// Returns the statuses it got.
fn operation(conn: &mut Option<Conn>, port: u16, path: &str, tenant: &str, attempts: u32) -> Vec<u16> {
    let mut statuses = Vec::new();
    for attempt in 1..=attempts {
        let number = attempt.to_string();
        let headers = [("x-tenant-id", tenant), (RETRY_HEADER, number.as_str())];
        let answer = match conn.as_mut().map(|c| c.get(path, &headers)) {
            Some(Ok(r)) => r,
            _ => {
                *conn = Conn::open(port).ok();
                match conn.as_mut().map(|c| c.get(path, &headers)) {
                    Some(Ok(r)) => r,
                    _ => {
                        statuses.push(0);
                        *conn = None;
                        continue;
                    }
                }
            }
        };
        statuses.push(answer.status);
        if answer.status == 200 {
            break;
        }
    }
    statuses
}

/// What a retry storm did: client operations, requests sent, requests
/// answered 503 after the first attempt.
struct Storm {
    operations: u64,
    sent: u64,
    elapsed: Duration,
}

/// 8 clients × 100 operations on `/up/items`, each retrying every failure
/// up to 3 attempts in all: without a budget, 3 upstream attempts per
/// operation under 100 % errors.
fn retry_storm(port: u16) -> Storm {
    const CLIENTS: usize = 8;
    const OPERATIONS: usize = 100;
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            std::thread::spawn(move || {
                let mut conn = Conn::open(port).ok();
                let tenant = format!("t{c}");
                let mut out = Vec::new();
                for _ in 0..OPERATIONS {
                    out.push(operation(&mut conn, port, "/up/items", &tenant, 3));
                    if started.elapsed() > Duration::from_secs(60) {
                        break;
                    }
                }
                out
            })
        })
        .collect();
    let mut operations = 0u64;
    let mut sent = 0u64;
    for c in clients {
        for statuses in c.join().unwrap() {
            operations += 1;
            sent += statuses.len() as u64;
        }
    }
    assert_eq!(operations, (CLIENTS * OPERATIONS) as u64);
    Storm {
        operations,
        sent,
        elapsed: started.elapsed(),
    }
}

#[test]
fn under_100_percent_errors_retrying_clients_add_at_most_a_fifth_of_the_primaries() {
    let upstream = Upstream::start();
    let envoy = Envoy::start_with_upstream(&policy(0), upstream.port, &CLASSES);
    upstream.set_status(503);
    let Storm {
        operations,
        sent,
        elapsed,
    } = retry_storm(envoy.port);
    // Every retry refused by the budget never reached the upstream.
    let attempts = upstream.received();
    let primaries = operations;
    let retries = attempts.saturating_sub(primaries);
    let ratio = attempts as f64 / primaries as f64;
    println!(
        "retry budget (ratio 0.2, floor 0): {operations} operations, {sent} requests sent by clients, {attempts} upstream attempts ({retries} retries admitted), {ratio:.3} attempts per primary, in {elapsed:?}"
    );
    assert!(sent >= 2 * operations, "clients retried: {sent}");
    // THE BOUND with no floor: attempts ≤ (1 + ratio) × primaries.
    assert!(
        attempts * 10 <= primaries * 12,
        "{attempts} upstream attempts for {primaries} primaries"
    );
    // And the budget was used, not just closed.
    assert!(
        retries * 10 >= primaries,
        "{retries} retries for {primaries} primaries"
    );
    let refused = envoy.tg_stat("admission.retry_budget.normal");
    assert_eq!(
        refused + attempts,
        sent,
        "refused {refused}, attempts {attempts}, sent {sent}"
    );
    assert_eq!(envoy.tg_stat("admission.retries.db"), retries);
    assert!(
        wait_for(WAIT, || envoy
            .stat("wasmcustom.tenantgate.admission.retry_amplification_permille.db")
            .is_some_and(|g| (1000..=1200).contains(&g) && g > 1050)),
        "amplification gauge {:?}",
        envoy.stat("wasmcustom.tenantgate.admission.retry_amplification_permille.db")
    );
    // A refused retry: 503 retry_budget with an honest Retry-After (the
    // oldest retries leave the 10 s window within 10 s; plus the jitter).
    let r = get(
        envoy.port,
        "/up/items",
        &[("x-tenant-id", "t0"), (RETRY_HEADER, "2")],
    );
    assert_refused(&r, "retry_budget");
}

#[test]
fn with_the_default_floor_the_retries_are_a_fifth_of_the_primaries_plus_a_window_of_the_floor() {
    let upstream = Upstream::start();
    let envoy = Envoy::start_with_upstream(&policy(1), upstream.port, &CLASSES);
    upstream.set_status(503);
    let storm = retry_storm(envoy.port);
    let attempts = upstream.received();
    let primaries = storm.operations;
    let retries = attempts.saturating_sub(primaries);
    println!(
        "retry budget (ratio 0.2, floor 1/s, window 10 s): {primaries} operations, {} requests sent, {attempts} upstream attempts ({retries} retries), {:.3} attempts per primary, in {:?}",
        storm.sent,
        attempts as f64 / primaries as f64,
        storm.elapsed
    );
    // THE BOUND: ⌊0.2 × P⌋ + 1/s × 10 s while the run is shorter than the
    // window (it takes well under a second).
    assert!(storm.elapsed < Duration::from_secs(10), "{:?}", storm.elapsed);
    assert!(
        retries <= primaries / 5 + 10,
        "{retries} retries for {primaries} primaries"
    );
    assert!(retries >= primaries / 5, "{retries}");
}

#[test]
fn x_envoy_attempt_count_of_an_earlier_hop_is_the_retry_signal_when_the_policy_says_so() {
    let upstream = Upstream::start();
    let envoy = Envoy::start_with_upstream(&policy(1), upstream.port, &CLASSES);
    let port = envoy.port;
    let attempt = |n: &str| {
        get(
            port,
            "/up/proxied",
            &[("x-tenant-id", "acme"), ("x-envoy-attempt-count", n)],
        )
    };
    // No primaries yet and no floor: a retry has no budget.
    assert_refused(&attempt("2"), "retry_budget");
    // Attempt 1 is a primary; 5 of them make room for one retry once a
    // tick has folded them.
    for _ in 0..5 {
        assert_eq!(attempt("1").status, 200);
    }
    let mut statuses = Vec::new();
    assert!(
        wait_for(WAIT, || {
            let s = attempt("3").status;
            statuses.push(s);
            s == 200
        }),
        "{statuses:?}"
    );
    assert_refused(&attempt("2"), "retry_budget");
    // The tenant's own retry header means nothing to this dependency.
    let r = get(
        port,
        "/up/proxied",
        &[("x-tenant-id", "acme"), (RETRY_HEADER, "2")],
    );
    assert_eq!(r.status, 200);
    assert_eq!(envoy.tg_stat("admission.retries.edge"), 1);
}

fn assert_refused(r: &Response, reason: &str) {
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.header("x-tenantgate-reason"), Some(reason), "{r:?}");
    let retry: u64 = r.header("retry-after").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!((1..=20).contains(&retry), "Retry-After {retry}");
    assert_eq!(r.json()["reason"], reason);
    assert!(r.header("x-tenantgate-degraded").is_none(), "{r:?}");
}

fn post(port: u16, path: &str, tenant: &str) -> Response {
    request(
        port,
        "POST",
        path,
        &[("x-tenant-id", tenant), ("content-length", "0")],
    )
    .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

/// The degraded answer's headers as a client sees them.
fn assert_degraded(r: &Response, body: &str, version: &str, reason: &str, max_age: u64) {
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(String::from_utf8_lossy(&r.body), body, "{r:?}");
    assert_eq!(r.header("etag"), Some(version), "{r:?}");
    assert_eq!(r.header("x-tenantgate-degraded"), Some(reason), "{r:?}");
    assert_eq!(r.header("content-type"), Some("text/plain"), "{r:?}");
    assert_eq!(r.header("cache-control"), Some("no-store"), "{r:?}");
    let age: u64 = r.header("age").and_then(|v| v.parse().ok()).unwrap_or(u64::MAX);
    assert!(age <= max_age, "age {age}: {r:?}");
    let captured = r.header("x-tenantgate-captured-at").unwrap_or("");
    // IMF-fixdate: "Tue, 01 Dec 2026 13:40:00 GMT".
    assert!(
        captured.len() == 29 && captured.ends_with(" GMT") && captured.as_bytes()[3] == b',',
        "{captured:?}"
    );
}

on_both_hosts!(shed_gets_get_the_last_good_answer_writes_their_refusal_and_tenants_only_their_own);
fn shed_gets_get_the_last_good_answer_writes_their_refusal_and_tenants_only_their_own() {
    let upstream = Upstream::start();
    let log = Envoy::temp_dir().join("degraded-access.log");
    let envoy = Envoy::start_with_upstream_logged(&policy(1), upstream.port, &CLASSES, Some(&log));
    let port = envoy.port;
    let path = "/up/catalog/items?page=2";
    // Two tenants read the same path at two versions: each answer is kept
    // under its own tenant.
    upstream.set_version(1);
    let acme = get(port, path, &[("x-tenant-id", "acme")]);
    assert_eq!(
        (acme.status, acme.header("etag")),
        (200, Some("\"v1\"")),
        "{acme:?}"
    );
    let captured = Instant::now();
    upstream.set_version(2);
    let globex = get(port, path, &[("x-tenant-id", "globex")]);
    assert_eq!(
        (globex.status, globex.header("etag")),
        (200, Some("\"v2\"")),
        "{globex:?}"
    );
    // An answer the upstream marks `cache-control: no-store` is not kept.
    upstream.set_header(Some(("cache-control", "private, no-store")));
    let hooli = get(port, path, &[("x-tenant-id", "hooli")]);
    assert_eq!(hooli.status, 200, "{hooli:?}");
    upstream.set_header(None);
    assert!(
        wait_for(WAIT, || envoy.tg_stat("admission.degraded.stores") >= 2),
        "stores {}",
        envoy.tg_stat("admission.degraded.stores")
    );
    // Saturate `cat` (2 slots): two requests held by the upstream.
    upstream.hold();
    let (tx, rx) = mpsc::channel();
    let holders: Vec<_> = (0..2)
        .map(|i| {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let r = get(
                    port,
                    &format!("/up/catalog/hold{i}"),
                    &[("x-tenant-id", "holder")],
                );
                let _ = tx.send(r.status);
            })
        })
        .collect();
    assert!(
        wait_for(WAIT, || upstream.in_flight() == 2),
        "in flight {}",
        upstream.in_flight()
    );
    let received = upstream.received();
    // Shed GETs: each tenant gets its own last good answer, marked.
    let r = get(port, path, &[("x-tenant-id", "acme")]);
    assert_degraded(&r, "ok v1\n", "\"v1\"", "concurrency_limit", 3);
    let r = get(port, path, &[("x-tenant-id", "globex")]);
    assert_degraded(&r, "ok v2\n", "\"v2\"", "concurrency_limit", 3);
    // The answer marked no-store was not kept.
    assert_refused(
        &get(port, path, &[("x-tenant-id", "hooli")]),
        "dependency_unavailable",
    );
    // A tenant that never read it gets no one else's answer.
    let r = get(port, path, &[("x-tenant-id", "initech")]);
    assert_refused(&r, "dependency_unavailable");
    assert!(!String::from_utf8_lossy(&r.body).contains("ok v"), "{r:?}");
    // Another path of the same tenant: no answer either.
    assert_refused(
        &get(port, "/up/catalog/items?page=3", &[("x-tenant-id", "acme")]),
        "dependency_unavailable",
    );
    // Anonymous clients get none (the policy does not say `anonymous: true`).
    assert_refused(&get(port, path, &[]), "concurrency_limit");
    // A write on the same route gets its refusal, never the cached body.
    let w = post(port, path, "acme");
    assert_refused(&w, "concurrency_limit");
    assert!(!String::from_utf8_lossy(&w.body).contains("ok v"), "{w:?}");
    // Nothing of this reached the upstream.
    assert_eq!(upstream.received(), received);
    // Past max_stale (3 s): 503 dependency_unavailable, never an older answer.
    let mut last = None;
    assert!(
        wait_for(WAIT, || {
            let r = get(port, path, &[("x-tenant-id", "acme")]);
            let stale = r.status == 503;
            last = Some(r);
            stale
        }),
        "{last:?}"
    );
    let stale_after = captured.elapsed();
    let r = last.unwrap();
    assert_refused(&r, "dependency_unavailable");
    assert!(
        stale_after >= Duration::from_secs(3),
        "stale after {stale_after:?}"
    );
    println!("degraded: the answer captured at t=0 was served until {stale_after:?} (max_stale 3s)");
    upstream.release();
    for h in holders {
        h.join().unwrap();
    }
    assert_eq!(rx.try_iter().collect::<Vec<_>>(), [200, 200]);
    assert!(envoy.tg_stat("admission.degraded.answered") >= 2);
    // Each shed request is counted once, under its final reason.
    assert!(envoy.tg_stat("decisions.concurrency_limit") >= 4);
    assert!(envoy.tg_stat("decisions.dependency_unavailable") >= 3);
    assert!(envoy.tg_stat("admission.degraded.unavailable") >= 4);
    // acme's, globex's and the two holders' (hooli's was no-store).
    assert!(
        wait_for(WAIT, || envoy.tg_stat("admission.degraded.stores") == 4),
        "stores {}",
        envoy.tg_stat("admission.degraded.stores")
    );
    assert!(envoy.tg_stat("admission.degraded.stale") >= 1);
    assert!(
        envoy.tg_stat("admission.degraded.age_le_1s") + envoy.tg_stat("admission.degraded.age_le_10s") >= 2
    );
    // The decision record notes the degraded answer.
    let mut lines = String::new();
    assert!(
        wait_for(WAIT, || {
            lines = std::fs::read_to_string(&log).unwrap_or_default();
            lines.contains("degraded_age_ms=")
        }),
        "{lines}"
    );
    let line = lines
        .lines()
        .find(|l| l.contains("degraded_age_ms="))
        .unwrap_or("");
    println!("access log: {line}");
    assert!(
        line.starts_with("/up/catalog/items?page=2 200 outcome=concurrency_limit "),
        "{line}"
    );
    assert!(lines.contains(" 503 outcome=dependency_unavailable "), "{lines}");
}

/// A raw HEAD request: the status line and headers, and the bytes after.
fn head(port: u16, path: &str, tenant: &str) -> (String, Vec<u8>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "HEAD {path} HTTP/1.1\r\nhost: t\r\nx-tenant-id: {tenant}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let end = text.find("\r\n\r\n").map_or(text.len(), |e| e + 4);
    (
        text[..end].to_ascii_lowercase(),
        raw[end.min(raw.len())..].to_vec(),
    )
}

#[test]
fn a_queued_get_a_timed_out_one_a_retry_over_the_budget_and_a_head_get_the_stale_answer() {
    let upstream = Upstream::start();
    let envoy = Envoy::start_with_upstream(&policy(1), upstream.port, &CLASSES);
    let port = envoy.port;
    let hold = |tx: &mpsc::Sender<u16>| {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let r = get(port, "/up/shelf/hold", &[("x-tenant-id", "holder")]);
            let _ = tx.send(r.status);
        })
    };
    let (tx, rx) = mpsc::channel();
    // `store` has 1 slot: a holder takes it, acme's GET waits in the queue,
    // is admitted when the holder is released, and its answer is kept.
    upstream.set_version(7);
    upstream.hold();
    let holder = hold(&tx);
    assert!(wait_for(WAIT, || upstream.in_flight() == 1));
    let queued = std::thread::spawn(move || get(port, "/up/shelf/a", &[("x-tenant-id", "acme")]));
    assert!(
        wait_for(WAIT, || envoy
            .stat("wasmcustom.tenantgate.admission.queue_depth.store")
            == Some(1)),
        "queue depth {:?}",
        envoy.stat("wasmcustom.tenantgate.admission.queue_depth.store")
    );
    upstream.release();
    let r = queued.join().unwrap();
    assert_eq!((r.status, r.header("etag")), (200, Some("\"v7\"")), "{r:?}");
    holder.join().unwrap();
    assert!(
        wait_for(WAIT, || envoy.tg_stat("admission.degraded.stores") >= 2),
        "stores {}",
        envoy.tg_stat("admission.degraded.stores")
    );
    // Now the slot is held again: a GET queues, times out after 300 ms and
    // gets the answer the queued request left.
    upstream.set_version(8);
    upstream.hold();
    let holder = hold(&tx);
    assert!(wait_for(WAIT, || upstream.in_flight() == 1));
    let received = upstream.received();
    let r = get(port, "/up/shelf/a", &[("x-tenant-id", "acme")]);
    assert_degraded(&r, "ok v7\n", "\"v7\"", "queue_timeout", 30);
    // A retry over the budget (ratio 0.2 of a few primaries, no floor: 0)
    // is not sent; it gets the stale answer instead.
    let r = get(
        port,
        "/up/shelf/a",
        &[("x-tenant-id", "acme"), (RETRY_HEADER, "2")],
    );
    assert_degraded(&r, "ok v7\n", "\"v7\"", "retry_budget", 30);
    // HEAD: the same headers, no body.
    let (headers, body) = head(port, "/up/shelf/a", "acme");
    assert!(headers.starts_with("http/1.1 200"), "{headers}");
    assert!(headers.contains("\r\netag: \"v7\"\r\n"), "{headers}");
    assert!(
        headers.contains("\r\nx-tenantgate-degraded: queue_timeout\r\n"),
        "{headers}"
    );
    assert!(headers.contains("\r\nage: "), "{headers}");
    assert!(body.is_empty(), "{body:?}");
    // A POST times out in the queue like any request and gets its refusal.
    let w = post(port, "/up/shelf/a", "acme");
    assert_refused(&w, "queue_timeout");
    assert_eq!(upstream.received(), received);
    upstream.release();
    holder.join().unwrap();
    assert_eq!(rx.try_iter().collect::<Vec<_>>(), [200, 200]);
    assert!(envoy.tg_stat("admission.degraded.answered") >= 3);
}
