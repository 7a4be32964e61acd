//! The test-only fault switch, compiled only with the `test-faults` feature
//! (`make module-faults`; no release build enables it): with
//! `TENANTGATE_MODULE_TEST_FAULTS=1` in
//! Envoy's environment when the module loads, a request carrying
//! `x-tenantgate-test-fault: <point>` makes the module panic at that point
//! (`request_headers`, `response_headers`, `stream_complete`), or at the
//! next tick of its worker (`tick`, armed once, at the request's headers).
//! Off otherwise: one relaxed load, and the header is never read. `integration-tests/tests/module.rs` uses it to
//! show that a panic never brings Envoy down (see `lib.rs`, "Fail-safe").

use std::sync::atomic::{AtomicBool, Ordering};

use crate::abi::{self, EnvoyBuffer, HttpFilterEnvoy, ModuleBuffer};

static ENABLED: AtomicBool = AtomicBool::new(false);
static TICK: AtomicBool = AtomicBool::new(false);

/// The request header naming the point to fail at.
pub const HEADER: &str = "x-tenantgate-test-fault";

/// Reads the switch (once, at load).
pub fn init() {
    let on = std::env::var("TENANTGATE_MODULE_TEST_FAULTS").is_ok_and(|v| v == "1");
    ENABLED.store(on, Ordering::Relaxed);
    if on {
        log::warn!("tenantgate: TEST FAULTS ENABLED ({HEADER}): never in production");
    }
}

/// Fails here if this request asks to (see the module header).
pub fn request(filter: HttpFilterEnvoy, point: &str) {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    let mut value = EnvoyBuffer::EMPTY;
    let mut count = 0usize;
    // SAFETY: `filter` is the current hook's stream; the buffers are ours.
    let asked = unsafe {
        abi::envoy_dynamic_module_callback_http_get_header(
            filter,
            abi::HEADER_REQUEST,
            ModuleBuffer::of(HEADER.as_bytes()),
            &mut value,
            0,
            &mut count,
        ) && count > 0
    };
    if !asked {
        return;
    }
    // SAFETY: valid until this hook returns.
    let asked = unsafe { value.bytes() };
    if asked == b"tick" {
        // Armed once per request, at its first step: a tick that runs
        // between this request's steps must not be armed again by a later
        // one (exactly one tick panics per asking request).
        if point == "request_headers" {
            TICK.store(true, Ordering::Relaxed);
        }
    } else if asked == point.as_bytes() {
        fail(point);
    }
}

/// Fails this tick if a request asked for it.
pub fn tick() {
    if TICK.swap(false, Ordering::Relaxed) {
        fail("tick");
    }
}

// The switch's whole purpose is a real panic, through the panic hook and
// the unwinding a bug would take.
#[allow(clippy::panic)]
fn fail(point: &str) {
    panic!("tenantgate test fault at {point}");
}
