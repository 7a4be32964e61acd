//! A half-open breaker's promise through the whole pipeline, over seeded
//! random schedules: at most `probes` requests reach the dependency per
//! half-open period, node-wide, whatever the interleaving of workers,
//! ticks, later refusals (a tenant's rate limit, its share of the
//! dependency, the hold) and stream ends; and when requests are offered,
//! exactly `probes` do. The `breaker_probes` stat counts exactly those
//! requests.
//!
//! The node: three workers (three [`Pipeline`]s over one store), each
//! ticking every 10 ms at its own offset; requests arrive at random
//! workers from four tenants (one of them always over its rate limit, so
//! it takes probe tickets it never uses); an upstream answers each request
//! let through after a random latency, 500 while failing and 200 once
//! healed, and some clients reset before the answer. The breaker's entry
//! is read every millisecond to see every half-open period, and every
//! request let through is charged to the period it was let through in.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

use super::*;
use crate::admission::breaker::{self, Breaker, Phase};
use crate::admission::splitmix64;
use crate::limiter::NANOS_PER_SEC;
use crate::memory::{MemoryHost, MemoryStats, SharedStore};

const S: u64 = NANOS_PER_SEC;
const MS: u64 = 1_000_000;
const T0: u64 = 1_796_000_000 * S;
const PROBES: usize = 2;

const POLICY: &str = r#"{
    "version": "probes-1",
    "identity": {"header": "x-tenant-id"},
    "plans": {
        "paid": {"limits": [{"name": "paid", "rate": 100000, "per": "1s"}]},
        "tiny": {"limits": [{"name": "tiny", "rate": 1, "per": "1h", "burst": 1}]}
    },
    "tenants": [{"id": "spent", "plan": "tiny"}],
    "default_plan": "paid",
    "anonymous": {"plan": "paid"},
    "dependencies": {
        "db": {"max_in_flight": 8, "tenant_max_share": 3,
               "queues": {"normal": {"max_queue": 4, "max_wait": "30ms"}},
               "circuit_breaker": {"error_rate": 0.5, "min_volume": 4, "window": "500ms",
                                   "open_for": "200ms", "max_open_for": "400ms", "probes": 2,
                                   "ramp": "1s", "ramp_floor": 0.5}}
    },
    "routes": {"orders": {"dependency": "db"}},
    "default_route": "orders"
}"#;

/// A tiny seeded generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        splitmix64(self.0)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A request let through, waiting for its upstream's answer (or its
/// client's reset).
struct InFlight {
    worker: usize,
    stream: StreamId,
    at: u64,
    reset: bool,
    /// Let through while the breaker was half-open.
    probe: bool,
}

/// What one run saw.
#[derive(Default)]
struct Seen {
    /// Half-open period (its start) → requests let through in it.
    periods: BTreeMap<u64, usize>,
    /// Requests let through while the breaker was open, a tick after it opened.
    while_open: usize,
    /// Most probes (requests let through while half-open) in flight at once.
    max_concurrent_probes: usize,
    /// Requests offered while half-open, per period.
    offered: HashMap<u64, usize>,
    probes_stat: i64,
}

/// The breaker's node-wide entry.
fn entry(store: &Rc<RefCell<SharedStore>>, now: u64) -> Breaker {
    let host = MemoryHost::new(store.clone());
    breaker::read(&host, &crate::keys::breaker("db"), now).unwrap_or_default()
}

/// One seeded run: failing until `heal_at`, healthy after, `upstream_ms`
/// the latency range (min, max).
fn run(seed: u64, heal_at: u64, end: u64, upstream_ms: (u64, u64)) -> Seen {
    let store = SharedStore::new();
    let stats = MemoryStats::default();
    let mut rng = Rng(seed);
    let mut workers: Vec<(Pipeline, Rc<Policy>)> = (0..3)
        .map(|_| {
            let mut p = Pipeline::default();
            let host = MemoryHost::new(store.clone());
            let policy = p
                .configure(&host, &T0, &mut stats.clone(), POLICY.as_bytes())
                .unwrap();
            (p, policy)
        })
        .collect();
    let tenants = ["a", "b", "c", "spent"];
    let mut next_stream: StreamId = 1;
    let mut upstream: Vec<InFlight> = Vec::new();
    let mut seen = Seen::default();
    let mut now = T0;
    while now < end {
        now += MS;
        let half_open = period(&entry(&store, now));
        // Requests: about two a millisecond, at random workers.
        for _ in 0..rng.below(4) {
            let w = rng.below(workers.len() as u64) as usize;
            let tenant = tenants[rng.below(tenants.len() as u64) as usize];
            let host = MemoryHost::new(store.clone())
                .route_class("orders")
                .header("x-tenant-id", tenant);
            let stream = next_stream;
            next_stream += 1;
            if let Some(period) = half_open {
                *seen.offered.entry(period).or_default() += 1;
            }
            let (pipeline, policy) = &mut workers[w];
            let d = pipeline.on_request_headers(&host, &now, &policy.clone(), stream);
            match d.verdict {
                Verdict::Continue => {
                    let reset = rng.below(10) == 0;
                    let latency = upstream_ms.0 + rng.below(upstream_ms.1 - upstream_ms.0 + 1);
                    let at = now + latency * MS;
                    let probe = let_through(&mut seen, &entry(&store, now), now);
                    upstream.push(InFlight {
                        worker: w,
                        stream,
                        at,
                        reset,
                        probe,
                    });
                }
                Verdict::Pause | Verdict::Buffer => {}
                Verdict::Reply(_) => {
                    let _ = pipeline.on_stream_end(&host, &now, stream);
                }
            }
        }
        // Answers from the upstream, and client resets.
        let (due, rest): (Vec<InFlight>, Vec<InFlight>) = upstream.into_iter().partition(|r| r.at <= now);
        upstream = rest;
        for r in due {
            let status = if now < heal_at { "500" } else { "200" };
            let host = MemoryHost::new(store.clone()).response_header(":status", status);
            let pipeline = &mut workers[r.worker].0;
            if !r.reset {
                let _ = pipeline.on_response_headers(&host, &now, r.stream, true);
            }
            pipeline.on_stream_end(&host, &now, r.stream);
        }
        let probes = upstream.iter().filter(|r| r.probe).count();
        seen.max_concurrent_probes = seen.max_concurrent_probes.max(probes);
        // Each worker's tick, every 10 ms at its own offset; held requests
        // resumed by it go to the upstream too.
        for (i, (pipeline, policy)) in workers.iter_mut().enumerate() {
            if (now / MS + i as u64 * 3) % 10 != 0 {
                continue;
            }
            let host = MemoryHost::new(store.clone());
            pipeline.on_tick(&host, &now, &mut stats.clone(), Some(policy));
            for a in pipeline.take_answers() {
                match a.directive.verdict {
                    Verdict::Continue => {
                        let at = now + upstream_ms.0 * MS;
                        let probe = let_through(&mut seen, &entry(&store, now), now);
                        upstream.push(InFlight {
                            worker: i,
                            stream: a.stream,
                            at,
                            reset: false,
                            probe,
                        });
                    }
                    _ => {
                        let _ = pipeline.on_stream_end(&host, &now, a.stream);
                    }
                }
            }
        }
    }
    // Every half-open period, even one nobody was let through in.
    seen.probes_stat = stats.value("tenantgate.admission.breaker_probes.db");
    seen
}

/// A request let through at `now`, charged to the breaker's phase then
/// (a probe's take makes the open → half-open transition on the entry
/// itself): `true` if it is a probe.
fn let_through(seen: &mut Seen, b: &Breaker, now: u64) -> bool {
    match period(b) {
        Some(p) => {
            *seen.periods.entry(p).or_default() += 1;
            true
        }
        None => {
            // Every worker refuses from its first tick after the breaker
            // opened (its copy is at most one tick stale).
            if b.phase == Phase::Open && now < b.until && now > b.since.saturating_add(TICK_NS) {
                seen.while_open += 1;
            }
            false
        }
    }
}

/// The half-open period an entry is in (its start), if any.
fn period(b: &Breaker) -> Option<u64> {
    (b.phase == Phase::HalfOpen).then_some(b.since)
}

#[test]
fn at_most_and_exactly_probes_per_half_open_period_across_seeds() {
    let mut periods = 0;
    let mut histogram = BTreeMap::new();
    for seed in 0..24 {
        let seen = run(seed, T0 + 6 * S, T0 + 9 * S, (1, 40));
        assert_eq!(
            seen.while_open, 0,
            "seed {seed}: requests reached the dependency while open"
        );
        for (period, n) in &seen.periods {
            assert!(
                *n <= PROBES,
                "seed {seed}: {n} probes in the period at {} ms",
                (period - T0) / MS
            );
        }
        // Every period in which requests were offered let exactly `probes`
        // through (they arrive about every half millisecond; a period
        // lasts until its probes' answers are folded).
        for (period, offered) in &seen.offered {
            if *offered >= 20 {
                let n = seen.periods.get(period).copied().unwrap_or(0);
                assert_eq!(n, PROBES, "seed {seed}: the period at {} ms", (period - T0) / MS);
            }
        }
        assert!(seen.max_concurrent_probes <= PROBES, "seed {seed}");
        let total: usize = seen.periods.values().sum();
        assert_eq!(
            seen.probes_stat as usize, total,
            "seed {seed}: the stat counts probes let through"
        );
        periods += seen.periods.len();
        for n in seen.periods.values() {
            *histogram.entry(*n).or_insert(0) += 1;
        }
    }
    // Many periods: the failing phase re-opens every few hundred ms.
    assert!(periods >= 24 * 5, "{periods} periods");
    println!("probes per half-open period over 24 seeds: {histogram:?} ({periods} periods)");
}

#[test]
fn slow_probes_end_their_period_and_never_exceed_probes_at_once() {
    // Probes answer after 1.2–1.5 s, longer than two 500 ms windows: their
    // period is declared lost and a new one begins, but the effective limit
    // still keeps at most `probes` in flight, and each period lets at most
    // `probes` through.
    for seed in 0..8 {
        let seen = run(seed, T0 + S, T0 + 8 * S, (1_200, 1_500));
        assert_eq!(seen.while_open, 0, "seed {seed}");
        assert!(
            seen.periods.values().all(|n| *n <= PROBES),
            "seed {seed}: {:?}",
            seen.periods
        );
        assert!(
            seen.max_concurrent_probes <= PROBES,
            "seed {seed}: {}",
            seen.max_concurrent_probes
        );
    }
}
