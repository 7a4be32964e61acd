//! Global limits at the sizes users run, with real processes on loopback:
//! Envoys and one `tenantgate serve` (embedded store).
//! Issue 7's three failures, run as a user would, on two Envoys of one
//! region: a paced client against a small limit (it farmed the provisional
//! allowance on every lease expiry), a cost-5 route on 100/min (never
//! admitted), and two nodes with equal demand on 100/min (one starved).
//! Then the states in which no lease can come (a limit the service lacks,
//! an overflowing key) reach the failure mode within `2·I + D`. Then issue
//! 21's two situations on three Envoys in two regions: a burst from cold,
//! and an outage of the service right after demand moved.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tenantgate_integration_tests::cluster::cluster;
use tenantgate_integration_tests::{get, on_both_hosts, request, wait_for};

/// `I` = 1 s, `D` = 500 ms, `P` = 2, as `policies/global.yaml`.
const POLICY: &str = r#"
version: "users-1"
identity: { header: x-tenant-id }
plans:
  free: { limits: [ { name: free, rate: 100, per: 1m, global: true } ] }
  tiny: { limits: [ { name: tiny, rate: 6, per: 1m, global: true } ] }
  ghost: { limits: [ { name: ghost, rate: 100, per: 1m, global: true } ] }
tenants: [ { id: paced, plan: tiny }, { id: haunted, plan: ghost } ]
default_plan: free
anonymous: { plan: free }
key_table: { max_keys: 8 }
routes:
  api: {}
  search: { cost: 5 }
default_route: api
sync: { cluster: tenantgate, interval: 1s, timeout: 500ms, provisional: 2, failure_mode: fail_open }
"#;

/// What the service knows: the same policy without the `ghost` limit (a
/// rollout with policy skew).
fn service_policy() -> String {
    POLICY
        .replace(
            "  ghost: { limits: [ { name: ghost, rate: 100, per: 1m, global: true } ] }\n",
            "  ghost: { limits: [ { name: ghost-v0, rate: 100, per: 1m } ] }\n",
        )
        .replace("users-1", "users-0")
}

/// Requests of `tenant` on `path` at Envoy `port`: `burst` at once every
/// `every`, for `run_for`. Returns how many were admitted (200).
fn paced(port: u16, path: &str, tenant: &str, burst: usize, every: Duration, run_for: Duration) -> usize {
    let start = Instant::now();
    let mut admitted = 0;
    let mut next = start;
    while start.elapsed() < run_for {
        for _ in 0..burst {
            if get(port, path, &[("x-tenant-id", tenant)]).status == 200 {
                admitted += 1;
            }
        }
        next += every;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    admitted
}

on_both_hosts!(equal_demand_shares_fairly_a_paced_client_stays_in_the_bound_and_cost_5_passes);
/// One minute, four clients at once (the suite's one long test):
/// * `fair` on both Envoys, 5 requests/s each, on 100/min: the issue saw
///   56 / 5 / 55 on three Envoys;
/// * `paced` (6/min, burst 6) on Envoy 0: 3 requests every 4.5 s, the
///   issue's client, which was admitted 28 times in 60 s;
/// * `costly` on `search` (cost 5) on Envoy 1, 1 request/s on 100/min:
///   0 of 20 admitted before.
fn equal_demand_shares_fairly_a_paced_client_stays_in_the_bound_and_cost_5_passes() {
    let c = cluster("users", &["r1", "r1"], POLICY, POLICY);
    let ports: Vec<u16> = c.envoys.iter().map(|e| e.port).collect();
    let minute = Duration::from_secs(60);
    let results = Arc::new(Mutex::new(Vec::<(&str, usize)>::new()));
    std::thread::scope(|s| {
        for (i, &port) in ports.iter().enumerate() {
            let results = results.clone();
            let name = if i == 0 { "fair-0" } else { "fair-1" };
            s.spawn(move || {
                let n = paced(port, "/api/x", "fair", 1, Duration::from_millis(200), minute);
                results.lock().unwrap().push((name, n));
            });
        }
        let r = results.clone();
        let p0 = ports[0];
        s.spawn(move || {
            let n = paced(p0, "/api/x", "paced", 3, Duration::from_millis(4500), minute);
            r.lock().unwrap().push(("paced", n));
        });
        let r = results.clone();
        let p1 = ports[1];
        s.spawn(move || {
            let n = paced(p1, "/api/search", "costly", 1, Duration::from_secs(1), minute);
            r.lock().unwrap().push(("costly", n));
        });
    });
    let results = results.lock().unwrap().clone();
    let of = |name: &str| results.iter().find(|(n, _)| *n == name).map(|r| r.1).unwrap();
    let (a, b, paced_n, costly) = (of("fair-0"), of("fair-1"), of("paced"), of("costly"));
    println!(
        "60 s: fair {a} / {b} (L + B + N·P = 204), paced {paced_n} (bound L + B + P = 14), \
         cost-5 {costly} requests (L/5 = 20 per minute, + B/5 = 20 for the first)"
    );
    // Within 25 % of each other.
    assert!(a.abs_diff(b) * 4 <= a.max(b), "fair: {a} vs {b}");
    assert!(a + b <= 204, "fair within L + B + N·P: {}", a + b);
    assert!(a + b >= 100, "fair uses the limit: {}", a + b);
    assert!(paced_n <= 14, "paced within L + B + P: {paced_n}");
    assert!(costly >= 18, "cost 5 at ≥ 90 % of L/5: {costly}");
    let no_lease: u64 = c.envoys.iter().map(|e| e.tg_stat("sync.no_lease")).sum();
    assert_eq!(no_lease, 0, "every key here gets leases");
    // The filter reports the settings it enforces, the same as the
    // service's policy here: every request counted `same`.
    let metrics = request(c.serve.admin_port, "GET", "/metrics", &[]).unwrap();
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    let settings = |result: &str| -> u64 {
        let line = format!("tenantgate_sync_settings_total{{result=\"{result}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&line))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {line} in /metrics"))
    };
    assert!(settings("same") >= 100, "{text}");
    assert_eq!((settings("differs"), settings("unreported")), (0, 0));
}

/// A limit the service's policy lacks, and a key the node's full table
/// charges to its overflow entry (never reported): no lease can come.
/// Before, both denied for good; now they run the failure mode
/// (`fail_open`) `2·I + D` = 2.5 s after they began to wait, counted in
/// `sync.no_lease`.
#[test]
fn an_unknown_limit_and_an_overflowing_key_fall_back_to_the_failure_mode_in_bounded_time() {
    let c = cluster("no-lease", &["r1"], POLICY, &service_policy());
    let port = c.envoys[0].port;
    let stated = Duration::from_millis(2500);
    let slack = Duration::from_millis(1500);

    // Unknown to the service: the provisional allowance, then waits.
    let start = Instant::now();
    let first: Vec<u16> = (0..3)
        .map(|_| get(port, "/api/x", &[("x-tenant-id", "haunted")]).status)
        .collect();
    assert_eq!(first, [200, 200, 429]);
    assert!(
        wait_for(stated + slack, || get(
            port,
            "/api/x",
            &[("x-tenant-id", "haunted")]
        )
        .status
            == 200),
        "the unknown limit reached fail_open"
    );
    let took = start.elapsed();
    println!("unknown limit: fail_open after {took:?} (stated 2·I + D = {stated:?})");
    assert!(
        took >= Duration::from_millis(2000),
        "not before the stated time: {took:?}"
    );
    assert!(c.envoys[0].tg_stat("sync.no_lease") > 0);

    // Nine new tenants (their counts not yet reported, so not idle) fill
    // the table (`max_keys: 8`, one slot of it `haunted`'s, idle and
    // reclaimed); the next ones overflow.
    for t in 0..9 {
        assert_eq!(
            get(port, "/api/x", &[("x-tenant-id", &format!("t{t}"))]).status,
            200
        );
    }
    let start = Instant::now();
    let statuses: Vec<u16> = (0..3)
        .map(|_| get(port, "/api/x", &[("x-tenant-id", "overflow-a")]).status)
        .collect();
    assert!(c.envoys[0].tg_stat("key_table.overflows") > 0, "overflowed");
    assert!(
        statuses.contains(&429),
        "the overflow entry waits first: {statuses:?}"
    );
    assert!(
        wait_for(stated + slack, || get(
            port,
            "/api/x",
            &[("x-tenant-id", "overflow-b")]
        )
        .status
            == 200),
        "the overflowing key reached fail_open"
    );
    println!("overflowing key: fail_open after {:?}", start.elapsed());
}

/// Issue 21's set-up, as `policies/global.yaml`: 100/min (burst 100),
/// `I` = 1 s, `D` = 500 ms, `P` = 2, `fail_open_local`.
const OUTAGE_POLICY: &str = r#"
version: "users-21"
identity: { header: x-tenant-id }
plans:
  free: { limits: [ { name: free, rate: 100, per: 1m, global: true } ] }
default_plan: free
anonymous: { plan: free }
routes: { api: {} }
default_route: api
sync: { cluster: tenantgate, interval: 1s, timeout: 500ms, provisional: 2, failure_mode: fail_open_local }
"#;

/// Every `every` for `run_for`, one request of `tenant` on each Envoy in
/// `ports`, each from its own thread: (port index, when from the common
/// start, admitted).
fn each_envoy(
    ports: &[u16],
    tenant: &str,
    every: &[Duration],
    run_for: Duration,
) -> Vec<(usize, Duration, bool)> {
    let start = Instant::now();
    let seen = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|s| {
        for (i, (&port, &every)) in ports.iter().zip(every).enumerate() {
            let seen = seen.clone();
            s.spawn(move || {
                let mut next = start;
                while start.elapsed() < run_for {
                    let at = start.elapsed();
                    let ok = get(port, "/api/x", &[("x-tenant-id", tenant)]).status == 200;
                    seen.lock().unwrap().push((i, at, ok));
                    next += every;
                    if let Some(wait) = next.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                }
            });
        }
    });
    let seen = seen.lock().unwrap().clone();
    seen
}

fn admitted_by(seen: &[(usize, Duration, bool)], envoys: usize) -> Vec<u64> {
    (0..envoys)
        .map(|i| seen.iter().filter(|(n, _, ok)| *n == i && *ok).count() as u64)
        .collect()
}

/// Issue 21 on three Envoys in two regions (two in `r1`, one in `r2`) and
/// `tenantgate serve`, on 100/min:
/// * **a burst from cold**: a new tenant asked for on every Envoy at once,
///   a request every 10 ms on each (300 a second against a burst of 100):
///   ≥ 90 % of min(B, demand) admitted within two sync intervals of the
///   first request (`make run`'s demo admitted 44 of 100 before);
/// * **an outage right after demand moved**: another tenant, 1 request/s
///   on each Envoy for 8 s, then 3/s on Envoy 0 and one every 5 s on the
///   others for 8 s, then the service is killed and each Envoy gets 1
///   request/s for 30 s: ≥ 80 % of the limit's flow over the outage, and
///   every Envoy ≥ 15 % of its equal share (the issue saw 0 and 55 over a
///   65-s outage: `fail_open_local` ran each node at its last share). The
///   outage is 30 s, not the issue's 65: a local limit admits its outage
///   allowance every interval from the lease's expiry, so the figure over
///   a minute is the same rate for twice as long (the simulator measures
///   the minute: `outage_after_shift`). Then the service comes back and
///   every Envoy syncs again.
#[test]
fn a_cold_burst_gets_the_burst_and_an_outage_after_a_shift_serves_every_envoy() {
    let mut c = cluster("issue-21", &["r1", "r1", "r2"], OUTAGE_POLICY, OUTAGE_POLICY);
    let ports: Vec<u16> = c.envoys.iter().map(|e| e.port).collect();
    // A system that runs: every Envoy has synced with the service.
    for e in &c.envoys {
        assert!(
            wait_for(Duration::from_secs(10), || e.tg_stat("sync.ok") >= 2),
            "synced"
        );
    }
    let rate = 100.0 / 60.0;

    // A burst from cold.
    let every = [Duration::from_millis(10); 3];
    let seen = each_envoy(&ports, "cold-tenant", &every, Duration::from_secs(3));
    let first = seen.iter().map(|s| s.1).min().unwrap();
    let within = |s: &&(usize, Duration, bool)| s.1 < first + Duration::from_secs(2);
    let demand = seen.iter().filter(within).count() as u64;
    let admitted = seen.iter().filter(within).filter(|s| s.2).count() as u64;
    let total = seen.iter().filter(|s| s.2).count() as u64;
    println!(
        "cold burst: {admitted} admitted within 2 s of the first request (demand {demand}, burst 100; by Envoy {:?}), {total} in {:.1} s",
        admitted_by(&seen, 3),
        seen.iter().map(|s| s.1).max().unwrap().as_secs_f64()
    );
    assert!(
        admitted * 10 >= demand.min(100) * 9,
        "≥ 90 % of min(B, demand): {admitted} of {demand}"
    );
    // The bound over the run (< W): B + r·t + N·P.
    assert!((total as f64) <= 100.0 + rate * 3.5 + 6.0, "bound: {total}");

    // Demand even, then moved to Envoy 0.
    let second = Duration::from_secs(1);
    let even = each_envoy(&ports, "shift-tenant", &[second; 3], Duration::from_secs(8));
    let shifted = each_envoy(
        &ports,
        "shift-tenant",
        &[Duration::from_millis(333), second * 5, second * 5],
        Duration::from_secs(8),
    );
    let (even, shifted) = (admitted_by(&even, 3), admitted_by(&shifted, 3));
    // The service goes silent.
    c.serve.stop();
    let outage_for = Duration::from_secs(30);
    let outage = each_envoy(&ports, "shift-tenant", &[second; 3], outage_for);
    let during = admitted_by(&outage, 3);
    let sum: u64 = during.iter().sum();
    let flow = rate * outage_for.as_secs_f64();
    println!(
        "outage after a shift: even {even:?}, shifted {shifted:?}, then {sum} admitted in the {} s outage \
         ({:.0} % of the limit's {flow:.0}), by Envoy {during:?} (equal share {:.1})",
        outage_for.as_secs(),
        100.0 * sum as f64 / flow,
        flow / 3.0
    );
    assert!(sum as f64 >= 0.8 * flow, "≥ 80 % of the limit: {sum}");
    for (i, n) in during.iter().enumerate() {
        assert!(
            *n as f64 >= 0.15 * flow / 3.0,
            "Envoy {i}: {n} < 15 % of its equal share"
        );
    }
    // Within THE BOUND over these 46 s (< W): L + B + N·P + r·I + N·c.
    let all = even.iter().chain(&shifted).sum::<u64>() + sum;
    assert!(all <= 100 + 100 + 6 + 2 + 3, "bound: {all}");
    let no_lease: u64 = c.envoys.iter().map(|e| e.tg_stat("sync.no_lease")).sum();
    assert_eq!(no_lease, 0);

    // The service comes back: every Envoy syncs again by its next probe
    // (the breaker's backoff is at most 2·I: within I + 2·I, plus slack).
    let before: Vec<u64> = c.envoys.iter().map(|e| e.tg_stat("sync.ok")).collect();
    c.serve.restart();
    let back = Instant::now();
    for (e, b) in c.envoys.iter().zip(&before) {
        assert!(
            wait_for(Duration::from_secs(4), || e.tg_stat("sync.ok") > *b),
            "synced again"
        );
    }
    println!(
        "every Envoy synced again {} ms after the service was ready",
        back.elapsed().as_millis()
    );
}
