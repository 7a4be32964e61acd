//! Token bucket in GCRA form (the generic cell rate algorithm).
//!
//! # Semantics
//! A limit of `rate` per `per` with capacity `burst` refills one token every
//! emission interval `T = ceil(per / rate)` and holds at most `burst`
//! tokens. The whole state is one `u64`, the *theoretical arrival time*
//! (TAT): the instant at which the bucket is full again. With tolerance
//! `τ = burst × T`, at time `now`:
//!
//! * available tokens = `floor((now + τ − max(TAT, now)) / T)`, always in
//!   `[0, burst]`;
//! * a request of cost `c` is admitted iff `max(TAT, now) + c·T ≤ now + τ`,
//!   and then `TAT := max(TAT, now) + c·T`;
//! * a denied request changes nothing, and may retry after
//!   `max(TAT, now) + c·T − τ − now` nanoseconds: the exact instant `c`
//!   tokens are available.
//!
//! An idle period accrues at most `burst` tokens (`max(TAT, now)` forgets
//! idle time beyond a full bucket). A clock that steps backwards is
//! saturated: the stored TAT is clamped to `now + τ` (`now + τ + D·T` with
//! a debt allowance, below), so a bucket is at worst empty and never owes
//! more than one full refill (and its debt).
//!
//! # Several workers, stale readings
//! The TAT is shared by every worker of a node, each with its own reading
//! of the clock: a worker may read `now`, wait for a core, and find a TAT
//! another worker wrote at a later instant. THE INVARIANT: **the TAT never
//! moves backwards by a write except by a give-back of units its own
//! parameters charged; a stale reading can only deny, never admit what the
//! limit would not at an instant the request lived through, nor create
//! units.** It holds because a charge reads a record at
//! [`crate::limiter::algo::reading`], never before the record's own write
//! instant (less than [`crate::limiter::algo::MAX_STALE_NS`] behind it:
//! beyond that it is a clock step, saturated as above), so the clamp of
//! [`Gcra::saturate`] never meets a TAT a stale reading left ahead; and a
//! give-back goes only to a record still under the parameters it was
//! charged under ([`crate::limiter::algo::Algo::charged_under`]). An
//! admission at a reading `δ` stale is charged `δ` early: over any interval
//! `d`, at most `burst + floor((d + δ) / T)`. Tested with thousands of
//! seeded schedules of 2 to 8 workers with stale readings through the
//! shipped `table::update` (`src/engine/tests/stale.rs`), and in a real
//! Envoy at `--concurrency 4` on two cores
//! (`integration-tests/tests/node_bound.rs`).
//!
//! # Debt
//! A limit with a debt allowance `D` (`max_debt`, in tokens; 0 unless the
//! policy settles costs after the response) also takes **charges without
//! admission** ([`Gcra::settle_more`]): a request's real cost, known only
//! at its end, beyond the estimate it was admitted with. Such a charge moves
//! the TAT like any other, `TAT := max(TAT, now) + u·T`, but past the
//! horizon: the TAT may run ahead of `now + τ` by at most `D·T`, and what
//! would go further is **written off** (returned to the caller, who counts
//! it). While `TAT > now + τ` the bucket is in debt: no token is available,
//! and a request of cost `c` waits `TAT + c·T − τ − now`, the debt's
//! repayment included (the honest `Retry-After`). The clock's saturation
//! keeps the debt: a stored TAT is clamped to `now + τ + D·T`.
//!
//! # Error and over-admission bound
//! `T` is rounded *up* to whole nanoseconds, so the limiter admits at most
//! `rate` per `per` plus `burst`: in any interval of length `d`, at most
//! `burst + floor(d / T)` tokens are consumed, never more. The rounding
//! under-admits by less than one token per `T` nanoseconds of error: for
//! `7/day`, `T` is 1 ns longer than exact, i.e. one token in 10^13.
//!
//! With debt, every unit charged (admitted or settled) moves the TAT by
//! `T`, the TAT stays in `[now − …, now + τ + D·T]` and forgetting idle time
//! only lowers it: so the units charged in any interval of length `d` are at
//! most `burst + D + floor(d / T)`, plus what was written off (counted).

/// The immutable parameters of one token-bucket limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    /// `T`: nanoseconds per token.
    interval_ns: u64,
    /// `τ = burst × T`: how far the TAT may run ahead of now.
    tolerance_ns: u64,
    burst: u64,
    /// `D·T`: how far past `now + τ` late-settled costs may push the TAT
    /// (see "Debt"); 0 without a debt allowance.
    debt_ns: u64,
}

/// The outcome of [`Gcra::check`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Admitted; store `new_tat`. `remaining` tokens are left.
    Admit { new_tat: u64, remaining: u64 },
    /// Denied; nothing changes. `wait_ns` until the cost is available.
    Deny { wait_ns: u64 },
}

impl Gcra {
    /// `rate` tokens per `per_ns` nanoseconds, holding at most `burst`.
    ///
    /// Returns `None` unless `rate`, `per_ns` and `burst` are positive and
    /// `burst × T` fits in a `u64` (policy validation reports these).
    pub fn new(rate: u64, per_ns: u64, burst: u64) -> Option<Gcra> {
        if rate == 0 || per_ns == 0 || burst == 0 {
            return None;
        }
        let interval_ns = per_ns.div_ceil(rate);
        let tolerance_ns = burst.checked_mul(interval_ns)?;
        Some(Gcra {
            interval_ns,
            tolerance_ns,
            burst,
            debt_ns: 0,
        })
    }

    /// These parameters with a debt allowance of `max_debt` tokens (see
    /// "Debt"); `None` if `max_debt × T` does not fit a `u64` (policy
    /// validation reports it).
    pub fn with_debt(self, max_debt: u64) -> Option<Gcra> {
        Some(Gcra {
            debt_ns: max_debt.checked_mul(self.interval_ns)?,
            ..self
        })
    }

    /// Rebuilds parameters stored by an earlier configuration.
    pub fn from_stored(interval_ns: u64, tolerance_ns: u64) -> Option<Gcra> {
        if interval_ns == 0 || tolerance_ns == 0 || tolerance_ns % interval_ns != 0 {
            return None;
        }
        Some(Gcra {
            interval_ns,
            tolerance_ns,
            burst: tolerance_ns / interval_ns,
            debt_ns: 0,
        })
    }

    pub fn interval_ns(&self) -> u64 {
        self.interval_ns
    }

    pub fn tolerance_ns(&self) -> u64 {
        self.tolerance_ns
    }

    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// The debt allowance in tokens (`max_debt`).
    pub fn max_debt(&self) -> u64 {
        self.debt_ns / self.interval_ns
    }

    /// The furthest the TAT may be ahead of `now`: one refill and the debt.
    fn max_lead(&self) -> u64 {
        self.tolerance_ns.saturating_add(self.debt_ns)
    }

    /// The TAT as it stands at `now`: idle time beyond a full bucket is
    /// forgotten and a TAT left ahead by a clock step backwards is clamped.
    fn effective_tat(&self, tat: u64, now: u64) -> u64 {
        tat.clamp(now, now.saturating_add(self.max_lead()))
    }

    /// `tat` with anything beyond one full refill and the debt allowance
    /// forgiven: after a clock step backwards the stored TAT can be far
    /// ahead of `now`. Callers persist this on a denial when it differs
    /// from `tat`, so the bucket refills from `now` instead of waiting for
    /// the old clock.
    pub fn saturate(&self, tat: u64, now: u64) -> u64 {
        tat.min(now.saturating_add(self.max_lead()))
    }

    /// Whole tokens available at `now` (0 while in debt).
    pub fn available(&self, tat: u64, now: u64) -> u64 {
        let base = self.effective_tat(tat, now);
        let slack = now.saturating_add(self.tolerance_ns).saturating_sub(base);
        (slack / self.interval_ns).min(self.burst)
    }

    /// Whole tokens owed at `now`: how far the TAT is past `now + τ`,
    /// rounded up (0 when not in debt).
    pub fn debt(&self, tat: u64, now: u64) -> u64 {
        let base = self.effective_tat(tat, now);
        base.saturating_sub(now.saturating_add(self.tolerance_ns))
            .div_ceil(self.interval_ns)
    }

    /// Gives `units` tokens back (a charge a later check refused, a lease's
    /// unspent units, a settled cost below its estimate): a debt is repaid
    /// first; a bucket never holds more than its burst (a TAT below `now`
    /// reads as full).
    pub fn refund(&self, tat: u64, units: u64) -> u64 {
        tat.saturating_sub(units.saturating_mul(self.interval_ns))
    }

    /// Charges `units` more tokens at `now` without admission (a cost
    /// settled after the response, see "Debt"): the new TAT, and the units
    /// written off because the debt allowance could not hold them.
    pub fn settle_more(&self, tat: u64, units: u64, now: u64) -> (u64, u64) {
        let base = self.effective_tat(tat, now);
        let cap = now.saturating_add(self.max_lead());
        let wanted = u128::from(base) + u128::from(units) * u128::from(self.interval_ns);
        if wanted <= u128::from(cap) {
            // wanted ≤ cap ≤ u64::MAX.
            return (u64::try_from(wanted).unwrap_or(cap), 0);
        }
        let over = (wanted - u128::from(cap)).div_ceil(u128::from(self.interval_ns));
        (cap.max(base), u64::try_from(over).unwrap_or(u64::MAX).min(units))
    }

    /// Nanoseconds until the bucket is full again.
    pub fn time_to_full_ns(&self, tat: u64, now: u64) -> u64 {
        self.effective_tat(tat, now) - now
    }

    /// Whether a request of `cost` tokens is admitted at `now`.
    pub fn check(&self, tat: u64, now: u64, cost: u64) -> Check {
        let base = self.effective_tat(tat, now);
        let new_tat = base.saturating_add(cost.saturating_mul(self.interval_ns));
        let horizon = now.saturating_add(self.tolerance_ns);
        if new_tat <= horizon {
            let remaining = ((horizon - new_tat) / self.interval_ns).min(self.burst);
            Check::Admit { new_tat, remaining }
        } else {
            Check::Deny {
                wait_ns: new_tat - horizon,
            }
        }
    }

    /// The TAT under `self` that leaves a bucket no fuller than it was under
    /// `old` at `now`: used when a policy reload changes a live limit, so a
    /// reload never hands out tokens (in particular, never a fresh burst).
    /// The bucket keeps its fill level in tokens, capped at the new burst,
    /// and refills at the new rate from `now`.
    /// A debt carries over too, in whole tokens (rounded up), at most the
    /// new debt allowance: a reload neither adds tokens nor forgives more
    /// debt than the new allowance holds.
    pub fn migrate_tat(&self, old: &Gcra, tat: u64, now: u64) -> u64 {
        if old == self {
            return tat;
        }
        let old_base = old.effective_tat(tat, now);
        let horizon = now.saturating_add(old.tolerance_ns);
        if old_base > horizon {
            let owed = old.debt(tat, now).min(self.max_debt());
            return now
                .saturating_add(self.tolerance_ns)
                .saturating_add(owed.saturating_mul(self.interval_ns));
        }
        let old_slack = u128::from(horizon - old_base);
        // Tokens (as a fraction) = old_slack / old.T; in new nanoseconds:
        let new_slack = old_slack * u128::from(self.interval_ns) / u128::from(old.interval_ns);
        let new_slack = u64::try_from(new_slack)
            .unwrap_or(u64::MAX)
            .min(self.tolerance_ns);
        now.saturating_add(self.tolerance_ns) - new_slack
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;
    const MIN: u64 = 60 * S;
    /// An arbitrary, realistic wall-clock start (2026-11-30).
    const T0: u64 = 1_796_000_000 * S;

    fn limit(rate: u64, per: u64, burst: u64) -> Gcra {
        Gcra::new(rate, per, burst).unwrap()
    }

    /// Admits `cost` at `now`, updating `tat`; true if admitted.
    fn take(g: &Gcra, tat: &mut u64, now: u64, cost: u64) -> bool {
        match g.check(*tat, now, cost) {
            Check::Admit { new_tat, .. } => {
                *tat = new_tat;
                true
            }
            Check::Deny { .. } => false,
        }
    }

    #[test]
    fn a_full_bucket_admits_exactly_its_burst() {
        let g = limit(100, MIN, 20);
        let mut tat = 0;
        let admitted = (0..50).filter(|_| take(&g, &mut tat, T0, 1)).count();
        assert_eq!(admitted, 20);
        assert_eq!(g.available(tat, T0), 0);
    }

    #[test]
    fn refill_is_exact_after_long_idle_and_capped_at_burst() {
        let g = limit(100, MIN, 100);
        let mut tat = 0;
        for _ in 0..100 {
            assert!(take(&g, &mut tat, T0, 1));
        }
        // 600 ms per token: 30 s later exactly 50 tokens are back.
        assert_eq!(g.available(tat, T0 + 30 * S), 50);
        assert_eq!(g.available(tat, T0 + 30 * S - 1), 49);
        // A week idle accrues no more than the burst.
        assert_eq!(g.available(tat, T0 + 7 * 86_400 * S), 100);
        let mut later = tat;
        let n = (0..1000)
            .filter(|_| take(&g, &mut later, T0 + 7 * 86_400 * S, 1))
            .count();
        assert_eq!(n, 100);
    }

    #[test]
    fn retry_after_is_the_exact_time_to_the_next_token() {
        let g = limit(10, S, 10); // T = 100 ms
        let mut tat = 0;
        for _ in 0..10 {
            assert!(take(&g, &mut tat, T0, 1));
        }
        let now = T0 + 30_000_000; // 30 ms later: next token at +100 ms
        assert_eq!(g.check(tat, now, 1), Check::Deny { wait_ns: 70_000_000 });
        assert!(!take(&g, &mut tat, now + 70_000_000 - 1, 1));
        assert!(take(&g, &mut tat, now + 70_000_000, 1));
    }

    #[test]
    fn costs_above_one_consume_and_wait_proportionally() {
        let g = limit(10, S, 10);
        let mut tat = 0;
        assert!(take(&g, &mut tat, T0, 5));
        assert_eq!(g.available(tat, T0), 5);
        assert!(take(&g, &mut tat, T0, 5));
        assert_eq!(g.check(tat, T0, 5), Check::Deny { wait_ns: 500_000_000 });
        // Four tokens back is not enough for cost 5.
        assert!(!take(&g, &mut tat, T0 + 400_000_000, 5));
        assert!(take(&g, &mut tat, T0 + 500_000_000, 5));
    }

    #[test]
    fn a_clock_step_backwards_saturates_instead_of_blocking() {
        let g = limit(10, S, 10);
        let mut tat = 0;
        for _ in 0..10 {
            assert!(take(&g, &mut tat, T0, 1));
        }
        let back = T0 - 3600 * S; // the wall clock jumps back an hour
        assert_eq!(g.available(tat, back), 0);
        match g.check(tat, back, 1) {
            Check::Deny { wait_ns } => assert_eq!(wait_ns, g.interval_ns()),
            other => panic!("expected a denial, got {other:?}"),
        }
        assert_eq!(g.time_to_full_ns(tat, back), g.tolerance_ns());
        // The caller persists the saturated TAT with the denial...
        tat = g.saturate(tat, back);
        // ...so exactly one interval later a token is back.
        assert!(!take(&g, &mut tat, back + g.interval_ns() - 1, 1));
        assert!(take(&g, &mut tat, back + g.interval_ns(), 1));
    }

    #[test]
    fn tokens_stay_within_zero_and_capacity_under_random_traffic() {
        // A small deterministic xorshift so the test needs no dependency.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..200 {
            let rate = next() % 1000 + 1;
            let burst = next() % 500 + 1;
            let per = (next() % 3600 + 1) * S;
            let g = limit(rate, per, burst);
            let (mut tat, mut now) = (0u64, T0);
            for _ in 0..500 {
                // Mostly forward, sometimes backwards, sometimes idle long.
                match next() % 10 {
                    0 => now = now.saturating_sub(next() % (10 * S)),
                    1 => now += next() % (per * 2),
                    _ => now += next() % (g.interval_ns() * 2),
                }
                let cost = next() % burst.min(5) + 1;
                let available = g.available(tat, now);
                assert!(available <= burst);
                if take(&g, &mut tat, now, cost) {
                    assert!(cost <= available, "admitted {cost} with {available} available");
                }
                assert!(g.available(tat, now) <= burst);
            }
        }
    }

    #[test]
    fn admitted_never_exceeds_burst_plus_rate_times_elapsed() {
        let g = limit(7, 86_400 * S, 3);
        let mut tat = 0;
        let mut admitted = 0u64;
        let mut now = T0;
        for step in 0..100_000u64 {
            now = T0 + step * 3_600 * S / 7; // every ~8.6 minutes
            if take(&g, &mut tat, now, 1) {
                admitted += 1;
            }
        }
        let elapsed = now - T0;
        assert!(admitted <= 3 + elapsed / g.interval_ns());
        assert!(admitted >= elapsed / g.interval_ns()); // and it is not starved
    }

    #[test]
    fn migrating_to_new_parameters_never_adds_tokens() {
        let old = limit(10, S, 10);
        let mut tat = 0;
        for _ in 0..10 {
            assert!(take(&old, &mut tat, T0, 1));
        }
        // Raise the limit: an empty bucket stays empty.
        let raised = limit(1000, S, 1000);
        let new_tat = raised.migrate_tat(&old, tat, T0);
        assert_eq!(raised.available(new_tat, T0), 0);
        // Half full, then lower the burst below the fill level: capped.
        let mut tat = 0;
        for _ in 0..5 {
            assert!(take(&old, &mut tat, T0, 1));
        }
        let lowered = limit(2, S, 3);
        let new_tat = lowered.migrate_tat(&old, tat, T0);
        assert_eq!(lowered.available(new_tat, T0), 3);
        // Same parameters: untouched.
        assert_eq!(old.migrate_tat(&old, tat, T0), tat);
        // Half full, raise: still 5 tokens, refilling at the new rate.
        let new_tat = raised.migrate_tat(&old, tat, T0);
        assert_eq!(raised.available(new_tat, T0), 5);
        assert_eq!(raised.available(new_tat, T0 + 10_000_000), 15);
    }

    #[test]
    fn migrating_a_tat_beyond_one_refill_never_wraps_and_never_fills_the_bucket() {
        // A TAT further ahead of the migration instant than the old
        // tolerance (written later, or by a clock that ran ahead) is clamped
        // to an empty bucket, never read as a negative debt that wraps into
        // a full one; extreme values saturate.
        let old = limit(100, MIN, 100);
        let new = limit(10_000, MIN, 10_000);
        for tat in [T0 + old.tolerance_ns() + 1, T0 + 86_400 * S, u64::MAX] {
            for (from, to) in [(&old, &new), (&new, &old)] {
                let migrated = to.migrate_tat(from, tat, T0);
                assert_eq!(to.available(migrated, T0), 0, "{tat}");
            }
        }
        for now in [0, 1, u64::MAX - 1, u64::MAX] {
            for tat in [0, 1, now, u64::MAX] {
                let migrated = new.migrate_tat(&old, tat, now);
                assert!(new.available(migrated, now) <= new.burst());
            }
        }
    }

    #[test]
    fn a_settled_cost_runs_into_debt_up_to_the_allowance_and_the_wait_includes_it() {
        // 10 per second (T = 100 ms), burst 10, debt up to 20 tokens.
        let g = limit(10, S, 10).with_debt(20).unwrap();
        assert_eq!(g.max_debt(), 20);
        let mut tat = 0;
        assert!(take(&g, &mut tat, T0, 10));
        // The real cost was 25 more: 20 owed, 5 written off.
        let (owed, lost) = g.settle_more(tat, 25, T0);
        assert_eq!((g.debt(owed, T0), lost), (20, 5));
        assert_eq!(g.available(owed, T0), 0);
        // One token needs the debt repaid and one refill: 2.1 s.
        assert_eq!(
            g.check(owed, T0, 1),
            Check::Deny {
                wait_ns: 2_100_000_000
            }
        );
        assert_eq!(g.time_to_full_ns(owed, T0), 3 * S);
        let mut t = owed;
        assert!(!take(&g, &mut t, T0 + 2_100_000_000 - 1, 1));
        assert!(take(&g, &mut t, T0 + 2_100_000_000, 1));
        // Saturation keeps the debt (a clock step back does not forgive it).
        assert_eq!(g.saturate(owed, T0), owed);
        assert_eq!(g.saturate(owed, T0 - 3600 * S), T0 - 3600 * S + 3 * S);
        // Without an allowance the whole excess is written off.
        let plain = limit(10, S, 10);
        let mut tat = 0;
        assert!(take(&plain, &mut tat, T0, 10));
        assert_eq!(plain.settle_more(tat, 7, T0), (tat, 7));
        // A settled cost that fits the bucket is charged like an admission.
        let (part, lost) = g.settle_more(0, 4, T0);
        assert_eq!((g.available(part, T0), lost), (6, 0));
        // A refund of a settled cost lowers the debt first.
        let back = g.refund(owed, 15);
        assert_eq!(g.debt(back, T0), 5);
    }

    #[test]
    fn a_reload_carries_a_debt_in_whole_tokens_up_to_the_new_allowance() {
        let old = limit(10, S, 10).with_debt(20).unwrap();
        let (owed, _) = old.settle_more(T0 + S, 12, T0);
        assert_eq!(old.debt(owed, T0), 12);
        let new = limit(100, S, 50).with_debt(8).unwrap();
        let moved = new.migrate_tat(&old, owed, T0);
        assert_eq!((new.available(moved, T0), new.debt(moved, T0)), (0, 8));
        let none = limit(100, S, 50);
        let moved = none.migrate_tat(&old, owed, T0);
        assert_eq!((none.available(moved, T0), none.debt(moved, T0)), (0, 0));
    }

    #[test]
    fn settling_never_overflows_and_never_lowers_the_tat() {
        let g = limit(7, 86_400 * S, 3).with_debt(1_000_000).unwrap();
        for now in [0, 1, T0, u64::MAX - 1, u64::MAX] {
            for tat in [0, now, now.saturating_add(g.tolerance_ns()), u64::MAX] {
                for units in [0, 1, 1_000_000_000, u64::MAX] {
                    let (after, lost) = g.settle_more(tat, units, now);
                    assert!(after >= g.saturate(tat.max(now), now), "{now} {tat} {units}");
                    assert!(lost <= units);
                }
            }
        }
        assert!(limit(1, S, 1).with_debt(u64::MAX).is_none());
    }

    #[test]
    fn invalid_parameters_are_refused() {
        assert!(Gcra::new(0, S, 1).is_none());
        assert!(Gcra::new(1, 0, 1).is_none());
        assert!(Gcra::new(1, S, 0).is_none());
        assert!(Gcra::new(1, u64::MAX, u64::MAX).is_none());
    }
}
