//! The simulator's targets: the real node code and the real allocator,
//! 3 regions × 3 nodes and 10 regions × 10 nodes, every scenario.
//!
//! Every run is computed once (virtual time: the whole table takes a few
//! seconds, unoptimized) and shared by the tests below, which print what
//! they check (`-- --nocapture`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::sync::OnceLock;

use tenantgate::sync::FailureMode;
use tenantgate_central::sim::{self, Outcome, Run, SimConfig, Topology};

const SEED: u64 = 1;

fn runs() -> &'static [Run] {
    static RUNS: OnceLock<Vec<Run>> = OnceLock::new();
    RUNS.get_or_init(|| {
        // Each run is single-threaded; two at a time use both cores.
        let cfg = SimConfig::default();
        let jobs: Vec<_> = [Topology::SMALL, Topology::LARGE]
            .into_iter()
            .flat_map(|topo| sim::scenarios().into_iter().map(move |spec| (topo, spec)))
            .collect();
        let run = |(topo, spec): &(Topology, sim::Scenario)| sim::run(spec, *topo, &cfg, SEED).unwrap();
        let (odd, even): (Vec<_>, Vec<_>) = std::thread::scope(|s| {
            let odd = s.spawn(|| jobs.iter().skip(1).step_by(2).map(run).collect::<Vec<_>>());
            let even = jobs.iter().step_by(2).map(run).collect::<Vec<_>>();
            (odd.join().unwrap(), even)
        });
        let mut runs = Vec::with_capacity(jobs.len());
        let mut odd = odd.into_iter();
        for r in even {
            runs.push(r);
            runs.extend(odd.next());
        }
        runs
    })
}

fn outcomes(names: &[&str]) -> Vec<&'static Outcome> {
    let all: Vec<_> = runs().iter().map(|r| &r.outcome).collect();
    let picked: Vec<_> = all.into_iter().filter(|o| names.contains(&o.scenario)).collect();
    assert_eq!(picked.len(), names.len() * 2, "each scenario on both topologies");
    picked
}

fn line(o: &Outcome) -> String {
    format!(
        "{:<6} {:<19} max/window {:>6} (L+B {:>6}, bound {:>6}; extra measured {:>6}, formula {:>6}) utilisation {:>6.2}% converge {:?} S {} by {:?}",
        o.topology,
        o.scenario,
        o.max_admitted_in_window,
        o.limit + o.burst,
        o.bound.max_window,
        o.measured_extra,
        o.bound.extra,
        o.utilisation_pct,
        o.converge_s,
        o.key_starts_per_node,
        o.admitted_by
    )
}

#[test]
fn steady_and_shifting_demand_stay_within_one_percent_and_use_the_limit() {
    for o in outcomes(&["uniform", "skewed", "shifting"]) {
        eprintln!("{}", line(o));
        let allowed = o.limit as f64 * 1.01 + o.burst as f64;
        assert!(o.max_admitted_in_window as f64 <= allowed, "{}", line(o));
        assert!(o.utilisation_pct >= 95.0, "{}", line(o));
    }
}

#[test]
fn every_scenario_stays_within_its_bound() {
    for r in runs() {
        let o = &r.outcome;
        eprintln!("{}", line(o));
        assert!(o.within_bound, "{}", line(o));
        assert!(o.max_admitted_in_window <= o.bound.max_window);
    }
}

#[test]
fn a_central_outage_overruns_at_most_the_formula() {
    for o in outcomes(&["outage", "outage_fail_closed", "outage_fail_open"]) {
        eprintln!("{}", line(o));
        assert_eq!(o.outage_s, 30.0);
        assert!(o.measured_extra <= o.bound.extra as i64, "{}", line(o));
        match o.failure_mode {
            // Nothing beyond leases and provisional allowances.
            FailureMode::FailClosed => {
                assert_eq!(o.admitted_by.fail_open_local + o.admitted_by.fail_open, 0);
                assert_eq!(o.bound.terms.outage, 0);
            }
            // Local limits carried on at about the limit's rate.
            FailureMode::FailOpenLocal => {
                assert!(o.admitted_by.fail_open_local > 0);
                assert!(o.utilisation_pct >= 95.0, "{}", line(o));
            }
            // Everything was admitted, and all of it is charged: the
            // silent nodes' shares as time passed (a fail_open key keeps
            // its share reserved, as fail_open_local does), the rest
            // booked as debt.
            FailureMode::FailOpen => {
                let service = o.service.as_ref().unwrap();
                assert!(service.stats.precharged > 0);
                assert!(service.stats.debt_booked + service.stats.precharged >= o.admitted_by.fail_open);
                assert!(service.stats.repaid > 0);
            }
        }
    }
}

#[test]
fn the_first_request_of_a_new_key_is_admitted_on_every_node() {
    for r in runs() {
        let o = &r.outcome;
        assert_eq!(o.first_requests, o.nodes, "{}", line(o));
        assert_eq!(o.first_requests_denied, 0, "{}", line(o));
    }
    // A key appearing mid-run, on 100 nodes at once.
    let flash = outcomes(&["flash_crowd"]);
    assert!(flash.iter().all(|o| o.admitted_by.provisional > 0));
}

#[test]
fn a_partitioned_region_keeps_its_share_and_the_rest_stays_within_the_limit() {
    for o in outcomes(&["partition"]) {
        eprintln!("{}", line(o));
        assert!(o.admitted_by.fail_open_local > 0);
        assert!(o.max_admitted_in_window as f64 <= o.limit as f64 * 1.01 + o.burst as f64);
        assert!(o.utilisation_pct >= 95.0, "{}", line(o));
    }
}

#[test]
fn node_clock_offsets_change_nothing() {
    let spec = sim::scenario::named("outage").unwrap();
    let skewed = SimConfig::default();
    let exact = SimConfig {
        clock_skew_ns: 0,
        ..SimConfig::default()
    };
    let a = sim::run(&spec, Topology::SMALL, &skewed, 7).unwrap();
    let b = sim::run(&spec, Topology::SMALL, &exact, 7).unwrap();
    assert_eq!(a.admitted_per_s, b.admitted_per_s);
    assert_eq!(a.outcome.max_admitted_in_window, b.outcome.max_admitted_in_window);
    assert_eq!(a.outcome.bound.max_window, b.outcome.bound.max_window);
}

#[test]
fn runs_are_deterministic_per_seed() {
    let spec = sim::scenario::named("lossy").unwrap();
    let cfg = SimConfig::default();
    let json =
        |seed| serde_json::to_string(&sim::run(&spec, Topology::SMALL, &cfg, seed).unwrap().outcome).unwrap();
    assert_eq!(json(3), json(3));
    assert_ne!(json(3), json(4));
}

#[test]
fn the_chart_is_an_svg_of_the_run() {
    let svg = runs()[0].svg();
    assert!(svg.starts_with("<svg ") && svg.contains("uniform 3x3"));
}

/// 100/min (burst 100, `P` = 2), 1 s interval, 3 s leases: the plan
/// users run, as in `policies/global.yaml`.
fn per_minute(limit: u64, cost: u64, duration_s: u64) -> SimConfig {
    const S: u64 = 1_000_000_000;
    SimConfig {
        limit,
        window_ns: 60 * S,
        burst: limit,
        max_cost: cost,
        local_max_ns: 60 * S,
        duration_ns: duration_s * S,
        tick_ns: 100_000_000,
        ..SimConfig::default()
    }
}

fn users_line(o: &Outcome) -> String {
    format!(
        "{:<6} {:<16} L {:>3} max/window {:>4} (bound {:>4} = L+B {:>4} + {:>3}, S {}) min/window {:>4?} fairness {:?} over {} s",
        o.topology,
        o.scenario,
        o.limit,
        o.max_admitted_in_window,
        o.bound.max_window,
        o.limit + o.burst,
        o.bound.extra,
        o.key_starts_per_node,
        o.min_admitted_in_window,
        o.fairness_min,
        o.fairness_window_s
    )
}

/// Issue 7's scenarios at users' sizes, on the filter's code (the engine
/// and `sync::shared` over the fake host, two workers per node), the real
/// allocator and the protocol's JSON: every window within the restated bound; among the nodes of
/// one region with equal demand, Jain's index ≥ 0.95 over every window in
/// which each node's fair share is at least 10 units; ≥ 90 % utilisation
/// when demand exceeds the limit; a cost-5 route at ≥ 90 % of L/5.
#[test]
fn users_sizes_keep_the_bound_share_fairly_and_use_the_limit() {
    let topo = |regions, nodes_per_region| Topology {
        regions,
        nodes_per_region,
    };
    let mut jobs: Vec<(Topology, SimConfig, sim::Scenario)> = Vec::new();
    for spec in sim::scenario::users() {
        for (t, duration_s) in [
            (topo(1, 3), 240),
            (topo(3, 1), 240),
            (topo(3, 3), 240),
            (topo(10, 10), 660),
        ] {
            jobs.push((t, per_minute(100, 1, duration_s), spec.clone()));
        }
        // 6/min on 3 nodes.
        jobs.push((topo(1, 3), per_minute(6, 1, 240), spec.clone()));
    }
    let equal = sim::scenario::users().into_iter().next().unwrap();
    for t in [topo(1, 1), topo(1, 3), topo(3, 3)] {
        jobs.push((t, per_minute(100, 5, 240), equal.clone()));
        jobs.push((t, per_minute(100, 5, 240), sim::scenario::retrying(1.5)));
        jobs.push((t, per_minute(100, 5, 240), sim::scenario::retrying(0.5)));
    }
    let run = |(t, cfg, spec): &(Topology, SimConfig, sim::Scenario)| {
        // `SIM_SEED=N` explores another seed (the targets are asserted on seed 1).
        let seed = std::env::var("SIM_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(SEED);
        let r = sim::run(spec, *t, cfg, seed).unwrap();
        // Admitted after the first window (the full bucket's burst) per
        // window's worth of the limit.
        let after: u64 = r.admitted_per_s.iter().skip(60).sum();
        let windows = (r.admitted_per_s.len().saturating_sub(60)) as f64 / 60.0;
        let used_pct = 100.0 * after as f64 / (r.outcome.limit as f64 * windows);
        (cfg.max_cost, used_pct, r.outcome)
    };
    let (odd, even): (Vec<_>, Vec<_>) = std::thread::scope(|s| {
        let odd = s.spawn(|| jobs.iter().skip(1).step_by(2).map(run).collect::<Vec<_>>());
        let even = jobs.iter().step_by(2).map(run).collect::<Vec<_>>();
        (odd.join().unwrap(), even)
    });
    let mut failures = Vec::new();
    for (cost, used_pct, o) in even.into_iter().chain(odd) {
        let line = format!(
            "cost {cost} {} used after the first window {used_pct:.1}%, retries admitted {}/{}",
            users_line(&o),
            o.retries_admitted,
            o.retries
        );
        eprintln!("{line}");
        let mut check = |ok: bool, what: &str| {
            if !ok {
                failures.push(format!("{what}: {line}"));
            }
        };
        check(o.within_bound, "bound");
        if o.scenario == "retrying_under" {
            // Under the limit nobody else takes the capacity a `Retry-After`
            // promised: every client that waited that long gets in.
            check(
                o.retries > 0 && o.retries_admitted == o.retries,
                "Retry-After kept",
            );
            continue;
        }
        if o.scenario == "paced_adversary" {
            // Its demand is bursts, not a rate: only the bound (above,
            // L + B + N·P with one start per node) applies.
            continue;
        }
        check(used_pct >= 90.0, "utilisation");
        // Fairness is measured over windows in which each node's share is
        // at least 10 units; at cost 5 that is 2 requests, so the cost-5
        // runs are held to the same index over 10 requests' worth.
        if let (Some(j), 1) = (o.fairness_min, cost) {
            check(j >= 0.95, "fairness");
        }
        // The cost-5 route (one Envoy): every window at ≥ 90 % of
        // L/5 requests. On 3 and 9 nodes (0.56 and 0.19 units per node
        // and interval) the worst window is printed, at about 85 %.
        if cost > 1 && o.nodes == 1 {
            check(
                o.min_admitted_in_window.is_some_and(|m| m * 10 >= o.limit * 9),
                "cost-5 rate",
            );
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The key-spraying adversary on every node (5 new keys per second, so the
/// key table holds no idle slot): every window within the bound with the
/// measured key starts `S`, at 100/min on 3 and 9 nodes.
#[test]
fn a_key_spraying_adversary_stays_within_the_bound_with_its_measured_starts() {
    let spec = sim::scenario::spraying();
    for t in [
        Topology {
            regions: 1,
            nodes_per_region: 3,
        },
        Topology::SMALL,
    ] {
        let o = sim::run(&spec, t, &per_minute(100, 1, 180), SEED)
            .unwrap()
            .outcome;
        eprintln!(
            "{} sprayed {} by {:?}",
            users_line(&o),
            o.sprayed_keys,
            o.admitted_by
        );
        assert!(o.sprayed_keys > 0);
        assert!(o.within_bound, "{}", users_line(&o));
    }
}

/// Issue 21 at users' sizes (100/min and 10,000/min, burst = limit, on 3,
/// 10 and 100 nodes), on the filter's code:
/// * `outage_after_shift`: demand even, then 90 % on one node, then the
///   service down for 65 s while demand is even again. Over the outage's
///   minute, 3 nodes at 100/min admit ≥ 80 % of the limit, and every node
///   with demand ≥ 15 % of its equal share (with last shares a real run
///   admitted 0 and 55: the nodes whose demand rose had almost none);
/// * `cold_burst`: a new key asked for by every node at once (the burst
///   every second for 3 s): ≥ 90 % of min(B, demand) within two sync
///   intervals of the first request (44 of 100 in `make run`'s demo
///   before).
///
/// Every run stays within its bound.
#[test]
fn an_outage_after_a_shift_and_a_cold_burst_serve_the_tenant_within_the_bound() {
    let topo = |regions, nodes_per_region| Topology {
        regions,
        nodes_per_region,
    };
    let mut jobs: Vec<(Topology, SimConfig, sim::Scenario)> = Vec::new();
    for limit in [100, 10_000] {
        for t in [topo(1, 3), topo(2, 5), topo(10, 10)] {
            jobs.push((t, per_minute(limit, 1, 240), sim::scenario::outage_after_shift()));
            jobs.push((t, per_minute(limit, 1, 30), sim::scenario::cold_burst()));
        }
    }
    let run = |(t, cfg, spec): &(Topology, SimConfig, sim::Scenario)| {
        sim::run(spec, *t, cfg, SEED).unwrap().outcome
    };
    let (odd, even): (Vec<_>, Vec<_>) = std::thread::scope(|s| {
        let odd = s.spawn(|| jobs.iter().skip(1).step_by(2).map(run).collect::<Vec<_>>());
        let even = jobs.iter().step_by(2).map(run).collect::<Vec<_>>();
        (odd.join().unwrap(), even)
    });
    let mut failures = Vec::new();
    for o in even.into_iter().chain(odd) {
        let line = format!(
            "{} outage's minute {:?}% (least node {:?}% of its equal share), burst {:?}% by {:?}",
            users_line(&o),
            o.outage_window_pct,
            o.outage_node_min_pct,
            o.burst_pct,
            o.admitted_by
        );
        eprintln!("{line}");
        let mut check = |ok: bool, what: &str| {
            if !ok {
                failures.push(format!("{what}: {line}"));
            }
        };
        check(o.within_bound, "bound");
        if o.scenario == "outage_after_shift" && o.limit == 100 && o.nodes == 3 {
            check(o.outage_window_pct.is_some_and(|p| p >= 80.0), "outage's minute");
            check(o.outage_node_min_pct.is_some_and(|p| p >= 15.0), "every node");
        }
        if o.scenario == "cold_burst" {
            check(o.burst_pct.is_some_and(|p| p >= 90.0), "cold burst");
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Issue 24 on the filter's code (the engine's charge and `engine::settle`,
/// `sync::shared` over the fake host, the real allocator): the adversary
/// whose every answer costs the ceiling `C` against a low estimate `E`,
/// with streams of 2 to 20 s (many in flight), at 100/min (`E` 5, `C` 50)
/// and 10,000/min (`E` 10, `C` 100), each limit's `max_debt` its burst, on
/// 3 and 10 nodes: every window's real cost within THE BOUND plus
/// `M·(C − E) + N·D + W` (the most requests in flight at once, what nodes
/// may owe, what was written off), and the long-run rate held.
#[test]
fn late_settlement_the_adversary_at_the_ceiling_stays_within_the_restated_bound() {
    let topo = |regions, nodes_per_region| Topology {
        regions,
        nodes_per_region,
    };
    const S: u64 = 1_000_000_000;
    let mut jobs = Vec::new();
    for (limit, estimate, ceiling) in [(100, 5, 50), (10_000, 10, 100)] {
        for t in [topo(1, 3), topo(2, 5)] {
            let cfg = SimConfig {
                late: Some(sim::LateSettlement {
                    ceiling,
                    max_debt: limit,
                    stream_ns: (2 * S, 20 * S),
                }),
                ..per_minute(limit, estimate, 240)
            };
            jobs.push((t, cfg));
        }
    }
    let spec = sim::scenario::late_settlement();
    let run = |(t, cfg): &(Topology, SimConfig)| {
        let r = sim::run(&spec, *t, cfg, SEED).unwrap();
        // Real cost admitted after the first window, per window's worth of
        // the limit: the long-run rate.
        let after: u64 = r.admitted_per_s.iter().skip(60).sum();
        let windows = (r.admitted_per_s.len().saturating_sub(60)) as f64 / 60.0;
        (
            100.0 * after as f64 / (r.outcome.limit as f64 * windows),
            r.outcome,
        )
    };
    let (odd, even): (Vec<_>, Vec<_>) = std::thread::scope(|s| {
        let odd = s.spawn(|| jobs.iter().skip(1).step_by(2).map(run).collect::<Vec<_>>());
        let even = jobs.iter().step_by(2).map(run).collect::<Vec<_>>();
        (odd.join().unwrap(), even)
    });
    let mut failures = Vec::new();
    for (used_pct, o) in even.into_iter().chain(odd) {
        let late = o.late.clone().unwrap();
        let line = format!(
            "{} late: E {} C {} D {} M {} written off {} (max in a window {}) term {} bound {}; real cost after the first window {used_pct:.1}% of the limit",
            users_line(&o),
            late.estimate,
            late.ceiling,
            late.max_debt,
            late.max_in_flight,
            late.written_off,
            late.written_off_max_window,
            late.term,
            late.max_window
        );
        eprintln!("{line}");
        if !o.within_bound {
            failures.push(format!("bound: {line}"));
        }
        if late.max_in_flight < 5 {
            failures.push(format!("too few in flight to test anything: {line}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Issue 35: with 20 % of messages lost (20–300 ms latency), a report
/// unanswered within the callout timeout is retried at once, so a lost
/// message costs a node the timeout, not an interval of its leases; and a
/// node that did not acknowledge its last lease is leased half a share
/// more, to last through a retry's delay; and a report unanswered half
/// its callout timeout after it was sent is sent again, the same `seq`,
/// which the service answers again with the same lease (the node's hedge).
/// Measured, seed 1: 95.9 % (3×3) and 97.8 % (10×10); 91.2 % and 95.5 %
/// without the hedge; 90.5 % and 92.9 % with the retry alone; 81.1 % and
/// 82.2 % when a report was retried only an interval later.
#[test]
fn under_message_loss_a_lost_report_costs_the_timeout_not_an_interval() {
    for o in outcomes(&["lossy"]) {
        eprintln!("{} losses {:?}", line(o), o.losses);
        assert!(o.within_bound, "{}", line(o));
        assert!(o.utilisation_pct >= 95.0, "{}", line(o));
        assert!(o.losses.requests_lost > 0 && o.losses.answers_lost > 0);
        assert!(o.losses.drawn_answer_lost > 0 && o.losses.reserved_mean > 0);
    }
}

/// Issue 35: `lossy`'s two causes apart, seed 1 (the accounting in
/// docs/global-limits.md): its latency alone (99.7 % on 3×3) and its loss
/// alone at the base latency (97.6 %) each cost little; together, 91.2 %.
/// What is missing was never drawn from the bucket: nodes whose answer
/// came late or not at all drew it later or not at all, while `b + Σ R ≤
/// B` left the refill no room.
#[test]
fn lossy_s_latency_and_loss_each_cost_little_alone() {
    let cfg = SimConfig::default();
    for name in ["lossy_latency", "lossy_loss"] {
        let spec = sim::scenario::named(name).unwrap();
        let o = sim::run(&spec, Topology::SMALL, &cfg, SEED).unwrap().outcome;
        eprintln!("{} losses {:?}", line(&o), o.losses);
        assert!(o.within_bound, "{}", line(&o));
        assert!(o.utilisation_pct >= 97.0, "{}", line(&o));
    }
}

/// Issue 35: the overshoot table's generator (the doc's table is
/// `cargo run --release -p tenantgate-central --example overshoot`), on
/// two small cells: within the bound, and rendered.
#[test]
fn the_overshoot_table_stays_within_its_bound() {
    let cells = sim::overshoot::table(1_000, &[250], &[2, 3], 12, SEED).unwrap();
    assert_eq!(cells.len(), 2);
    for c in &cells {
        eprintln!("{c:?}");
        assert!(c.within_bound, "{c:?}");
        assert!(c.overshoot_pct <= c.bound_pct, "{c:?}");
    }
    let md = sim::overshoot::markdown(&cells);
    assert!(md.contains("| 250 ms | 500 |"), "{md}");
}
