//! The proxy-wasm hostcalls the glue makes, declared here and called raw,
//! so that no status Envoy returns can trap the VM.
//!
//! # Why not the SDK's wrappers
//! proxy-wasm 0.2.5's `hostcalls::*` match the host's status against the
//! few values each wrapper expects and `panic!` on any other one; with
//! `panic = "abort"` that is a trap, which fails the worker's VM for every
//! later request (Envoy answers them 503 under the default failure policy).
//! Read in its source (`src/hostcalls.rs`): `get_map_value_bytes`,
//! `get_buffer`, `get_shared_data` accept only Ok and NotFound;
//! `set_shared_data` Ok and CasMismatch; `get_property` adds
//! SerializationFailure and InternalFailure; `send_http_response`,
//! `add_map_value`, `resume_http_request`, `get_current_time`,
//! `set_tick_period` and `define_metric` only Ok; `set_effective_context`
//! Ok and BadArgument; `increment_metric` / `record_metric` Ok, NotFound
//! (and BadArgument). Envoy does return other statuses on paths the filter
//! reaches (read in `source/extensions/common/wasm/context.cc`): a header
//! map that does not exist is BadArgument, and on a failed callout (reset,
//! response body over the async client's 32 MiB buffer limit) Envoy calls
//! `on_http_call_response(token, 0, 0, 0)` with no response at all, so
//! reading `:status` there returned BadArgument and trapped the VM
//! (reproduced: `integration-tests/tests/callout.rs`). A memory allocation
//! the host cannot make is InvalidMemoryAccess for every call returning data.
//!
//! `set_property` (the admission decision record) is declared raw too: the
//! SDK's wrapper accepts only Ok and panics on any other status; so are
//! `replace_header_map_value` and `remove_header_map_value` (a soft
//! limit's marker) and `call_foreign_function` (Envoy's
//! `clear_route_cache`, read in `source/extensions/common/wasm/foreign.cc`:
//! it returns Ok; proxy-wasm-cpp-host's `call_foreign_function` returns
//! NotFound for a name the host did not register).
//!
//! Every function here returns the raw status as [`HostStatus`] (a plain
//! `u32`: an unknown value is data, never undefined behaviour) and callers
//! handle it. Declaring the imports with `u32` instead of the SDK's `Status`
//! enum is deliberate: a status outside that enum would be an invalid enum
//! value.
//!
//! # What still goes through the SDK
//! * `dispatch_http_call`: the SDK must register the callout's token, or
//!   its dispatcher panics when the answer arrives (`register_callout` is
//!   private to the crate). Envoy's `httpCall` returns only Ok, BadArgument
//!   (unknown cluster, missing `:method`/`:path`/`:authority`, negative
//!   timeout) and InternalFailure, which are exactly the ones the wrapper
//!   handles.
//! * Logging (`log` crate → `hostcalls::log(..).unwrap()`): Envoy's `log`
//!   returns Ok for every level the SDK sends.
//! * The SDK's dispatcher itself (`set_effective_context(..).unwrap()`
//!   before each callback) runs before our code, with ids Envoy just gave.

use std::ptr::{null, null_mut};

use proxy_wasm::types::{BufferType, MapType, MetricType};

/// A proxy-wasm status as the host returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostStatus(pub u32);

impl HostStatus {
    pub const OK: HostStatus = HostStatus(0);
    pub const NOT_FOUND: HostStatus = HostStatus(1);
    pub const CAS_MISMATCH: HostStatus = HostStatus(8);
}

/// `StreamType::HttpRequest` in the ABI.
const STREAM_HTTP_REQUEST: u32 = 0;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_add_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_set_buffer_bytes(
        buffer_type: u32,
        start: usize,
        size: usize,
        buffer_data: *const u8,
        buffer_size: usize,
    ) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_set_property(
        path_data: *const u8,
        path_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    #[allow(clippy::too_many_arguments)]
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
    fn proxy_call_foreign_function(
        function_name_data: *const u8,
        function_name_size: usize,
        arguments_data: *const u8,
        arguments_size: usize,
        results_data: *mut *mut u8,
        results_size: *mut usize,
    ) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_define_metric(
        metric_type: u32,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
    fn proxy_get_metric(metric_id: u32, return_value: *mut u64) -> u32;
}

fn ok(status: u32) -> Result<(), HostStatus> {
    match HostStatus(status) {
        HostStatus::OK => Ok(()),
        other => Err(other),
    }
}

/// Takes ownership of bytes the host returned (`None`: a null pointer):
/// it allocated them through the SDK's `proxy_on_memory_allocate` (a
/// `Vec<u8>` of exactly `size` capacity, leaked), so they are freed as such.
fn owned(data: *mut u8, size: usize) -> Option<Vec<u8>> {
    if data.is_null() {
        return None;
    }
    // SAFETY: `data` was allocated by the SDK's allocator as a `Vec<u8>`
    // with capacity `size` and handed to us once, as the SDK's own
    // wrappers assume.
    Some(unsafe { Vec::from_raw_parts(data, size, size) })
}

/// What a hostcall returning bytes answered.
struct Returned {
    /// Ok (not NotFound).
    found: bool,
    /// The bytes, unless the host returned none.
    data: Option<Vec<u8>>,
}

fn returning_bytes(call: impl FnOnce(*mut *mut u8, *mut usize) -> u32) -> Result<Returned, HostStatus> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    match HostStatus(call(&mut data, &mut size)) {
        HostStatus::OK => Ok(Returned {
            found: true,
            data: owned(data, size),
        }),
        HostStatus::NOT_FOUND => Ok(Returned {
            found: false,
            data: None,
        }),
        other => Err(other),
    }
}

/// One value of a header map (`None`: absent; present and empty is
/// `Some` of nothing).
pub fn header(map: MapType, name: &str) -> Result<Option<Vec<u8>>, HostStatus> {
    let r = returning_bytes(|data, size| {
        // SAFETY: the pointers are valid for the call; the host writes the
        // two out-parameters only.
        unsafe { proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), data, size) }
    })?;
    Ok(r.found.then(|| r.data.unwrap_or_default()))
}

pub fn add_header(map: MapType, name: &str, value: &str) -> Result<(), HostStatus> {
    // SAFETY: the host only reads the two slices during the call.
    ok(unsafe {
        proxy_add_header_map_value(map as u32, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

/// Sets a header of a map to one value (replacing any).
pub fn replace_header(map: MapType, name: &str, value: &str) -> Result<(), HostStatus> {
    // SAFETY: the host only reads the two slices during the call.
    ok(unsafe {
        proxy_replace_header_map_value(map as u32, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

/// Removes a header from a map.
pub fn remove_header(map: MapType, name: &str) -> Result<(), HostStatus> {
    // SAFETY: the host only reads the slice during the call.
    ok(unsafe { proxy_remove_header_map_value(map as u32, name.as_ptr(), name.len()) })
}

/// Envoy's `clear_route_cache` foreign function: the stream's route is
/// picked again (with the request headers as they are now) before it is
/// routed. No arguments, no results.
pub fn clear_route_cache() -> Result<(), HostStatus> {
    const NAME: &str = "clear_route_cache";
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: the host reads the name during the call and writes the two
    // out-parameters only (this function allocates no result: they stay
    // null and 0, and nothing is freed).
    ok(unsafe { proxy_call_foreign_function(NAME.as_ptr(), NAME.len(), null(), 0, &mut data, &mut size) })
}

/// Up to `max` bytes of a buffer from `start` (`None`: no such buffer).
pub fn buffer(kind: BufferType, start: usize, max: usize) -> Result<Option<Vec<u8>>, HostStatus> {
    let r = returning_bytes(|data, size| {
        // SAFETY: as in `header`.
        unsafe { proxy_get_buffer_bytes(kind as u32, start, max, data, size) }
    })?;
    Ok(r.data)
}

/// Replaces a buffer's first `size` bytes with `data` (`size`: the whole
/// buffer replaces it all).
pub fn set_buffer(kind: BufferType, size: usize, data: &[u8]) -> Result<(), HostStatus> {
    // SAFETY: the host only reads the slice during the call.
    ok(unsafe { proxy_set_buffer_bytes(kind as u32, 0, size, data.as_ptr(), data.len()) })
}

/// A property by path (`None`: absent).
pub fn property(path: &[&str]) -> Result<Option<Vec<u8>>, HostStatus> {
    // The ABI's path: the parts joined by NUL bytes.
    let mut serialized = Vec::with_capacity(path.iter().map(|p| p.len() + 1).sum());
    for (i, part) in path.iter().enumerate() {
        if i > 0 {
            serialized.push(0);
        }
        serialized.extend_from_slice(part.as_bytes());
    }
    let r = returning_bytes(|data, size| {
        // SAFETY: as in `header`.
        unsafe { proxy_get_property(serialized.as_ptr(), serialized.len(), data, size) }
    })?;
    Ok(r.data)
}

/// Sets a one-part property: Envoy keeps it as the stream's filter state
/// `wasm.<name>` (what access logs print with `%FILTER_STATE(…)%`).
pub fn set_property(name: &str, value: &[u8]) -> Result<(), HostStatus> {
    // SAFETY: the host only reads the two slices during the call.
    ok(unsafe { proxy_set_property(name.as_ptr(), name.len(), value.as_ptr(), value.len()) })
}

/// A shared-data value and its CAS token (`(None, None)`: absent).
pub fn shared_get(key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostStatus> {
    let mut cas: u32 = 0;
    let r = returning_bytes(|data, size| {
        // SAFETY: as in `header`, plus the CAS out-parameter.
        unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), data, size, &mut cas) }
    })?;
    if !r.found {
        return Ok((None, None));
    }
    Ok((r.data, (cas > 0).then_some(cas)))
}

/// Writes a shared-data value; with `cas`, only if it still matches
/// (CasMismatch otherwise).
pub fn shared_set(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), HostStatus> {
    // SAFETY: the host only reads the two slices during the call.
    ok(unsafe {
        proxy_set_shared_data(
            key.as_ptr(),
            key.len(),
            value.as_ptr(),
            value.len(),
            cas.unwrap_or(0),
        )
    })
}

/// The ABI's header-map serialization: count, then each name and value
/// length (u32 LE), then each name and value NUL-terminated.
fn serialize_headers(headers: &[(&str, &str)]) -> Vec<u8> {
    let size = 4 + headers.iter().map(|(n, v)| n.len() + v.len() + 10).sum::<usize>();
    let mut out = Vec::with_capacity(size);
    let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    out.extend_from_slice(&len(headers.len()));
    for (name, value) in headers {
        out.extend_from_slice(&len(name.len()));
        out.extend_from_slice(&len(value.len()));
    }
    for (name, value) in headers {
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.extend_from_slice(value.as_bytes());
        out.push(0);
    }
    out
}

/// Sends a local reply on the current stream.
pub fn send_local_response(status: u32, headers: &[(&str, &str)], body: &[u8]) -> Result<(), HostStatus> {
    let serialized = serialize_headers(headers);
    // SAFETY: the host only reads the slices during the call.
    ok(unsafe {
        proxy_send_local_response(
            status,
            null(),
            0,
            body.as_ptr(),
            body.len(),
            serialized.as_ptr(),
            serialized.len(),
            -1,
        )
    })
}

/// Resumes the current (paused) request.
pub fn resume_http_request() -> Result<(), HostStatus> {
    // SAFETY: no pointers.
    ok(unsafe { proxy_continue_stream(STREAM_HTTP_REQUEST) })
}

pub fn set_effective_context(context_id: u32) -> Result<(), HostStatus> {
    // SAFETY: no pointers.
    ok(unsafe { proxy_set_effective_context(context_id) })
}

/// The host's wall clock, nanoseconds since the Unix epoch.
pub fn now_ns() -> Result<u64, HostStatus> {
    let mut ns: u64 = 0;
    // SAFETY: the host writes the out-parameter only.
    ok(unsafe { proxy_get_current_time_nanoseconds(&mut ns) })?;
    Ok(ns)
}

pub fn set_tick_period_ms(ms: u32) -> Result<(), HostStatus> {
    // SAFETY: no pointers.
    ok(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

pub fn define_metric(kind: MetricType, name: &str) -> Result<u32, HostStatus> {
    let mut id: u32 = 0;
    // SAFETY: the host reads the name and writes the id during the call.
    ok(unsafe { proxy_define_metric(kind as u32, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn increment_metric(id: u32, by: i64) -> Result<(), HostStatus> {
    // SAFETY: no pointers.
    ok(unsafe { proxy_increment_metric(id, by) })
}

pub fn record_metric(id: u32, value: u64) -> Result<(), HostStatus> {
    // SAFETY: no pointers.
    ok(unsafe { proxy_record_metric(id, value) })
}

pub fn get_metric(id: u32) -> Result<u64, HostStatus> {
    let mut value: u64 = 0;
    // SAFETY: the host writes the value during the call.
    ok(unsafe { proxy_get_metric(id, &mut value) })?;
    Ok(value)
}
