//! The retry budget of a dependency (`dependencies.<d>.retry_budget`):
//! retries are admitted only while they stay a small share of the
//! dependency's recent primary requests, node-wide, so that clients
//! retrying every failure cannot multiply the load on a failing
//! dependency (Finagle's and Linkerd's retry budgets, Google SRE's
//! "Handling Overload").
//!
//! # What a retry is
//! Only a **trusted signal** makes a request a retry: the policy's
//! `retry_header` (a header a trusted earlier hop sets to the attempt
//! number, 1 for the first attempt) or, with `envoy_attempt_count: true`,
//! Envoy's `x-envoy-attempt-count` set by an earlier Envoy hop
//! (`include_request_attempt_count`). A value that parses as an integer
//! ≥ 2 is a retry; anything else (absent, `1`, garbage) is a primary. The
//! edge must strip these headers from clients, like the tenant header: a
//! client that could send them could only make its own requests count as
//! retries (stricter for it), but one that strips them makes its retries
//! primaries, which then also *raise* the budget (see the bound below).
//! Retries made by **this** Envoy's router (`retry_policy`) happen after
//! the filter chain: the filter sees the request once, holds one slot for
//! all of its attempts, and never counts or refuses those retries; bound
//! them with the router's own `retry_budget` (cluster circuit breakers).
//!
//! # The formula
//! The window `W` (`window`, default 10 s) is split into [`BUCKETS`]
//! buckets of `W / 10`. With `P` the primary requests admitted and `R` the
//! retries admitted in the last [`BUCKETS`] buckets (the current one
//! included), node-wide, a retry is admitted iff
//!
//! ```text
//! R < ⌊P × ratio⌋ + min_per_second × W / 1 s        (ratio default 0.2, min_per_second default 1)
//! ```
//!
//! and is then counted in `R` in the same compare-and-swap (before its
//! slot is taken: a retry a later limit refuses has still spent its
//! place, which only makes the budget stricter). A refusal is
//! 503 `retry_budget`, its `Retry-After` the time until the oldest bucket
//! holding a retry leaves the window (at least 1 s) plus the dependency's
//! jitter.
//!
//! # Where the counts live
//! A primary request costs **no hostcall**: its worker counts it in memory
//! ([`Primaries::note`]) and folds the count into the node-wide entry
//! `tg2|r|<dependency>` on its tick ([`Primaries::fold`], through
//! [`crate::table::update`]) and in the update of any retry it admits. A
//! retry takes its place in one [`crate::table::update`]. A primary is
//! counted in the bucket of the instant it is folded: at most one tick
//! (10 ms) late, and unfolded primaries are not counted yet, which only
//! makes the budget stricter.
//!
//! # THE BOUND
//! A retry admitted at bucket `c` saw every retry admitted before it in
//! buckets `(c − 10, c]`, so in any 10 consecutive buckets (one window)
//! `R ≤ ⌊ratio × P'⌋ + min_per_second × W` where `P'` is the primaries of
//! the window ending at the last retry admitted in it (at most one window
//! earlier; checked in every window under random timing with late ticks:
//! `the_bound_holds_in_every_window_under_random_timing_on_two_workers`).
//! Over a span of `k` windows with steady primaries, retries are
//! at most `ratio × P + k × min_per_second × W` (+ one window's `ratio ×
//! P` at the edge), so upstream attempts ≤ `(1 + ratio) × P + floor`.
//! A client **spraying retries** (every one marked) gets at most that
//! budget, shared with every other client of the dependency, whatever its
//! rate: the budget does not grow with retries, only with primaries
//! (tested: `a_client_spraying_retries_gets_only_the_budget`). A
//! client that hides its retries makes them primaries: then each one is
//! also subject to the dependency's other limits, and they raise the
//! budget by `ratio` each, so at most `ratio` marked retries per hidden one.
//! A compare-and-swap that stays conflicted refuses the retry with
//! `contention` (never a silent admission); a failed fold keeps the count
//! for the next tick.
//!
//! Pure: time is `now`, the host is [`Host`].

use hashbrown::HashMap;

use crate::engine::Reason;
use crate::host::Host;
use crate::keys::kind;
use crate::limiter::NANOS_PER_SEC;
use crate::policy::admission::{RetryBudget, ENVOY_ATTEMPT_COUNT_HEADER};
use crate::table::{self, layout::Reader, push_record_with, Commit, Failure, Place, Reach, Records};

/// Buckets of a window.
pub const BUCKETS: usize = 10;
const FORMAT: u8 = 1;

/// Whether a request is a retry by the budget's trusted signals (see the
/// module header): one header read per signal, no shared data.
pub fn is_retry<H: Host>(budget: &RetryBudget, host: &H) -> bool {
    let marked = |name: &str| host.request_header(name).is_some_and(|v| attempt_is_retry(&v));
    budget.retry_header.as_deref().is_some_and(marked)
        || (budget.envoy_attempt_count && marked(ENVOY_ATTEMPT_COUNT_HEADER))
}

/// An attempt number ≥ 2 (ASCII digits, surrounding spaces allowed).
pub fn attempt_is_retry(value: &[u8]) -> bool {
    let text = core::str::from_utf8(value).unwrap_or("").trim();
    !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && text.parse::<u64>().map_or(true, |n| n >= 2)
}

/// One bucket of the window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bucket {
    /// `now / bucket_ns` of the bucket (0: never used).
    pub index: u64,
    pub primaries: u32,
    pub retries: u32,
}

/// A budget's stored state: [`BUCKETS`] buckets in a ring by index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Window {
    pub buckets: [Bucket; BUCKETS],
}

/// The counts of the last window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub primaries: u64,
    pub retries: u64,
}

impl Totals {
    /// Attempts per primary request, ×1000 (1000 with no traffic; with
    /// retries and no primaries, `1000 × (retries + 1)`).
    pub fn amplification_permille(&self) -> u64 {
        let attempts = self.primaries.saturating_add(self.retries);
        attempts.saturating_mul(1000) / self.primaries.max(1)
    }
}

/// The bucket length of a budget.
pub fn bucket_ns(budget: &RetryBudget) -> u64 {
    (budget.window_ns / BUCKETS as u64).max(1)
}

/// Retries the window allows with `primaries` primaries.
pub fn allowed(budget: &RetryBudget, primaries: u64) -> u64 {
    let by_ratio = primaries.saturating_mul(u64::from(budget.ratio_permille)) / 1000;
    let floor = u64::from(budget.min_per_second).saturating_mul(budget.window_ns) / NANOS_PER_SEC;
    by_ratio.saturating_add(floor)
}

impl Window {
    fn in_window(b: &Bucket, current: u64) -> bool {
        b.index != 0 && b.index <= current && current - b.index < BUCKETS as u64
    }

    /// Totals over the buckets `(current − 10, current]`.
    pub fn totals(&self, current: u64) -> Totals {
        self.buckets
            .iter()
            .filter(|b| Window::in_window(b, current))
            .fold(Totals::default(), |t, b| Totals {
                primaries: t.primaries.saturating_add(u64::from(b.primaries)),
                retries: t.retries.saturating_add(u64::from(b.retries)),
            })
    }

    /// The bucket of `current`, emptied if it held an older index.
    pub fn bucket_mut(&mut self, current: u64) -> Option<&mut Bucket> {
        let i = usize::try_from(current % BUCKETS as u64).unwrap_or(0);
        let b = self.buckets.get_mut(i)?;
        if b.index != current {
            *b = Bucket {
                index: current,
                ..Bucket::default()
            };
        }
        Some(b)
    }

    /// The oldest in-window bucket holding a retry.
    fn oldest_retry(&self, current: u64) -> Option<u64> {
        self.buckets
            .iter()
            .filter(|b| Window::in_window(b, current) && b.retries > 0)
            .map(|b| b.index)
            .min()
    }

    fn decode(records: Option<&Records<'_>>) -> Window {
        let state = records.and_then(|rs| rs.iter().find(|r| r.kind == kind::RETRY_BUDGET).map(|r| r.state));
        let mut w = Window::default();
        let Some(state) = state else { return w };
        let mut r = Reader(state);
        if r.u8() != Some(FORMAT) {
            return w;
        }
        for b in &mut w.buckets {
            let (Some(index), Some(primaries), Some(retries)) = (r.u64(), r.u32(), r.u32()) else {
                return Window::default();
            };
            *b = Bucket {
                index,
                primaries,
                retries,
            };
        }
        w
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.push(1);
        push_record_with(out, 0, kind::RETRY_BUDGET, 0, 0, |o| {
            o.push(FORMAT);
            for b in &self.buckets {
                o.extend_from_slice(&b.index.to_le_bytes());
                o.extend_from_slice(&b.primaries.to_le_bytes());
                o.extend_from_slice(&b.retries.to_le_bytes());
            }
        });
    }
}

/// A budget's entry is never reclaimed (it is a fixed entry).
const INSERT: Reach<'static> = Reach::Insert {
    is_idle: &|_, _| false,
};

/// Why a retry was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryRefusal {
    /// `retry_budget`, or `contention` / `state_unavailable`.
    pub reason: Reason,
    /// When the budget has room again without new primaries (≥ 1).
    pub retry_after_secs: u64,
    /// The window's counts at the decision.
    pub totals: Totals,
}

fn failure_reason(f: Failure) -> Reason {
    match f {
        Failure::Exhausted => Reason::Contention,
        _ => Reason::StateUnavailable,
    }
}

/// A worker's primary requests not yet in shared data, per budget key.
#[derive(Debug, Default)]
pub struct Primaries {
    pending: HashMap<String, Pending>,
    buffers: table::Buffers,
}

#[derive(Debug, Clone, Copy, Default)]
struct Pending {
    count: u64,
    bucket_ns: u64,
}

impl Primaries {
    /// Counts a primary request admitted to a budget's dependency: memory
    /// only.
    pub fn note(&mut self, budget: &RetryBudget) {
        let bucket_ns = bucket_ns(budget);
        match self.pending.get_mut(budget.key.as_str()) {
            Some(p) => {
                p.count = p.count.saturating_add(1);
                p.bucket_ns = bucket_ns;
            }
            None => {
                self.pending
                    .insert(budget.key.clone(), Pending { count: 1, bucket_ns });
            }
        }
    }

    /// This worker's primaries not folded yet (tests and stats).
    pub fn pending(&self, key: &str) -> u64 {
        self.pending.get(key).map_or(0, |p| p.count)
    }

    /// On the tick: adds each pending count to its budget's current
    /// bucket; a count that could not be written stays pending.
    pub fn fold<H: Host>(&mut self, host: &H, now: u64) {
        let Primaries { pending, buffers } = self;
        for (key, p) in pending.iter_mut().filter(|(_, p)| p.count > 0) {
            let current = now / p.bucket_ns.max(1);
            let add = u32::try_from(p.count).unwrap_or(u32::MAX);
            let done = table::update(
                host,
                &Place::Fixed { key },
                &INSERT,
                now,
                buffers,
                |records, out| {
                    let mut w = Window::decode(records);
                    if let Some(b) = w.bucket_mut(current) {
                        b.primaries = b.primaries.saturating_add(add);
                    }
                    w.encode(out);
                    (Commit::Write, ())
                },
            );
            if matches!(done, Ok(u) if u.written) {
                p.count = p.count.saturating_sub(u64::from(add));
            }
        }
        pending.retain(|_, p| p.count > 0);
    }

    /// Admits a retry within `budget` (one update, which also folds this
    /// worker's pending primaries of the budget).
    pub fn take_retry<H: Host>(
        &mut self,
        host: &H,
        budget: &RetryBudget,
        now: u64,
    ) -> Result<Totals, RetryRefusal> {
        let bucket_ns = bucket_ns(budget);
        let current = now / bucket_ns;
        let mine = self.pending(&budget.key);
        let add = u32::try_from(mine).unwrap_or(u32::MAX);
        let updated = table::update(
            host,
            &Place::Fixed { key: &budget.key },
            &INSERT,
            now,
            &mut self.buffers,
            |records, out| {
                let mut w = Window::decode(records);
                if let Some(b) = w.bucket_mut(current) {
                    b.primaries = b.primaries.saturating_add(add);
                }
                let totals = w.totals(current);
                if totals.retries >= allowed(budget, totals.primaries) {
                    let until = w.oldest_retry(current).map_or(bucket_ns, |oldest| {
                        oldest
                            .saturating_add(BUCKETS as u64)
                            .saturating_mul(bucket_ns)
                            .saturating_sub(now)
                    });
                    let secs = until.div_ceil(NANOS_PER_SEC).max(1);
                    // The folded primaries are written anyway: best effort.
                    w.encode(out);
                    let commit = if add > 0 { Commit::BestEffort } else { Commit::Skip };
                    return (commit, Err((secs, totals)));
                }
                if let Some(b) = w.bucket_mut(current) {
                    b.retries = b.retries.saturating_add(1);
                }
                w.encode(out);
                (
                    Commit::Write,
                    Ok(Totals {
                        retries: totals.retries.saturating_add(1),
                        ..totals
                    }),
                )
            },
        );
        match updated {
            Ok(u) => {
                if u.written {
                    if let Some(p) = self.pending.get_mut(budget.key.as_str()) {
                        p.count = p.count.saturating_sub(u64::from(add));
                    }
                }
                u.result.map_err(|(retry_after_secs, totals)| RetryRefusal {
                    reason: Reason::RetryBudget,
                    retry_after_secs,
                    totals,
                })
            }
            Err(f) => Err(RetryRefusal {
                reason: failure_reason(f),
                retry_after_secs: 1,
                totals: Totals::default(),
            }),
        }
    }
}

/// The window's counts node-wide, as shared data says at `now` (the
/// amplification gauge). `None`: shared data could not be read.
pub fn totals<H: Host>(host: &H, budget: &RetryBudget, now: u64) -> Option<Totals> {
    let (value, _) = host.shared_get(&budget.key).ok()?;
    let Some(value) = value else {
        return Some(Totals::default());
    };
    let slots = table::decode_entry(&value)?;
    let records = slots.first().and_then(|s| table::decode_records(s.records));
    Some(Window::decode(records.as_ref()).totals(now / bucket_ns(budget)))
}

#[cfg(test)]
#[path = "retry_tests.rs"]
mod tests;
