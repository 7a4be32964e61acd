//! The control law: one closed window applied to the state ([`step`]),
//! move by move, as the module header of [`super`] states it.

use super::{
    latency_samples, measurable_limit, next_refresh, ratio, Inputs, Move, Phase, State, BASELINE_SHIFT_PPM,
    DESCENT_STEP_PPM, FLAT_BAND_PPM, MAX_FLAT_BAND_PPM, MILLI, MIN_BASELINE_SAMPLES, MIN_SAMPLES, NOISE,
    NOISE_SAMPLE_CAP, PROBE_WINDOWS, QUEUED_AT_CUT_PPM, UTILIZED_PPM,
};
use crate::admission::window::WindowSummary;
use crate::policy::admission::Adaptive;
use crate::policy::values::PPM;

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
    against_baseline(a, st, before, w, p)
}

/// A refresh's measuring window with a p95 `p` and a baseline to judge it
/// by: the cut's p95 over the window before's says whether the limit
/// comes back, goes on down, or the baseline is replaced.
fn against_baseline(a: &Adaptive, mut st: State, before: &State, w: &Judged, p: u64) -> State {
    let limit = w.limit;
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
