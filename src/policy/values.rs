//! The ranges and shapes a policy's values may take: the validator
//! ([`super::compile`], [`super::settle`], [`super::admission`]) checks
//! them and the JSON Schema ([`super::schema`], [`super::spec`]) states
//! them, from these definitions. It imports nothing of the policy.

/// Largest `cost`, `settle.ceiling` and `sync` count accepted: what one
/// request may cost.
pub const MAX_COUNT: i64 = 1_000_000_000;

/// Largest `rate`, `burst` and `max_debt` of a limit: 10¹³, so a budget in
/// micro-units of a currency (a price catalogue's) reaches ten million
/// currency units (an organisation's month at 50,000 USD is 5·10¹⁰). The
/// central service still counts every unit exactly (below 2⁵³), and a
/// limit's thousandths of a unit (the allocator's, a fair share's) fit a
/// `u64` a thousand times over. A `fixed_window`'s rate may also be 0
/// (every request of a cost over 0 refused; envoyproxy/ratelimit's
/// `requests_per_unit` range, a `uint32`, fits within). A token bucket's
/// rate must also be one its whole-nanosecond step can hold
/// ([`MAX_RATE_ERROR_PER_MILLE`]).
pub const MAX_LIMIT: i64 = 10_000_000_000_000;

/// How much slower than its `rate` a token bucket may refill, in
/// thousandths: its step between units is a whole number of nanoseconds
/// (`per / rate` rounded up), so `rate` per `per` must come within 0.1 %
/// of a rate that step gives (10⁹ a second does, exactly; 7·10⁸ a second
/// would refill at 5·10⁸).
pub const MAX_RATE_ERROR_PER_MILLE: u64 = 1;

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
