//! The node's sync with the central cluster, in the glue: on each tick,
//! read the node's sync state (for requests), try to win the interval, scan
//! the key table in bounded steps, send one batched `dispatch_http_call`,
//! and apply its answer. The logic is `crate::sync::shared`; this adds the
//! callout, its failures and the stats. Requests never wait for it.
//!
//! # Reading an answer
//! Envoy calls `on_http_call_response(token, 0, 0, 0)` for a callout that
//! failed (reset, before or after the response headers; a body over the
//! async client's 32 MiB buffer limit): there is no response then, and a
//! header read returns BadArgument. So an answer with no headers is a
//! failure before anything is read; `:status` is read with the raw
//! hostcall and any status but Ok is a failure; a body over
//! [`MAX_ANSWER_BYTES`] is a failure without being copied into the VM.
//! Every number the answer carries is then clamped to what the policy
//! allows ([`crate::sync::clamp`]).
//!
//! # Applying an answer in steps
//! The answer is accepted at once, then applied to key slots by
//! [`shared::apply_step`]: one step in the response callback, then one on
//! each of this worker's ticks until done, each at most
//! [`shared::APPLY_PER_STEP`] keys and about [`APPLY_STEP_BUDGET_NS`] of
//! wall clock (read between chunks of [`shared::APPLY_CHECK_EVERY`]
//! keys). The application waits in this worker's memory (one answer at
//! most); a VM torn down meanwhile loses it, and its keys keep their
//! counts (reported again). Stats: `sync.applied_in_steps` (answers that
//! took more than one step), `sync.apply_dropped`, and the histogram
//! `sync.apply_step_us`.

use std::collections::HashMap;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType};

use super::abi;
use super::metrics::Metrics;
use super::{ProxyHost, SYNC_VIEW};
use crate::host::{Host, HostError};
use crate::policy::{Policy, SyncSettings};
use crate::sync::clamp;
use crate::sync::shared::{self, Abandoned, Application, Claim, GivenUp, NotApplied, Scan, Step};
use crate::sync::{ApplyError, SyncResponse};

/// The service's sync endpoint.
pub const SYNC_PATH: &str = "/v1/sync";
/// Envoy's node id and region, unless the policy overrides them.
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
/// The wall-clock budget of one step of an answer's application: 1 ms.
/// [`shared::APPLY_PER_STEP`] (256) slot updates took about 0.6 ms in
/// Envoy (`docs/global-limits.md`, "Applying an answer in steps"), so the
/// count is what usually ends a step, and this budget ends it on a slow or
/// contended worker.
const APPLY_STEP_BUDGET_NS: u64 = 1_000_000;

/// What Envoy says about a callout's answer (`on_http_call_response`).
#[derive(Debug, Clone, Copy)]
pub struct Answer {
    /// Response headers: 0 when the callout failed (no response at all).
    pub headers: usize,
    pub body_size: usize,
}

/// A callout in flight.
struct Call {
    seq: u64,
    sent_at: u64,
}

/// One root context's part in syncing.
#[derive(Default)]
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
}

fn text_property(host: &ProxyHost, path: &[&str]) -> Option<String> {
    let bytes = host.property(path)?;
    let text = String::from_utf8(bytes).ok()?;
    (!text.is_empty()).then_some(text)
}

impl Syncer {
    /// Resolves who this node is: the policy's `sync.node_id` / `sync.region`,
    /// else Envoy's `node.id` / `node.locality.region`.
    /// Envoy may not answer properties during `on_configure`: then they
    /// are read again before each report until they answer.
    pub fn configure(&mut self, policy: &Policy, host: &ProxyHost) {
        self.resolved = false;
        self.resolve(policy, host);
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

    fn resolve(&mut self, policy: &Policy, host: &ProxyHost) {
        let Some(settings) = policy.sync.as_ref() else {
            return;
        };
        if self.resolved {
            return;
        }
        // Envoy 1.40 answers `["node", "id"]` with nothing (verified);
        // `["xds", "node", "id"]` works.
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

    pub fn tick(&mut self, policy: &Policy, metrics: &Metrics, now: u64) {
        // While this worker applies an answer, the node reports nothing
        // (see `shared`): this tick only applies the next step.
        if let Some(app) = self.applying.take() {
            self.apply_step(policy, metrics, app, now);
            return;
        }
        let Some(settings) = policy.sync.as_ref().filter(|_| policy.has_global_limits()) else {
            return;
        };
        let budget = shared::scan_budget(policy.key_table_entries);
        if let Some(mut scan) = self.scan.take() {
            if shared::scan_step(&ProxyHost, policy, &mut scan, budget) {
                self.dispatch(policy, settings, metrics, scan, now);
            } else {
                self.scan = Some(scan);
            }
            return;
        }
        match shared::claim(&ProxyHost, settings, now) {
            Ok(Claim::NotDue(state)) => SYNC_VIEW.with(|v| *v.borrow_mut() = Some(state)),
            Ok(Claim::Won { seq, given_up }) => {
                note_given_up(metrics, given_up);
                refresh_view();
                let mut scan = Scan::new(seq, now);
                if shared::scan_step(&ProxyHost, policy, &mut scan, budget) {
                    self.dispatch(policy, settings, metrics, scan, now);
                } else {
                    self.scan = Some(scan);
                }
            }
            Ok(Claim::Skipped { given_up }) => {
                note_given_up(metrics, given_up);
                metrics.sync_skipped();
                refresh_view();
            }
            Ok(Claim::Lost) => refresh_view(),
            Err(_) => metrics.sync_failed(),
        }
        if let Some(state) = SYNC_VIEW.with(|v| *v.borrow()) {
            metrics.sync_breaker(state.breaker(now));
        }
    }

    fn dispatch(
        &mut self,
        policy: &Policy,
        settings: &SyncSettings,
        metrics: &Metrics,
        scan: Scan,
        now: u64,
    ) {
        let acked = shared::read_state(&ProxyHost)
            .ok()
            .and_then(|(s, _)| s)
            .map_or(0, |s| s.acked_seq);
        self.resolve(policy, &ProxyHost);
        let mut req = shared::request(policy, &self.node_id, &self.region, acked, &scan);
        req.boot = tenantgate_boot(now);
        let body = req.to_json();
        if !matches!(shared::sent(&ProxyHost, &scan, now), Ok(true)) {
            // Another worker gave up on this report meanwhile.
            metrics.sync_failed();
            return;
        }
        let headers = vec![
            (":method", "POST"),
            (":path", SYNC_PATH),
            (":authority", settings.cluster.as_str()),
            ("content-type", "application/json"),
        ];
        let timeout = Duration::from_nanos(settings.timeout_ns);
        match hostcalls::dispatch_http_call(
            &settings.cluster,
            headers,
            Some(body.as_bytes()),
            vec![],
            timeout,
        ) {
            Ok(token) => {
                metrics.sync_sent();
                self.calls.insert(
                    token,
                    Call {
                        seq: scan.seq,
                        sent_at: now,
                    },
                );
            }
            Err(status) => {
                // An unknown cluster, typically: leases run out, then the
                // failure mode applies.
                log::warn!(
                    "tenantgate: cannot call sync cluster {}: {status:?}",
                    settings.cluster
                );
                metrics.sync_failed();
                note_abandoned(metrics, shared::abandon(&ProxyHost, settings, scan.seq, now));
            }
        }
    }

    pub fn on_response(&mut self, policy: &Policy, metrics: &Metrics, token: u32, answer: Answer) {
        let Some(call) = self.calls.remove(&token) else {
            return;
        };
        let Some(settings) = policy.sync.as_ref() else {
            return;
        };
        let now = super::now_ns().unwrap_or(call.sent_at);
        let elapsed = now.saturating_sub(call.sent_at);
        metrics.sync_latency_ms(elapsed / 1_000_000);
        let outcome = self.answer(policy, settings, metrics, answer, now);
        match outcome {
            Ok(()) => metrics.sync_ok(),
            Err(Failure::Timeout) => metrics.sync_timeout(),
            Err(Failure::Other) if elapsed.saturating_add(TIMEOUT_SLACK_NS) >= settings.timeout_ns => {
                metrics.sync_timeout()
            }
            Err(Failure::Other) => metrics.sync_failed(),
        }
        if outcome.is_err() {
            note_abandoned(metrics, shared::abandon(&ProxyHost, settings, call.seq, now));
        }
        refresh_view();
    }

    fn answer(
        &mut self,
        policy: &Policy,
        settings: &SyncSettings,
        metrics: &Metrics,
        answer: Answer,
        now: u64,
    ) -> Result<(), Failure> {
        // No headers: the callout failed and there is no response to read
        // (reading one returns BadArgument; see the module header).
        if answer.headers == 0 {
            log::warn!("tenantgate: sync callout failed (reset or over Envoy's buffer limit)");
            return Err(Failure::Other);
        }
        let status = match abi::header(MapType::HttpCallResponseHeaders, ":status") {
            Ok(Some(status)) => status,
            Ok(None) => return Err(Failure::Other),
            Err(status) => {
                log::warn!("tenantgate: cannot read the sync answer's status: {status:?}");
                return Err(Failure::Other);
            }
        };
        if status != b"200" {
            log::warn!("tenantgate: sync answered {}", String::from_utf8_lossy(&status));
            return Err(Failure::Other);
        }
        if answer.body_size > MAX_ANSWER_BYTES {
            log::warn!(
                "tenantgate: sync answer of {} bytes refused (at most {MAX_ANSWER_BYTES})",
                answer.body_size
            );
            return Err(Failure::Other);
        }
        let body = match abi::buffer(BufferType::HttpCallResponseBody, 0, answer.body_size) {
            Ok(body) => body.unwrap_or_default(),
            Err(status) => {
                log::warn!("tenantgate: cannot read the sync answer's body: {status:?}");
                return Err(Failure::Other);
            }
        };
        let mut resp = SyncResponse::from_json(&body).map_err(|e| {
            log::warn!("tenantgate: sync answer refused: {e}");
            Failure::Other
        })?;
        let clamped = clamp::answer(policy, settings, &mut resp);
        if clamped > 0 {
            log::warn!("tenantgate: sync answer clamped ({clamped} values beyond the policy)");
            metrics.sync_clamped(clamped);
        }
        match shared::accept(&ProxyHost, policy, settings, &resp, now) {
            Ok(app) => {
                if app.applied.ignored > 0 {
                    log::warn!(
                        "tenantgate: sync answer had {} leases beyond the report's bound, ignored",
                        app.applied.ignored
                    );
                }
                // Accepted: the first step runs in this callback.
                self.apply_step(policy, metrics, app, now);
                Ok(())
            }
            Err(NotApplied::Refused(ApplyError::Late)) => Err(Failure::Timeout),
            Err(_) => Err(Failure::Other),
        }
    }

    /// One step of the answer's application (see the module header).
    fn apply_step(&mut self, policy: &Policy, metrics: &Metrics, mut app: Application, now: u64) {
        let start = super::now_ns().unwrap_or(now);
        let deadline = start.saturating_add(APPLY_STEP_BUDGET_NS);
        let time_up = || super::now_ns().is_none_or(|t| t >= deadline);
        let step = shared::apply_step(&ProxyHost, policy, &mut app, start, time_up);
        let end = super::now_ns().unwrap_or(start);
        metrics.sync_apply_step_us(end.saturating_sub(start) / 1_000);
        let applied = app.applied;
        match step {
            Step::More => {
                self.applying = Some(app);
                return;
            }
            Step::Done => {}
            Step::Dropped => {
                log::warn!(
                    "tenantgate: sync answer {} dropped after {} steps, {} keys unapplied (their counts stay)",
                    app.seq,
                    applied.steps,
                    applied.dropped
                );
                metrics.sync_apply_dropped();
            }
        }
        if applied.steps > 1 {
            metrics.sync_applied_in_steps();
        }
        if applied.missed > 0 {
            log::warn!("tenantgate: {} keys missed their sync update", applied.missed);
        }
        refresh_view();
    }
}

enum Failure {
    Timeout,
    Other,
}

/// A report given up on by `claim` timed out; it may have opened the breaker.
fn note_given_up(metrics: &Metrics, given_up: GivenUp) {
    if given_up.timed_out {
        metrics.sync_timeout();
    }
    if given_up.opened {
        metrics.sync_breaker_opened();
    }
}

fn note_abandoned(metrics: &Metrics, abandoned: Result<Abandoned, HostError>) {
    if let Ok(Abandoned::Failed { opened: true }) = abandoned {
        log::warn!("tenantgate: sync circuit breaker open");
        metrics.sync_breaker_opened();
    }
}

fn refresh_view() {
    if let Ok((Some(state), _)) = shared::read_state(&ProxyHost) {
        SYNC_VIEW.with(|v| *v.borrow_mut() = Some(state));
    }
}

/// The node's session id (`sync::boot`); 0 (no session) if shared data
/// cannot be read.
fn tenantgate_boot(now: u64) -> u64 {
    crate::sync::boot::boot_id(&ProxyHost, now).unwrap_or(0)
}
