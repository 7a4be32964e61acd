//! Circuit breakers on Envoy's streams: the stats (the core is
//! [`crate::admission::breaker`]; [`breaker::tick`] runs in the root tick
//! of [`super::admission`], after the controller's, on the stream-end
//! signal windows the glue records there).
//!
//! * The worker that closes a dependency's signal window folds its summary
//!   into the breaker (`tg2|b|<dep>`) and counts the transitions that made;
//!   every other worker reads the entry (one read). Each keeps the result in
//!   its worker's [`crate::admission::Control`] for its requests until its
//!   next tick (10 ms).
//! * A request's check reads that copy (no hostcall), except a half-open
//!   probe's ticket, which refreshes it.
//!
//! Stats per dependency with a breaker: gauges
//! `tenantgate.admission.breaker_state.<dep>` ([`Phase`] as a number) and
//! `tenantgate.admission.breaker_ramp_permille.<dep>`, set on every tick;
//! counters `tenantgate.admission.breaker_{opened,half_opened,ramping,closed}.<dep>`
//! (each transition once per node: by the worker whose write made it) and
//! `tenantgate.admission.breaker_probes.<dep>`.

use std::cell::RefCell;
use std::collections::HashMap;

use proxy_wasm::types::MetricType;

use super::abi;
use crate::admission::breaker::{self, Phase, Transition};
use crate::policy::admission::Dependency;
use crate::policy::Policy;

thread_local! {
    /// Stats ids by dependency key.
    static STATS: RefCell<HashMap<String, Stats>> = RefCell::new(HashMap::new());
}

struct Stats {
    state: Option<u32>,
    ramp: Option<u32>,
    opened: Option<u32>,
    half_opened: Option<u32>,
    ramping: Option<u32>,
    closed: Option<u32>,
    probes: Option<u32>,
}

impl Stats {
    fn define(name: &str) -> Stats {
        let metric = |t, what: &str| super::admission::dependency_metric(t, what, name);
        Stats {
            state: metric(MetricType::Gauge, "breaker_state"),
            ramp: metric(MetricType::Gauge, "breaker_ramp_permille"),
            opened: metric(MetricType::Counter, "breaker_opened"),
            half_opened: metric(MetricType::Counter, "breaker_half_opened"),
            ramping: metric(MetricType::Counter, "breaker_ramping"),
            closed: metric(MetricType::Counter, "breaker_closed"),
            probes: metric(MetricType::Counter, "breaker_probes"),
        }
    }

    fn count(&self, t: Transition) {
        let id = match t.to {
            Phase::Open => self.opened,
            Phase::HalfOpen => self.half_opened,
            Phase::Ramping => self.ramping,
            Phase::Closed => self.closed,
        };
        if let Some(id) = id {
            let _ = abi::increment_metric(id, 1);
        }
    }
}

/// Defines the stats of a newly loaded policy's breakers.
pub fn configure(policy: &Policy) {
    STATS.with(|s| {
        let Ok(mut stats) = s.try_borrow_mut() else { return };
        for d in policy.dependencies.iter().filter(|d| d.breaker.is_some()) {
            stats
                .entry(d.key.clone())
                .or_insert_with(|| Stats::define(&d.name));
        }
    });
}

/// The breaker's phase for the decision record (`None`: no breaker).
pub fn phase_name(dep: Option<&Dependency>, now: u64) -> Option<&'static str> {
    let dep = dep?;
    let settings = dep.breaker.as_ref()?;
    let copy = super::admission::with_worker(|w| w.control(&dep.key).breaker).flatten();
    let phase = copy.map_or(Phase::Closed, |b| b.phase_at(settings, now));
    Some(phase.as_str())
}

/// Sets a dependency's breaker stats after its tick: the transitions
/// this worker made, the probes it took, the gauges.
pub fn report(dep: &Dependency, t: &breaker::Ticked, now: u64) {
    let Some(settings) = dep.breaker.as_ref() else {
        return;
    };
    STATS.with(|s| {
        let Ok(stats) = s.try_borrow() else { return };
        let Some(st) = stats.get(&dep.key) else { return };
        for tr in t.transitions.iter() {
            st.count(tr);
        }
        if let (Some(id), true) = (st.probes, t.probes.probes > 0) {
            let _ = abi::increment_metric(id, i64::try_from(t.probes.probes).unwrap_or(i64::MAX));
        }
        for _ in 0..t.probes.half_opened.min(16) {
            st.count(Transition {
                from: Phase::Open,
                to: Phase::HalfOpen,
            });
        }
        let Some(b) = t.breaker else { return };
        if let Some(id) = st.state {
            let _ = abi::record_metric(id, b.phase_at(settings, now) as u64);
        }
        if let Some(id) = st.ramp {
            let _ = abi::record_metric(id, u64::from(b.gate(settings, now).permille()));
        }
    });
}
