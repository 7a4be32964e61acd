//! One value of a policy checked against its range, with the field's path
//! in the error: the helpers the admission parts of the policy
//! ([`super::admission`], [`super::adaptive`], [`super::degraded`]) share.

use super::duration::parse_duration_ns;
use super::error::{FieldPath, PolicyError};
use super::values::PPM;

pub(super) fn add(errors: &mut Vec<PolicyError>, path: FieldPath, message: impl Into<String>) {
    errors.push(PolicyError::new(path, message));
}

pub(super) fn in_range(
    value: i64,
    min: i64,
    max: i64,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Option<u32> {
    if (min..=max).contains(&value) {
        u32::try_from(value).ok()
    } else {
        add(errors, path.clone(), format!("must be between {min} and {max}"));
        None
    }
}

/// A fraction in `[low, high]` (or `(0, high]` when `open_low`) as ppm.
pub(super) fn fraction(
    value: Option<f64>,
    default: u32,
    (low, high, open_low): (f64, f64, bool),
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> u32 {
    let Some(v) = value else { return default };
    let ok = v.is_finite() && v <= high && (if open_low { v > low } else { v >= low });
    if ok {
        (v * f64::from(PPM)).round() as u32
    } else {
        let from = if open_low { "more than" } else { "from" };
        add(
            errors,
            path.clone(),
            format!("must be a number {from} {low} to {high}"),
        );
        default
    }
}

/// A duration field: `default` when absent; an error (and `default`) when
/// it does not parse or is outside `low..=high` (`message` says the range).
pub(super) fn duration_in(
    value: Option<&str>,
    default: u64,
    (low, high): (u64, u64),
    message: &str,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> u64 {
    match value.map(parse_duration_ns) {
        None => default,
        Some(Ok(ns)) if (low..=high).contains(&ns) => ns,
        Some(Ok(_)) => {
            add(errors, path.clone(), message);
            default
        }
        Some(Err(m)) => {
            add(errors, path.clone(), m);
            default
        }
    }
}
