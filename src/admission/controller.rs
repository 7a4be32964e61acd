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
//! Pure: time is `now`, and it touches no host (see [`super::adaptive`]).
//!
//! # Where it is
//! The rule above, the state and its limits here; the control law, window
//! by window ([`step`] and its moves), in `controller/law.rs`; the state's
//! bytes in its shared-data record in `controller/record.rs`. Its life in
//! shared data and on the tick is in [`super::adaptive`].

mod law;
mod record;

use super::splitmix64;
use super::window::WindowSummary;
use crate::policy::admission::Adaptive;
use crate::policy::values::PPM;
pub use law::step;

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
pub(super) const CONTROL_NAME_HASH: u32 = 0x0000_1f19;
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
}

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

#[cfg(test)]
mod tests;
