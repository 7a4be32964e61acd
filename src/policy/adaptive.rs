//! A dependency's `adaptive:` block: the adaptive concurrency controller's
//! window, bounds, baseline refresh and gains, validated and compiled, with
//! every default and bound of these fields, once. How the filter runs it is
//! in [`crate::admission::controller`].

use super::check::{add, duration_in, fraction, in_range};
use super::error::{FieldPath, PolicyError};
use super::spec::AdaptiveSpec;
use crate::limiter::NANOS_PER_SEC;

/// `adaptive.window`: default and bounds.
pub const DEFAULT_ADAPTIVE_WINDOW_NS: u64 = 500 * NANOS_PER_MS;
pub const MIN_ADAPTIVE_WINDOW_NS: u64 = 250 * NANOS_PER_MS;
pub const MAX_ADAPTIVE_WINDOW_NS: u64 = 5 * NANOS_PER_SEC;
/// `adaptive.buffer`: how far above its baseline p95 may be and still be
/// healthy.
pub const DEFAULT_BUFFER_PPM: u32 = 20_000;
/// `adaptive.dead_zone`: the band above the buffer where the limit holds.
pub const DEFAULT_DEAD_ZONE_PPM: u32 = 40_000;
/// `adaptive.smoothing`: the share of a window's move that is taken.
pub const DEFAULT_SMOOTHING_PPM: u32 = 250_000;
/// `adaptive.max_increase`: the largest rise per window, of the limit.
pub const DEFAULT_MAX_INCREASE_PPM: u32 = 250_000;
/// `adaptive.backoff`: the multiplicative decrease.
pub const DEFAULT_BACKOFF_PPM: u32 = 800_000;
/// `adaptive.error_rate`: errors and timeouts per completed request at
/// which the limit backs off.
pub const DEFAULT_ERROR_RATE_PPM: u32 = 100_000;
/// `adaptive.queue_age`: the oldest queued request's age at which the
/// limit backs off (unless latency is healthy); default and bounds.
pub const DEFAULT_QUEUE_AGE_NS: u64 = 250 * NANOS_PER_MS;
pub const MAX_QUEUE_AGE_NS: u64 = 30 * NANOS_PER_SEC;
/// `adaptive.baseline_refresh`: how often the baseline is measured again;
/// default and bounds (at least 10 windows).
pub const DEFAULT_BASELINE_REFRESH_NS: u64 = 30 * NANOS_PER_SEC;
pub const MIN_BASELINE_REFRESH_NS: u64 = 5 * NANOS_PER_SEC;
pub const MAX_BASELINE_REFRESH_NS: u64 = 600 * NANOS_PER_SEC;
const NANOS_PER_MS: u64 = 1_000_000;

/// A compiled `dependencies.<name>.adaptive` (the controller is
/// [`crate::admission::controller`]). Fractions are in [`PPM`](super::values::PPM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adaptive {
    pub window_ns: u64,
    /// Default: `reserved.critical + reserved.system + 1` (the pool keeps a
    /// slot).
    pub min: u32,
    /// Default and most: `max_in_flight`.
    pub max: u32,
    pub buffer_ppm: u32,
    pub dead_zone_ppm: u32,
    pub smoothing_ppm: u32,
    pub max_increase_ppm: u32,
    pub backoff_ppm: u32,
    pub error_rate_ppm: u32,
    pub queue_age_ns: u64,
    pub baseline_refresh_ns: u64,
}

impl Adaptive {
    /// The defaults for a dependency of `max_in_flight` with `reserved`
    /// slots.
    pub fn defaults(max_in_flight: u32, reserved: u32) -> Adaptive {
        Adaptive {
            window_ns: DEFAULT_ADAPTIVE_WINDOW_NS,
            min: reserved.saturating_add(1).min(max_in_flight),
            max: max_in_flight,
            buffer_ppm: DEFAULT_BUFFER_PPM,
            dead_zone_ppm: DEFAULT_DEAD_ZONE_PPM,
            smoothing_ppm: DEFAULT_SMOOTHING_PPM,
            max_increase_ppm: DEFAULT_MAX_INCREASE_PPM,
            backoff_ppm: DEFAULT_BACKOFF_PPM,
            error_rate_ppm: DEFAULT_ERROR_RATE_PPM,
            queue_age_ns: DEFAULT_QUEUE_AGE_NS,
            baseline_refresh_ns: DEFAULT_BASELINE_REFRESH_NS,
        }
    }
}

/// `adaptive:` of a dependency of `max_in_flight` with `reserved` slots:
/// its window, bounds and baseline refresh, then its gains
/// ([`adaptive_gains`]); errors in that order.
pub(super) fn compile_adaptive(
    spec: &AdaptiveSpec,
    max_in_flight: u32,
    reserved: u32,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Adaptive {
    let d = Adaptive::defaults(max_in_flight, reserved);
    let window_ns = duration_in(
        spec.window.as_deref(),
        d.window_ns,
        (MIN_ADAPTIVE_WINDOW_NS, MAX_ADAPTIVE_WINDOW_NS),
        "must be between 250ms and 5s",
        &path.key("window"),
        errors,
    );
    let max = spec.max.map_or(d.max, |n| {
        in_range(n, 1, i64::from(max_in_flight), &path.key("max"), errors).unwrap_or(d.max)
    });
    let min = match spec.min {
        None => d.min.min(max),
        Some(n) => {
            let low = i64::from(reserved) + 1;
            if (low..=i64::from(max)).contains(&n) {
                u32::try_from(n).unwrap_or(d.min)
            } else {
                add(
                    errors,
                    path.key("min"),
                    format!(
                        "must be between {low} (reserved.critical + reserved.system + 1) and max ({max})"
                    ),
                );
                d.min.min(max)
            }
        }
    };
    let baseline_refresh_ns = duration_in(
        spec.baseline_refresh.as_deref(),
        d.baseline_refresh_ns,
        (MIN_BASELINE_REFRESH_NS, MAX_BASELINE_REFRESH_NS),
        "must be between 5s and 10m",
        &path.key("baseline_refresh"),
        errors,
    );
    if baseline_refresh_ns < window_ns.saturating_mul(10) {
        add(
            errors,
            path.key("baseline_refresh"),
            "must be at least 10 windows",
        );
    }
    let gains = adaptive_gains(spec, d, path, errors);
    Adaptive {
        window_ns,
        min,
        max,
        baseline_refresh_ns,
        ..gains
    }
}

/// The controller's gains and thresholds (`buffer`, `dead_zone`,
/// `smoothing`, `max_increase`, `backoff`, `error_rate`, `queue_age`) over
/// the defaults `d`, which give every other field.
fn adaptive_gains(
    spec: &AdaptiveSpec,
    d: Adaptive,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Adaptive {
    let mut frac = |value: Option<f64>, default: u32, bounds: (f64, f64, bool), key: &str| {
        fraction(value, default, bounds, &path.key(key), errors)
    };
    Adaptive {
        buffer_ppm: frac(spec.buffer, d.buffer_ppm, (0.0, 1.0, false), "buffer"),
        dead_zone_ppm: frac(spec.dead_zone, d.dead_zone_ppm, (0.0, 0.5, false), "dead_zone"),
        smoothing_ppm: frac(spec.smoothing, d.smoothing_ppm, (0.0, 1.0, true), "smoothing"),
        max_increase_ppm: frac(
            spec.max_increase,
            d.max_increase_ppm,
            (0.0, 1.0, true),
            "max_increase",
        ),
        backoff_ppm: frac(spec.backoff, d.backoff_ppm, (0.5, 0.99, false), "backoff"),
        error_rate_ppm: frac(spec.error_rate, d.error_rate_ppm, (0.0, 1.0, true), "error_rate"),
        queue_age_ns: duration_in(
            spec.queue_age.as_deref(),
            d.queue_age_ns,
            (NANOS_PER_MS, MAX_QUEUE_AGE_NS),
            "must be between 1ms and 30s",
            &path.key("queue_age"),
            errors,
        ),
        ..d
    }
}
