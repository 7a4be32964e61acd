//! What a request gets from admission control: a [`Ticket`] for the slots
//! it holds (given back exactly once), or a [`Refusal`] naming the limit.

use crate::engine::Reason;

/// Why a request did not get a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub reason: Reason,
    /// The dependency's live slots (requests + streams) at the decision.
    pub in_flight: u32,
    /// The dependency's `retry_after_window` (the default without one).
    pub retry_after_window_ns: u64,
    /// The shortest honest `Retry-After` (≥ 1 s): for `circuit_open`, the
    /// time until half-open, rounded up.
    pub retry_after_secs: u64,
    pub limit: Limited,
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limited {
    /// The tenant's `tenant_max_share` of the dependency.
    Tenant,
    /// The action's `actions.<action>.max_in_flight`.
    Action,
    /// The dependency's `max_in_flight` or `max_streams`.
    Dependency,
}

/// The slots held by one stream (its dependency's, its action's, its
/// tenant's share). Not `Clone`: [`super::Worker::release`] takes it, so it is
/// given back exactly once.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a ticket must be released when its stream ends"]
pub struct Ticket {
    pub(super) dependency: Option<String>,
    pub(super) action: Option<String>,
    pub(super) tenant: Option<String>,
    pub(super) level: usize,
    pub(super) streaming: bool,
    /// The dependency's live slots before this one (the action's, for a
    /// class without a dependency), for the record.
    pub(super) in_flight: u32,
    /// A half-open breaker's probe ticket, taken last.
    pub(super) probe: Option<ProbeTicket>,
}

/// A half-open breaker's probe ticket (see [`super::breaker`]): given back by
/// [`super::Worker::cancel`] if its request never reaches the dependency, kept
/// (spent) by [`super::Worker::release`] at the end of a stream that did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeTicket {
    /// The breaker's shared-data key.
    pub breaker_key: String,
    /// The half-open period it was taken in (the period's start).
    pub period: u64,
}

impl Ticket {
    /// The probe ticket this request holds, if its breaker is half-open.
    pub fn probe(&self) -> Option<&ProbeTicket> {
        self.probe.as_ref()
    }

    /// The dependency's live slots (requests + streams) when it was taken,
    /// not counting itself (the action's, for a class without a dependency).
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// The dependency's shared-data key (`None`: an action limit only).
    pub fn dependency_key(&self) -> Option<&str> {
        self.dependency.as_deref()
    }
}
