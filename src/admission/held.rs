//! What this worker holds at each place, and the one update that
//! publishes it: a take (from a permit, or one compare-and-swap that reads
//! every live holder and may take permits too), the record kept in memory,
//! the write with a fresh lease.

use super::{
    failure_reason, holders, Counts, Held, Holder, Worker, INSERT, LEASE_NS, PERMIT_SHARE,
    TENANT_OVERFLOW_PLAN,
};
use crate::engine::Reason;
use crate::host::Host;
use crate::table::{self, Commit, Overflow, Place};

/// What a take decides from the others' counts (`Err`: refused, with the
/// occupancy it saw).
pub(super) type Decide<'a> = &'a dyn Fn(&Counts) -> Result<Taken, (Reason, Counts)>;

/// What a worker publishes at a place ([`Worker::write`]).
pub(super) enum Publish<'a> {
    /// These counts, whatever the others hold (a release, a renewal).
    Exactly(Counts),
    /// What a take decides.
    Checked(Decide<'a>),
}

/// What a take saw and published.
#[derive(Debug, Clone, Copy)]
pub(super) struct Taken {
    /// Every worker's published slots before it, this one's included.
    occupancy: Counts,
    /// What this worker published.
    mine: Counts,
    /// Of those, its permits.
    permits: Counts,
}

/// Permits a place with a `ceiling` can spare at an occupancy of `used`
/// (see [`PERMIT_SHARE`]): none unless `used` plus this request and them
/// stays within a quarter of the ceiling, at most a quarter of it.
pub(super) fn permit_room(ceiling: u64, used: u64) -> u32 {
    let quarter = ceiling / u64::from(PERMIT_SHARE);
    let room = quarter.saturating_sub(used.saturating_add(1));
    u32::try_from(room).unwrap_or(u32::MAX)
}

impl Worker {
    /// One more slot at `key` if `check(others + own)` passes: from a
    /// permit of its level (no shared data), else one update, which may
    /// take permits too (`room`: how many the place can spare at an
    /// occupancy, see [`PERMIT_SHARE`]). `Err`: the reason and the
    /// occupancy it saw.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn take<H: Host>(
        &mut self,
        host: &H,
        key: &str,
        table_entries: Option<u64>,
        overflow_action: &str,
        now: u64,
        level: usize,
        streaming: bool,
        check: &dyn Fn(&Counts) -> Result<(), Reason>,
        room: &dyn Fn(&Counts) -> u32,
    ) -> Result<Counts, (Reason, Counts)> {
        let (own, permits, want) = match self.held.get_mut(key) {
            Some(h) => {
                h.taken = h.taken.saturating_add(1);
                let spare = h.permits.levels.get(level).copied().unwrap_or(0);
                if !streaming && spare > 0 {
                    h.permits.sub(level, false);
                    h.counts.add(level, false);
                    // The occupancy as last seen (a permit reads nothing).
                    let mut seen = Counts::default();
                    if let Some(l) = seen.levels.get_mut(level) {
                        *l = h.occupancy;
                    }
                    return Ok(seen);
                }
                (h.counts, h.permits, h.taken_last)
            }
            None => (Counts::default(), Counts::default(), 0),
        };
        let mut after = own;
        after.add(level, streaming);
        let written = self.write(
            host,
            key,
            table_entries,
            overflow_action,
            now,
            Publish::Checked(&|others| {
                let occupancy = others.plus(&own).plus(&permits);
                check(&occupancy).map_err(|r| (r, occupancy))?;
                let mut spare = permits;
                if !streaming && want > 0 {
                    if let Some(p) = spare.levels.get_mut(level) {
                        *p = p.saturating_add(want.min(room(&occupancy)));
                    }
                }
                Ok(Taken {
                    occupancy,
                    mine: after.plus(&spare),
                    permits: spare,
                })
            }),
        );
        match written {
            Ok(Ok(taken)) => {
                self.set(key, table_entries, overflow_action, after, now, false);
                if let Some(h) = self.held.get_mut(key) {
                    h.permits = taken.permits;
                    h.occupancy = taken.occupancy.total();
                    if h.taken == 0 {
                        h.taken = 1;
                    }
                }
                Ok(taken.occupancy)
            }
            Ok(Err(refused)) => Err(refused),
            Err(reason) => Err((reason, Counts::default())),
        }
    }

    pub(super) fn set(
        &mut self,
        key: &str,
        table_entries: Option<u64>,
        action: &str,
        counts: Counts,
        now: u64,
        dirty: bool,
    ) {
        let lease_until = now.saturating_add(LEASE_NS);
        match self.held.get_mut(key) {
            Some(h) => {
                h.counts = counts;
                if dirty {
                    // Not written: its permits are not published either.
                    h.permits = Counts::default();
                }
                h.dirty = dirty;
                if !dirty {
                    h.lease_until = lease_until;
                    // Where it was last written (a reload may resize the
                    // key table: a count left at the old place expires
                    // with its lease).
                    h.table_entries = table_entries;
                    if h.overflow_action != action {
                        action.clone_into(&mut h.overflow_action);
                    }
                }
            }
            None => {
                self.held.insert(
                    key.to_owned(),
                    Held {
                        table_entries,
                        overflow_action: action.to_owned(),
                        counts,
                        permits: Counts::default(),
                        taken: 0,
                        taken_last: 0,
                        occupancy: 0,
                        lease_until: if dirty { 0 } else { lease_until },
                        dirty,
                    },
                );
            }
        }
    }

    /// The one update of a place: reads every holder, decides what this
    /// worker publishes ([`Publish`]; a refusal writes nothing), writes it
    /// with a fresh lease.
    pub(super) fn write<H: Host>(
        &mut self,
        host: &H,
        key: &str,
        table_entries: Option<u64>,
        overflow_action: &str,
        now: u64,
        publish: Publish<'_>,
    ) -> Result<Result<Taken, (Reason, Counts)>, Reason> {
        let place = match table_entries {
            None => Place::Fixed { key },
            Some(entries) => Place::Table {
                logical: key.as_bytes(),
                entries,
                overflow: Overflow {
                    action: overflow_action,
                    plan: TENANT_OVERFLOW_PLAN,
                },
            },
        };
        let worker = self.id;
        let updated = table::update(host, &place, &INSERT, now, &mut self.buffers, |records, out| {
            let listed = holders::of_records(records);
            let others = holders::others(&listed, worker, now);
            let verdict = match &publish {
                Publish::Checked(check) => check(&others),
                Publish::Exactly(mine) => Ok(Taken {
                    occupancy: others,
                    mine: *mine,
                    permits: Counts::default(),
                }),
            };
            let Ok(taken) = verdict else {
                return (Commit::Skip, Ok(verdict));
            };
            let me = Holder {
                worker,
                lease_until: now.saturating_add(LEASE_NS),
                counts: taken.mine,
            };
            if !holders::write(&listed, &me, now, out) {
                return (Commit::Skip, Err(Reason::StateUnavailable));
            }
            (Commit::Write, Ok(Ok(taken)))
        });
        match updated {
            Ok(u) => u.result,
            Err(f) => Err(failure_reason(f)),
        }
    }
}
