//! The host layer: the only module that names `proxy_wasm`.
//!
//! It implements [`Host`] with hostcalls, compiles the policy in
//! `on_configure` (returning `false` so Envoy keeps the previous
//! configuration on any error), and turns each [`Decision`] into an Envoy
//! action, headers and stats.
//!
//! No hostcall may trap the VM: a trap fails it for every later request on
//! the worker. The SDK's trait helpers unwrap, and even its
//! `Result`-returning `hostcalls::*` panic on statuses they do not expect,
//! so every hostcall goes through [`abi`] (raw imports, every status
//! handled), except `dispatch_http_call` and logging: [`abi`]'s header
//! lists each wrapper avoided, why, and why those two are safe.

mod abi;
mod admission;
mod breaker;
mod metrics;
#[cfg(feature = "self-time")]
mod self_time;
mod sync;

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use crate::engine::{self, Decision, RateLimitHeaders, Scratch};
use crate::host::{CasResult, Host, HostError};
use crate::policy::Policy;
use crate::queue::{NotQueued, Queue};
use crate::response;
use crate::sync::SyncState;
use abi::HostStatus;
use metrics::Metrics;

/// How often a worker serves its queues of held requests, in nanoseconds.
const TICK_NS: u64 = 10_000_000;
const TICK: Duration = Duration::from_nanos(TICK_NS);

thread_local! {
    /// The worker's held requests (`on_limit: queue`). One per VM: a
    /// request held under one configuration is served after a reload too.
    static QUEUE: RefCell<Queue> = RefCell::new(Queue::default());
    /// `RateLimit` headers of held requests admitted by the queue, for
    /// their response (keyed by stream context id).
    static RESUMED: RefCell<HashMap<u32, RateLimitHeaders>> = RefCell::new(HashMap::new());
    /// The node's sync state as this worker last read it (every tick):
    /// global limits decide with it, so requests never read it themselves.
    static SYNC_VIEW: RefCell<Option<SyncState>> = const { RefCell::new(None) };
    /// The worker's charge buffers, reused by every request (one request
    /// runs at a time on a worker).
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Charges a prepared request with the worker's buffers.
fn charge(policy: &Policy, prepared: &engine::Prepared, now: u64) -> Decision {
    let view = sync_view(policy);
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut scratch) => {
            engine::charge_synced(policy, prepared, &ProxyHost, now, view.as_ref(), &mut scratch)
        }
        // Never re-entered; if it were, fresh buffers are correct, only slower.
        Err(_) => engine::charge_synced(
            policy,
            prepared,
            &ProxyHost,
            now,
            view.as_ref(),
            &mut Scratch::default(),
        ),
    })
}

/// The sync state global limits decide with (`None` when the policy has
/// none: non-global limits never look at it).
fn sync_view(policy: &Policy) -> Option<SyncState> {
    policy.sync.as_ref()?;
    SYNC_VIEW.with(|v| *v.borrow())
}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::new()) });
}}

/// Nanoseconds since the Unix epoch from the host's wall clock.
fn now_ns() -> Option<u64> {
    abi::now_ns().ok()
}

/// Envoy, through hostcalls.
struct ProxyHost;

impl Host for ProxyHost {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        // Bytes: a client's header value need not be UTF-8.
        abi::header(MapType::HttpRequestHeaders, name).ok().flatten()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        abi::property(path).ok().flatten()
    }

    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        abi::shared_get(key).map_err(|_| HostError)
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<CasResult, HostError> {
        match abi::shared_set(key, value, cas) {
            Ok(()) => Ok(CasResult::Written),
            Err(HostStatus::CAS_MISMATCH) => Ok(CasResult::Conflict),
            Err(_) => Err(HostError),
        }
    }
}

/// One per plugin configuration per worker: owns the compiled policy.
struct Root {
    policy: Option<Rc<Policy>>,
    metrics: Rc<Metrics>,
    admission: Rc<admission::Admission>,
    sync: sync::Syncer,
}

impl Root {
    fn new() -> Root {
        Root {
            policy: None,
            metrics: Rc::new(Metrics::define()),
            admission: Rc::new(admission::Admission::define()),
            sync: sync::Syncer::default(),
        }
    }
}

impl Context for Root {
    fn on_done(&mut self) -> bool {
        // The VM is shutting down: the last tick's counts go to Envoy.
        self.metrics.flush();
        true
    }

    fn on_http_call_response(&mut self, token: u32, headers: usize, body_size: usize, _trailers: usize) {
        if let Some(policy) = self.policy.clone() {
            let answer = sync::Answer { headers, body_size };
            self.sync.on_response(&policy, &self.metrics, token, answer);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = match abi::buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(bytes) => bytes.unwrap_or_default(),
            Err(status) => {
                log::error!("tenantgate: cannot read the plugin configuration: {status:?}");
                self.metrics.config_rejected();
                return false;
            }
        };
        match Policy::from_json(&config) {
            Ok(mut policy) => {
                policy.effective_from_ns = now_ns().unwrap_or(0);
                log::info!(
                    "tenantgate: policy {} loaded ({} plans, mode {:?})",
                    policy.version,
                    policy.plans().len(),
                    policy.mode
                );
                self.sync.configure(&policy, &ProxyHost);
                self.admission.configure(&policy, policy.effective_from_ns);
                self.policy = Some(Rc::new(policy));
                self.metrics.config_loaded();
                #[cfg(feature = "self-time")]
                if let Some(policy) = &self.policy {
                    self_time::report(policy);
                }
                // Every configuration serves the queue: requests held under
                // an earlier one still need answering.
                let tick_ms = u32::try_from(TICK.as_millis()).unwrap_or(u32::MAX);
                if let Err(status) = abi::set_tick_period_ms(tick_ms) {
                    log::warn!("tenantgate: cannot set the queue tick: {status:?}");
                }
                true
            }
            Err(errors) => {
                for e in &errors.0 {
                    log::error!("tenantgate: policy rejected: {e}");
                }
                self.metrics.config_rejected();
                false
            }
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            context_id,
            policy: self.policy.clone(),
            metrics: self.metrics.clone(),
            admission: self.admission.clone(),
            stream: admission::Stream::default(),
            response_headers: None,
            held: false,
        }))
    }

    fn on_tick(&mut self) {
        self.metrics.flush();
        let Some(now) = now_ns() else { return };
        self.admission.tick(&self.metrics, self.policy.as_deref(), now);
        if let Some(policy) = self.policy.clone() {
            self.sync.tick(&policy, &self.metrics, now);
        }
        if QUEUE.with(|q| q.borrow().is_empty()) {
            return;
        }
        let tick_ns = TICK.as_nanos() as u64;
        let answered = QUEUE.with(|q| {
            q.borrow_mut()
                .tick(now, tick_ns, |w| charge(&w.policy, &w.prepared, now))
        });
        for (waiting, decision) in answered {
            self.metrics.record(&decision);
            self.metrics.queue_answered(decision.deny_status().is_none());
            // The stream may have ended meanwhile; then there is nothing to do.
            if abi::set_effective_context(waiting.context_id).is_err() {
                continue;
            }
            let policy = &waiting.policy;
            match response::local_reply(&decision, &policy.version, policy.ratelimit_headers, None) {
                Some(reply) => {
                    send_reply(&reply, &self.metrics);
                }
                None => {
                    if let (true, Some(h)) = (policy.ratelimit_headers, decision.headers) {
                        RESUMED.with(|r| r.borrow_mut().insert(waiting.context_id, h));
                    }
                    if abi::resume_http_request().is_err() {
                        log::warn!("tenantgate: cannot resume a held request");
                    }
                }
            }
        }
    }
}

/// Sends a local reply; false if Envoy refused it.
fn send_reply(reply: &response::LocalReply, metrics: &Metrics) -> bool {
    let headers: Vec<(&str, &str)> = reply.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    match abi::send_local_response(reply.status, &headers, reply.body.as_bytes()) {
        Ok(()) => true,
        Err(status) => {
            log::error!("tenantgate: cannot send the {} reply: {status:?}", reply.status);
            metrics.reply_failed();
            false
        }
    }
}

/// One per HTTP stream.
struct Request {
    context_id: u32,
    policy: Option<Rc<Policy>>,
    metrics: Rc<Metrics>,
    admission: Rc<admission::Admission>,
    /// The stream's admission slot and body budget.
    stream: admission::Stream,
    /// `RateLimit` headers to add to an allowed request's response.
    response_headers: Option<RateLimitHeaders>,
    /// Paused in the queue.
    held: bool,
}

impl Request {
    /// Gives the stream's slot back, once (from `on_log` or `on_done`),
    /// and records its outcome for an adaptive dependency.
    fn release_slot(&mut self) {
        if self.stream.ticket.is_some() || self.stream.queued {
            admission::end_signal(self.context_id, now_ns().unwrap_or(0));
        }
        if let Some(ticket) = self.stream.ticket.take() {
            admission::release(ticket, now_ns().unwrap_or(0));
        }
        if self.stream.queued {
            self.stream.queued = false;
            admission::stream_done(self.context_id, now_ns().unwrap_or(0));
        }
    }
}

impl Context for Request {
    fn on_done(&mut self) -> bool {
        self.release_slot();
        // Whatever path the stream took, nothing of it stays behind.
        admission::forget_signal(self.context_id);
        if self.held && QUEUE.with(|q| q.borrow_mut().remove(self.context_id)) {
            self.metrics.queue_cancelled();
        }
        RESUMED.with(|r| r.borrow_mut().remove(&self.context_id));
        true
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let Some(policy) = self.policy.clone() else {
            return Action::Continue;
        };
        let Some(now) = now_ns() else {
            return self.finish(&policy, Decision::unavailable());
        };
        let prepared = match engine::prepare(&policy, &ProxyHost) {
            Ok(p) => p,
            Err(reason) => return self.finish(&policy, Decision::passed(reason)),
        };
        if prepared.class.labels.checks_anything() {
            let admitted =
                self.admission
                    .on_request_headers(&policy, &prepared, &mut self.stream, self.context_id, now);
            match admitted {
                Ok(()) => {}
                Err(admission::Refused::Held) => return Action::Pause,
                Err(admission::Refused::Reply(refusal)) => return self.finish(&policy, refusal),
                Err(admission::Refused::Degraded(reply, refusal)) => {
                    self.metrics.record(&refusal);
                    // If Envoy refused the reply, pausing would hang the request.
                    return if admission::send_degraded(&reply) {
                        Action::Pause
                    } else {
                        self.metrics.reply_failed();
                        Action::Continue
                    };
                }
            }
        }
        let decision = charge(&policy, &prepared, now);
        if decision.deny_status().is_some() {
            // A rate-limit denial gives its slot back at once.
            if let Some(ticket) = self.stream.ticket.take() {
                admission::release(ticket, now);
                admission::forget_signal(self.context_id);
            }
        }
        if decision.deny_status() == Some(429) {
            let offered = QUEUE.with(|q| {
                q.borrow_mut()
                    .offer(self.context_id, &policy, &prepared, &decision, now)
            });
            match offered {
                Ok(()) => {
                    self.held = true;
                    self.metrics.queue_held();
                    return Action::Pause;
                }
                Err(NotQueued::Full) => self.metrics.queue_full(),
                Err(_) => {}
            }
        }
        self.finish(&policy, decision)
    }

    fn on_log(&mut self) {
        self.release_slot();
    }

    fn on_http_request_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        if self.stream.body.is_none() {
            return Action::Continue;
        }
        let Some(policy) = self.policy.clone() else {
            return Action::Continue;
        };
        match self.admission.on_request_body(&mut self.stream, body_size) {
            Ok(()) => Action::Continue,
            Err(refusal) => self.finish(&policy, refusal),
        }
    }

    fn on_http_response_trailers(&mut self, _trailers: usize) -> Action {
        // The body ended before the trailers.
        if self.stream.capture.is_some() {
            self.admission.on_response_body(&mut self.stream, 0, true);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.stream.capture.is_some() {
            self.admission
                .on_response_body(&mut self.stream, body_size, end_of_stream);
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        if self.stream.ticket.is_some() || self.stream.queued {
            admission::on_response_headers(self.context_id);
        }
        if self.stream.queued && self.stream.capture.is_none() {
            self.stream.capture = admission::take_queued_capture(self.context_id);
        }
        if self.stream.capture.is_some() {
            let now = now_ns().unwrap_or(0);
            self.admission
                .on_response_headers(&mut self.stream, end_of_stream, now);
        }
        let headers = self
            .response_headers
            .take()
            .or_else(|| RESUMED.with(|r| r.borrow_mut().remove(&self.context_id)));
        if let Some(h) = headers {
            for (name, value) in [("ratelimit-policy", &h.policy), ("ratelimit", &h.ratelimit)] {
                if abi::add_header(MapType::HttpResponseHeaders, name, value).is_err() {
                    log::warn!("tenantgate: cannot add the {name} response header");
                }
            }
        }
        Action::Continue
    }
}

impl Request {
    /// Records a decision and acts on it: a local reply, or on its way.
    fn finish(&mut self, policy: &Policy, decision: Decision) -> Action {
        self.metrics.record(&decision);
        if decision.deny_status().is_some() {
            // tenantgate answers: not a health signal of the upstream.
            admission::forget_signal(self.context_id);
            // Only a denial echoes the request id: read it only then.
            let raw = ProxyHost.request_header("x-request-id");
            let request_id = response::request_id(raw.as_deref());
            let reply =
                response::local_reply(&decision, &policy.version, policy.ratelimit_headers, request_id);
            if let Some(reply) = reply {
                // If Envoy refused the reply, pausing would hang the request.
                return if send_reply(&reply, &self.metrics) {
                    Action::Pause
                } else {
                    Action::Continue
                };
            }
        }
        if policy.ratelimit_headers {
            self.response_headers = decision.headers;
        }
        Action::Continue
    }
}
