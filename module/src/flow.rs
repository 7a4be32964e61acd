//! An answer the pipeline ends early ([`tenantgate::pipeline::EndAnswer`]:
//! its tenant's limits refused more as it flowed), in the module: the
//! current response body chunk becomes its first `keep` bytes and the
//! provider's terminal event (drained and appended through the ABI's body
//! callbacks) and every later chunk is drained, so the response ends when
//! the upstream's does; a refused non-streamed answer is reset at once.

use tenantgate::pipeline::EndAnswer;

use crate::abi::{self, HttpFilterEnvoy, ModuleBuffer};

/// Ends the answer in the current chunk (`chunk`: its bytes).
pub fn end(envoy: HttpFilterEnvoy, chunk: &[u8], end: EndAnswer) {
    let mut kept = chunk.get(..end.keep).unwrap_or(chunk).to_vec();
    kept.extend_from_slice(end.terminal);
    drop_chunk(envoy, chunk.len());
    // SAFETY: the current hook's stream; the buffer is ours for the call.
    let appended = unsafe {
        abi::envoy_dynamic_module_callback_http_append_body(
            envoy,
            abi::BODY_RECEIVED_RESPONSE,
            ModuleBuffer::of(&kept),
        )
    };
    if !appended && !kept.is_empty() {
        log::warn!("tenantgate: cannot end an answer");
    }
    if end.reset {
        reset(envoy);
    }
}

/// Drops `size` bytes of the current chunk (all of it).
pub fn drop_chunk(envoy: HttpFilterEnvoy, size: usize) {
    // SAFETY: the current hook's stream.
    let drained = unsafe {
        abi::envoy_dynamic_module_callback_http_drain_body(envoy, abi::BODY_RECEIVED_RESPONSE, size)
    };
    if !drained && size > 0 {
        log::warn!("tenantgate: cannot drop an ended answer's chunk");
    }
}

/// Resets the stream.
pub fn reset(envoy: HttpFilterEnvoy) {
    // SAFETY: the current hook's stream; the details are ours for the call.
    unsafe {
        abi::envoy_dynamic_module_callback_http_filter_reset_stream(
            envoy,
            abi::RESET_LOCAL,
            ModuleBuffer::of(b"tenantgate_answer_ended"),
        );
    }
}
