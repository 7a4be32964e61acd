//! One worker's part in the node's sync with the central cluster, over any
//! host: on each tick, read the node's sync state (for requests), try to
//! win the interval, scan the key table in bounded steps, and hand the
//! host one batched callout to send; then read the callout's answer and
//! apply it. The steps are [`super::shared`]'s; this is their order, their
//! failures and their stats. Requests never wait for it.
//!
//! # Reading an answer
//! A host reports a callout that failed (reset, before or after the
//! response headers; a body over Envoy's 32 MiB async-client limit) as an
//! answer with no headers: there is no response then, and nothing is read.
//! Otherwise `:status` is read and any status but 200 is a failure; a body
//! over [`MAX_ANSWER_BYTES`] is a failure without being read. Every number
//! the answer carries is then clamped to what the policy allows
//! ([`super::clamp`]).
//!
//! # Applying an answer in steps
//! The answer is accepted at once, then applied to key slots by
//! [`apply::apply_step`]: one step when it arrives, then one on each of
//! this worker's ticks until done, each at most [`shared::APPLY_PER_STEP`]
//! keys and about [`APPLY_STEP_BUDGET_NS`] of the host's clock (read
//! between chunks of [`shared::APPLY_CHECK_EVERY`] keys). The application
//! waits in this worker's memory (one answer at most); a worker torn down
//! meanwhile loses it, and its keys keep their counts (reported again).
//! Stats: `sync.applied_in_steps` (answers that took more than one step),
//! `sync.apply_dropped`, and the histogram `sync.apply_step_us`.

use hashbrown::HashMap;

use super::apply::{self, Application, NotApplied, Step};
use super::shared::{self, Abandoned, Claim, GivenUp, Scan};
use super::{clamp, ApplyError, BreakerState, SyncResponse, SyncState};
use crate::host::Clock;
use crate::host::{Host, HostError};
use crate::policy::{Policy, SyncSettings};
use crate::stats::SyncStat;
use crate::stats::{Metric, Stats};

/// The service's sync endpoint.
pub const SYNC_PATH: &str = "/v1/sync";
/// Envoy's node id and region, unless the policy overrides them. (Envoy
/// 1.40 answers `["node", "id"]` with nothing; `["xds", "node", "id"]` works.)
const NODE_ID_PROPERTY: [&str; 2] = ["node", "id"];
const REGION_PROPERTY: [&str; 3] = ["node", "locality", "region"];
const XDS_NODE_ID_PROPERTY: [&str; 3] = ["xds", "node", "id"];
const XDS_REGION_PROPERTY: [&str; 4] = ["xds", "node", "locality", "region"];
/// A callout that failed this close to its timeout counts as a timeout.
const TIMEOUT_SLACK_NS: u64 = 5_000_000;
/// The largest answer body read: a full answer, one lease per report (at
/// most `MAX_REPORTS` = 4096), each under 1 KiB of JSON (a 255-byte key
/// even if every byte is escaped, a 64-byte limit name, three `u64`), fits.
/// A larger body is a failure, never copied into the VM.
pub const MAX_ANSWER_BYTES: usize = 4 << 20;
/// The clock budget of one step of an answer's application: 1 ms.
/// [`shared::APPLY_PER_STEP`] (256) slot updates took about 0.6 ms in
/// Envoy (`docs/global-limits.md`, "Applying an answer in steps"), so the
/// count is what usually ends a step, and this budget ends it on a slow or
/// contended worker.
pub const APPLY_STEP_BUDGET_NS: u64 = 1_000_000;

/// A report for the host to send: `POST` [`SYNC_PATH`] to `cluster` with
/// `body` (JSON), giving up after `timeout_ns`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callout {
    pub cluster: String,
    pub body: Vec<u8>,
    pub timeout_ns: u64,
    seq: u64,
    /// The second copy of a report ([`shared::hedge`]).
    copy: bool,
}

impl Callout {
    /// The request's headers.
    pub fn headers(&self) -> [(&str, &str); 4] {
        [
            (":method", "POST"),
            (":path", SYNC_PATH),
            (":authority", self.cluster.as_str()),
            ("content-type", "application/json"),
        ]
    }
}

/// A callout's answer as the host has it: read only as far as the syncer
/// needs.
pub trait CalloutAnswer {
    /// Whether a response came at all (Envoy: response headers > 0).
    fn has_response(&self) -> bool;
    /// The response's `:status` (`Err`: the host could not read it).
    fn status(&self) -> Result<Option<Vec<u8>>, HostError>;
    /// The body's size as announced.
    fn body_size(&self) -> usize;
    /// The body (`Err`: the host could not read it).
    fn body(&self) -> Result<Option<Vec<u8>>, HostError>;
}

/// A callout in flight.
#[derive(Debug)]
struct Call {
    seq: u64,
    sent_at: u64,
}

/// Why an answer was not applied.
enum Failure {
    Timeout,
    Other,
}

/// One worker's part in syncing (see the module header).
#[derive(Debug, Default)]
pub struct Syncer {
    /// Whether `node_id` / `region` are final (the policy set them, or
    /// Envoy's properties answered).
    resolved: bool,
    node_id: String,
    region: String,
    scan: Option<Scan>,
    calls: HashMap<u32, Call>,
    /// The answer this worker is applying, a step per tick.
    applying: Option<Application>,
    /// The report this worker sent last, while it may still be sent a
    /// second time ([`shared::hedge`]).
    hedge: Option<Callout>,
    /// The report whose answer this worker accepted last: the answer to
    /// its other copy is then no failure.
    answered_seq: Option<u64>,
    /// What this worker last set the `sync.breaker` gauge to.
    breaker_set: Option<u64>,
}

fn text_property<H: Host>(host: &H, path: &[&str]) -> Option<String> {
    let text = String::from_utf8(host.property(path)?).ok()?;
    (!text.is_empty()).then_some(text)
}

impl Syncer {
    /// Resolves who this node is: the policy's `sync.node_id` /
    /// `sync.region`, else Envoy's `node.id` / `node.locality.region`. The
    /// host may not answer properties while configuring: then they are
    /// read again before each report until they answer.
    pub fn configure<H: Host>(&mut self, host: &H, policy: &Policy) {
        self.resolved = false;
        self.resolve(host, policy);
        if let (Some(settings), true) = (policy.sync.as_ref(), policy.has_global_limits()) {
            log::info!(
                "tenantgate: global limits sync with cluster {} every {} ms as node {:?} in region {:?}",
                settings.cluster,
                settings.interval_ns / 1_000_000,
                self.node_id,
                self.region
            );
        }
    }

    fn resolve<H: Host>(&mut self, host: &H, policy: &Policy) {
        let Some(settings) = policy.sync.as_ref() else {
            return;
        };
        if self.resolved {
            return;
        }
        let id = settings
            .node_id
            .clone()
            .or_else(|| text_property(host, &NODE_ID_PROPERTY))
            .or_else(|| text_property(host, &XDS_NODE_ID_PROPERTY));
        let region = settings
            .region
            .clone()
            .or_else(|| text_property(host, &REGION_PROPERTY))
            .or_else(|| text_property(host, &XDS_REGION_PROPERTY));
        self.resolved = id.is_some();
        self.node_id = id.unwrap_or_else(|| String::from("unknown"));
        self.region = region.unwrap_or_default();
    }

    /// The worker's sync step on its tick: a callout to send, if this
    /// worker reports now, and the node's sync state as read (requests
    /// decide global limits with it).
    pub fn tick<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        stats: &mut dyn Stats,
        policy: &Policy,
        now: u64,
    ) -> (Option<Callout>, Option<SyncState>) {
        // While this worker applies an answer, the node reports nothing
        // (see `shared`): this tick only applies the next step.
        if let Some(app) = self.applying.take() {
            return (None, self.apply_step(host, clock, stats, policy, app, now));
        }
        let Some(settings) = policy.sync.as_ref().filter(|_| policy.has_global_limits()) else {
            return (None, None);
        };
        if let Some(copy) = self.hedge_due(host, stats, settings, now) {
            return (Some(copy), read_view(host));
        }
        let budget = shared::scan_budget(policy.key_table_entries);
        if let Some(mut scan) = self.scan.take() {
            if shared::scan_step(host, policy, &mut scan, budget) {
                return (self.report(host, stats, policy, settings, scan, now), None);
            }
            self.scan = Some(scan);
            return (None, None);
        }
        let (callout, view) = match shared::claim(host, settings, now) {
            Ok(Claim::NotDue(state)) => (None, Some(state)),
            Ok(Claim::GaveUp(given_up, state)) => {
                note_given_up(stats, given_up);
                (None, Some(state))
            }
            Ok(Claim::Won { seq, given_up }) => {
                note_given_up(stats, given_up);
                let view = read_view(host);
                let mut scan = Scan::new(seq, now);
                if shared::scan_step(host, policy, &mut scan, budget) {
                    (self.report(host, stats, policy, settings, scan, now), view)
                } else {
                    self.scan = Some(scan);
                    (None, view)
                }
            }
            Ok(Claim::Skipped { given_up }) => {
                note_given_up(stats, given_up);
                stats.add(&Metric::Sync(SyncStat::Skipped), 1);
                (None, read_view(host))
            }
            Ok(Claim::Lost) => (None, read_view(host)),
            Err(_) => {
                stats.add(&Metric::Sync(SyncStat::Failed), 1);
                (None, None)
            }
        };
        if let Some(state) = view {
            self.breaker_gauge(stats, state.breaker(now));
        }
        (callout, view)
    }

    /// Whether a copy of report `seq` is still in flight from this worker
    /// (then a failure of the other gives nothing up).
    fn copy_in_flight(&self, seq: u64) -> bool {
        self.calls.values().any(|c| c.seq == seq)
    }

    /// The second copy of this worker's report in flight, when it is due
    /// ([`shared::hedge`]); the report is forgotten once it is no longer
    /// in flight unhedged.
    fn hedge_due<H: Host>(
        &mut self,
        host: &H,
        stats: &mut dyn Stats,
        settings: &SyncSettings,
        now: u64,
    ) -> Option<Callout> {
        let report = self.hedge.take()?;
        if let Ok(true) = shared::hedge(host, settings, report.seq, now) {
            stats.add(&Metric::Sync(SyncStat::Hedged), 1);
            return Some(Callout { copy: true, ..report });
        }
        let waiting = read_view(host)
            .and_then(|s| s.in_flight)
            .is_some_and(|f| f.seq == report.seq && !f.hedged);
        if waiting {
            self.hedge = Some(report);
        }
        None
    }

    /// The callout of a finished scan, marked sent in shared data (`None`:
    /// another worker gave up on this report meanwhile).
    fn report<H: Host>(
        &mut self,
        host: &H,
        stats: &mut dyn Stats,
        policy: &Policy,
        settings: &SyncSettings,
        scan: Scan,
        now: u64,
    ) -> Option<Callout> {
        let acked = shared::read_state(host)
            .ok()
            .and_then(|(s, _)| s)
            .map_or(0, |s| s.acked_seq);
        self.resolve(host, policy);
        let mut req = shared::request(policy, &self.node_id, &self.region, acked, &scan);
        req.boot = super::boot::boot_id(host, now).unwrap_or(0);
        let body = req.to_json().into_bytes();
        if !matches!(shared::sent(host, &scan, now), Ok(true)) {
            stats.add(&Metric::Sync(SyncStat::Failed), 1);
            return None;
        }
        Some(Callout {
            cluster: settings.cluster.clone(),
            body,
            timeout_ns: settings.timeout_ns,
            seq: scan.seq,
            copy: false,
        })
    }

    /// What the host did with a callout: `Ok(token)` sent, `Err` not (an
    /// unknown cluster, typically: leases run out, then the failure mode
    /// applies).
    pub fn dispatched<H: Host>(
        &mut self,
        host: &H,
        stats: &mut dyn Stats,
        policy: &Policy,
        callout: &Callout,
        token: Result<u32, ()>,
        now: u64,
    ) {
        match token {
            Ok(token) => {
                stats.add(&Metric::Sync(SyncStat::Sent), 1);
                self.calls.insert(
                    token,
                    Call {
                        seq: callout.seq,
                        sent_at: now,
                    },
                );
                if !callout.copy {
                    self.hedge = Some(callout.clone());
                }
            }
            Err(()) => {
                stats.add(&Metric::Sync(SyncStat::Failed), 1);
                // The first copy still answers for the report.
                if let (Some(settings), false) = (policy.sync.as_ref(), self.copy_in_flight(callout.seq)) {
                    note_abandoned(stats, shared::abandon(host, settings, callout.seq, now));
                }
            }
        }
    }

    /// A callout's answer: checked, clamped, accepted and its first step
    /// applied. Returns the node's sync state as read after it.
    pub fn on_answer<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        stats: &mut dyn Stats,
        policy: &Policy,
        token: u32,
        answer: &impl CalloutAnswer,
    ) -> Option<SyncState> {
        let call = self.calls.remove(&token)?;
        let settings = policy.sync.as_ref()?;
        let now = clock.now().unwrap_or(call.sent_at);
        let elapsed = now.saturating_sub(call.sent_at);
        stats.set(&Metric::Sync(SyncStat::LatencyMs), elapsed / 1_000_000);
        let outcome = if elapsed > settings.timeout_ns {
            // Later than this copy's timeout (a host whose callout outlived
            // it): its lease would outlive what the service counts on.
            Err(Failure::Timeout)
        } else {
            self.answer(host, clock, stats, policy, settings, answer, now)
        };
        let failed = match outcome {
            Ok(()) => None,
            // The report's other copy was answered: this one's failure
            // (Envoy's timeout, typically) costs nothing.
            Err(_) if self.answered_seq == Some(call.seq) => {
                return read_view(host);
            }
            Err(Failure::Timeout) => Some(SyncStat::Timeouts),
            Err(Failure::Other) if elapsed.saturating_add(TIMEOUT_SLACK_NS) >= settings.timeout_ns => {
                Some(SyncStat::Timeouts)
            }
            Err(Failure::Other) => Some(SyncStat::Failed),
        };
        stats.add(&Metric::Sync(failed.unwrap_or(SyncStat::Ok)), 1);
        // While the report's other copy is in flight, it may still answer.
        if failed.is_some() && !self.copy_in_flight(call.seq) {
            note_abandoned(stats, shared::abandon(host, settings, call.seq, now));
        }
        read_view(host)
    }

    #[allow(clippy::too_many_arguments)]
    fn answer<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        stats: &mut dyn Stats,
        policy: &Policy,
        settings: &SyncSettings,
        answer: &impl CalloutAnswer,
        now: u64,
    ) -> Result<(), Failure> {
        // No response: the callout failed and there is nothing to read
        // (see the module header).
        if !answer.has_response() {
            log::warn!("tenantgate: sync callout failed (reset or over Envoy's buffer limit)");
            return Err(Failure::Other);
        }
        let status = match answer.status() {
            Ok(Some(status)) => status,
            Ok(None) => return Err(Failure::Other),
            Err(HostError) => {
                log::warn!("tenantgate: cannot read the sync answer's status");
                return Err(Failure::Other);
            }
        };
        if status != b"200" {
            log::warn!("tenantgate: sync answered {}", String::from_utf8_lossy(&status));
            return Err(Failure::Other);
        }
        if answer.body_size() > MAX_ANSWER_BYTES {
            log::warn!(
                "tenantgate: sync answer of {} bytes refused (at most {MAX_ANSWER_BYTES})",
                answer.body_size()
            );
            return Err(Failure::Other);
        }
        let body = answer.body().map_err(|HostError| {
            log::warn!("tenantgate: cannot read the sync answer's body");
            Failure::Other
        })?;
        let mut resp = SyncResponse::from_json(&body.unwrap_or_default()).map_err(|e| {
            log::warn!("tenantgate: sync answer refused: {e}");
            Failure::Other
        })?;
        if self.answered_seq == Some(resp.ack_seq) {
            // The answer to the report's other copy came first and was
            // applied; this one brings the same leases.
            return Ok(());
        }
        let clamped = clamp::answer(policy, settings, &mut resp);
        if clamped > 0 {
            log::warn!("tenantgate: sync answer clamped ({clamped} values beyond the policy)");
            stats.add(&Metric::Sync(SyncStat::Clamped), i64::from(clamped));
        }
        match apply::accept(host, policy, settings, &resp, now) {
            Ok(app) => {
                self.answered_seq = Some(resp.ack_seq);
                self.hedge = None;
                if app.applied.ignored > 0 {
                    log::warn!(
                        "tenantgate: sync answer had {} leases beyond the report's bound, ignored",
                        app.applied.ignored
                    );
                }
                // Accepted: the first step runs now.
                let _ = self.apply_step(host, clock, stats, policy, app, now);
                Ok(())
            }
            Err(NotApplied::Refused(ApplyError::Late)) => Err(Failure::Timeout),
            Err(_) => Err(Failure::Other),
        }
    }

    /// One step of the answer's application (see the module header);
    /// returns the node's sync state once it is done.
    fn apply_step<H: Host>(
        &mut self,
        host: &H,
        clock: &impl Clock,
        stats: &mut dyn Stats,
        policy: &Policy,
        mut app: Application,
        now: u64,
    ) -> Option<SyncState> {
        let start = clock.now().unwrap_or(now);
        let deadline = start.saturating_add(APPLY_STEP_BUDGET_NS);
        let time_up = || clock.now().is_none_or(|t| t >= deadline);
        let step = apply::apply_step(host, policy, &mut app, start, time_up);
        let end = clock.now().unwrap_or(start);
        stats.set(
            &Metric::Sync(SyncStat::ApplyStepUs),
            end.saturating_sub(start) / 1_000,
        );
        let applied = app.applied;
        match step {
            Step::More => {
                self.applying = Some(app);
                return None;
            }
            Step::Done => {}
            Step::Dropped => {
                log::warn!(
                    "tenantgate: sync answer {} dropped after {} steps, {} keys unapplied (their counts stay)",
                    app.seq,
                    applied.steps,
                    applied.dropped
                );
                stats.add(&Metric::Sync(SyncStat::ApplyDropped), 1);
            }
        }
        if applied.steps > 1 {
            stats.add(&Metric::Sync(SyncStat::AppliedInSteps), 1);
        }
        if applied.missed > 0 {
            log::warn!("tenantgate: {} keys missed their sync update", applied.missed);
        }
        read_view(host)
    }

    /// The node's sync breaker as this worker last read it (set when it
    /// changes: every worker reads the same node-wide state).
    fn breaker_gauge(&mut self, stats: &mut dyn Stats, state: BreakerState) {
        let value = match state {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        };
        if self.breaker_set != Some(value) {
            stats.set(&Metric::Sync(SyncStat::Breaker), value);
            self.breaker_set = Some(value);
        }
    }
}

/// A report given up on by `claim` timed out; it may have opened the breaker.
fn note_given_up(stats: &mut dyn Stats, given_up: GivenUp) {
    if given_up.timed_out {
        stats.add(&Metric::Sync(SyncStat::Timeouts), 1);
    }
    if given_up.opened {
        stats.add(&Metric::Sync(SyncStat::BreakerOpened), 1);
    }
}

fn note_abandoned(stats: &mut dyn Stats, abandoned: Result<Abandoned, HostError>) {
    if let Ok(Abandoned::Failed { opened: true }) = abandoned {
        log::warn!("tenantgate: sync circuit breaker open");
        stats.add(&Metric::Sync(SyncStat::BreakerOpened), 1);
    }
}

/// The node's sync state, if shared data has one.
fn read_view<H: Host>(host: &H) -> Option<SyncState> {
    shared::read_state(host).ok().and_then(|(s, _)| s)
}
