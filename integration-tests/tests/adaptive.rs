//! The adaptive concurrency controller in a real Envoy 1.40
//! (`--concurrency 2`) in front of the controllable test upstream: the
//! upstream's capacity halves during mixed critical and sheddable traffic
//! and comes back. The controller's limit (the `admission.limit.svc`
//! gauge) falls below twice the new capacity, critical p99 stays within
//! its baseline plus one service time once the limit has followed (a
//! queue at the upstream of less than one round of its capacity), and the
//! limit rises again after the capacity returns. A healthy upstream
//! (issue #26's run) keeps its limit at or above its capacity (below it
//! only for an experiment and the climb back, below the controller's
//! floor only for a refresh's cut), and upstream errors back it off to
//! `min` and it comes back. Every load loop is bounded in count and time; the tests
//! print their figures (`cargo test -p tenantgate-integration-tests --test
//! adaptive -- --nocapture`).

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tenantgate_integration_tests::upstream::Upstream;
use tenantgate_integration_tests::{get, Conn, Envoy};

/// `svc`: at most 64 in flight (the controller's ceiling and start), 4
/// reserved for critical work; the controller at its defaults, but its
/// baseline refreshed once a minute so that no scheduled refresh falls
/// inside the test's 34 s (a refresh halves the limit for two windows;
/// the unit tests cover it; a descent that reaches its floor still runs
/// one).
const POLICY: &str = r#"
version: "adaptive-1"
identity: { header: x-tenant-id }
plans:
  free: { limits: [ { rate: 1000000, per: 1s } ] }
default_plan: free
anonymous: { plan: free }
dependencies:
  svc:
    max_in_flight: 64
    reserved: { critical: 4 }
    adaptive: { baseline_refresh: 1m }
routes:
  checkout: { criticality: critical, dependency: svc }
  report: { criticality: sheddable, dependency: svc }
"#;

/// The upstream: 16 at once, 100 ms each (160 requests/s); then 8 (a long
/// service time keeps a shared machine's scheduling delays, tens of ms
/// while other builds run, small beside it).
const CAPACITY: u64 = 16;
const LATENCY: Duration = Duration::from_millis(100);
/// The phases: full capacity, half, full again.
const FULL: Duration = Duration::from_secs(10);
const HALF: Duration = Duration::from_secs(16);
const BACK: Duration = Duration::from_secs(8);
/// How long the limit may take to follow a step, and the upstream's own
/// queue to drain, before critical p99 is held to its bound (ten windows;
/// the simulation settles in 4–5, and the queue that built up at the full
/// limit drains behind them: at three windows CI saw its tail in the p99).
const FOLLOW: Duration = Duration::from_secs(5);
/// The p99 bound's absolute slack, for a shared 2-core machine.
const P99_SLACK: Duration = Duration::from_millis(5);
/// The claim critical p99 is held to, once the limit has followed: a
/// critical request waits behind at most one round of the upstream's
/// capacity, so its p99 is at most its baseline's plus one service time
/// ([`LATENCY`]) plus [`P99_SLACK`]. At the fixed limit (64, of which
/// sheddable work may hold most) the upstream's queue would be several
/// rounds deep. A tighter bound (1.5× the baseline, half a service time)
/// is not what the controller promises: it settles above the capacity
/// (sheddable work fills only part of the pool), so a critical request
/// that arrives while the reserved slots are in use queues for part of a
/// round; CI saw 1.67× (196.8 ms against 117.7 ms) with the limit at 9–11
/// for a capacity of 8, the controller doing what it states.
fn critical_p99_bound(baseline: Duration) -> Duration {
    baseline + LATENCY + P99_SLACK
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Sent this long after the start.
    at: Duration,
    ok: bool,
    latency: Duration,
}

/// A client on its own keep-alive connection: one request every `period`
/// (never two at once), until `until`, at most `max` requests.
fn paced(
    port: u16,
    path: &'static str,
    tenant: String,
    period: Duration,
    t0: Instant,
    until: Duration,
) -> JoinHandle<Vec<Sample>> {
    let max = (until.as_secs_f64() / period.as_secs_f64()) as usize + 10;
    std::thread::spawn(move || {
        let mut conn = Conn::open(port).unwrap();
        let mut out = Vec::new();
        let mut next = Instant::now();
        while t0.elapsed() < until && out.len() < max {
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
            next = Instant::now().max(next) + period;
            let sent = Instant::now();
            let at = t0.elapsed();
            let r = match conn.get(path, &[("x-tenant-id", &tenant)]) {
                Ok(r) => r,
                Err(_) => {
                    conn = Conn::open(port).unwrap();
                    continue;
                }
            };
            out.push(Sample {
                at,
                ok: r.status == 200,
                latency: sent.elapsed(),
            });
            if r.header("connection") == Some("close") {
                conn = Conn::open(port).unwrap();
            }
        }
        out
    })
}

fn p99(samples: &[&Sample]) -> Duration {
    let mut l: Vec<Duration> = samples.iter().map(|s| s.latency).collect();
    l.sort_unstable();
    let i = (l.len() * 99).div_ceil(100).saturating_sub(1);
    l.get(i).copied().unwrap_or_default()
}

fn between(samples: &[Sample], from: Duration, to: Duration) -> Vec<&Sample> {
    samples.iter().filter(|s| s.at >= from && s.at < to).collect()
}

fn median(values: &[u64]) -> u64 {
    let mut v = values.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

#[test]
fn the_limit_follows_the_upstream_capacity_down_and_back_and_critical_p99_holds() {
    let upstream = Upstream::start();
    upstream.set_capacity(CAPACITY);
    upstream.set_latency(LATENCY);
    let envoy = Envoy::start_with_upstream(POLICY, upstream.port, &["checkout", "report"]);
    let port = envoy.port;
    for path in ["/up/checkout", "/up/report"] {
        assert_eq!(get(port, path, &[("x-tenant-id", "warm")]).status, 200);
    }
    let end = FULL + HALF + BACK;
    let t0 = Instant::now();
    // Critical: 4 clients × 5/s (about 2 slots). Sheddable: 32 clients ×
    // at most 10/s, twice what the upstream serves at full capacity.
    let critical: Vec<_> = (0..4)
        .map(|i| {
            paced(
                port,
                "/up/checkout",
                format!("shop-{i}"),
                Duration::from_millis(200),
                t0,
                end,
            )
        })
        .collect();
    let sheddable: Vec<_> = (0..32)
        .map(|i| {
            paced(
                port,
                "/up/report",
                format!("bulk-{}", i % 8),
                Duration::from_millis(100),
                t0,
                end,
            )
        })
        .collect();
    // The controller's limit as the gauge shows it, every 200 ms.
    let limit = || envoy.stat("wasmcustom.tenantgate.admission.limit.svc");
    let gauge = |name: &str| {
        envoy
            .stat(&format!("wasmcustom.tenantgate.admission.{name}.svc"))
            .unwrap_or(0)
    };
    let mut limits: Vec<(Duration, u64)> = Vec::new();
    let mut latencies: Vec<(u64, u64)> = Vec::new();
    let mut halved = false;
    let mut restored = false;
    while t0.elapsed() < end {
        let at = t0.elapsed();
        if !halved && at >= FULL {
            upstream.set_capacity(CAPACITY / 2);
            halved = true;
        }
        if !restored && at >= FULL + HALF {
            upstream.set_capacity(CAPACITY);
            restored = true;
        }
        if let Some(l) = limit() {
            limits.push((at, l));
            latencies.push((gauge("baseline_us"), gauge("latency_p95_us")));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let join = |hs: Vec<JoinHandle<Vec<Sample>>>| -> Vec<Sample> {
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    };
    let critical = join(critical);
    let sheddable = join(sheddable);
    let limits_in = |from: Duration, to: Duration| -> Vec<u64> {
        limits
            .iter()
            .filter(|(at, _)| *at >= from && *at < to)
            .map(|(_, l)| *l)
            .collect()
    };
    let tail = Duration::from_secs(3);
    let l_full = median(&limits_in(FULL - tail, FULL));
    let l_half = median(&limits_in(FULL + HALF - tail, FULL + HALF));
    let l_back = median(&limits_in(end - tail, end));
    // Once followed, the limit keeps the upstream's queue under one round
    // of its capacity: below twice the halved capacity.
    let half_top = limits_in(FULL + FOLLOW, FULL + HALF)
        .into_iter()
        .max()
        .unwrap_or(0);
    let series: Vec<String> = limits
        .iter()
        .zip(&latencies)
        .step_by(2)
        .map(|((at, l), (b, p))| format!("{:.1}s:{l}/{}/{}", at.as_secs_f64(), b / 1000, p / 1000))
        .collect();
    println!(
        "limit/baseline ms/p95 ms (gauges, every 400 ms): {}",
        series.join(" ")
    );
    // Baseline: the settled part of the first phase (its last 4 s).
    let base = between(&critical, FULL - Duration::from_secs(4), FULL);
    let half_all = between(&critical, FULL, FULL + HALF);
    let half_followed = between(&critical, FULL + FOLLOW, FULL + HALF);
    let back = between(&critical, FULL + HALF + FOLLOW, end);
    let ok = |s: &[&Sample]| s.iter().filter(|x| x.ok).count() as f64 / s.len().max(1) as f64;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "limit medians of each phase's last 3 s: full {l_full}, half {l_half}, back {l_back}; highest from {} s after the step down {half_top} (upstream capacity {CAPACITY} → {} → {CAPACITY} at {} ms)",
        FOLLOW.as_secs(),
        CAPACITY / 2,
        LATENCY.as_millis()
    );
    println!(
        "critical p99: baseline {:.1} ms ({} requests, {:.1} % ok); halved, from {} s after the step {:.1} ms ({:.2}× the baseline, bound {:.1} ms; {}, {:.1} % ok); whole halved phase {:.1} ms; back {:.1} ms",
        ms(p99(&base)),
        base.len(),
        100.0 * ok(&base),
        FOLLOW.as_secs(),
        ms(p99(&half_followed)),
        p99(&half_followed).as_secs_f64() / p99(&base).as_secs_f64().max(1e-9),
        ms(critical_p99_bound(p99(&base))),
        half_followed.len(),
        100.0 * ok(&half_followed),
        ms(p99(&half_all)),
        ms(p99(&back)),
    );
    let shed_ok = |from, to| ok(&between(&sheddable, from, to));
    println!(
        "sheddable: {} requests, admitted {:.1} % at full capacity, {:.1} % at half; upstream at most {} in flight; served {}",
        sheddable.len(),
        100.0 * shed_ok(FULL - Duration::from_secs(4), FULL),
        100.0 * shed_ok(FULL + FOLLOW, FULL + HALF),
        upstream.max_in_flight(),
        upstream.served()
    );
    assert!(limits.len() >= 100, "the gauge was read: {}", limits.len());
    assert!(
        base.len() >= 60 && half_followed.len() >= 100,
        "{} / {}",
        base.len(),
        half_followed.len()
    );
    assert!(l_full < 64, "the limit came down from its start: {l_full}");
    // Against the full phase's limit, or the full capacity when that
    // limit had not climbed back to it yet (at load average 5–6 a run on
    // this machine saw the first descent reach 9 and the limit at 12 at the
    // step, climbing a slot a window).
    assert!(
        (l_half as f64) <= 0.8 * l_full.max(CAPACITY) as f64,
        "the limit fell with the capacity: {l_full} -> {l_half}"
    );
    assert!(
        (l_back as f64) >= 1.25 * l_half as f64,
        "the limit rose again: {l_half} -> {l_back}"
    );
    assert!(
        half_top < CAPACITY,
        "the limit stayed below twice the halved capacity: {half_top}"
    );
    // Where it settles (docs/admission.md, "How far above the capacity it
    // settles"): near capacity ÷ 0.8 (sheddable work fills at most 80 % of
    // the pool) plus the slots its steps oscillate by: 10–12 for 8.
    let settles_at_most = (CAPACITY / 2) * 5 / 4 + 3;
    assert!(
        l_half <= settles_at_most,
        "the halved phase settled at {l_half}, above capacity / 0.8 + 3 = {settles_at_most}"
    );
    assert!(ok(&half_followed) >= 0.99, "critical success at half capacity");
    let bound = critical_p99_bound(p99(&base));
    assert!(
        p99(&half_followed) <= bound,
        "critical p99 {:?} > {bound:?}",
        p99(&half_followed)
    );
}

/// Upstream 5xx answers are errors: the limit backs off to `min` and the
/// error-rate gauge shows them; once the upstream answers 200 again the
/// limit climbs back. (tenantgate's own 503s, the refusals, are never
/// counted: the refused share of this load is large, yet the limit comes
/// back.)
#[test]
fn upstream_errors_back_the_limit_off_to_min_and_it_recovers() {
    let upstream = Upstream::start();
    upstream.set_capacity(CAPACITY);
    upstream.set_latency(Duration::from_millis(10));
    let envoy = Envoy::start_with_upstream(POLICY, upstream.port, &["checkout", "report"]);
    let port = envoy.port;
    assert_eq!(get(port, "/up/report", &[("x-tenant-id", "warm")]).status, 200);
    let end = Duration::from_secs(20);
    let t0 = Instant::now();
    let load: Vec<_> = (0..24)
        .map(|i| {
            paced(
                port,
                "/up/report",
                format!("bulk-{i}"),
                Duration::from_millis(20),
                t0,
                end,
            )
        })
        .collect();
    let gauge = |name: &str| envoy.stat(&format!("wasmcustom.tenantgate.admission.{name}.svc"));
    let mut series: Vec<(Duration, u64, u64)> = Vec::new();
    let mut lat: Vec<(u64, u64)> = Vec::new();
    let mut failing = false;
    let mut healed = false;
    while t0.elapsed() < end {
        let at = t0.elapsed();
        if !failing && at >= Duration::from_secs(4) {
            upstream.set_status(503);
            failing = true;
        }
        if !healed && at >= Duration::from_secs(10) {
            upstream.set_status(0);
            healed = true;
        }
        if let (Some(l), Some(e)) = (gauge("limit"), gauge("error_rate_ppm")) {
            series.push((at, l, e));
            lat.push((
                gauge("baseline_us").unwrap_or(0),
                gauge("latency_p95_us").unwrap_or(0),
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let samples: Vec<Sample> = load.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let shown: Vec<String> = series
        .iter()
        .zip(&lat)
        .step_by(2)
        .map(|((at, l, e), (b, p))| {
            format!(
                "{:.1}s:{l}/{}%/{}/{}",
                at.as_secs_f64(),
                e / 10_000,
                b / 1000,
                p / 1000
            )
        })
        .collect();
    println!(
        "limit/error rate/baseline ms/p95 ms (gauges, every 400 ms): {}",
        shown.join(" ")
    );
    let at = |from: u64, to: u64| -> Vec<(u64, u64)> {
        series
            .iter()
            .filter(|(t, _, _)| *t >= Duration::from_secs(from) && *t < Duration::from_secs(to))
            .map(|(_, l, e)| (*l, *e))
            .collect()
    };
    let before = at(3, 4);
    let failed = at(8, 10);
    let after = at(18, 20);
    println!(
        "{} requests; limit before {:?}, at the end of the failure {:?}, at the end {:?}",
        samples.len(),
        before.last(),
        failed.last(),
        after.last()
    );
    // min = reserved.critical + 1 = 5.
    assert!(
        failed.iter().any(|(l, e)| *l == 5 && *e >= 900_000),
        "backed off to min: {failed:?}"
    );
    let recovered = after.iter().map(|(l, _)| *l).max().unwrap_or(0);
    assert!(recovered >= 10, "the limit climbed back: {after:?}");
    assert!(after.iter().all(|(_, e)| *e < 100_000), "errors gone: {after:?}");
}

/// The issue's run (#26), healthy: `svc` with every adaptive default (its
/// first baseline measured at an eighth of the limit on a quiet start, a
/// refresh every 30 s ± 25 %), in front of an upstream of 30 ms and capacity
/// 16 that never fails, 40 closed-loop clients of normal traffic (a refused
/// one tries again after [`REFUSED_PAUSE`]) and critical requests at 10/s.
const HEALTHY_POLICY: &str = r#"
version: "adaptive-healthy-1"
identity: { header: x-tenant-id }
plans:
  free: { limits: [ { rate: 1000000, per: 1s } ] }
default_plan: free
anonymous: { plan: free }
dependencies:
  svc:
    max_in_flight: 64
    reserved: { critical: 4 }
    adaptive: {}
routes:
  checkout: { criticality: critical, dependency: svc }
  browse: { dependency: svc }
"#;
const HEALTHY_CAPACITY: u64 = 16;
const HEALTHY_LATENCY: Duration = Duration::from_millis(30);
const HEALTHY_RUN: Duration = Duration::from_secs(30);
/// From here on the limit has come down from its start at 64.
const HEALTHY_SETTLED: Duration = Duration::from_secs(8);
/// The controller's bound 1 on this dependency: latency alone takes a
/// limit that reached the capacity no lower than `min + 0.75·(C − min)` =
/// 13.25 (`min` 5), except for an experiment's two windows at half of it
/// (the gauge shows the cut) or an experiment that takes noise for a clear
/// fall. A limit below this is below that floor.
const HEALTHY_FLOOR: u64 = 14;
/// A refused closed-loop client waits this long before it tries again (no
/// busy loop of refusals on a shared machine).
const REFUSED_PAUSE: Duration = Duration::from_millis(50);

/// A closed-loop client on its own keep-alive connection: the next request
/// as soon as the last answer came (after [`REFUSED_PAUSE`] when refused),
/// until `until`. (Successes, refusals.)
fn closed_loop(
    port: u16,
    path: &'static str,
    tenant: String,
    t0: Instant,
    until: Duration,
) -> JoinHandle<(u64, u64)> {
    std::thread::spawn(move || {
        let mut conn = Conn::open(port).unwrap();
        let (mut ok, mut refused) = (0u64, 0u64);
        while t0.elapsed() < until {
            let r = match conn.get(path, &[("x-tenant-id", &tenant)]) {
                Ok(r) => r,
                Err(_) => {
                    conn = Conn::open(port).unwrap();
                    continue;
                }
            };
            if r.status == 200 {
                ok += 1;
            } else {
                refused += 1;
                std::thread::sleep(REFUSED_PAUSE);
            }
            if r.header("connection") == Some("close") {
                conn = Conn::open(port).unwrap();
            }
        }
        (ok, refused)
    })
}

#[test]
fn a_healthy_upstream_keeps_the_limit_at_or_above_its_capacity() {
    let upstream = Upstream::start();
    upstream.set_capacity(HEALTHY_CAPACITY);
    upstream.set_latency(HEALTHY_LATENCY);
    let envoy = Envoy::start_with_upstream(HEALTHY_POLICY, upstream.port, &["checkout", "browse"]);
    let port = envoy.port;
    for path in ["/up/checkout", "/up/browse"] {
        assert_eq!(get(port, path, &[("x-tenant-id", "warm")]).status, 200);
    }
    let t0 = Instant::now();
    let critical: Vec<_> = (0..2)
        .map(|i| {
            paced(
                port,
                "/up/checkout",
                format!("shop-{i}"),
                Duration::from_millis(200),
                t0,
                HEALTHY_RUN,
            )
        })
        .collect();
    let normal: Vec<_> = (0..40)
        .map(|i| closed_loop(port, "/up/browse", format!("app-{}", i % 8), t0, HEALTHY_RUN))
        .collect();
    let gauge = |name: &str| envoy.stat(&format!("wasmcustom.tenantgate.admission.{name}.svc"));
    // (at, limit, upstream in flight, baseline µs, p95 µs), every 200 ms.
    let mut series: Vec<(Duration, u64, u64, u64, u64)> = Vec::new();
    while t0.elapsed() < HEALTHY_RUN {
        let at = t0.elapsed();
        if let Some(l) = gauge("limit") {
            let b = gauge("baseline_us").unwrap_or(0);
            let p = gauge("latency_p95_us").unwrap_or(0);
            series.push((at, l, upstream.in_flight(), b, p));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let critical: Vec<Sample> = critical.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let (ok, refused) = normal
        .into_iter()
        .map(|h| h.join().unwrap())
        .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
    let shown: Vec<String> = series
        .iter()
        .step_by(2)
        .map(|(at, l, f, b, p)| {
            format!(
                "{:.1}s:{l}/{f}/{:.1}/{:.1}",
                at.as_secs_f64(),
                *b as f64 / 1e3,
                *p as f64 / 1e3
            )
        })
        .collect();
    println!(
        "limit/upstream in flight/baseline ms/p95 ms (every 400 ms): {}",
        shown.join(" ")
    );
    let settled: Vec<u64> = series
        .iter()
        .filter(|(at, ..)| *at >= HEALTHY_SETTLED)
        .map(|(_, l, ..)| *l)
        .collect();
    let below = settled.iter().filter(|&&l| l < HEALTHY_CAPACITY).count();
    // The longest run of samples below `level` (a refresh cuts the limit
    // to half for two windows, 1 s: five samples).
    let longest = |level: u64| {
        settled
            .split(|&l| l >= level)
            .map(<[u64]>::len)
            .max()
            .unwrap_or(0)
    };
    let longest_below = longest(HEALTHY_CAPACITY);
    let longest_below_floor = longest(HEALTHY_FLOOR);
    let crit_ok = critical.iter().filter(|s| s.ok).count();
    println!(
        "from {} s: limit median {} (lowest {:?}), below the capacity {HEALTHY_CAPACITY} in {below} of {} samples (longest run {longest_below}; below {HEALTHY_FLOOR} at most {longest_below_floor} in a row); normal traffic {:.0}/s served, {:.0}/s refused (the upstream serves {:.0}/s); upstream at most {} in flight; critical {crit_ok}/{} ok",
        HEALTHY_SETTLED.as_secs(),
        median(&settled),
        settled.iter().min(),
        settled.len(),
        ok as f64 / HEALTHY_RUN.as_secs_f64(),
        refused as f64 / HEALTHY_RUN.as_secs_f64(),
        HEALTHY_CAPACITY as f64 / HEALTHY_LATENCY.as_secs_f64(),
        upstream.max_in_flight(),
        critical.len(),
    );
    assert!(settled.len() >= 80, "the gauge was read: {}", settled.len());
    assert!(
        median(&settled) >= HEALTHY_CAPACITY,
        "the limit settles at or above the capacity: {settled:?}"
    );
    // Below the floor only in a refresh's two windows (and the gauge's
    // tick around them): at most 7 samples (1.4 s) in a row. Below the
    // capacity (an experiment, the descent to the floor that starts it,
    // the climb back after it) at most 3 s in a row and a quarter of the
    // time: on this machine under load (load average 5–6) the proxy-side
    // p95 read 40–66 ms for a 30 ms upstream, and two experiments 2 s apart
    // held the limit below 16 for 10 samples, 19 of 108 in all; in quiet
    // runs 0–4. The issue's collapse stayed at `min` for 48 s.
    assert!(
        longest_below_floor <= 7,
        "the limit stayed below the floor {HEALTHY_FLOOR}: {settled:?}"
    );
    assert!(
        longest_below <= 15,
        "the limit stayed below the capacity: {settled:?}"
    );
    assert!(
        below * 4 <= settled.len(),
        "below the capacity too often: {below} of {settled:?}"
    );
    assert_eq!(crit_ok, critical.len(), "critical requests all succeed");
}
