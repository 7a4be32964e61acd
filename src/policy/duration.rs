//! Durations as people write them: `500ms`, `10s`, `1m`, `1h`, `1d`.

/// Nanoseconds per unit, longest suffix first so `ms` wins over `m`/`s`.
const UNITS: [(&str, u64); 5] = [
    ("ms", 1_000_000),
    ("s", 1_000_000_000),
    ("m", 60_000_000_000),
    ("h", 3_600_000_000_000),
    ("d", 86_400_000_000_000),
];

/// What [`parse_duration_ns`] accepts, as a regular expression (the
/// policy's JSON Schema states it): digits, then one of [`UNITS`]' suffixes.
/// Kept beside the table it spells; a test checks they agree.
pub const PATTERN: &str = "^[0-9]+(ms|s|m|h|d)$";
/// A limit's `per`: a duration, or `month` (calendar months, a
/// `fixed_window`'s; see `super::limits`).
pub const PER_PATTERN: &str = "^([0-9]+(ms|s|m|h|d)|month)$";

/// Parses a duration into nanoseconds. Zero is allowed here; callers say
/// whether it makes sense for their field.
pub fn parse_duration_ns(text: &str) -> Result<u64, String> {
    let bad = || {
        format!("invalid duration {text:?}: expected a whole number followed by ms, s, m, h or d (e.g. 500ms, 10s, 1m)")
    };
    let (digits, unit) = UNITS
        .iter()
        .find_map(|(suffix, ns)| text.strip_suffix(suffix).map(|d| (d, *ns)))
        .ok_or_else(bad)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let value: u64 = digits.parse().map_err(|_| bad())?;
    value
        .checked_mul(unit)
        .ok_or_else(|| format!("duration {text:?} is too long"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!(parse_duration_ns("500ms"), Ok(500_000_000));
        assert_eq!(parse_duration_ns("10s"), Ok(10_000_000_000));
        assert_eq!(parse_duration_ns("1m"), Ok(60_000_000_000));
        assert_eq!(parse_duration_ns("2h"), Ok(7_200_000_000_000));
        assert_eq!(parse_duration_ns("1d"), Ok(86_400_000_000_000));
    }

    #[test]
    fn rejects_what_is_not_a_duration() {
        for bad in ["", "m", "1", "1 m", "-1s", "1.5s", "1w", "5 minutes", "s1", "+1s"] {
            assert!(parse_duration_ns(bad).is_err(), "{bad:?} should not parse");
        }
        assert!(parse_duration_ns("99999999999999999999d").is_err());
        assert!(parse_duration_ns("999999999999d").is_err());
    }
}
