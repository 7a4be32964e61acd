//! The ranges and shapes a policy's values may take: the validator
//! ([`super::compile`], [`super::settle`], [`super::admission`]) checks
//! them and the JSON Schema ([`super::schema`], [`super::spec`]) states
//! them, from these definitions. It imports nothing of the policy.

/// Largest `rate`, `burst`, `cost`, `max_debt` and `settle.ceiling` accepted.
pub const MAX_COUNT: i64 = 1_000_000_000;

/// Largest `rate` of a `fixed_window` limit, which may also be 0 (every
/// request of a cost over 0 refused): envoyproxy/ratelimit's
/// `requests_per_unit` range (a `uint32`), so every imported rule keeps its
/// meaning. A window's count is a `u64`; no arithmetic divides by its rate.
pub const MAX_WINDOW_RATE: i64 = u32::MAX as i64;

/// Parts per million: how the compiled policy keeps a fraction (exact,
/// comparable).
pub const PPM: u32 = 1_000_000;

/// Longest `per` window, and longest time a bucket may take to refill.
pub const MAX_WINDOW_SECS: u64 = 366 * 86_400;

/// Whether `name` is an HTTP header name (token characters, ≤ 128).
pub fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}
