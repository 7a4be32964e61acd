//! The adaptive concurrency controller: per dependency with `adaptive:`,
//! it moves the in-flight limit once per closed window
//! ([`super::window::WindowSummary`]) from the window's p95 latency over a
//! measured baseline, its upstream error rate and its oldest queue age.
//!
//! # The formula (per closed window, `L` the limit before it)
//! With `B` the baseline (the p95 measured at reduced concurrency, below),
//! `p` the window's p95 (successes and timeouts) over `n` of them, `b` =
//! `buffer`, `dz` = `dead_zone`, `α` = `smoothing`, `ε = 0.3/√n` (the
//! p95's sampling noise, [`NOISE`]):
//! ```text
//! g  = clamp(0.5, 2, B·(1 + b) / p)                   the gradient
//! ḡ  = (g + ḡ_previous) / 2                           smoothed over windows
//! errors + timeouts ≥ error_rate of completed    →  L' = L·backoff
//! queue age ≥ queue_age, and ḡ < 1 − ε − dz
//!   or nothing completed (a hung upstream)       →  L' = L·backoff
//! ḡ < 1 − ε − dz                                 →  L' = L + 2α·(L·ḡ − L)   (2α at most 1)
//! 1 − ε − dz ≤ ḡ < 1 − ε                         →  L' = L          (the dead zone)
//! ḡ ≥ 1 − ε and the limit was used               →  L' = L + max(1, α·(L·ḡ + √(L·ḡ) − L))
//! otherwise (idle, < MIN_SAMPLES, unused)        →  L' = L
//! then  L' ≤ L + max(1, L·max_increase),  L' ≥ L/2,  L' = clamp(min, max, L')
//! ```
//! Down moves take twice the smoothing's share of the way up's: an
//! overload costs more than spare capacity. On the way up this is
//! Envoy's gradient (`L·g + √(L·g)`). On the way
//! down its `√(L·g)` headroom is left out: with it the limit settles
//! where `1 − g ≈ 1/√L`, a queue of about `√L` past the capacity (for a
//! capacity of 20, 30 % above it). Without it the limit settles in the
//! dead zone, where the upstream's own queue keeps p95 within about
//! `(1 + b)/(1 − dz)` of the baseline: **5–15 % above the capacity** at
//! the defaults (the simulation in this module's tests measures it: the
//! upstream stays busy, its queue short). "Used": the window refused a
//! request for the limit (or its level's share of it), or its peak in
//! flight reached [`UTILIZED_PPM`] (80 %) of the limit; so a dependency
//! with little demand (fast answers, few requests) does not inflate its
//! limit towards `max`, and one whose traffic is all sheddable (which
//! fills at most 70–80 % of the pool) still rises when it is refused. A queue behind healthy latency is demand, not
//! overload (lowering the limit would only lengthen it), so queue age
//! counts only when latency is unhealthy or nothing completed at all.
//! Windows with fewer than [`MIN_SAMPLES`] completions hold the limit: it
//! neither collapses nor grows while nothing is measured.
//!
//! Defaults (defined once, in [`crate::policy::admission`]): `window`
//! 500 ms, `min` = reservations + 1, `max` = `max_in_flight`, `buffer`
//! 0.02, `dead_zone` 0.04, `smoothing` 0.25, `max_increase` 0.25,
//! `backoff` 0.8, `error_rate` 0.1, `queue_age` 250 ms,
//! `baseline_refresh` 30 s. The limit starts at `max`.
//!
//! # The baseline
//! A baseline measured at high concurrency would call a saturated upstream
//! healthy, so it is measured **at reduced concurrency**: the first window
//! with at least [`MIN_SAMPLES`] completions starts a refresh, and then
//! every `baseline_refresh`, jittered by ±25 % (per dependency and
//! window, so dependencies do not refresh in step). A refresh caps the
//! limit at `max(min, L/2)` ([`REFRESH_CUT_PPM`]; the first, while the
//! limit is still at `max`, at `L/8`: [`FIRST_REFRESH_CUT_PPM`]) for two
//! windows: the first drains the requests admitted at the full limit, the
//! second's p95 is the measurement (with at least [`MIN_BASELINE_SAMPLES`];
//! otherwise the old baseline stays). A measurement within ±25 % of the
//! old baseline is averaged with it (halving its noise); beyond, it
//! replaces it (the service time really changed). A baseline measured
//! while the cut limit was still above the capacity is too high; each
//! later refresh measures at half the limit that baseline led to, so the
//! error shrinks at every refresh. The controller's limit itself is kept
//! through a refresh and given back after it, so a refresh costs at most
//! half the capacity for two windows in every `baseline_refresh` (about
//! 3 % of the time at the defaults), never a collapse; a refresh starts
//! only in a window with traffic, and errors over `error_rate` during it
//! end it with a backoff.
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
use crate::policy::admission::{Adaptive, Dependency, PPM};
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
const CONTROL_NAME_HASH: u32 = 0x0000_1f19;
const VERSION: u8 = 1;
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
            last_move: Move::Idle,
            inputs: Inputs::default(),
        }
    }

    /// The controller's limit in slots, within the current `min`/`max`.
    pub fn limit(&self, a: &Adaptive) -> u32 {
        let slots = (self.limit_milli.saturating_add(500) / 1000).min(u64::from(u32::MAX)) as u32;
        slots.clamp(a.min, a.max.max(a.min))
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
                (cut as u32).max(a.min)
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
        out.push(self.last_move as u8);
        let i = &self.inputs;
        for v in [i.completed, i.error_ppm, i.peak_in_flight] {
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
        if r.u8()? != VERSION {
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
        let last_move = MOVES.get(usize::from(r.u8()?)).copied()?;
        let (completed, error_ppm, peak_in_flight) = (r.u32()?, r.u32()?, r.u32()?);
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
            last_move,
            inputs: Inputs {
                completed,
                p95_ns,
                min_ns,
                error_ppm,
                oldest_queue_ns,
                peak_in_flight,
            },
        })
    }
}

/// Every [`Move`] by its byte.
const MOVES: [Move; 8] = [
    Move::Idle,
    Move::Held,
    Move::Increase,
    Move::Gradient,
    Move::ErrorBackoff,
    Move::QueueBackoff,
    Move::Refresh,
    Move::Measured,
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
    };
    let limit = st.limit_milli as f64 / MILLI;
    let lo = f64::from(a.min);
    let hi = f64::from(a.max.max(a.min));
    let backoff = (limit * ratio(a.backoff_ppm)).clamp(lo, hi);
    let enough = s.completed >= MIN_SAMPLES;
    let errors_hot = enough && st.inputs.error_ppm >= a.error_rate_ppm;
    let latency_samples = s.successes.saturating_add(s.timeouts) >= MIN_SAMPLES;
    let p95 = s.p95_ns.filter(|_| latency_samples);
    // The baseline refresh (see the module header).
    match st.phase {
        Phase::Draining | Phase::Measuring if errors_hot => {
            st.phase = Phase::Normal;
            st.next_refresh = next_refresh(a, seed, s.index);
            return moved(st, limit, backoff, Move::ErrorBackoff);
        }
        Phase::Draining => {
            st.phase = Phase::Measuring;
            return moved(st, limit, limit, Move::Refresh);
        }
        Phase::Measuring => {
            st.phase = Phase::Normal;
            st.next_refresh = next_refresh(a, seed, s.index);
            let baseline_samples = s.successes.saturating_add(s.timeouts) >= MIN_BASELINE_SAMPLES;
            let mv = match p95.filter(|_| baseline_samples || st.baseline_ns == 0) {
                Some(p) => {
                    st.baseline_ns = refreshed_baseline(st.baseline_ns, p);
                    st.gradient_ppm = 0;
                    Move::Measured
                }
                None => Move::Idle,
            };
            return moved(st, limit, limit, mv);
        }
        Phase::Normal => {}
    }
    if errors_hot {
        return moved(st, limit, backoff, Move::ErrorBackoff);
    }
    if p95.is_some() && (st.baseline_ns == 0 || s.index >= st.next_refresh) {
        st.phase = Phase::Draining;
        return moved(st, limit, limit, Move::Refresh);
    }
    let buffer = 1.0 + ratio(a.buffer_ppm);
    let raw = p95.map(|p| (st.baseline_ns as f64 * buffer / p as f64).clamp(0.5, 2.0));
    // The gradient is smoothed over windows (an average with the last
    // window's), which halves the noise a single window's p95 carries.
    let g = raw.map(|g| match st.gradient_ppm {
        0 => g,
        prev => (g + ratio(prev)) / 2.0,
    });
    st.gradient_ppm = g.map_or(st.gradient_ppm, |g| (g * f64::from(PPM)) as u32);
    // Both thresholds allow for the p95's sampling noise, `NOISE/√n`.
    let n = f64::from(s.successes.saturating_add(s.timeouts).max(1));
    let noise = NOISE / n.sqrt();
    let healthy = 1.0 - noise;
    let dead_zone = healthy - ratio(a.dead_zone_ppm);
    let latency_bad = match g {
        Some(g) => g < dead_zone,
        None => s.completed == 0,
    };
    if s.oldest_queue_ns >= a.queue_age_ns && latency_bad {
        return moved(st, limit, backoff, Move::QueueBackoff);
    }
    let alpha = ratio(a.smoothing_ppm);
    // Against the whole slots requests saw (the limit rounded).
    let used = s.refused > 0 || f64::from(s.peak_in_flight) >= f64::from(st.limit(a)) * ratio(UTILIZED_PPM);
    let (target, mv) = match g {
        None => (limit, Move::Idle),
        Some(g) if g < dead_zone => (limit * g, Move::Gradient),
        Some(g) if g < healthy || !used => (limit, Move::Held),
        Some(g) => (limit * g + (limit * g).sqrt(), Move::Increase),
    };
    // Down twice as fast as up: an overload costs more than spare capacity.
    let alpha = if target < limit {
        (2.0 * alpha).min(1.0)
    } else {
        alpha
    };
    let mut smoothed = limit + alpha * (target - limit);
    if mv == Move::Increase {
        // At least one slot: probing one more is always cheap.
        smoothed = smoothed.max(limit + 1.0);
    }
    let step_up = (limit * ratio(a.max_increase_ppm)).max(1.0);
    let bounded = smoothed.min(limit + step_up).max(limit * 0.5).clamp(lo, hi);
    moved(st, limit, bounded, mv)
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
