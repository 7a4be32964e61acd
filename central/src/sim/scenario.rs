//! The traffic shapes and faults the simulator runs.

use tenantgate::sync::FailureMode;

/// How a tenant's demand is spread over regions and time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Shape {
    /// `level` × the global rate, evenly over every node.
    Uniform { level: f64 },
    /// `level` × the rate; `hot_pct` % of it in region 0, the rest evenly
    /// over the other regions.
    Skewed { level: f64, hot_pct: f64 },
    /// Like `Skewed`, but the hot region moves to the next one every
    /// `every_s` seconds.
    Shifting { level: f64, hot_pct: f64, every_s: f64 },
    /// Nothing until `at_s`, then `level` × the rate evenly (a key no node
    /// has seen before).
    Flash { at_s: f64, level: f64 },
    /// The adversarial client of issue 7 on every node: `requests` at
    /// once every `every_s` seconds, timed to arrive just after the
    /// node's last lease expired (`every_s` = TTL + 1.5 s), so that a node
    /// that re-granted its provisional allowance on every expiry would
    /// admit `P` more each time.
    Paced { every_s: f64, requests: u64 },
    /// Issue 21's outage after a shift: `level` × the rate, evenly on every
    /// node; from `shift_at_s` node 0 carries `hot_pct` % of it (the rest
    /// evenly on the other nodes); from `equal_at_s` evenly again.
    ShiftThenEqual {
        level: f64,
        hot_pct: f64,
        shift_at_s: f64,
        equal_at_s: f64,
    },
    /// A burst on a key no node has seen: nothing until `at_s`, then
    /// `level` × the rate evenly on every node for `for_s` seconds, then
    /// nothing.
    Burst { at_s: f64, level: f64, for_s: f64 },
}

/// One scenario: a shape, a network and faults.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    pub name: &'static str,
    pub about: &'static str,
    pub shape: Shape,
    pub failure_mode: FailureMode,
    /// The central cluster unreachable during `[from, to)` seconds.
    pub outage_s: Option<(f64, f64)>,
    /// Region 1 cut off from the central cluster during `[from, to)`.
    pub partition_s: Option<(f64, f64)>,
    /// Per message (request or response).
    pub loss: f64,
    pub latency_ms: (u64, u64),
    /// The key-spraying adversary: new keys (other tenants) per second and
    /// node, filling the key table so that idle slots are reclaimed.
    pub spray_per_s: f64,
    /// Clients that send a denied request again when its `Retry-After`
    /// says, up to this many times (0: clients that give up at once).
    pub retries: u32,
}

const BASE_LOSS: f64 = 0.01;
const BASE_LATENCY_MS: (u64, u64) = (10, 80);
const OUTAGE: (f64, f64) = (40.0, 70.0);

fn base(name: &'static str, about: &'static str, shape: Shape) -> Scenario {
    Scenario {
        name,
        about,
        shape,
        failure_mode: FailureMode::FailOpenLocal,
        outage_s: None,
        partition_s: None,
        loss: BASE_LOSS,
        latency_ms: BASE_LATENCY_MS,
        spray_per_s: 0.0,
        retries: 0,
    }
}

/// Every scenario, in table order.
pub fn all() -> Vec<Scenario> {
    let over = Shape::Uniform { level: 1.5 };
    let outage = |name, about, mode| Scenario {
        failure_mode: mode,
        outage_s: Some(OUTAGE),
        ..base(name, about, over)
    };
    vec![
        base("uniform", "1.5x the limit, even over all nodes", over),
        base(
            "skewed",
            "1.5x the limit, 80% of it in one region",
            Shape::Skewed {
                level: 1.5,
                hot_pct: 80.0,
            },
        ),
        base(
            "shifting",
            "1.5x the limit, 80% in one region, moving to the next every 20 s",
            Shape::Shifting {
                level: 1.5,
                hot_pct: 80.0,
                every_s: 20.0,
            },
        ),
        base(
            "flash_crowd",
            "a new key: nothing, then 4x the limit at once on every node at 20 s",
            Shape::Flash {
                at_s: 20.0,
                level: 4.0,
            },
        ),
        base(
            "under_limit",
            "0.6x the limit, even",
            Shape::Uniform { level: 0.6 },
        ),
        Scenario {
            loss: 0.2,
            latency_ms: (20, 300),
            ..base("lossy", "uniform, 20% of messages lost, 20-300 ms latency", over)
        },
        outage(
            "outage",
            "uniform; central cluster down 40-70 s (T = 30 s); fail_open_local",
            FailureMode::FailOpenLocal,
        ),
        outage(
            "outage_fail_closed",
            "the same outage with fail_closed",
            FailureMode::FailClosed,
        ),
        outage(
            "outage_fail_open",
            "the same outage with fail_open",
            FailureMode::FailOpen,
        ),
        Scenario {
            partition_s: Some(OUTAGE),
            ..base(
                "partition",
                "uniform; region 1 cut off from the central cluster 40-70 s",
                over,
            )
        },
    ]
}

/// The scenarios at the sizes users run (100/min, 6/min; see
/// `tests/sim.rs`, `users_sizes`): equal, skewed and shifting demand over
/// the limit, and the paced adversary.
pub fn users() -> Vec<Scenario> {
    vec![
        base(
            "equal",
            "1.5x the limit, evenly on every node",
            Shape::Uniform { level: 1.5 },
        ),
        base(
            "skewed",
            "1.5x the limit, 70% of it in region 0",
            Shape::Skewed {
                level: 1.5,
                hot_pct: 70.0,
            },
        ),
        base(
            "shifting",
            "1.5x the limit, 80% in one region, moving every 60 s",
            Shape::Shifting {
                level: 1.5,
                hot_pct: 80.0,
                every_s: 60.0,
            },
        ),
        base(
            "paced_adversary",
            "3 requests at once every 4.5 s on every node, just after each lease expired",
            Shape::Paced {
                every_s: 4.5,
                requests: 3,
            },
        ),
    ]
}

/// Clients that honour `Retry-After` (a denied request is sent again when
/// its `Retry-After` says, up to 3 times), at `level` times the limit,
/// evenly on every node: what real clients do, and the test of the promise
/// a `Retry-After` makes.
pub fn retrying(level: f64) -> Scenario {
    Scenario {
        retries: 3,
        ..base(
            if level < 1.0 {
                "retrying_under"
            } else {
                "retrying_over"
            },
            "evenly on every node; denied clients retry at Retry-After (3 times)",
            Shape::Uniform { level },
        )
    }
}

/// The key-spraying adversary (issue 7): on every node, 5 new keys per
/// second (other tenants, one request each) keep the key table full of
/// keys that are not idle, so the driven key, first asked for at 20 s at
/// 1.5x the limit, finds no slot to take or reclaim.
pub fn spraying() -> Scenario {
    Scenario {
        spray_per_s: 5.0,
        ..base(
            "spraying_adversary",
            "5 new keys per second on every node; the key at 1.5x the limit from 20 s",
            Shape::Flash {
                at_s: 20.0,
                level: 1.5,
            },
        )
    }
}

/// Issue 21's outage after a shift, at users' sizes (60 s windows): 1.5×
/// the limit evenly on every node for a minute, then 90 % of it on node 0
/// for a minute, then the central cluster is down for 65 s (120–185 s)
/// while demand is even again, then it is back.
pub fn outage_after_shift() -> Scenario {
    Scenario {
        outage_s: Some((120.0, 185.0)),
        ..base(
            "outage_after_shift",
            "1.5x the limit evenly, 90% on one node from 60 s, evenly again and the service down 120-185 s",
            Shape::ShiftThenEqual {
                level: 1.5,
                hot_pct: 90.0,
                shift_at_s: 60.0,
                equal_at_s: 120.0,
            },
        )
    }
}

/// Issue 24's adversary (run with [`crate::sim::SimConfig::late`]): 1.5×
/// the limit in estimates evenly on every node, every answer at the
/// ceiling, streams long enough that many are in flight at once.
pub fn late_settlement() -> Scenario {
    base(
        "late_settlement_adversary",
        "1.5x the limit in estimates, evenly; every real cost at the ceiling, settled when its stream ends",
        Shape::Uniform { level: 1.5 },
    )
}

/// Issue 21's burst from cold: a key no node has seen, asked for at 10 s
/// by every node at once, 60 × the rate for 3 s: the burst `B` every
/// second when `B` is the limit per minute (`make run`'s demo loop: 300
/// requests in about 3 s on a burst of 100).
pub fn cold_burst() -> Scenario {
    base(
        "cold_burst",
        "a new key: nothing, then 60x the rate (B per second when B = L per minute) evenly for 3 s at 10 s",
        Shape::Burst {
            at_s: 10.0,
            level: 60.0,
            for_s: 3.0,
        },
    )
}

/// The scenario called `name`.
pub fn named(name: &str) -> Option<Scenario> {
    all().into_iter().chain(lossy_parts()).find(|s| s.name == name)
}

/// `lossy`'s two causes apart (issue 35), by name only (not in the
/// table): its latency with no loss, and its loss at the base latency.
pub fn lossy_parts() -> Vec<Scenario> {
    let over = Shape::Uniform { level: 1.5 };
    vec![
        Scenario {
            loss: 0.0,
            latency_ms: (20, 300),
            ..base("lossy_latency", "uniform, no loss, 20-300 ms latency", over)
        },
        Scenario {
            loss: 0.2,
            ..base(
                "lossy_loss",
                "uniform, 20% of messages lost, 10-80 ms latency",
                over,
            )
        },
    ]
}

impl Scenario {
    /// Demand of one region at `t_s`, as a multiple of the global rate.
    pub fn region_level(&self, region: usize, regions: usize, t_s: f64) -> f64 {
        let share_hot = |level: f64, hot_pct: f64, hot: usize| {
            if regions == 1 {
                level
            } else if region == hot {
                level * hot_pct / 100.0
            } else {
                level * (100.0 - hot_pct) / 100.0 / (regions - 1) as f64
            }
        };
        match self.shape {
            Shape::Uniform { level } => level / regions as f64,
            Shape::Skewed { level, hot_pct } => share_hot(level, hot_pct, 0),
            Shape::Shifting {
                level,
                hot_pct,
                every_s,
            } => share_hot(level, hot_pct, (t_s / every_s) as usize % regions),
            Shape::Flash { at_s, level } => {
                if t_s < at_s {
                    0.0
                } else {
                    level / regions as f64
                }
            }
            // Bursts, not a rate: see [`Scenario::burst`].
            Shape::Paced { .. } => 0.0,
            Shape::ShiftThenEqual { level, .. } => level / regions as f64,
            Shape::Burst { at_s, level, for_s } => {
                if t_s >= at_s && t_s < at_s + for_s {
                    level / regions as f64
                } else {
                    0.0
                }
            }
        }
    }

    /// Demand of node `node` (of `regions × nodes_per_region`, region-major)
    /// at `t_s`, as a multiple of the global rate.
    pub fn node_level(&self, node: usize, regions: usize, nodes_per_region: usize, t_s: f64) -> f64 {
        let nodes = (regions * nodes_per_region).max(1);
        match self.shape {
            Shape::ShiftThenEqual {
                level,
                hot_pct,
                shift_at_s,
                equal_at_s,
            } if t_s >= shift_at_s && t_s < equal_at_s && nodes > 1 => {
                if node == 0 {
                    level * hot_pct / 100.0
                } else {
                    level * (100.0 - hot_pct) / 100.0 / (nodes - 1) as f64
                }
            }
            _ => {
                self.region_level(node / nodes_per_region.max(1), regions, t_s)
                    / nodes_per_region.max(1) as f64
            }
        }
    }

    /// Requests every node sends at once in the tick `[t_s, t_s + tick_s)`
    /// (the `Paced` shape), besides its rate.
    pub fn burst(&self, t_s: f64, tick_s: f64) -> u64 {
        match self.shape {
            Shape::Paced { every_s, requests } => {
                let k = (t_s / every_s).ceil();
                if k * every_s < t_s + tick_s - 1e-9 {
                    requests
                } else {
                    0
                }
            }
            _ => 0,
        }
    }

    /// Instants (seconds) after which demand or connectivity changes: where
    /// convergence is measured from.
    pub fn changes(&self, duration_s: f64) -> Vec<f64> {
        let mut at = vec![0.0];
        match self.shape {
            Shape::Shifting { every_s, .. } => {
                let mut t = every_s;
                while t < duration_s {
                    at.push(t);
                    t += every_s;
                }
            }
            Shape::Flash { at_s, .. } | Shape::Burst { at_s, .. } => at = vec![at_s],
            Shape::ShiftThenEqual {
                shift_at_s,
                equal_at_s,
                ..
            } => at.extend([shift_at_s, equal_at_s]),
            _ => {}
        }
        for (_, to) in self.outage_s.iter().chain(&self.partition_s) {
            at.push(*to);
        }
        at
    }

    /// Peak aggregate demand, as a multiple of the global rate.
    pub fn peak_level(&self) -> f64 {
        match self.shape {
            Shape::Uniform { level }
            | Shape::Skewed { level, .. }
            | Shape::Shifting { level, .. }
            | Shape::Flash { level, .. }
            | Shape::ShiftThenEqual { level, .. }
            | Shape::Burst { level, .. } => level,
            Shape::Paced { .. } => 0.0,
        }
    }

    /// The central outage's length `T`, seconds (0: none).
    pub fn outage_len_s(&self) -> f64 {
        self.outage_s.map_or(0.0, |(from, to)| to - from)
    }

    /// Whether `region` can reach the central cluster at `t_s`.
    pub fn link_up(&self, region: usize, t_s: f64) -> bool {
        let within = |w: Option<(f64, f64)>| w.is_some_and(|(from, to)| t_s >= from && t_s < to);
        !(within(self.outage_s) || (region == 1 && within(self.partition_s)))
    }

    /// Whether the central cluster runs at `t_s`.
    pub fn service_up(&self, t_s: f64) -> bool {
        !self.outage_s.is_some_and(|(from, to)| t_s >= from && t_s < to)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_and_node_levels_add_up_to_the_shapes_level() {
        let mut specs = all();
        specs.extend([outage_after_shift(), cold_burst()]);
        for s in specs {
            for regions in [1, 3, 10] {
                let t = if s.name == "cold_burst" { 11.0 } else { 50.0 };
                let total: f64 = (0..regions).map(|r| s.region_level(r, regions, t)).sum();
                assert!((total - s.peak_level()).abs() < 1e-9, "{} {regions}", s.name);
                for per in [1, 3] {
                    for t in [t, 90.0] {
                        let nodes: f64 = (0..regions * per).map(|n| s.node_level(n, regions, per, t)).sum();
                        let want: f64 = (0..regions).map(|r| s.region_level(r, regions, t)).sum();
                        assert!((nodes - want).abs() < 1e-9, "{} {regions}x{per} at {t}", s.name);
                    }
                }
            }
        }
        // The shift puts 90 % on node 0.
        let shift = outage_after_shift();
        assert!((shift.node_level(0, 1, 3, 90.0) - 1.35).abs() < 1e-9);
        assert!((shift.node_level(2, 1, 3, 130.0) - 0.5).abs() < 1e-9);
    }

    #[test]
    fn names_are_unique_and_found() {
        let all = all();
        for s in &all {
            assert_eq!(named(s.name).as_ref(), Some(s));
        }
        assert_eq!(all.len(), 10);
    }
}
