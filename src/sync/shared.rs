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
//! which applies it ([`super::apply`]).
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
//! # Hedging
//! A report still unanswered [`hedge_after_ns`] (half the callout timeout)
//! after it was sent is sent again by the worker that sent it, the same
//! `seq` and body, once ([`hedge`]); the service answers that copy with
//! the leases it granted the first (a repeat: nothing counted, nothing
//! drawn). The report's deadline then counts from the copy; each copy's
//! answer is still refused after the timeout from its own sending (Envoy
//! ends the callout; the syncer checks it too), so a lease never outlives
//! what the service counts on. Whichever answer comes first is applied,
//! the other ignored. Under 20 % message loss and 20–300 ms latency it
//! took the simulator's `lossy` scenario from 91.2 % to 95.9 % of the
//! limit on 3×3 (issue 35).
//!
//! # Circuit breaker
//! The breaker (see [`super::node`]) lives in the same state and is
//! updated by the same compare-and-swap, so every worker agrees: a failed
//! report is counted once, by the worker that clears it from the state
//! ([`abandon`], or [`claim`] giving up on it), and while the breaker is
//! open the worker that wins a due interval skips it
//! ([`Claim::Skipped`]) instead of reporting.

use super::cycle::{BreakerState, Retry, SyncState};
use super::node::FailureMode;
use super::protocol::{NodeSettings, Report, SyncRequest, PROTOCOL_VERSION};
use super::stored::{self, Carried, SYNC_CARRIED_KEY, SYNC_STATE_KEY};
use crate::host::{CasResult, Host, HostError};
use crate::keys::kind;
use crate::policy::{Policy, SyncSettings};
use crate::table;

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
/// ([`apply_step`](super::apply::apply_step)): an answer to a full report (4,096 keys) takes 16
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

pub(super) fn write_state<H: Host>(
    host: &H,
    s: &SyncState,
    cas: Option<u32>,
) -> Result<CasResult, HostError> {
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

/// How long after sending a report its worker sends it again, unchanged,
/// if no answer came ([`hedge`]): half the callout timeout. On a cluster
/// whose round trips take a few milliseconds only a lost message or a
/// stalled service waits that long; the copy then has the whole timeout
/// again.
pub fn hedge_after_ns(settings: &SyncSettings) -> u64 {
    settings.timeout_ns / 2
}

/// Marks report `seq` hedged if it is still in flight and unanswered
/// [`hedge_after_ns`] after it was sent (see "Hedging" in the module
/// header): `Ok(true)` when the worker that sent it should send it again,
/// the same body. Once per report.
pub fn hedge<H: Host>(host: &H, settings: &SyncSettings, seq: u64, now: u64) -> Result<bool, HostError> {
    let after = hedge_after_ns(settings);
    update_state(host, |s| s.hedge(seq, after, now))
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
pub(super) fn update_state<H: Host>(
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

#[cfg(test)]
pub(crate) mod tests;
