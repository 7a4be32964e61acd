//! Applying the central service's answer to a node's stored allowances,
//! over shared data: the second half of a node's sync, after
//! [`super::shared`] claimed the interval, scanned the key table and sent
//! the report. Pure apart from the [`Host`].
//!
//! # Applying an answer
//! [`accept`] updates the state first, by compare-and-swap (the report
//! acknowledged, contact renewed, the application marked under way in
//! [`SyncState::applying`]), so an answer is accepted at most once. Then
//! [`apply_step`] applies it to key slots **in steps**: at most
//! [`APPLY_PER_STEP`] (256) keys each, fewer when the caller's time budget
//! is spent (asked every [`APPLY_CHECK_EVERY`] keys, so the core reads no
//! clock). The glue runs one step in the response callback, then one on
//! each of that worker's ticks: an answer to a full report (4,096 keys)
//! takes 16 steps, 0.16 s. The worker holds the rest in its memory: one
//! answer at most, its first [`MAX_REPORTS`] leases (more are ignored and
//! counted), at most `2 × MAX_REPORTS` keys. Each key's slot is updated
//! by compare-and-swap (at most [`MAX_CAS_ATTEMPTS`] tries):
//! * the counts the report carried are subtracted, once;
//! * the lease is installed with its tokens less what the node admitted
//!   on leases since the report was built: the difference of two readings
//!   of `lease_used`, which counts every admission on any lease, before or
//!   after receipt, so a key applied steps later is charged exactly (no
//!   token created, none lost);
//! * its TTL counts from the answer's **receipt**: a lease installed steps
//!   later lives that much less, never more.
//!
//! A key whose slot cannot be updated keeps its counts: they are reported
//! again (the service then counts them twice, which errs toward admitting
//! less). Until its step, a key decides with what it had (its old lease,
//! its provisional allowance, or it awaits).
//!
//! **The next report waits.** No worker claims a report while an
//! application is under way, so no count is carried by two reports (one
//! carried by the report being applied and again by the next would be
//! subtracted twice: counts lost, admitting more). The applying worker
//! clears the mark after its last step. It drops the rest itself
//! [`APPLY_MAX_NS`] after receipt (128 steps of at least 64 keys fit in
//! it); another worker gives up on the mark [`super::shared::APPLY_GRACE_NS`] later, so
//! the next scan never runs beside a step still writing, and each step
//! first checks that the mark is still its own. (If clearing the mark
//! fails, shared data down or contended 16 times, the next report waits
//! for that grace too.)
//!
//! **A worker that stops mid-application** (its VM torn down) loses the
//! rest: those keys keep their counts and are reported again by the next
//! report, `APPLY_MAX_NS + APPLY_GRACE_NS` (3 s) after receipt at the
//! latest; their leases do not come until then (they err toward admitting
//! less).
//!
//! **A reload mid-application**: the rest is applied under the worker's
//! current policy (its key table; a lease only for a limit still global
//! in it, its TTL at most the new `max_ttl`); a policy that no longer
//! syncs drops the rest (counts kept).

use std::collections::BTreeMap;

use super::cycle::{ApplyError, Applying, SyncState};
use super::node::{Counts, Granted};
use super::protocol::SyncResponse;
use super::shared::{
    read_state, update_state, write_state, APPLY_CHECK_EVERY, APPLY_MAX_NS, APPLY_PER_STEP, MAX_CAS_ATTEMPTS,
    MAX_REPORTS,
};
use super::stored::{self, SYNC_CARRIED_KEY};
use crate::host::{CasResult, Host, HostError};
use crate::keys::kind;
use crate::policy::{Policy, SyncSettings};
use crate::table::{self, Commit, Failure, Overflow, Place, Reach};

const NANOS_PER_MS: u64 = 1_000_000;

/// Why an answer was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotApplied {
    /// Not the report in flight, or too late (see [`ApplyError`]).
    Refused(ApplyError),
    /// Shared data failed or stayed contended.
    State,
}

/// What applying an answer did (so far).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Leases installed.
    pub leases: usize,
    /// Keys whose slot could not be updated (counts kept, lease lost).
    pub missed: usize,
    /// Keys left unapplied because the application was dropped (counts
    /// kept, lease lost; see [`Step::Dropped`]).
    pub dropped: usize,
    /// Leases beyond [`MAX_REPORTS`] in the answer, ignored.
    pub ignored: usize,
    /// Steps (worker callbacks) it took.
    pub steps: u32,
}

/// What a report carried for one (key, limit): the counts to subtract
/// and the allowance's `lease_used` when the report was built.
#[derive(Debug, Clone, Copy)]
struct Ack {
    counts: Counts,
    lease_used: u64,
}

/// One limit's update in a key's slot.
#[derive(Debug, Clone, Copy)]
struct LimitUpdate {
    name_hash: u32,
    ack: Option<Ack>,
    /// A lease of the answer, its TTL clamped to the answer's bounds.
    lease: Option<Granted>,
}

/// One key slot's updates.
#[derive(Debug, Clone)]
struct KeyUpdate {
    key: Vec<u8>,
    limits: Vec<LimitUpdate>,
}

/// An accepted answer, applied to key slots a chunk at a time
/// ([`apply_step`]) by the worker that received it. At most
/// `2 × MAX_REPORTS` keys (each key the report carried, each leased).
#[derive(Debug, Clone)]
pub struct Application {
    /// The report it answers.
    pub seq: u64,
    /// When it was received: its leases' TTLs count from then.
    pub received_at: u64,
    keys: Vec<KeyUpdate>,
    /// The next key to update.
    next: usize,
    pub applied: Applied,
}

impl Application {
    /// Keys still to update.
    pub fn remaining(&self) -> usize {
        self.keys.len().saturating_sub(self.next)
    }
}

/// What one [`apply_step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Keys remain: call again on the worker's next tick.
    More,
    /// Every key updated (or missed); the node may report again.
    Done,
    /// The rest was not applied: the application outlived
    /// [`APPLY_MAX_NS`], another worker gave up on it, or the policy no
    /// longer syncs. Those keys keep their counts (reported again).
    Dropped,
}

/// Accepts the answer to the report in flight: the state is updated at
/// once, by compare-and-swap (the report acknowledged, contact renewed,
/// the application marked under way), so an answer is accepted at most
/// once. Then [`apply_step`] applies it to key slots.
pub fn accept<H: Host>(
    host: &H,
    policy: &Policy,
    settings: &SyncSettings,
    resp: &SyncResponse,
    now: u64,
) -> Result<Application, NotApplied> {
    let max_ttl = settings.max_ttl_ns;
    let ttl = |ms: u64| ms.saturating_mul(NANOS_PER_MS).min(max_ttl);
    let leases = &resp.leases[..resp.leases.len().min(MAX_REPORTS)];
    let longest = leases.iter().map(|l| ttl(l.ttl_ms)).max().unwrap_or(0);
    let mut accepted = None;
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (current, cas) = read_state(host).map_err(|_| NotApplied::State)?;
        let Some(mut s) = current else {
            return Err(NotApplied::Refused(ApplyError::Stale));
        };
        let f = s
            .accept(resp.ack_seq, now, settings.timeout_ns)
            .map_err(NotApplied::Refused)?;
        s.applied(f.seq, resp.interval_ms, longest, max_ttl, now);
        s.applying = Some(Applying {
            seq: f.seq,
            since: now,
        });
        if write_state(host, &s, cas).map_err(|_| NotApplied::State)? == CasResult::Written {
            accepted = Some(f);
            break;
        }
    }
    let Some(f) = accepted else {
        return Err(NotApplied::State);
    };

    // Per key, per limit: what to acknowledge and which lease to install.
    let mut updates: BTreeMap<Vec<u8>, BTreeMap<u32, LimitUpdate>> = BTreeMap::new();
    fn limit(
        updates: &mut BTreeMap<Vec<u8>, BTreeMap<u32, LimitUpdate>>,
        key: Vec<u8>,
        name_hash: u32,
    ) -> &mut LimitUpdate {
        updates
            .entry(key)
            .or_default()
            .entry(name_hash)
            .or_insert(LimitUpdate {
                name_hash,
                ack: None,
                lease: None,
            })
    }
    if let Ok((Some(bytes), _)) = host.shared_get(SYNC_CARRIED_KEY) {
        if let Some((seq, items)) = stored::decode_carried(&bytes) {
            if seq == f.seq {
                for c in items {
                    limit(&mut updates, c.key, c.name_hash).ack = Some(Ack {
                        counts: c.counts,
                        lease_used: c.lease_used,
                    });
                }
            }
        }
    }
    for l in leases {
        let hash = crate::policy::limit_name_hash(&l.limit);
        if policy.global_limit_name(hash) != Some(l.limit.as_str()) {
            continue;
        }
        limit(&mut updates, l.key.as_bytes().to_vec(), hash).lease =
            Some(Granted::from_wire(l, ttl(l.ttl_ms)));
    }
    let keys = updates
        .into_iter()
        .map(|(key, limits)| KeyUpdate {
            key,
            limits: limits.into_values().collect(),
        })
        .collect();
    Ok(Application {
        seq: f.seq,
        received_at: now,
        keys,
        next: 0,
        applied: Applied {
            ignored: resp.leases.len().saturating_sub(leases.len()),
            ..Applied::default()
        },
    })
}

/// Applies the next chunk of `app` to key slots: at most
/// [`APPLY_PER_STEP`] keys, fewer when `time_up` says so (asked every
/// [`APPLY_CHECK_EVERY`] keys; the glue's wall-clock budget, so the core
/// stays clock-free). `policy` is the worker's current one (it may have
/// been reloaded since the answer was accepted: see the module header).
pub fn apply_step<H: Host>(
    host: &H,
    policy: &Policy,
    app: &mut Application,
    now: u64,
    mut time_up: impl FnMut() -> bool,
) -> Step {
    app.applied.steps = app.applied.steps.saturating_add(1);
    let ours = |s: &SyncState| s.applying.is_some_and(|a| a.seq == app.seq);
    let mine = matches!(read_state(host), Ok((Some(s), _)) if ours(&s));
    let settings = policy.sync.as_ref().filter(|_| policy.has_global_limits());
    let expired = now >= app.received_at.saturating_add(APPLY_MAX_NS);
    let Some(settings) = settings.filter(|_| mine && !expired) else {
        app.applied.dropped = app.remaining();
        app.next = app.keys.len();
        if mine {
            let _ = finish(host, app.seq);
        }
        return Step::Dropped;
    };
    let end = app.next.saturating_add(APPLY_PER_STEP).min(app.keys.len());
    let mut done = 0;
    while app.next < end {
        if done > 0 && done % APPLY_CHECK_EVERY == 0 && time_up() {
            break;
        }
        let Some(u) = app.keys.get(app.next) else {
            break;
        };
        match update_slot(host, policy, settings, &u.key, &u.limits, app.received_at, now) {
            Some(n) => app.applied.leases += n,
            None => app.applied.missed += 1,
        }
        app.next += 1;
        done += 1;
    }
    if app.next < app.keys.len() {
        return Step::More;
    }
    let _ = finish(host, app.seq);
    Step::Done
}

/// Clears the application of `seq` from the state: the next report may
/// start.
fn finish<H: Host>(host: &H, seq: u64) -> Result<bool, HostError> {
    update_state(host, |s| {
        if s.applying.is_some_and(|a| a.seq == seq) {
            s.applying = None;
            true
        } else {
            false
        }
    })
}

/// Accepts the answer and applies all of it at once (the simulator, and
/// tests; the glue spreads [`apply_step`] over ticks).
pub fn apply<H: Host>(
    host: &H,
    policy: &Policy,
    settings: &SyncSettings,
    resp: &SyncResponse,
    now: u64,
) -> Result<Applied, NotApplied> {
    let mut app = accept(host, policy, settings, resp, now)?;
    while apply_step(host, policy, &mut app, now, || false) == Step::More {}
    Ok(app.applied)
}

/// Applies one key's updates to its slot: leases installed (expiring
/// `ttl` after `received_at`), or `None` if the slot could not be written
/// (a key no longer in the table is fine: `Some(0)`).
fn update_slot<H: Host>(
    host: &H,
    policy: &Policy,
    settings: &SyncSettings,
    key: &[u8],
    limits: &[LimitUpdate],
    received_at: u64,
    now: u64,
) -> Option<usize> {
    let place = Place::Table {
        logical: key,
        entries: policy.key_table_entries,
        // Never used: an update only reaches the key's existing slot.
        overflow: Overflow { action: "", plan: "" },
    };
    let mut buffers = table::Buffers::default();
    let updated = table::update(
        host,
        &place,
        &Reach::Existing,
        now,
        &mut buffers,
        |records, out| {
            let Some(records) = records else {
                return (Commit::Skip, None);
            };
            let mut leases = 0;
            out.push(records.len() as u8);
            for r in records {
                let update = limits.iter().find(|u| u.name_hash == r.name_hash);
                let allowance = (r.kind == kind::GLOBAL_ALLOWANCE)
                    .then(|| stored::decode_allowance(r.state))
                    .flatten();
                match (update, allowance) {
                    (Some(u), Some(mut a)) => {
                        let mut mark = a.lease_used;
                        if let Some(ack) = u.ack {
                            a.ack(&ack.counts);
                            mark = ack.lease_used;
                        }
                        // A limit a reload removed gets no lease; a reload
                        // that shortened the longest TTL shortens it.
                        let lease = u
                            .lease
                            .filter(|_| policy.global_limit_name(r.name_hash).is_some());
                        if let Some(l) = lease {
                            let used = a.lease_used.wrapping_sub(mark);
                            let granted = Granted {
                                ttl_ns: l.ttl_ns.min(settings.max_ttl_ns),
                                ..l
                            };
                            a.install(granted, used, received_at);
                            leases += 1;
                        }
                        table::push_record_with(out, r.name_hash, r.kind, r.p1, r.p2, |o| {
                            stored::encode_allowance(&a, o)
                        });
                    }
                    _ => table::push_record(out, r.name_hash, r.kind, r.p1, r.p2, r.state),
                }
            }
            (Commit::Write, Some(leases))
        },
    );
    match updated {
        Ok(u) => u.result,
        // Not in the table (reclaimed meanwhile): nothing to update.
        Err(Failure::Absent) => Some(0),
        Err(Failure::Unavailable { .. } | Failure::Exhausted | Failure::TooLarge) => None,
    }
}
