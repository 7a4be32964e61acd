//! The adaptive concurrency controller: per dependency with `adaptive:`,
//! it moves the in-flight limit once per closed window
//! ([`super::window::WindowSummary`]) from the window's p95 latency over a
//! measured baseline, its upstream error rate and its oldest queue age.
//!
//! Latency above the baseline is this limit's queue only if it falls when
//! the limit falls. On a shared machine it may be anything else: a
//! baseline measured on a quiet start, scheduling noise, the p95's 12.5 %
//! buckets. So latency alone moves the limit down only so far, and then
//! the controller measures whether the latency was its own (issue #26: a
//! healthy upstream's limit walked to `min` on a few percent of noise and
//! stayed there, because nothing could contradict a baseline taken on a
//! quiet start).
//!
//! # The bounds
//! `F` = [`DESCENT_STEP_PPM`] (25 %), `min`/`max` the policy's, `C` the
//! upstream's capacity (the concurrency beyond which it queues).
//! 1. **Latency alone never takes the limit more than `F` of its slots
//!    above `min` below its anchor** (the limit the current descent began
//!    at), nor below the level where a window still holds [`MIN_SAMPLES`]
//!    completions at the baseline latency (`MIN_SAMPLES·B/window`: the
//!    controller never makes itself blind), nor below `min`. At that floor,
//!    while latency is still bad, a refresh measures the latency at half
//!    the limit ("the experiment", below). Only a clear fall of the
//!    latency with the limit (or a queue even at the cut) lets a descent go
//!    on; a flat one gives the limit back, and a baseline it contradicts is
//!    replaced. Errors (`error_rate`) and queue age behind bad latency are
//!    the upstream's own signals: they back off below the floor, to `min`.
//!    Hence on an upstream that neither fails nor queues below `C`, a limit
//!    that had reached `C` goes below `min + (1 − F)·(C − min)` only for
//!    the experiment's two windows at half of it, or when an experiment
//!    takes noise for a clear fall (more than 1.5 times its band, 19–30 %:
//!    three standard deviations at least).
//! 2. **A refresh never gives back more than the limit it started from,
//!    and gives back less when its windows show the upstream got worse**:
//!    bad at the cut and halved with it (the upstream queues even at half
//!    the limit): the cut; unhealthy at the cut and worse than before it
//!    beyond the noise (a step during the refresh): the floor below `L`,
//!    from where the next bad window is judged again. It never measures a
//!    baseline from a window that is bad against the old one unless the
//!    window before it was bad too and halving the limit left the latency
//!    where it was (the old baseline is then the error).
//! 3. **Coming back**: once errors stop, the limit climbs by
//!    `max_increase` (25 %) a window to the level the backoff started
//!    from; after an experiment that found the latency flat and the
//!    baseline wrong, to the descent's anchor; otherwise by the gradient,
//!    at least one slot a window while latency is healthy and the limit
//!    used, and one slot every [`PROBE_WINDOWS`] windows it holds in the
//!    dead zone while used (the dead zone is a band, not a wall: if the
//!    slot queues, latency says so). At `min`, a window the baseline calls
//!    unhealthy starts an experiment at once (nothing is cut there), so a
//!    baseline too low is measured again at `min` as well.
//!
//! Measured on the simulation of this code (`tests/bounds.rs`, 20 seeded
//! runs each, an upstream of 30 ms and capacity 16 behind `min` 5 and
//! `max` 64, offered 1.5 times its capacity; `docs/admission.md` has the
//! table and the command that prints them): at 3 % of latency noise a
//! window and a first baseline on a 7 % faster start, the limit never fell
//! below 16 (the issue's collapse took it to `min`); at 5 % and a 10 %
//! faster start its lowest was 11, below 16 in 3.9 % of windows, mean
//! 17.8; a step 16 → 8 at a refresh kept its result (from the third
//! window 8–15, never above the limit before the step); from `min` with a
//! baseline 10 % low, back at 16 in 14 windows (median), 29 (90th
//! percentile), but 2 of 20 runs not within 60 (at 15 and 10: a baseline
//! still a few percent low holds the limit in the dead zone, a slot every
//! [`PROBE_WINDOWS`]); after errors, back to the limit before them in 7
//! (median, 10 at most).
//!
//! # The formula (per closed window, `L` the limit before it)
//! With `B` the baseline (the p95 measured at reduced concurrency, below),
//! `p` the window's p95 (successes and timeouts) over `n` of them, `b` =
//! `buffer`, `dz` = `dead_zone`, `α` = `smoothing`, and `ε` the p95's
//! noise: `0.3/√n` ([`NOISE`], half a standard deviation of a p95 of `n`
//! samples of a lognormal σ = 0.3), or half the window-to-window standard
//! deviation this dependency's p95 has shown, when larger (measured on
//! pairs of windows at one limit, each pair's log-change capped at
//! [`NOISE_SAMPLE_CAP`]):
//! ```text
//! g  = clamp(0.5, 2, B·(1 + b) / p)                   the gradient
//! ḡ  = (g + ḡ_previous) / 2                           smoothed over windows
//! errors + timeouts ≥ error_rate of completed    →  L' = L·backoff
//! queue age ≥ queue_age, and ḡ < 1 − ε − dz
//!   or nothing completed (a hung upstream)       →  L' = L·backoff
//! ḡ < 1 − ε − dz (bad)                           →  L' = L + 2α·(L·max(ḡ, g) − L), at least the floor;
//!                                                    at the floor: the experiment
//! 1 − ε − dz ≤ ḡ < 1 − ε (the dead zone)         →  L' = L; L + 1 every PROBE_WINDOWS held while used;
//!                                                    at min: the experiment
//! ḡ ≥ 1 − ε and the limit was used               →  L' = L + max(1, α·(L·ḡ + √(L·ḡ) − L)),
//!                                                    or back towards a recovery level
//! otherwise (idle, < MIN_SAMPLES, unused)        →  L' = L
//! then  L' ≤ L + max(1, L·max_increase),  L' ≥ L/2,  L' = clamp(min, max, L')
//! ```
//! Down moves take twice the smoothing's share of the way up's: an
//! overload costs more than spare capacity; they go no further than the
//! latest window's own `L·g` (the smoothed gradient averages in the last
//! window's, of a higher limit: alone it would carry the limit below the
//! capacity after a step). On the way up this is Envoy's gradient
//! (`L·g + √(L·g)`). On the way down its `√(L·g)` headroom is left out:
//! with it the limit settles where `1 − g ≈ 1/√L`, a queue of about `√L`
//! past the capacity. Without it the limit settles in the dead zone, where
//! the upstream's own queue keeps p95 within about `(1 + b)/(1 − ε − dz)`
//! of the baseline. "Used": the window refused a request for the limit
//! (or its level's share of it), or its peak in flight reached
//! [`UTILIZED_PPM`] (80 %) of the limit; so a dependency with little demand
//! does not inflate its limit towards `max`, and one whose traffic is all
//! sheddable (which fills at most 70–80 % of the pool) still rises when
//! it is refused. A queue behind healthy latency is demand, not overload,
//! so queue age counts only when latency is bad or nothing completed.
//! Windows with fewer than [`MIN_SAMPLES`] completions hold the limit,
//! unless the limit is below the level where a window can measure, was
//! used, and what completed was healthy: then one slot more.
//!
//! Defaults (defined once, in [`crate::policy::admission`]): `window`
//! 500 ms, `min` = reservations + 1, `max` = `max_in_flight`, `buffer`
//! 0.02, `dead_zone` 0.04, `smoothing` 0.25, `max_increase` 0.25,
//! `backoff` 0.8, `error_rate` 0.1, `queue_age` 250 ms,
//! `baseline_refresh` 30 s. The limit starts at `max`.
//!
//! # The baseline and the experiment
//! A baseline measured at high concurrency would call a saturated upstream
//! healthy, so it is measured **at reduced concurrency**: a refresh caps
//! the limit at `max(min, L/2)` ([`REFRESH_CUT_PPM`]; the first, while the
//! limit is still at `max`, at `L/8`: [`FIRST_REFRESH_CUT_PPM`]), and no
//! lower than a window can measure (`2·MIN_SAMPLES·B/window`: twice, since
//! reservations and level shares leave some slots empty), for two
//! windows: the first drains the requests admitted at the full limit, the
//! second's p95 `p½` is the measurement (none with fewer than
//! [`MIN_SAMPLES`]: the limit comes back, and a descent goes on only from
//! it). A refresh starts in the first
//! window with traffic, then every `baseline_refresh` ± 25 % (jittered per
//! dependency and window) in a window whose latency is not bad (a refresh
//! inside a descent would measure its queue), and at a descent's floor (or
//! at `min`) as the experiment. With `p₀` the p95 of the window that
//! started it and `r = p½/p₀`, and `β` the flat band ([`FLAT_BAND_PPM`]
//! 12.5 %, or three standard deviations of `r` when the measured noise is
//! larger, at most [`MAX_FLAT_BAND_PPM`] 20 %):
//! ```text
//! bad at the cut and r ≤ 0.6            queues even at the cut        L' = the cut; B kept
//! 1 − 1.5β ≤ r ≤ 1 + β, the window
//!   before bad (an experiment)          the latency is not L's queue  L' = L; B := p½ if bad at the
//!                                                                     cut (at min: (p½ + p₀)/2), and
//!                                                                     back to the anchor; else B
//!                                                                     measured as below
//! unhealthy at the cut and r > 1 + β    worse meanwhile (a step)      L' = max(cut, the floor below L)
//! otherwise                                                           B measured: averaged with the old
//!                                                                     within ±25 %, replacing it beyond
//!                                                                     (with ≥ MIN_BASELINE_SAMPLES, or
//!                                                                     fewer when flat yet unhealthy; never
//!                                                                     when bad); L' = L, or, after a clear
//!                                                                     fall (r < 1 − 1.5β), on down from L
//!                                                                     by p₀'s gradient (at least the cut)
//! ```
//! Errors over `error_rate` during a refresh end it with a backoff. A
//! refresh costs half the limit for two windows in every
//! `baseline_refresh` (about 3 % of the time at the defaults), plus one
//! for each descent that reaches its floor.
//!
//! # Where it runs
//! The worker that closes a window (one per window, by compare-and-swap:
//! [`super::window`]) applies it to the node-wide state in `tg2|c|<dep>`
//! through [`crate::table::update`] (a window's index is applied once:
//! [`State::last_index`]). Every worker reads that state on its tick into
//! its [`super::Control`]; the request path reads the worker's copy, so
//! the limit a request sees is **at most one tick (10 ms) stale** after
//! the window's close, which comes [`super::window::GRACE_NS`] (50 ms)
//! after the window's end.
//!
//! Pure: time is `now`, the host is [`Host`].

use super::window::{self, WindowSummary, Windows};
use super::{splitmix64, Worker};
use crate::host::Host;
use crate::keys::kind;
use crate::policy::admission::{Adaptive, Dependency};
use crate::policy::values::PPM;
use crate::policy::Policy;
use crate::table::{self, push_record_with, Commit, Failure, Place, Reach, Record, Records};

/// Completions (successes, errors, timeouts) a window needs to move the
/// limit on latency or errors, or to measure a baseline.
pub const MIN_SAMPLES: u32 = 20;
/// Latency samples a refresh needs to replace a baseline (a first
/// baseline needs [`MIN_SAMPLES`]): a p95 of fewer varies too much.
pub const MIN_BASELINE_SAMPLES: u32 = 100;
/// A refreshed baseline within this share of the old one is averaged with
/// it; beyond, it replaces it.
pub const BASELINE_SHIFT_PPM: u32 = 250_000;
/// A refresh caps the limit at this share of it (at least `min`).
pub const REFRESH_CUT_PPM: u32 = 500_000;
/// The first refresh (no baseline yet, the limit still at `max`, which
/// may be far above the capacity) cuts deeper.
pub const FIRST_REFRESH_CUT_PPM: u32 = 125_000;
/// The refresh interval is jittered by ± this share.
pub const REFRESH_JITTER_PPM: u32 = 250_000;
/// A window's peak in flight must reach this share of the limit for it
/// to rise.
pub const UTILIZED_PPM: u32 = 800_000;
/// Both thresholds allow `NOISE/√n` for a window of `n` latency samples:
/// a p95 of `n` samples varies by about `0.6/√n` (relative, for a
/// lognormal service time of σ = 0.3); half a standard deviation keeps the
/// dead zone tight where samples are many (1.3 % at 500) and widens it
/// where they are few (6 % at 25).
pub const NOISE: f64 = 0.3;
/// Latency alone takes the limit at most this share of its slots above
/// `min` below the limit its descent began at (`F`); there the experiment
/// judges the latency (see the module header).
pub const DESCENT_STEP_PPM: u32 = 250_000;
/// A refresh's p95 at the cut within this share of the p95 before it is
/// flat: halving the limit did not change the latency (the band `β` widens
/// to three standard deviations of the ratio when the windows are
/// noisier; a fall is clear beyond `1.5·β`).
pub const FLAT_BAND_PPM: u32 = 125_000;
/// The flat band never widens beyond this share (a fall of more than 1.5
/// times it, 30 %, is always a clear fall).
pub const MAX_FLAT_BAND_PPM: u32 = 200_000;
/// One window's contribution to the measured noise is at most this
/// log-change of p95 (a step in the upstream is not noise).
pub const NOISE_SAMPLE_CAP: f64 = 0.2;
/// A refresh's p95 at the cut at most this share of the p95 before it
/// halved with the limit: the upstream queues even at the cut.
pub const QUEUED_AT_CUT_PPM: u32 = 600_000;
/// After this many windows held in the dead zone while used, the limit
/// tries one slot more (the dead zone is a band, not a wall).
pub const PROBE_WINDOWS: u32 = 8;
const CONTROL_NAME_HASH: u32 = 0x0000_1f19;
/// Version 2 added the noise, the anchor, the recovery level and the
/// refresh's first window; version 1 records still decode (without them).
const VERSION: u8 = 2;
const MILLI: f64 = 1000.0;

/// The shared-data key of a dependency's control state.
pub fn control_key(dependency: &str) -> String {
    crate::keys::control(dependency)
}

/// Where the baseline measurement is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Normal,
    /// The first refresh window: requests admitted at the full limit drain.
    Draining,
    /// The second: its p95 becomes the baseline.
    Measuring,
}

/// What the last window did to the limit (stats, tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Move {
    /// Fewer than [`MIN_SAMPLES`] completions, or no baseline yet.
    Idle,
    /// Within the dead zone, or healthy but unused.
    Held,
    Increase,
    Gradient,
    ErrorBackoff,
    QueueBackoff,
    /// A baseline refresh started or is draining.
    Refresh,
    /// A baseline was measured.
    Measured,
    /// Below the level where a window holds [`MIN_SAMPLES`], one more slot.
    Probe,
}

/// The inputs of the last applied window (gauges).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Inputs {
    pub completed: u32,
    pub p95_ns: u64,
    pub min_ns: u64,
    /// Errors and timeouts per completed, in parts per million.
    pub error_ppm: u32,
    pub oldest_queue_ns: u64,
    pub peak_in_flight: u32,
    /// The limit requests saw during the window ([`State::cap`]).
    pub cap: u32,
}

/// A dependency's node-wide controller state (`tg2|c|<dep>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    /// The controller's limit, in thousandths of a slot (small moves add up).
    pub limit_milli: u64,
    /// The baseline p95 (0: not measured yet).
    pub baseline_ns: u64,
    pub phase: Phase,
    /// The window index from which the next refresh may start.
    pub next_refresh: u64,
    /// The last window applied.
    pub last_index: u64,
    /// The sign of the last change (−1, 0, +1).
    pub direction: i8,
    /// Changes of direction so far.
    pub reversals: u32,
    /// The smoothed gradient, in parts per million (0: none yet).
    pub gradient_ppm: u32,
    /// Windows held in the dead zone in a row while the limit was used.
    pub held_windows: u32,
    /// The p95's measured window-to-window noise: the mean absolute
    /// log-change between consecutive windows at an unchanged limit, in
    /// parts per million (0: not measured yet).
    pub noise_ppm: u32,
    /// The anchor (see the module header): the limit the latency descent
    /// in progress began at (0: none).
    pub anchor_milli: u64,
    /// The level the limit comes back to by the largest step (0: none):
    /// the one errors backed it off from, or a descent's anchor that a
    /// refresh found the latency flat below.
    pub recover_milli: u64,
    /// The p95 of the window that started the refresh in progress (0:
    /// unknown), and its latency samples.
    pub refresh_p95_ns: u64,
    pub refresh_samples: u32,
    /// The refresh was started by latency the smoothed gradient called
    /// bad (a descent's floor; at `min`, unhealthy).
    pub refresh_on_bad: bool,
    pub last_move: Move,
    pub inputs: Inputs,
}

impl State {
    /// Before any window: the limit at `max`, no baseline.
    pub fn initial(a: &Adaptive) -> State {
        State {
            limit_milli: u64::from(a.max).saturating_mul(1000),
            baseline_ns: 0,
            phase: Phase::Normal,
            next_refresh: 0,
            last_index: 0,
            direction: 0,
            reversals: 0,
            gradient_ppm: 0,
            held_windows: 0,
            noise_ppm: 0,
            anchor_milli: 0,
            recover_milli: 0,
            refresh_p95_ns: 0,
            refresh_samples: 0,
            refresh_on_bad: false,
            last_move: Move::Idle,
            inputs: Inputs::default(),
        }
    }

    /// The controller's limit in slots, within the current `min`/`max`.
    pub fn limit(&self, a: &Adaptive) -> u32 {
        let slots = (self.limit_milli.saturating_add(500) / 1000).min(u64::from(u32::MAX)) as u32;
        slots.clamp(a.min, a.max.max(a.min))
    }

    /// The standard deviation of a window's p95 (relative) that the
    /// measured noise implies: for two independent normal draws the mean
    /// absolute difference is `2σ/√π`.
    pub fn noise_sd(&self) -> f64 {
        ratio(self.noise_ppm) * std::f64::consts::PI.sqrt() / 2.0
    }

    /// The limit requests see: [`State::limit`], cut during a refresh.
    pub fn cap(&self, a: &Adaptive) -> u32 {
        let limit = self.limit(a);
        match self.phase {
            Phase::Normal => limit,
            Phase::Draining | Phase::Measuring => {
                let share = if self.baseline_ns == 0 {
                    FIRST_REFRESH_CUT_PPM
                } else {
                    REFRESH_CUT_PPM
                };
                let cut = u64::from(limit) * u64::from(share) / u64::from(PPM);
                // A cut its window can measure: twice MIN_SAMPLES at the
                // baseline latency (reservations and level shares leave
                // some of its slots empty).
                let measurable = measurable_limit(a, self.baseline_ns, 2 * MIN_SAMPLES) as u32;
                (cut as u32).max(measurable.min(limit)).max(a.min)
            }
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.push(VERSION);
        for v in [
            self.limit_milli,
            self.baseline_ns,
            self.next_refresh,
            self.last_index,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.push(match self.phase {
            Phase::Normal => 0,
            Phase::Draining => 1,
            Phase::Measuring => 2,
        });
        out.push(self.direction as u8);
        out.extend_from_slice(&self.reversals.to_le_bytes());
        out.extend_from_slice(&self.gradient_ppm.to_le_bytes());
        out.extend_from_slice(&self.noise_ppm.to_le_bytes());
        out.extend_from_slice(&self.refresh_samples.to_le_bytes());
        out.extend_from_slice(&self.held_windows.to_le_bytes());
        out.push(u8::from(self.refresh_on_bad));
        for v in [self.anchor_milli, self.recover_milli, self.refresh_p95_ns] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.push(self.last_move as u8);
        let i = &self.inputs;
        for v in [i.completed, i.error_ppm, i.peak_in_flight, i.cap] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in [i.p95_ns, i.min_ns, i.oldest_queue_ns] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    fn decode(record: &Record<'_>) -> Option<State> {
        if record.kind != kind::CONTROL {
            return None;
        }
        let mut r = table::layout::Reader(record.state);
        let version = r.u8()?;
        if version != VERSION && version != 1 {
            return None;
        }
        let (limit_milli, baseline_ns, next_refresh, last_index) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
        let phase = match r.u8()? {
            0 => Phase::Normal,
            1 => Phase::Draining,
            2 => Phase::Measuring,
            _ => return None,
        };
        let direction = r.u8()? as i8;
        let reversals = r.u32()?;
        let gradient_ppm = r.u32()?;
        let (noise_ppm, refresh_samples, held_windows, refresh_on_bad) = if version == 1 {
            (0, 0, 0, false)
        } else {
            (r.u32()?, r.u32()?, r.u32()?, r.u8()? != 0)
        };
        let (anchor_milli, recover_milli, refresh_p95_ns) = if version == 1 {
            (0, 0, 0)
        } else {
            (r.u64()?, r.u64()?, r.u64()?)
        };
        let last_move = MOVES.get(usize::from(r.u8()?)).copied()?;
        let (completed, error_ppm, peak_in_flight) = (r.u32()?, r.u32()?, r.u32()?);
        let cap = if version == 1 { 0 } else { r.u32()? };
        let (p95_ns, min_ns, oldest_queue_ns) = (r.u64()?, r.u64()?, r.u64()?);
        r.is_empty().then_some(State {
            limit_milli,
            baseline_ns,
            phase,
            next_refresh,
            last_index,
            direction,
            reversals,
            gradient_ppm,
            held_windows,
            noise_ppm,
            anchor_milli,
            recover_milli,
            refresh_p95_ns,
            refresh_samples,
            refresh_on_bad,
            last_move,
            inputs: Inputs {
                completed,
                p95_ns,
                min_ns,
                error_ppm,
                oldest_queue_ns,
                peak_in_flight,
                cap,
            },
        })
    }
}

/// Every [`Move`] by its byte.
const MOVES: [Move; 9] = [
    Move::Idle,
    Move::Held,
    Move::Increase,
    Move::Gradient,
    Move::ErrorBackoff,
    Move::QueueBackoff,
    Move::Refresh,
    Move::Measured,
    Move::Probe,
];

fn ratio(ppm: u32) -> f64 {
    f64::from(ppm) / f64::from(PPM)
}

/// The window index of the next refresh after `index`: `baseline_refresh`
/// in windows, jittered by ±[`REFRESH_JITTER_PPM`] from `seed`.
fn next_refresh(a: &Adaptive, seed: u64, index: u64) -> u64 {
    let windows = (a.baseline_refresh_ns / a.window_ns.max(1)).max(1);
    let spread = windows.saturating_mul(u64::from(REFRESH_JITTER_PPM)) / u64::from(PPM);
    let jitter = splitmix64(seed ^ index) % spread.saturating_mul(2).saturating_add(1);
    index
        .saturating_add(windows)
        .saturating_sub(spread)
        .saturating_add(jitter)
}

/// The least limit whose window holds `samples` completions at the
/// baseline latency, all its slots busy (Little's law): `samples·B/window`.
fn measurable_limit(a: &Adaptive, baseline_ns: u64, samples: u32) -> f64 {
    (f64::from(samples) * baseline_ns as f64 / a.window_ns.max(1) as f64)
        .ceil()
        .min(f64::from(u32::MAX))
}

/// A window's latency samples: its successes and timeouts (what its p95
/// is of).
fn latency_samples(s: &WindowSummary) -> u32 {
    s.successes.saturating_add(s.timeouts)
}

/// A window as the controller judges it (see the module header).
struct Judged {
    /// The limit before the window, in slots (fractional).
    limit: f64,
    lo: f64,
    hi: f64,
    /// The limit after a multiplicative backoff.
    backoff: f64,
    errors_hot: bool,
    /// The window's p95, when it has [`MIN_SAMPLES`] latency samples.
    p95: Option<u64>,
    /// Its latency samples (successes and timeouts).
    samples: u32,
    /// The p95's noise the thresholds allow: `NOISE/√n`, or half the
    /// measured window-to-window standard deviation when larger.
    noise: f64,
    /// The band within which a refresh's two p95s are flat.
    flat_band: f64,
    /// Whether the limit was used (see the module header).
    used: bool,
}

impl Judged {
    fn of(a: &Adaptive, st: &State, s: &WindowSummary) -> Judged {
        let limit = st.limit_milli as f64 / MILLI;
        let lo = f64::from(a.min);
        let hi = f64::from(a.max.max(a.min));
        let samples = latency_samples(s);
        let error_ppm = (s.error_rate() * f64::from(PPM)) as u32;
        // Against the whole slots requests saw (the limit rounded).
        let used =
            s.refused > 0 || f64::from(s.peak_in_flight) >= f64::from(st.limit(a)) * ratio(UTILIZED_PPM);
        // Half a standard deviation of the p95's sampling noise, and the
        // window-to-window standard deviation: measured, or until it is,
        // the sampling one.
        let sampling = NOISE / f64::from(samples.max(1)).sqrt();
        let sd = if st.noise_ppm == 0 {
            2.0 * sampling
        } else {
            st.noise_sd()
        };
        Judged {
            limit,
            lo,
            hi,
            backoff: (limit * ratio(a.backoff_ppm)).clamp(lo, hi),
            errors_hot: s.completed >= MIN_SAMPLES && error_ppm >= a.error_rate_ppm,
            p95: s.p95_ns.filter(|_| samples >= MIN_SAMPLES),
            samples,
            noise: sampling.max(if st.noise_ppm == 0 { 0.0 } else { sd / 2.0 }),
            flat_band: ratio(FLAT_BAND_PPM)
                .max(3.0 * std::f64::consts::SQRT_2 * sd)
                .min(ratio(MAX_FLAT_BAND_PPM)),
            used,
        }
    }

    /// The gradient `B·(1 + b)/p`, within [0.5, 2].
    fn gradient(a: &Adaptive, baseline_ns: u64, p95_ns: u64) -> f64 {
        let buffer = 1.0 + ratio(a.buffer_ppm);
        (baseline_ns as f64 * buffer / p95_ns.max(1) as f64).clamp(0.5, 2.0)
    }

    /// The gradient below which latency is bad: `1 − ε − dz`.
    fn bad_below(&self, a: &Adaptive) -> f64 {
        1.0 - self.noise - ratio(a.dead_zone_ppm)
    }

    /// The least limit latency alone may set: `min`, the level where a
    /// window still holds [`MIN_SAMPLES`] completions at the baseline
    /// latency (Little's law), and `F` of the slots above `min` below the
    /// anchor (`min` is the reservations' and their own slot: the shared
    /// pool is what latency may cut).
    fn floor(&self, a: &Adaptive, baseline_ns: u64, anchor_milli: u64) -> f64 {
        let measurable = measurable_limit(a, baseline_ns, MIN_SAMPLES);
        let anchor = anchor_milli as f64 / MILLI;
        let from = self.lo + (anchor - self.lo).max(0.0) * (1.0 - ratio(DESCENT_STEP_PPM));
        from.max(measurable).max(self.lo).min(self.hi)
    }
}

/// One closed window applied to the state (see the module header). `seed`
/// spreads the refresh jitter (the dependency's name hash). A window not
/// newer than [`State::last_index`] changes nothing.
pub fn step(a: &Adaptive, seed: u64, before: &State, s: &WindowSummary) -> State {
    let mut st = *before;
    if s.index <= st.last_index && st.last_index != 0 {
        return st;
    }
    st.last_index = s.index;
    st.inputs = Inputs {
        completed: s.completed,
        p95_ns: s.p95_ns.unwrap_or(0),
        min_ns: s.min_ns.unwrap_or(0),
        error_ppm: (s.error_rate() * f64::from(PPM)) as u32,
        oldest_queue_ns: s.oldest_queue_ns,
        peak_in_flight: s.peak_in_flight,
        cap: before.cap(a),
    };
    let w = Judged::of(a, before, s);
    let limit = w.limit;
    // The baseline refresh (see the module header).
    match st.phase {
        Phase::Draining | Phase::Measuring if w.errors_hot => {
            st.phase = Phase::Normal;
            st.next_refresh = next_refresh(a, seed, s.index);
            return error_backoff(st, &w);
        }
        Phase::Draining => {
            st.phase = Phase::Measuring;
            return moved(st, limit, limit, Move::Refresh);
        }
        Phase::Measuring => {
            st.phase = Phase::Normal;
            st.next_refresh = next_refresh(a, seed, s.index);
            return measured(a, st, before, &w);
        }
        Phase::Normal => {}
    }
    if w.errors_hot {
        return error_backoff(st, &w);
    }
    let Some(p) = w.p95 else {
        return unmeasured(a, st, s, &w);
    };
    if st.baseline_ns == 0 {
        return refresh(st, latency_samples(s), p);
    }
    judged(a, st, before, s, &w, p)
}

/// A normal window with a p95 and a baseline (see the module header).
fn judged(a: &Adaptive, mut st: State, before: &State, s: &WindowSummary, w: &Judged, p: u64) -> State {
    let limit = w.limit;
    // Two windows at one limit (within a slot or 5 %): their p95s differ
    // by the noise alone.
    let (cap, prev_cap) = (f64::from(st.inputs.cap), f64::from(before.inputs.cap));
    let same = (cap - prev_cap).abs() <= (0.05 * cap).max(1.0);
    if same
        && before.phase == Phase::Normal
        && before.inputs.completed >= MIN_SAMPLES
        && before.inputs.p95_ns > 0
    {
        let d = (p as f64 / before.inputs.p95_ns as f64)
            .ln()
            .abs()
            .min(NOISE_SAMPLE_CAP);
        let prev = ratio(st.noise_ppm);
        st.noise_ppm = ((prev + (d - prev) / 8.0) * f64::from(PPM)) as u32;
    }
    // The gradient is smoothed over windows (an average with the last
    // window's), which halves the noise a single window's p95 carries.
    let now = Judged::gradient(a, st.baseline_ns, p);
    let g = match st.gradient_ppm {
        0 => now,
        prev => (now + ratio(prev)) / 2.0,
    };
    st.gradient_ppm = (g * f64::from(PPM)) as u32;
    let bad = g < w.bad_below(a);
    if !bad && s.index >= st.next_refresh {
        return refresh(st, latency_samples(s), p);
    }
    if bad && s.oldest_queue_ns >= a.queue_age_ns {
        // Queue age behind bad latency: an overload, attributable.
        st.anchor_milli = 0;
        st.recover_milli = 0;
        return moved(st, limit, w.backoff, Move::QueueBackoff);
    }
    if bad {
        // Never past the latest window's own `L·g`: the smoothing may delay
        // a move down, it does not carry the last window's gradient (of a
        // higher limit) below the capacity.
        return descend(a, st, w, p, limit * g.max(now));
    }
    if g < 1.0 - w.noise && w.used && limit <= w.lo + 0.5 {
        // Held at `min` by a latency the baseline calls unhealthy: a
        // refresh judges it (free here: there is nothing to cut).
        let mut st = refresh(st, latency_samples(s), p);
        st.refresh_on_bad = true;
        return st;
    }
    if g < 1.0 - w.noise && w.used {
        // The dead zone is a band, not a wall: after PROBE_WINDOWS held
        // there, one slot more is tried (if it queues, latency says so).
        st.held_windows = st.held_windows.saturating_add(1);
        if st.held_windows >= PROBE_WINDOWS {
            return moved(st, limit, (limit + 1.0).min(w.hi), Move::Probe);
        }
        return moved(st, limit, limit, Move::Held);
    }
    if !w.used {
        return moved(st, limit, limit, Move::Held);
    }
    increase(a, st, w, g)
}

/// Healthy and used: up by the gradient, or back to where errors or a
/// contradicted baseline took the limit from.
fn increase(a: &Adaptive, mut st: State, w: &Judged, g: f64) -> State {
    let limit = w.limit;
    let step_up = (limit * ratio(a.max_increase_ppm)).max(1.0);
    let recover = st.recover_milli as f64 / MILLI;
    let up = if limit < recover {
        // Back to where errors or a wrong baseline took it from, by the
        // largest step.
        recover
    } else {
        // Envoy's gradient `L·g + √(L·g)`, by the smoothing's share, at
        // least one slot (probing one more is always cheap).
        let target = limit * g + (limit * g).sqrt();
        (limit + ratio(a.smoothing_ppm) * (target - limit)).max(limit + 1.0)
    };
    let after = up.min(limit + step_up).clamp(w.lo, w.hi);
    if after * MILLI >= st.anchor_milli as f64 {
        st.anchor_milli = 0;
    }
    if after >= recover {
        st.recover_milli = 0;
    }
    moved(st, limit, after, Move::Increase)
}

/// Starts a baseline refresh (the first, a due one, or a descent's
/// judgement) in a window whose p95 was `p95`.
fn refresh(mut st: State, samples: u32, p95: u64) -> State {
    st.phase = Phase::Draining;
    st.refresh_p95_ns = p95;
    st.refresh_samples = samples;
    st.refresh_on_bad = false;
    let limit = st.limit_milli as f64 / MILLI;
    moved(st, limit, limit, Move::Refresh)
}

/// The multiplicative backoff on errors: attributable to the upstream, so
/// the floor does not apply (the anchor goes); the limit comes back to the
/// level it fell from once the errors stop.
fn error_backoff(mut st: State, w: &Judged) -> State {
    st.anchor_milli = 0;
    st.recover_milli = st.recover_milli.max(st.limit_milli);
    moved(st, w.limit, w.backoff, Move::ErrorBackoff)
}

/// A window with fewer than [`MIN_SAMPLES`] latency samples: held, unless
/// nothing completed while requests waited (a hung upstream: backoff), or
/// the limit is below the level where a window can measure, was used, and
/// what did complete was healthy (one more slot).
fn unmeasured(a: &Adaptive, mut st: State, s: &WindowSummary, w: &Judged) -> State {
    if s.completed == 0 && s.oldest_queue_ns >= a.queue_age_ns {
        st.anchor_milli = 0;
        st.recover_milli = 0;
        return moved(st, w.limit, w.backoff, Move::QueueBackoff);
    }
    let blind = w.limit < w.floor(a, st.baseline_ns, 0);
    let healthy = s.p95_ns.is_some_and(|p| {
        s.errors == 0 && s.timeouts == 0 && Judged::gradient(a, st.baseline_ns, p) >= 1.0 - w.noise
    });
    if st.baseline_ns != 0 && blind && healthy && w.used {
        return moved(st, w.limit, (w.limit + 1.0).min(w.hi), Move::Probe);
    }
    moved(st, w.limit, w.limit, Move::Idle)
}

/// A move down on latency (see the module header): the gradient's, never
/// below the floor under the anchor (the limit this descent began at, or
/// an earlier one not shown to queue); at the floor, while latency is
/// still bad, a refresh judges it.
fn descend(a: &Adaptive, mut st: State, w: &Judged, p95: u64, target: f64) -> State {
    let limit = w.limit;
    if st.anchor_milli == 0 {
        st.anchor_milli = st.limit_milli;
    }
    let floor = w.floor(a, st.baseline_ns, st.anchor_milli);
    if limit <= floor + 0.5 {
        let mut st = refresh(st, w.samples, p95);
        st.refresh_on_bad = true;
        return st;
    }
    // Down twice as fast as up: an overload costs more than spare capacity.
    // Latency objects to the level a recovery was heading for: it ends.
    st.recover_milli = 0;
    let alpha = (2.0 * ratio(a.smoothing_ppm)).min(1.0);
    let after = (limit + alpha * (target - limit))
        .max(limit * 0.5)
        .max(floor)
        .min(limit)
        .clamp(w.lo, w.hi);
    moved(st, limit, after, Move::Gradient)
}

/// The refresh's measuring window (see the module header): `r`, its p95
/// at the cut over the p95 before the cut, says what halving the limit
/// did.
fn measured(a: &Adaptive, mut st: State, before: &State, w: &Judged) -> State {
    let limit = w.limit;
    let Some(p) = w.p95 else {
        // Nothing measured at the cut: the limit comes back, and a descent
        // goes on only from here (the next bad window is no floor's).
        if st.anchor_milli != 0 {
            st.anchor_milli = st.limit_milli;
        }
        return moved(st, limit, limit, Move::Idle);
    };
    st.gradient_ppm = 0;
    if st.baseline_ns == 0 {
        st.baseline_ns = p.max(1);
        return moved(st, limit, limit, Move::Measured);
    }
    let cut = f64::from(before.cap(a));
    let pre = st.refresh_p95_ns;
    let r = if pre == 0 { 1.0 } else { p as f64 / pre as f64 };
    // Flat: within the band; a fall of less than 1.5 times the band is no
    // clear fall either (the window before, when a bad one started the
    // refresh, is a high draw).
    let fell = r < 1.0 - 1.5 * w.flat_band;
    let flat = r <= 1.0 + w.flat_band && !fell;
    // Each window against the old baseline: bad, or merely unhealthy.
    let judge = |p95: u64, below: f64| p95 != 0 && Judged::gradient(a, st.baseline_ns, p95) < below;
    let bad = judge(p, w.bad_below(a));
    let unhealthy = judge(p, 1.0 - w.noise);
    // The window before: bad when a bad smoothed gradient started it.
    let bad_pre = st.refresh_on_bad || judge(pre, w.bad_below(a));
    let unhealthy_pre = st.refresh_on_bad || judge(pre, 1.0 - w.noise);
    // At `min` nothing was cut: the window before measured the same.
    let at_min = cut >= limit;
    if bad && r <= ratio(QUEUED_AT_CUT_PPM) {
        // Bad at the cut, and the cut halved the latency too: the upstream
        // queues even at the cut. The old baseline stays, the limit is the
        // cut.
        st.anchor_milli = 0;
        st.recover_milli = 0;
        return moved(st, limit, cut.min(limit).clamp(w.lo, w.hi), Move::Gradient);
    }
    if flat && (bad_pre || (at_min && unhealthy_pre)) {
        // Latency alone took the limit down (or holds it at `min`) and
        // halving it changed nothing within the noise. Unhealthy at the cut
        // too, the old baseline is contradicted (a quiet start's error, a
        // low draw): the cut's p95 replaces it (at `min`, where nothing was
        // cut, with the window before's), and the limit comes back whole,
        // then to the anchor by the largest step. Healthy at the cut, the
        // verdict is open: the cut's p95 is measured as any refresh's. The
        // anchor moves to L either way: a descent goes on only from here.
        if bad || (at_min && unhealthy) {
            st.baseline_ns = if at_min {
                (p / 2).saturating_add(pre / 2)
            } else {
                p
            }
            .max(1);
            if st.refresh_on_bad {
                st.recover_milli = st.recover_milli.max(st.anchor_milli);
            }
        } else if w.samples >= MIN_BASELINE_SAMPLES {
            st.baseline_ns = refreshed_baseline(st.baseline_ns, p);
        }
        st.anchor_milli = st.limit_milli;
        return moved(st, limit, limit, Move::Measured);
    }
    if unhealthy && r > 1.0 + w.flat_band {
        // Unhealthy at the cut and worse than the window before beyond the
        // noise, although it ran at twice the limit: the upstream got
        // slower meanwhile (a step). The old baseline stays; the limit does
        // not come back past a descent's floor below L, where the next bad
        // window is judged again.
        st.anchor_milli = st.limit_milli;
        st.recover_milli = 0;
        let floor = w.floor(a, st.baseline_ns, st.anchor_milli);
        return moved(st, limit, floor.max(cut).min(limit), Move::Gradient);
    }
    // The cut's p95 measured the upstream unqueued (unless it is bad):
    // averaged with the old baseline (halving its noise) or replacing it
    // beyond ±25 %, as any refresh's.
    // (Flat yet unhealthy, the old baseline is off: it counts with fewer
    // samples too.)
    if !bad && (w.samples >= MIN_BASELINE_SAMPLES || (flat && unhealthy)) {
        st.baseline_ns = refreshed_baseline(st.baseline_ns, p);
    }
    st.anchor_milli = 0;
    if !fell {
        // Flat, or a fall within the noise: the limit comes back (and a
        // recovery goes on).
        return moved(st, limit, limit, Move::Measured);
    }
    // The cut lowered the latency clearly: the window before it queued.
    // The limit goes on down from where it was, by that window's gradient
    // against the baseline.
    st.recover_milli = 0;
    let alpha = (2.0 * ratio(a.smoothing_ppm)).min(1.0);
    let g = Judged::gradient(a, st.baseline_ns, pre);
    let after = (limit + alpha * (limit * g - limit))
        .max(cut)
        .min(limit)
        .clamp(w.lo, w.hi);
    moved(st, limit, after, Move::Gradient)
}

/// A new baseline from a refresh's p95 `measured`: the mean with the old
/// one while they are within [`BASELINE_SHIFT_PPM`] (halving the
/// measurement's noise), the new one alone beyond (the service time
/// really changed).
fn refreshed_baseline(old: u64, measured: u64) -> u64 {
    let measured = measured.max(1);
    if old == 0 {
        return measured;
    }
    let shift = ratio(BASELINE_SHIFT_PPM);
    let r = measured as f64 / old as f64;
    if (1.0 - shift..=1.0 + shift).contains(&r) {
        old / 2 + measured / 2
    } else {
        measured
    }
}

/// Sets the new limit, and the direction and reversal count.
fn moved(mut st: State, before: f64, after: f64, mv: Move) -> State {
    st.limit_milli = (after * MILLI).round().max(0.0) as u64;
    st.last_move = mv;
    if mv != Move::Held {
        st.held_windows = 0;
    }
    let delta = after - before;
    let direction = if delta > 0.5 {
        1
    } else if delta < -0.5 {
        -1
    } else {
        0
    };
    if direction != 0 {
        if st.direction != 0 && direction != st.direction {
            st.reversals = st.reversals.saturating_add(1);
        }
        st.direction = direction;
    }
    st
}

/// The reach of control entries: a fixed key.
const FIXED: Reach<'static> = Reach::Insert {
    is_idle: &|_, _| false,
};

fn decode_state(records: Option<&Records<'_>>) -> Option<State> {
    records?.iter().find_map(State::decode)
}

/// Applies a closed window to the dependency's node-wide state (the
/// closing worker calls it). `Ok(None)`: the window was applied already.
pub fn apply<H: Host>(
    host: &H,
    dep: &Dependency,
    a: &Adaptive,
    summary: &WindowSummary,
    now: u64,
    buffers: &mut table::Buffers,
) -> Result<Option<State>, Failure> {
    let key = control_key(&dep.name);
    let seed = table::fnv1a64(dep.name.as_bytes());
    let updated = table::update(
        host,
        &Place::Fixed { key: &key },
        &FIXED,
        now,
        buffers,
        |records, out| {
            let before = decode_state(records).unwrap_or_else(|| State::initial(a));
            if summary.index <= before.last_index && before.last_index != 0 {
                return (Commit::Skip, None);
            }
            let after = step(a, seed, &before, summary);
            out.push(1);
            push_record_with(out, CONTROL_NAME_HASH, kind::CONTROL, 0, 0, |o| after.encode(o));
            (Commit::Write, Some(after))
        },
    )?;
    Ok(updated.result.filter(|_| updated.written))
}

/// A dependency's node-wide controller state (`None`: none yet, or
/// unreadable).
pub fn read<H: Host>(host: &H, dependency: &str) -> Option<State> {
    let (value, _) = host.shared_get(&control_key(dependency)).ok()?;
    let value = value?;
    let slots = table::decode_entry(&value)?;
    let records = slots.first().and_then(|s| table::decode_records(s.records));
    decode_state(records.as_ref())
}

/// What a worker's tick did for one adaptive dependency (stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticked {
    /// Index into the policy's dependencies.
    pub dependency: usize,
    /// The window this worker closed and applied.
    pub closed: Option<WindowSummary>,
    /// The windows not closed yet, node-wide, after this worker's fold.
    pub running: Option<window::Running>,
    /// The node-wide state as read on this tick.
    pub state: Option<State>,
    /// The limit requests now see on this worker.
    pub cap: Option<u32>,
}

/// A worker's tick for every dependency of `policy` (the glue and the
/// simulation both run this): notes its queues' oldest age, folds its
/// windows and closes the due ones ([`Windows::tick`]), applies a window it
/// closed ([`apply`]), then reads each node-wide state into the worker's
/// [`super::Control`]. A dependency without `adaptive` has its controller
/// limit cleared (a reload that removed it).
pub fn tick<H: Host>(
    host: &H,
    policy: &Policy,
    worker: &mut Worker,
    windows: &mut Windows,
    queue_age_ns: &dyn Fn(&Dependency) -> u64,
    now: u64,
    buffers: &mut table::Buffers,
) -> Vec<Ticked> {
    let mut out = Vec::new();
    for (i, dep) in policy.dependencies.iter().enumerate() {
        let Some(a) = dep.adaptive.as_ref() else {
            if worker.control(&dep.key).limit.is_some() {
                worker.update_control(&dep.key, |c| c.limit = None);
            }
            continue;
        };
        windows.note_queue_age(&dep.name, a.window_ns, queue_age_ns(dep), now);
        let ticked = windows.tick(host, &dep.name, a.window_ns, now);
        let (closed, running) = (ticked.closed, ticked.running);
        if let Some(summary) = &closed {
            if let Err(f) = apply(host, dep, a, summary, now, buffers) {
                // The window is lost to the controller: the limit holds.
                log::debug!("tenantgate: controller state of {} not written: {f:?}", dep.name);
            }
        }
        let state = read(host, &dep.name);
        let cap = state.map(|s| s.cap(a));
        worker.update_control(&dep.key, |c| c.limit = cap);
        out.push(Ticked {
            dependency: i,
            closed,
            running,
            state,
            cap,
        });
    }
    out
}

#[cfg(test)]
mod tests;
