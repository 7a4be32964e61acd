//! Rate-limit algorithms. Pure arithmetic on explicit time: no clock, no host.

pub mod algo;
pub mod token_bucket;

pub use token_bucket::{Check, Gcra};

/// Nanoseconds per second.
pub const NANOS_PER_SEC: u64 = 1_000_000_000;
