//! A deterministic simulator of allowance reconciliation.
//!
//! Virtual time advances in fixed ticks (50 ms by default); a seeded PRNG
//! with one stream per purpose (network, traffic, clocks, sync phases)
//! drives everything; there are no threads and no sleeps, so a run is a
//! pure function of (scenario, topology, configuration, seed).
//!
//! It runs the code the filter ships ([`shipped`]: every request goes
//! through the engine's charge path, every tick through `sync::shared`'s
//! claim, scan and apply, over the in-memory host with two workers per node)
//! and the **real** [`Allocator`], and the sync messages travel as the
//! protocol's JSON with configurable latency and loss. A worker ticks
//! every tick; the shared state says when a report is due (every
//! interval) and gives up on one unanswered for an interval. Each node's clock is offset by up to `clock_skew_ns`
//! either way (it must not change anything: only differences of a node's
//! own clock are used). During a central outage every message to or from
//! the service is lost and the service does not run; in a partition only
//! region 1's messages are lost.
//!
//! Per run it reports (see [`Outcome`]) the most admitted in any window,
//! the overrun against `L + B`, utilisation against `min(demand, limit)`,
//! the time to converge after each change, and THE BOUND's value beside
//! the measured overrun.
//!
//! With [`SimConfig::late`], the route's cost is known only after the
//! response (`tenantgate::cost`): each request is charged its estimate `E`
//! when admitted, its stream lasts a random time, and its real cost `C` (the
//! ceiling: the adversary) is settled at its end through the filter's own
//! `engine::settle`. Admissions are counted at their real cost, and the
//! bound gains the late-settlement term ([`LateReport`]).
//!
//! [`Allocator`]: crate::alloc::Allocator

mod metrics;
pub mod nested;
pub mod overshoot;
mod rng;
pub mod scenario;
pub mod shipped;
mod svg;
mod world;

use serde::Serialize;
use tenantgate::sync::FailureMode;

use crate::alloc::{tuning, KeyView};
use crate::bound::{bound, Bound, BoundInputs, FORMULA};
use crate::error::ConfigError;
pub use scenario::Scenario;
pub use world::{ByKind, Losses};

/// The limit every scenario drives (on the key [`shipped::KEY`]).
pub const LIMIT: &str = "per-10s";

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// Regions × nodes per region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    pub regions: usize,
    pub nodes_per_region: usize,
}

impl Topology {
    /// 3 regions × 3 nodes.
    pub const SMALL: Topology = Topology {
        regions: 3,
        nodes_per_region: 3,
    };
    /// 10 regions × 10 nodes.
    pub const LARGE: Topology = Topology {
        regions: 10,
        nodes_per_region: 10,
    };

    pub fn name(&self) -> String {
        format!("{}x{}", self.regions, self.nodes_per_region)
    }

    pub fn nodes(&self) -> u64 {
        (self.regions * self.nodes_per_region) as u64
    }
}

/// The limit, the sync settings and the run's length (times in ns).
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// `L` units per `window_ns`, burst `B`.
    pub limit: u64,
    pub window_ns: u64,
    pub burst: u64,
    pub interval_ns: u64,
    pub lease_ttl_ns: u64,
    pub response_timeout_ns: u64,
    pub provisional: u64,
    /// Every request's cost (the policy's largest route cost).
    pub max_cost: u64,
    pub lease_factor_pct: u64,
    pub node_floor: u64,
    pub region_floor: u64,
    pub borrow_ceiling_pct: u64,
    pub repay_pct: u64,
    pub settle_ns: u64,
    pub local_max_ns: u64,
    pub duration_ns: u64,
    pub tick_ns: u64,
    /// Node clocks are offset uniformly within ± this.
    pub clock_skew_ns: u64,
    /// The filter's key table: `key_table.max_keys`.
    pub max_keys: u64,
    /// Costs settled after the response (`None`: every cost is known on
    /// the request).
    pub late: Option<LateSettlement>,
}

/// A route whose cost is known only after the response: `max_cost` is its
/// estimate `E`, charged on the request; every answer really costs
/// `ceiling` (`C`, the adversary's), settled when its stream ends, a
/// uniform `stream_ns` range after it was admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LateSettlement {
    pub ceiling: u64,
    /// The global limit's `max_debt` (units a node may owe per key).
    pub max_debt: u64,
    pub stream_ns: (u64, u64),
}

impl Default for SimConfig {
    fn default() -> SimConfig {
        SimConfig {
            limit: 10_000,
            window_ns: 10 * NANOS_PER_SEC,
            burst: 2_000,
            interval_ns: tuning::INTERVAL_NS,
            lease_ttl_ns: tuning::LEASE_TTL_NS,
            response_timeout_ns: tuning::RESPONSE_TIMEOUT_NS,
            provisional: 2,
            max_cost: 1,
            lease_factor_pct: tuning::LEASE_FACTOR_PCT,
            node_floor: tuning::NODE_FLOOR,
            region_floor: tuning::REGION_FLOOR,
            borrow_ceiling_pct: tuning::BORROW_CEILING_PCT,
            repay_pct: tuning::REPAY_PCT,
            settle_ns: tuning::SETTLE_NS,
            local_max_ns: 300 * NANOS_PER_SEC,
            duration_ns: 120 * NANOS_PER_SEC,
            tick_ns: 50_000_000,
            clock_skew_ns: 2 * NANOS_PER_SEC,
            max_keys: 64,
            late: None,
        }
    }
}

/// The bound beside the measurement.
#[derive(Debug, Clone, Serialize)]
pub struct BoundReport {
    pub formula: &'static str,
    #[serde(flatten)]
    pub terms: Bound,
    /// `L + B + extra`: the most a window may admit.
    pub max_window: u64,
    /// Units allowed beyond `L + B`.
    pub extra: u64,
}

/// Late settlement's term of the bound, beside what was measured: with `M`
/// requests in flight at once (over all nodes, at most), each settling at
/// most `C − E` after its window, `N` nodes each owing at most `D` per
/// key, and `W` units written off in a window, a window admits at most
/// THE BOUND's `max_window` + `M·(C − E) + N·D + W` in real cost (see the
/// filter's `cost` module and `sync::node`, "Costs settled after the
/// response").
#[derive(Debug, Clone, Serialize)]
pub struct LateReport {
    pub estimate: u64,
    pub ceiling: u64,
    pub max_debt: u64,
    /// `M`: the most requests in flight at once, over all nodes.
    pub max_in_flight: u64,
    /// Units written off over the run, and the most in any window (`W`).
    pub written_off: u64,
    pub written_off_max_window: u64,
    /// `M·(C − E) + N·D + W`.
    pub term: u64,
    /// THE BOUND's `max_window` plus the term.
    pub max_window: u64,
}

/// One scenario's result: one JSON object.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub scenario: &'static str,
    pub topology: String,
    pub nodes: u64,
    pub seed: u64,
    pub failure_mode: FailureMode,
    /// `L`, per window of `window_s`, burst `B`.
    pub limit: u64,
    pub window_s: f64,
    pub burst: u64,
    pub outage_s: f64,
    pub loss_pct: f64,
    pub clock_skew_s: f64,
    /// The most admitted in any window of `window_s` (one tick: 50 ms by default).
    pub max_admitted_in_window: u64,
    /// `max_admitted_in_window − (L + B)`: negative is headroom.
    pub measured_extra: i64,
    /// `measured_extra ÷ (L + B)`, %.
    pub overrun_pct: f64,
    pub bound: BoundReport,
    pub within_bound: bool,
    /// Admitted ÷ Σ per second of min(demand, limit), %.
    pub utilisation_pct: f64,
    /// Seconds from the worst change (start, shift, flash, outage or
    /// partition end) until admissions (3 s average) stay within 5% of
    /// min(demand, limit) for 5 s; `null` if that never happened.
    pub converge_s: Option<f64>,
    pub first_requests: u64,
    pub first_requests_denied: u64,
    /// `S` as measured: the most key starts of the driven key on one node
    /// within one window (the bound uses it, at least 1).
    pub key_starts_per_node: u64,
    /// Keys the key-spraying adversary sent, over all nodes.
    pub sprayed_keys: u64,
    /// Retrying clients: requests sent again at their `Retry-After`, and
    /// how many of those were admitted.
    pub retries: u64,
    pub retries_admitted: u64,
    pub admitted: u64,
    pub demand: u64,
    pub admitted_by: ByKind,
    pub messages_sent: u64,
    pub messages_lost: u64,
    pub service: Option<KeyView>,
    /// The fewest units admitted in any window of `window_s` after the
    /// first one (the first holds the full bucket's burst).
    pub min_admitted_in_window: Option<u64>,
    /// Windows over which fairness is measured: the shortest multiple of
    /// `window_s` in which every node's fair share (`r·w/N`) is at least
    /// 10 units.
    pub fairness_window_s: f64,
    /// The lowest Jain's index of admissions among the nodes of a region
    /// over those windows (after the first `window_s`); `null` if no
    /// region of two nodes or more admitted 10 units per node in one.
    pub fairness_min: Option<f64>,
    /// Issue 21, for a run with an outage: the units admitted over the
    /// outage's first window (at most its length), % of the limit over
    /// that time.
    pub outage_window_pct: Option<f64>,
    /// The least, among the nodes with demand over that window, of what a
    /// node admitted ÷ its equal share of the limit over it, %.
    pub outage_node_min_pct: Option<f64>,
    /// Issue 21, for a burst from cold: the units admitted within two sync
    /// intervals of the key's first request ÷ min(B, demand then), %.
    pub burst_pct: Option<f64>,
    /// Issue 24, costs settled after the response ([`SimConfig::late`]).
    pub late: Option<LateReport>,
    /// Issue 35: where use is lost to lost messages.
    pub losses: Losses,
}

/// A finished run: its outcome and per-second series.
#[derive(Debug, Clone)]
pub struct Run {
    pub outcome: Outcome,
    pub admitted_per_s: Vec<u64>,
    pub demand_per_s: Vec<u64>,
    pub rate_per_s: f64,
}

impl Run {
    /// An SVG chart of admitted vs demand vs the limit over time.
    pub fn svg(&self) -> String {
        let o = &self.outcome;
        let title = format!(
            "{} {}: max {} in any {} s window (L+B = {}, bound {})",
            o.scenario,
            o.topology,
            o.max_admitted_in_window,
            o.window_s,
            o.limit + o.burst,
            o.bound.max_window
        );
        svg::chart(&title, &self.admitted_per_s, &self.demand_per_s, self.rate_per_s)
    }
}

/// Every scenario.
pub fn scenarios() -> Vec<Scenario> {
    scenario::all()
}

/// Runs one scenario.
pub fn run(spec: &Scenario, topo: Topology, cfg: &SimConfig, seed: u64) -> Result<Run, ConfigError> {
    if cfg.window_ns % cfg.tick_ns.max(1) != 0 || NANOS_PER_SEC % cfg.tick_ns.max(1) != 0 {
        return Err(ConfigError::new(
            "tick_ns",
            "must divide the window and one second",
        ));
    }
    let trace = world::simulate(spec, topo, cfg, seed)?;
    let secs = |ns: u64| ns as f64 / NANOS_PER_SEC as f64;
    let rate_per_s = cfg.limit as f64 / secs(cfg.window_ns);
    let ticks_per_s = (NANOS_PER_SEC / cfg.tick_ns) as usize;
    let max = metrics::max_window(&trace.admitted, (cfg.window_ns / cfg.tick_ns) as usize);
    let admitted_per_s = metrics::group(&trace.admitted, ticks_per_s);
    let demand_per_s = metrics::group(&trace.demand, ticks_per_s);
    let terms = bound_terms(spec, topo, cfg, &trace);
    let allowed = cfg.limit + cfg.burst;
    let measured_extra = max as i64 - allowed as i64;
    let late = cfg.late.map(|l| late_report(l, cfg, topo, &trace, &terms));
    let max_window = late.as_ref().map_or(terms.max_window(), |l| l.max_window);
    let window_ticks = (cfg.window_ns / cfg.tick_ns) as usize;
    let min_window = metrics::min_window(&trace.admitted, window_ticks, window_ticks);
    let fairness = fairness(&trace, topo, cfg);
    let (outage_window_pct, outage_node_min_pct) = match spec.outage_s {
        Some((from, to)) => outage_window(&trace, cfg, from, to),
        None => (None, None),
    };
    let burst_pct = matches!(spec.shape, scenario::Shape::Burst { .. })
        .then(|| burst_admitted(&trace, cfg))
        .flatten();
    let outcome = Outcome {
        scenario: spec.name,
        topology: topo.name(),
        nodes: topo.nodes(),
        seed,
        failure_mode: spec.failure_mode,
        limit: cfg.limit,
        window_s: secs(cfg.window_ns),
        burst: cfg.burst,
        outage_s: spec.outage_len_s(),
        loss_pct: spec.loss * 100.0,
        clock_skew_s: secs(cfg.clock_skew_ns),
        max_admitted_in_window: max,
        measured_extra,
        overrun_pct: round2(100.0 * measured_extra as f64 / allowed as f64),
        bound: BoundReport {
            formula: FORMULA,
            terms,
            max_window: terms.max_window(),
            extra: terms.extra(),
        },
        within_bound: max <= max_window,
        utilisation_pct: round2(metrics::utilisation(&admitted_per_s, &demand_per_s, rate_per_s)),
        converge_s: metrics::converge(
            &admitted_per_s,
            &demand_per_s,
            rate_per_s,
            &spec.changes(secs(cfg.duration_ns)),
            0.05,
            (3, 5),
        ),
        first_requests: trace.first_requests,
        first_requests_denied: trace.first_denied,
        key_starts_per_node: trace.max_starts,
        sprayed_keys: trace.sprayed,
        retries: trace.retries,
        retries_admitted: trace.retries_admitted,
        admitted: trace.admitted.iter().sum(),
        demand: trace.demand.iter().sum(),
        admitted_by: trace.by_kind,
        messages_sent: trace.messages_sent,
        messages_lost: trace.messages_lost,
        service: trace.service,
        min_admitted_in_window: min_window,
        fairness_window_s: secs(cfg.window_ns) * fairness.windows as f64,
        fairness_min: fairness.min.map(|j| (j * 1000.0).floor() / 1000.0),
        outage_window_pct,
        outage_node_min_pct,
        burst_pct,
        late,
        losses: trace.losses,
    };
    Ok(Run {
        outcome,
        admitted_per_s,
        demand_per_s,
        rate_per_s,
    })
}

/// THE BOUND's terms for a run of `spec` on `topo` (its key starts per
/// node as the run measured them, at least one).
fn bound_terms(spec: &Scenario, topo: Topology, cfg: &SimConfig, trace: &world::Trace) -> Bound {
    bound(&BoundInputs {
        limit: cfg.limit,
        window_ns: cfg.window_ns,
        burst: cfg.burst,
        interval_ns: cfg.interval_ns,
        response_timeout_ns: cfg.response_timeout_ns,
        provisional: cfg.provisional,
        starts_per_node: trace.max_starts.max(1),
        nodes: topo.nodes(),
        max_cost: cfg.max_cost,
        outage_ns: (spec.outage_len_s() * NANOS_PER_SEC as f64) as u64,
        failure_mode: spec.failure_mode,
        demand_per_window: (spec.peak_level() * cfg.limit as f64).ceil() as u64,
    })
}

/// What costs settled after the response added to a run (`late`), and the
/// bound with their term.
fn late_report(
    late: LateSettlement,
    cfg: &SimConfig,
    topo: Topology,
    trace: &world::Trace,
    terms: &Bound,
) -> LateReport {
    let written_off_max_window =
        metrics::max_window(&trace.written_off, (cfg.window_ns / cfg.tick_ns) as usize);
    let term = trace
        .max_in_flight
        .saturating_mul(late.ceiling.saturating_sub(cfg.max_cost))
        .saturating_add(topo.nodes().saturating_mul(late.max_debt))
        .saturating_add(written_off_max_window);
    LateReport {
        estimate: cfg.max_cost,
        ceiling: late.ceiling,
        max_debt: late.max_debt,
        max_in_flight: trace.max_in_flight,
        written_off: trace.written_off.iter().sum(),
        written_off_max_window,
        term,
        max_window: terms.max_window().saturating_add(term),
    }
}

/// Fairness over a span of whole windows: how many, and the least
/// fairness measured over any such span.
struct Fairness {
    windows: u64,
    min: Option<f64>,
}

fn fairness(trace: &world::Trace, topo: Topology, cfg: &SimConfig) -> Fairness {
    let window_ticks = (cfg.window_ns / cfg.tick_ns) as usize;
    // r·w/N ≥ 10 units: w ≥ 10·N·W/L, rounded up to whole windows.
    let windows = (10 * topo.nodes()).div_ceil(cfg.limit.max(1)).max(1);
    let fairness_ticks = window_ticks * windows as usize;
    let min = metrics::min_fairness(
        &trace.admitted_by_node,
        &trace.regions,
        fairness_ticks,
        window_ticks,
        10.0,
    );
    Fairness { windows, min }
}

/// Over the outage `[from_s, to_s)`'s first window (at most its length):
/// admitted ÷ the limit's flow over it, and the least, among nodes with
/// demand then, of a node's admissions ÷ its equal share, both %.
fn outage_window(
    trace: &world::Trace,
    cfg: &SimConfig,
    from_s: f64,
    to_s: f64,
) -> (Option<f64>, Option<f64>) {
    let tick_s = cfg.tick_ns as f64 / NANOS_PER_SEC as f64;
    let start = (from_s / tick_s).round() as usize;
    let span = ((to_s - from_s).min(cfg.window_ns as f64 / NANOS_PER_SEC as f64) / tick_s).round() as usize;
    let end = start.saturating_add(span).min(trace.admitted.len());
    if end <= start {
        return (None, None);
    }
    let flow =
        cfg.limit as f64 * ((end - start) as f64 * tick_s) * NANOS_PER_SEC as f64 / cfg.window_ns as f64;
    let sum = |v: &[u64]| v.get(start..end).map_or(0, |s| s.iter().sum::<u64>());
    let total = sum(&trace.admitted);
    let nodes = trace.admitted_by_node.len().max(1) as f64;
    let least = trace
        .admitted_by_node
        .iter()
        .zip(&trace.demand_by_node)
        .filter(|(_, d)| sum(d) > 0)
        .map(|(a, _)| 100.0 * sum(a) as f64 / (flow / nodes))
        .reduce(f64::min);
    (Some(round2(100.0 * total as f64 / flow)), least.map(round2))
}

/// Units admitted within two sync intervals of the first request (over
/// all nodes) ÷ min(B, demand then), %.
fn burst_admitted(trace: &world::Trace, cfg: &SimConfig) -> Option<f64> {
    let first = trace.demand.iter().position(|&d| d > 0)?;
    let span = (2 * cfg.interval_ns / cfg.tick_ns.max(1)) as usize;
    let end = first.saturating_add(span).min(trace.admitted.len());
    let admitted: u64 = trace.admitted.get(first..end)?.iter().sum();
    let demand: u64 = trace.demand.get(first..end)?.iter().sum();
    let of = demand.min(cfg.burst).max(1);
    Some(round2(100.0 * admitted as f64 / of as f64))
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
