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
//! # Where it is
//! | what | file |
//! |---|---|
//! | a [`Worker`], its registration, the keys it prepares, its control copies | here |
//! | acquire: the gate, the tenant's share, the action, the dependency, the probe ticket | `acquire.rs` |
//! | give back: cancel, release, the tick's renewal | `give_back.rs` |
//! | what the worker holds at each place and the one update that publishes it (permits) | `held.rs` |
//! | the limits arithmetic (levels, ceilings, the controller's and breaker's caps) | `limits.rs` |
//! | tickets and refusals | `ticket.rs` |
//! | the decision record; the node-wide in-flight view | `record.rs` |
//! | the holders' records in bytes | [`crate::inflight`] |

mod acquire;
pub mod adaptive;
pub mod breaker;
pub mod controller;
pub mod degraded;
mod give_back;
mod held;
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
use crate::policy::Policy;
use crate::table::{self, push_record_with, Commit, Failure, Place, Reach, Record};
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

/// Every failure of the table is a refusal, never an admission.
fn failure_reason(f: Failure) -> Reason {
    match f {
        Failure::Exhausted => Reason::Contention,
        Failure::Unavailable { .. } | Failure::Absent | Failure::TooLarge => Reason::StateUnavailable,
    }
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

    /// Places with a count or a pending write (for tests and stats).
    pub fn places(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod permit_tests;
#[cfg(test)]
mod tests;
