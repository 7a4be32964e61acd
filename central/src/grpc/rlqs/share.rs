//! How one key's limit is split among the Envoy token buckets that hold it
//! (a pure function of the limit and the number of holders), and the
//! `RateLimitStrategy` each holder is sent.
//!
//! # The split
//! A key enforced at `rate` per `per` seconds with a capacity of `burst`,
//! held by `S` buckets (in the order they joined), gives holder `i`:
//! * when `rate ≥ S`: `tokens_per_fill` = `rate / S`, plus one for the
//!   first `rate mod S` holders, every `per` seconds: Σ = `rate`;
//! * when `rate < S` (a limit smaller than its holders): one token every
//!   `⌈per · S / rate⌉` seconds each, so no holder starves and
//!   Σ ≤ `rate / per` per second;
//! * `max_tokens` = `burst / S`, plus one for the first `burst mod S`
//!   holders, at least 1: Σ = `max(burst, S)` at most.
//!
//! Every number is rounded down (or the interval up), so the holders'
//! rates never add up to more than the limit's. Values beyond `u32` (the
//! proto's) are capped, which admits less, never more.
//!
//! # Envoy 1.40's reading
//! Envoy reads `fill_interval` in whole seconds
//! (`tokens_per_fill / fill_interval.seconds` tokens per second) and
//! decides whether an assignment changed by comparing `max_tokens`,
//! `tokens_per_fill` and `fill_interval.nanos` only. So the interval is a
//! whole number of seconds (at least 1) and its `nanos` carry the seconds
//! again (mod 10⁹; Envoy truncates them): an assignment whose interval
//! alone changed is then still seen as changed, and its new rate applied.
//! A changed assignment replaces the bucket with a new one that starts
//! full (`max_tokens`): the term THE BOUND counts per change.

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};

/// The token bucket a key is enforced with on this path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRate {
    /// Tokens per `per_secs`.
    pub rate: u64,
    pub per_secs: u64,
    /// Capacity.
    pub burst: u64,
}

/// One holder's token bucket, as Envoy reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    pub max_tokens: u32,
    pub tokens_per_fill: u32,
    /// Whole seconds, at least 1.
    pub fill_interval_secs: u64,
}

/// What a bucket is told to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    /// Every request passes (no rule, `unlimited`, `mode: off`/`shadow`).
    AllowAll,
    /// A limit of 0, or a key the service cannot serve.
    DenyAll,
    Bucket(Share),
}

/// The `index`-th of `n` parts of `total`, split as evenly as whole numbers
/// allow (the first `total mod n` parts one larger).
fn part(total: u64, n: u64, index: u64) -> u64 {
    let base = total.checked_div(n).unwrap_or(0);
    let extra = u64::from(index < total.checked_rem(n).unwrap_or(0));
    base.saturating_add(extra)
}

fn capped(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// Holder `index`'s grant among `holders` (see the module header).
pub fn split(limit: KeyRate, holders: usize, index: usize) -> Grant {
    let (Ok(n), Ok(i)) = (u64::try_from(holders), u64::try_from(index)) else {
        return Grant::DenyAll;
    };
    if n == 0 || i >= n || limit.rate == 0 {
        return Grant::DenyAll;
    }
    let per = limit.per_secs.max(1);
    let (tokens_per_fill, fill_interval_secs) = if limit.rate >= n {
        (part(limit.rate, n, i), per)
    } else {
        // One token every ⌈per·S/rate⌉ s each: Σ ≤ rate/per.
        let stretched = u128::from(per)
            .saturating_mul(u128::from(n))
            .div_ceil(u128::from(limit.rate));
        (1, u64::try_from(stretched).unwrap_or(u64::MAX))
    };
    Grant::Bucket(Share {
        max_tokens: capped(part(limit.burst, n, i).max(1)),
        tokens_per_fill: capped(tokens_per_fill),
        fill_interval_secs,
    })
}

/// The most tokens `holders` buckets of `limit` can hold together (Σ
/// `max_tokens`): the burst term of THE BOUND, per assignment.
pub fn total_burst(limit: KeyRate, holders: usize) -> u64 {
    (0..holders)
        .map(|i| match split(limit, holders, i) {
            Grant::Bucket(s) => u64::from(s.max_tokens),
            Grant::AllowAll | Grant::DenyAll => 0,
        })
        .fold(0u64, u64::saturating_add)
}

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// Seconds as Envoy reads them (whole seconds; `nanos` as the header says).
pub fn seconds(secs: u64, tag_nanos: bool) -> PbDuration {
    let nanos = if tag_nanos { secs % NANOS_PER_SEC } else { 0 };
    PbDuration {
        seconds: i64::try_from(secs).unwrap_or(i64::MAX),
        nanos: i32::try_from(nanos).unwrap_or(0),
    }
}

/// The grant as Envoy's `RateLimitStrategy`.
pub fn strategy(grant: Grant) -> RateLimitStrategy {
    let strategy = match grant {
        Grant::AllowAll => Strategy::BlanketRule(BlanketRule::AllowAll as i32),
        Grant::DenyAll => Strategy::BlanketRule(BlanketRule::DenyAll as i32),
        Grant::Bucket(s) => Strategy::TokenBucket(TokenBucket {
            max_tokens: s.max_tokens,
            tokens_per_fill: Some(UInt32Value {
                value: s.tokens_per_fill,
            }),
            fill_interval: Some(seconds(s.fill_interval_secs, true)),
        }),
    };
    RateLimitStrategy {
        strategy: Some(strategy),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(g: Grant) -> Share {
        match g {
            Grant::Bucket(s) => s,
            other => panic!("{other:?}"),
        }
    }

    /// Tokens per second, summed over the holders (as Envoy computes them).
    fn total_rate(limit: KeyRate, n: usize) -> f64 {
        (0..n)
            .map(|i| {
                let s = bucket(split(limit, n, i));
                f64::from(s.tokens_per_fill) / s.fill_interval_secs as f64
            })
            .sum()
    }

    #[test]
    fn the_holders_rates_and_bursts_add_up_to_the_limit_at_most() {
        for rate in [1u64, 2, 3, 7, 30, 100, 1000] {
            for burst in [1u64, 2, 6, 30, 100] {
                for per_secs in [1u64, 10, 60, 86_400] {
                    let limit = KeyRate {
                        rate,
                        per_secs,
                        burst,
                    };
                    for n in 1..12 {
                        let r = total_rate(limit, n);
                        assert!(r <= rate as f64 / per_secs as f64 + 1e-9, "{limit:?} n={n}: {r}");
                        assert!(total_burst(limit, n) <= burst.max(n as u64), "{limit:?} n={n}");
                        for i in 0..n {
                            let s = bucket(split(limit, n, i));
                            assert!(s.max_tokens >= 1 && s.tokens_per_fill >= 1 && s.fill_interval_secs >= 1);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn an_even_split_uses_the_whole_limit() {
        let limit = KeyRate {
            rate: 30,
            per_secs: 10,
            burst: 6,
        };
        let shares: Vec<Share> = (0..2).map(|i| bucket(split(limit, 2, i))).collect();
        assert_eq!(
            shares,
            vec![
                Share {
                    max_tokens: 3,
                    tokens_per_fill: 15,
                    fill_interval_secs: 10
                };
                2
            ]
        );
        assert_eq!(total_burst(limit, 2), 6);
        // 31 over 2: 16 + 15.
        let odd = KeyRate { rate: 31, ..limit };
        assert_eq!(bucket(split(odd, 2, 0)).tokens_per_fill, 16);
        assert_eq!(bucket(split(odd, 2, 1)).tokens_per_fill, 15);
    }

    #[test]
    fn a_limit_smaller_than_its_holders_starves_none() {
        // 2 per minute over 3 holders: one token every 90 s each.
        let limit = KeyRate {
            rate: 2,
            per_secs: 60,
            burst: 2,
        };
        for i in 0..3 {
            let s = bucket(split(limit, 3, i));
            assert_eq!(
                (s.tokens_per_fill, s.fill_interval_secs, s.max_tokens),
                (1, 90, 1)
            );
        }
    }

    #[test]
    fn a_zero_limit_or_no_holder_denies() {
        let zero = KeyRate {
            rate: 0,
            per_secs: 1,
            burst: 5,
        };
        assert_eq!(split(zero, 1, 0), Grant::DenyAll);
        let limit = KeyRate {
            rate: 5,
            per_secs: 1,
            burst: 5,
        };
        assert_eq!(split(limit, 0, 0), Grant::DenyAll);
        assert_eq!(split(limit, 2, 2), Grant::DenyAll);
    }

    #[test]
    fn huge_numbers_are_capped_not_wrapped() {
        let limit = KeyRate {
            rate: u64::MAX,
            per_secs: u64::MAX,
            burst: u64::MAX,
        };
        let s = bucket(split(limit, 1, 0));
        assert_eq!((s.max_tokens, s.tokens_per_fill), (u32::MAX, u32::MAX));
        let d = seconds(u64::MAX, true);
        assert_eq!(d.seconds, i64::MAX);
        assert!(d.nanos >= 0 && d.nanos < 1_000_000_000);
    }

    #[test]
    fn the_interval_seconds_show_in_its_nanos() {
        let s = strategy(Grant::Bucket(Share {
            max_tokens: 1,
            tokens_per_fill: 1,
            fill_interval_secs: 90,
        }));
        let Some(Strategy::TokenBucket(tb)) = s.strategy else {
            panic!("{s:?}")
        };
        assert_eq!(
            tb.fill_interval,
            Some(PbDuration {
                seconds: 90,
                nanos: 90
            })
        );
    }
}
