//! The entry points Envoy calls (`envoy_dynamic_module_on_*`): each turns
//! one hook into calls on the stream's worker ([`crate::node`]) and the
//! pipeline's directive into callbacks, inside [`guard`] (see `lib.rs`,
//! "Fail-safe"). A callback that may re-enter the module (a local reply, a
//! resumed request) is never made with a worker's mutex held.
//!
//! | Envoy hook | here | core |
//! |---|---|---|
//! | `on_program_init` | the logger, the panic hook, the fault switch (test builds only) | returns [`abi::ABI_VERSION`] |
//! | `on_http_filter_config_new` / `_destroy` | [`Node::configure`] / [`Node::remove`] | `Pipeline::configure` on every worker |
//! | `on_http_filter_per_route_config_new` | the route's class ([`RouteConfig`](crate::route::RouteConfig)) | |
//! | `on_http_filter_new` | the stream's worker and id | |
//! | `on_http_filter_request_headers` / `_body` | [`apply`] the directive | `on_request_headers` / `on_request_body` |
//! | `on_http_filter_response_headers` / `_body` / `_trailers` | the `RateLimit` headers added | `on_response_*` |
//! | `on_http_filter_stream_complete`, `_destroy` | the held stream forgotten | `on_stream_end` (the second finds nothing) |
//! | `on_http_filter_scheduled` | a held stream's answer applied on its worker | (made by the tick) |
//! | `on_http_filter_config_scheduled` | every worker's tick | `on_tick`, `take_callouts`, `dispatched`, `take_answers` |
//! | `on_http_filter_config_http_callout_done` | the answer to its worker | `on_sync_answer` |
//!
//! Once the response headers' answer says the pipeline keeps nothing of
//! the stream (`finished`: most requests, which hold no slot and settle no
//! cost), its body, trailers, end and destroy are no steps at all: no
//! worker lock, no callback (`destroy` still forgets a stream once held).
//!
//! By event: the program's hook in `entry/program.rs`; the config hooks
//! (a config made, destroyed and ticked, a sync callout's answer, a
//! route's config) in `entry/configs.rs`; the stream hooks here, in the
//! order Envoy calls them, with what a directive becomes in callbacks.

mod configs;
mod program;

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use tenantgate::pipeline::{BodyEdit, Chunk, Directive, RouteMark, StreamId, Verdict};
use tenantgate::response::LocalReply;

use crate::abi::{
    self, EnvoyBuffer, EnvoyHttpHeader, HttpFilterConfigModule, HttpFilterEnvoy, HttpFilterModule,
    ModuleBuffer,
};
use crate::host::{EnvoyHost, SystemClock};
use crate::node::{node, Config, Node};
use configs::config;

/// Runs `f`; a panic becomes `None` (logged by the panic hook).
fn guard<R>(f: impl FnOnce() -> R) -> Option<R> {
    catch_unwind(AssertUnwindSafe(f)).ok()
}

// ------------------------------------------------------------- streams

/// One stream's module state.
struct Filter {
    /// Our config: Envoy keeps its config (and so ours) alive while any
    /// of its streams is.
    config: *const Config,
    worker: usize,
    stream: StreamId,
    /// The pipeline keeps nothing of the stream since its response
    /// headers ([`tenantgate::pipeline::ResponseHeaders::finished`]): its
    /// body, trailers and end are not steps.
    finished: Cell<bool>,
    /// The stream was held once: its worker keeps its scheduler until
    /// `destroy`.
    held: Cell<bool>,
    /// The pipeline ended its answer early (`flow.rs`).
    ended: Cell<bool>,
}

impl Filter {
    fn config(&self) -> &Config {
        // SAFETY: see the field.
        unsafe { &*self.config }
    }

    /// Holds the stream on its worker (the pipeline paused it).
    fn hold(&self, w: &mut crate::node::Worker, envoy: HttpFilterEnvoy) {
        w.hold(self.stream, envoy, self.config().id);
        self.held.set(true);
    }
}

/// # Safety
/// `ptr` came from `on_http_filter_new` and is not destroyed.
unsafe fn filter<'a>(ptr: HttpFilterModule) -> &'a Filter {
    // SAFETY: the caller's promise.
    unsafe { &*ptr.cast::<Filter>() }
}

thread_local! {
    /// Stream ids: one counter per worker thread, so ids are unique per
    /// worker (a pipeline's streams) with no lock.
    static NEXT_STREAM: std::cell::Cell<StreamId> = const { std::cell::Cell::new(0) };
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config_ptr: HttpFilterConfigModule,
    envoy: HttpFilterEnvoy,
) -> HttpFilterModule {
    guard(|| {
        // SAFETY: Envoy's config pointer and the new stream, on its worker.
        let config = unsafe { config(config_ptr) };
        // SAFETY: `envoy` is the new stream, on this worker's thread.
        let worker = unsafe { abi::envoy_dynamic_module_callback_http_filter_get_worker_index(envoy) };
        let stream = NEXT_STREAM.with(|n| {
            let id = n.get().wrapping_add(1);
            n.set(id);
            id
        });
        let filter = Filter {
            config: Arc::as_ptr(config),
            worker: usize::try_from(worker).unwrap_or(0),
            stream,
            finished: Cell::new(false),
            held: Cell::new(false),
            ended: Cell::new(false),
        };
        Box::into_raw(Box::new(filter)).cast_const().cast()
    })
    .unwrap_or(std::ptr::null())
}

/// A stream's step on its worker: `f` with the worker's pipeline, the
/// stream's policy and host; then the answers it made for other streams
/// posted. `None`: the worker or policy is unknown. A panic inside is
/// caught by the caller's [`guard`], which then repairs the worker.
fn step<R>(
    f: &Filter,
    envoy: HttpFilterEnvoy,
    point: &str,
    run: impl FnOnce(&mut crate::node::Worker, &std::rc::Rc<tenantgate::policy::Policy>, &EnvoyHost<'_>) -> R,
) -> Option<R> {
    let node = node();
    let mut w = node.worker(f.worker)?;
    #[cfg(feature = "test-faults")]
    crate::fault::request(envoy, point);
    #[cfg(not(feature = "test-faults"))]
    let _ = (envoy, point);
    let policy = w.policies.get(&f.config().id).cloned()?;
    let host = EnvoyHost::stream(envoy, &node.store, &node.identity);
    let result = run(&mut w, &policy, &host);
    let answers = w.pipeline.take_answers();
    w.deliver(answers);
    Some(result)
}

/// After a caught panic: counted, the worker repaired, and the request's
/// failure mode for the class the core's classifier gives (the rule and the
/// classifier are the core's: `tenantgate::pipeline::failure`,
/// `tenantgate::engine::class_of`). If classifying panics too, the
/// policy's default mode.
fn failed(f: &Filter, envoy: HttpFilterEnvoy) -> Directive {
    let config = f.config();
    config.count_panic();
    let node = node();
    let class = guard(|| {
        let w = node.worker(f.worker)?;
        let policy = w.policies.get(&config.id)?;
        let host = EnvoyHost::stream(envoy, &node.store, &node.identity);
        tenantgate::engine::class_of(policy, &host).map(|c| c.name.clone())
    })
    .flatten();
    config.failure.directive(class.as_deref())
}

/// Sends a local reply on the stream.
fn send(envoy: HttpFilterEnvoy, reply: &LocalReply) {
    let mut headers: Vec<abi::ModuleHttpHeader> = reply
        .headers
        .iter()
        .map(|(k, v)| abi::ModuleHttpHeader::of(k, v.as_bytes()))
        .collect();
    let details = reply.details();
    // SAFETY: the current hook's stream; every buffer outlives the call.
    unsafe {
        abi::envoy_dynamic_module_callback_http_send_response(
            envoy,
            reply.status,
            headers.as_mut_ptr(),
            headers.len(),
            ModuleBuffer::of(&reply.body),
            ModuleBuffer::of(details.as_bytes()),
        );
    }
}

/// Writes the decision record (filter state, for the access log),
/// carries out a soft limit's route mark and a metered request's
/// `accept-encoding: identity`.
fn record(envoy: HttpFilterEnvoy, directive: &Directive) {
    if let Some(record) = &directive.record {
        filter_state(envoy, crate::RECORD_KEY, record, "decision record");
    }
    if let Some(mark) = &directive.mark {
        route_mark(envoy, mark);
    }
    if directive.identity_encoding {
        identity_encoding(envoy);
    }
    match &directive.body {
        BodyEdit::None => {}
        BodyEdit::Unsized => {
            // SAFETY: the current hook's stream; the buffer is ours (a null
            // value removes the header).
            let removed = unsafe {
                abi::envoy_dynamic_module_callback_http_set_header(
                    envoy,
                    abi::HEADER_REQUEST,
                    ModuleBuffer::of(tenantgate::pipeline::CONTENT_LENGTH.as_bytes()),
                    ModuleBuffer::NULL,
                )
            };
            if !removed {
                log::warn!("tenantgate: cannot remove the content-length request header");
            }
        }
        BodyEdit::Replace(body) => replace_request_body(envoy, body),
    }
}

/// The request body's last chunk: the chunks Envoy kept for us and this
/// one are replaced by `body`.
fn replace_request_body(envoy: HttpFilterEnvoy, body: &[u8]) {
    // SAFETY: the current hook's stream (its request body callback); the
    // buffer is ours, read during the call.
    let replaced = unsafe {
        abi::envoy_dynamic_module_callback_http_drain_body(envoy, abi::BODY_BUFFERED_REQUEST, usize::MAX);
        abi::envoy_dynamic_module_callback_http_drain_body(envoy, abi::BODY_RECEIVED_REQUEST, usize::MAX)
            && abi::envoy_dynamic_module_callback_http_append_body(
                envoy,
                abi::BODY_RECEIVED_REQUEST,
                ModuleBuffer::of(body),
            )
    };
    if !replaced {
        log::warn!("tenantgate: cannot replace the request body");
    }
}

/// Asks the upstream for an uncompressed answer (a metered request).
fn identity_encoding(envoy: HttpFilterEnvoy) {
    let name = tenantgate::pipeline::ACCEPT_ENCODING;
    // SAFETY: the current hook's stream; the buffers are ours.
    let set = unsafe {
        abi::envoy_dynamic_module_callback_http_set_header(
            envoy,
            abi::HEADER_REQUEST,
            ModuleBuffer::of(name.as_bytes()),
            ModuleBuffer::of(tenantgate::pipeline::IDENTITY.as_bytes()),
        )
    };
    if !set {
        log::warn!("tenantgate: cannot set the {name} request header");
    }
}

/// Keeps `value` in the stream's filter state under `key` (for the access log).
fn filter_state(envoy: HttpFilterEnvoy, key: &str, value: &str, what: &str) {
    // SAFETY: the current hook's stream; the buffers are ours.
    let set = unsafe {
        abi::envoy_dynamic_module_callback_http_set_filter_state_bytes(
            envoy,
            ModuleBuffer::of(key.as_bytes()),
            ModuleBuffer::of(value.as_bytes()),
        )
    };
    if !set {
        log::debug!("tenantgate: cannot set the {what}");
    }
}

/// Keeps a settled stream's cost record for the access log.
fn cost_record(envoy: HttpFilterEnvoy, record: Option<String>) {
    if let Some(r) = record {
        filter_state(envoy, crate::COST_KEY, &r, "cost record");
    }
}

/// Sets (or removes) a soft limit's marker on the request, then has Envoy
/// pick the route again with it.
fn route_mark(envoy: HttpFilterEnvoy, mark: &RouteMark) {
    let value = mark
        .value
        .as_deref()
        .map_or(ModuleBuffer::NULL, |v| ModuleBuffer::of(v.as_bytes()));
    // SAFETY: the current hook's stream; the buffers are ours (a null
    // value removes the header).
    let set = unsafe {
        abi::envoy_dynamic_module_callback_http_set_header(
            envoy,
            abi::HEADER_REQUEST,
            ModuleBuffer::of(mark.header.as_bytes()),
            value,
        )
    };
    if !set {
        log::warn!("tenantgate: cannot set the {} request header", mark.header);
        return;
    }
    // SAFETY: the current hook's stream.
    unsafe { abi::envoy_dynamic_module_callback_http_clear_route_cache(envoy) };
}

/// What a directive becomes on a request callback: `stop` is the status
/// that holds the stream (paused, or answered here).
fn apply(envoy: HttpFilterEnvoy, directive: Directive, go: u32, stop: u32) -> u32 {
    record(envoy, &directive);
    match directive.verdict {
        Verdict::Continue => go,
        Verdict::Pause => stop,
        // Only on a request body's chunk.
        Verdict::Buffer => abi::BODY_STOP_ITERATION_AND_BUFFER,
        Verdict::Reply(reply) => {
            send(envoy, &reply);
            stop
        }
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: HttpFilterEnvoy,
    ptr: HttpFilterModule,
    _end_of_stream: bool,
) -> abi::HeadersStatus {
    // SAFETY: Envoy's pointer to our filter, alive until `destroy`.
    let f = unsafe { filter(ptr) };
    let directive = guard(|| {
        step(f, envoy, "request_headers", |w, policy, host| {
            let d = w
                .pipeline
                .on_request_headers(host, &SystemClock, policy, f.stream);
            if d.verdict == Verdict::Pause {
                f.hold(w, envoy);
            }
            d
        })
    });
    let directive = match directive {
        Some(d) => d.unwrap_or_else(Directive::go),
        None => guard(|| failed(f, envoy)).unwrap_or_else(Directive::go),
    };
    guard(|| {
        apply(
            envoy,
            directive,
            abi::HEADERS_CONTINUE,
            abi::HEADERS_STOP_ALL_ITERATION_AND_WATERMARK,
        )
    })
    .unwrap_or(abi::HEADERS_CONTINUE)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: HttpFilterEnvoy,
    ptr: HttpFilterModule,
    end_of_stream: bool,
) -> abi::BodyStatus {
    // SAFETY: as in `request_headers`.
    let f = unsafe { filter(ptr) };
    let directive = guard(|| {
        // SAFETY: the current hook's stream.
        let size = unsafe {
            abi::envoy_dynamic_module_callback_http_get_body_size(envoy, abi::BODY_RECEIVED_REQUEST)
        };
        step(f, envoy, "request_body", |w, policy, host| {
            let d = w.pipeline.on_request_body(
                host,
                &SystemClock,
                policy,
                f.stream,
                // Envoy keeps what we buffered apart: the received body
                // is this chunk only.
                Chunk {
                    offset: 0,
                    len: size,
                    end_of_stream,
                },
            );
            if d.verdict == Verdict::Pause {
                f.hold(w, envoy);
            }
            d
        })
    });
    let directive = match directive {
        Some(d) => d.unwrap_or_else(Directive::go),
        None => guard(|| failed(f, envoy)).unwrap_or_else(Directive::go),
    };
    guard(|| {
        apply(
            envoy,
            directive,
            abi::BODY_CONTINUE,
            abi::BODY_STOP_ITERATION_NO_BUFFER,
        )
    })
    .unwrap_or(abi::BODY_CONTINUE)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    _envoy: HttpFilterEnvoy,
    _ptr: HttpFilterModule,
) -> abi::TrailersStatus {
    abi::TRAILERS_CONTINUE
}

/// A response step (nothing to answer; a panic only repairs the worker).
fn response_step(
    f: &Filter,
    envoy: HttpFilterEnvoy,
    point: &str,
    run: impl FnOnce(&mut crate::node::Worker, &EnvoyHost<'_>),
) {
    let done = guard(|| step(f, envoy, point, |w, _, host| run(w, host)));
    if done.is_none() {
        guard(|| failed(f, envoy));
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: HttpFilterEnvoy,
    ptr: HttpFilterModule,
    end_of_stream: bool,
) -> abi::HeadersStatus {
    // SAFETY: as in `request_headers`.
    let f = unsafe { filter(ptr) };
    let mut response = None;
    response_step(f, envoy, "response_headers", |w, host| {
        response = Some(
            w.pipeline
                .on_response_headers(host, &SystemClock, f.stream, end_of_stream),
        );
    });
    if let Some(r) = response {
        f.finished.set(r.finished);
        for (name, value) in r.added() {
            // SAFETY: the current hook's stream; the buffers are ours.
            let added = unsafe {
                abi::envoy_dynamic_module_callback_http_add_header(
                    envoy,
                    abi::HEADER_RESPONSE,
                    ModuleBuffer::of(name.as_bytes()),
                    ModuleBuffer::of(value.as_bytes()),
                )
            };
            if !added {
                log::warn!("tenantgate: cannot add the {name} response header");
            }
        }
        cost_record(envoy, r.cost_record);
    }
    abi::HEADERS_CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy: HttpFilterEnvoy,
    ptr: HttpFilterModule,
    end_of_stream: bool,
) -> abi::BodyStatus {
    // SAFETY: as in `request_headers`.
    let f = unsafe { filter(ptr) };
    if f.finished.get() {
        return abi::BODY_CONTINUE;
    }
    // SAFETY: the current hook's stream.
    let size =
        unsafe { abi::envoy_dynamic_module_callback_http_get_body_size(envoy, abi::BODY_RECEIVED_RESPONSE) };
    if f.ended.get() {
        // Its terminal event has gone with an earlier chunk (`flow.rs`).
        guard(|| crate::flow::drop_chunk(envoy, size));
        return abi::BODY_CONTINUE;
    }
    let mut body = None;
    response_step(f, envoy, "response_body", |w, host| {
        let b = w
            .pipeline
            .on_response_body(host, &SystemClock, f.stream, size, end_of_stream);
        if let Some(end) = b.end {
            f.ended.set(true);
            crate::flow::end(
                envoy,
                &tenantgate::host::Host::response_body(host, size).unwrap_or_default(),
                end,
            );
        }
        body = Some(b.cost_record);
    });
    cost_record(envoy, body.flatten());
    abi::BODY_CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    envoy: HttpFilterEnvoy,
    ptr: HttpFilterModule,
) -> abi::TrailersStatus {
    // SAFETY: as in `request_headers`.
    let f = unsafe { filter(ptr) };
    if f.finished.get() {
        return abi::TRAILERS_CONTINUE;
    }
    let mut record = None;
    response_step(f, envoy, "response_trailers", |w, host| {
        record = w.pipeline.on_response_trailers(host, &SystemClock, f.stream);
    });
    cost_record(envoy, record);
    abi::TRAILERS_CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    envoy: HttpFilterEnvoy,
    ptr: HttpFilterModule,
) {
    // SAFETY: as in `request_headers`.
    let f = unsafe { filter(ptr) };
    if f.finished.get() {
        return;
    }
    let mut record = None;
    response_step(f, envoy, "stream_complete", |w, host| {
        record = w.pipeline.on_stream_end(host, &SystemClock, f.stream);
    });
    cost_record(envoy, record);
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(ptr: HttpFilterModule) {
    guard(|| {
        if ptr.is_null() {
            return;
        }
        // SAFETY: made by `filter_new`, destroyed once, here.
        let f = unsafe { Box::from_raw(ptr.cast::<Filter>().cast_mut()) };
        if f.finished.get() && !f.held.get() {
            return;
        }
        let node: &Node = node();
        if let Some(mut w) = node.worker(f.worker) {
            // Without a stream: the end was already recorded at
            // `stream_complete`, unless the stream was torn down first.
            let host = EnvoyHost::tick(&node.store, &node.identity);
            w.pipeline.on_stream_end(&host, &SystemClock, f.stream);
            w.held.remove(&f.stream);
        }
    });
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    envoy: HttpFilterEnvoy,
    ptr: HttpFilterModule,
    _event: u64,
) {
    // SAFETY: as in `request_headers`.
    let f = unsafe { filter(ptr) };
    let answer = guard(|| {
        let mut w = node().worker(f.worker)?;
        w.held.get_mut(&f.stream).and_then(|h| h.answer.take())
    })
    .flatten();
    let Some(directive) = answer else { return };
    guard(|| {
        record(envoy, &directive);
        match directive.verdict {
            // SAFETY: the current hook's stream, paused by us.
            Verdict::Continue => unsafe {
                abi::envoy_dynamic_module_callback_http_filter_continue_decoding(envoy)
            },
            Verdict::Reply(reply) => send(envoy, &reply),
            // A held request's answer is never to buffer a body.
            Verdict::Pause | Verdict::Buffer => {}
        }
    });
}

// Hooks Envoy requires that tenantgate has no use for: callouts and streams
// of a stream (the sync's callouts are the config's), watermarks.

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _envoy: HttpFilterEnvoy,
    _ptr: HttpFilterModule,
    _callout_id: u64,
    _result: abi::CalloutResult,
    _headers: *const EnvoyHttpHeader,
    _headers_size: usize,
    _body: *const EnvoyBuffer,
    _body_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _envoy: HttpFilterEnvoy,
    _ptr: HttpFilterModule,
    _stream_id: u64,
    _headers: *const EnvoyHttpHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _envoy: HttpFilterEnvoy,
    _ptr: HttpFilterModule,
    _stream_id: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _envoy: HttpFilterEnvoy,
    _ptr: HttpFilterModule,
    _stream_id: u64,
    _trailers: *const EnvoyHttpHeader,
    _trailers_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _envoy: HttpFilterEnvoy,
    _ptr: HttpFilterModule,
    _stream_id: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _envoy: HttpFilterEnvoy,
    _ptr: HttpFilterModule,
    _stream_id: u64,
    _reason: u32,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _envoy: HttpFilterEnvoy,
    _ptr: HttpFilterModule,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _envoy: HttpFilterEnvoy,
    _ptr: HttpFilterModule,
) {
}
