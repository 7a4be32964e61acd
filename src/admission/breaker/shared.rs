//! A breaker's life in shared data: its record's bytes, the entry made on
//! configure, the tick's read and fold (the judgement of a closed signal
//! window), the half-open probe tickets taken and given back, all through
//! [`crate::table::update`]; and [`tick`], a worker's whole breaker step.
//! The state machine they apply is [`super::Breaker`]'s.

use super::{Breaker, Observed, Phase, Transitions, ENCODED_LEN, VERSION};
use crate::admission::window::{WindowSummary, Windows};
use crate::admission::{ProbeEvents, Worker};
use crate::host::Host;
use crate::keys::kind;
use crate::policy::admission::BreakerSettings;
use crate::policy::Policy;
use crate::table::{self, push_record_with, Commit, Failure, Place, Reach, Records};

/// The record's bytes (little-endian):
/// `[version u8][phase u8][reopens u32][since u64][until u64][window_start u64][completed u64][failures u64][probes_taken u32][empty_folds u8]`.
pub fn encode(b: &Breaker, out: &mut Vec<u8>) {
    out.push(VERSION);
    out.push(b.phase as u8);
    out.extend_from_slice(&b.reopens.to_le_bytes());
    for v in [
        b.since,
        b.until,
        b.window_start,
        b.window.completed,
        b.window.failures,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&b.probes_taken.to_le_bytes());
    out.push(b.empty_folds);
}

/// Decodes a record's state (`None`: another version or malformed: the
/// breaker starts closed).
pub fn decode(state: &[u8]) -> Option<Breaker> {
    if state.len() != ENCODED_LEN || state.first() != Some(&VERSION) {
        return None;
    }
    let mut r = table::layout::Reader(state.get(1..)?);
    let phase = Phase::from_u8(r.u8()?)?;
    let reopens = r.u32()?;
    let (since, until, window_start) = (r.u64()?, r.u64()?, r.u64()?);
    let window = Observed {
        completed: r.u64()?,
        failures: r.u64()?,
    };
    Some(Breaker {
        phase,
        since,
        until,
        reopens,
        window_start,
        window,
        probes_taken: r.u32()?,
        empty_folds: r.u8()?,
    })
}

fn of_records(records: Option<&Records<'_>>) -> Option<Breaker> {
    records?
        .iter()
        .find(|r| r.kind == kind::BREAKER)
        .and_then(|r| decode(r.state))
}

fn write(b: &Breaker, out: &mut Vec<u8>) {
    out.push(1);
    push_record_with(out, 0, kind::BREAKER, 0, 0, |o| encode(b, o));
}

const EXISTING_OR_NEW: Reach<'static> = Reach::Insert {
    is_idle: &|_, _| false,
};

/// Creates the breaker's entry, closed, if it is absent (on configure:
/// shared data has no create-if-absent, see [`crate::admission::Worker::prepare`]).
pub fn prepare<H: Host>(host: &H, key: &str, now: u64, buffers: &mut table::Buffers) {
    let _ = table::update(
        host,
        &Place::Fixed { key },
        &EXISTING_OR_NEW,
        now,
        buffers,
        |records, out| {
            if records.is_some() {
                return (Commit::Skip, ());
            }
            write(&fresh(now), out);
            (Commit::BestEffort, ())
        },
    );
}

fn fresh(now: u64) -> Breaker {
    Breaker {
        window_start: now,
        ..Breaker::default()
    }
}

/// The node's breaker as stored (`None`: shared data could not be read;
/// an absent or unreadable entry is a closed breaker whose window starts
/// at `now`).
pub fn read<H: Host>(host: &H, key: &str, now: u64) -> Option<Breaker> {
    let (value, _) = host.shared_get(key).ok()?;
    let Some(value) = value else {
        return Some(fresh(now));
    };
    let slots = table::decode_entry(&value);
    let records = slots
        .as_ref()
        .and_then(|s| s.first())
        .and_then(|s| table::decode_records(s.records));
    Some(of_records(records.as_ref()).unwrap_or(fresh(now)))
}

/// A fold's result: the breaker as written and the transitions it made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Folded {
    pub breaker: Breaker,
    pub transitions: Transitions,
}

/// Adds `seen` (one worker's stream ends since its last fold; may be
/// empty: a fold also makes time-based transitions) to the node's
/// breaker, by compare-and-swap. `Err`: nothing written (the caller keeps
/// `seen` for its next tick).
pub fn fold<H: Host>(
    host: &H,
    key: &str,
    s: &BreakerSettings,
    seen: Observed,
    now: u64,
    seed: u64,
    buffers: &mut table::Buffers,
) -> Result<Folded, Failure> {
    let (breaker, transitions) = change(host, key, now, buffers, |b| b.observe(s, seen, now, seed))?;
    Ok(Folded { breaker, transitions })
}

/// [`Breaker::judge_early`] on the node's breaker, by compare-and-swap
/// (nothing written unless it opens). `Err`: nothing written.
pub fn judge<H: Host>(
    host: &H,
    key: &str,
    s: &BreakerSettings,
    running: Observed,
    now: u64,
    seed: u64,
    buffers: &mut table::Buffers,
) -> Result<Folded, Failure> {
    let (breaker, transitions) = change(host, key, now, buffers, |b| {
        let mut made = Transitions::default();
        if let Some(t) = b.judge_early(s, running, now, seed) {
            made.push(t);
        }
        made
    })?;
    Ok(Folded { breaker, transitions })
}

/// A probe ticket's answer: whether one was taken, and the breaker after
/// it (so the caller's copy is fresh).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    pub taken: bool,
    pub breaker: Breaker,
    /// This write made the open → half-open transition (count it).
    pub half_opened: bool,
}

impl Probe {
    /// The half-open period the ticket belongs to (its start).
    pub fn period(&self) -> u64 {
        self.breaker.since
    }
}

/// Takes a half-open probe ticket node-wide.
pub fn take_probe<H: Host>(
    host: &H,
    key: &str,
    s: &BreakerSettings,
    now: u64,
    buffers: &mut table::Buffers,
) -> Result<Probe, Failure> {
    let (breaker, (taken, was_open)) = change(host, key, now, buffers, |b| {
        let was_open = b.phase == Phase::Open;
        (b.take_probe(s, now), was_open)
    })?;
    Ok(Probe {
        taken,
        breaker,
        half_opened: taken && was_open,
    })
}

/// Gives back a probe ticket of the half-open period `period` node-wide
/// (see [`Breaker::give_back`]): its request was refused after it took the
/// ticket. `Err`: nothing written (the ticket is then lost to its period,
/// which the lost-probe rule ends).
pub fn give_back_probe<H: Host>(
    host: &H,
    key: &str,
    period: u64,
    now: u64,
    buffers: &mut table::Buffers,
) -> Result<bool, Failure> {
    change(host, key, now, buffers, |b| b.give_back(period)).map(|(_, given)| given)
}

/// One compare-and-swap on the node's breaker, the only way it is
/// written: `f` changes it; written only if it changed (or there was no
/// record). Returns the breaker after `f` and what `f` said.
fn change<H: Host, R>(
    host: &H,
    key: &str,
    now: u64,
    buffers: &mut table::Buffers,
    f: impl Fn(&mut Breaker) -> R,
) -> Result<(Breaker, R), Failure> {
    let updated = table::update(
        host,
        &Place::Fixed { key },
        &EXISTING_OR_NEW,
        now,
        buffers,
        |records, out| {
            let mut b = of_records(records).unwrap_or(fresh(now));
            let before = b;
            let said = f(&mut b);
            if b == before && records.is_some() {
                return (Commit::Skip, (b, said));
            }
            write(&b, out);
            (Commit::Write, (b, said))
        },
    )?;
    Ok(updated.result)
}

/// What a worker's tick did for one dependency with a breaker (stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticked {
    /// Index into the policy's dependencies.
    pub dependency: usize,
    /// The node's breaker as this worker now holds it (`None`: shared data
    /// could not be read; the worker keeps its last copy).
    pub breaker: Option<Breaker>,
    /// The transitions this worker's fold made (each is made by one worker).
    pub transitions: Transitions,
    /// The probe tickets this worker took since its last tick.
    pub probes: ProbeEvents,
}

impl From<&WindowSummary> for Observed {
    fn from(w: &WindowSummary) -> Observed {
        Observed {
            completed: u64::from(w.completed),
            failures: u64::from(w.errors).saturating_add(u64::from(w.timeouts)),
        }
    }
}

/// A worker's tick for every dependency of `policy` with a breaker (the
/// glue and the tests both run this), after [`crate::admission::adaptive::tick`]: the
/// window this worker closed (for an adaptive dependency, the one the
/// controller's tick closed, in `controlled`; otherwise its own
/// [`Windows::tick`] closes it) is folded into the node's breaker
/// ([`fold`]); the breaker then goes into the worker's
/// [`crate::admission::Control`]. A dependency without a breaker has its copy cleared
/// (a reload that removed it).
pub fn tick<H: Host>(
    host: &H,
    policy: &Policy,
    worker: &mut Worker,
    windows: &mut Windows,
    controlled: &[crate::admission::adaptive::Ticked],
    now: u64,
    buffers: &mut table::Buffers,
) -> Vec<Ticked> {
    let mut out = Vec::new();
    for (i, dep) in policy.dependencies.iter().enumerate() {
        let (Some(s), Some(window_ns)) = (dep.breaker.as_ref(), dep.signal_window_ns()) else {
            if worker.control(&dep.key).breaker.is_some() {
                worker.update_control(&dep.key, |c| c.breaker = None);
            }
            continue;
        };
        let (closed, running) = if dep.adaptive.is_some() {
            controlled
                .iter()
                .find(|t| t.dependency == i)
                .map_or((None, None), |t| (t.closed, t.running))
        } else {
            let t = windows.tick(host, &dep.name, window_ns, now);
            (t.closed, t.running)
        };
        let seed = worker.id() ^ now.rotate_left(17);
        let folded = match (closed, running) {
            (Some(w), _) => fold(host, &dep.breaker_key, s, Observed::from(&w), now, seed, buffers).ok(),
            // Judged early only when this worker's copy says it would open
            // (a compare-and-swap only then).
            (None, Some(r)) => {
                let running = Observed {
                    completed: r.completed,
                    failures: r.failures,
                };
                // (No copy yet, the worker's first tick: judged by the CAS.)
                let copy = worker.control(&dep.key).breaker;
                let trips = copy.is_none_or(|mut b| b.judge_early(s, running, now, seed).is_some());
                if trips {
                    judge(host, &dep.breaker_key, s, running, now, seed, buffers).ok()
                } else {
                    None
                }
            }
            (None, None) => None,
        };
        let (breaker, transitions) = match folded {
            Some(f) => (Some(f.breaker), f.transitions),
            // Not the closer, or its fold failed (that window is then lost
            // to the breaker: it stays as it is).
            None => (read(host, &dep.breaker_key, now), Transitions::default()),
        };
        if let Some(b) = breaker {
            worker.update_control(&dep.key, |c| c.breaker = Some(b));
        }
        out.push(Ticked {
            dependency: i,
            breaker,
            transitions,
            probes: worker.take_probe_events(&dep.key),
        });
    }
    out
}
