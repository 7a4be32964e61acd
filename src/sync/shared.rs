//! A node's sync with the central cluster, over shared data: which worker
//! reports this interval, building the report from the key table, and
//! applying the answer to the stored allowances. Pure apart from the
//! [`Host`]: the glue only adds the tick, the callout and the stats.
//!
//! # One worker per interval
//! Every worker reads [`SYNC_STATE_KEY`] on its tick. When an interval has
//! passed since the last report started and no report is in flight (or the
//! one in flight is older than an interval), a worker starts the next
//! report in the state and writes it back by compare-and-swap: the one
//! whose write lands has **won** the interval ([`claim`]); the others see
//! the report in flight on their next tick. The winner scans the key table
//! in bounded steps ([`scan_step`]), sends one batched callout, and marks
//! the report sent ([`sent`]). Its answer comes back to the same worker,
//! which applies it ([`apply`]).
//!
//! # Retry
//! A report unanswered within the callout timeout is given up on then
//! (its answer would be refused as late), and a report whose callout
//! failed at once ([`abandon`]) likewise; the next [`claim`] sends it
//! again **at once**, once, under a new `seq`, before the interval is due
//! ([`super::cycle::Retry`]): one lost message costs a node the timeout, not
//! an interval of its leases (issue 35: the simulator's `lossy` scenario
//! went from 81 % to 90.5 % of the limit on 3×3). The report and its retry
//! count as one failure for the breaker; the interval's cadence stays.
//!
//! # Circuit breaker
//! The breaker (see [`super::node`]) lives in the same state and is
//! updated by the same compare-and-swap, so every worker agrees: a failed
//! report is counted once, by the worker that clears it from the state
//! ([`abandon`], or [`claim`] giving up on it), and while the breaker is
//! open the worker that wins a due interval skips it
//! ([`Claim::Skipped`]) instead of reporting.
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
//! it); another worker gives up on the mark [`APPLY_GRACE_NS`] later, so
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

use super::cycle::{ApplyError, Applying, BreakerState, Retry, SyncState};
use super::node::{Counts, FailureMode, Granted};
use super::protocol::{NodeSettings, Report, SyncRequest, SyncResponse, PROTOCOL_VERSION};
use super::stored::{self, Carried, SYNC_CARRIED_KEY, SYNC_STATE_KEY};
use crate::host::{CasResult, Host, HostError};
use crate::keys::kind;
use crate::policy::{Policy, SyncSettings};
use crate::table::{self, Commit, Failure, Overflow, Place, Reach};

/// Compare-and-swap attempts per shared-data key.
pub use crate::table::MAX_CAS_ATTEMPTS;
/// Key-table entries one tick scans at least; a larger table is scanned
/// in [`SCAN_TICKS`] ticks at most.
pub const MIN_SCAN_PER_TICK: u64 = 2048;
pub const SCAN_TICKS: u64 = 40;
/// How much longer than a sent report one still being scanned may stay in
/// flight before another worker gives up on it: a scan takes at most
/// [`SCAN_TICKS`] ticks (0.4 s at the glue's 10 ms tick); this leaves room
/// for slow ticks.
pub const SCAN_GRACE_NS: u64 = 2_000 * NANOS_PER_MS;
/// Most (key, limit) one report carries; the others wait for the next one
/// (their counts stay until acknowledged).
pub const MAX_REPORTS: usize = 4096;
/// Most key slots one worker callback updates while applying an answer
/// ([`apply_step`]): an answer to a full report (4,096 keys) takes 16
/// callbacks, 0.16 s at the glue's 10 ms tick. One step of 256 took
/// 0.53–0.6 ms (median) in Envoy 1.40 on this 2-core machine, where the
/// whole answer in one callback held the worker 7–25 ms (see the module
/// header).
pub const APPLY_PER_STEP: usize = 256;
/// How often (in slot updates) a step asks whether its time budget is
/// spent: a step updates at least this many keys, so an answer of the
/// most keys (`2 × MAX_REPORTS`) takes at most 128 steps.
pub const APPLY_CHECK_EVERY: usize = 64;
/// How long after its receipt an answer may still be applied: the worker
/// applying it drops the rest then (those keys keep their counts and are
/// reported again). The most keys an answer updates (`2 × MAX_REPORTS`,
/// each acknowledged key and each leased one) take at most 128 steps,
/// 1.28 s at the 10 ms tick, however slow each step.
pub const APPLY_MAX_NS: u64 = 2_000 * NANOS_PER_MS;
pub const APPLY_GRACE_NS: u64 = 1_000 * NANOS_PER_MS;

const NANOS_PER_MS: u64 = 1_000_000;

/// How many entries a tick scans for a table of `entries`.
pub fn scan_budget(entries: u64) -> u64 {
    MIN_SCAN_PER_TICK.max(entries.div_ceil(SCAN_TICKS))
}

/// The node's sync state and its CAS token (`None`: absent or unreadable).
pub fn read_state<H: Host>(host: &H) -> Result<(Option<SyncState>, Option<u32>), HostError> {
    let (value, cas) = host.shared_get(SYNC_STATE_KEY)?;
    Ok((value.as_deref().and_then(stored::decode_sync_state), cas))
}

fn write_state<H: Host>(host: &H, s: &SyncState, cas: Option<u32>) -> Result<CasResult, HostError> {
    let mut out = Vec::new();
    stored::encode_sync_state(s, &mut out);
    host.shared_set(SYNC_STATE_KEY, &out, cas)
}

/// What [`claim`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This worker reports this interval, as `seq` (with the breaker
    /// half-open, this report is the probe).
    Won { seq: u64, given_up: GivenUp },
    /// This worker skipped this interval: the breaker is open.
    Skipped { given_up: GivenUp },
    /// Not due, or another worker's report is in flight.
    NotDue(SyncState),
    /// This worker gave up on the report in flight (a failure, recorded)
    /// and nothing is sent before the interval is due: the given-up report
    /// was itself a retry, or the breaker opened.
    GaveUp(GivenUp, SyncState),
    /// Another worker won the race.
    Lost,
}

/// Whether [`claim`] gave up on the previous report (it timed out: a
/// failure for the breaker), and whether that opened the breaker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GivenUp {
    pub timed_out: bool,
    pub opened: bool,
}

/// Tries to win this interval: to report, or, while the breaker is open,
/// to skip it. A missing or unreadable state is created (the node starts
/// syncing now).
pub fn claim<H: Host>(host: &H, settings: &SyncSettings, now: u64) -> Result<Claim, HostError> {
    let (current, cas) = read_state(host)?;
    let mut s = current.unwrap_or_else(|| SyncState::new(now, settings.interval_ns, settings.timeout_ns));
    if s.in_flight.is_none() && s.retry != Retry::Due && !s.due(now) {
        return Ok(Claim::NotDue(s));
    }
    // No report while a worker applies the previous answer (the module
    // header, "Applying an answer"), unless it stopped long ago.
    if let Some(a) = s.applying {
        if now.saturating_sub(a.since) <= APPLY_MAX_NS.saturating_add(APPLY_GRACE_NS) {
            return Ok(Claim::NotDue(s));
        }
        s.applying = None;
    }
    // A report unanswered for longer than the callout timeout is given up
    // on (its answer would be refused as late): a failure, and its retry
    // is sent at once (see "Retry" in the module header). One still being
    // scanned (not sent yet: its timer starts at dispatch) gets
    // [`SCAN_GRACE_NS`] more, so that a scan longer than the timeout is
    // not abandoned by another worker again and again.
    let give_up_ns = settings.timeout_ns;
    let mut given_up = GivenUp::default();
    if let Some(f) = s.in_flight {
        let waited = now.saturating_sub(f.sent_at);
        if waited <= give_up_ns {
            return Ok(Claim::NotDue(s));
        }
        let sent = host
            .shared_get(SYNC_CARRIED_KEY)?
            .0
            .as_deref()
            .and_then(stored::carried_seq)
            == Some(f.seq);
        if !sent && waited <= give_up_ns.saturating_add(SCAN_GRACE_NS) {
            return Ok(Claim::NotDue(s));
        }
        given_up = GivenUp {
            timed_out: true,
            opened: s.given_up(now, &settings.breaker()),
        };
    }
    if s.breaker(now) == BreakerState::Open {
        if !s.due(now) {
            // The failure is recorded; the interval is skipped when due.
            return Ok(match write_state(host, &s, cas)? {
                CasResult::Written => Claim::GaveUp(given_up, s),
                CasResult::Conflict => Claim::Lost,
            });
        }
        s.skip(now);
        return Ok(match write_state(host, &s, cas)? {
            CasResult::Written => Claim::Skipped { given_up },
            CasResult::Conflict => Claim::Lost,
        });
    }
    let seq = if s.due(now) {
        s.begin_report(now, give_up_ns).map(|(seq, _)| seq)
    } else {
        s.begin_retry(now)
    };
    let Some(seq) = seq else {
        // Given up on, nothing to send before the interval is due: the
        // failure is recorded.
        return Ok(match write_state(host, &s, cas)? {
            CasResult::Written => Claim::GaveUp(given_up, s),
            CasResult::Conflict => Claim::Lost,
        });
    };
    Ok(match write_state(host, &s, cas)? {
        CasResult::Written => Claim::Won { seq, given_up },
        CasResult::Conflict => Claim::Lost,
    })
}

/// A report being built by the worker that won its interval.
#[derive(Debug, Clone, Default)]
pub struct Scan {
    pub seq: u64,
    /// The next key-table entry to scan.
    pub next: u64,
    pub carried: Vec<Carried>,
    pub reports: Vec<Report>,
    /// When the scan began (what a key's keep-alive is measured against).
    pub started_at: u64,
}

impl Scan {
    pub fn new(seq: u64, now: u64) -> Scan {
        Scan {
            seq,
            started_at: now,
            ..Scan::default()
        }
    }
}

/// Scans up to `budget` key-table entries for global allowances to report
/// (counts to report, or asked for recently: see
/// [`Allowance::wants_report`](super::node::Allowance::wants_report)).
/// Returns whether the scan is complete.
pub fn scan_step<H: Host>(host: &H, policy: &Policy, scan: &mut Scan, budget: u64) -> bool {
    let default_mode = policy.sync.as_ref().map(|s| s.failure_mode);
    let modes = ClassModes::of(policy);
    let entries = policy.key_table_entries.max(1);
    let end = scan.next.saturating_add(budget).min(entries);
    for index in scan.next..end {
        if scan.carried.len() >= MAX_REPORTS {
            scan.next = entries;
            break;
        }
        let Ok((Some(value), _)) = host.shared_get(&table::layout::entry_key(index)) else {
            continue;
        };
        for slot in table::decode_entry(&value).unwrap_or_default() {
            for r in table::decode_records(slot.records).unwrap_or_default() {
                if r.kind != kind::GLOBAL_ALLOWANCE {
                    continue;
                }
                let (Some(limit), Some(a)) = (
                    policy.global_limit_name(r.name_hash),
                    stored::decode_allowance(r.state),
                ) else {
                    continue;
                };
                if !a.wants_report(scan.started_at) || scan.carried.len() >= MAX_REPORTS {
                    continue;
                }
                scan.reports.push(Report {
                    key: String::from_utf8_lossy(slot.key).into_owned(),
                    limit: limit.to_owned(),
                    consumed: a.pending.consumed,
                    unleased: a.pending.unleased,
                    demand: a.pending.demand,
                    failure_mode: modes.of_key(slot.key).filter(|m| Some(*m) != default_mode),
                    started_ms: a.started_ms(scan.started_at),
                });
                scan.carried.push(Carried {
                    key: slot.key.to_vec(),
                    name_hash: r.name_hash,
                    counts: a.pending,
                    lease_used: a.lease_used,
                });
            }
        }
    }
    scan.next = scan.next.max(end);
    scan.next >= entries
}

/// The failure modes of a policy's route classes by action, for the
/// reports: a key is `action|subject`, and every class with that action
/// charges it, so the key runs the most permissive of their modes.
struct ClassModes<'a> {
    /// Every class's action and mode, if any class overrides
    /// `sync.failure_mode` (empty in most policies: then every key runs
    /// the default, and no report looks anything up).
    classes: Vec<(&'a str, FailureMode)>,
    default: Option<FailureMode>,
}

impl<'a> ClassModes<'a> {
    fn of(policy: &'a Policy) -> ClassModes<'a> {
        let default = policy.sync.as_ref().map(|s| s.failure_mode);
        let mut classes = Vec::new();
        if let Some(d) = default {
            if policy
                .route_classes()
                .any(|c| c.failure_mode.is_some_and(|m| m != d))
            {
                classes = policy
                    .route_classes()
                    .map(|c| (c.action.as_str(), c.failure_mode.unwrap_or(d)))
                    .collect();
            }
        }
        ClassModes { classes, default }
    }

    /// The mode of the key `action|subject`.
    fn of_key(&self, key: &[u8]) -> Option<FailureMode> {
        let action = key.split(|b| *b == b'|').next().unwrap_or_default();
        self.classes
            .iter()
            .filter(|(a, _)| a.as_bytes() == action)
            .map(|(_, m)| *m)
            .reduce(most_permissive)
            .or(self.default)
    }
}

/// Of two failure modes, the one that admits more.
fn most_permissive(a: FailureMode, b: FailureMode) -> FailureMode {
    let rank = |m: FailureMode| match m {
        FailureMode::FailClosed => 0,
        FailureMode::FailOpenLocal => 1,
        FailureMode::FailOpen => 2,
    };
    if rank(a) >= rank(b) {
        a
    } else {
        b
    }
}

/// The settings a node reports (see `protocol`, "Shared settings").
pub fn node_settings(settings: &SyncSettings) -> NodeSettings {
    NodeSettings {
        timeout_ms: settings.timeout_ns.div_ceil(NANOS_PER_MS),
        local_max_ms: settings.local_max_ns.div_ceil(NANOS_PER_MS),
        interval_ms: settings.interval_ns.div_ceil(NANOS_PER_MS),
        failure_mode: settings.failure_mode,
        outage_allowance: true,
    }
}

/// The batched request of a complete scan.
pub fn request(policy: &Policy, node_id: &str, region: &str, acked_seq: u64, scan: &Scan) -> SyncRequest {
    SyncRequest {
        version: PROTOCOL_VERSION,
        node_id: node_id.to_owned(),
        region: region.to_owned(),
        policy_version: policy.version.clone(),
        seq: scan.seq,
        boot: 0,
        acked_seq,
        settings: policy.sync.as_ref().map(node_settings),
        reports: scan.reports.clone(),
    }
}

/// Records that the report was sent at `now`: what it carried, and its
/// send time (its timeout counts from then). `false` if the report is no
/// longer the one in flight.
pub fn sent<H: Host>(host: &H, scan: &Scan, now: u64) -> Result<bool, HostError> {
    let mut out = Vec::new();
    stored::encode_carried(scan.seq, &scan.carried, &mut out);
    host.shared_set(SYNC_CARRIED_KEY, &out, None)?;
    update_state(host, |s| match &mut s.in_flight {
        Some(f) if f.seq == scan.seq => {
            f.sent_at = now;
            true
        }
        _ => false,
    })
}

/// What [`abandon`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abandoned {
    /// The report was no longer in flight (another worker gave up on it,
    /// and counted the failure), or the state could not be written.
    NotInFlight,
    /// The failure is recorded; `opened`: the breaker opened.
    Failed { opened: bool },
}

/// Gives up on report `seq` (its callout could not be made or failed) and
/// counts the failure for the breaker. Unless that opens the breaker, the
/// next interval reports again.
pub fn abandon<H: Host>(
    host: &H,
    settings: &SyncSettings,
    seq: u64,
    now: u64,
) -> Result<Abandoned, HostError> {
    let breaker = settings.breaker();
    let mut opened = false;
    let written = update_state(host, |s| {
        if s.in_flight.is_some_and(|f| f.seq == seq) {
            opened = s.given_up(now, &breaker);
            true
        } else {
            false
        }
    })?;
    Ok(if written {
        Abandoned::Failed { opened }
    } else {
        Abandoned::NotInFlight
    })
}

/// Read-modify-write of the state; `change` returns whether to write.
fn update_state<H: Host>(
    host: &H,
    mut change: impl FnMut(&mut SyncState) -> bool,
) -> Result<bool, HostError> {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (Some(mut s), cas) = read_state(host)? else {
            return Ok(false);
        };
        if !change(&mut s) {
            return Ok(false);
        }
        if write_state(host, &s, cas)? == CasResult::Written {
            return Ok(true);
        }
    }
    Ok(false)
}

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

/// A lease of the answer, its TTL already clamped.
#[derive(Debug, Clone, Copy)]
struct NewLease {
    tokens: u64,
    share: u64,
    share_milli: u64,
    ttl_ns: u64,
    outage_milli: Option<u64>,
}

/// One limit's update in a key's slot.
#[derive(Debug, Clone, Copy)]
struct LimitUpdate {
    name_hash: u32,
    ack: Option<Ack>,
    lease: Option<NewLease>,
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
        limit(&mut updates, l.key.as_bytes().to_vec(), hash).lease = Some(NewLease {
            tokens: l.tokens,
            share: l.share,
            share_milli: l.share_milli,
            ttl_ns: ttl(l.ttl_ms),
            outage_milli: l.outage_milli,
        });
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
                            let ttl_ns = l.ttl_ns.min(settings.max_ttl_ns);
                            let used = a.lease_used.wrapping_sub(mark);
                            let granted = Granted {
                                tokens: l.tokens,
                                share: l.share,
                                share_milli: l.share_milli,
                                ttl_ns,
                                outage_milli: l.outage_milli,
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

#[cfg(test)]
mod tests;
