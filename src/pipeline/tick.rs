//! The worker's tick (every [`super::TICK_NS`]), in order:
//! 1. the pending stats go to the host's sink (`tenantgate.stats.flushes`);
//! 2. once any policy of the worker has admission control: the worker's
//!    slot leases are renewed and what a failed write left dirty is
//!    published ([`crate::admission::Worker::renew`]), and its counted
//!    retry-budget primaries are folded into their budgets;
//! 3. the node's sync ([`crate::sync::syncer`]): the sync state read for
//!    requests, and a report made if this worker wins the interval;
//! 4. the [`super::hold`] is served: the slot lanes, each request that
//!    gets its slot charged its rate limits and resumed, one whose
//!    `max_wait` would pass answered 503 `queue_timeout`, one whose breaker
//!    opened or whose dependency was paused answered at once; then the
//!    rate lane, each request charged again and resumed or answered 429;
//! 5. the policy's adaptive controllers ([`adaptive::tick`]) and then its
//!    breakers ([`breaker::tick`]), which each fold and close signal
//!    windows and read the node-wide state into the worker's copy;
//! 6. the gauges: per dependency its queue depth (each worker adds the
//!    change of its own lane's length to the one node-wide gauge) and its
//!    oldest held request's age (the largest any worker reported: a worker
//!    sets it when its own age is at least the gauge's value, or when the
//!    value is the one it set last, so it can lower it); every 10th tick the
//!    controller's gauges, the retry amplification and the in-flight
//!    counts, read from shared data (node-wide: every worker sets the same
//!    value).

use std::rc::Rc;

use super::{Clock, Pipeline, TICK_NS};
use crate::admission::breaker::{self, Phase};
use crate::admission::queue::Attempt;
use crate::admission::{self, retry, Refusal};
use crate::admission::{adaptive, controller};
use crate::decision::Reason;
use crate::host::Host;
use crate::policy::Policy;
use crate::stats::{BreakerPhase, ControllerStat, Metric, Stats};

impl Pipeline {
    /// The worker's tick (see the module header). `policy`: the one in
    /// force for the host configuration that ticks (`None`: none loaded).
    pub fn on_tick<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        stats: &mut dyn Stats,
        policy: Option<&Rc<Policy>>,
    ) {
        self.pending.flush(stats);
        stats.add(&Metric::Flushes, 1);
        self.leases.flush(stats);
        let Some(now) = clock.now() else { return };
        self.leases.on_tick(host, now, &mut self.scratch);
        let admission = !self.dependencies.is_empty() || !self.actions.is_empty();
        if admission {
            self.ensure_worker(host, now);
            if let Some(w) = self.worker.as_mut() {
                w.renew(host, now);
            }
            self.primaries.fold(host, now);
        }
        if let Some(policy) = policy {
            let (callout, view) = self.sync.tick(host, clock, stats, policy, now);
            if view.is_some() {
                self.sync_view = view;
            }
            self.callouts.extend(callout);
        }
        self.serve_hold(host, now);
        if let Some(age) = self.last_degraded_age_ms.take() {
            stats.set(&Metric::DegradedLastAgeMs, age);
        }
        if !admission {
            return;
        }
        let ticks = self.ticks.wrapping_add(1);
        self.ticks = ticks;
        let controlled = match policy.filter(|p| p.dependencies.iter().any(|d| d.adaptive.is_some())) {
            Some(policy) => self.control(host, policy, now),
            None => Vec::new(),
        };
        if let Some(policy) = policy.filter(|p| p.dependencies.iter().any(|d| d.breaker.is_some())) {
            self.breakers(host, stats, policy, &controlled, now);
        }
        if ticks % 10 == 0 {
            for t in &controlled {
                let (Some(dep), Some(state), Some(cap)) =
                    (policy.and_then(|p| p.dependency(t.dependency)), t.state, t.cap)
                else {
                    continue;
                };
                controller_gauges(stats, &dep.name, &state, cap);
            }
        }
        self.report_lanes(stats, now);
        if ticks % 10 == 0 {
            self.node_gauges(host, stats, now);
        }
    }

    /// Serves the hold (step 3 of the module header).
    fn serve_hold<H: Host>(&mut self, host: &H, now: u64) {
        if self.hold.is_empty() {
            return;
        }
        let Pipeline {
            hold,
            worker,
            scratch,
            sync_view,
            ..
        } = self;
        let released = hold.serve(
            now,
            TICK_NS,
            |h| {
                let p = &h.item;
                let tried = worker
                    .as_mut()
                    .map(|w| w.acquire(host, &p.policy, &p.prepared.class, &p.prepared.subject, now));
                match tried {
                    Some(Ok(ticket)) => Attempt::Admitted(ticket),
                    Some(Err(r)) if r.reason == Reason::TenantShare => Attempt::TenantFull,
                    // Its breaker opened, or it was paused: answered now,
                    // not held until its max_wait.
                    Some(Err(r)) if matches!(r.reason, Reason::CircuitOpen | Reason::Paused) => {
                        Attempt::Refused(r)
                    }
                    _ => Attempt::<_, Refusal>::LevelFull,
                }
            },
            |p| {
                let view = p.policy.sync.as_ref().and(*sync_view);
                super::settle::unmetered(&p.prepared).unwrap_or_else(|| {
                    crate::engine::charge_synced(&p.policy, &p.prepared, host, now, view.as_ref(), scratch)
                })
            },
        );
        for r in released {
            match r {
                super::hold::Released::Admitted(h, ticket) => {
                    self.resume_admitted(host, h, ticket, now);
                }
                super::hold::Released::TimedOut(h) => {
                    self.pending.admission(Some(Reason::QueueTimeout), h.level);
                    self.answer_held(host, h, Reason::QueueTimeout, 1, now);
                }
                super::hold::Released::Refused(h, r) => {
                    self.pending.admission(Some(r.reason), h.level);
                    self.answer_held(host, h, r.reason, r.retry_after_secs, now);
                }
                super::hold::Released::Charged(p, decision) => {
                    let admitted = decision.deny_status().is_none();
                    self.pending.rare(if admitted {
                        Metric::QueueAdmitted
                    } else {
                        Metric::QueueRejected
                    });
                    self.resume_charged(host, p, decision, now);
                }
            }
        }
    }

    /// The adaptive controllers' tick (see [`adaptive::tick`]), with each
    /// dependency's oldest held request's age.
    fn control<H: Host>(&mut self, host: &H, policy: &Policy, now: u64) -> Vec<adaptive::Ticked> {
        let Pipeline {
            worker,
            windows,
            control_buffers,
            hold,
            ..
        } = self;
        let Some(w) = worker.as_mut() else {
            return Vec::new();
        };
        let age = |d: &crate::policy::admission::Dependency| {
            hold.slot_lane(&d.key).1.map_or(0, |at| now.saturating_sub(at))
        };
        adaptive::tick(host, policy, w, windows, &age, now, control_buffers)
    }

    /// The breakers' tick (see [`breaker::tick`]), after the controllers',
    /// and their stats: the transitions this worker made, the probes it let
    /// through, the gauges.
    fn breakers<H: Host>(
        &mut self,
        host: &H,
        stats: &mut dyn Stats,
        policy: &Policy,
        controlled: &[adaptive::Ticked],
        now: u64,
    ) {
        let Pipeline {
            worker,
            windows,
            control_buffers,
            ..
        } = self;
        let Some(w) = worker.as_mut() else { return };
        let ticked = breaker::tick(host, policy, w, windows, controlled, now, control_buffers);
        for t in ticked {
            let Some(dep) = policy.dependency(t.dependency) else {
                continue;
            };
            let Some(settings) = dep.breaker.as_ref() else {
                continue;
            };
            let name = dep.name.as_str();
            for tr in t.transitions.iter() {
                stats.add(&Metric::BreakerEntered(name, entered(tr.to)), 1);
            }
            if t.probes.half_opened > 0 {
                let n = i64::try_from(t.probes.half_opened).unwrap_or(i64::MAX);
                stats.add(&Metric::BreakerEntered(name, BreakerPhase::HalfOpen), n);
            }
            if let Some(b) = t.breaker {
                stats.set(&Metric::BreakerState(name), b.phase_at(settings, now) as u64);
                stats.set(
                    &Metric::BreakerRamp(name),
                    u64::from(b.gate(settings, now).permille()),
                );
            }
        }
    }

    /// Each dependency's lane depth and oldest age (step 5).
    fn report_lanes(&mut self, stats: &mut dyn Stats, now: u64) {
        for (key, known) in self.dependencies.iter_mut() {
            let (depth, oldest) = self.hold.slot_lane(key);
            let depth = depth as u64;
            let oldest_ms = oldest.map_or(0, |at| now.saturating_sub(at) / 1_000_000);
            let name = known.name.as_str();
            if depth != known.reported_depth {
                let delta = i64::try_from(depth)
                    .unwrap_or(i64::MAX)
                    .saturating_sub(i64::try_from(known.reported_depth).unwrap_or(i64::MAX));
                stats.add(&Metric::QueueDepth(name), delta);
                known.reported_depth = depth;
            }
            let Some(value) = stats.get(&Metric::QueueOldestMs(name)) else {
                continue;
            };
            let ours = value == known.reported_oldest_ms;
            if oldest_ms >= value || ours {
                if oldest_ms != value {
                    stats.set(&Metric::QueueOldestMs(name), oldest_ms);
                }
                known.reported_oldest_ms = oldest_ms;
            }
        }
    }

    /// The node-wide gauges read from shared data (every 10th tick).
    fn node_gauges<H: Host>(&self, host: &H, stats: &mut dyn Stats, now: u64) {
        for (key, known) in &self.dependencies {
            if let Some(t) = known.budget.as_ref().and_then(|b| retry::totals(host, b, now)) {
                stats.set(
                    &Metric::RetryAmplification(&known.name),
                    t.amplification_permille(),
                );
            }
            if let Some(live) = admission::in_flight(host, key, now) {
                stats.set(&Metric::InFlight(&known.name), u64::from(live.total()));
            }
        }
        for (key, name) in &self.actions {
            if let Some(live) = admission::in_flight(host, key, now) {
                stats.set(&Metric::ActionInFlight(name), u64::from(live.total()));
            }
        }
    }
}

/// An adaptive dependency's gauges from its node-wide state.
fn controller_gauges(stats: &mut dyn Stats, dependency: &str, state: &controller::State, cap: u32) {
    let i = &state.inputs;
    for (stat, value) in [
        (ControllerStat::Limit, u64::from(cap)),
        (ControllerStat::BaselineUs, state.baseline_ns / 1_000),
        (ControllerStat::P95Us, i.p95_ns / 1_000),
        (ControllerStat::MinUs, i.min_ns / 1_000),
        (ControllerStat::ErrorRatePpm, u64::from(i.error_ppm)),
        (ControllerStat::QueueAgeMs, i.oldest_queue_ns / 1_000_000),
    ] {
        stats.set(&Metric::Controller(dependency, stat), value);
    }
}

/// How the transition counters name a breaker phase.
fn entered(phase: Phase) -> BreakerPhase {
    match phase {
        Phase::Open => BreakerPhase::Open,
        Phase::HalfOpen => BreakerPhase::HalfOpen,
        Phase::Ramping => BreakerPhase::Ramping,
        Phase::Closed => BreakerPhase::Closed,
    }
}
