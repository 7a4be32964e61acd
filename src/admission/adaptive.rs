//! The adaptive controllers in shared data: one record per dependency
//! (its [`State`]), stepped once per closed window by the worker that
//! closes it ([`apply`]), read back by every worker ([`read`]) and run on
//! the tick ([`tick`]). The controller's rule itself is pure, in
//! [`super::controller`].

use super::controller::{control_key, step, State, CONTROL_NAME_HASH};
use super::window::{self, WindowSummary, Windows};
use super::Worker;
use crate::host::Host;
use crate::keys::kind;
use crate::policy::admission::{Adaptive, Dependency};
use crate::policy::Policy;
use crate::table::{self, push_record_with, Commit, Failure, Place, Reach, Records};

/// The reach of control entries: a fixed key.
pub(super) const FIXED: Reach<'static> = Reach::Insert {
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
