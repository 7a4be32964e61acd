//! Stream-end signals: what the upstream of a dependency did, per short
//! window, node-wide. The adaptive controller ([`super::controller`]) and
//! the circuit breaker run on the [`WindowSummary`] of each closed window.
//!
//! # What is recorded
//! The glue records one [`Outcome`] per stream that held a slot of the
//! dependency, at its end, into its worker's [`Windows`] (memory only: no
//! hostcall). Its `latency_ns` runs from the slot taken (the request's
//! headers, or the instant a queue admitted it: queue time is not the
//! upstream's) to the **response's headers** (the stream's end when none
//! came): the upstream's time to answer, which a slow client reading a large
//! body cannot stretch. Its [`OutcomeKind`]:
//! * `Success`: the upstream answered below 500;
//! * `Error`: the upstream answered 5xx (not 504), reset the stream, refused
//!   or failed the connection, or had no healthy host;
//! * `Timeout`: the upstream did not answer in time (Envoy's route timeout,
//!   or a 504 from the upstream itself);
//! * `NotCounted`: tenantgate's own local replies, other filters' 5xx
//!   local replies, and client resets before any answer: none of them says
//!   anything about the upstream. (The glue reads Envoy's
//!   `response.code_details` only for a 5xx or a stream without response
//!   headers, so a local reply below 500 by a filter after tenantgate
//!   counts as a success: a misconfiguration's cost, not a signal lost.) (Client retries are ordinary requests
//!   here: a retry is counted by what its upstream did, never as a signal
//!   of its own.)
//!
//! # The window
//! Windows are wall-clock aligned: window `i` of a dependency with window
//! length `w` is `[i·w, (i+1)·w)`. A worker's [`Tally`] carries the index of
//! its newest sample; on its tick ([`Windows::tick`]) the worker folds the
//! tally into the node-wide entry `tg2|w|<dep>` through
//! [`crate::table::update`]: the entry holds the open window `W` and the
//! next one, and a tally of index `≤ W` joins `W`, of index `W + 1` joins
//! the next. Once `now ≥ (W+1)·w + `[`GRACE_NS`], the first worker whose
//! compare-and-swap lands **closes** `W` (the next window becomes the open
//! one) and gets its [`WindowSummary`]; exactly one worker gets each
//! summary (its write is the one that moved `W`). An idle dependency still
//! closes its windows (with no samples) on the first tick after each end,
//! so the controller sees idle windows as such.
//!
//! # Bounds
//! * **Late workers count in the next window**: a tally folded after its
//!   window closed (a tick more than [`GRACE_NS`] late, a sample merged into
//!   a newer tally) joins the open window. Nothing is counted twice: a tally
//!   is cleared once its fold is written.
//! * **A dead worker's part is simply absent**: what it had not folded is
//!   lost, at most one tick (10 ms) of its samples.
//! * A fold that fails (shared data down, 16 conflicts) keeps the tally in
//!   memory for the next tick; a tally is bounded (counts saturate).
//! * **Percentiles**: latencies are counted in [`BUCKETS`] fixed log-linear
//!   buckets (8 per power of two, from 1 µs to [`MAX_LATENCY_US`] µs, about
//!   134 s; longer ones count in the top bucket): a bucket is 12.5 % wide,
//!   its midpoint within **±6.25 %** of any latency in it (exact below
//!   8 µs). A percentile is interpolated by rank inside its bucket
//!   ([`Tally::quantile_ns`]): within one bucket width (12.5 %) of the
//!   true sample percentile. The minimum is exact (nanoseconds).
//! * p95 counts successes and timeouts (a timeout is the overload signal),
//!   not errors: a fast failure (connection refused) would look like spare
//!   capacity. The minimum counts successes only.
//!
//! # Sizes
//! A [`Tally`] is 840 bytes (the buckets are `u32`s); a worker keeps one
//! per dependency with a window. The entry's record is [`ENTRY_STATE_LEN`]
//! (1,705) bytes, one fixed shared-data key per dependency. A worker makes
//! one read and one compare-and-swap per tick and dependency while it has
//! samples, and only at a window's end while it has none.
//!
//! Pure: time is `now`, the host is [`Host`].

use hashbrown::HashMap;

use crate::host::Host;
use crate::keys::kind;
use crate::table::{self, push_record_with, Commit, Failure, Place, Reach, Record, Records};

/// How long after a window's end the workers' folds still join it, before
/// one of them closes it: five ticks of 10 ms.
pub const GRACE_NS: u64 = 50_000_000;
/// Latency buckets: exact below 8 µs, then 8 per power of two.
pub const BUCKETS: usize = 8 + 24 * 8;
/// Latencies at or above this many microseconds count in the top bucket.
pub const MAX_LATENCY_US: u64 = 1 << 27;
const WINDOW_NAME_HASH: u32 = 0x0000_1f18;
const VERSION: u8 = 1;
const NANOS_PER_US: u64 = 1_000;
/// Bytes of an encoded [`Tally`].
const TALLY_LEN: usize = 4 * 4 + 8 + 8 + 4 + 4 + 4 * BUCKETS;
/// Bytes of the window record's state: version, window length, open index,
/// windows closed, two tallies.
pub const ENTRY_STATE_LEN: usize = 1 + 8 + 8 + 8 + 2 * TALLY_LEN;

/// The shared-data key of a dependency's window entry.
pub fn window_key(dependency: &str) -> String {
    crate::keys::window(dependency)
}

/// What the upstream did for one stream (see the module header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutcomeKind {
    Success,
    Error,
    Timeout,
    NotCounted,
}

/// One stream's end, as the glue records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// From the slot taken to the response's headers (or the stream's end).
    pub latency_ns: u64,
    pub kind: OutcomeKind,
    /// The dependency's live slots node-wide when this stream took its
    /// slot, itself included ([`super::Ticket::in_flight`] + 1): the
    /// controller raises a limit only when it was used.
    pub in_flight: u32,
}

/// Envoy's `response.code_details` and the response status, classified
/// (see the module header). `details`: `None` when Envoy gave none;
/// `status`: `None` when no response headers came; `local`: tenantgate
/// answered the stream itself.
pub fn classify(details: Option<&str>, status: Option<u32>, local: bool) -> OutcomeKind {
    if local {
        return OutcomeKind::NotCounted;
    }
    let by_status = |status: Option<u32>| match status {
        None => OutcomeKind::NotCounted,
        Some(504) => OutcomeKind::Timeout,
        Some(s) if s >= 500 => OutcomeKind::Error,
        Some(_) => OutcomeKind::Success,
    };
    let Some(d) = details else {
        return by_status(status);
    };
    if d == "via_upstream" {
        by_status(status)
    } else if d.starts_with("upstream_response_timeout") || d.starts_with("upstream_per_try_timeout") {
        OutcomeKind::Timeout
    } else if d.starts_with("upstream_reset")
        || d.starts_with("no_healthy_upstream")
        || d.starts_with("upstream_max_stream_duration_reached")
        || d.starts_with("overload_manager")
        || d.starts_with("maintenance_mode")
    {
        OutcomeKind::Error
    } else {
        // Client resets (`downstream_*`, `client_*`), other filters' local
        // replies (`direct_response`, `route_not_found`, …).
        OutcomeKind::NotCounted
    }
}

/// The bucket of a latency (see the module header).
pub fn bucket_of(latency_ns: u64) -> usize {
    let us = (latency_ns / NANOS_PER_US).min(MAX_LATENCY_US - 1);
    if us < 8 {
        return us as usize;
    }
    let e = 63 - us.leading_zeros() as usize; // ≥ 3
    let mantissa = ((us >> (e - 3)) & 7) as usize;
    (8 + (e - 3) * 8 + mantissa).min(BUCKETS - 1)
}

/// A bucket's bounds `[low, high)`, in nanoseconds.
pub fn bucket_bounds_ns(bucket: usize) -> (u64, u64) {
    if bucket < 8 {
        let low = bucket as u64 * NANOS_PER_US;
        return (low, low + NANOS_PER_US);
    }
    let e = (bucket - 8) / 8 + 3;
    let mantissa = ((bucket - 8) % 8) as u64;
    let width = 1u64 << (e - 3);
    let low = (8 + mantissa) << (e - 3);
    (
        low.saturating_mul(NANOS_PER_US),
        low.saturating_add(width).saturating_mul(NANOS_PER_US),
    )
}

/// A bucket's representative latency (its midpoint), in nanoseconds.
pub fn bucket_value_ns(bucket: usize) -> u64 {
    if bucket < 8 {
        return bucket as u64 * NANOS_PER_US + NANOS_PER_US / 2;
    }
    let e = (bucket - 8) / 8 + 3;
    let mantissa = ((bucket - 8) % 8) as u64;
    let width = 1u64 << (e - 3);
    let low = (8 + mantissa) << (e - 3);
    low.saturating_mul(NANOS_PER_US)
        .saturating_add(width.saturating_mul(NANOS_PER_US) / 2)
}

/// Samples of one window (a worker's, or the node's sum of them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tally {
    pub successes: u32,
    pub errors: u32,
    pub timeouts: u32,
    pub not_counted: u32,
    /// The least success latency (`u64::MAX`: none).
    pub min_ns: u64,
    /// The oldest queued request's age seen.
    pub oldest_queue_ns: u64,
    /// The most slots in flight any recorded stream saw when it took its.
    pub peak_in_flight: u32,
    /// Requests refused a slot of the dependency for its limit
    /// (`concurrency_limit`, `queue_full`, `queue_timeout`): demand the
    /// limit did not let through.
    pub refused: u32,
    /// Successes and timeouts by latency bucket ([`bucket_of`]).
    pub buckets: [u32; BUCKETS],
}

impl Default for Tally {
    fn default() -> Tally {
        Tally {
            successes: 0,
            errors: 0,
            timeouts: 0,
            not_counted: 0,
            min_ns: u64::MAX,
            oldest_queue_ns: 0,
            peak_in_flight: 0,
            refused: 0,
            buckets: [0; BUCKETS],
        }
    }
}

impl Tally {
    pub fn is_empty(&self) -> bool {
        *self == Tally::default()
    }

    /// Streams that are health signals: successes, errors, timeouts.
    pub fn completed(&self) -> u32 {
        self.successes
            .saturating_add(self.errors)
            .saturating_add(self.timeouts)
    }

    pub fn add(&mut self, o: Outcome) {
        let counted = match o.kind {
            OutcomeKind::Success => {
                self.min_ns = self.min_ns.min(o.latency_ns);
                &mut self.successes
            }
            OutcomeKind::Timeout => &mut self.timeouts,
            OutcomeKind::Error => &mut self.errors,
            OutcomeKind::NotCounted => &mut self.not_counted,
        };
        *counted = counted.saturating_add(1);
        self.peak_in_flight = self.peak_in_flight.max(o.in_flight);
        if matches!(o.kind, OutcomeKind::Success | OutcomeKind::Timeout) {
            if let Some(b) = self.buckets.get_mut(bucket_of(o.latency_ns)) {
                *b = b.saturating_add(1);
            }
        }
    }

    pub fn merge(&mut self, other: &Tally) {
        self.successes = self.successes.saturating_add(other.successes);
        self.errors = self.errors.saturating_add(other.errors);
        self.timeouts = self.timeouts.saturating_add(other.timeouts);
        self.not_counted = self.not_counted.saturating_add(other.not_counted);
        self.min_ns = self.min_ns.min(other.min_ns);
        self.oldest_queue_ns = self.oldest_queue_ns.max(other.oldest_queue_ns);
        self.peak_in_flight = self.peak_in_flight.max(other.peak_in_flight);
        self.refused = self.refused.saturating_add(other.refused);
        for (a, b) in self.buckets.iter_mut().zip(other.buckets.iter()) {
            *a = a.saturating_add(*b);
        }
    }

    /// The latency at quantile `q` (0–1] of the bucketed samples: in the
    /// bucket of that rank, interpolated linearly by rank inside it (so the
    /// estimate moves smoothly with the samples, not in 12.5 % steps);
    /// `None` without samples. It lies in the true quantile's bucket: at
    /// most one bucket width (12.5 %) from it, and within ±6.25 % when the
    /// samples of the bucket sit at its middle.
    pub fn quantile_ns(&self, q: f64) -> Option<u64> {
        let n: u64 = self.buckets.iter().map(|&b| u64::from(b)).sum();
        if n == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0u64;
        for (i, &b) in self.buckets.iter().enumerate() {
            let before = seen;
            seen = seen.saturating_add(u64::from(b));
            if seen >= rank {
                let (low, high) = bucket_bounds_ns(i);
                // The rank's place among the bucket's samples, at their
                // midpoints: (k − ½) / count.
                let at = ((rank - before) as f64 - 0.5) / f64::from(b.max(1));
                return Some(low.saturating_add(((high - low) as f64 * at) as u64));
            }
        }
        None
    }

    fn encode(&self, out: &mut Vec<u8>) {
        for n in [self.successes, self.errors, self.timeouts, self.not_counted] {
            out.extend_from_slice(&n.to_le_bytes());
        }
        out.extend_from_slice(&self.min_ns.to_le_bytes());
        out.extend_from_slice(&self.oldest_queue_ns.to_le_bytes());
        out.extend_from_slice(&self.peak_in_flight.to_le_bytes());
        out.extend_from_slice(&self.refused.to_le_bytes());
        for b in &self.buckets {
            out.extend_from_slice(&b.to_le_bytes());
        }
    }

    fn decode(r: &mut table::layout::Reader<'_>) -> Option<Tally> {
        let mut t = Tally {
            successes: r.u32()?,
            errors: r.u32()?,
            timeouts: r.u32()?,
            not_counted: r.u32()?,
            min_ns: r.u64()?,
            oldest_queue_ns: r.u64()?,
            peak_in_flight: r.u32()?,
            refused: r.u32()?,
            ..Tally::default()
        };
        for b in t.buckets.iter_mut() {
            *b = r.u32()?;
        }
        Some(t)
    }
}

/// A closed window, node-wide: what the controller and the breaker read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowSummary {
    /// The window's index (`start_ns / window_ns`).
    pub index: u64,
    pub start_ns: u64,
    pub window_ns: u64,
    /// Successes, errors and timeouts (the health signals).
    pub completed: u32,
    pub successes: u32,
    pub errors: u32,
    pub timeouts: u32,
    /// Streams that were not health signals (see [`OutcomeKind::NotCounted`]).
    pub not_counted: u32,
    /// p95 of successes and timeouts (`None`: none).
    pub p95_ns: Option<u64>,
    /// The least success latency (`None`: no success).
    pub min_ns: Option<u64>,
    /// The oldest queued request's age any worker reported in it.
    pub oldest_queue_ns: u64,
    /// The most slots in flight a stream of it saw (see [`Outcome::in_flight`]).
    pub peak_in_flight: u32,
    /// Requests refused for the dependency's limit (see [`Tally::refused`]).
    pub refused: u32,
}

impl WindowSummary {
    /// Errors and timeouts per completed stream, in [0, 1] (0 when idle).
    pub fn error_rate(&self) -> f64 {
        if self.completed == 0 {
            return 0.0;
        }
        f64::from(self.errors.saturating_add(self.timeouts)) / f64::from(self.completed)
    }

    fn of(index: u64, window_ns: u64, t: &Tally) -> WindowSummary {
        WindowSummary {
            index,
            start_ns: index.saturating_mul(window_ns),
            window_ns,
            completed: t.completed(),
            successes: t.successes,
            errors: t.errors,
            timeouts: t.timeouts,
            not_counted: t.not_counted,
            p95_ns: t.quantile_ns(0.95),
            min_ns: (t.min_ns != u64::MAX).then_some(t.min_ns),
            oldest_queue_ns: t.oldest_queue_ns,
            peak_in_flight: t.peak_in_flight,
            refused: t.refused,
        }
    }
}

/// The node-wide entry's decoded state.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    window_ns: u64,
    /// The open window.
    open: u64,
    /// Windows closed so far (for tests and stats).
    closed: u64,
    current: Tally,
    next: Tally,
}

impl Entry {
    fn fresh(window_ns: u64, now: u64) -> Entry {
        Entry {
            window_ns,
            open: now / window_ns,
            closed: 0,
            current: Tally::default(),
            next: Tally::default(),
        }
    }

    /// When the open window may be closed.
    fn closes_at(&self) -> u64 {
        self.open
            .saturating_add(1)
            .saturating_mul(self.window_ns)
            .saturating_add(GRACE_NS)
    }

    fn decode(records: Option<&Records<'_>>) -> Option<Entry> {
        let record: Record<'_> = records?.iter().find(|r| r.kind == kind::WINDOW).copied()?;
        let mut r = table::layout::Reader(record.state);
        if r.u8()? != VERSION {
            return None;
        }
        let e = Entry {
            window_ns: r.u64()?,
            open: r.u64()?,
            closed: r.u64()?,
            current: Tally::decode(&mut r)?,
            next: Tally::decode(&mut r)?,
        };
        (r.is_empty() && e.window_ns > 0).then_some(e)
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.push(1);
        push_record_with(out, WINDOW_NAME_HASH, kind::WINDOW, 0, 0, |o| {
            o.reserve(ENTRY_STATE_LEN);
            o.push(VERSION);
            o.extend_from_slice(&self.window_ns.to_le_bytes());
            o.extend_from_slice(&self.open.to_le_bytes());
            o.extend_from_slice(&self.closed.to_le_bytes());
            self.current.encode(o);
            self.next.encode(o);
        });
    }

    /// Closes the open window if it is due (see the module header).
    fn close_due(&mut self, now: u64) -> Option<WindowSummary> {
        if now < self.closes_at() {
            return None;
        }
        let summary = WindowSummary::of(self.open, self.window_ns, &self.current);
        let next = std::mem::take(&mut self.next);
        self.current = next;
        // After an idle gap the open window is the one `now` is in (less
        // the grace); what the old next held joins it (late).
        self.open = self
            .open
            .saturating_add(1)
            .max(now.saturating_sub(GRACE_NS) / self.window_ns);
        self.closed = self.closed.saturating_add(1);
        Some(summary)
    }

    fn fold(&mut self, index: u64, tally: &Tally) {
        if index > self.open {
            self.next.merge(tally);
        } else {
            self.current.merge(tally);
        }
    }
}

/// The reach of window entries: a fixed key.
const FIXED: Reach<'static> = Reach::Insert {
    is_idle: &|_, _| false,
};

/// Creates a dependency's window entry if it is absent (on configure,
/// before any request: shared data has no create-if-absent, see
/// [`super::Worker::prepare`]).
pub fn prepare<H: Host>(host: &H, dependency: &str, window_ns: u64, now: u64) {
    let key = window_key(dependency);
    let window_ns = window_ns.max(1);
    let mut buffers = table::Buffers::default();
    let _ = table::update(
        host,
        &Place::Fixed { key: &key },
        &FIXED,
        now,
        &mut buffers,
        |records, out| {
            if Entry::decode(records).is_some() {
                return (Commit::Skip, ());
            }
            Entry::fresh(window_ns, now).write(out);
            (Commit::BestEffort, ())
        },
    );
}

/// What one dependency's tick did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ticked {
    /// The window this worker closed (exactly one worker gets each).
    pub closed: Option<WindowSummary>,
    /// The fold or close failed; the tally is kept for the next tick.
    pub failed: Option<Failure>,
    /// When this tick folded samples: the node-wide counts of the windows
    /// not closed yet, right after the fold (the circuit breaker judges
    /// them early, see [`super::breaker`]).
    pub running: Option<Running>,
}

/// Node-wide health signals not yet in a closed window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Running {
    /// Successes, errors and timeouts.
    pub completed: u64,
    /// Errors and timeouts.
    pub failures: u64,
}

impl Running {
    fn of(tallies: [&Tally; 2]) -> Running {
        let mut r = Running::default();
        for t in tallies {
            r.completed = r.completed.saturating_add(u64::from(t.completed()));
            r.failures = r
                .failures
                .saturating_add(u64::from(t.errors))
                .saturating_add(u64::from(t.timeouts));
        }
        r
    }
}

/// One dependency's samples in a worker.
#[derive(Debug, Clone, Default)]
struct Pending {
    /// The index of the newest sample in `tally`.
    index: u64,
    tally: Tally,
    /// The next close instant, as this worker last read the entry
    /// (0: unknown, read on the next tick).
    closes_at: u64,
    /// The window length `closes_at` is of.
    window_ns: u64,
}

/// A worker VM's windows, by dependency name (one per VM).
#[derive(Debug, Default)]
pub struct Windows {
    pending: HashMap<String, Pending>,
    buffers: table::Buffers,
}

impl Windows {
    /// Records one stream's end (memory only).
    pub fn record(&mut self, dependency: &str, window_ns: u64, outcome: Outcome, now: u64) {
        self.with(dependency, window_ns, now, |t| t.add(outcome));
    }

    /// Notes a request refused a slot for the dependency's limit (memory
    /// only).
    pub fn note_refused(&mut self, dependency: &str, window_ns: u64, now: u64) {
        self.with(dependency, window_ns, now, |t| {
            t.refused = t.refused.saturating_add(1)
        });
    }

    /// Notes the age of this worker's oldest queued request for the
    /// dependency (the glue calls it on its tick; memory only).
    pub fn note_queue_age(&mut self, dependency: &str, window_ns: u64, age_ns: u64, now: u64) {
        if age_ns == 0 {
            return;
        }
        self.with(dependency, window_ns, now, |t| {
            t.oldest_queue_ns = t.oldest_queue_ns.max(age_ns)
        });
    }

    fn with(&mut self, dependency: &str, window_ns: u64, now: u64, f: impl FnOnce(&mut Tally)) {
        let index = now / window_ns.max(1);
        let p = match self.pending.get_mut(dependency) {
            Some(p) => p,
            None => self.pending.entry(dependency.to_owned()).or_default(),
        };
        // A tally spanning two windows counts in the newer one (late).
        p.index = p.index.max(index);
        f(&mut p.tally);
    }

    /// The samples not folded yet (tests and stats).
    pub fn pending(&self, dependency: &str) -> Option<&Tally> {
        self.pending.get(dependency).map(|p| &p.tally)
    }

    /// On the tick, per dependency with a window: folds this worker's
    /// samples into the node-wide entry and closes the open window if it is
    /// due (see the module header). One read and one compare-and-swap when
    /// there is something to do; nothing when there is not.
    pub fn tick<H: Host>(&mut self, host: &H, dependency: &str, window_ns: u64, now: u64) -> Ticked {
        let window_ns = window_ns.max(1);
        let (index, empty, closes_at) = match self.pending.get(dependency) {
            Some(p) if p.window_ns == window_ns => (p.index, p.tally.is_empty(), p.closes_at),
            Some(p) => (p.index, p.tally.is_empty(), 0),
            None => (0, true, 0),
        };
        if empty && closes_at != 0 && now < closes_at {
            return Ticked::default();
        }
        let empty_tally = Tally::default();
        let tally = self.pending.get(dependency).map_or(&empty_tally, |p| &p.tally);
        let key = window_key(dependency);
        let updated = table::update(
            host,
            &Place::Fixed { key: &key },
            &FIXED,
            now,
            &mut self.buffers,
            |records, out| {
                // A changed window length starts over.
                let existing = Entry::decode(records).filter(|e| e.window_ns == window_ns);
                let fresh = existing.is_none();
                let mut entry = existing.unwrap_or_else(|| Entry::fresh(window_ns, now));
                let closed = entry.close_due(now);
                if !empty {
                    entry.fold(index, tally);
                }
                let closes_at = entry.closes_at();
                if closed.is_none() && empty && !fresh {
                    return (Commit::Skip, (None, closes_at, None));
                }
                let running = (!empty).then(|| Running::of([&entry.current, &entry.next]));
                entry.write(out);
                (Commit::Write, (closed, closes_at, running))
            },
        );
        match updated {
            Ok(u) => {
                let (closed, closes_at, running) = u.result;
                if let Some(p) = self.pending.get_mut(dependency) {
                    p.closes_at = closes_at;
                    p.window_ns = window_ns;
                    if u.written {
                        p.tally = Tally::default();
                    }
                } else {
                    self.pending.insert(
                        dependency.to_owned(),
                        Pending {
                            closes_at,
                            window_ns,
                            ..Pending::default()
                        },
                    );
                }
                Ticked {
                    closed: if u.written { closed } else { None },
                    failed: None,
                    running: if u.written { running } else { None },
                }
            }
            Err(f) => {
                if let Some(p) = self.pending.get_mut(dependency) {
                    p.closes_at = 0;
                }
                Ticked {
                    closed: None,
                    failed: Some(f),
                    running: None,
                }
            }
        }
    }

    /// Forgets dependencies no longer in `keep` (after a reload).
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.pending.retain(|name, _| keep(name));
    }
}

/// The open window's index and the windows closed so far, as shared data
/// says (tests and stats). `None`: no readable entry.
pub fn open_window<H: Host>(host: &H, dependency: &str) -> Option<(u64, u64)> {
    let (value, _) = host.shared_get(&window_key(dependency)).ok()?;
    let value = value?;
    let slots = table::decode_entry(&value)?;
    let records = slots.first().and_then(|s| table::decode_records(s.records));
    Entry::decode(records.as_ref()).map(|e| (e.open, e.closed))
}

#[cfg(test)]
mod tests;
