//! The circuit breaker in a real Envoy 1.40 (`--concurrency 2`) in front of
//! the controllable test upstream: (a) a 100 % failing upstream opens it
//! within the minimum volume, and while it is open or half-open the
//! upstream sees at most the probes, refused clients getting 503
//! `circuit_open` with a spread `Retry-After`; (b) it recovers through a
//! slow start that rises over the ramp window, not in one step, and (d) a
//! replay storm of every refused client retrying at once never pushes the
//! upstream past its capacity; (c) `paused: true` by a policy reload
//! refuses at once with no upstream call, and a reload back lets traffic
//! through; (e) while it is open a `degradable` GET gets the last good
//! answer (`x-tenantgate-degraded: circuit_open`) and other requests 503.
//! Every load loop is bounded in count and time; the figures are printed.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tenantgate_integration_tests::upstream::Upstream;
use tenantgate_integration_tests::{get, wait_for, Envoy, Response};

const WAIT: Duration = Duration::from_secs(20);
const MIN_VOLUME: u64 = 10;
const PROBES: u64 = 2;
/// The dependency's `max_in_flight`, and the upstream's real capacity.
const LIMIT: u64 = 20;
const RAMP: Duration = Duration::from_secs(3);

fn policy(version: &str, paused: bool) -> String {
    format!(
        r#"
version: "{version}"
identity: {{ header: x-tenant-id }}
plans:
  free: {{ limits: [ {{ rate: 1000000, per: 1s }} ] }}
default_plan: free
anonymous: {{ plan: free }}
dependencies:
  db:
    max_in_flight: {LIMIT}
    retry_after_window: 10s
    paused: {paused}
    circuit_breaker:
      error_rate: 0.5
      min_volume: {MIN_VOLUME}
      window: 250ms
      open_for: 1s
      max_open_for: 4s
      probes: {PROBES}
      ramp: 3s
      ramp_floor: 0.1
routes:
  orders: {{ dependency: db }}
  catalog: {{ dependency: db, degradable: {{ max_stale: 30s }} }}
  api: {{}}
"#
    )
}

fn start(paused: bool) -> (Upstream, Envoy) {
    let upstream = Upstream::start();
    let envoy = Envoy::start_with_upstream(&policy("brk-1", paused), upstream.port, &["orders", "catalog"]);
    (upstream, envoy)
}

fn orders(envoy: &Envoy) -> Response {
    get(envoy.port, "/up/orders", &[("x-tenant-id", "acme")])
}

fn reason(r: &Response) -> Option<&str> {
    r.header("x-tenantgate-reason")
}

fn stat(envoy: &Envoy, name: &str) -> Option<u64> {
    envoy.stat(&format!("wasmcustom.tenantgate.admission.{name}.db"))
}

fn phase(envoy: &Envoy) -> Option<u64> {
    stat(envoy, "breaker_state")
}

#[test]
fn a_failing_upstream_opens_the_breaker_probes_only_then_recovers_through_a_ramp_despite_a_replay_storm() {
    let (upstream, envoy) = start(false);
    upstream.set_latency(Duration::from_millis(2));
    // The breaker's volume counts every completed call in its window, this
    // first success too (so 9 failures after it already make 10 at 90 %).
    let before = upstream.received();
    assert_eq!(orders(&envoy).status, 200);
    assert!(wait_for(WAIT, || phase(&envoy) == Some(0)));

    // (a) 100 % failures, one client at a time: it opens once the minimum
    // volume has failed: at the first worker tick whose fold brings the
    // node's count to it (each failure is folded within a tick, 10 ms, and
    // the other worker reads the open breaker within another), long
    // before that signal window closes (250 ms, plus its 50 ms grace).
    upstream.set_status(503);
    let started = Instant::now();
    let mut volume_at = None;
    let mut first_open = None;
    for _ in 0..5_000 {
        let r = orders(&envoy);
        if reason(&r) == Some("circuit_open") {
            first_open = Some((upstream.received() - before, Instant::now()));
            break;
        }
        assert_eq!(r.status, 503);
        if volume_at.is_none() && upstream.received() - before >= MIN_VOLUME {
            volume_at = Some(Instant::now());
        }
        if started.elapsed() > WAIT {
            break;
        }
    }
    let (to_open, opened_at) = first_open.expect("the breaker never opened");
    let after_volume = opened_at - volume_at.expect("never reached the volume");
    println!(
        "upstream calls until the breaker opened: {to_open} (min_volume {MIN_VOLUME}); \
         open {} ms after the {MIN_VOLUME}th call (two ticks: 20 ms; the window's close: 300 ms)",
        after_volume.as_millis()
    );
    assert!(
        to_open >= MIN_VOLUME,
        "opened before the minimum volume: {to_open}"
    );
    // Within the minimum volume, plus the calls of those two ticks (about
    // six at one client; 20 leaves room for a loaded machine's late ticks),
    // and before the signal window could have closed.
    assert!(
        to_open <= MIN_VOLUME + 20,
        "{to_open} upstream calls before it opened"
    );
    assert!(
        after_volume < Duration::from_millis(250),
        "open {after_volume:?} after the minimum volume"
    );
    assert!(wait_for(WAIT, || phase(&envoy).is_some_and(|p| p != 0)));
    // Both workers have read it (their copy is at most a tick old): a few
    // ticks each.
    envoy.settle();

    // While open and half-open, 8 clients for 3 s: the upstream sees only
    // the probes (at most PROBES per half-open episode), everyone else gets
    // 503 circuit_open (Retry-After spread) or circuit_probe_limit.
    let half_opened = |e: &Envoy| stat(e, "breaker_half_opened").unwrap_or(0);
    let episodes_before = half_opened(&envoy);
    let calls_before = upstream.received();
    let deadline = Instant::now() + Duration::from_secs(3);
    let clients: Vec<JoinHandle<Vec<Response>>> = (0..8)
        .map(|_| {
            let port = envoy.port;
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                while Instant::now() < deadline && seen.len() < 2_000 {
                    seen.push(get(port, "/up/orders", &[("x-tenant-id", "acme")]));
                    std::thread::sleep(Duration::from_millis(3));
                }
                seen
            })
        })
        .collect();
    let seen: Vec<Response> = clients.into_iter().flat_map(|c| c.join().unwrap()).collect();
    let calls = upstream.received() - calls_before;
    let episodes = half_opened(&envoy) - episodes_before;
    let mut retry_after = BTreeSet::new();
    let (mut open, mut probe_limit, mut upstream_503) = (0, 0, 0);
    for r in &seen {
        assert_eq!(r.status, 503, "{r:?}");
        match reason(r) {
            Some("circuit_open") => {
                open += 1;
                let secs: u64 = r.header("retry-after").and_then(|v| v.parse().ok()).unwrap();
                // At least the time to half-open (≥ 1 s), at most the
                // longest wait (4 s) plus the 10 s window.
                assert!((1..=14).contains(&secs), "Retry-After {secs}");
                retry_after.insert(secs);
            }
            Some("circuit_probe_limit") => probe_limit += 1,
            None => upstream_503 += 1,
            Some(other) => panic!("unexpected reason {other}"),
        }
    }
    println!(
        "open/half-open for 3 s: {} requests, {open} circuit_open, {probe_limit} circuit_probe_limit, \
         {upstream_503} reached the upstream; upstream calls {calls} over {episodes} half-open episodes \
         (probes {PROBES}); distinct Retry-After values {retry_after:?}",
        seen.len()
    );
    assert!(seen.len() >= 200, "{}", seen.len());
    assert!(episodes >= 1, "it never went half-open");
    assert!(
        calls <= PROBES * episodes,
        "{calls} upstream calls over {episodes} episodes"
    );
    assert_eq!(calls, upstream_503);
    assert!(retry_after.len() >= 3, "Retry-After not spread: {retry_after:?}");

    // (b) + (d) recovery under a replay storm: the upstream heals (capacity
    // LIMIT, 100 ms per request); 60 clients that were refused all retry
    // at once the moment it goes half-open, and again at once after every
    // refusal (a 2 ms pause). Admitted concurrency ramps up over the ramp,
    // and the upstream never sees more than its capacity.
    upstream.set_status(200);
    upstream.set_latency(Duration::from_millis(100));
    upstream.set_capacity(LIMIT);
    upstream.reset_max();
    let go = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let stop_at = Instant::now() + Duration::from_secs(15);
    let storm: Vec<JoinHandle<()>> = (0..60)
        .map(|_| {
            let (go, ok, port) = (go.clone(), ok.clone(), envoy.port);
            std::thread::spawn(move || {
                while !go.load(Ordering::SeqCst) && Instant::now() < stop_at {
                    std::thread::sleep(Duration::from_millis(1));
                }
                for _ in 0..5_000 {
                    if Instant::now() >= stop_at {
                        break;
                    }
                    let r = get(port, "/up/orders", &[("x-tenant-id", "acme")]);
                    if r.status == 200 {
                        ok.fetch_add(1, Ordering::SeqCst);
                    } else {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
            })
        })
        .collect();
    // Half-open comes within max_open_for (4 s).
    assert!(
        wait_for(Duration::from_secs(6), || phase(&envoy) == Some(2)),
        "phase {:?}",
        phase(&envoy)
    );
    go.store(true, Ordering::SeqCst);
    // Sample the upstream's concurrency and the ramp gauge until closed.
    let mut samples: Vec<(Duration, u64, u64, u64)> = Vec::new();
    let t0 = Instant::now();
    let mut ramp_start = None;
    while t0.elapsed() < Duration::from_secs(10) {
        let p = phase(&envoy).unwrap_or(9);
        let permille = stat(&envoy, "breaker_ramp_permille").unwrap_or(0);
        if p == 3 && ramp_start.is_none() {
            ramp_start = Some(t0.elapsed());
        }
        samples.push((t0.elapsed(), p, permille, upstream.in_flight()));
        if p == 0 && ramp_start.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let ramp_start = ramp_start.expect("never ramped");
    let ramping: Vec<&(Duration, u64, u64, u64)> = samples.iter().filter(|s| s.1 == 3).collect();
    for (at, p, permille, in_flight) in &samples {
        println!(
            "t={:>5} ms phase {p} ramp {permille:>4} permille upstream in flight {in_flight:>2}",
            at.as_millis()
        );
    }
    assert_eq!(samples.last().map(|s| s.1), Some(0), "not closed after the ramp");
    // Not one step: the ramp gauge takes many levels, rising.
    let levels: Vec<u64> = ramping.iter().map(|s| s.2).collect();
    assert!(levels.windows(2).all(|w| w[0] <= w[1]), "{levels:?}");
    let distinct: BTreeSet<u64> = levels.iter().copied().collect();
    assert!(distinct.len() >= 8, "{levels:?}");
    // The upstream's concurrency follows it: low at the start, near the
    // limit at the end (floor 10 % = 2 of 20; the line is 2 + 18·t/3 s).
    let early: Vec<u64> = ramping
        .iter()
        .filter(|s| s.0 < ramp_start + RAMP / 4)
        .map(|s| s.3)
        .collect();
    let late: Vec<u64> = ramping
        .iter()
        .filter(|s| s.0 >= ramp_start + RAMP * 3 / 4)
        .map(|s| s.3)
        .collect();
    println!("ramp: upstream in flight in its first quarter {early:?}, in its last {late:?}");
    assert!(!early.is_empty() && !late.is_empty());
    assert!(early.iter().all(|n| *n <= 8), "{early:?}");
    assert!(late.iter().any(|n| *n >= 14), "{late:?}");
    // Each sample at most the cap of the level it shows (⌈20 · p⌉), plus
    // 2 for the rise between reading the gauge and the upstream.
    for s in &ramping {
        let cap = (LIMIT * s.2).div_ceil(1000);
        assert!(s.3 <= cap + 2, "{s:?} over the ramp's cap {cap}");
    }
    for h in storm {
        h.join().unwrap();
    }
    println!(
        "replay storm: 60 clients, {} answered 200, upstream max in flight {} (capacity {LIMIT})",
        ok.load(Ordering::SeqCst),
        upstream.max_in_flight()
    );
    assert!(upstream.max_in_flight() <= LIMIT, "{}", upstream.max_in_flight());
    assert!(ok.load(Ordering::SeqCst) > 100);
    let opened = stat(&envoy, "breaker_opened").unwrap_or(0);
    let closed = stat(&envoy, "breaker_closed").unwrap_or(0);
    let probes = stat(&envoy, "breaker_probes").unwrap_or(0);
    println!("transitions: opened {opened}, closed {closed}; probes {probes}");
    assert!(opened >= 2 && closed == 1, "opened {opened} closed {closed}");
}

/// Probes per half-open period: a short cycle (a 100 ms window, 150 ms
/// open) so that many periods pass in a few seconds. The tenant `spent`
/// is always over its rate limit: its requests take probe tickets and are
/// then refused 429, so they must give them back at once.
fn probe_policy() -> String {
    format!(
        r#"
version: "brk-probes"
identity: {{ header: x-tenant-id }}
plans:
  free: {{ limits: [ {{ rate: 1000000, per: 1s }} ] }}
  tiny: {{ limits: [ {{ rate: 1, per: 1h, burst: 1 }} ] }}
tenants:
  - {{ id: spent, plan: tiny }}
default_plan: free
anonymous: {{ plan: free }}
dependencies:
  db:
    max_in_flight: {LIMIT}
    circuit_breaker:
      error_rate: 0.5
      min_volume: 4
      window: 100ms
      open_for: 150ms
      max_open_for: 150ms
      probes: {PROBES}
      ramp: 1s
      ramp_floor: 0.5
routes:
  orders: {{ dependency: db }}
"#
    )
}

/// Clients from `tenants`, each in a loop until `until` (bounded in count).
fn flood(port: u16, tenants: &[&'static str], until: Instant) -> Vec<JoinHandle<u64>> {
    tenants
        .iter()
        .map(|tenant| {
            let tenant = *tenant;
            std::thread::spawn(move || {
                let mut sent = 0;
                while Instant::now() < until && sent < 20_000 {
                    let _ = get(port, "/up/orders", &[("x-tenant-id", tenant)]);
                    sent += 1;
                    std::thread::sleep(Duration::from_millis(1));
                }
                sent
            })
        })
        .collect()
}

/// Upstream arrivals grouped into half-open periods: consecutive arrivals
/// less than `gap` apart (a period's probes arrive at its start; periods
/// are at least the open wait, 120 ms, apart).
fn periods(arrivals: &[Instant], gap: Duration) -> Vec<Vec<Instant>> {
    let mut out: Vec<Vec<Instant>> = Vec::new();
    for a in arrivals {
        match out.last_mut() {
            Some(p) if p.last().is_some_and(|l| a.duration_since(*l) < gap) => p.push(*a),
            _ => out.push(vec![*a]),
        }
    }
    out
}

#[test]
fn each_half_open_period_lets_exactly_probes_through_and_a_refused_ticket_comes_back_at_once() {
    let upstream = Upstream::start();
    let envoy = Envoy::start_with_upstream(&probe_policy(), upstream.port, &["orders"]);
    upstream.set_latency(Duration::from_millis(2));
    upstream.set_status(503);
    // Trip it, then count every upstream call per half-open period while
    // three clients of a tenant within its limits and three of `spent` send.
    let tenants = ["acme", "acme", "acme", "spent", "spent", "spent"];
    for _ in 0..20 {
        let _ = orders(&envoy);
    }
    assert!(wait_for(WAIT, || phase(&envoy).is_some_and(|p| p == 1 || p == 2)));
    let half_opened = |e: &Envoy| stat(e, "breaker_half_opened").unwrap_or(0);
    let probes_stat = |e: &Envoy| stat(e, "breaker_probes").unwrap_or(0);
    envoy.settle();
    let (episodes_before, probes_before) = (half_opened(&envoy), probes_stat(&envoy));
    upstream.record_arrivals();
    let clients = flood(envoy.port, &tenants, Instant::now() + Duration::from_secs(7));
    let sent: u64 = clients.into_iter().map(|c| c.join().unwrap()).sum();
    // The last period's probes are answered and counted.
    std::thread::sleep(Duration::from_millis(300));
    envoy.settle();
    let arrivals = upstream.arrivals();
    let found = periods(&arrivals, Duration::from_millis(60));
    let counts: Vec<usize> = found.iter().map(Vec::len).collect();
    let episodes = half_opened(&envoy) - episodes_before;
    let probes = probes_stat(&envoy) - probes_before;
    let mut histogram = std::collections::BTreeMap::new();
    for n in &counts {
        *histogram.entry(*n).or_insert(0) += 1;
    }
    println!(
        "{sent} requests over 7 s, {} upstream calls in {} half-open periods (stat: {episodes} half-opened, \
         {probes} probes); calls per period {histogram:?}",
        arrivals.len(),
        found.len()
    );
    assert!(found.len() >= 20, "only {} periods: {counts:?}", found.len());
    // Never more than the promised probes, and with requests offered all
    // the time, exactly that many: no ticket lost to a 429, none given
    // twice (the last period may have begun as the clients stopped).
    assert!(counts.iter().all(|n| *n <= PROBES as usize), "{counts:?}");
    let whole = &counts[..counts.len() - 1];
    assert!(whole.iter().all(|n| *n == PROBES as usize), "{counts:?}");
    // The stat counts the requests let through, and each period is one
    // half-open transition (give or take one that began before the
    // clients or after them, with no call).
    assert_eq!(probes, arrivals.len() as u64);
    assert!(
        episodes.abs_diff(found.len() as u64) <= 1,
        "{episodes} transitions, {counts:?}"
    );

    // Recovery: the upstream heals; the period's second probe follows the
    // first at once (a refused request's ticket comes back at once, not
    // after the lost-probe rule's two windows), and the ramp begins.
    upstream.set_status(200);
    upstream.record_arrivals();
    let clients = flood(envoy.port, &tenants, Instant::now() + Duration::from_secs(2));
    assert!(wait_for(WAIT, || phase(&envoy).is_some_and(|p| p == 3 || p == 0)));
    for c in clients {
        c.join().unwrap();
    }
    let healed = upstream.arrivals();
    assert!(healed.len() >= 2, "{} calls after healing", healed.len());
    let second = healed[1].duration_since(healed[0]);
    println!(
        "healed: the second probe {} ms after the first",
        second.as_millis()
    );
    assert!(second < Duration::from_millis(100), "{second:?}");
}

#[test]
fn paused_by_a_reload_refuses_at_once_with_no_upstream_call_and_unpausing_lets_traffic_through() {
    let upstream = Upstream::start();
    let log = Envoy::temp_dir().join("access.log");
    let envoy =
        Envoy::start_with_upstream_logged(&policy("brk-1", false), upstream.port, &["orders"], Some(&log));
    assert_eq!(orders(&envoy).status, 200);
    let loads = envoy.tg_stat("config.loads");
    let (ok, err) = envoy.apply(&policy("brk-paused", true));
    assert!(ok, "{err}");
    assert!(wait_for(WAIT, || envoy.tg_stat("config.loads") >= loads + 2));
    let calls = upstream.received();
    for _ in 0..50 {
        let r = orders(&envoy);
        assert_eq!((r.status, reason(&r)), (503, Some("paused")), "{r:?}");
        assert_eq!(r.json()["reason"], "paused");
    }
    assert_eq!(upstream.received(), calls, "a paused dependency was called");
    let loads = envoy.tg_stat("config.loads");
    let (ok, err) = envoy.apply(&policy("brk-unpaused", false));
    assert!(ok, "{err}");
    assert!(wait_for(WAIT, || envoy.tg_stat("config.loads") >= loads + 2));
    for _ in 0..20 {
        assert_eq!(orders(&envoy).status, 200);
    }
    println!(
        "paused: 50 refused with 0 upstream calls; unpaused: 20 of 20 answered 200 ({} upstream calls)",
        upstream.received() - calls
    );
    assert_eq!(upstream.received() - calls, 20);
    // The decision record names the breaker's phase.
    let lines = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(wait_for(WAIT, || lines().lines().count() >= 71), "{}", lines());
    let text = lines();
    assert!(
        text.contains("/up/orders 503 outcome=paused criticality=normal dependency=db in_flight=0 queue_wait_ms=0 policy=brk-paused key=orders|t|acme limit=dependency:db breaker=closed"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("/up/orders 200 outcome=admitted ")
                && l.ends_with(" policy=brk-unpaused key=orders|t|acme limit=- breaker=closed")),
        "{text}"
    );
}

#[test]
fn while_the_breaker_is_open_a_degradable_get_gets_the_last_good_answer_and_others_503() {
    let (upstream, envoy) = start(false);
    let tenant = [("x-tenant-id", "acme")];
    // A good answer, kept for the degradable route.
    upstream.set_version(7);
    let first = get(envoy.port, "/up/catalog/items", &tenant);
    assert_eq!(
        (first.status, first.header("etag")),
        (200, Some("\"v7\"")),
        "{first:?}"
    );
    // 100 % failures until it opens.
    upstream.set_status(503);
    let opened = wait_for(WAIT, || reason(&orders(&envoy)) == Some("circuit_open"));
    assert!(opened, "the breaker never opened");
    envoy.settle();
    let calls = upstream.received();
    for _ in 0..20 {
        let r = get(envoy.port, "/up/catalog/items", &tenant);
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(String::from_utf8_lossy(&r.body), "ok v7\n", "{r:?}");
        assert_eq!(r.header("etag"), Some("\"v7\""), "{r:?}");
        assert_eq!(r.header("x-tenantgate-degraded"), Some("circuit_open"), "{r:?}");
        let age: u64 = r.header("age").and_then(|v| v.parse().ok()).unwrap_or(u64::MAX);
        assert!(age <= 30, "{r:?}");
        assert!(
            r.header("x-tenantgate-captured-at")
                .is_some_and(|c| c.ends_with(" GMT")),
            "{r:?}"
        );
        let other = orders(&envoy);
        assert_eq!(
            (other.status, reason(&other)),
            (503, Some("circuit_open")),
            "{other:?}"
        );
        assert!(other
            .header("retry-after")
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|s| s >= 1));
    }
    println!(
        "open: 20 degradable GETs answered 200 from the last good answer (circuit_open), 20 others 503; {} upstream calls meanwhile",
        upstream.received() - calls
    );
    assert!(
        upstream.received() - calls <= PROBES,
        "only probes reach the upstream"
    );
}
