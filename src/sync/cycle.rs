//! One node's report cycle ([`SyncState`]): when a report is due, the one
//! in flight and its immediate retry, the answer being applied, and the
//! circuit breaker on the callout. The glue keeps it in shared data
//! ([`super::stored`]); the allowances it reports on are [`super::node`]'s.
//!
//! # Circuit breaker
//! [`SyncState`] also holds the node's breaker on the callout (the glue
//! keeps it in shared data, so every worker agrees). A **failure** is any
//! report that did not end in an applied answer: the callout could not be
//! made (unknown cluster), failed (refused, reset, no healthy host), timed
//! out, answered late, with a status other than 200, or with a body that is
//! not an answer to it (a report and its immediate retry, [`Retry`], count
//! as one). After [`BreakerConfig::failures`] failures in a
//! row the breaker **opens**: no report is started until a backoff has
//! passed since the next one was due. The backoff is one interval, doubled
//! with each further failure, at most [`BreakerConfig::max_backoff_ns`].
//! Every interval due meanwhile is **skipped** ([`SyncState::skip`]). The
//! first report due after the backoff is the **probe** (half-open): an
//! applied answer closes the breaker and resets the count, a failure opens
//! it again with the doubled backoff. The breaker never touches leases:
//! they run to their expiry, then the failure mode applies as above.
//!
//!
//! Pure: no clock, no I/O; `now` is the node's wall clock in nanoseconds.

use super::node::{BreakerConfig, FailureMode, NodeView, NANOS_PER_MS};

/// Where the breaker stands at some instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Reports are sent every interval.
    Closed,
    /// No report until the backoff has passed.
    Open,
    /// The backoff has passed: the next report is the probe.
    HalfOpen,
}

/// Why a response was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyError {
    /// It does not answer the report in flight.
    Stale,
    /// It came after the callout timeout.
    Late,
}

/// The report in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlight {
    pub seq: u64,
    /// When it was sent (or, before it is sent, claimed); once hedged,
    /// when its second copy was sent.
    pub sent_at: u64,
    /// A second copy of it (the same `seq` and body) was sent
    /// ([`SyncState::hedge`]).
    pub hedged: bool,
}

/// Where the interval's report stands on its **retry** (see
/// [`SyncState::given_up`]): a report given up on (no answer within the
/// callout timeout, or its callout failed) is sent again at once, once,
/// instead of an interval later, so that one lost message costs a node
/// the callout timeout, not an interval of its leases.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Retry {
    /// Nothing to retry.
    #[default]
    None,
    /// The interval's report was given up on: the next claim sends its
    /// retry at once, without waiting for the interval.
    Due,
    /// The report in flight is that retry: giving it up counts no second
    /// failure and sends no third try before the interval is due.
    InFlight,
}

/// An accepted answer still being applied to key slots, a chunk per
/// worker callback (see [`super::shared`], "Applying an answer"): no
/// report starts meanwhile, so no count is carried by two reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applying {
    /// The report it answers.
    pub seq: u64,
    /// When the answer was received (accepted).
    pub since: u64,
}

/// The node-global half of the state machine: sequence numbers, the
/// report in flight and contact with the service. Plain data, like
/// [`Allowance`](super::Allowance).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncState {
    pub next_seq: u64,
    pub acked_seq: u64,
    pub in_flight: Option<InFlight>,
    /// The sync interval the service asked for (or the configured one).
    pub interval_ns: u64,
    /// Connected while `now` is before this.
    pub contact_until: Option<u64>,
    /// When the last response was applied.
    pub last_applied_at: Option<u64>,
    /// When the last report was started (or its interval skipped while
    /// the breaker was open).
    pub last_report_at: Option<u64>,
    /// Failed reports in a row (reset by an applied answer).
    pub failures: u32,
    /// While the breaker is open: no report starts before this.
    pub open_until: Option<u64>,
    /// The answer a worker is applying, if any.
    pub applying: Option<Applying>,
    /// The interval's report's retry.
    pub retry: Retry,
}

impl SyncState {
    /// `now` seeds `seq`, so it keeps increasing across restarts as long as
    /// the clock does not step back further than the node ran. A starting
    /// node waits one interval (plus the callout timeout) for its first
    /// leases before it counts as cut off.
    pub fn new(now: u64, interval_ns: u64, timeout_ns: u64) -> SyncState {
        let interval_ns = interval_ns.max(NANOS_PER_MS);
        SyncState {
            next_seq: now.max(1),
            acked_seq: 0,
            in_flight: None,
            interval_ns,
            contact_until: Some(now.saturating_add(interval_ns).saturating_add(timeout_ns)),
            last_applied_at: None,
            last_report_at: None,
            failures: 0,
            open_until: None,
            applying: None,
            retry: Retry::None,
        }
    }

    pub fn connected(&self, now: u64) -> bool {
        self.contact_until.is_some_and(|until| now < until)
    }

    /// What decisions need, with the settings that apply to them
    /// (`timeout_ns`: the callout timeout; `max_ttl_ns`: the longest a
    /// lease lasts).
    pub fn view(
        &self,
        mode: FailureMode,
        provisional: u64,
        local_max_ns: u64,
        timeout_ns: u64,
        max_ttl_ns: u64,
        now: u64,
    ) -> NodeView {
        NodeView {
            connected: self.connected(now),
            last_applied_at: self.last_applied_at,
            interval_ns: self.interval_ns,
            mode,
            provisional,
            local_max_ns,
            await_max_ns: self.interval_ns.saturating_mul(2).saturating_add(timeout_ns),
            max_ttl_ns,
        }
    }

    /// Whether an interval has passed since the last report started.
    pub fn due(&self, now: u64) -> bool {
        self.last_report_at
            .is_none_or(|at| now >= at.saturating_add(self.interval_ns))
    }

    /// Starts a report: its `seq`, or `None` while the previous one is in
    /// flight and younger than `timeout_ns`. The flag says whether a
    /// previous report was given up on (timed out).
    pub fn begin_report(&mut self, now: u64, timeout_ns: u64) -> Option<(u64, bool)> {
        let mut timed_out = false;
        if let Some(f) = &self.in_flight {
            if now.saturating_sub(f.sent_at) <= timeout_ns {
                return None;
            }
            self.in_flight = None;
            timed_out = true;
        }
        let seq = self.next_seq;
        self.next_seq = self.next_seq.saturating_add(1);
        self.in_flight = Some(InFlight {
            seq,
            sent_at: now,
            hedged: false,
        });
        self.last_report_at = Some(now);
        self.retry = Retry::None;
        Some((seq, timed_out))
    }

    /// Starts the retry of the report given up on ([`Retry::Due`]): a new
    /// `seq` (a report is never answered twice), sent now, whether or not
    /// an interval has passed; the interval's cadence (`last_report_at`)
    /// stays. `None` when no retry is due or a report is in flight.
    pub fn begin_retry(&mut self, now: u64) -> Option<u64> {
        if self.retry != Retry::Due || self.in_flight.is_some() {
            return None;
        }
        let seq = self.next_seq;
        self.next_seq = self.next_seq.saturating_add(1);
        self.in_flight = Some(InFlight {
            seq,
            sent_at: now,
            hedged: false,
        });
        self.retry = Retry::InFlight;
        Some(seq)
    }

    /// Sends report `seq` a second time, unchanged (see "Hedging" in
    /// [`super::shared`]): only the report in flight, once, when
    /// `hedge_after_ns` has passed since it was sent and no answer is being
    /// applied. Its deadline then counts from the second copy (each copy's
    /// answer is still refused after the callout timeout from its own
    /// sending, by the host). Returns whether it is hedged now.
    pub fn hedge(&mut self, seq: u64, hedge_after_ns: u64, now: u64) -> bool {
        if self.applying.is_some() {
            return false;
        }
        match &mut self.in_flight {
            Some(f) if f.seq == seq && !f.hedged && now.saturating_sub(f.sent_at) >= hedge_after_ns => {
                f.sent_at = now;
                f.hedged = true;
                true
            }
            _ => false,
        }
    }

    /// Gives up on the report in flight (no answer within the callout
    /// timeout, or its callout failed). A report and its retry count as
    /// **one** failure for the breaker: the interval's report counts it
    /// and makes its retry due (unless that opened the breaker); the
    /// retry counts nothing more and the next report waits for the
    /// interval. Returns whether the breaker opened.
    pub fn given_up(&mut self, now: u64, cfg: &BreakerConfig) -> bool {
        self.in_flight = None;
        if self.retry == Retry::InFlight {
            self.retry = Retry::None;
            return false;
        }
        let opened = self.failed(now, cfg);
        self.retry = if opened { Retry::None } else { Retry::Due };
        opened
    }

    /// Takes the report in flight that a response with `ack_seq` answers.
    pub fn accept(&mut self, ack_seq: u64, now: u64, timeout_ns: u64) -> Result<InFlight, ApplyError> {
        let Some(f) = self.in_flight.take_if(|f| f.seq == ack_seq) else {
            return Err(ApplyError::Stale);
        };
        if now.saturating_sub(f.sent_at) > timeout_ns {
            return Err(ApplyError::Late);
        }
        Ok(f)
    }

    /// Records an accepted response: `seq` acknowledged, the interval it
    /// asks for, and contact for the longest lease it granted (at least
    /// three intervals, at most `max_ttl_ns`).
    pub fn applied(&mut self, seq: u64, interval_ms: u64, longest_ttl_ns: u64, max_ttl_ns: u64, now: u64) {
        self.acked_seq = seq;
        self.interval_ns = interval_ms.saturating_mul(NANOS_PER_MS).max(NANOS_PER_MS);
        let contact_ns = self
            .interval_ns
            .saturating_mul(3)
            .min(max_ttl_ns)
            .max(longest_ttl_ns.min(max_ttl_ns));
        self.contact_until = Some(now.saturating_add(contact_ns));
        self.last_applied_at = Some(now);
        self.retry = Retry::None;
        // A success closes the breaker.
        self.failures = 0;
        self.open_until = None;
    }

    /// The breaker at `now`.
    pub fn breaker(&self, now: u64) -> BreakerState {
        match self.open_until {
            None => BreakerState::Closed,
            Some(until) if now < until => BreakerState::Open,
            Some(_) => BreakerState::HalfOpen,
        }
    }

    /// The backoff after `failures` failures in a row: none below the
    /// threshold, then one interval, doubled per further failure, capped.
    pub fn backoff_ns(&self, failures: u32, cfg: &BreakerConfig) -> Option<u64> {
        let beyond = failures.checked_sub(cfg.failures.max(1))?;
        let factor = 1u64.checked_shl(beyond).unwrap_or(u64::MAX);
        Some(self.interval_ns.saturating_mul(factor).min(cfg.max_backoff_ns))
    }

    /// Records that the report started at `last_report_at` failed (it must
    /// no longer be in flight). Returns whether the breaker opened (from
    /// closed, or again after a failed probe): then no report starts
    /// before the next one was due (`last_report_at` + interval) plus the
    /// backoff.
    pub fn failed(&mut self, now: u64, cfg: &BreakerConfig) -> bool {
        self.failures = self.failures.saturating_add(1);
        let Some(backoff) = self.backoff_ns(self.failures, cfg) else {
            return false;
        };
        let due = self
            .last_report_at
            .unwrap_or(now)
            .saturating_add(self.interval_ns);
        self.open_until = Some(due.saturating_add(backoff));
        true
    }

    /// Skips the interval due at `now` because the breaker is open: the
    /// next one is due an interval later.
    pub fn skip(&mut self, now: u64) {
        self.last_report_at = Some(now);
    }
}
