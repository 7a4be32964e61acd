//! What a dependency admits: its limits (the policy's, the adaptive
//! controller's, the breaker's cap) and whether one more request of a
//! level fits an occupancy under them, with the shedding order (the module
//! header of [`super`] states the rule). Pure arithmetic: no shared data.

use super::breaker;
use crate::engine::Reason;
use crate::inflight::Counts;
use crate::policy::admission::{Criticality, Dependency, Labels};

/// Percent of the shared pool each of (sheddable retryable, sheddable,
/// normal retryable, normal) may fill: the shedding order.
pub const SHED_CEILING_PCT: [u64; 4] = [70, 80, 90, 100];

impl Control {
    /// What the dependency's breaker says at `now` ([`breaker::Gate::Free`]
    /// without one).
    pub fn gate(&self, dep: &Dependency, now: u64) -> breaker::Gate {
        match (dep.breaker.as_ref(), self.breaker.as_ref()) {
            (Some(s), Some(b)) => b.gate(s, now),
            _ => breaker::Gate::Free,
        }
    }
}

/// The limits [`admits_within`] applies to a dependency: its policy's
/// (`max_in_flight`, `max_streams`, reservations), or those capped by its
/// breaker ([`effective_limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_in_flight: u32,
    pub max_streams: Option<u32>,
    pub reserved_critical: u32,
    pub reserved_system: u32,
    /// Below the policy's `max_in_flight`: in flight (every level) must
    /// also stay below it, whatever was admitted under a higher limit.
    pub capped: bool,
}

impl Limits {
    /// The policy's limits.
    pub fn of(dep: &Dependency) -> Limits {
        Limits::at(dep, dep.max_in_flight)
    }

    /// The policy's limits with an in-flight limit of `limit` (the
    /// controller's, clamped to 1–`max_in_flight`): the reservations stay,
    /// the pool is what is left.
    pub fn at(dep: &Dependency, limit: u32) -> Limits {
        Limits {
            max_in_flight: limit.clamp(1, dep.max_in_flight.max(1)),
            max_streams: dep.max_streams,
            reserved_critical: dep.reserved_critical,
            reserved_system: dep.reserved_system,
            capped: false,
        }
    }

    /// The shared pool: what neither reservation holds.
    pub fn general(&self) -> u32 {
        self.max_in_flight
            .saturating_sub(self.reserved_critical)
            .saturating_sub(self.reserved_system)
    }
}

/// **The one effective limit** of a dependency: `min(target, the breaker's
/// cap)`, `target` the static `max_in_flight` or the controller's limit
/// ([`effective_limit`]), the cap `gate.cap(target)` (half-open: the probe
/// count; ramping: floor → target). Under the breaker's cap the
/// reservations shrink in proportion (rounded down, so they stay below
/// the cap together: probes never exceed `probes`, whatever the level),
/// the same ceilings apply to the smaller pool (so the shedding order and
/// "no level borrows a reservation" hold at every level), in flight must
/// stay below the cap whatever was admitted before it, and streams are
/// capped the same way.
pub fn effective_limits(dep: &Dependency, target: u32, gate: &breaker::Gate) -> Limits {
    let base = Limits::at(dep, target);
    let target = base.max_in_flight;
    let cap = gate.cap(target);
    if cap >= target {
        return base;
    }
    let scale = |n: u32| {
        let scaled = u64::from(n) * u64::from(cap) / u64::from(target.max(1));
        u32::try_from(scaled).unwrap_or(0)
    };
    Limits {
        max_in_flight: cap,
        max_streams: dep.max_streams.map(|m| gate.cap(m)),
        reserved_critical: scale(dep.reserved_critical),
        reserved_system: scale(dep.reserved_system),
        capped: true,
    }
}

/// The pool use `u` of the module header.
pub(super) fn pool_use(dep: &Limits, c: &Counts) -> u64 {
    let [d, n, crit, sys] = c.levels.map(u64::from);
    d + n
        + crit.saturating_sub(u64::from(dep.reserved_critical))
        + sys.saturating_sub(u64::from(dep.reserved_system))
}

/// What a worker knows of a dependency's node-wide control state, as it
/// read it on its last tick (at most one tick, 10 ms, stale): the request
/// path reads this copy, never shared data. `Default`: no control state
/// (the static `max_in_flight` applies).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Control {
    /// The adaptive controller's limit (see [`super::controller`]).
    pub limit: Option<u32>,
    /// The node's breaker for the dependency as last read (see
    /// [`breaker`]; `None`: no breaker, or not read yet: closed).
    pub breaker: Option<breaker::Breaker>,
}

/// The in-flight limit [`admits`] uses for a dependency: its static
/// `max_in_flight`, or the controller's limit when it has one (never more
/// than `max_in_flight`). Reservations and level ceilings apply below it
/// as they do below `max_in_flight`.
pub fn effective_limit(dep: &Dependency, control: &Control) -> u32 {
    control
        .limit
        .map_or(dep.max_in_flight, |l| l.clamp(1, dep.max_in_flight))
}

/// Whether one more request of `labels` fits `occupancy` (everything live,
/// this worker included) under the static `max_in_flight`, per the module
/// header.
pub fn admits(dep: &Dependency, labels: &Labels, occupancy: &Counts) -> Result<(), Reason> {
    admits_within(&Limits::of(dep), labels, occupancy)
}

/// [`admits`] under an in-flight limit of `limit` (see [`effective_limit`]):
/// the shared pool is `limit − reserved.critical − reserved.system`.
pub fn admits_at(dep: &Dependency, limit: u32, labels: &Labels, occupancy: &Counts) -> Result<(), Reason> {
    admits_within(&Limits::at(dep, limit), labels, occupancy)
}

/// [`admits`] at a dependency's effective limits ([`effective_limits`]).
pub fn admits_within(dep: &Limits, labels: &Labels, occupancy: &Counts) -> Result<(), Reason> {
    if labels.streaming {
        let max = dep.max_streams.unwrap_or(0);
        return if occupancy.streams < max {
            Ok(())
        } else {
            Err(Reason::StreamLimit)
        };
    }
    let general = u64::from(dep.general());
    let used = pool_use(dep, occupancy);
    let level = labels.criticality;
    let held = occupancy.levels.get(level.index()).copied().unwrap_or(0);
    let ok = match level {
        Criticality::System => held < dep.reserved_system || used < general,
        Criticality::Critical => held < dep.reserved_critical || used < general,
        Criticality::Normal | Criticality::Sheddable => used < ceiling(general, level, labels.retryable),
    } && (!dep.capped || occupancy.in_flight() < dep.max_in_flight);
    if ok {
        Ok(())
    } else {
        Err(Reason::ConcurrencyLimit)
    }
}

/// A level's share of the pool (see [`SHED_CEILING_PCT`]).
pub fn ceiling(general: u64, level: Criticality, retryable: bool) -> u64 {
    let step = match level {
        Criticality::Sheddable => 0,
        _ => 2,
    } + usize::from(!retryable);
    let pct = SHED_CEILING_PCT.get(step).copied().unwrap_or(100);
    (general.saturating_mul(pct) / 100).max(1).min(general)
}
