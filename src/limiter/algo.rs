//! A limit's algorithm as the engine uses it: one enum over every algorithm,
//! with the operations the key table needs. Loading a stored record,
//! migrating it when a reload changed the limit, checking a request,
//! encoding the new state, telling whether a state is idle (reclaimable),
//! and refunding a charge.
//!
//! # Stored records
//! A record carries the parameters it was written under (`p1`, `p2`, see
//! [`crate::table::layout`]) and, after the algorithm's state, a [`Stamp`]
//! of 16 bytes: the writing policy's *epoch* and the *write instant* (the
//! writer's `now`; the state is exact as of then). A record without a stamp
//! (written by a version before stamps) reads as epoch 0, write instant
//! unknown.
//!
//! A policy's epoch is its `effective_from` (when its worker loaded it),
//! or 0 while that instant is ahead of `now` (loaded while the clock ran
//! ahead, since corrected: such a policy ranks oldest until the clock
//! catches up, so it can never outrank the policies loaded after it). A
//! stored epoch ahead of `now` (a clock step back, or garbage) ranks 0 too.
//!
//! # Reload rule
//! While workers reload one after the other, and while requests held in a
//! queue under the old policy are charged after the reload, charges under
//! two policies meet on one record. A charge under policy `P` (epoch `E`)
//! reads a record written under other parameters with epoch `E_w`:
//! 1. **The newest policy wins.** If `E_w > E`, the record was written
//!    under a newer policy: the request is checked under the record's
//!    parameters and written back with them and `E_w`. An older policy
//!    never migrates a newer record back (a migration of window counts
//!    loses what the old window length counted; back and forth, it would
//!    forget counts on every round).
//! 2. **Forward, once, never before the write.** Otherwise (`E_w ≤ E`) the
//!    record is migrated to `P`'s parameters as of
//!    `min(now, max(E, write instant, L))`, where `L` is the earliest write
//!    instant the state itself allows (a TAT is never more than `τ` ahead
//!    of its write, a window or log entry never starts after it; a TAT in
//!    debt may be `D·T` further ahead, so `L` may then be up to that much
//!    after the write and the old parameters rule that much longer). It is
//!    never migrated as of an instant before it was written, so no time is
//!    credited twice; the old parameters rule until then, `P`'s after.
//!    Without a write instant (an unstamped record), `now`.
//! 3. A record of another algorithm starts fresh, unless rule 1 applies
//!    (then it is charged under its own algorithm).
//! 4. A record of a limit the charging plan lacks is kept as it is if a
//!    newer policy wrote it ([`Algo::written_by_newer`], applied by the
//!    engine), else dropped: an older policy never resets a limit that only
//!    the newer one has.
//!
//! What a migration does, per algorithm, as of that instant `m`:
//! * token bucket: the bucket keeps its fill level in tokens, capped at the
//!   new burst, and refills at the new rate from `m`. A migration never
//!   adds tokens (the fill level is rounded down). Stored parameters no
//!   version writes (`T = 0`, `τ` not a multiple of `T`) leave it empty at
//!   `m`.
//! * fixed window: the count of the window current at `m` (or of one ahead
//!   of it, which `load` would saturate to it) carries into the new window
//!   current at `m` (a changed window length never opens a fresh window); a
//!   changed limit applies to that count.
//! * sliding window log and counter: the recorded admissions stay as they
//!   are and are read under the new limit and window.
//!
//! # The bound across a reload
//! For charges under two policies `a` and `b` on one key, in any order and
//! any number of rounds (two workers, one not yet reloaded; queued
//! requests), in any `d` consecutive nanoseconds:
//! * token bucket: at most `max(B_a, B_b) + floor(d / min(T_a, T_b))`
//!   admitted, what a bucket with the more generous burst and rate would
//!   admit, and the fill level never exceeds the burst it is checked under.
//!   Why: between two writes the level grows at the rate of one of the two
//!   policies (the writer's up to `m`, which is no earlier than the write,
//!   the charging one's after), is capped at one of the two bursts, and a
//!   conversion never rounds up; so, by induction over the writes, it never
//!   exceeds the level of that more generous bucket. This holds whichever policy
//!   charges, so it needs only rule 2; rule 1 is for the window algorithms.
//! * window algorithms: at most what `a` alone plus what `b` alone would
//!   admit (each algorithm's bound in its module header): the record is
//!   counted under the older parameters until its first charge under the
//!   newer policy, migrated once, then counted under the newer ones by
//!   every charge, old or new.
//!
//! A record's epoch never decreases (a migration writes the charging
//! policy's, higher; every other write keeps the higher of the two), so
//! its parameters change only by migrations, each to a later epoch. With
//! one reload at a time (every worker on the old policy before any loads
//! the new one) a record migrates at most once per reload. Each worker
//! stamps its own load instant, so a worker that loads the old policy after
//! another already loaded the new one outranks it until it reloads too
//! (the old parameters rule meanwhile); in every case a record migrates
//! at most once per worker load, as each migration takes a later epoch. A
//! clock that steps back below a stored epoch makes it rank 0 (above), so
//! during a step back the two policies may migrate a record back and forth
//! again, each time as of its write: the token-bucket bound above still
//! holds, the window bound only per migration.
//!
//! # Why a stamp
//! The state alone bounds its write instant only from below (`L`):
//! migrating as of a lower bound still credits the time between it and the
//! write, and migrating as of `now` always would make a reload take effect
//! on a key only from its next charge (the old rate applying until then).
//! Only the stored write instant is both safe and exact. The epoch is what
//! tells a newer record from an older one, which a write instant cannot (a
//! worker not yet reloaded writes late too). The price is 16 bytes per
//! limit and key: a one-limit key's slot grows from 49 to 65 bytes (see
//! [`crate::table::layout`]), about 115 bytes per key in all against the
//! 128 B target (98.9 B measured before, `docs/operations.md`).
//!
//! Tested through the engine with two workers on one shared store
//! (`src/engine/tests/reload.rs`), at 100/min and 10,000/min, raised and
//! lowered, for every algorithm.

use super::calendar::Month;
use super::fixed_window::{self, FixedWindow};
use super::sliding_window_counter::{self, SlidingWindowCounter};
use super::sliding_window_log::{self, SlidingWindowLog};
use super::token_bucket::{Check, Gcra};
use super::Verdict;
use crate::keys::kind;
use crate::table::Record;

/// A compiled limit's algorithm and parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    TokenBucket(Gcra),
    FixedWindow(FixedWindow),
    SlidingWindowLog(SlidingWindowLog),
    SlidingWindowCounter(SlidingWindowCounter),
}

/// What a reload does to a limit's live state (see [`Algo::carry_from`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carry {
    /// Same algorithm and parameters: the state is used as it is.
    Keeps,
    /// Same algorithm, other parameters: the fill level (count) carries
    /// over, capped at the new burst (limit), as of the reload.
    Migrated,
    /// Another algorithm wrote it: it starts fresh.
    Fresh,
}

/// One limit's state for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// The theoretical arrival time (see [`Gcra`]).
    TokenBucket {
        tat: u64,
    },
    FixedWindow(fixed_window::State),
    SlidingWindowLog(sliding_window_log::State),
    SlidingWindowCounter(sliding_window_counter::State),
}

/// What a limit says about one request (see [`Verdict`]).
pub type Outcome = Verdict<State>;

fn read_u64(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

/// Bytes of the [`Stamp`] after every algorithm's state in a stored record.
pub const STAMP_LEN: usize = 16;

/// Which policy wrote a record, and when (see the module header): the 16
/// bytes after the algorithm's state, two little-endian `u64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// The writing policy's epoch; 0 ranks oldest.
    pub epoch: u64,
    /// The writer's `now`: the state is exact as of this instant.
    pub written_at: u64,
}

impl Stamp {
    /// A record written before stamps: epoch 0, written at an unknown
    /// instant (read as `now`, the latest it can be).
    pub const UNKNOWN: Stamp = Stamp {
        epoch: 0,
        written_at: u64::MAX,
    };
}

/// A policy's epoch at `now`: its `effective_from`, or 0 while that is
/// ahead of `now` (see the module header).
pub fn epoch_of(effective_from: u64, now: u64) -> u64 {
    if effective_from <= now {
        effective_from
    } else {
        0
    }
}

/// Splits a whole stored state into the algorithm's part and its stamp
/// (none: [`Stamp::UNKNOWN`]); any other trailing bytes make it unreadable.
fn stamped<S>(decoded: Option<(S, usize)>, bytes: &[u8]) -> Option<(S, Stamp)> {
    let (state, used) = decoded?;
    let rest = bytes.get(used..)?;
    if rest.is_empty() {
        return Some((state, Stamp::UNKNOWN));
    }
    if rest.len() != STAMP_LEN {
        return None;
    }
    Some((
        state,
        Stamp {
            epoch: read_u64(rest.get(..8)?)?,
            written_at: read_u64(rest.get(8..)?)?,
        },
    ))
}

/// A limit's state as a charge uses it (see [`Algo::load`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Live {
    /// The parameters to check under and to store: the charging limit's,
    /// or a newer policy's that wrote the record (the reload rule).
    pub algo: Algo,
    pub state: State,
    /// The epoch to stamp the record with when it is written.
    pub epoch: u64,
    /// The state differs from what is stored (the caller then persists it,
    /// on a denial too).
    pub changed: bool,
    /// The instant to check, charge and stamp at: the caller's `now`, or
    /// the record's write instant if `now` is a stale reading behind it
    /// (see [`reading`]). Never earlier than the write it follows.
    pub now: u64,
}

/// How far a reading of the clock may lag a record's write instant and
/// still be taken for a **stale reading**, not a clock that stepped back:
/// a worker that read `now`, then waited for a core (more workers than
/// cores) or lost a compare-and-swap to a worker that read the clock
/// later. One second is hundreds of scheduler slices; NTP slews offsets
/// below 128 ms and steps only larger ones.
pub const MAX_STALE_NS: u64 = 1_000_000_000;

/// The instant a charge reads a record at: `now`, or the record's write
/// instant `written_at` when `now` lags it by at most [`MAX_STALE_NS`].
///
/// This is what makes the invariant of the limiter headers hold for any
/// interleaving of workers: **a record's time never runs backwards by a
/// write, so a stale reading can only deny, never admit or create
/// units.** A stale reading taken as it is would find a TAT (a window, a
/// log entry) ahead of it and saturate it, and a denial persists the
/// saturation: the units between the stale and the real clock would be
/// forgiven, once per stale denial (issue 31: 38 units over the bound in
/// 60 s at four workers on two cores). Read at the write instant, every
/// state is exactly as its writer left it, and the writer's instant is
/// no later than the real time of this charge (the writer read the clock
/// before this charge read the record), so charging there is what a
/// limiter would do at some instant the request really lived through.
///
/// A lag beyond [`MAX_STALE_NS`] is a clock that stepped back: the
/// reading is kept and the state saturates (each algorithm's header: at
/// most one refill or window is forgiven), so a step back never blocks a
/// key for the length of the step.
pub fn reading(now: u64, written_at: u64) -> u64 {
    if written_at > now && written_at - now <= MAX_STALE_NS {
        written_at
    } else {
        now
    }
}

fn map<S>(verdict: Verdict<S>, wrap: impl FnOnce(S) -> State) -> Outcome {
    match verdict {
        Verdict::Admit {
            state,
            remaining,
            reset_ns,
        } => Verdict::Admit {
            state: wrap(state),
            remaining,
            reset_ns,
        },
        Verdict::Deny {
            wait_ns,
            remaining,
            reset_ns,
        } => Verdict::Deny {
            wait_ns,
            remaining,
            reset_ns,
        },
    }
}

impl Algo {
    /// A calendar month's limit (`fixed_window`, `per: month`): the month
    /// of `now` in its zone. `None` for every other limit.
    pub fn calendar_month(&self, now: u64) -> Option<Month> {
        match self {
            Algo::FixedWindow(w) => w.calendar_zone().map(|z| z.month_at(now)),
            _ => None,
        }
    }

    pub fn kind(&self) -> u8 {
        match self {
            Algo::TokenBucket(_) => kind::TOKEN_BUCKET,
            Algo::FixedWindow(_) => kind::FIXED_WINDOW,
            Algo::SlidingWindowLog(_) => kind::SLIDING_WINDOW_LOG,
            Algo::SlidingWindowCounter(_) => kind::SLIDING_WINDOW_COUNTER,
        }
    }

    /// The parameters stored beside the state (`p1`, `p2`).
    pub fn params(&self) -> (u64, u64) {
        match self {
            Algo::TokenBucket(g) => (g.interval_ns(), g.tolerance_ns()),
            Algo::FixedWindow(a) => (a.limit(), a.window_ns()),
            Algo::SlidingWindowLog(a) => (a.limit(), a.window_ns()),
            Algo::SlidingWindowCounter(a) => (a.limit(), a.window_ns()),
        }
    }

    /// The most bytes [`Algo::encode`] writes for any state of this limit.
    pub fn max_state_len(&self) -> usize {
        match self {
            Algo::TokenBucket(_) => 8,
            // Two varints.
            Algo::FixedWindow(_) => 20,
            Algo::SlidingWindowLog(a) => a.max_state_len(),
            // A u64 and two varints.
            Algo::SlidingWindowCounter(_) => 28,
        }
    }

    /// The most bytes [`Algo::encode_stored`] writes for any state of
    /// this limit: what a record's state takes in the key table.
    pub fn max_stored_len(&self) -> usize {
        self.max_state_len().saturating_add(STAMP_LEN)
    }

    pub fn fresh(&self) -> State {
        match self {
            Algo::TokenBucket(_) => State::TokenBucket { tat: 0 },
            Algo::FixedWindow(_) => State::FixedWindow(Default::default()),
            Algo::SlidingWindowLog(_) => State::SlidingWindowLog(Default::default()),
            Algo::SlidingWindowCounter(_) => State::SlidingWindowCounter(Default::default()),
        }
    }

    /// Decodes a whole stored state of algorithm `kind` (any parameters)
    /// and its stamp; `None` if another kind or malformed.
    fn decode_stored(kind: u8, bytes: &[u8]) -> Option<(State, Stamp)> {
        match kind {
            kind::TOKEN_BUCKET => {
                let tat = bytes.get(..8).and_then(read_u64);
                stamped(tat.map(|tat| (State::TokenBucket { tat }, 8)), bytes)
            }
            kind::FIXED_WINDOW => {
                stamped(FixedWindow::decode(bytes), bytes).map(|(s, stamp)| (State::FixedWindow(s), stamp))
            }
            kind::SLIDING_WINDOW_LOG => stamped(SlidingWindowLog::decode(bytes), bytes)
                .map(|(s, stamp)| (State::SlidingWindowLog(s), stamp)),
            kind::SLIDING_WINDOW_COUNTER => stamped(SlidingWindowCounter::decode(bytes), bytes)
                .map(|(s, stamp)| (State::SlidingWindowCounter(s), stamp)),
            _ => None,
        }
    }

    /// This limit's state from its stored record (`None`: a new key, or a
    /// new limit: fresh), under the module header's reload rule, for a
    /// charge under a policy that took effect at `effective_from`: a record
    /// of a newer policy is used under its own parameters, an older one is
    /// migrated forward, never as of an instant before its write. Every
    /// algorithm is also normalised for `now`: a clock step backwards is
    /// saturated (a state left ahead of `now` by a clock that ran ahead
    /// keeps what it counted, but waits at most one refill or window from
    /// `now`, not for the clock).
    pub fn load(&self, record: Option<&Record<'_>>, effective_from: u64, now: u64) -> Live {
        let decoded = record.map(|r| (r, Algo::decode_stored(r.kind, r.state)));
        let written_at = match &decoded {
            Some((_, Some((_, stamp)))) => stamp.written_at,
            _ => 0,
        };
        let now = reading(now, written_at);
        let own = epoch_of(effective_from, now);
        let (algo, state, epoch, migrated) = self.resolve(decoded, own, now);
        let (state, saturated) = algo.saturate(state, now);
        Live {
            algo,
            state,
            epoch,
            changed: migrated || saturated,
            now,
        }
    }

    /// Rules 1–3 of the reload rule: the parameters, the state under them
    /// (not yet saturated), the epoch to stamp, and whether the state
    /// differs from the stored one.
    fn resolve(
        &self,
        decoded: Option<(&Record<'_>, Option<(State, Stamp)>)>,
        own: u64,
        now: u64,
    ) -> (Algo, State, u64, bool) {
        let Some((r, decoded)) = decoded else {
            return (*self, self.fresh(), own, false);
        };
        let Some((stored, stamp)) = decoded else {
            return (*self, self.fresh(), own, true);
        };
        // A stamp from the future ranks oldest.
        let theirs = epoch_of(stamp.epoch, now);
        if self.carry_from(r.kind, (r.p1, r.p2)) == Carry::Keeps {
            return (*self, stored, own.max(theirs), false);
        }
        if theirs > own {
            // 1. A newer policy wrote it: its parameters rule.
            if let Some(newer) = Algo::of_record(r) {
                return (newer, stored, theirs, false);
            }
        }
        if r.kind != self.kind() {
            // 3. Another algorithm, no newer: fresh.
            return (*self, self.fresh(), own, true);
        }
        // 2. Forward, as of no earlier than the write.
        let at = own
            .max(stamp.written_at)
            .max(Algo::written_no_earlier_than(r, &stored))
            .min(now);
        let migrated = self.migrate(r, &stored, at);
        let changed = migrated != stored;
        (*self, migrated, own, changed)
    }

    /// Whether `record` was written by a policy newer than one that took
    /// effect at `effective_from` (the reload rule's ranking, at `now`).
    pub fn written_by_newer(record: &Record<'_>, effective_from: u64, now: u64) -> bool {
        Algo::decode_stored(record.kind, record.state)
            .is_some_and(|(_, stamp)| epoch_of(stamp.epoch, now) > epoch_of(effective_from, now))
    }

    /// The earliest instant at which `stored` (under the record's
    /// parameters) can have been written: a TAT runs at most `τ` ahead of
    /// its write; a window, a log entry or a counter's latest admission is
    /// never after it. 0 when the state says nothing.
    fn written_no_earlier_than(r: &Record<'_>, stored: &State) -> u64 {
        match stored {
            // `p2` is `τ` (see `params`).
            State::TokenBucket { tat } => tat.saturating_sub(r.p2),
            State::FixedWindow(s) if s.count > 0 => s.window.saturating_mul(r.p2),
            State::SlidingWindowLog(s) => s.entries().last().map_or(0, |&(ts, _)| ts),
            State::SlidingWindowCounter(s) if s.prev > 0 || s.curr > 0 => s.last_ns,
            _ => 0,
        }
    }

    /// `stored`, written by this algorithm under the record's other
    /// parameters, moved to `self`'s as of `at` (see the module header).
    fn migrate(&self, r: &Record<'_>, stored: &State, at: u64) -> State {
        match (self, stored) {
            (Algo::TokenBucket(g), State::TokenBucket { tat }) => State::TokenBucket {
                tat: match Gcra::from_stored(r.p1, r.p2) {
                    Some(old) => g.migrate_tat(&old, *tat, at),
                    // Unusable stored parameters: be conservative, empty at `at`.
                    None => at.saturating_add(g.tolerance_ns()),
                },
            },
            (Algo::FixedWindow(a), State::FixedWindow(s)) if r.p2 != a.window_ns() => {
                // A new window length: the count of the window current at
                // `at` (or ahead of it) moves into the new window current
                // then. Unusable stored parameters: the count carries.
                let current_then = r.p2 == 0 || s.window >= at / r.p2;
                let count = if current_then { s.count } else { 0 };
                State::FixedWindow(fixed_window::State {
                    window: at / a.window_ns(),
                    count,
                })
            }
            (_, stored) => stored.clone(),
        }
    }

    /// `state` normalised for `now` (a clock step back saturated), and
    /// whether that changed it.
    fn saturate(&self, state: State, now: u64) -> (State, bool) {
        let saturated = match (self, &state) {
            (Algo::TokenBucket(g), State::TokenBucket { tat }) => {
                let s = g.saturate(*tat, now);
                (s != *tat).then_some(State::TokenBucket { tat: s })
            }
            (Algo::FixedWindow(a), State::FixedWindow(s)) => a.saturate(s, now).map(State::FixedWindow),
            (Algo::SlidingWindowLog(a), State::SlidingWindowLog(s)) => {
                a.saturate(s, now).map(State::SlidingWindowLog)
            }
            (Algo::SlidingWindowCounter(a), State::SlidingWindowCounter(s)) => {
                a.saturate(s, now).map(State::SlidingWindowCounter)
            }
            _ => None,
        };
        match saturated {
            Some(s) => (s, true),
            None => (state, false),
        }
    }

    /// Whether `record` is still under this limit's algorithm and
    /// parameters: a give-back of units this limit charged (a refusal later
    /// in the chain, a lease's unspent units, a settled cost below its
    /// estimate) goes only to such a record. Once a reload migrated it
    /// (either way: this policy older or newer), the fill level it carried
    /// over already counts the charge as spent, and units given back to it
    /// would be units the new parameters never held: a lease of 1,000
    /// units taken under 50,000/s, returned to a bucket lowered to burst 50
    /// and drained, would refill it (issue 31). They are dropped instead,
    /// which errs toward admitting less.
    pub fn charged_under(&self, record: &Record<'_>) -> bool {
        self.carry_from(record.kind, (record.p1, record.p2)) == Carry::Keeps
    }

    /// What a reload does to a live state written by a limit of the same
    /// name with `kind` and `params`, when the reloaded policy is the newer
    /// one (what [`Algo::load`] then does with such a record):
    /// [`Carry::Keeps`] it, [`Carry::Migrated`] to the new parameters (never
    /// adding tokens: capped at the new burst or limit), or [`Carry::Fresh`]
    /// (another algorithm wrote it).
    pub fn carry_from(&self, kind: u8, params: (u64, u64)) -> Carry {
        if kind != self.kind() {
            Carry::Fresh
        } else if params == self.params() {
            Carry::Keeps
        } else {
            Carry::Migrated
        }
    }

    /// The `t` of the `RateLimit` field (draft-ietf-httpapi-ratelimit-headers-11),
    /// exact in ns: the longest time from `now` within which no more than
    /// `remaining` units can be used on `state` (as charged, or as found
    /// when the request was refused), that is until one unit more would
    /// fit. With nothing left, the time until the next unit; on a whole
    /// limit (no unit to come back), until a unit used now comes back.
    pub fn quota_window_ns(&self, state: &State, now: u64, remaining: u64) -> u64 {
        match self.check(state, now, remaining.saturating_add(1)) {
            Outcome::Deny { wait_ns, .. } if wait_ns != u64::MAX => wait_ns,
            Outcome::Deny { .. } => match self.check(state, now, 1) {
                Outcome::Admit { state: used, .. } => match self.check(&used, now, remaining) {
                    Outcome::Deny { wait_ns, .. } if wait_ns != u64::MAX => wait_ns,
                    _ => 0,
                },
                Outcome::Deny { .. } => 0,
            },
            Outcome::Admit { .. } => 0,
        }
    }

    pub fn check(&self, state: &State, now: u64, cost: u64) -> Outcome {
        match (self, state) {
            (Algo::TokenBucket(g), State::TokenBucket { tat }) => match g.check(*tat, now, cost) {
                Check::Admit { new_tat, remaining } => Verdict::Admit {
                    state: State::TokenBucket { tat: new_tat },
                    remaining,
                    reset_ns: g.time_to_full_ns(new_tat, now),
                },
                Check::Deny { wait_ns } => Verdict::Deny {
                    wait_ns,
                    remaining: g.available(*tat, now),
                    reset_ns: g.time_to_full_ns(*tat, now),
                },
            },
            (Algo::FixedWindow(a), State::FixedWindow(s)) => map(a.check(s, now, cost), State::FixedWindow),
            (Algo::SlidingWindowLog(a), State::SlidingWindowLog(s)) => {
                map(a.check(s, now, cost), State::SlidingWindowLog)
            }
            (Algo::SlidingWindowCounter(a), State::SlidingWindowCounter(s)) => {
                map(a.check(s, now, cost), State::SlidingWindowCounter)
            }
            // A state of another algorithm: `load` never returns one.
            _ => self.check(&self.fresh(), now, cost),
        }
    }

    /// Gives back a charge of `cost` made at `charged_at` (a later limit in
    /// the chain denied the request).
    pub fn refund(&self, state: &State, cost: u64, charged_at: u64) -> State {
        match (self, state) {
            (Algo::TokenBucket(g), State::TokenBucket { tat }) => State::TokenBucket {
                tat: g.refund(*tat, cost),
            },
            (Algo::FixedWindow(a), State::FixedWindow(s)) => {
                let mut s = *s;
                if s.window == charged_at / a.window_ns() {
                    s.count = s.count.saturating_sub(cost);
                }
                State::FixedWindow(s)
            }
            (Algo::SlidingWindowLog(_), State::SlidingWindowLog(s)) => {
                let mut s = s.clone();
                s.refund(charged_at, cost);
                State::SlidingWindowLog(s)
            }
            (Algo::SlidingWindowCounter(a), State::SlidingWindowCounter(s)) => {
                let mut s = *s;
                if s.last_ns / a.window_ns() == charged_at / a.window_ns() {
                    s.curr = s.curr.saturating_sub(cost);
                }
                State::SlidingWindowCounter(s)
            }
            (_, other) => other.clone(),
        }
    }

    /// Charges `units` more, made at `charged_at`, without admission: a
    /// cost settled after the response, past the limit by at most its debt
    /// allowance (each algorithm's `settle_more` states how). Returns the
    /// new state and the units written off.
    pub fn settle_more(&self, state: &State, units: u64, charged_at: u64, now: u64) -> (State, u64) {
        match (self, state) {
            (Algo::TokenBucket(g), State::TokenBucket { tat }) => {
                let (tat, lost) = g.settle_more(*tat, units, now);
                (State::TokenBucket { tat }, lost)
            }
            (Algo::FixedWindow(a), State::FixedWindow(s)) => {
                let (s, lost) = a.settle_more(s, units, now);
                (State::FixedWindow(s), lost)
            }
            (Algo::SlidingWindowLog(a), State::SlidingWindowLog(s)) => {
                let (s, lost) = a.settle_more(s, units, charged_at, now);
                (State::SlidingWindowLog(s), lost)
            }
            (Algo::SlidingWindowCounter(a), State::SlidingWindowCounter(s)) => {
                let (s, lost) = a.settle_more(s, units, now);
                (State::SlidingWindowCounter(s), lost)
            }
            // A state of another algorithm: `load` never returns one.
            (_, other) => (other.clone(), units),
        }
    }

    /// Units `state` owes at `now`: how far late-settled costs took it past
    /// its capacity (0 when not in debt; a sliding log never owes).
    pub fn debt(&self, state: &State, now: u64) -> u64 {
        match (self, state) {
            (Algo::TokenBucket(g), State::TokenBucket { tat }) => g.debt(*tat, now),
            (Algo::FixedWindow(a), State::FixedWindow(s)) => a.debt(s, now),
            (Algo::SlidingWindowCounter(a), State::SlidingWindowCounter(s)) => a.debt(s, now),
            _ => 0,
        }
    }

    /// These parameters with a debt allowance of `max_debt` units (a
    /// sliding log has none: it is exact). `None` if the allowance cannot
    /// be represented (policy validation reports it).
    pub fn with_debt(self, max_debt: u64) -> Option<Algo> {
        Some(match self {
            Algo::TokenBucket(g) => Algo::TokenBucket(g.with_debt(max_debt)?),
            Algo::FixedWindow(a) => Algo::FixedWindow(a.with_debt(max_debt)),
            Algo::SlidingWindowCounter(a) => Algo::SlidingWindowCounter(a.with_debt(max_debt)),
            log @ Algo::SlidingWindowLog(_) => log,
        })
    }

    pub fn encode(state: &State, out: &mut Vec<u8>) {
        match state {
            State::TokenBucket { tat } => out.extend_from_slice(&tat.to_le_bytes()),
            State::FixedWindow(s) => FixedWindow::encode(s, out),
            State::SlidingWindowLog(s) => SlidingWindowLog::encode(s, out),
            State::SlidingWindowCounter(s) => SlidingWindowCounter::encode(s, out),
        }
    }

    /// Appends a state as stored in a record: the algorithm's encoding,
    /// then its [`Stamp`].
    pub fn encode_stored(state: &State, stamp: Stamp, out: &mut Vec<u8>) {
        Algo::encode(state, out);
        out.extend_from_slice(&stamp.epoch.to_le_bytes());
        out.extend_from_slice(&stamp.written_at.to_le_bytes());
    }

    /// Whether a record of one of these algorithms is back to its fresh
    /// state at `now` (see [`crate::engine::record_is_idle`], the key
    /// table's test, which also knows global allowances). A record no
    /// algorithm here can read counts as idle.
    pub fn record_is_idle(record: &Record<'_>, now: u64) -> bool {
        let Some(algo) = Algo::of_record(record) else {
            return true;
        };
        match (
            algo,
            Algo::decode_stored(record.kind, record.state).map(|(s, _)| s),
        ) {
            (_, None) => true,
            (Algo::TokenBucket(_), Some(State::TokenBucket { tat })) => tat <= now,
            (Algo::FixedWindow(a), Some(State::FixedWindow(s))) => a.is_idle(&s, now),
            (Algo::SlidingWindowLog(a), Some(State::SlidingWindowLog(s))) => a.is_idle(&s, now),
            (Algo::SlidingWindowCounter(a), Some(State::SlidingWindowCounter(s))) => a.is_idle(&s, now),
            _ => true,
        }
    }

    /// The algorithm a stored record was written by, from its parameters.
    fn of_record(r: &Record<'_>) -> Option<Algo> {
        Some(match r.kind {
            kind::TOKEN_BUCKET => Algo::TokenBucket(Gcra::from_stored(r.p1, r.p2)?),
            kind::FIXED_WINDOW => Algo::FixedWindow(FixedWindow::new(r.p1, r.p2)?),
            kind::SLIDING_WINDOW_LOG => Algo::SlidingWindowLog(SlidingWindowLog::new(r.p1, r.p2)?),
            kind::SLIDING_WINDOW_COUNTER => {
                Algo::SlidingWindowCounter(SlidingWindowCounter::new(r.p1, r.p2)?)
            }
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;
    const T0: u64 = 1_796_000_000 * S;

    fn record<'a>(algo: &Algo, state: &'a [u8]) -> Record<'a> {
        let (p1, p2) = algo.params();
        Record {
            name_hash: 1,
            kind: algo.kind(),
            p1,
            p2,
            state,
        }
    }

    /// The state a charge would use, and whether it must be persisted
    /// (no record here comes from a newer policy).
    fn load(algo: &Algo, record: Option<&Record<'_>>, effective_from: u64, now: u64) -> (State, bool) {
        let live = algo.load(record, effective_from, now);
        assert_eq!(live.algo, *algo);
        (live.state, live.changed)
    }

    fn all() -> [Algo; 4] {
        [
            Algo::TokenBucket(Gcra::new(5, S, 5).unwrap()),
            Algo::FixedWindow(FixedWindow::new(5, S).unwrap()),
            Algo::SlidingWindowLog(SlidingWindowLog::new(5, S).unwrap()),
            Algo::SlidingWindowCounter(SlidingWindowCounter::new(5, S).unwrap()),
        ]
    }

    #[test]
    fn every_algorithm_round_trips_through_its_record_refunds_and_goes_idle() {
        for algo in all() {
            let (fresh, changed) = load(&algo, None, T0, T0);
            assert!(!changed);
            let Verdict::Admit { state, remaining, .. } = algo.check(&fresh, T0, 2) else {
                panic!("{algo:?}")
            };
            assert_eq!(remaining, 3, "{algo:?}");
            let mut bytes = Vec::new();
            Algo::encode(&state, &mut bytes);
            let stored = record(&algo, &bytes);
            assert_eq!(
                load(&algo, Some(&stored), T0, T0),
                (state.clone(), false),
                "{algo:?}"
            );
            assert!(!Algo::record_is_idle(&stored, T0), "{algo:?}");
            assert!(Algo::record_is_idle(&stored, T0 + 3 * S), "{algo:?}");
            // Refunding the charge restores the fresh level.
            let refunded = algo.refund(&state, 2, T0);
            let Verdict::Admit { remaining, .. } = algo.check(&refunded, T0, 1) else {
                panic!("{algo:?}")
            };
            assert_eq!(remaining, 4, "{algo:?}");
        }
    }

    #[test]
    fn no_state_encodes_longer_than_max_state_len() {
        // The fullest states: a log of `limit` entries spread over a year
        // (7-byte deltas), and the other algorithms' varints at their largest.
        let year = 366 * 86_400 * S;
        let log = SlidingWindowLog::new(1024, year).unwrap();
        let mut st = Algo::SlidingWindowLog(log).fresh();
        let algo = Algo::SlidingWindowLog(log);
        for i in 0..1024u64 {
            let Verdict::Admit { state, .. } = algo.check(&st, T0 + i * (year / 1024), 1) else {
                panic!("{i}")
            };
            st = state;
        }
        let mut out = Vec::new();
        Algo::encode(&st, &mut out);
        assert!(
            out.len() <= algo.max_state_len(),
            "{} > {}",
            out.len(),
            algo.max_state_len()
        );
        let big = u64::MAX;
        for (algo, state) in [
            (
                Algo::TokenBucket(Gcra::new(5, S, 5).unwrap()),
                State::TokenBucket { tat: big },
            ),
            (
                Algo::FixedWindow(FixedWindow::new(5, S).unwrap()),
                State::FixedWindow(fixed_window::State {
                    window: big,
                    count: big,
                }),
            ),
            (
                Algo::SlidingWindowCounter(SlidingWindowCounter::new(5, S).unwrap()),
                State::SlidingWindowCounter(sliding_window_counter::State {
                    last_ns: big,
                    prev: big,
                    curr: big,
                }),
            ),
        ] {
            out.clear();
            Algo::encode(&state, &mut out);
            assert_eq!(out.len(), algo.max_state_len(), "{algo:?}");
        }
    }

    #[test]
    fn unreadable_or_foreign_records_start_fresh_and_are_reclaimable() {
        for algo in all() {
            let junk = Record {
                name_hash: 1,
                kind: 99,
                p1: 0,
                p2: 0,
                state: &[1, 2],
            };
            assert_eq!(load(&algo, Some(&junk), T0, T0), (algo.fresh(), true));
            assert!(Algo::record_is_idle(&junk, T0));
            let short = record(&algo, &[0xff; 3]);
            let (state, _) = load(&algo, Some(&short), T0, T0);
            assert!(
                matches!(algo.check(&state, T0, 1), Verdict::Admit { .. }),
                "{algo:?}"
            );
        }
    }

    #[test]
    fn a_forward_clock_excursion_blocks_a_window_limit_for_two_windows_at_most() {
        // Regression: admissions made while the clock ran an hour ahead kept
        // the window algorithms shut for the hour after it came back (the
        // token bucket already saturated: at most one refill).
        let hour = 3600 * S;
        for algo in all() {
            if matches!(algo, Algo::TokenBucket(_)) {
                continue;
            }
            // The limit (5) used up at T0 + 1 h, the clock ahead.
            let mut st = algo.fresh();
            for i in 0..5 {
                let Verdict::Admit { state, .. } = algo.check(&st, T0 + hour + i, 1) else {
                    panic!("{algo:?}")
                };
                st = state;
            }
            let mut bytes = Vec::new();
            Algo::encode(&st, &mut bytes);
            // The clock comes back to T0: what the key used still counts (no
            // fresh limit), and the engine persists the normalised state.
            let (loaded, changed) = load(&algo, Some(&record(&algo, &bytes)), T0, T0);
            assert!(changed, "{algo:?}: normalised, so a denial persists it");
            assert!(
                matches!(algo.check(&loaded, T0, 1), Verdict::Deny { .. }),
                "{algo:?}"
            );
            bytes.clear();
            Algo::encode(&loaded, &mut bytes);
            // Two windows later, not an hour: admitted again.
            let later = T0 + 2 * S;
            let (loaded, _) = load(&algo, Some(&record(&algo, &bytes)), T0, later);
            assert!(
                matches!(algo.check(&loaded, later, 1), Verdict::Admit { .. }),
                "{algo:?} still blocked by the excursion"
            );
        }
    }

    #[test]
    fn a_fixed_window_whose_length_changes_keeps_its_count() {
        let old = Algo::FixedWindow(FixedWindow::new(5, S).unwrap());
        let Verdict::Admit { state, .. } = old.check(&old.fresh(), T0, 5) else {
            panic!()
        };
        let mut bytes = Vec::new();
        Algo::encode(&state, &mut bytes);
        let new = Algo::FixedWindow(FixedWindow::new(5, 60 * S).unwrap());
        let (moved, changed) = load(&new, Some(&record(&old, &bytes)), T0, T0);
        assert!(changed);
        assert!(
            matches!(new.check(&moved, T0, 1), Verdict::Deny { .. }),
            "no fresh window on reload"
        );
    }

    fn stored(algo: &Algo, state: &State, epoch: u64, written_at: u64) -> Vec<u8> {
        let mut bytes = Vec::new();
        Algo::encode_stored(state, Stamp { epoch, written_at }, &mut bytes);
        let mut plain = Vec::new();
        Algo::encode(state, &mut plain);
        assert_eq!(bytes.len(), plain.len() + STAMP_LEN);
        assert!(bytes.len() <= algo.max_stored_len(), "{algo:?}");
        bytes
    }

    #[test]
    fn a_stamp_round_trips_and_an_unstamped_record_reads_as_unknown() {
        for algo in all() {
            let Verdict::Admit { state, .. } = algo.check(&algo.fresh(), T0, 2) else {
                panic!("{algo:?}")
            };
            let bytes = stored(&algo, &state, T0 - S, T0);
            assert_eq!(
                Algo::decode_stored(algo.kind(), &bytes),
                Some((
                    state.clone(),
                    Stamp {
                        epoch: T0 - S,
                        written_at: T0
                    }
                )),
                "{algo:?}"
            );
            let mut plain = Vec::new();
            Algo::encode(&state, &mut plain);
            assert_eq!(
                Algo::decode_stored(algo.kind(), &plain),
                Some((state.clone(), Stamp::UNKNOWN))
            );
            // A stamp cut short, or one byte too many: unreadable, fresh.
            for len in [
                plain.len() + 1,
                plain.len() + STAMP_LEN - 1,
                plain.len() + STAMP_LEN + 1,
            ] {
                let mut odd = bytes.clone();
                odd.resize(len, 0);
                assert_eq!(Algo::decode_stored(algo.kind(), &odd), None, "{algo:?} {len}");
            }
            assert!(algo.max_stored_len() >= bytes.len());
        }
    }

    /// Two versions of each algorithm: 5 per second, then 50 per 10 s.
    fn versions() -> [(Algo, Algo); 4] {
        [
            (
                Algo::TokenBucket(Gcra::new(5, S, 5).unwrap()),
                Algo::TokenBucket(Gcra::new(50, 10 * S, 50).unwrap()),
            ),
            (
                Algo::FixedWindow(FixedWindow::new(5, S).unwrap()),
                Algo::FixedWindow(FixedWindow::new(50, 10 * S).unwrap()),
            ),
            (
                Algo::SlidingWindowLog(SlidingWindowLog::new(5, S).unwrap()),
                Algo::SlidingWindowLog(SlidingWindowLog::new(50, 10 * S).unwrap()),
            ),
            (
                Algo::SlidingWindowCounter(SlidingWindowCounter::new(5, S).unwrap()),
                Algo::SlidingWindowCounter(SlidingWindowCounter::new(50, 10 * S).unwrap()),
            ),
        ]
    }

    #[test]
    fn an_older_policy_checks_a_newer_policys_record_under_the_newer_parameters() {
        for (old, new) in versions() {
            let Verdict::Admit { state, .. } = new.check(&new.fresh(), T0 + 2 * S, 3) else {
                panic!("{new:?}")
            };
            let bytes = stored(&new, &state, T0 + S, T0 + 2 * S);
            let live = old.load(Some(&record(&new, &bytes)), T0, T0 + 2 * S);
            assert_eq!(live.algo, new, "newest wins");
            assert_eq!(live.epoch, T0 + S);
            assert_eq!((live.state, live.changed), (state, false));
            // And the newer policy reads its own record as it is.
            let live = new.load(Some(&record(&new, &bytes)), T0 + S, T0 + 2 * S);
            assert_eq!((live.algo, live.epoch, live.changed), (new, T0 + S, false));
        }
    }

    #[test]
    fn a_record_written_after_the_reload_is_migrated_as_of_its_write() {
        // Regression: an empty bucket written by a worker still on the old
        // policy 10 s after the new one took effect was migrated as of the
        // reload, so those 10 s refilled it at the new rate.
        let (old, new) = (Gcra::new(5, S, 5).unwrap(), Gcra::new(1000, S, 1000).unwrap());
        let (old_algo, new_algo) = (Algo::TokenBucket(old), Algo::TokenBucket(new));
        let written = T0 + 10 * S;
        let empty = State::TokenBucket {
            tat: written + old.tolerance_ns(),
        };
        for (epoch, written_at) in [(T0 - S, written), (0, written), (T0 - S, 0), (0, u64::MAX)] {
            let bytes = stored(&old_algo, &empty, epoch, written_at);
            let live = new_algo.load(Some(&record(&old_algo, &bytes)), T0, written);
            assert_eq!(live.algo, new_algo);
            let State::TokenBucket { tat } = live.state else {
                panic!()
            };
            assert_eq!(new.available(tat, written), 0, "{epoch} {written_at}");
            assert_eq!(new.available(tat, written + 10_000_000), 10);
        }
        // Unstamped: as of `now`, the latest it can have been written.
        let mut plain = Vec::new();
        Algo::encode(&empty, &mut plain);
        let live = new_algo.load(Some(&record(&old_algo, &plain)), T0, written + S);
        let State::TokenBucket { tat } = live.state else {
            panic!()
        };
        // One second at the old rate (5 tokens), none at the new one.
        assert_eq!(new.available(tat, written + S), 5);
    }

    #[test]
    fn a_stamp_from_the_future_ranks_oldest_and_a_window_ahead_keeps_its_count() {
        for (old, new) in versions() {
            // Used up while the clock ran a day ahead; the stamp says so.
            let ahead = T0 + 86_400 * S;
            let Verdict::Admit { state, .. } = new.check(&new.fresh(), ahead, 50) else {
                panic!("{new:?}")
            };
            let bytes = stored(&new, &state, ahead, ahead);
            let live = old.load(Some(&record(&new, &bytes)), T0 - S, T0);
            assert_eq!(live.algo, old, "{new:?}: a future epoch does not outrank");
            assert_eq!(live.epoch, T0 - S);
            assert!(
                matches!(old.check(&live.state, T0, 1), Verdict::Deny { .. }),
                "{old:?}: what it counted still counts"
            );
        }
    }

    #[test]
    fn a_policy_loaded_ahead_of_the_clock_ranks_oldest() {
        assert_eq!(epoch_of(T0, T0), T0);
        assert_eq!(epoch_of(T0 + 1, T0), 0);
        for (old, new) in versions() {
            let Verdict::Admit { state, .. } = old.check(&old.fresh(), T0, 1) else {
                panic!("{old:?}")
            };
            let bytes = stored(&old, &state, T0 - S, T0);
            // `new` was loaded an hour ahead of the clock, since corrected.
            let live = new.load(Some(&record(&old, &bytes)), T0 + 3600 * S, T0);
            assert_eq!((live.algo, live.epoch), (old, T0 - S), "{new:?}");
        }
    }
}
