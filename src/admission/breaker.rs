//! A dependency's circuit breaker: open on errors, probe, ramp up.
//!
//! # The state machine (`dependencies.<d>.circuit_breaker`, settings `s`)
//! ```text
//!            window: volume ≥ min_volume and rate ≥ error_rate
//!   CLOSED ─────────────────────────────────────────────────────▶ OPEN (k = 0)
//!     ▲                                                            │ now ≥ until
//!     │ now ≥ since + ramp                                         ▼
//!   RAMPING ◀──────── probes succeeded (completed ≥ probes, ── HALF-OPEN
//!     │                or a window ended with ≥ 1 success)         │
//!     │ rate ≥ error_rate (volume ≥ ramp_volume)                   │ ≥ 1 completed, rate ≥ error_rate
//!     └──────────────────────────▶ OPEN (k + 1) ◀──────────────────┘
//! ```
//! * **rate** = (errors + timeouts) ÷ completed over the current window
//!   (`failures` clamped to `completed`; compared as
//!   `failures · 1000 ≥ error_permille · completed` in `u128`, so any `u64`
//!   counts are exact). A window with 0 completed never trips.
//! * The window is `s.window_ns` long; its counts reset when it ends. It
//!   is judged at every fold (each signal window's close, see below) on
//!   the window so far, and closed and ramping breakers also at every
//!   worker's fold of its stream ends ([`Breaker::judge_early`]), so it
//!   opens as soon as `min_volume` completions are in, not at a window's
//!   end.
//! * **Open** lasts `w_k · (1 − j/5)` with `w_k = min(max_open_for,
//!   open_for · 2^k)`, `j ∈ [0, 1)` from a seed (a jitter of up to 20 %
//!   downwards, so nodes and dependencies do not probe in lockstep), `k`
//!   the re-opens since the breaker was last closed: each re-open waits
//!   longer than the last (`0.8 · 2 w > w`) until `max_open_for`. Every
//!   request is refused (`circuit_open`): **zero upstream calls while
//!   open**. Its `Retry-After` is the time until half-open, rounded up,
//!   never earlier, plus the dependency's `retry_after_window` jitter.
//! * **Half-open**: **at most `probes` requests reach the dependency per
//!   half-open period, node-wide**, and at most `probes` at once (the
//!   effective limit); the rest are refused `circuit_probe_limit`. A
//!   request takes a probe ticket by compare-and-swap on the breaker's
//!   entry (the only request-path write, and only in this state) after
//!   every other slot of its admission (tenant share, action, dependency
//!   level) is taken; a request that is then refused by any later check
//!   (its rate limits, a guard, the hold) gives its ticket back at once
//!   ([`give_back_probe`]: only in the period it was taken in, so a ticket
//!   never counts twice), and so does a request whose slots were refused
//!   after its ticket. A ticket's request that goes on to the dependency
//!   keeps it until the period ends: that is the count the promise is
//!   about. A period's tickets are never handed out again; **lost probes**
//!   (taken, let through, never answered: the worker died, or the
//!   dependency is slower than the windows) end the period instead: after
//!   [`LOST_PROBE_FOLDS`] folds in a row without an answer since the last
//!   ticket was taken, a new half-open period begins with fresh tickets
//!   (counted as a half-open transition), while the effective limit still
//!   holds in flight at `probes`.
//! * **Ramping** (slow start): the dependency's effective limit is
//!   `max(1, ⌈L · p / 1000⌉)` for its limit `L` with
//!   `p(t) = floor + (1000 − floor) · (t − since) / ramp` permille, a
//!   straight line from `ramp_floor` to 100 % over `ramp`, then closed.
//!   `ramp_volume = max(probes, ⌊min_volume · p / 1000⌋)`: a failing
//!   dependency at a low ramp level re-opens without waiting for the full
//!   volume.
//! * Open ignores stream ends (requests admitted before it opened).
//!
//! # Clocks
//! Time is `now`. A clock that jumps backwards re-anchors a window or ramp
//! that would start in the future at `now`, and an open period is never
//! longer than `max_open_for` from `now`; a jump forwards ends waits early
//! (half-open still admits at most `probes`).
//!
//! # Where it lives
//! Node-wide in the fixed entry `tg2|b|<dependency>` ([`crate::keys::breaker`]), one record
//! of kind [`crate::keys::kind::BREAKER`] ([`shared::encode`]: 51 bytes), changed only through
//! [`crate::table::update`]. Its input is the dependency's stream-end
//! signal windows ([`super::window`]): the one worker that closes a window
//! folds its summary (completed; errors + timeouts) into the breaker
//! ([`fold`]), and the transitions that trips are made in the same
//! compare-and-swap, so each is made (and counted) once. The breaker's own
//! `window` sums the signal windows that close within it (a signal window
//! is `adaptive.window`, or the breaker's `window` up to 500 ms). Between
//! closes, a worker whose tick folds stream ends gets the node-wide counts
//! of the signal windows not closed yet ([`super::window::Running`]); if
//! its copy says they trip a closed or ramping breaker (with its window
//! so far), it judges them on the entry ([`judge`]: counted there, never
//! added, since each is added at its close), so **a failing dependency
//! opens within one tick (10 ms) of its `min_volume`-th failure being
//! folded**, each failure being folded at its worker's next tick. Every worker reads the entry on its tick
//! into memory ([`read`]); a request's check ([`Breaker::gate`]) reads
//! that copy: no hostcall on the request path except a half-open probe's
//! ticket. The copy is at most one tick (10 ms) stale; time-based
//! transitions (open → half-open, the ramp's end) are computed from it at
//! `now` and written by the next fold or probe.
//!
//! [`tick`] is a worker's whole breaker step, run by the glue on every
//! tick after the controller's.
//!
//! Pure: time is `now`, the host is [`crate::host::Host`].
//!
//! # Where it is
//! The rule, the state machine and its gate here (pure, to
//! [`Transitions`]); its life in shared data (the record's bytes, fold,
//! probe tickets, [`tick`]) in `breaker/shared.rs`.

mod shared;

pub use shared::{
    decode, encode, fold, give_back_probe, judge, prepare, read, take_probe, tick, Folded, Probe, Ticked,
};

use crate::policy::admission::BreakerSettings;

const VERSION: u8 = 1;
/// An encoded breaker state: version, phase, reopens, 5 instants and
/// counts, probes, empty folds.
pub const ENCODED_LEN: usize = 1 + 1 + 4 + 5 * 8 + 4 + 1;
const PERMILLE: u64 = 1000;
/// Half-open: folds in a row without an answer, counted from the last
/// probe ticket taken, after which the period's probes are lost and a new
/// period begins. Two, so that the signal window open when a probe was
/// taken (whose close may come before that probe's answer) is not enough.
pub const LOST_PROBE_FOLDS: u8 = 2;

/// Where a breaker is (gauge `admission.breaker_state.<dep>`: the number).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Phase {
    #[default]
    Closed = 0,
    Open = 1,
    HalfOpen = 2,
    Ramping = 3,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Closed => "closed",
            Phase::Open => "open",
            Phase::HalfOpen => "half_open",
            Phase::Ramping => "ramping",
        }
    }

    fn from_u8(b: u8) -> Option<Phase> {
        Some(match b {
            0 => Phase::Closed,
            1 => Phase::Open,
            2 => Phase::HalfOpen,
            3 => Phase::Ramping,
            _ => return None,
        })
    }
}

/// What streams of a dependency showed (a window, or one worker's part of one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Observed {
    /// Streams that got an answer from the upstream (or its timeout).
    pub completed: u64,
    /// Of those, errors (5xx) and timeouts.
    pub failures: u64,
}

impl Observed {
    pub fn is_empty(&self) -> bool {
        self.completed == 0 && self.failures == 0
    }

    pub fn add(&mut self, other: Observed) {
        self.completed = self.completed.saturating_add(other.completed);
        self.failures = self.failures.saturating_add(other.failures);
    }

    /// At least `volume` completed and a rate at or over `error_permille`.
    pub fn trips(&self, volume: u64, error_permille: u32) -> bool {
        let failures = self.failures.min(self.completed);
        self.completed > 0
            && self.completed >= volume
            && u128::from(failures) * u128::from(PERMILLE)
                >= u128::from(error_permille) * u128::from(self.completed)
    }
}

/// A transition, made by exactly one fold (for the counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub from: Phase,
    pub to: Phase,
}

/// A node's breaker for one dependency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Breaker {
    pub phase: Phase,
    /// When the phase began (ramping: the ramp's start).
    pub since: u64,
    /// Open: when it turns half-open.
    pub until: u64,
    /// Re-opens since it was last closed (the backoff's exponent).
    pub reopens: u32,
    /// The current window's start, and what it saw so far.
    pub window_start: u64,
    pub window: Observed,
    /// Probe tickets taken in this half-open period.
    pub probes_taken: u32,
    /// Half-open folds in a row that brought no answer since the last
    /// probe ticket was taken.
    pub empty_folds: u8,
}

/// What a request of the dependency meets (from [`Breaker::gate`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Gate {
    /// No breaker cap.
    #[default]
    Free,
    /// Refuse `circuit_open` until this instant.
    Open { half_open_at: u64 },
    /// Half-open: `left` probe tickets in this window, at most `probes` at once.
    Probe { probes: u32, left: u32 },
    /// Slow start at this level (permille of the limit, < 1000).
    Ramp { permille: u32 },
}

impl Gate {
    /// The breaker's cap on a limit `target` (≥ 1): see the module header.
    pub fn cap(&self, target: u32) -> u32 {
        match *self {
            Gate::Free => target,
            Gate::Open { .. } => 0,
            Gate::Probe { probes, .. } => target.min(probes),
            Gate::Ramp { permille } => {
                let scaled = (u64::from(target) * u64::from(permille)).div_ceil(PERMILLE);
                u32::try_from(scaled).unwrap_or(target).clamp(1, target.max(1))
            }
        }
    }

    /// The ramp gauge: permille of the limit the breaker admits.
    pub fn permille(&self) -> u32 {
        match *self {
            Gate::Free => 1000,
            Gate::Open { .. } => 0,
            Gate::Probe { .. } => 0,
            Gate::Ramp { permille } => permille,
        }
    }
}

/// The ramp level at `now` (permille, 1000 once `ramp_ns` has passed).
pub fn ramp_permille(s: &BreakerSettings, since: u64, now: u64) -> u32 {
    let elapsed = now.saturating_sub(since);
    let floor = u64::from(s.ramp_floor_permille.min(1000));
    if elapsed >= s.ramp_ns || s.ramp_ns == 0 {
        return 1000;
    }
    let rise = u128::from(PERMILLE - floor) * u128::from(elapsed) / u128::from(s.ramp_ns);
    u32::try_from(u128::from(floor) + rise).unwrap_or(1000).min(1000)
}

/// How long the `k`-th re-open waits at most: `min(max_open_for, open_for · 2^k)`.
pub fn open_wait_ns(s: &BreakerSettings, reopens: u32) -> u64 {
    let factor = 1u64.checked_shl(reopens.min(63)).unwrap_or(u64::MAX);
    s.open_for_ns
        .saturating_mul(factor)
        .min(s.max_open_for_ns.max(s.open_for_ns))
}

impl Breaker {
    /// What a request meets at `now` (this worker's copy; time-based
    /// transitions are applied on the fly).
    pub fn gate(&self, s: &BreakerSettings, now: u64) -> Gate {
        match self.phase {
            Phase::Closed => Gate::Free,
            Phase::Open => {
                let half_open_at = self.until.min(now.saturating_add(s.max_open_for_ns));
                if now < half_open_at {
                    Gate::Open { half_open_at }
                } else {
                    Gate::Probe {
                        probes: s.probes,
                        left: s.probes,
                    }
                }
            }
            Phase::HalfOpen => Gate::Probe {
                probes: s.probes,
                left: s.probes.saturating_sub(self.probes_taken),
            },
            Phase::Ramping => match ramp_permille(s, self.since, now) {
                1000 => Gate::Free,
                permille => Gate::Ramp { permille },
            },
        }
    }

    /// The phase a reader sees at `now` (time-based transitions applied).
    pub fn phase_at(&self, s: &BreakerSettings, now: u64) -> Phase {
        match self.gate(s, now) {
            Gate::Free => Phase::Closed,
            Gate::Open { .. } => Phase::Open,
            Gate::Probe { .. } => Phase::HalfOpen,
            Gate::Ramp { .. } => Phase::Ramping,
        }
    }

    fn window_ended(&self, s: &BreakerSettings, now: u64) -> bool {
        now.saturating_sub(self.window_start) >= s.window_ns
    }

    fn enter(&mut self, phase: Phase, now: u64) -> Transition {
        let from = self.phase;
        self.phase = phase;
        self.since = now;
        self.window_start = now;
        self.window = Observed::default();
        self.probes_taken = 0;
        self.empty_folds = 0;
        Transition { from, to: phase }
    }

    fn open(&mut self, s: &BreakerSettings, now: u64, seed: u64) -> Transition {
        self.reopens = match self.phase {
            Phase::Closed => 0,
            _ => self.reopens.saturating_add(1),
        };
        let wait = open_wait_ns(s, self.reopens);
        // Up to a fifth shorter, never longer: `w_k` stays the bound.
        let jitter = super::splitmix64(seed)
            .checked_rem((wait / 5).saturating_add(1))
            .unwrap_or(0);
        let t = self.enter(Phase::Open, now);
        self.until = now.saturating_add(wait.saturating_sub(jitter));
        t
    }

    /// Time-based transitions due at `now` (open → half-open, ramping →
    /// closed) and re-anchoring after a clock jump; `None`: nothing changed
    /// phase.
    pub fn advance(&mut self, s: &BreakerSettings, now: u64) -> Option<Transition> {
        if self.window_start > now {
            self.window_start = now;
        }
        match self.phase {
            Phase::Open => {
                let latest = now.saturating_add(s.max_open_for_ns);
                if self.until > latest {
                    self.until = latest;
                }
                (now >= self.until).then(|| self.enter(Phase::HalfOpen, now))
            }
            Phase::Ramping => {
                if self.since > now {
                    self.since = now;
                }
                (ramp_permille(s, self.since, now) >= 1000).then(|| {
                    let t = self.enter(Phase::Closed, now);
                    self.reopens = 0;
                    t
                })
            }
            Phase::Closed | Phase::HalfOpen => None,
        }
    }

    /// Adds what streams observed and makes the transitions it trips (see
    /// the module header). `seed` jitters an open period. Returns every
    /// transition made, oldest first (at most three: a time-based one, a
    /// judged one, and a half-open window's end).
    pub fn observe(&mut self, s: &BreakerSettings, seen: Observed, now: u64, seed: u64) -> Transitions {
        let mut made = Transitions::default();
        if let Some(t) = self.advance(s, now) {
            made.push(t);
        }
        if self.phase != Phase::Open {
            self.window.add(seen);
        }
        let judged = match self.phase {
            Phase::Closed => self
                .window
                .trips(u64::from(s.min_volume), s.error_permille)
                .then(|| self.open(s, now, seed)),
            Phase::HalfOpen => {
                if self.window.trips(1, s.error_permille) {
                    Some(self.open(s, now, seed))
                } else if self.window.completed >= u64::from(s.probes) {
                    Some(self.enter(Phase::Ramping, now))
                } else {
                    None
                }
            }
            Phase::Ramping => {
                let level = u64::from(ramp_permille(s, self.since, now));
                let volume = u64::from(s.probes).max(u64::from(s.min_volume) * level / PERMILLE);
                self.window
                    .trips(volume, s.error_permille)
                    .then(|| self.open(s, now, seed))
            }
            Phase::Open => None,
        };
        if let Some(t) = judged {
            made.push(t);
        }
        if self.phase == Phase::HalfOpen && self.probes_taken > 0 {
            // Probes never answered (lost): after LOST_PROBE_FOLDS folds in
            // a row without an answer, a new period (never the same
            // period's tickets again: see the module header).
            if seen.completed == 0 {
                self.empty_folds = self.empty_folds.saturating_add(1);
                if self.empty_folds >= LOST_PROBE_FOLDS {
                    made.push(self.enter(Phase::HalfOpen, now));
                }
            } else {
                self.empty_folds = 0;
            }
        }
        if self.window_ended(s, now) {
            if self.phase == Phase::HalfOpen && self.window.completed > 0 {
                // Some probes answered, none tripped it: ramp up.
                made.push(self.enter(Phase::Ramping, now));
            } else {
                self.window_start = now;
                self.window = Observed::default();
            }
        }
        made
    }

    /// Judges the node's signal windows not closed yet (`running`, see
    /// [`super::window::Running`]) with the breaker's own window so far,
    /// without adding them to it (each is added once, when its signal
    /// window closes): a closed or ramping breaker opens as soon as the
    /// counts folded so far trip it, not at the signal window's close.
    /// Half-open and open breakers are judged only at closes.
    pub fn judge_early(
        &mut self,
        s: &BreakerSettings,
        running: Observed,
        now: u64,
        seed: u64,
    ) -> Option<Transition> {
        let mut w = if self.window_ended(s, now) {
            Observed::default()
        } else {
            self.window
        };
        w.add(running);
        let trips = match self.phase {
            Phase::Closed => w.trips(u64::from(s.min_volume), s.error_permille),
            Phase::Ramping => {
                let level = u64::from(ramp_permille(s, self.since, now));
                let volume = u64::from(s.probes).max(u64::from(s.min_volume) * level / PERMILLE);
                w.trips(volume, s.error_permille)
            }
            Phase::HalfOpen | Phase::Open => false,
        };
        trips.then(|| self.open(s, now, seed))
    }

    /// Takes a half-open probe ticket at `now`; `false`: none left (or not
    /// half-open: the caller's copy was stale). A ticket taken restarts the
    /// count of folds without an answer (lost probes).
    pub fn take_probe(&mut self, s: &BreakerSettings, now: u64) -> bool {
        let _ = self.advance(s, now);
        if self.phase != Phase::HalfOpen {
            return false;
        }
        if self.probes_taken < s.probes {
            self.probes_taken = self.probes_taken.saturating_add(1);
            self.empty_folds = 0;
            true
        } else {
            false
        }
    }

    /// Gives back a probe ticket of the half-open period that began at
    /// `period` (its request never reached the dependency); `false`: that
    /// period is over, so the ticket is gone with it.
    pub fn give_back(&mut self, period: u64) -> bool {
        if self.phase != Phase::HalfOpen || self.since != period || self.probes_taken == 0 {
            return false;
        }
        self.probes_taken = self.probes_taken.saturating_sub(1);
        true
    }
}

/// Transitions of one fold (at most three).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Transitions {
    items: [Option<Transition>; 3],
}

impl Transitions {
    fn push(&mut self, t: Transition) {
        if let Some(slot) = self.items.iter_mut().find(|i| i.is_none()) {
            *slot = Some(t);
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = Transition> + '_ {
        self.items.iter().flatten().copied()
    }
}

#[cfg(test)]
mod tests;
