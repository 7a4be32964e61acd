//! Acquire: a request's slots taken in turn (the tenant's share, the
//! action's limit, the dependency's level, a half-open probe ticket), each
//! later refusal giving back what the earlier steps took (see the module
//! header of [`super`] for the rule).

use super::held::permit_room;
use super::limits::pool_use;
use super::{
    admits_within, breaker, ceiling, effective_limit, effective_limits, failure_reason, tenant_action,
    tenant_key, Counts, Limited, ProbeTicket, Refusal, Ticket, Worker,
};
use crate::engine::{Reason, Subject};
use crate::host::Host;
use crate::limiter::NANOS_PER_SEC;
use crate::policy::admission::{ActionLimit, Criticality, Dependency, Labels, DEFAULT_RETRY_AFTER_WINDOW_NS};
use crate::policy::{Policy, RouteClass};

/// A refusal by `paused` or the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GateRefusal {
    reason: Reason,
    retry_after_secs: u64,
}

impl GateRefusal {
    fn of(reason: Reason) -> GateRefusal {
        GateRefusal {
            reason,
            retry_after_secs: 1,
        }
    }

    /// `circuit_open`: its `Retry-After` is the time until half-open,
    /// rounded up, never earlier.
    fn open(half_open_at: u64, now: u64) -> GateRefusal {
        GateRefusal {
            reason: Reason::CircuitOpen,
            retry_after_secs: half_open_at.saturating_sub(now).div_ceil(NANOS_PER_SEC).max(1),
        }
    }
}

/// How a try's refusals are written (the dependency's `retry_after_window`).
struct Refusing {
    retry_after_window_ns: u64,
}

impl Refusing {
    fn refuse(&self, reason: Reason, in_flight: u32, limit: Limited) -> Refusal {
        Refusal {
            reason,
            in_flight,
            retry_after_window_ns: self.retry_after_window_ns,
            retry_after_secs: 1,
            limit,
        }
    }

    /// A refusal by `paused` or the breaker, with its `Retry-After`.
    fn gate(&self, r: GateRefusal) -> Refusal {
        Refusal {
            retry_after_secs: r.retry_after_secs,
            ..self.refuse(r.reason, 0, Limited::Dependency)
        }
    }
}

/// Why one try of [`Worker::acquire`] took nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tried<R = Refusal> {
    Refused(R),
    /// The breaker's phase changed under this worker's copy: try again.
    Stale(R),
}

impl<R> Tried<R> {
    fn map<S>(self, f: impl FnOnce(R) -> S) -> Tried<S> {
        match self {
            Tried::Refused(r) => Tried::Refused(f(r)),
            Tried::Stale(r) => Tried::Stale(f(r)),
        }
    }
}

impl Worker {
    /// Takes a slot for a request of `class` (see the module header): its
    /// tenant's share, then its action's limit, then its dependency, each
    /// given back if a later one refuses, then (half-open) a probe ticket.
    /// `Ok(None)`: the class has neither a dependency nor an action limit.
    pub fn acquire<H: Host>(
        &mut self,
        host: &H,
        policy: &Policy,
        class: &RouteClass,
        subject: &Subject,
        now: u64,
    ) -> Result<Option<Ticket>, Refusal> {
        match self.try_acquire(host, policy, class, subject, now) {
            // The breaker moved on between this worker's copy and its entry
            // (half-open ended): once more, with the breaker as it now is.
            Err(Tried::Stale(_)) => match self.try_acquire(host, policy, class, subject, now) {
                Err(Tried::Stale(r) | Tried::Refused(r)) => Err(r),
                Ok(t) => Ok(t),
            },
            Err(Tried::Refused(r)) => Err(r),
            Ok(t) => Ok(t),
        }
    }

    /// One try of [`Worker::acquire`]: the gate, then each slot in turn
    /// (tenant share, action, dependency, probe ticket), each later refusal
    /// giving back what the earlier steps took.
    fn try_acquire<H: Host>(
        &mut self,
        host: &H,
        policy: &Policy,
        class: &RouteClass,
        subject: &Subject,
        now: u64,
    ) -> Result<Option<Ticket>, Tried> {
        let labels = class.labels;
        let dep = labels.dependency.and_then(|i| policy.dependency(i));
        let action = labels.action_limit.and_then(|i| policy.action_limit(i));
        if dep.is_none() && action.is_none() {
            return Ok(None);
        }
        let refusing = Refusing {
            retry_after_window_ns: dep.map_or(DEFAULT_RETRY_AFTER_WINDOW_NS, |d| d.retry_after_window_ns),
        };
        let gate = match dep {
            Some(d) => self.gate(d, now).map_err(|r| Tried::Refused(refusing.gate(r)))?,
            None => breaker::Gate::Free,
        };
        let mut ticket = Ticket {
            dependency: None,
            action: None,
            tenant: None,
            level: labels.criticality.index(),
            streaming: labels.streaming,
            in_flight: 0,
            probe: None,
        };
        let taken = self
            .take_tenant(host, policy, dep, subject, &mut ticket, now)
            .map_err(|(reason, _)| refusing.refuse(reason, 0, Limited::Tenant))
            .and_then(|()| {
                self.take_action(host, action, &mut ticket, now)
                    .map_err(|(reason, occ)| refusing.refuse(reason, occ.total(), Limited::Action))
            })
            .and_then(|()| match dep {
                Some(dep) => self
                    .take_dependency(host, dep, &labels, &gate, &mut ticket, now)
                    .map_err(|(reason, occ)| refusing.refuse(reason, occ.total(), Limited::Dependency)),
                None => Ok(()),
            });
        if let Err(refusal) = taken {
            self.release(host, ticket, now);
            return Err(Tried::Refused(refusal));
        }
        if let (Some(dep), breaker::Gate::Probe { .. }) = (dep, gate) {
            match self.take_probe(host, dep, now) {
                Ok(probe) => ticket.probe = Some(probe),
                Err(tried) => {
                    self.release(host, ticket, now);
                    return Err(tried.map(|r| refusing.gate(r)));
                }
            }
        }
        Ok(Some(ticket))
    }

    /// The tenant's share of `dep` (`tenant_max_share`), if it has one and
    /// the request a subject.
    fn take_tenant<H: Host>(
        &mut self,
        host: &H,
        policy: &Policy,
        dep: Option<&Dependency>,
        subject: &Subject,
        ticket: &mut Ticket,
        now: u64,
    ) -> Result<(), (Reason, Counts)> {
        let Some((dep, max)) = dep.and_then(|d| d.tenant_max.map(|max| (d, max))) else {
            return Ok(());
        };
        if matches!(subject, Subject::None) {
            return Ok(());
        }
        let key = tenant_key(&dep.name, subject);
        let action = tenant_action(&dep.name);
        let check = |occ: &Counts| {
            if occ.total() < max {
                Ok(())
            } else {
                Err(Reason::TenantShare)
            }
        };
        let entries = Some(policy.key_table_entries);
        let (level, streaming) = (ticket.level, ticket.streaming);
        self.take(
            host,
            &key,
            entries,
            &action,
            now,
            level,
            streaming,
            &check,
            &|_| 0,
        )?;
        ticket.tenant = Some(key);
        Ok(())
    }

    /// The action's in-flight limit (`actions.<action>.max_in_flight`).
    fn take_action<H: Host>(
        &mut self,
        host: &H,
        action: Option<&ActionLimit>,
        ticket: &mut Ticket,
        now: u64,
    ) -> Result<(), (Reason, Counts)> {
        let Some(a) = action else {
            return Ok(());
        };
        let max = a.max_in_flight;
        let check = |occ: &Counts| {
            if occ.total() < max {
                Ok(())
            } else {
                Err(Reason::ConcurrencyLimit)
            }
        };
        let room = |occ: &Counts| permit_room(u64::from(max), u64::from(occ.total()));
        let (level, streaming) = (ticket.level, ticket.streaming);
        let occupancy = self.take(host, &a.key, None, "", now, level, streaming, &check, &room)?;
        ticket.in_flight = occupancy.total();
        ticket.action = Some(a.key.clone());
        Ok(())
    }

    /// The dependency's level, under its effective limits (the controller's
    /// limit, the breaker's cap: a half-open breaker's refusals are
    /// `circuit_probe_limit`).
    fn take_dependency<H: Host>(
        &mut self,
        host: &H,
        dep: &Dependency,
        labels: &Labels,
        gate: &breaker::Gate,
        ticket: &mut Ticket,
        now: u64,
    ) -> Result<(), (Reason, Counts)> {
        let target = effective_limit(dep, &self.control(&dep.key));
        let limits = effective_limits(dep, target, gate);
        let probing = matches!(gate, breaker::Gate::Probe { .. });
        let check = |occ: &Counts| {
            admits_within(&limits, labels, occ).map_err(|r| match r {
                Reason::ConcurrencyLimit | Reason::StreamLimit if probing => Reason::CircuitProbeLimit,
                other => other,
            })
        };
        // Permits only under the plain limits, for the shared levels.
        let permits = !limits.capped
            && dep.adaptive.is_none()
            && matches!(labels.criticality, Criticality::Normal | Criticality::Sheddable);
        let room = |occ: &Counts| {
            if !permits {
                return 0;
            }
            let c = ceiling(u64::from(limits.general()), labels.criticality, labels.retryable);
            permit_room(c, pool_use(&limits, occ))
        };
        let (level, streaming) = (ticket.level, ticket.streaming);
        let occupancy = self.take(host, &dep.key, None, "", now, level, streaming, &check, &room)?;
        ticket.in_flight = occupancy.total();
        ticket.dependency = Some(dep.key.clone());
        Ok(())
    }

    /// `paused`, then the breaker as this worker's copy says (see
    /// [`breaker`]): the gate a request passes, or its refusal
    /// (`retry_after_secs` set). No hostcall: a half-open probe's ticket is
    /// taken after the request's slots ([`Worker::take_probe`]).
    fn gate(&self, dep: &Dependency, now: u64) -> Result<breaker::Gate, GateRefusal> {
        if dep.paused {
            return Err(GateRefusal::of(Reason::Paused));
        }
        if dep.breaker.is_none() {
            return Ok(breaker::Gate::Free);
        }
        match self.control(&dep.key).gate(dep, now) {
            breaker::Gate::Open { half_open_at } => Err(GateRefusal::open(half_open_at, now)),
            breaker::Gate::Probe { left: 0, .. } => Err(GateRefusal::of(Reason::CircuitProbeLimit)),
            other => Ok(other),
        }
    }

    /// Takes a half-open probe ticket of `dep`'s breaker node-wide, and
    /// refreshes this worker's copy. `Err`: none left (refused), or the
    /// breaker is no longer half-open and lets the request through another
    /// way (stale: try again).
    fn take_probe<H: Host>(
        &mut self,
        host: &H,
        dep: &Dependency,
        now: u64,
    ) -> Result<ProbeTicket, Tried<GateRefusal>> {
        let Some(settings) = dep.breaker.as_ref() else {
            return Err(Tried::Stale(GateRefusal::of(Reason::CircuitProbeLimit)));
        };
        let probe = breaker::take_probe(host, &dep.breaker_key, settings, now, &mut self.buffers)
            .map_err(|f| Tried::Refused(GateRefusal::of(failure_reason(f))))?;
        self.update_control(&dep.key, |c| c.breaker = Some(probe.breaker));
        if probe.taken {
            if probe.half_opened {
                let events = self.probe_events.entry(dep.key.clone()).or_default();
                events.half_opened = events.half_opened.saturating_add(1);
            }
            return Ok(ProbeTicket {
                breaker_key: dep.breaker_key.clone(),
                period: probe.period(),
            });
        }
        // Another worker took the last ticket, or it is no longer
        // half-open (this copy was stale).
        Err(match probe.breaker.gate(settings, now) {
            breaker::Gate::Open { half_open_at } => Tried::Refused(GateRefusal::open(half_open_at, now)),
            breaker::Gate::Probe { .. } => Tried::Refused(GateRefusal::of(Reason::CircuitProbeLimit)),
            _ => Tried::Stale(GateRefusal::of(Reason::CircuitProbeLimit)),
        })
    }
}
