//! The simulation loop: virtual time in fixed ticks, nodes running the
//! filter's code ([`ShippedNode`]: the engine and `sync::shared` over the
//! in-memory host), the real [`Allocator`], and JSON messages carried with
//! latency and loss. One thread, no sleeps.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use tenantgate::sync::{Admitted, FailureMode, SyncResponse};

use super::rng::Rng;
use super::scenario::Scenario;
use super::shipped::{self, ShippedNode, TENANT};
use super::{SimConfig, Topology, LIMIT};
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

/// Where a lossy run loses use: messages lost by direction, answers the
/// nodes refused, and what denied requests lacked.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Losses {
    /// Reports lost on their way to the service, and answers on their way
    /// back (dropped or cut off).
    pub requests_lost: u64,
    pub answers_lost: u64,
    /// Answers that arrived but were not applied (later than the node's
    /// callout timeout, or not the report in flight).
    pub answers_refused: u64,
    /// Units denied with a live lease too small for them, and with no
    /// live lease (none yet, expired, or a failure mode's local limit).
    pub denied_lease_too_small: u64,
    pub denied_no_lease: u64,
    /// Per node, the share of its time with demand but no live lease, %:
    /// the least, the mean and the most over the nodes.
    pub no_lease_pct: [f64; 3],
    /// Units the service drew from its bucket into answers that were lost
    /// on their way back, and into answers the node refused: held in
    /// the node's reservation until a later answer brings them.
    pub drawn_answer_lost: u64,
    pub drawn_answer_refused: u64,
    /// Over the run's ticks, the mean of Σ reservations and of the bucket
    /// (units): `b + Σ R ≤ B`, so what reservations hold the refill has no
    /// room for.
    pub reserved_mean: u64,
    pub bucket_mean: u64,
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
    /// The most times one node started the key afresh (a key start: its
    /// provisional allowance) within one window.
    pub max_starts: u64,
    /// Keys sprayed by the adversary, over all nodes.
    pub sprayed: u64,
    pub messages_sent: u64,
    pub messages_lost: u64,
    pub service: Option<KeyView>,
    /// Per node: units admitted and demanded per tick, and its region.
    pub admitted_by_node: Vec<Vec<u64>>,
    pub demand_by_node: Vec<Vec<u64>>,
    pub regions: Vec<usize>,
    /// Retrying clients ([`Scenario::retries`]): requests sent again at
    /// their `Retry-After`, and how many of them were admitted.
    pub retries: u64,
    pub retries_admitted: u64,
    /// Costs settled after the response ([`SimConfig::late`]): the most
    /// requests in flight at once over all nodes, and the units written
    /// off per tick.
    pub max_in_flight: u64,
    pub written_off: Vec<u64>,
    pub losses: Losses,
}

struct SimNode {
    /// The filter's code: the engine and `sync::shared` over the in-memory host.
    node: ShippedNode,
    region: usize,
    offset_ns: i64,
    /// When the node's workers start ticking (a random phase within the
    /// first interval, so nodes do not all report in the same tick).
    ticks_from: u64,
    carry: f64,
    /// Sprayed keys due (fractional), and how many this node sent.
    spray_carry: f64,
    sprayed: u64,
    seen: bool,
    /// Ticks at which the key started afresh on this node.
    starts: Vec<usize>,
    /// Denied requests to send again: when, and the retries left after it.
    retries: Vec<(u64, u32)>,
    /// Admitted requests whose cost settles after the response: when their
    /// stream ends (simulated time), and what they were charged.
    streams: Vec<(u64, tenantgate::engine::Charged)>,
}

impl SimNode {
    fn clock(&self, t: u64) -> u64 {
        t.saturating_add_signed(self.offset_ns)
    }
}

/// A message in flight, ordered by arrival, then by when it was sent
/// (`order` is unique, so no two messages compare equal).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Msg {
    arrival: u64,
    order: u64,
    to_service: bool,
    /// The node that sent it, or that it goes to.
    node: usize,
    /// Units the service drew from its bucket into it (an answer).
    drew: u64,
    /// When the node sent the report (an answer: the report it answers):
    /// the host refuses an answer later than the callout timeout from
    /// then, as Envoy's timeout on that callout does.
    sent_at: u64,
    /// Its JSON body.
    body: String,
}

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
                month: 0,
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
    let mut world = World::new(spec, topo, cfg, seed)?;
    let ticks = world.trace.admitted.len();
    for tick in 0..ticks {
        let now = T0 + tick as u64 * cfg.tick_ns;
        let t_s = tick as f64 * world.tick_s;
        world.deliver(now, t_s);
        if spec.service_up(t_s) && world.last_interval != Some(now / cfg.interval_ns) {
            world.last_interval = Some(now / cfg.interval_ns);
            world.service.tick(now);
        }
        world.sample_bucket();
        world.send_reports(now, t_s);
        world.settle_streams(now, tick);
        for i in 0..world.nodes.len() {
            let due = world.demand(i, now, t_s);
            for retry in due
                .retries
                .into_iter()
                .map(Some)
                .chain((0..due.fresh).map(|_| None))
            {
                world.request(i, tick, now, retry);
            }
        }
    }
    Ok(world.finish())
}

/// A run in progress: the service, the nodes, the messages in flight, the
/// random streams (each drawn in the same order as ever, so a seed gives
/// the same run) and what the run recorded so far.
struct World<'a> {
    spec: &'a Scenario,
    topo: Topology,
    cfg: &'a SimConfig,
    service: Allocator,
    nodes: Vec<SimNode>,
    /// Latency and loss; demand; the streams' lengths.
    net: Rng,
    traffic: Rng,
    streams_rng: Rng,
    queue: BinaryHeap<Reverse<Msg>>,
    /// Messages sent so far: ties in arrival go in sending order.
    order: u64,
    /// The interval the service last ticked in.
    last_interval: Option<u64>,
    trace: Trace,
    /// Per node: ticks with demand, and of those without a live lease.
    demand_ticks: Vec<u64>,
    no_lease_ticks: Vec<u64>,
    /// Demand per second at level 1, and a tick in seconds.
    rate_per_s: f64,
    tick_s: f64,
    /// Units a request asks for, and what an admitted one really costs
    /// (settled at its stream's end).
    cost: u64,
    real: u64,
    /// Σ over ticks of Σ reservations and of the bucket.
    reserved_sum: u64,
    bucket_sum: u64,
}

/// A node's requests due in one tick: retries (the retries left after
/// each) and new ones.
struct Due {
    retries: Vec<u32>,
    fresh: u64,
}

impl<'a> World<'a> {
    fn new(
        spec: &'a Scenario,
        topo: Topology,
        cfg: &'a SimConfig,
        seed: u64,
    ) -> Result<World<'a>, ConfigError> {
        let service = Allocator::new(alloc_config(cfg, spec.failure_mode))?;
        if cfg.tick_ns == 0 || cfg.duration_ns < cfg.tick_ns {
            return Err(ConfigError::new("tick_ns", "must be > 0 and at most duration_ns"));
        }
        let nodes = sim_nodes(spec, topo, cfg, seed)?;
        let ticks = (cfg.duration_ns / cfg.tick_ns) as usize;
        let cost = cfg.max_cost.max(1);
        Ok(World {
            spec,
            topo,
            cfg,
            service,
            net: Rng::new(seed, 1),
            traffic: Rng::new(seed, 2),
            streams_rng: Rng::new(seed, 5),
            queue: BinaryHeap::new(),
            order: 0,
            last_interval: None,
            trace: empty_trace(ticks, &nodes),
            demand_ticks: vec![0u64; nodes.len()],
            no_lease_ticks: vec![0u64; nodes.len()],
            rate_per_s: cfg.limit as f64 * NANOS_PER_SEC / cfg.window_ns as f64,
            tick_s: cfg.tick_ns as f64 / NANOS_PER_SEC,
            cost,
            real: cfg.late.map_or(cost, |l| l.ceiling.max(cost)),
            reserved_sum: 0,
            bucket_sum: 0,
            nodes,
        })
    }

    /// Sends `body` from node `i` (`to_service`) or to it (with the
    /// units the service `drew` into it), arriving after the scenario's
    /// latency.
    fn send(&mut self, now: u64, to_service: bool, i: usize, drew: u64, body: String, sent_at: u64) {
        let latency = self.net.between(self.spec.latency_ms.0, self.spec.latency_ms.1) * NANOS_PER_MS;
        self.order += 1;
        self.queue.push(Reverse(Msg {
            arrival: now + latency,
            order: self.order,
            to_service,
            node: i,
            drew,
            sent_at,
            body,
        }));
    }

    /// Units the service has drawn from the key's bucket so far.
    fn granted(&self) -> u64 {
        self.service
            .view(shipped::KEY, LIMIT)
            .map_or(0, |v| v.stats.granted)
    }

    /// Adds this tick's reservations and bucket to the run's sums.
    fn sample_bucket(&mut self) {
        if let Some(v) = self.service.view(shipped::KEY, LIMIT) {
            self.reserved_sum = self.reserved_sum.saturating_add(v.reserved);
            self.bucket_sum = self.bucket_sum.saturating_add(v.bucket);
        }
    }

    /// Every message that arrives by `now`: a report answered by the
    /// service, an answer applied by its node (unless its region's link
    /// is down, or the answer is lost on its way back).
    fn deliver(&mut self, now: u64, t_s: f64) {
        while self.queue.peek().is_some_and(|Reverse(m)| m.arrival <= now) {
            let Some(Reverse(Msg {
                to_service,
                node: i,
                drew,
                body,
                sent_at,
                ..
            })) = self.queue.pop()
            else {
                break;
            };
            let n = &mut self.nodes[i];
            if !self.spec.link_up(n.region, t_s) {
                self.trace.messages_lost += 1;
                if to_service {
                    self.trace.losses.requests_lost += 1;
                } else {
                    self.trace.losses.answers_lost += 1;
                }
                continue;
            }
            if to_service {
                // Garbage and stale requests get no answer (the node times out).
                let before = self.granted();
                let Ok(answer) = self.service.handle_json(body.as_bytes(), now) else {
                    continue;
                };
                let drew = self.granted().saturating_sub(before);
                self.trace.messages_sent += 1;
                if self.net.chance(self.spec.loss) {
                    self.trace.messages_lost += 1;
                    self.trace.losses.answers_lost += 1;
                    self.trace.losses.drawn_answer_lost += drew;
                    continue;
                }
                self.send(now, false, i, drew, answer, sent_at);
            } else if let Ok(resp) = SyncResponse::from_json(body.as_bytes()) {
                let clock = n.clock(now);
                // Envoy ends a callout at its timeout: a later answer to
                // that copy never reaches the filter.
                let late = now.saturating_sub(sent_at) > self.cfg.response_timeout_ns;
                if late || !n.node.apply(&resp, clock) {
                    self.trace.losses.answers_refused += 1;
                    self.trace.losses.drawn_answer_refused += drew;
                }
            }
        }
    }

    /// Every node's report due now, sent (or lost).
    fn send_reports(&mut self, now: u64, t_s: f64) {
        for i in 0..self.nodes.len() {
            let n = &mut self.nodes[i];
            if now < n.ticks_from {
                continue;
            }
            let clock = n.clock(now);
            // Every tick a worker ticks; the shared state says whether a
            // report is due (and gives up on one timed out).
            // A report, or the second copy of the one in flight.
            let Some(req) = n.node.tick(clock).or_else(|| n.node.hedge(clock)) else {
                continue;
            };
            self.trace.messages_sent += 1;
            if !self.spec.link_up(n.region, t_s) || self.net.chance(self.spec.loss) {
                self.trace.messages_lost += 1;
                self.trace.losses.requests_lost += 1;
                continue;
            }
            self.send(now, true, i, 0, req.to_json(), now);
        }
    }

    /// Streams that end now settle their real cost (the filter's
    /// `engine::settle`), before this tick's requests.
    fn settle_streams(&mut self, now: u64, tick: usize) {
        let mut in_flight = 0u64;
        for n in &mut self.nodes {
            let clock = n.clock(now);
            let (due, open): (Vec<_>, Vec<_>) = n.streams.drain(..).partition(|(end, _)| *end <= now);
            n.streams = open;
            for (_, charged) in due {
                let adjusted = n.node.settle(TENANT, &charged, self.real, clock);
                self.trace.written_off[tick] += adjusted.written_off;
            }
            in_flight += n.streams.len() as u64;
        }
        self.trace.max_in_flight = self.trace.max_in_flight.max(in_flight);
    }

    /// Node `i`'s demand this tick: the adversary's sprayed keys sent at
    /// once, then the requests due (retries first, then new ones).
    fn demand(&mut self, i: usize, now: u64, t_s: f64) -> Due {
        let (spec, topo) = (self.spec, self.topo);
        let n = &mut self.nodes[i];
        let level = spec.node_level(i, topo.regions, topo.nodes_per_region, t_s);
        // Units of demand; requests of `cost` units each.
        n.carry += level * self.rate_per_s * self.tick_s * (0.5 + self.traffic.unit());
        let count = (n.carry / self.cost as f64).floor();
        n.carry -= count * self.cost as f64;
        let clock = n.clock(now);
        // The key-spraying adversary: new keys (other tenants), which
        // fill the key table and reclaim idle slots.
        n.spray_carry += spec.spray_per_s * self.tick_s;
        while n.spray_carry >= 1.0 {
            n.spray_carry -= 1.0;
            n.sprayed += 1;
            self.trace.sprayed += 1;
            let _ = n.node.request(&format!("spray-{i}-{}", n.sprayed), clock);
        }
        // Retries due now (clients that waited their `Retry-After`),
        // then the new requests; a retry is not new demand.
        let mut retries = Vec::new();
        n.retries.retain(|&(at, left)| {
            if at <= now {
                retries.push(left);
            }
            at > now
        });
        let fresh = count as u64 + spec.burst(t_s, self.tick_s);
        if fresh > 0 {
            self.demand_ticks[i] += 1;
            self.no_lease_ticks[i] += u64::from(!n.node.has_live_lease(clock));
        }
        Due { retries, fresh }
    }

    /// One request of node `i` (`retry`: a retry, with the retries left
    /// after it; `None`: new demand), recorded.
    fn request(&mut self, i: usize, tick: usize, now: u64, retry: Option<u32>) {
        let real = self.real;
        let trace = &mut self.trace;
        let n = &mut self.nodes[i];
        let clock = n.clock(now);
        let charged = n.node.request(TENANT, clock);
        let left = match retry {
            Some(left) => {
                trace.retries += 1;
                trace.retries_admitted += u64::from(charged.admitted.is_some());
                left
            }
            None => {
                trace.demand[tick] += real;
                trace.demand_by_node[i][tick] += real;
                self.spec.retries
            }
        };
        if charged.admitted.is_none() && left > 0 {
            let wait = charged.retry_after_secs.max(1).saturating_mul(1_000_000_000);
            n.retries.push((now.saturating_add(wait), left - 1));
        }
        if !n.seen {
            n.seen = true;
            trace.first_requests += 1;
            trace.first_denied += u64::from(charged.admitted.is_none());
        }
        if charged.start {
            n.starts.push(tick);
        }
        let Some(kind) = charged.admitted else {
            if charged.lease_too_small {
                trace.losses.denied_lease_too_small += real;
            } else {
                trace.losses.denied_no_lease += real;
            }
            return;
        };
        if let (Some(late), Some(c)) = (self.cfg.late, charged.charged) {
            let (shortest, longest) = late.stream_ns;
            let end = now.saturating_add(self.streams_rng.between(shortest, longest.max(shortest)));
            n.streams.push((end, c));
        }
        // Counted at its real cost, when it was admitted.
        trace.admitted[tick] += real;
        trace.admitted_by_node[i][tick] += real;
        match kind {
            Admitted::Lease => trace.by_kind.lease += real,
            Admitted::Provisional => trace.by_kind.provisional += real,
            Admitted::FailOpenLocal => trace.by_kind.fail_open_local += real,
            Admitted::FailOpen => trace.by_kind.fail_open += real,
        }
    }

    /// The trace, with what is measured over the whole run: the most key
    /// starts in a window, the service's view, the nodes' time without a
    /// lease.
    fn finish(mut self) -> Trace {
        let window_ticks = (self.cfg.window_ns / self.cfg.tick_ns).max(1) as usize;
        self.trace.max_starts = self
            .nodes
            .iter()
            .map(|n| max_in_span(&n.starts, window_ticks))
            .max()
            .unwrap_or(0);
        self.trace.service = self.service.view(shipped::KEY, LIMIT);
        let ticks = self.trace.admitted.len().max(1) as u64;
        self.trace.losses.reserved_mean = self.reserved_sum / ticks;
        self.trace.losses.bucket_mean = self.bucket_sum / ticks;
        let pct: Vec<f64> = self
            .demand_ticks
            .iter()
            .zip(&self.no_lease_ticks)
            .filter(|(d, _)| **d > 0)
            .map(|(d, n)| (100.0 * *n as f64 / *d as f64 * 10.0).round() / 10.0)
            .collect();
        if !pct.is_empty() {
            let mean = (pct.iter().sum::<f64>() / pct.len() as f64 * 10.0).round() / 10.0;
            self.trace.losses.no_lease_pct = [
                pct.iter().copied().fold(f64::INFINITY, f64::min),
                mean,
                pct.iter().copied().fold(0.0, f64::max),
            ];
        }
        self.trace
    }
}

/// The nodes of `topo`, each with its own clock offset (within the
/// configured skew) and a random phase.
fn sim_nodes(
    spec: &Scenario,
    topo: Topology,
    cfg: &SimConfig,
    seed: u64,
) -> Result<Vec<SimNode>, ConfigError> {
    let mut clocks = Rng::new(seed, 3);
    let mut phases = Rng::new(seed, 4);
    let skew = i64::try_from(cfg.clock_skew_ns).unwrap_or(i64::MAX);
    (0..topo.regions * topo.nodes_per_region)
        .map(|i| {
            let region = i / topo.nodes_per_region;
            let offset_ns = clocks.between(0, 2 * cfg.clock_skew_ns) as i64 - skew;
            let policy = shipped::policy(cfg, spec.failure_mode, T0.saturating_add_signed(offset_ns))?;
            Ok(SimNode {
                node: ShippedNode::new(
                    policy,
                    format!("envoy-{region}-{}", i % topo.nodes_per_region),
                    format!("region-{region}"),
                ),
                region,
                offset_ns,
                ticks_from: T0 + phases.between(0, cfg.interval_ns - 1),
                // A random phase, so that nodes whose demand is below one
                // request per tick do not all ask in the same tick.
                carry: phases.unit() * cfg.max_cost.max(1) as f64,
                spray_carry: 0.0,
                sprayed: 0,
                seen: false,
                starts: Vec::new(),
                retries: Vec::new(),
                streams: Vec::new(),
            })
        })
        .collect()
}

/// A trace of `ticks` ticks over `nodes` with nothing recorded yet.
fn empty_trace(ticks: usize, nodes: &[SimNode]) -> Trace {
    Trace {
        admitted: vec![0; ticks],
        demand: vec![0; ticks],
        by_kind: ByKind::default(),
        first_requests: 0,
        first_denied: 0,
        max_starts: 0,
        sprayed: 0,
        messages_sent: 0,
        messages_lost: 0,
        service: None,
        admitted_by_node: vec![vec![0; ticks]; nodes.len()],
        demand_by_node: vec![vec![0; ticks]; nodes.len()],
        regions: nodes.iter().map(|n| n.region).collect(),
        retries: 0,
        retries_admitted: 0,
        max_in_flight: 0,
        written_off: vec![0; ticks],
        losses: Losses::default(),
    }
}

/// The most of the sorted `ticks` within any `span` consecutive ticks.
fn max_in_span(ticks: &[usize], span: usize) -> u64 {
    let mut first = 0;
    let mut most = 0;
    for (last, t) in ticks.iter().enumerate() {
        while ticks[first] + span <= *t {
            first += 1;
        }
        most = most.max(last + 1 - first);
    }
    most as u64
}
