//! The node-local bound `burst + rate × (d + τ)` in a real Envoy 1.40, on
//! the users' terms (issue 31): more workers than cores (`--concurrency 4`
//! on this 2-core machine, and 2), a flooded key that is never leased
//! (beside a guard) and one that is (worker leases), every window from
//! 0.1 s to 60 s; and a hot key's limit lowered, renamed and re-planned
//! by `policy apply` while it is flooded and its workers hold leases.
//!
//! An admission happens somewhere between its request's send and its
//! answer: a window counts only the requests sent and answered inside it
//! ([`surely_within`]), so the check never blames the client's latency on
//! the filter, and a filter over its bound by more than a request's
//! latency worth of units fails it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tenantgate_integration_tests::{on_both_hosts, with_workers, Conn, Envoy};

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;
/// τ: a worker lease's life (src/pipeline/lease.rs, LEASE_TTL_NS), also
/// allowed for a stale reading on a never-leased key (docs/policy.md,
/// "Stale clock readings").
const TAU: u64 = 10 * MS;

/// One tenant on 1,000/s with a burst of 80; `orders` is charged beside a
/// guard (never leased), `api` alone (leased when hot).
const FLOOD: &str = r#"
version: "nb-1"
identity: { header: x-tenant-id }
plans:
  flood: { limits: [ { rate: 1000, per: 1s, burst: 80 } ] }
guards:
  generous: { limits: [ { rate: 1000000, per: 1s, burst: 1000000 } ] }
default_plan: flood
anonymous: { plan: flood }
routes:
  api:    { action: api }
  orders: { action: orders, guard: generous }
  search: { action: search }
default_route: api
"#;

/// What one request got: sent and answered (ns since the run's start),
/// status, and the `ratelimit-policy` header.
#[derive(Debug, Clone)]
struct Answer {
    sent: u64,
    answered: u64,
    status: u16,
    policy: String,
}

/// `threads` clients on keep-alive connections (reopened every 40
/// requests, so the kernel spreads them over every worker) send `GET path`
/// for `tenant` until `stop`, or `run_for`, or 400,000 requests each.
fn flood(
    port: u16,
    path: &'static str,
    tenant: &'static str,
    threads: usize,
    start: Instant,
    run_for: Duration,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Vec<Answer>> {
    std::thread::spawn(move || {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    let mut conn = Conn::open(port).ok();
                    let ns =
                        |t: Instant| u64::try_from(t.duration_since(start).as_nanos()).unwrap_or(u64::MAX);
                    for sent_count in 0..400_000u32 {
                        if stop.load(Ordering::Relaxed) || start.elapsed() >= run_for {
                            break;
                        }
                        if sent_count % 40 == 0 {
                            conn = Conn::open(port).ok();
                        }
                        let Some(c) = conn.as_mut() else {
                            std::thread::sleep(Duration::from_millis(1));
                            conn = Conn::open(port).ok();
                            continue;
                        };
                        let sent = Instant::now();
                        match c.get(path, &[("x-tenant-id", tenant)]) {
                            Ok(r) => got.push(Answer {
                                sent: ns(sent),
                                answered: ns(Instant::now()),
                                status: r.status,
                                policy: r.header("ratelimit-policy").unwrap_or("").to_owned(),
                            }),
                            Err(_) => conn = Conn::open(port).ok(),
                        }
                    }
                    got
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_default())
            .collect()
    })
}

/// The most admissions any interval of length `d` surely holds: over
/// intervals starting at each admission's send, the requests sent at or
/// after the start and answered by its end (#answered ≤ a + d, less
/// #sent < a: a lower bound of that count, never more than the interval
/// really admitted).
fn surely_within(admitted: &[&Answer], d: u64) -> u64 {
    let mut sent: Vec<u64> = admitted.iter().map(|a| a.sent).collect();
    let mut answered: Vec<u64> = admitted.iter().map(|a| a.answered).collect();
    sent.sort_unstable();
    answered.sort_unstable();
    sent.iter()
        .map(|&a| {
            let done = answered.partition_point(|&t| t <= a.saturating_add(d));
            let before = sent.partition_point(|&t| t < a);
            done.saturating_sub(before) as u64
        })
        .max()
        .unwrap_or(0)
}

/// `burst + rate × (d + τ)`, plus the documented race of workers creating
/// a key's entry at once (`workers − 1` requests of cost 1, once).
fn bound(burst: u64, rate_per_s: u64, d: u64, workers: u64) -> u64 {
    burst + rate_per_s * (d + TAU) / S + workers.saturating_sub(1)
}

/// The worst window, `(admitted, bound, d)`, of `admitted` over `lengths`.
fn worst(admitted: &[&Answer], lengths: &[u64], burst: u64, rate: u64, workers: u64) -> (u64, u64, u64) {
    lengths
        .iter()
        .map(|&d| (surely_within(admitted, d), bound(burst, rate, d, workers), d))
        .max_by_key(|(got, allowed, _)| *got as i64 - *allowed as i64)
        .unwrap_or((0, 0, 0))
}

fn flooded_keys_stay_within_their_bound_in_every_window(workers: u64, seconds: u64) {
    with_workers(workers, || {
        let envoy = Envoy::start(FLOOD);
        let start = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let run_for = Duration::from_secs(seconds);
        let guarded = flood(
            envoy.port,
            "/api/orders",
            "flooder",
            3,
            start,
            run_for,
            stop.clone(),
        );
        let leased = flood(envoy.port, "/api/items", "flooder", 3, start, run_for, stop);
        let guarded = guarded.join().unwrap();
        let leased = leased.join().unwrap();
        let lengths: Vec<u64> = [100 * MS, 500 * MS, S, 5 * S, 10 * S, 30 * S, 60 * S]
            .into_iter()
            .filter(|&d| d <= seconds * S)
            .collect();
        for (name, answers) in [("never leased", &guarded), ("leased", &leased)] {
            let unexpected: Vec<u16> = answers
                .iter()
                .map(|a| a.status)
                .filter(|s| *s != 200 && *s != 429)
                .collect();
            assert!(
                unexpected.len() <= 5,
                "{name}: {} unexpected statuses",
                unexpected.len()
            );
            let admitted: Vec<&Answer> = answers.iter().filter(|a| a.status == 200).collect();
            let (got, allowed, d) = worst(&admitted, &lengths, 80, 1000, workers);
            println!(
                "{name} key at --concurrency {workers}: {} requests, {} admitted; worst window {} ms: \
                 {got} admitted, bound {allowed} ({} over)",
                answers.len(),
                admitted.len(),
                d / MS,
                got as i64 - allowed as i64
            );
            for &d in &lengths {
                let got = surely_within(&admitted, d);
                let allowed = bound(80, 1000, d, workers);
                assert!(
                    got <= allowed,
                    "{name}: {got} admitted in {} ms, bound {allowed}",
                    d / MS
                );
            }
            // Not starved: the flood gets about the rate.
            let span = admitted.last().map_or(0, |a| a.answered) as f64 / S as f64;
            assert!(
                admitted.len() as f64 >= 1000.0 * span * 0.8,
                "{name}: {} admitted in {span:.1} s",
                admitted.len()
            );
        }
        assert!(
            envoy.tg_stat("lease.served") > 0,
            "the leased key was served from leases"
        );
    });
}

on_both_hosts!(flooded_keys_stay_within_their_bound_at_four_workers_on_two_cores);
fn flooded_keys_stay_within_their_bound_at_four_workers_on_two_cores() {
    flooded_keys_stay_within_their_bound_in_every_window(4, 60);
}

on_both_hosts!(flooded_keys_stay_within_their_bound_at_two_workers);
fn flooded_keys_stay_within_their_bound_at_two_workers() {
    flooded_keys_stay_within_their_bound_in_every_window(2, 10);
}

/// A hot key's policy: 50,000/s with a burst of 8,000 (limit `s`); plan
/// `q` holds a lowered `s` for the re-plan.
fn hot(version: &str, hot_limits: &str, tenant_plan: &str) -> String {
    format!(
        r#"
version: "{version}"
identity: {{ header: x-tenant-id }}
plans:
  hot: {{ limits: {hot_limits} }}
  q:   {{ limits: [ {{ name: s, rate: 10, per: 1s, burst: 50 }} ] }}
tenants:
  - {{ id: hot-tenant, plan: {tenant_plan} }}
default_plan: hot
anonymous: {{ plan: hot }}
routes:
  api: {{ action: api }}
  orders: {{ action: orders }}
  search: {{ action: search }}
default_route: api
"#
    )
}

const BEFORE: &str = "[ { name: s, rate: 50000, per: 1s, burst: 8000 } ]";

fn reloads_under_leases(workers: u64) {
    with_workers(workers, || {
        let envoy = Envoy::start(&hot("rl-0", BEFORE, "hot"));
        let start = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let traffic = flood(
            envoy.port,
            "/api/items",
            "hot-tenant",
            6,
            start,
            Duration::from_secs(60),
            stop.clone(),
        );
        let ns = |t: Instant| u64::try_from(t.duration_since(start).as_nanos()).unwrap_or(u64::MAX);
        let cases = [
            (
                "lowered",
                hot("rl-1", "[ { name: s, rate: 10, per: 1s, burst: 50 } ]", "hot"),
            ),
            (
                "renamed",
                hot("rl-2", "[ { name: s2, rate: 10, per: 1s, burst: 50 } ]", "hot"),
            ),
            ("re-planned", hot("rl-3", BEFORE, "q")),
        ];
        let mut applied = Vec::new();
        let mut raised = Vec::new();
        std::thread::sleep(Duration::from_millis(1_500));
        for (i, (name, policy)) in cases.iter().enumerate() {
            let (ok, err) = envoy.apply(policy);
            assert!(ok, "{name}: {err}");
            applied.push((*name, ns(Instant::now())));
            std::thread::sleep(Duration::from_millis(2_500));
            // Raised back to the hot limit: leases form again before the
            // next case.
            let (ok, err) = envoy.apply(&hot(&format!("rl-back-{i}"), BEFORE, "hot"));
            assert!(ok, "back: {err}");
            raised.push(ns(Instant::now()));
            std::thread::sleep(Duration::from_millis(1_500));
        }
        stop.store(true, Ordering::Relaxed);
        let answers = traffic.join().unwrap();
        assert!(
            answers.iter().all(|a| a.status == 200 || a.status == 429),
            "only 200 and 429"
        );
        for at in raised {
            // Raised: from the apply on, the raised limit's answers stay within
            // its own bound (the lowered bucket's level carries over, then
            // refills at the new rate: no fresh burst beyond it either).
            let admitted: Vec<&Answer> = answers
                .iter()
                .filter(|a| a.sent >= at && a.sent < at + 1_500 * MS && a.policy.contains("q=50000;"))
                .filter(|a| a.status == 200)
                .collect();
            for d in [100 * MS, 500 * MS, S] {
                let got = surely_within(&admitted, d);
                let allowed = bound(8_000, 50_000, d, workers);
                assert!(
                    got <= allowed,
                    "raised at {workers} workers: {got} admitted in {} ms, bound {allowed}",
                    d / MS
                );
            }
            assert!(!admitted.is_empty(), "the raised policy admitted nothing");
        }
        for (name, at) in applied {
            // The new policy's answers (q=10), for 2.5 s from its apply
            // returning, and before it: the module loads it within a few
            // milliseconds of the file's write, before `policy apply` exits
            // (the previous case's answers ended 1.5 s before).
            let new: Vec<&Answer> = answers
                .iter()
                .filter(|a| a.sent + S >= at && a.sent < at + 2_500 * MS && a.policy.contains("q=10;"))
                .collect();
            let first = new.iter().map(|a| a.answered).min().unwrap_or(at);
            let admitted: Vec<&Answer> = new.iter().copied().filter(|a| a.status == 200).collect();
            let old_after: usize = answers
                .iter()
                .filter(|a| a.sent >= first && a.sent < at + 2_500 * MS && a.policy.contains("q=50000;"))
                .filter(|a| a.status == 200)
                .count();
            let lengths = [100 * MS, 500 * MS, S, 2 * S];
            let (got, allowed, d) = worst(&admitted, &lengths, 50, 10, workers);
            println!(
                "{name} at {workers} workers: new policy answering {} ms after apply returned; first 0.1 s {} \
                 admitted (bound {}); worst window {} ms: {got} admitted, bound {allowed}; {old_after} admitted \
                 under the old policy after its first new answer",
                (first as i64 - at as i64) / MS as i64,
                surely_within(&admitted, 100 * MS),
                bound(50, 10, 100 * MS, workers),
                d / MS
            );
            for d in lengths {
                let got = surely_within(&admitted, d);
                let allowed = bound(50, 10, d, workers);
                assert!(
                    got <= allowed,
                    "{name} at {workers} workers: {got} admitted in {} ms under the new policy, bound {allowed}",
                    d / MS
                );
            }
            assert!(!admitted.is_empty(), "{name}: the new policy admitted nothing");
        }
    });
}

on_both_hosts!(a_reload_under_leases_keeps_the_new_bound_at_two_workers);
fn a_reload_under_leases_keeps_the_new_bound_at_two_workers() {
    reloads_under_leases(2);
}

on_both_hosts!(a_reload_under_leases_keeps_the_new_bound_at_four_workers);
fn a_reload_under_leases_keeps_the_new_bound_at_four_workers() {
    reloads_under_leases(4);
}
