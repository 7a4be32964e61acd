//! Request checks before admission, per route class.
//!
//! * `max_body_bytes`: a declared `content-length` above it is refused at
//!   once (413 `request_too_large`); a body without one (chunked, HTTP/2
//!   data frames) is counted as it streams ([`BodyBudget`]) and refused as
//!   soon as it passes the limit, so no more than `max_body_bytes` plus one
//!   chunk reaches the filter before the refusal.
//! * `min_timeout_budget`: a request whose remaining timeout, as Envoy
//!   states it in `x-envoy-expected-rq-timeout-ms` (set by a downstream
//!   Envoy's router), is below it is refused (503 `timeout_budget`): it
//!   would time out before the upstream could answer. Without that header
//!   nothing is checked. A client can only lower its own budget with it.
//!
//! Pure: the header values come in as bytes.

use crate::engine::Reason;
use crate::policy::admission::Labels;

/// The header that carries the remaining timeout budget, in milliseconds.
pub const EXPECTED_TIMEOUT_HEADER: &str = "x-envoy-expected-rq-timeout-ms";

/// A header value that is a plain decimal number (at most 19 digits).
pub fn decimal(raw: &[u8]) -> Option<u64> {
    let text = core::str::from_utf8(raw).ok()?.trim();
    if text.is_empty() || text.len() > 19 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// What the request's headers declare.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Declared {
    pub content_length: Option<u64>,
    pub expected_timeout_ms: Option<u64>,
}

impl Declared {
    /// Reads the declared values (an unparsable value counts as absent).
    pub fn read(content_length: Option<&[u8]>, expected_timeout: Option<&[u8]>) -> Declared {
        Declared {
            content_length: content_length.and_then(decimal),
            expected_timeout_ms: expected_timeout.and_then(decimal),
        }
    }
}

/// Checks a request's declared size and timeout budget against its class.
pub fn check(labels: &Labels, declared: &Declared) -> Result<(), Reason> {
    if let (Some(max), Some(len)) = (labels.max_body_bytes, declared.content_length) {
        if len > max {
            return Err(Reason::RequestTooLarge);
        }
    }
    if let (Some(min_ns), Some(ms)) = (labels.min_timeout_budget_ns, declared.expected_timeout_ms) {
        if ms.saturating_mul(1_000_000) < min_ns {
            return Err(Reason::TimeoutBudget);
        }
    }
    Ok(())
}

/// A streamed body's byte count against `max_body_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyBudget {
    max: u64,
    seen: u64,
}

impl BodyBudget {
    /// `None`: the class has no body limit.
    pub fn of(labels: &Labels) -> Option<BodyBudget> {
        labels.max_body_bytes.map(|max| BodyBudget { max, seen: 0 })
    }

    /// Counts a chunk; `Err` once the body is over the limit.
    pub fn add(&mut self, bytes: u64) -> Result<(), Reason> {
        self.seen = self.seen.saturating_add(bytes);
        if self.seen > self.max {
            Err(Reason::RequestTooLarge)
        } else {
            Ok(())
        }
    }

    pub fn seen(&self) -> u64 {
        self.seen
    }
}
