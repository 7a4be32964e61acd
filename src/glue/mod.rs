//! The proxy-wasm host: the only module that names `proxy_wasm`.
//!
//! It translates. Envoy's callbacks become calls on the worker's one
//! [`Pipeline`] (held in [`WORKER`], one per VM whatever its root
//! contexts), and the pipeline's directives become hostcalls: continue,
//! pause, a local reply, the decision record, a resumed or answered held
//! stream, a sync callout. [`ProxyHost`] is the core's [`Host`] over
//! hostcalls, [`WallClock`] its clock, [`metrics::EnvoyStats`] its stats.
//! What to decide, in which order, lives in [`crate::pipeline`].
//!
//! No hostcall may trap the VM: a trap fails it for every later request on
//! the worker. The SDK's trait helpers unwrap, and even its
//! `Result`-returning `hostcalls::*` panic on statuses they do not expect,
//! so every hostcall goes through [`abi`] (raw imports, every status
//! handled), except `dispatch_http_call` and logging: [`abi`]'s header
//! lists each wrapper avoided, why, and why those two are safe.

mod abi;
mod metrics;
#[cfg(feature = "self-time")]
mod self_time;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use crate::host::Clock;
use crate::host::{CasResult, Host, HostError};
use crate::pipeline::{
    Answer, BodyEdit, Callout, Chunk, Directive, EndAnswer, Pipeline, RouteMark, StreamId, Verdict,
};
use crate::policy::Policy;
use crate::response::LocalReply;
use crate::stats::{Metric, Stats};
use crate::sync::syncer::CalloutAnswer;
use abi::HostStatus;
use metrics::EnvoyStats;

/// The worker VM's pipeline and its stats sink.
struct Worker {
    pipeline: Pipeline,
    stats: EnvoyStats,
}

thread_local! {
    /// One per VM: every root context of the VM (one per filter instance)
    /// and every stream share it.
    static WORKER: RefCell<Option<Worker>> = const { RefCell::new(None) };
}

/// Runs `f` with the worker's pipeline and stats (created, with the fixed
/// stats defined, on first use). `None` only if re-entered, which the
/// host's single-threaded callbacks never do.
fn with_worker<R>(f: impl FnOnce(&mut Pipeline, &mut EnvoyStats) -> R) -> Option<R> {
    WORKER.with(|w| {
        let mut w = w.try_borrow_mut().ok()?;
        let worker = w.get_or_insert_with(|| {
            let mut stats = EnvoyStats::default();
            for m in Metric::fixed() {
                stats.define(&m);
            }
            Worker {
                pipeline: Pipeline::default(),
                stats,
            }
        });
        Some(f(&mut worker.pipeline, &mut worker.stats))
    })
}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { policy: None }) });
}}

/// Envoy's wall clock.
struct WallClock;

impl Clock for WallClock {
    fn now(&self) -> Option<u64> {
        abi::now_ns().ok()
    }
}

/// Envoy, through hostcalls.
struct ProxyHost;

impl Host for ProxyHost {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        // Bytes: a client's header value need not be UTF-8.
        abi::header(MapType::HttpRequestHeaders, name).ok().flatten()
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        abi::header(MapType::HttpResponseHeaders, name).ok().flatten()
    }

    fn response_body(&self, len: usize) -> Option<Vec<u8>> {
        abi::buffer(BufferType::HttpResponseBody, 0, len).ok().flatten()
    }

    fn response_trailer(&self, name: &str) -> Option<Vec<u8>> {
        abi::header(MapType::HttpResponseTrailers, name).ok().flatten()
    }

    fn request_body(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        abi::buffer(BufferType::HttpRequestBody, offset, len)
            .ok()
            .flatten()
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

/// A sync callout's answer as Envoy delivers it (`on_http_call_response`).
struct EnvoyAnswer {
    /// Response headers: 0 when the callout failed (there is no response
    /// then, and reading one returns BadArgument).
    headers: usize,
    body_size: usize,
}

impl CalloutAnswer for EnvoyAnswer {
    fn has_response(&self) -> bool {
        self.headers > 0
    }

    fn status(&self) -> Result<Option<Vec<u8>>, HostError> {
        abi::header(MapType::HttpCallResponseHeaders, ":status").map_err(|_| HostError)
    }

    fn body_size(&self) -> usize {
        self.body_size
    }

    fn body(&self) -> Result<Option<Vec<u8>>, HostError> {
        abi::buffer(BufferType::HttpCallResponseBody, 0, self.body_size).map_err(|_| HostError)
    }
}

/// One per plugin configuration per worker: owns the policy in force.
struct Root {
    policy: Option<Rc<Policy>>,
}

impl Context for Root {
    fn on_done(&mut self) -> bool {
        // The VM is shutting down: the last counts go to Envoy.
        with_worker(|p, stats| p.flush(stats));
        true
    }

    fn on_http_call_response(&mut self, token: u32, headers: usize, body_size: usize, _trailers: usize) {
        let Some(policy) = self.policy.clone() else { return };
        let answer = EnvoyAnswer { headers, body_size };
        with_worker(|p, stats| p.on_sync_answer(&ProxyHost, &WallClock, stats, &policy, token, &answer));
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = match abi::buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(bytes) => bytes.unwrap_or_default(),
            Err(status) => {
                log::error!("tenantgate: cannot read the plugin configuration: {status:?}");
                with_worker(|_, stats| stats.add(&Metric::ConfigRejections, 1));
                return false;
            }
        };
        let configured = with_worker(|p, stats| p.configure(&ProxyHost, &WallClock, stats, &config));
        match configured {
            Some(Ok(policy)) => {
                log::info!(
                    "tenantgate: policy {} loaded ({} plans, mode {:?})",
                    policy.version,
                    policy.plans().len(),
                    policy.mode
                );
                #[cfg(feature = "self-time")]
                self_time::report(&policy);
                self.policy = Some(policy);
                // Every configuration ticks: requests held under an earlier
                // one still need answering.
                let tick_ms = u32::try_from(crate::pipeline::TICK_NS / 1_000_000).unwrap_or(u32::MAX);
                if let Err(status) = abi::set_tick_period_ms(tick_ms) {
                    log::warn!("tenantgate: cannot set the tick: {status:?}");
                }
                true
            }
            Some(Err(errors)) => {
                for e in &errors.0 {
                    log::error!("tenantgate: policy rejected: {e}");
                }
                false
            }
            None => false,
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            stream: context_id,
            policy: self.policy.clone(),
            ended: false,
            kept: 0,
        }))
    }

    fn on_tick(&mut self) {
        let policy = self.policy.clone();
        let done = with_worker(|p, stats| {
            p.on_tick(&ProxyHost, &WallClock, stats, policy.as_ref());
            (p.take_callouts(), p.take_answers())
        });
        let Some((callouts, answers)) = done else { return };
        if let Some(policy) = &policy {
            for c in callouts {
                let token = dispatch(&c);
                with_worker(|p, stats| p.dispatched(&ProxyHost, &WallClock, stats, policy, &c, token));
            }
        }
        apply_answers(answers);
    }
}

/// Sends a sync callout; `Err`: Envoy refused it (an unknown cluster).
fn dispatch(c: &Callout) -> Result<u32, ()> {
    let headers = c.headers().to_vec();
    let timeout = Duration::from_nanos(c.timeout_ns);
    hostcalls::dispatch_http_call(&c.cluster, headers, Some(&c.body), vec![], timeout).map_err(|status| {
        log::warn!("tenantgate: cannot call sync cluster {}: {status:?}", c.cluster);
    })
}

/// Sends a local reply on the current stream; false if Envoy refused it.
fn send(reply: &LocalReply) -> bool {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(k, v)| (k.as_ref(), v.as_str()))
        .collect();
    match abi::send_local_response(reply.status, &headers, &reply.body) {
        Ok(()) => true,
        Err(status) => {
            log::error!("tenantgate: cannot send the {} reply: {status:?}", reply.status);
            with_worker(|p, _| p.reply_failed());
            false
        }
    }
}

/// Carries out a directive on the current stream (`body`: the request body
/// bytes the host holds, on a request body's callback).
fn apply(directive: Directive, body: usize) -> Action {
    if let Some(record) = &directive.record {
        if abi::set_property(crate::pipeline::RECORD_PROPERTY, record.as_bytes()).is_err() {
            log::debug!("tenantgate: cannot set the decision record");
        }
    }
    if let Some(mark) = &directive.mark {
        route_mark(mark);
    }
    if directive.identity_encoding {
        let (name, value) = (crate::pipeline::ACCEPT_ENCODING, crate::pipeline::IDENTITY);
        if let Err(status) = abi::replace_header(MapType::HttpRequestHeaders, name, value) {
            log::warn!("tenantgate: cannot set the {name} request header: {status:?}");
        }
    }
    match &directive.body {
        BodyEdit::None => {}
        BodyEdit::Unsized => {
            if let Err(status) =
                abi::remove_header(MapType::HttpRequestHeaders, crate::pipeline::CONTENT_LENGTH)
            {
                log::warn!("tenantgate: cannot remove the content-length request header: {status:?}");
            }
        }
        BodyEdit::Replace(new) => {
            if let Err(status) = abi::set_buffer(BufferType::HttpRequestBody, body, new) {
                log::warn!("tenantgate: cannot replace the request body: {status:?}");
            }
        }
    }
    match directive.verdict {
        Verdict::Continue => Action::Continue,
        // A request body's chunk kept by Envoy: `StopIterationAndBuffer`.
        Verdict::Pause | Verdict::Buffer => Action::Pause,
        // If Envoy refused the reply, pausing would hang the request.
        Verdict::Reply(reply) if send(&reply) => Action::Pause,
        Verdict::Reply(_) => Action::Continue,
    }
}

/// Sets (or removes) a soft limit's marker on the request, then has Envoy
/// pick the route again with it (`clear_route_cache`).
fn route_mark(mark: &RouteMark) {
    let changed = match &mark.value {
        Some(value) => abi::replace_header(MapType::HttpRequestHeaders, &mark.header, value),
        None => abi::remove_header(MapType::HttpRequestHeaders, &mark.header),
    };
    if let Err(status) = changed {
        log::warn!(
            "tenantgate: cannot set the {} request header: {status:?}",
            mark.header
        );
        return;
    }
    if let Err(status) = abi::clear_route_cache() {
        log::warn!("tenantgate: cannot clear the route cache: {status:?}");
    }
}

/// Keeps a settled stream's cost record for the access log.
fn cost_record(record: Option<String>) {
    if let Some(r) = record {
        if abi::set_property(crate::pipeline::settle::COST_PROPERTY, r.as_bytes()).is_err() {
            log::debug!("tenantgate: cannot set the cost record");
        }
    }
}

/// Carries out directives for held streams, each on its own stream.
fn apply_answers(answers: Vec<Answer>) {
    for a in answers {
        if abi::set_effective_context(a.stream).is_err() {
            // The stream is gone: whatever it held goes back.
            let _ = with_worker(|p, _| p.on_stream_end(&ProxyHost, &WallClock, a.stream));
            continue;
        }
        if apply(a.directive, 0) == Action::Continue && abi::resume_http_request().is_err() {
            log::warn!("tenantgate: cannot resume a held request");
        }
    }
}

/// One per HTTP stream.
struct Request {
    stream: StreamId,
    policy: Option<Rc<Policy>>,
    /// The pipeline ended its answer early ([`EndAnswer`]).
    ended: bool,
    /// Request body bytes Envoy keeps for this filter (`Verdict::Buffer`),
    /// in front of the next chunk it delivers.
    kept: usize,
}

/// Ends an answer in the current response body chunk (see
/// [`crate::pipeline::EndAnswer`]): the chunk becomes its first `keep`
/// bytes and the terminal event, and later chunks are dropped (the
/// response ends with the upstream's); a refused one is reset at once
/// (Envoy resets after this callback, so nothing of the chunk goes).
fn end_answer(body_size: usize, end: EndAnswer) {
    let mut kept = abi::buffer(BufferType::HttpResponseBody, 0, end.keep)
        .ok()
        .flatten()
        .unwrap_or_default();
    kept.truncate(end.keep);
    kept.extend_from_slice(end.terminal);
    if let Err(status) = abi::set_buffer(BufferType::HttpResponseBody, body_size, &kept) {
        log::warn!("tenantgate: cannot end an answer: {status:?}");
    }
    if end.reset {
        reset_response();
    }
}

/// Drops the current response body chunk.
fn drop_chunk(body_size: usize) {
    if let Err(status) = abi::set_buffer(BufferType::HttpResponseBody, body_size, &[]) {
        log::warn!("tenantgate: cannot drop an ended answer's chunk: {status:?}");
    }
}

fn reset_response() {
    if let Err(status) = abi::reset_http_response() {
        log::warn!("tenantgate: cannot reset an ended answer: {status:?}");
    }
}

impl Request {
    /// Runs a pipeline step for this stream, then the answers it made for
    /// other streams (a request displaced from a full queue).
    fn step(&mut self, body: usize, f: impl FnOnce(&mut Pipeline) -> Directive) -> Action {
        let Some((directive, answers)) = with_worker(|p, _| (f(p), p.take_answers())) else {
            return Action::Continue;
        };
        // Envoy gives the chunks it keeps for us, and the new one after
        // them, on the next callback.
        self.kept = if directive.verdict == Verdict::Buffer {
            body
        } else {
            0
        };
        let action = apply(directive, body);
        if !answers.is_empty() {
            apply_answers(answers);
            // Back on this request's stream.
            let _ = abi::set_effective_context(self.stream);
        }
        action
    }

    fn end(&self) {
        let record = with_worker(|p, _| p.on_stream_end(&ProxyHost, &WallClock, self.stream));
        cost_record(record.flatten());
    }
}

impl Context for Request {
    fn on_done(&mut self) -> bool {
        self.end();
        true
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let Some(policy) = self.policy.clone() else {
            return Action::Continue;
        };
        let stream = self.stream;
        self.step(0, |p| {
            p.on_request_headers(&ProxyHost, &WallClock, &policy, stream)
        })
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(policy) = self.policy.clone() else {
            return Action::Continue;
        };
        let stream = self.stream;
        let chunk = Chunk {
            offset: self.kept,
            len: body_size.saturating_sub(self.kept),
            end_of_stream,
        };
        self.step(body_size, |p| {
            p.on_request_body(&ProxyHost, &WallClock, &policy, stream, chunk)
        })
    }

    fn on_http_response_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let stream = self.stream;
        let Some(response) =
            with_worker(|p, _| p.on_response_headers(&ProxyHost, &WallClock, stream, end_of_stream))
        else {
            return Action::Continue;
        };
        for (name, value) in response.added() {
            if abi::add_header(MapType::HttpResponseHeaders, name, value).is_err() {
                log::warn!("tenantgate: cannot add the {name} response header");
            }
        }
        cost_record(response.cost_record);
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.ended {
            // The answer was ended in an earlier chunk, which has gone with
            // its terminal event: nothing more of it goes.
            drop_chunk(body_size);
            return Action::Continue;
        }
        let stream = self.stream;
        let Some(body) =
            with_worker(|p, _| p.on_response_body(&ProxyHost, &WallClock, stream, body_size, end_of_stream))
        else {
            return Action::Continue;
        };
        cost_record(body.cost_record);
        if let Some(end) = body.end {
            self.ended = true;
            end_answer(body_size, end);
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _trailers: usize) -> Action {
        let stream = self.stream;
        let record = with_worker(|p, _| p.on_response_trailers(&ProxyHost, &WallClock, stream));
        cost_record(record.flatten());
        Action::Continue
    }

    fn on_log(&mut self) {
        self.end();
    }
}
