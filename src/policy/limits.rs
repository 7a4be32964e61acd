//! A plan's or a guard's `limits`: each limit's algorithm, rate, period,
//! burst, debt and name validated and compiled, and the set checked to fit
//! one key-table slot.

use super::duration::parse_duration_ns;
use super::error::{Errors, FieldPath};
use super::spec::{self, LimitSpec};
use super::values::{MAX_LIMIT, MAX_RATE_ERROR_PER_MILLE, MAX_WINDOW_SECS};
use super::{fnv1a32, is_name, Limit, MAX_LIMITS_PER_PLAN};
use crate::limiter::algo::Algo;
use crate::limiter::calendar::{self, Zone};
use crate::limiter::{
    FixedWindow, Gcra, SlidingWindowCounter, SlidingWindowLog, MAX_LOG_ENTRIES, NANOS_PER_SEC,
};
use crate::table;

/// The limits of a plan (or a guard's or a level's, see [`Owner`]): at least one,
/// at most [`MAX_LIMITS_PER_PLAN`], and together small enough for one
/// key-table slot.
pub(super) fn compile_limits(
    owner: &Owner<'_>,
    specs: &[LimitSpec],
    path: &FieldPath,
    errors: &mut Errors,
) -> Vec<Limit> {
    if specs.is_empty() {
        errors.add(path.clone(), "at least one limit is required");
    }
    if specs.len() > MAX_LIMITS_PER_PLAN {
        errors.add(
            path.clone(),
            format!("at most {MAX_LIMITS_PER_PLAN} limits per plan"),
        );
    }
    let mut limits: Vec<Limit> = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        if let Some(limit) = compile_limit(spec, owner, &limits, &path.index(i), errors) {
            limits.push(limit);
        }
    }
    check_state_fits(&limits, path, errors);
    limits
}

/// The plan or guard a limit belongs to.
pub(super) struct Owner<'a> {
    pub plan: &'a str,
    /// How many limits it has.
    pub limits: usize,
    /// `None`: its limits may be global (a plan's, a level's). Otherwise
    /// why they may not, the start of the error that says so.
    pub global_refused: Option<&'static str>,
    /// The same for `on_limit: soft` (only a plan's limits may be soft).
    pub soft_refused: Option<&'static str>,
    /// Some route class of the policy settles its cost (`max_debt`'s default).
    pub settles: bool,
}

/// One limit (`None`: it has an error that leaves nothing to compile):
/// its name, its rate, burst and window, its algorithm, `shadow` and `global`.
fn compile_limit(
    spec: &LimitSpec,
    owner: &Owner<'_>,
    before: &[Limit],
    path: &FieldPath,
    errors: &mut Errors,
) -> Option<Limit> {
    let (name, name_hash) = limit_name(spec, owner, before, path, errors)?;
    let rate = if spec.algorithm == spec::Algorithm::FixedWindow {
        window_rate(spec.rate, &path.key("rate"), errors)
    } else {
        count(spec.rate, &path.key("rate"), errors)
    };
    let burst = match spec.burst {
        Some(b) => count(b, &path.key("burst"), errors),
        None => rate,
    };
    let per_secs = if spec.per == MONTH {
        Some(AVERAGE_MONTH_SECS)
    } else {
        if spec.time_zone.is_some() {
            errors.add(
                path.key("time_zone"),
                "a time zone places calendar months: only with `per: month`",
            );
        }
        limit_per_secs(&spec.per, &path.key("per"), errors)
    };
    let (Some(rate), Some(burst), Some(per_secs)) = (rate, burst, per_secs) else {
        return None;
    };
    let algo = limit_algo(spec, rate, burst, per_secs, path, errors)?;
    let shadow = spec.shadow.unwrap_or(false);
    let global = spec.global.unwrap_or(false);
    if let (true, Some(why)) = (global, owner.global_refused) {
        errors.add(
            path.key("global"),
            format!("{why}: only plans' and levels' limits can be global"),
        );
    } else if global && spec.algorithm != spec::Algorithm::TokenBucket && spec.per != MONTH {
        errors.add(
            path.key("global"),
            "only token_bucket limits and calendar months (`per: month`) can be global",
        );
    }
    let soft = spec.on_limit == Some(spec::LimitOnLimit::Soft);
    if let (true, Some(why)) = (soft, owner.soft_refused) {
        errors.add(
            path.key("on_limit"),
            format!("{why}: only plans' limits can be soft"),
        );
    } else if soft && shadow {
        errors.add(
            path.key("on_limit"),
            "a shadow limit never denies: `on_limit: soft` does not apply",
        );
    }
    let (algo, max_debt) = limit_debt(spec, owner, algo, rate, burst, per_secs, path, errors)?;
    Some(Limit {
        name,
        name_hash,
        rate,
        per_secs,
        burst,
        algo,
        shadow,
        global,
        soft,
        max_debt,
    })
}

/// A limit's debt allowance for late-settled costs (`max_debt`): by
/// default its capacity (a token bucket's burst, a window's rate) in a
/// policy with a class that settles, else 0; a sliding log has none (it is
/// exact); a token bucket must repay it within 366 days.
#[allow(clippy::too_many_arguments)]
fn limit_debt(
    spec: &LimitSpec,
    owner: &Owner<'_>,
    algo: Algo,
    rate: u64,
    burst: u64,
    per_secs: u64,
    path: &FieldPath,
    errors: &mut Errors,
) -> Option<(Algo, u64)> {
    let log = spec.algorithm == spec::Algorithm::SlidingWindowLog;
    let max_debt = match spec.max_debt {
        Some(n) if !(0..=MAX_LIMIT).contains(&n) => {
            errors.add(path.key("max_debt"), format!("must be between 0 and {MAX_LIMIT}"));
            return None;
        }
        Some(n) if n > 0 && log => {
            errors.add(
                path.key("max_debt"),
                "a sliding_window_log is exact and cannot owe: a settled cost fills it up to its rate",
            );
            return None;
        }
        Some(n) => n as u64,
        None if !owner.settles || log => 0,
        None if spec.algorithm == spec::Algorithm::TokenBucket => burst,
        None => rate,
    };
    let fits = |a: &Algo| match a {
        Algo::TokenBucket(g) => {
            g.tolerance_ns()
                .saturating_add(g.max_debt().saturating_mul(g.interval_ns()))
                / NANOS_PER_SEC
                <= MAX_WINDOW_SECS
        }
        _ => true,
    };
    match algo.with_debt(max_debt) {
        Some(a) if fits(&a) => Some((a, max_debt)),
        _ => {
            errors.add(
                path.key("max_debt"),
                format!(
                    "a debt of {max_debt} at {rate} per {per_secs}s (with a burst of {burst}) takes longer than 366d to repay"
                ),
            );
            None
        }
    }
}

/// A limit's name (the plan's, for a plan's only limit) and its hash,
/// unique among `before`; `None` when a name is required and missing.
fn limit_name(
    spec: &LimitSpec,
    owner: &Owner<'_>,
    before: &[Limit],
    path: &FieldPath,
    errors: &mut Errors,
) -> Option<(String, u32)> {
    let name = match (&spec.name, owner.limits) {
        (Some(n), _) => n.clone(),
        (None, 1) => owner.plan.to_owned(),
        (None, _) => {
            errors.add(path.key("name"), "required when a plan has more than one limit");
            return None;
        }
    };
    if !is_name(&name) {
        errors.add(
            path.key("name"),
            "limit names are 1 to 64 characters of A-Z a-z 0-9 _ - .",
        );
    }
    let name_hash = fnv1a32(name.as_bytes());
    if before.iter().any(|l| l.name == name || l.name_hash == name_hash) {
        errors.add(
            path.key("name"),
            format!("duplicate limit name `{name}` in this plan"),
        );
    }
    Some((name, name_hash))
}

/// `per: month`: windows that are calendar months (a `fixed_window`'s),
/// in the limit's `time_zone`.
const MONTH: &str = "month";
/// A calendar month's `per_secs` where one number is needed (the `w=` of
/// `RateLimit-Policy`, the limits endpoint): the Gregorian average,
/// 30.436875 days. Windows, `Retry-After` and `t=` use each month's exact end.
pub const AVERAGE_MONTH_SECS: u64 = 2_629_746;

/// A limit's `time_zone`: absent or `UTC`/`Z` is UTC; `+HH:MM` /
/// `-HH:MM` a fixed offset up to ±14:00; else an IANA zone name
/// (`Europe/Berlin`), with its changes of clock, from the table the filter
/// carries ([`calendar::zones`], the database's version in its error).
fn time_zone(zone: Option<&str>, path: &FieldPath, errors: &mut Errors) -> Option<Zone> {
    let zone = match zone {
        None | Some("UTC" | "Z") => return Zone::fixed(0),
        Some(z) => z,
    };
    let fixed = (|| {
        let (sign, rest) = match zone.as_bytes().first()? {
            b'+' => (1, zone.get(1..)?),
            b'-' => (-1, zone.get(1..)?),
            _ => return None,
        };
        let (h, m) = rest.split_once(':')?;
        let ok = h.len() == 2 && m.len() == 2;
        let (h, m): (i32, i32) = (h.parse().ok()?, m.parse().ok()?);
        if !ok || m >= 60 {
            return None;
        }
        Zone::fixed(sign * (h * 3600 + m * 60))
    })();
    let parsed = fixed.or_else(|| Zone::named(zone));
    if parsed.is_none() {
        errors.add(
            path.clone(),
            format!(
                "`{zone}`: UTC, a fixed offset from -14:00 to +14:00 (+05:30), or an IANA time zone name as the database spells it (Europe/Berlin; tzdata {})",
                calendar::zones::VERSION
            ),
        );
    }
    parsed
}

/// A limit's `per`: a whole number of seconds, from 1 s to 366 days.
fn limit_per_secs(per: &str, path: &FieldPath, errors: &mut Errors) -> Option<u64> {
    match parse_duration_ns(per) {
        Err(message) => {
            errors.add(path.clone(), message);
            None
        }
        Ok(ns) if ns < NANOS_PER_SEC || ns % NANOS_PER_SEC != 0 => {
            errors.add(
                path.clone(),
                "must be a whole number of seconds, at least 1s (RateLimit-Policy states w= in seconds)",
            );
            None
        }
        Ok(ns) if ns / NANOS_PER_SEC > MAX_WINDOW_SECS => {
            errors.add(path.clone(), "must be at most 366d");
            None
        }
        Ok(ns) => Some(ns / NANOS_PER_SEC),
    }
}

/// A limit's algorithm with its parameters (`None`: they cannot be
/// represented, with the error that says why).
fn limit_algo(
    spec: &LimitSpec,
    rate: u64,
    burst: u64,
    per_secs: u64,
    path: &FieldPath,
    errors: &mut Errors,
) -> Option<Algo> {
    let window_ns = per_secs * NANOS_PER_SEC;
    if spec.algorithm != spec::Algorithm::TokenBucket && spec.burst.is_some() {
        errors.add(
            path.key("burst"),
            "only token_bucket has a burst: a window algorithm admits `rate` per `per`",
        );
        return None;
    }
    if spec.per == MONTH && spec.algorithm != spec::Algorithm::FixedWindow {
        errors.add(
            path.key("per"),
            "a calendar month is a fixed_window's: set `algorithm: fixed_window` (or a duration such as 30d)",
        );
        return None;
    }
    let algo = match spec.algorithm {
        spec::Algorithm::TokenBucket => match Gcra::new(rate, window_ns, burst) {
            Some(g) if !steps_hold(&g, rate, window_ns) => {
                errors.add(
                    path.key("rate"),
                    format!(
                        "{rate} per {per_secs}s needs a step finer than a token bucket's whole nanosecond (it would refill {} per {per_secs}s): use a longer `per`, or a rate that divides it into whole nanoseconds",
                        window_ns / g.interval_ns().max(1)
                    ),
                );
                return None;
            }
            Some(g) if g.tolerance_ns() / NANOS_PER_SEC <= MAX_WINDOW_SECS => Some(Algo::TokenBucket(g)),
            _ => {
                errors.add(
                    path.key("burst"),
                    format!("a burst of {burst} at {rate} per {per_secs}s takes longer than 366d to refill"),
                );
                return None;
            }
        },
        spec::Algorithm::FixedWindow if spec.per == MONTH => {
            let zone = time_zone(spec.time_zone.as_deref(), &path.key("time_zone"), errors)?;
            Some(Algo::FixedWindow(FixedWindow::calendar_month(rate, zone)))
        }
        spec::Algorithm::FixedWindow => FixedWindow::new(rate, window_ns).map(Algo::FixedWindow),
        spec::Algorithm::SlidingWindowCounter => {
            SlidingWindowCounter::new(rate, window_ns).map(Algo::SlidingWindowCounter)
        }
        spec::Algorithm::SlidingWindowLog => match SlidingWindowLog::new(rate, window_ns) {
            Some(a) => Some(Algo::SlidingWindowLog(a)),
            None => {
                errors.add(
                    path.key("rate"),
                    format!(
                        "sliding_window_log keeps one entry per admitted request, at most {MAX_LOG_ENTRIES} per key: lower the rate or use sliding_window_counter"
                    ),
                );
                return None;
            }
        },
    };
    if algo.is_none() {
        // Rates, windows and bursts are validated above; unreachable.
        errors.add(path.clone(), "these parameters cannot be represented");
    }
    algo
}

/// Whether a token bucket's whole-nanosecond step between units refills
/// `rate` per `window_ns` to within [`MAX_RATE_ERROR_PER_MILLE`].
fn steps_hold(g: &Gcra, rate: u64, window_ns: u64) -> bool {
    let refill_ns = u128::from(g.interval_ns()) * u128::from(rate);
    let slack = u128::from(window_ns) * u128::from(MAX_RATE_ERROR_PER_MILLE) / 1000;
    refill_ns <= u128::from(window_ns) + slack
}

/// One key's records for all these limits share one key-table slot: their
/// largest state must fit in it.
fn check_state_fits(limits: &[Limit], path: &FieldPath, errors: &mut Errors) {
    let records_len = limits
        .iter()
        .map(|l| {
            let state = if l.global {
                super::MAX_ALLOWANCE_LEN
            } else {
                l.algo.max_stored_len()
            };
            table::RECORD_HEADER_LEN.saturating_add(state)
        })
        .fold(1usize, usize::saturating_add);
    if records_len > table::MAX_RECORDS_LEN {
        errors.add(
            path.clone(),
            format!(
                "these limits need up to {records_len} bytes of state per key, more than the {} a key-table slot holds: use fewer or smaller sliding_window_log limits",
                table::MAX_RECORDS_LEN
            ),
        );
    }
}

/// A `fixed_window` rate: 0 to [`MAX_LIMIT`].
fn window_rate(value: i64, path: &FieldPath, errors: &mut Errors) -> Option<u64> {
    match value {
        0..=MAX_LIMIT => Some(value as u64),
        _ => {
            errors.add(
                path.clone(),
                format!("a fixed_window rate is between 0 and {MAX_LIMIT}"),
            );
            None
        }
    }
}

/// A positive count no larger than [`MAX_LIMIT`].
fn count(value: i64, path: &FieldPath, errors: &mut Errors) -> Option<u64> {
    if value <= 0 {
        errors.add(path.clone(), "must be > 0");
        None
    } else if value > MAX_LIMIT {
        errors.add(path.clone(), format!("must be at most {MAX_LIMIT}"));
        None
    } else {
        Some(value as u64)
    }
}
