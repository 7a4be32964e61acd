//! The config hooks: a filter config made and destroyed (one per policy,
//! on every worker: [`crate::node::Node::configure`] /
//! [`crate::node::Node::remove`]), the tick that Envoy schedules on it, a
//! sync callout's answer, a route's class.

use std::sync::Arc;

use tenantgate::sync::syncer::CalloutAnswer;

use super::guard;
use crate::abi::{
    self, EnvoyBuffer, EnvoyHttpHeader, HttpFilterConfigEnvoy, HttpFilterConfigModule,
    HttpFilterPerRouteConfigModule,
};
use crate::node::{node, Config};
use crate::route::RouteConfig;

/// Our config behind Envoy's pointer.
///
/// # Safety
/// `ptr` came from `on_http_filter_config_new` and is not destroyed.
pub(super) unsafe fn config<'a>(ptr: HttpFilterConfigModule) -> &'a Arc<Config> {
    // SAFETY: the caller's promise.
    unsafe { &*ptr.cast::<Arc<Config>>() }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: HttpFilterConfigEnvoy,
    _name: EnvoyBuffer,
    json: EnvoyBuffer,
) -> HttpFilterConfigModule {
    guard(|| {
        // SAFETY: Envoy's config bytes, valid for this hook.
        let json = unsafe { json.bytes() };
        match node().configure(envoy, json) {
            Ok(config) => Box::into_raw(Box::new(config)).cast_const().cast(),
            Err(()) => std::ptr::null(),
        }
    })
    .unwrap_or(std::ptr::null())
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(ptr: HttpFilterConfigModule) {
    guard(|| {
        if ptr.is_null() {
            return;
        }
        // SAFETY: made by `config_new`, destroyed once, here.
        let config = unsafe { Box::from_raw(ptr.cast::<Arc<Config>>().cast_mut()) };
        node().remove(&config);
    });
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _envoy: HttpFilterConfigEnvoy,
    _ptr: HttpFilterConfigModule,
    _event: u64,
) {
    guard(|| node().tick());
}

/// A callout's answer as Envoy hands it to the hook.
struct Answered<'a> {
    ok: bool,
    headers: &'a [EnvoyHttpHeader],
    body: &'a [EnvoyBuffer],
}

impl CalloutAnswer for Answered<'_> {
    fn has_response(&self) -> bool {
        self.ok && !self.headers.is_empty()
    }

    fn status(&self) -> Result<Option<Vec<u8>>, tenantgate::host::HostError> {
        Ok(self.headers.iter().find_map(|h| {
            // SAFETY: Envoy's headers, valid for the hook.
            let key = unsafe { bytes(h.key_ptr, h.key_length) };
            // SAFETY: as for `key`: Envoy's headers, valid for the hook.
            (key == b":status").then(|| unsafe { bytes(h.value_ptr, h.value_length) }.to_vec())
        }))
    }

    fn body_size(&self) -> usize {
        self.body
            .iter()
            .map(|b| b.length)
            .fold(0usize, usize::saturating_add)
    }

    fn body(&self) -> Result<Option<Vec<u8>>, tenantgate::host::HostError> {
        let mut body = Vec::with_capacity(self.body_size());
        for chunk in self.body {
            // SAFETY: Envoy's body, valid for the hook.
            body.extend_from_slice(unsafe { chunk.bytes() });
        }
        Ok(Some(body))
    }
}

/// # Safety
/// `(ptr, len)` is null or valid for the current hook.
unsafe fn bytes<'a>(ptr: *const u8, len: usize) -> &'a [u8] {
    if ptr.is_null() || len == 0 {
        return &[];
    }
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

/// # Safety
/// `(ptr, len)` is null or an array Envoy keeps valid for the current hook.
unsafe fn slice<'a, T>(ptr: *const T, len: usize) -> &'a [T] {
    if ptr.is_null() || len == 0 {
        return &[];
    }
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _envoy: HttpFilterConfigEnvoy,
    ptr: HttpFilterConfigModule,
    callout_id: u64,
    result: abi::CalloutResult,
    headers: *const EnvoyHttpHeader,
    headers_size: usize,
    body: *const EnvoyBuffer,
    body_size: usize,
) {
    guard(|| {
        // SAFETY: Envoy's config pointer, and its arrays for this hook.
        let config = unsafe { config(ptr) };
        let answer = Answered {
            ok: result == abi::CALLOUT_SUCCESS,
            // SAFETY: Envoy's header array for this hook.
            headers: unsafe { slice(headers, headers_size) },
            // SAFETY: Envoy's body array for this hook.
            body: unsafe { slice(body, body_size) },
        };
        node().callout_done(config, callout_id, &answer);
    });
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> HttpFilterPerRouteConfigModule {
    guard(|| {
        // SAFETY: Envoy's bytes for this hook.
        match RouteConfig::parse(unsafe { config.bytes() }) {
            Ok(route) => route.into_ptr(),
            Err(why) => {
                log::error!("tenantgate: route config rejected: {why}");
                std::ptr::null()
            }
        }
    })
    .unwrap_or(std::ptr::null())
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_destroy(
    ptr: HttpFilterPerRouteConfigModule,
) {
    // SAFETY: made by `per_route_config_new`, destroyed once.
    guard(|| unsafe { RouteConfig::free(ptr) });
}
