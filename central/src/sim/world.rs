//! The simulation loop: virtual time in fixed ticks, nodes running the real
//! `tenantgate::sync::Node`, the real [`Allocator`], and JSON messages
//! carried with latency and loss. One thread, no sleeps.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use tenantgate::sync::{Admitted, FailureMode, Node, NodeConfig, SyncResponse};

use super::rng::Rng;
use super::scenario::Scenario;
use super::shipped::{self, ShippedNode};
use super::{SimConfig, Topology, KEY, LIMIT};
use crate::alloc::{AllocConfig, Allocator, GlobalLimit, KeyView};
use crate::error::ConfigError;

const NANOS_PER_MS: u64 = 1_000_000;
const NANOS_PER_SEC: f64 = 1e9;
/// The simulated wall clock starts here (2026-11-30).
const T0: u64 = 1_796_000_000 * 1_000_000_000;

/// Admissions by kind, over the whole run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ByKind {
    pub lease: u64,
    pub provisional: u64,
    pub fail_open_local: u64,
    pub fail_open: u64,
}

/// What a run recorded.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Admitted and demanded units per tick, over all nodes.
    pub admitted: Vec<u64>,
    pub demand: Vec<u64>,
    pub by_kind: ByKind,
    /// Nodes that saw the key, and how many of their first requests were
    /// denied.
    pub first_requests: u64,
    pub first_denied: u64,
    /// The most times one node started the key afresh (provisional runs).
    pub max_starts: u64,
    pub messages_sent: u64,
    pub messages_lost: u64,
    pub service: Option<KeyView>,
    /// Per node: units admitted per tick, and its region.
    pub admitted_by_node: Vec<Vec<u64>>,
    pub regions: Vec<usize>,
}

struct SimNode {
    node: Node,
    /// With `SimConfig::shipped`: the filter's code, which then decides
    /// and syncs instead of `node`.
    shipped: Option<ShippedNode>,
    region: usize,
    offset_ns: i64,
    next_sync: u64,
    /// When the report in flight times out: then it is sent again at once.
    retry_at: Option<u64>,
    carry: f64,
    seen: bool,
    in_provisional: bool,
    starts: u64,
}

impl SimNode {
    fn clock(&self, t: u64) -> u64 {
        t.saturating_add_signed(self.offset_ns)
    }
}

/// A message in flight: (arrival, order, to the service?, node, JSON body).
type Msg = Reverse<(u64, u64, bool, usize, String)>;

pub fn alloc_config(cfg: &SimConfig, mode: FailureMode) -> AllocConfig {
    AllocConfig {
        policy_version: "sim".into(),
        limits: [(
            LIMIT.to_owned(),
            GlobalLimit {
                limit: cfg.limit,
                window_ns: cfg.window_ns,
                burst: cfg.burst,
                max_cost: cfg.max_cost,
            },
        )]
        .into_iter()
        .collect(),
        interval_ns: cfg.interval_ns,
        lease_ttl_ns: cfg.lease_ttl_ns,
        response_timeout_ns: cfg.response_timeout_ns,
        lease_factor_pct: cfg.lease_factor_pct,
        node_floor: cfg.node_floor,
        region_floor: cfg.region_floor,
        borrow_ceiling_pct: cfg.borrow_ceiling_pct,
        repay_pct: cfg.repay_pct,
        settle_ns: cfg.settle_ns,
        local_max_ns: cfg.local_max_ns,
        failure_mode: mode,
    }
}

pub fn simulate(spec: &Scenario, topo: Topology, cfg: &SimConfig, seed: u64) -> Result<Trace, ConfigError> {
    let mut service = Allocator::new(alloc_config(cfg, spec.failure_mode))?;
    if cfg.tick_ns == 0 || cfg.duration_ns < cfg.tick_ns {
        return Err(ConfigError::new("tick_ns", "must be > 0 and at most duration_ns"));
    }
    let mut net = Rng::new(seed, 1);
    let mut traffic = Rng::new(seed, 2);
    let mut clocks = Rng::new(seed, 3);
    let mut phases = Rng::new(seed, 4);
    let skew = i64::try_from(cfg.clock_skew_ns).unwrap_or(i64::MAX);
    let mut nodes: Vec<SimNode> = (0..topo.regions * topo.nodes_per_region)
        .map(|i| {
            let region = i / topo.nodes_per_region;
            let offset_ns = clocks.between(0, 2 * cfg.clock_skew_ns) as i64 - skew;
            let node_cfg = NodeConfig {
                node_id: format!("envoy-{region}-{}", i % topo.nodes_per_region),
                region: format!("region-{region}"),
                policy_version: "sim".into(),
                provisional: cfg.provisional,
                failure_mode: spec.failure_mode,
                response_timeout_ns: cfg.response_timeout_ns,
                interval_ns: cfg.interval_ns,
                max_ttl_ns: cfg.lease_ttl_ns.saturating_mul(4),
                local_max_ns: cfg.local_max_ns,
            };
            let shipped = cfg
                .shipped
                .then(|| shipped::policy(cfg, spec.failure_mode, T0.saturating_add_signed(offset_ns)))
                .transpose()?
                .map(|p| ShippedNode::new(p, node_cfg.node_id.clone(), node_cfg.region.clone()));
            Ok(SimNode {
                shipped,
                node: Node::new(node_cfg, T0.saturating_add_signed(offset_ns)),
                region,
                offset_ns,
                next_sync: T0 + phases.between(0, cfg.interval_ns - 1),
                retry_at: None,
                // A random phase, so that nodes whose demand is below one
                // request per tick do not all ask in the same tick.
                carry: phases.unit() * cfg.max_cost.max(1) as f64,
                seen: false,
                in_provisional: false,
                starts: 0,
            })
        })
        .collect::<Result<_, ConfigError>>()?;

    let ticks = (cfg.duration_ns / cfg.tick_ns) as usize;
    let rate_per_s = cfg.limit as f64 * NANOS_PER_SEC / cfg.window_ns as f64;
    let tick_s = cfg.tick_ns as f64 / NANOS_PER_SEC;
    let mut queue: BinaryHeap<Msg> = BinaryHeap::new();
    let mut order = 0u64;
    let mut trace = Trace {
        admitted: vec![0; ticks],
        demand: vec![0; ticks],
        by_kind: ByKind::default(),
        first_requests: 0,
        first_denied: 0,
        max_starts: 0,
        messages_sent: 0,
        messages_lost: 0,
        service: None,
        admitted_by_node: vec![vec![0; ticks]; nodes.len()],
        regions: nodes.iter().map(|n| n.region).collect(),
    };
    let cost = cfg.max_cost.max(1);
    let mut last_interval = None;
    let latency = |net: &mut Rng| net.between(spec.latency_ms.0, spec.latency_ms.1) * NANOS_PER_MS;

    for tick in 0..ticks {
        let now = T0 + tick as u64 * cfg.tick_ns;
        let t_s = tick as f64 * tick_s;

        while queue.peek().is_some_and(|Reverse(m)| m.0 <= now) {
            let Some(Reverse((_, _, to_service, i, body))) = queue.pop() else {
                break;
            };
            let n = &mut nodes[i];
            if !spec.link_up(n.region, t_s) {
                trace.messages_lost += 1;
                continue;
            }
            if to_service {
                // Garbage and stale requests get no answer (the node times out).
                let Ok(answer) = service.handle_json(body.as_bytes(), now) else {
                    continue;
                };
                trace.messages_sent += 1;
                if net.chance(spec.loss) {
                    trace.messages_lost += 1;
                    continue;
                }
                order += 1;
                queue.push(Reverse((now + latency(&mut net), order, false, i, answer)));
            } else if let Ok(resp) = SyncResponse::from_json(body.as_bytes()) {
                let clock = n.clock(now);
                match n.shipped.as_mut() {
                    Some(s) => s.apply(&resp, clock),
                    None => {
                        let _ = n.node.apply(&resp, clock);
                    }
                }
            }
        }

        if spec.service_up(t_s) && last_interval != Some(now / cfg.interval_ns) {
            last_interval = Some(now / cfg.interval_ns);
            service.tick(now);
        }

        for (i, n) in nodes.iter_mut().enumerate() {
            let clock = n.clock(now);
            if let Some(s) = n.shipped.as_mut() {
                // Every tick a worker ticks; the shared state says whether
                // a report is due (and gives up on one timed out).
                let Some(req) = s.tick(clock) else {
                    continue;
                };
                trace.messages_sent += 1;
                if !spec.link_up(n.region, t_s) || net.chance(spec.loss) {
                    trace.messages_lost += 1;
                    continue;
                }
                order += 1;
                queue.push(Reverse((now + latency(&mut net), order, true, i, req.to_json())));
                continue;
            }
            let retry = n.retry_at.is_some_and(|at| now >= at) && n.node.in_flight().is_some();
            if now < n.next_sync && !retry {
                continue;
            }
            if now >= n.next_sync {
                let jitter = 0.98 + 0.04 * phases.unit();
                n.next_sync = now + (n.node.interval_ns() as f64 * jitter) as u64;
            }
            let Some(req) = n.node.report(n.clock(now)) else {
                continue;
            };
            n.retry_at = Some(now + cfg.response_timeout_ns + cfg.tick_ns);
            trace.messages_sent += 1;
            if !spec.link_up(n.region, t_s) || net.chance(spec.loss) {
                trace.messages_lost += 1;
                continue;
            }
            order += 1;
            queue.push(Reverse((now + latency(&mut net), order, true, i, req.to_json())));
        }

        for (i, n) in nodes.iter_mut().enumerate() {
            let level = spec.region_level(n.region, topo.regions, t_s) / topo.nodes_per_region as f64;
            // Units of demand; requests of `cost` units each.
            n.carry += level * rate_per_s * tick_s * (0.5 + traffic.unit());
            let count = (n.carry / cost as f64).floor();
            n.carry -= count * cost as f64;
            let clock = n.clock(now);
            for _ in 0..count as u64 + spec.burst(t_s, tick_s) {
                let decision = match n.shipped.as_mut() {
                    // The engine says only whether it admitted: counted as
                    // lease admissions.
                    Some(s) => {
                        if s.request(clock) {
                            Ok(Admitted::Lease)
                        } else {
                            Err(tenantgate::sync::Denied::LeaseExhausted)
                        }
                    }
                    None => n.node.decide(KEY, LIMIT, cost, clock),
                };
                trace.demand[tick] += cost;
                if !n.seen {
                    n.seen = true;
                    trace.first_requests += 1;
                    trace.first_denied += u64::from(decision.is_err());
                }
                match decision {
                    Ok(Admitted::Provisional) if !n.in_provisional => {
                        n.starts += 1;
                        n.in_provisional = true;
                    }
                    Ok(Admitted::Provisional) | Err(_) => {}
                    Ok(_) => n.in_provisional = false,
                }
                let Ok(kind) = decision else {
                    continue;
                };
                trace.admitted[tick] += cost;
                trace.admitted_by_node[i][tick] += cost;
                match kind {
                    Admitted::Lease => trace.by_kind.lease += cost,
                    Admitted::Provisional => trace.by_kind.provisional += cost,
                    Admitted::FailOpenLocal => trace.by_kind.fail_open_local += cost,
                    Admitted::FailOpen => trace.by_kind.fail_open += cost,
                }
            }
        }
    }
    trace.max_starts = nodes.iter().map(|n| n.starts).max().unwrap_or(0);
    trace.service = service.view(if cfg.shipped { shipped::KEY } else { KEY }, LIMIT);
    Ok(trace)
}
