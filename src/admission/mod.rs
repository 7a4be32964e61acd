//! Admission control, part 1: request checks and in-flight slots per
//! dependency, counted node-wide across worker VMs.
//!
//! # What is decided
//! A request of a class with a `dependency` takes one **slot** of it when
//! its headers arrive and gives it back when its stream ends, however it
//! ends. It is refused (503) when:
//! * `tenant_share`: its tenant (or anonymous group) already holds
//!   `tenant_max_share` of the dependency, node-wide (requests and streams);
//! * `stream_limit`: a `streaming` class and `max_streams` streams are open
//!   (streams never take `max_in_flight` slots, so a long stream cannot hold
//!   them);
//! * `concurrency_limit`: the level's share of `max_in_flight` is full,
//!   or the class's action has `actions.<action>.max_in_flight` requests
//!   (and streams) in flight, node-wide, over every class of the action
//!   (no levels, no reservations: a plain count).
//!
//! The tenant's share is taken first, then the action's slot, then the
//! dependency's; a refusal gives back what was taken before it.
//!
//! With `G = max_in_flight − reserved.critical − reserved.system` (the
//! shared pool) and `s, c, n, d` the system, critical, normal and
//! sheddable requests in flight, the pool's use is
//! `u = n + d + (c − reserved.critical)⁺ + (s − reserved.system)⁺`.
//! `system` is admitted while `s < reserved.system` or `u < G`; `critical`
//! while `c < reserved.critical` or `u < G`; `normal` and `sheddable` only
//! while `u` is below their **ceiling** ([`SHED_CEILING_PCT`] of `G`:
//! sheddable retryable 70 %, sheddable 80 %, normal retryable 90 %,
//! normal 100 %, rounded down, at least 1). So under rising load sheddable
//! work is refused first, then normal; retryable before non-retryable at
//! one level; critical only once its own reservation and the pool are
//! full; and **no level ever borrows another's reservation**: `u ≤ G`,
//! `min(c, reserved.critical) ≤ reserved.critical`, and the same for
//! system, so in flight ≤ `max_in_flight` at every instant (up to the
//! leak bound below, which only ever lets a dead worker's slots go).
//!
//! # Where the counts live
//! Each worker VM keeps its own counts in memory ([`Worker`]): they are the
//! truth for its streams, so a release never needs shared data to be
//! right and can never drive a count below zero. It publishes them, with
//! a **lease**, in the dependency's fixed entry (`tg2|d|<name>`) and, with
//! a tenant cap, in the tenant's key-table slot (`~d.<name>|t|<tenant>`);
//! an action limit's in its fixed entry (`tg2|a|<action>`),
//! each through [`crate::table::update`], the one compare-and-swap
//! primitive. A decision reads every live holder of the entry (see
//! [`holders`]), adds its own counts and writes its new count in the same
//! compare-and-swap, so two workers never both take the last slot. A
//! holder whose lease has passed is not counted and is dropped by the next
//! writer. A worker's id is a shared counter (`tg2|d|workers`) in its high
//! half and clock bits in its low half: ids do not repeat in one Envoy
//! process even when two VMs created the counter at once.
//!
//! Envoy's shared data has no create-if-absent: a write to a key that does
//! not exist yet is unconditional, so two workers creating one key at once
//! lose one write. [`Worker::prepare`] creates every key admission control
//! writes, empty, when a policy is configured (before its requests), so
//! later writes are real compare-and-swaps; a count lost anyway (a tenant
//! slot created by two workers at once) is republished at its worker's
//! next renewal, within 500 ms and a tick.
//!
//! # THE BOUND on a leaked slot
//! A worker renews its leases on its tick when less than
//! [`RENEW_BEFORE_NS`] is left, and on every acquire or release, to
//! `now + LEASE_NS` ([`LEASE_NS`] = 2 s). A VM that crashes, is replaced by
//! a reload, or stops ticking publishes nothing more, so **its slots stop
//! counting at most [`LEASE_NS`] (2 s) after its last publish**, by every
//! reader's clock; nothing else can leak a slot (a stream's [`Ticket`] is
//! released exactly once: [`Worker::release`] takes it by value). The
//! price: a live worker whose tick is late by more than 1.5 s is under-counted
//! until it publishes again (over-admission by its own in-flight count, for
//! that long). A wall-clock jump forward expires leases early in the same
//! way; a jump backwards only makes them last longer.
//!
//! # Failures
//! A compare-and-swap that stays conflicted ([`crate::table::MAX_CAS_ATTEMPTS`])
//! refuses with `contention`, a host failure with `state_unavailable`:
//! never a silent admission. A failed release or renewal leaves the
//! worker's count right in memory, marked dirty, and the next tick
//! publishes it. A tenant slot that overflowed the key table shares the
//! overflow entry `tg2|o|~d.<name>|tenant` with every other overflowing
//! tenant (their share is then counted together: stricter, never looser).
//!
//! Pure: time is `now`, the host is [`Host`].
//!
//! Why this file is over 800 lines: about 100 are the rule above, and the
//! rest is one [`Worker`]'s methods over its private state (acquire, give
//! back, publish, renew), which a split would have to expose to a second
//! file. What needs no worker state is elsewhere: the limits arithmetic
//! (`limits.rs`), tickets and refusals (`ticket.rs`), the decision record
//! (`record.rs`), the records' bytes ([`crate::inflight`]).

pub mod breaker;
pub mod controller;
pub mod degraded;
mod limits;
pub mod queue;
mod record;
pub mod request;
pub mod retry;
mod ticket;
pub mod window;

use hashbrown::HashMap;

use crate::engine::{Reason, Subject};
use crate::host::Host;
use crate::inflight as holders;
pub use crate::inflight::{Counts, Holder};
use crate::keys::{self, kind};
use crate::limiter::NANOS_PER_SEC;
use crate::policy::admission::{ActionLimit, Criticality, Dependency, Labels, DEFAULT_RETRY_AFTER_WINDOW_NS};
use crate::policy::{Policy, RouteClass};
use crate::table::{self, push_record_with, Commit, Failure, Overflow, Place, Reach, Record};
use limits::pool_use;
pub use limits::{
    admits, admits_at, admits_within, ceiling, effective_limit, effective_limits, Control, Limits,
    SHED_CEILING_PCT,
};
pub use record::{in_flight, DecisionRecord};
pub use ticket::{Limited, ProbeTicket, Refusal, Ticket};

/// How long a published count stays counted without a renewal.
pub const LEASE_NS: u64 = 2 * NANOS_PER_SEC;
/// The tick renews a lease with less than this left.
/// (1.5 s: a lease is renewed 500 ms after it was written, so a tick may
/// be 1.5 s late before others stop counting the worker's slots.)
pub const RENEW_BEFORE_NS: u64 = LEASE_NS / 4 * 3;
/// The plan name of a tenant-share slot's overflow entry.
const TENANT_OVERFLOW_PLAN: &str = "tenant";

/// The key-table key of a subject's slots at a dependency.
pub fn tenant_key(dependency: &str, subject: &Subject) -> String {
    crate::engine::logical_key(&tenant_action(dependency), subject)
}

fn tenant_action(dependency: &str) -> String {
    format!("~d.{dependency}")
}

/// The key-table reach of tenant slots: idle when no holder is live.
const INSERT: Reach<'static> = Reach::Insert {
    is_idle: &holders::record_is_idle,
};

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

/// One place this worker has published counts in.
#[derive(Debug)]
struct Held {
    /// `None`: a fixed entry; `Some`: a key-table slot of that many entries.
    table_entries: Option<u64>,
    /// The overflow action of a key-table slot.
    overflow_action: String,
    /// Slots its streams hold.
    counts: Counts,
    /// Spare slots it published and holds for its next requests (see
    /// [`PERMIT_SHARE`]): published = `counts + permits`.
    permits: Counts,
    /// Slots taken here this tick and the last (how many permits to ask for).
    taken: u32,
    taken_last: u32,
    /// The occupancy its last shared take saw (a permit's record).
    occupancy: u32,
    lease_until: u64,
    /// Memory and shared data may differ: publish on the next tick.
    dirty: bool,
}

impl Held {
    fn published(&self) -> Counts {
        self.counts.plus(&self.permits)
    }
}

/// Permits: a worker may publish a few spare slots of a normal or
/// sheddable level of a dependency (or of an action limit) beyond its
/// streams' and hand them to its next requests with no shared data, while
/// the place is far from its limit: a take asks for as many as the place
/// took on this worker in the last tick, and gets at most `1/PERMIT_SHARE`
/// of the level's ceiling, and only while the occupancy after it (every
/// worker's published slots, permits included) stays within `1/PERMIT_SHARE`
/// of the ceiling. Permits are published like any slot, so **in flight
/// never exceeds any limit**; a released slot becomes a permit again; every
/// permit is given back on the worker's next tick. Since permits are only
/// made while the published occupancy is within a quarter of the ceiling,
/// permits never hold more than a quarter of it node-wide: a request is
/// refused for permits it cannot use only when a level's streams hold at
/// least three quarters of its ceiling, and for at most one tick. Never
/// for a reserved level, a stream, a tenant's share, a dependency under a
/// breaker's cap or an adaptive controller (whose signals count in flight).
pub const PERMIT_SHARE: u32 = 4;

/// A worker VM's slots (one per VM; see the module header).
#[derive(Debug)]
pub struct Worker {
    id: u64,
    held: HashMap<String, Held>,
    buffers: table::Buffers,
    /// Dependency key → its control state as last read on the tick.
    controls: HashMap<String, Control>,
    /// Dependency key → open → half-open transitions this worker's probe
    /// tickets made since its tick last asked ([`Worker::take_probe_events`]).
    probe_events: HashMap<String, ProbeEvents>,
}

/// What this worker's probe tickets did to a breaker, for the stats. (The
/// probes themselves are counted by the pipeline when their requests go on
/// to the dependency: a ticket given back is no probe.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProbeEvents {
    /// Tickets whose write made the open → half-open transition.
    pub half_opened: u64,
}

/// What a take decides from the others' counts (`Err`: refused, with the
/// occupancy it saw).
type Decide<'a> = &'a dyn Fn(&Counts) -> Result<Taken, (Reason, Counts)>;

/// What a worker publishes at a place ([`Worker::write`]).
enum Publish<'a> {
    /// These counts, whatever the others hold (a release, a renewal).
    Exactly(Counts),
    /// What a take decides.
    Checked(Decide<'a>),
}

/// What a take saw and published.
#[derive(Debug, Clone, Copy)]
struct Taken {
    /// Every worker's published slots before it, this one's included.
    occupancy: Counts,
    /// What this worker published.
    mine: Counts,
    /// Of those, its permits.
    permits: Counts,
}

/// Every failure of the table is a refusal, never an admission.
fn failure_reason(f: Failure) -> Reason {
    match f {
        Failure::Exhausted => Reason::Contention,
        Failure::Unavailable { .. } | Failure::Absent | Failure::TooLarge => Reason::StateUnavailable,
    }
}

/// Permits a place with a `ceiling` can spare at an occupancy of `used`
/// (see [`PERMIT_SHARE`]): none unless `used` plus this request and them
/// stays within a quarter of the ceiling, at most a quarter of it.
fn permit_room(ceiling: u64, used: u64) -> u32 {
    let quarter = ceiling / u64::from(PERMIT_SHARE);
    let room = quarter.saturating_sub(used.saturating_add(1));
    u32::try_from(room).unwrap_or(u32::MAX)
}

/// `Retry-After` for a refusal: at least `min_secs` (the real estimate,
/// at least 1) plus a jitter in `[0, window)` from `seed`, so refused
/// clients do not all come back in the same second.
pub fn jittered_retry_after_secs(min_secs: u64, window_ns: u64, seed: u64) -> u64 {
    let window = (window_ns / NANOS_PER_SEC).max(1);
    min_secs.max(1).saturating_add(splitmix64(seed) % window)
}

/// A well-mixed 64-bit hash (SplitMix64's finaliser).
pub fn splitmix64(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Worker {
    /// A worker with a fresh id from the node's shared counter.
    pub fn register<H: Host>(host: &H, now: u64) -> Result<Worker, Reason> {
        let mut buffers = table::Buffers::default();
        let read = |records: Option<&table::Records<'_>>| {
            records
                .and_then(|rs| rs.iter().find(|r| r.kind == kind::WORKER_COUNTER).copied())
                .and_then(|r: Record<'_>| r.state.try_into().ok())
                .map_or(0, u64::from_le_bytes)
        };
        let updated = table::update(
            host,
            &Place::Fixed {
                key: keys::WORKER_COUNTER,
            },
            &INSERT,
            now,
            &mut buffers,
            |records, out| {
                let id = read(records).saturating_add(1);
                out.push(1);
                push_record_with(out, 0, kind::WORKER_COUNTER, 0, 0, |o| {
                    o.extend_from_slice(&id.to_le_bytes())
                });
                (Commit::Write, id)
            },
        )
        .map_err(failure_reason)?;
        // The counter in the high half; the low half from the clock, so
        // that two VMs that both created the counter at once (shared data
        // has no create-if-absent: both writes are unconditional) still
        // get different ids.
        let clock_bits = splitmix64(now) & 0xffff_ffff;
        Ok(Worker::with_id((updated.result << 32) | clock_bits))
    }

    /// Creates the shared entries a policy's admission control writes to
    /// (each dependency's and action limit's, and the worker counter) if they are absent, with
    /// nothing in them. Called on configure, before any request: Envoy's
    /// shared data has no create-if-absent, so two workers writing a key
    /// that does not exist yet both write unconditionally and one write is
    /// lost. Once a key exists every write is a real compare-and-swap. (A
    /// count lost in that first race is republished by its worker within
    /// `LEASE_NS − RENEW_BEFORE_NS` (500 ms) and a tick.)
    pub fn prepare<H: Host>(host: &H, policy: &Policy, now: u64) {
        let mut buffers = table::Buffers::default();
        let places = policy
            .dependencies
            .iter()
            .map(|d| (d.key.as_str(), kind::IN_FLIGHT))
            .chain(policy.actions.iter().map(|a| (a.key.as_str(), kind::IN_FLIGHT)))
            .chain([(keys::WORKER_COUNTER, kind::WORKER_COUNTER)]);
        for d in policy.dependencies.iter().filter(|d| d.breaker.is_some()) {
            breaker::prepare(host, &d.breaker_key, now, &mut buffers);
        }
        for (key, record_kind) in places {
            let _ = table::update(
                host,
                &Place::Fixed { key },
                &INSERT,
                now,
                &mut buffers,
                |records, out| {
                    if records.is_some() {
                        return (Commit::Skip, ());
                    }
                    if record_kind == kind::IN_FLIGHT {
                        // An empty holder list.
                        holders::write(&holders::Holders::default(), &Holder::default(), now, out);
                    } else {
                        out.push(1);
                        push_record_with(out, 0, kind::WORKER_COUNTER, 0, 0, |o| {
                            o.extend_from_slice(&0u64.to_le_bytes())
                        });
                    }
                    (Commit::BestEffort, ())
                },
            );
        }
    }

    /// A worker with a given id (tests; ids must be unique per node).
    pub fn with_id(id: u64) -> Worker {
        Worker {
            id,
            held: HashMap::new(),
            buffers: table::Buffers::default(),
            controls: HashMap::new(),
            probe_events: HashMap::new(),
        }
    }

    /// Changes a dependency's control state (on the tick, from shared
    /// data): each part (the controller's limit, …) sets its own fields.
    pub fn update_control(&mut self, dependency_key: &str, change: impl FnOnce(&mut Control)) {
        let mut control = self.control(dependency_key);
        change(&mut control);
        if control == Control::default() {
            self.controls.remove(dependency_key);
        } else if let Some(c) = self.controls.get_mut(dependency_key) {
            *c = control;
        } else {
            self.controls.insert(dependency_key.to_owned(), control);
        }
    }

    /// The probes taken at a dependency since the last call (stats).
    pub fn take_probe_events(&mut self, dependency_key: &str) -> ProbeEvents {
        if self.probe_events.is_empty() {
            return ProbeEvents::default();
        }
        self.probe_events.remove(dependency_key).unwrap_or_default()
    }

    /// A dependency's control state as this worker knows it.
    pub fn control(&self, dependency_key: &str) -> Control {
        if self.controls.is_empty() {
            return Control::default();
        }
        self.controls.get(dependency_key).copied().unwrap_or_default()
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// This worker's own counts at a place (a dependency key or tenant key).
    pub fn own(&self, key: &str) -> Counts {
        self.held.get(key).map(|h| h.counts).unwrap_or_default()
    }

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

    /// Gives back everything a request took that never reached its
    /// dependency (a later check refused it): its slots, and its probe
    /// ticket to the half-open period it was taken in.
    pub fn cancel<H: Host>(&mut self, host: &H, mut ticket: Ticket, now: u64) {
        if let Some(p) = ticket.probe.take() {
            if let Err(f) = breaker::give_back_probe(host, &p.breaker_key, p.period, now, &mut self.buffers) {
                // Lost to its period, which the lost-probe rule ends.
                log::debug!("tenantgate: a probe ticket could not be given back: {f:?}");
            }
        }
        self.release(host, ticket, now);
    }

    /// Gives a stream's slot back (every end of a stream: complete, reset,
    /// local reply, client gone). Never fails: the worker's count is right
    /// in memory at once; shared data follows now or on the next tick.
    pub fn release<H: Host>(&mut self, host: &H, ticket: Ticket, now: u64) {
        let Ticket {
            dependency,
            action,
            tenant,
            level,
            streaming,
            ..
        } = ticket;
        for key in [dependency, action, tenant].into_iter().flatten() {
            self.give(host, &key, now, level, streaming);
        }
    }

    /// On the tick: publishes what is dirty and renews leases with less
    /// than [`RENEW_BEFORE_NS`] left; forgets places it holds nothing in
    /// once shared data agrees.
    pub fn renew<H: Host>(&mut self, host: &H, now: u64) {
        // Every permit goes back (see PERMIT_SHARE); the slots taken this
        // tick say how many to ask for next.
        for h in self.held.values_mut() {
            h.taken_last = std::mem::take(&mut h.taken);
            if !h.permits.is_zero() {
                h.permits = Counts::default();
                h.dirty = true;
            }
        }
        let due: Vec<String> = self
            .held
            .iter()
            .filter(|(_, h)| {
                h.dirty || (!h.counts.is_zero() && h.lease_until < now.saturating_add(RENEW_BEFORE_NS))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in due {
            self.publish(host, &key, now);
        }
        self.held
            .retain(|_, h| h.dirty || !h.counts.is_zero() || h.taken_last > 0);
    }

    /// Places with a count or a pending write (for tests and stats).
    pub fn places(&self) -> usize {
        self.held.len()
    }

    /// One more slot at `key` if `check(others + own)` passes: from a
    /// permit of its level (no shared data), else one update, which may
    /// take permits too (`room`: how many the place can spare at an
    /// occupancy, see [`PERMIT_SHARE`]). `Err`: the reason and the
    /// occupancy it saw.
    #[allow(clippy::too_many_arguments)]
    fn take<H: Host>(
        &mut self,
        host: &H,
        key: &str,
        table_entries: Option<u64>,
        overflow_action: &str,
        now: u64,
        level: usize,
        streaming: bool,
        check: &dyn Fn(&Counts) -> Result<(), Reason>,
        room: &dyn Fn(&Counts) -> u32,
    ) -> Result<Counts, (Reason, Counts)> {
        let (own, permits, want) = match self.held.get_mut(key) {
            Some(h) => {
                h.taken = h.taken.saturating_add(1);
                let spare = h.permits.levels.get(level).copied().unwrap_or(0);
                if !streaming && spare > 0 {
                    h.permits.sub(level, false);
                    h.counts.add(level, false);
                    // The occupancy as last seen (a permit reads nothing).
                    let mut seen = Counts::default();
                    if let Some(l) = seen.levels.get_mut(level) {
                        *l = h.occupancy;
                    }
                    return Ok(seen);
                }
                (h.counts, h.permits, h.taken_last)
            }
            None => (Counts::default(), Counts::default(), 0),
        };
        let mut after = own;
        after.add(level, streaming);
        let written = self.write(
            host,
            key,
            table_entries,
            overflow_action,
            now,
            Publish::Checked(&|others| {
                let occupancy = others.plus(&own).plus(&permits);
                check(&occupancy).map_err(|r| (r, occupancy))?;
                let mut spare = permits;
                if !streaming && want > 0 {
                    if let Some(p) = spare.levels.get_mut(level) {
                        *p = p.saturating_add(want.min(room(&occupancy)));
                    }
                }
                Ok(Taken {
                    occupancy,
                    mine: after.plus(&spare),
                    permits: spare,
                })
            }),
        );
        match written {
            Ok(Ok(taken)) => {
                self.set(key, table_entries, overflow_action, after, now, false);
                if let Some(h) = self.held.get_mut(key) {
                    h.permits = taken.permits;
                    h.occupancy = taken.occupancy.total();
                    if h.taken == 0 {
                        h.taken = 1;
                    }
                }
                Ok(taken.occupancy)
            }
            Ok(Err(refused)) => Err(refused),
            Err(reason) => Err((reason, Counts::default())),
        }
    }

    /// One slot fewer at `key`: kept as a permit while the place holds
    /// permits of its level (no shared data), else published now if
    /// possible.
    fn give<H: Host>(&mut self, host: &H, key: &str, now: u64, level: usize, streaming: bool) {
        if let Some(h) = self.held.get_mut(key) {
            h.counts.sub(level, streaming);
            let keeps = !streaming && h.permits.levels.get(level).is_some_and(|p| *p > 0);
            if keeps {
                h.permits.add(level, false);
                return;
            }
            h.dirty = true;
        }
        self.publish(host, key, now);
    }

    /// Writes this worker's count at `key` as it is in memory (its permits
    /// included).
    fn publish<H: Host>(&mut self, host: &H, key: &str, now: u64) {
        let Some(h) = self.held.get(key) else { return };
        let (entries, action, counts, published) = (
            h.table_entries,
            h.overflow_action.clone(),
            h.counts,
            h.published(),
        );
        let written = self.write(host, key, entries, &action, now, Publish::Exactly(published));
        self.set(key, entries, &action, counts, now, written.is_err());
    }

    fn set(
        &mut self,
        key: &str,
        table_entries: Option<u64>,
        action: &str,
        counts: Counts,
        now: u64,
        dirty: bool,
    ) {
        let lease_until = now.saturating_add(LEASE_NS);
        match self.held.get_mut(key) {
            Some(h) => {
                h.counts = counts;
                if dirty {
                    // Not written: its permits are not published either.
                    h.permits = Counts::default();
                }
                h.dirty = dirty;
                if !dirty {
                    h.lease_until = lease_until;
                    // Where it was last written (a reload may resize the
                    // key table: a count left at the old place expires
                    // with its lease).
                    h.table_entries = table_entries;
                    if h.overflow_action != action {
                        action.clone_into(&mut h.overflow_action);
                    }
                }
            }
            None => {
                self.held.insert(
                    key.to_owned(),
                    Held {
                        table_entries,
                        overflow_action: action.to_owned(),
                        counts,
                        permits: Counts::default(),
                        taken: 0,
                        taken_last: 0,
                        occupancy: 0,
                        lease_until: if dirty { 0 } else { lease_until },
                        dirty,
                    },
                );
            }
        }
    }

    /// The one update of a place: reads every holder, decides what this
    /// worker publishes ([`Publish`]; a refusal writes nothing), writes it
    /// with a fresh lease.
    fn write<H: Host>(
        &mut self,
        host: &H,
        key: &str,
        table_entries: Option<u64>,
        overflow_action: &str,
        now: u64,
        publish: Publish<'_>,
    ) -> Result<Result<Taken, (Reason, Counts)>, Reason> {
        let place = match table_entries {
            None => Place::Fixed { key },
            Some(entries) => Place::Table {
                logical: key.as_bytes(),
                entries,
                overflow: Overflow {
                    action: overflow_action,
                    plan: TENANT_OVERFLOW_PLAN,
                },
            },
        };
        let worker = self.id;
        let updated = table::update(host, &place, &INSERT, now, &mut self.buffers, |records, out| {
            let listed = holders::of_records(records);
            let others = holders::others(&listed, worker, now);
            let verdict = match &publish {
                Publish::Checked(check) => check(&others),
                Publish::Exactly(mine) => Ok(Taken {
                    occupancy: others,
                    mine: *mine,
                    permits: Counts::default(),
                }),
            };
            let Ok(taken) = verdict else {
                return (Commit::Skip, Ok(verdict));
            };
            let me = Holder {
                worker,
                lease_until: now.saturating_add(LEASE_NS),
                counts: taken.mine,
            };
            if !holders::write(&listed, &me, now, out) {
                return (Commit::Skip, Err(Reason::StateUnavailable));
            }
            (Commit::Write, Ok(Ok(taken)))
        });
        match updated {
            Ok(u) => u.result,
            Err(f) => Err(failure_reason(f)),
        }
    }
}

#[cfg(test)]
mod permit_tests;
#[cfg(test)]
mod tests;
