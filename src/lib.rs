//! tenantgate: multi-tenant rate limiting for Envoy, as a proxy-wasm filter.
//!
//! The crate is split in two:
//! * the **core** ([`policy`], [`limiter`], [`engine`], [`table`],
//!   [`response`]): pure Rust that never reads a clock or calls the proxy;
//!   everything it needs from Envoy comes through the [`host::Host`] trait
//!   and time comes in as an argument. It builds and is tested natively.
//! * the **glue** (`glue`, wasm32 only): the only code that uses
//!   the proxy-wasm SDK. It implements [`host::Host`] with hostcalls, compiles the
//!   policy in `on_configure`, and turns decisions into Envoy actions.
//!
//! [`sync`] holds the node side of allowance reconciliation with the central
//! cluster (protocol, state machine, its shared-data form, and the sync
//! steps over [`host::Host`]). It is pure like the core; the glue runs it
//! on the root tick for policies with global limits.

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
