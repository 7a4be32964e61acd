//! The central service's clock, in nanoseconds since the epoch. Time is
//! the service's own (never a node's timestamp) and always passed in: the
//! allocator and the quota rules take `now` as an argument; the sync API,
//! the reservation API and their background tasks read it here, and tests
//! move a [`ManualClock`] by hand. Plumbing beneath both APIs.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The service's clock, in nanoseconds.
pub trait Clock: Send + Sync {
    fn now_ns(&self) -> u64;
}

/// Monotonic per process; its epoch is the system clock at start (shared by
/// replicas to within their clock offset).
pub struct SystemClock {
    epoch_ns: u64,
    start: Instant,
}

impl Default for SystemClock {
    fn default() -> SystemClock {
        let epoch_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        SystemClock {
            epoch_ns,
            start: Instant::now(),
        }
    }
}

impl Clock for SystemClock {
    fn now_ns(&self) -> u64 {
        let elapsed = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.epoch_ns.saturating_add(elapsed)
    }
}

/// A clock that moves only when told: for tests and benchmarks.
#[derive(Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    pub fn new(now_ns: u64) -> ManualClock {
        ManualClock(AtomicU64::new(now_ns))
    }

    pub fn set(&self, now_ns: u64) {
        self.0.store(now_ns, Relaxed);
    }

    pub fn advance(&self, by: Duration) {
        self.0
            .fetch_add(u64::try_from(by.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Relaxed)
    }
}
