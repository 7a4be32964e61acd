//! Rate-limit algorithms. Pure arithmetic on explicit time: no clock, no host.
//!
//! Every algorithm takes `now` in nanoseconds since the Unix epoch and keeps
//! its per-key state as plain data the caller stores (in proxy-wasm shared
//! data, with compare-and-swap), so one decision is one read, one pure
//! function call and, on admission, one write:
//!
//! * [`token_bucket`]: GCRA; `rate` per `per` with a `burst` capacity.
//! * [`fixed_window`]: `limit` per aligned window; up to 2 × `limit` across
//!   a window boundary.
//! * [`sliding_window_log`]: exact over every rolling window; keeps one entry
//!   per admitted request, so `limit` is capped at [`MAX_LOG_ENTRIES`].
//! * [`sliding_window_counter`]: two counters weighted by time; constant
//!   state, approximate (its header states the worst case exactly).
//!
//! The window algorithms share [`Verdict`] and the same shape: a params
//! struct with `new(limit, window_ns)`, a `State` whose `Default` is a fresh
//! key, `check`, `is_idle`, `encode` and `decode`.

pub mod algo;
pub mod calendar;
pub mod charge;
mod codec;
pub mod fair;
pub mod fixed_window;
pub mod sliding_window_counter;
pub mod sliding_window_log;
pub mod token_bucket;

pub use fixed_window::FixedWindow;
pub use sliding_window_counter::SlidingWindowCounter;
pub use sliding_window_log::{SlidingWindowLog, MAX_LOG_ENTRIES};
pub use token_bucket::{Check, Gcra};

/// Nanoseconds per second.
pub const NANOS_PER_SEC: u64 = 1_000_000_000;

/// What an algorithm says about one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict<S> {
    /// Admitted: store `state`. `remaining` whole units are left now; the
    /// limit is fully available again in `reset_ns`.
    Admit { state: S, remaining: u64, reset_ns: u64 },
    /// Denied; nothing changes. The same request would be admitted after
    /// `wait_ns` if nothing else arrives (u64::MAX if never: cost > limit).
    Deny {
        wait_ns: u64,
        remaining: u64,
        reset_ns: u64,
    },
}

impl<S> Verdict<S> {
    /// Whether the request was admitted.
    pub fn is_admit(&self) -> bool {
        matches!(self, Verdict::Admit { .. })
    }
}

/// `a − b` for instants where `a` may lie past `u64::MAX` (window ends near
/// the end of time): saturates at `u64::MAX`, and at 0 if `a < b`.
fn ns_until(a: u128, b: u64) -> u64 {
    u64::try_from(a.saturating_sub(u128::from(b))).unwrap_or(u64::MAX)
}

#[cfg(test)]
pub(crate) mod testkit;
