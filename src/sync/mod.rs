//! Allowance reconciliation with the central cluster: the pure pieces a
//! node needs (no proxy-wasm, no clock, no I/O).
//!
//! * [`protocol`]: the versioned JSON messages of the batched sync exchange.
//! * [`clamp`]: an answer's numbers bounded by what the policy allows.
//! * [`node`]: the node-side allowance state machine per (key, limit):
//!   leases, the provisional allowance, counts since the last acknowledged
//!   report, and the failure modes (its in-memory `Node` is a test model
//!   only: the filter and the simulator sync through [`shared`]).
//! * [`cycle`]: the node's report cycle (due, in flight, retried, applied)
//!   and its circuit breaker on the callout.
//! * [`stored`]: that state's binary form in Envoy shared data.
//! * [`boot`]: the node's session id, one per Envoy process.
//! * [`shared`]: one node's sync over shared data (which worker reports,
//!   the scan, applying the answer).
//! * [`syncer`]: one worker's part in it, in order, over any host: the
//!   pipeline's tick runs it and hands the host the callout to send.
//!
//! The allocator that answers these messages, the overrun bound and the
//! simulator that measures it live in the `tenantgate-central` crate, which
//! depends on this one (never the other way round).

pub mod apply;
pub mod boot;
pub mod clamp;
pub mod cycle;
pub mod node;
pub mod protocol;
pub mod shared;
pub mod stored;
pub mod syncer;

pub use cycle::{ApplyError, BreakerState, InFlight, Retry, SyncState};
pub use node::{Admitted, Allowance, BreakerConfig, Counts, Denied, FailureMode, LeaseState, NodeView};
pub use protocol::{
    Lease, NodeSettings, ProtocolError, Report, SyncRequest, SyncResponse, FULL_BUCKET_MILLI, MAX_SETTING_MS,
    PROTOCOL_VERSION,
};
