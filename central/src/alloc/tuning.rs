//! The allocator's tuning where no policy sets it, in one place: what
//! `tenantgate serve` runs with (`service::policy::Settings`) and what the
//! simulator starts from (`sim::SimConfig`), so that the simulator's
//! figures (docs/global-limits.md) are the service's.

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// `I`: the sync interval nodes are told to use.
pub const INTERVAL_NS: u64 = NANOS_PER_SEC;
/// A lease's lifetime from receipt.
pub const LEASE_TTL_NS: u64 = 3 * NANOS_PER_SEC;
/// `D`, for a policy without a `sync:` block.
pub const RESPONSE_TIMEOUT_NS: u64 = NANOS_PER_SEC / 2;
/// A lease is topped up to its share × this / 100.
pub const LEASE_FACTOR_PCT: u64 = 150;
/// Units per interval every active node gets before demand is served.
pub const NODE_FLOOR: u64 = 1;
/// Units per interval every active region gets before demand is served.
pub const REGION_FLOOR: u64 = 5;
/// How much of an interval's flow (%) a region may get beyond an equal
/// share.
pub const BORROW_CEILING_PCT: u64 = 80;
/// At most this % of a region's allocation goes to its debt per interval.
pub const REPAY_PCT: u64 = 50;
/// How long a silent node's reservation waits for its report.
pub const SETTLE_NS: u64 = 5 * NANOS_PER_SEC;
