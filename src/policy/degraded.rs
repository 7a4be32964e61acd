//! A route class's `degradable:` block: the cached answers served while
//! its dependency refuses, validated and compiled, with every default and
//! bound of these fields, once. How the filter serves them is in
//! [`crate::admission::degraded`].

use super::check::{add, duration_in, in_range};
use super::error::{FieldPath, PolicyError};
use super::spec::{DegradableSpec, RouteSpec};
use super::values::is_header_name;
use crate::limiter::NANOS_PER_SEC;

/// Default `degradable.version_header`.
pub const DEFAULT_VERSION_HEADER: &str = "etag";
/// Default and largest `degradable.max_body_bytes` (every cached answer
/// fits one shared-data record: see [`crate::admission::degraded`]).
pub const DEFAULT_DEGRADED_BODY_BYTES: u32 = 16 * 1024;
pub const MAX_DEGRADED_BODY_BYTES: i64 = 48 * 1024;
/// Default and largest `degradable.slots`.
pub const DEFAULT_DEGRADED_SLOTS: u32 = 64;
pub const MAX_DEGRADED_SLOTS: i64 = 4096;
/// Longest `degradable.max_stale`.
pub const MAX_STALE_NS: u64 = 24 * 3600 * NANOS_PER_SEC;
/// Default `degradable.refresh`, and its bounds.
pub const DEFAULT_DEGRADED_REFRESH_NS: u64 = NANOS_PER_SEC;
pub const MAX_DEGRADED_REFRESH_NS: u64 = 3600 * NANOS_PER_SEC;

/// A compiled `routes.<class>.degradable`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Degradable {
    /// The class's name: its cache's shared-data keys start with it.
    pub class: String,
    pub max_stale_ns: u64,
    /// Lower-cased.
    pub version_header: String,
    pub max_body_bytes: u32,
    pub slots: u32,
    /// Anonymous requests get (and store) answers, shared by every
    /// anonymous client.
    pub anonymous: bool,
    /// A worker stores a cache key's answer at most once per `refresh`.
    pub refresh_ns: u64,
}

/// `routes.<class>.degradable` (the class must have a dependency: only an
/// admission refusal is answered from the cache).
pub fn compile_degradable(
    class: &str,
    spec: &RouteSpec,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Option<Degradable> {
    let d: &DegradableSpec = spec.degradable.as_ref()?;
    let path = path.key("degradable");
    if spec.dependency.is_none() {
        add(
            errors,
            path.clone(),
            "a degradable class answers from its cache when its dependency refuses it: name a dependency",
        );
    }
    if spec.streaming == Some(true) {
        add(errors, path.clone(), "a streaming class cannot be degradable");
    }
    let max_stale_ns = duration_in(
        Some(&d.max_stale),
        NANOS_PER_SEC,
        (1, MAX_STALE_NS),
        "must be more than 0 and at most 24h",
        &path.key("max_stale"),
        errors,
    );
    let version_header = match &d.version_header {
        None => DEFAULT_VERSION_HEADER.to_owned(),
        Some(h) => {
            if !is_header_name(h) {
                add(
                    errors,
                    path.key("version_header"),
                    "must be an HTTP header name (letters, digits, - _ .)",
                );
            }
            h.to_ascii_lowercase()
        }
    };
    let max_body_bytes = d.max_body_bytes.map_or(DEFAULT_DEGRADED_BODY_BYTES, |n| {
        in_range(n, 0, MAX_DEGRADED_BODY_BYTES, &path.key("max_body_bytes"), errors)
            .unwrap_or(DEFAULT_DEGRADED_BODY_BYTES)
    });
    let slots = d.slots.map_or(DEFAULT_DEGRADED_SLOTS, |n| {
        in_range(n, 1, MAX_DEGRADED_SLOTS, &path.key("slots"), errors).unwrap_or(DEFAULT_DEGRADED_SLOTS)
    });
    let refresh_ns = duration_in(
        d.refresh.as_deref(),
        DEFAULT_DEGRADED_REFRESH_NS,
        (1, MAX_DEGRADED_REFRESH_NS),
        "must be more than 0 and at most 1h",
        &path.key("refresh"),
        errors,
    );
    Some(Degradable {
        class: class.to_owned(),
        max_stale_ns,
        version_header,
        max_body_bytes,
        slots,
        anonymous: d.anonymous.unwrap_or(false),
        refresh_ns,
    })
}
