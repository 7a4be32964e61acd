//! The overshoot table peers publish (issue 35): the most a window admits
//! above the limit, in percent, against the sync interval and the number
//! of nodes, at a stated rate, beside THE BOUND of each cell.
//!
//! Each cell is one [`super::run`] of the `uniform` scenario (demand 1.5×
//! the limit, spread over the nodes), one region of `nodes` nodes, with
//! the rate at `rate_per_s` (a 10-s window: `L = 10 × rate`), the sync
//! interval `I`, the lease TTL `3·I`, the callout timeout `D = I/2`, the
//! burst `B = 2·r·I` (so that every node's lease, 1.5 shares, fits in
//! the bucket), `P` = 2, and in-cluster messages (1–10 ms, 1 % lost).
//! Overshoot is `(max in any window − L) ÷ L`; the bound's is
//! `(B + N·S·P) ÷ L` (no outage: `X = 0`). Printed by
//! `cargo run --release -p tenantgate-central --example overshoot`.

use serde::Serialize;

use super::{run, scenario, SimConfig, Topology};
use crate::error::ConfigError;

const NANOS_PER_MS: u64 = 1_000_000;
const NANOS_PER_SEC: u64 = 1_000_000_000;

/// One cell: a sync interval and a number of nodes.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    pub interval_ms: u64,
    pub nodes: usize,
    /// `L`, units per 10 s, and `B`.
    pub limit: u64,
    pub burst: u64,
    pub max_admitted_in_window: u64,
    /// `(max − L) ÷ L`, %.
    pub overshoot_pct: f64,
    /// The bound's `(max_window − L) ÷ L`, %.
    pub bound_pct: f64,
    pub within_bound: bool,
    pub utilisation_pct: f64,
}

/// The configuration of one cell (see the module header).
pub fn config(rate_per_s: u64, interval_ms: u64, duration_s: u64) -> SimConfig {
    let interval_ns = interval_ms.max(1) * NANOS_PER_MS;
    // A tick divides the window and one second, at most a tenth of the
    // interval (a message takes at least a tick each way).
    let tick_ns = [50, 25, 10, 5, 1]
        .into_iter()
        .map(|ms| ms * NANOS_PER_MS)
        .find(|t| t.saturating_mul(10) <= interval_ns)
        .unwrap_or(NANOS_PER_MS);
    SimConfig {
        limit: rate_per_s.saturating_mul(10),
        window_ns: 10 * NANOS_PER_SEC,
        burst: (2 * rate_per_s * interval_ms).div_ceil(1_000).max(1),
        interval_ns,
        lease_ttl_ns: 3 * interval_ns,
        response_timeout_ns: interval_ns / 2,
        duration_ns: duration_s * NANOS_PER_SEC,
        tick_ns,
        ..SimConfig::default()
    }
}

/// Every cell of `intervals_ms` × `nodes`, row by row.
pub fn table(
    rate_per_s: u64,
    intervals_ms: &[u64],
    nodes: &[usize],
    duration_s: u64,
    seed: u64,
) -> Result<Vec<Cell>, ConfigError> {
    let mut spec = scenario::named("uniform").ok_or_else(|| ConfigError::new("scenario", "no uniform"))?;
    spec.latency_ms = (1, 10);
    let mut cells = Vec::new();
    for &interval_ms in intervals_ms {
        for &n in nodes {
            let cfg = config(rate_per_s, interval_ms, duration_s);
            let topo = Topology {
                regions: 1,
                nodes_per_region: n,
            };
            let o = run(&spec, topo, &cfg, seed)?.outcome;
            let l = cfg.limit as f64;
            let pct = |v: f64| (v * 1_000.0).round() / 10.0;
            cells.push(Cell {
                interval_ms,
                nodes: n,
                limit: cfg.limit,
                burst: cfg.burst,
                max_admitted_in_window: o.max_admitted_in_window,
                overshoot_pct: pct((o.max_admitted_in_window as f64 - l) / l),
                bound_pct: pct((o.bound.max_window as f64 - l) / l),
                within_bound: o.within_bound,
                utilisation_pct: o.utilisation_pct,
            });
        }
    }
    Ok(cells)
}

/// The table in Markdown: one row per interval, one column per number of
/// nodes, each cell "measured % (bound %)".
pub fn markdown(cells: &[Cell]) -> String {
    let mut nodes: Vec<usize> = cells.iter().map(|c| c.nodes).collect();
    nodes.dedup();
    nodes.sort_unstable();
    nodes.dedup();
    let mut intervals: Vec<u64> = cells.iter().map(|c| c.interval_ms).collect();
    intervals.dedup();
    let mut out = String::from("| sync interval | B |");
    for n in &nodes {
        out.push_str(&format!(" {n} nodes |"));
    }
    out.push_str("\n|---:|---:|");
    out.push_str(&"---:|".repeat(nodes.len()));
    out.push('\n');
    for i in intervals {
        let burst = cells.iter().find(|c| c.interval_ms == i).map_or(0, |c| c.burst);
        out.push_str(&format!("| {i} ms | {burst} |"));
        for n in &nodes {
            match cells.iter().find(|c| c.interval_ms == i && c.nodes == *n) {
                Some(c) => out.push_str(&format!(" {:+.1} % ({:+.1} %) |", c.overshoot_pct, c.bound_pct)),
                None => out.push_str(" — |"),
            }
        }
        out.push('\n');
    }
    out
}
