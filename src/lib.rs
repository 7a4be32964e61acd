//! tenantgate: multi-tenant rate limiting and admission control for Envoy,
//! the core of the proxy-wasm filter and of the native module.
//!
//! The crate is split in two:
//! * the **core**: pure Rust that never reads a clock or calls the proxy;
//!   everything it needs from Envoy comes through the [`host::Host`] trait
//!   and time comes in as an argument. It builds and is tested natively.
//!   Floor by floor, each module importing only modules below it
//!   (docs/design.md, "Layout"):
//!   [`host`], [`keys`] (the shared-data namespace), [`table`] (the key
//!   table and its one compare-and-swap update), [`inflight`], [`limiter`]
//!   (the four algorithms), [`decision`] (the vocabulary), [`policy`]
//!   (schema, validation, the compiled policy), [`sync`] (the node side of
//!   allowance reconciliation with the central service), [`engine`]
//!   (classify, identify, limit, guard; give back and settle), [`cost`]
//!   (costs known after the response), [`admission`] (slots, queues,
//!   breakers, the adaptive controller, retry budgets, degraded answers),
//!   [`response`] (what a denied request receives), [`stats`], and on top
//!   [`pipeline`]: one worker's whole request path, which a host drives.
//!   [`memory`] is the in-memory host (explain, the simulator, the tests).
//! * the **glue** (`glue`, wasm32 only): the only code that uses the
//!   proxy-wasm SDK. It implements [`host::Host`] with hostcalls and
//!   translates Envoy's callbacks into [`pipeline::Pipeline`] calls and its
//!   directives into hostcalls. The native module (`module/`) is the other
//!   host, over Envoy's dynamic-module ABI.

pub mod admission;
pub mod cost;
pub mod decision;
pub mod engine;
pub mod host;
pub mod inflight;
pub mod keys;
pub mod limiter;
pub mod memory;
pub mod pipeline;
pub mod policy;
pub mod response;
pub mod stats;
pub mod sync;
pub mod table;

#[cfg(target_arch = "wasm32")]
mod glue;
