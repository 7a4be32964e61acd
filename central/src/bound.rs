//! THE BOUND (see the `alloc` module header for its derivation) as a
//! function of its parameters.

use serde::Serialize;
use tenantgate::sync::FailureMode;

/// The formula, as printed beside measurements.
pub const FORMULA: &str = "L + B + N*S*P + X(T); X = 0 (fail_closed or T = 0), \
     r*I + N*c (fail_open_local), A*min(T + I + D, W) (fail_open)";

/// The parameters the bound depends on (times in nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BoundInputs {
    /// `L`: units per window.
    pub limit: u64,
    /// `W`.
    pub window_ns: u64,
    /// `B`.
    pub burst: u64,
    /// `I`: the sync interval.
    pub interval_ns: u64,
    /// `D`: the callout timeout.
    pub response_timeout_ns: u64,
    /// `P`: provisional allowance per node and key start.
    pub provisional: u64,
    /// Key starts per node within one window (1 when every node sees the
    /// key once).
    pub starts_per_node: u64,
    /// `N`.
    pub nodes: u64,
    /// `c`: the largest route cost (a local limit holds at least one
    /// request of it).
    pub max_cost: u64,
    /// `T`: central outage (0: none).
    pub outage_ns: u64,
    pub failure_mode: FailureMode,
    /// `A`: aggregate demand, units per window (only `fail_open` uses it).
    pub demand_per_window: u64,
}

/// The bound's terms, in units.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Bound {
    /// `L + B`: what a single token bucket allows in a window.
    pub bucket: u64,
    /// `N·P` (times key starts).
    pub provisional: u64,
    /// `X(T)`.
    pub outage: u64,
}

impl Bound {
    /// Units beyond `L + B`.
    pub fn extra(&self) -> u64 {
        self.provisional.saturating_add(self.outage)
    }

    /// The most any window may admit.
    pub fn max_window(&self) -> u64 {
        self.bucket.saturating_add(self.extra())
    }
}

fn scale(units_per_window: u64, ns: u64, window_ns: u64) -> u64 {
    let v = u128::from(units_per_window) * u128::from(ns);
    u64::try_from(v.div_ceil(u128::from(window_ns.max(1)))).unwrap_or(u64::MAX)
}

/// Evaluates the formula.
pub fn bound(b: &BoundInputs) -> Bound {
    let outage = if b.outage_ns == 0 {
        0
    } else {
        match b.failure_mode {
            FailureMode::FailClosed => 0,
            // Σ (a_i + c) ≤ r·I + N·c, rounded up.
            FailureMode::FailOpenLocal => scale(b.limit, b.interval_ns, b.window_ns)
                .saturating_add(b.nodes.saturating_mul(b.max_cost.max(1))),
            FailureMode::FailOpen => {
                let span = b
                    .outage_ns
                    .saturating_add(b.interval_ns)
                    .saturating_add(b.response_timeout_ns)
                    .min(b.window_ns);
                scale(b.demand_per_window, span, b.window_ns)
            }
        }
    };
    Bound {
        bucket: b.limit.saturating_add(b.burst),
        provisional: b
            .nodes
            .saturating_mul(b.provisional)
            .saturating_mul(b.starts_per_node),
        outage,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn inputs(mode: FailureMode, outage_ns: u64) -> BoundInputs {
        BoundInputs {
            limit: 10_000,
            window_ns: 10 * S,
            burst: 2_000,
            interval_ns: S,
            response_timeout_ns: S / 2,
            provisional: 2,
            starts_per_node: 1,
            nodes: 100,
            max_cost: 1,
            outage_ns,
            failure_mode: mode,
            demand_per_window: 15_000,
        }
    }

    #[test]
    fn the_terms_add_up() {
        let steady = bound(&inputs(FailureMode::FailOpenLocal, 0));
        assert_eq!(
            (steady.bucket, steady.provisional, steady.outage),
            (12_000, 200, 0)
        );
        assert_eq!(steady.max_window(), 12_200);
        // fail_open_local: one interval of the global rate, plus one
        // request's cost per node, whatever T.
        assert_eq!(bound(&inputs(FailureMode::FailOpenLocal, 30 * S)).outage, 1_100);
        assert_eq!(bound(&inputs(FailureMode::FailOpenLocal, 3 * S)).outage, 1_100);
        let costly = BoundInputs {
            max_cost: 5,
            ..inputs(FailureMode::FailOpenLocal, 3 * S)
        };
        assert_eq!(bound(&costly).outage, 1_500);
        assert_eq!(bound(&inputs(FailureMode::FailClosed, 30 * S)).outage, 0);
        // fail_open: all demand for T + I + D, at most a window of it.
        assert_eq!(bound(&inputs(FailureMode::FailOpen, 2 * S)).outage, 5_250);
        assert_eq!(bound(&inputs(FailureMode::FailOpen, 30 * S)).outage, 15_000);
    }
}
