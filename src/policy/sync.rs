//! `sync`: a policy's settings for reconciling global limits with the
//! central service (the callout's timing, the provisional allowance, the
//! callout's breaker, the names a node reports under), validated and
//! compiled, with every default and bound of these fields, once.

use super::duration::parse_duration_ns;
use super::error::{Errors, FieldPath};
use super::spec;
use super::values::MAX_COUNT;
use super::{FailureMode, SyncSettings};
use crate::limiter::NANOS_PER_SEC;

/// Default `sync.cluster`.
pub const DEFAULT_SYNC_CLUSTER: &str = "tenantgate";
/// Default `sync.interval`, and its bounds.
pub const DEFAULT_SYNC_INTERVAL_NS: u64 = NANOS_PER_SEC;
pub const MIN_SYNC_INTERVAL_NS: u64 = 100_000_000;
pub const MAX_SYNC_INTERVAL_NS: u64 = 600 * NANOS_PER_SEC;
/// Default `sync.timeout`.
pub const DEFAULT_SYNC_TIMEOUT_NS: u64 = 500_000_000;
/// Default `sync.provisional`.
pub const DEFAULT_PROVISIONAL: i64 = 2;
/// Default `sync.breaker_failures`, and its bounds.
pub const DEFAULT_BREAKER_FAILURES: i64 = 3;
pub const MAX_BREAKER_FAILURES: i64 = 100;
/// Default `sync.breaker_max_backoff`, in sync intervals: two, so that
/// after an outage of any length the open breaker probes within two
/// intervals of the service's return and nodes converge within two
/// intervals (the recovery target) while the callout rate during an
/// outage is halved. A longer backoff protects a struggling service more
/// and delays recovery by as much.
pub const DEFAULT_BREAKER_MAX_BACKOFF_INTERVALS: u64 = 2;
pub const MAX_BREAKER_MAX_BACKOFF_NS: u64 = 3600 * NANOS_PER_SEC;
/// How long `fail_open_local` lasts after a lease expired.
pub const LOCAL_MAX_NS: u64 = 60 * NANOS_PER_SEC;
/// Lease TTLs are cut to this many intervals.
pub const MAX_TTL_INTERVALS: u64 = 10;

/// `sync`: the callout's timing, the provisional allowance, the callout's
/// breaker, and the names the node reports under (errors in that order).
pub(super) fn compile_sync(
    spec: Option<&spec::SyncSpec>,
    path: &FieldPath,
    errors: &mut Errors,
) -> SyncSettings {
    let interval_ns = sync_interval(spec, path, errors);
    let timeout_ns = sync_timeout(spec, interval_ns, path, errors);
    let provisional = match spec.and_then(|s| s.provisional).unwrap_or(DEFAULT_PROVISIONAL) {
        n @ 0..=MAX_COUNT => n as u64,
        _ => {
            errors.add(
                path.key("provisional"),
                format!("must be between 0 and {MAX_COUNT}"),
            );
            0
        }
    };
    let breaker_failures = match spec
        .and_then(|s| s.breaker_failures)
        .unwrap_or(DEFAULT_BREAKER_FAILURES)
    {
        n @ 1..=MAX_BREAKER_FAILURES => n as u32,
        _ => {
            errors.add(
                path.key("breaker_failures"),
                format!("must be between 1 and {MAX_BREAKER_FAILURES}"),
            );
            DEFAULT_BREAKER_FAILURES as u32
        }
    };
    let breaker_max_backoff_ns = sync_breaker_max_backoff(spec, interval_ns, path, errors);
    let cluster = spec
        .and_then(|s| s.cluster.clone())
        .unwrap_or_else(|| DEFAULT_SYNC_CLUSTER.to_owned());
    let node_id = spec.and_then(|s| s.node_id.clone());
    let region = spec.and_then(|s| s.region.clone());
    for (field, value) in [
        ("cluster", Some(&cluster)),
        ("node_id", node_id.as_ref()),
        ("region", region.as_ref()),
    ] {
        check_sync_name(value, &path.key(field), errors);
    }
    SyncSettings {
        cluster,
        interval_ns,
        timeout_ns,
        provisional,
        failure_mode: spec
            .and_then(|s| s.failure_mode)
            .unwrap_or(FailureMode::FailOpenLocal),
        node_id,
        region,
        local_max_ns: LOCAL_MAX_NS,
        max_ttl_ns: interval_ns.saturating_mul(MAX_TTL_INTERVALS),
        breaker_failures,
        breaker_max_backoff_ns,
    }
}

/// A `sync` duration field: `default` when absent, `None` (with its error)
/// when it does not parse.
fn sync_duration(
    path: &FieldPath,
    field: &str,
    value: Option<&String>,
    default: u64,
    errors: &mut Errors,
) -> Option<u64> {
    match value.map(|v| parse_duration_ns(v)) {
        None => Some(default),
        Some(Ok(ns)) => Some(ns),
        Some(Err(message)) => {
            errors.add(path.key(field), message);
            None
        }
    }
}

/// `sync.interval`: 100 ms to 10 min (the default after an error).
fn sync_interval(spec: Option<&spec::SyncSpec>, path: &FieldPath, errors: &mut Errors) -> u64 {
    let interval = spec.and_then(|s| s.interval.as_ref());
    match sync_duration(path, "interval", interval, DEFAULT_SYNC_INTERVAL_NS, errors) {
        Some(ns) if (MIN_SYNC_INTERVAL_NS..=MAX_SYNC_INTERVAL_NS).contains(&ns) => ns,
        Some(_) => {
            errors.add(path.key("interval"), "must be between 100ms and 10m");
            DEFAULT_SYNC_INTERVAL_NS
        }
        None => DEFAULT_SYNC_INTERVAL_NS,
    }
}

/// `sync.timeout`: more than 0 and shorter than the interval (0 after an error).
fn sync_timeout(
    spec: Option<&spec::SyncSpec>,
    interval_ns: u64,
    path: &FieldPath,
    errors: &mut Errors,
) -> u64 {
    let timeout_ns = sync_duration(
        path,
        "timeout",
        spec.and_then(|s| s.timeout.as_ref()),
        DEFAULT_SYNC_TIMEOUT_NS.min(interval_ns / 2),
        errors,
    );
    match timeout_ns {
        Some(ns) if ns > 0 && ns < interval_ns => ns,
        Some(_) => {
            errors.add(
                path.key("timeout"),
                "must be more than 0 and less than sync.interval",
            );
            0
        }
        None => 0,
    }
}

/// `sync.breaker_max_backoff`: from the interval to 1 h (the interval
/// after an error).
fn sync_breaker_max_backoff(
    spec: Option<&spec::SyncSpec>,
    interval_ns: u64,
    path: &FieldPath,
    errors: &mut Errors,
) -> u64 {
    match sync_duration(
        path,
        "breaker_max_backoff",
        spec.and_then(|s| s.breaker_max_backoff.as_ref()),
        interval_ns.saturating_mul(DEFAULT_BREAKER_MAX_BACKOFF_INTERVALS),
        errors,
    ) {
        Some(ns) if (interval_ns..=MAX_BREAKER_MAX_BACKOFF_NS).contains(&ns) => ns,
        Some(_) => {
            errors.add(
                path.key("breaker_max_backoff"),
                "must be at least sync.interval and at most 1h",
            );
            interval_ns
        }
        None => interval_ns,
    }
}

/// `sync.cluster`, `sync.node_id`, `sync.region` (when set): 1 to 128
/// printable ASCII characters, no spaces.
fn check_sync_name(value: Option<&String>, path: &FieldPath, errors: &mut Errors) {
    let ok = |t: &str| (1..=128).contains(&t.len()) && t.bytes().all(|b| (0x21..0x7f).contains(&b));
    if value.is_some_and(|v| !ok(v)) {
        errors.add(
            path.clone(),
            "must be 1 to 128 printable ASCII characters, no spaces",
        );
    }
}
