//! The key table: the one owner of limit state in shared data.
//!
//! Shared data has no delete, so dynamic keys (tenants, client addresses)
//! live in a bounded table of slots ([`layout`] has the bytes and the
//! reasons). This module owns everything else about it: probing, slot
//! placement, idleness (through the caller's test), overflow, and
//! [`update`], the **one compare-and-swap update primitive** that every
//! writer of a slot uses: the engine's charge and refund, and the sync's
//! acknowledgements and leases.
//!
//! # One update
//! An attempt reads the key's entry (its home entry, then the next one:
//! [`PROBES`] in all), decodes it **once**, finds the key's slot, and hands
//! that slot's records to the caller's closure. The closure writes the
//! slot's new records and says how to [`Commit`] them; the entry is
//! re-encoded with that slot replaced and written by compare-and-swap. A
//! conflict retries from the read; after [`MAX_CAS_ATTEMPTS`] attempts the
//! update fails with [`Failure::Exhausted`], which the caller must answer
//! (the engine denies with 503 and counts it: never a silent allow). A
//! best-effort write that conflicts or fails is not retried.
//!
//! # Placement ([`Reach::Insert`])
//! The key's own slot in its home entry or the next; else the first probed
//! entry with a free slot, or with a slot whose every record is idle by the
//! caller's test (reclaiming it loses nothing); else the **overflow** entry
//! of the key's action and plan, one slot shared by every overflowing key
//! ([`TableEvent::Overflow`]): memory stays bounded. An unreadable entry is
//! rebuilt from scratch when a key is placed in it. [`Reach::Existing`]
//! only ever updates the key's own slot ([`Failure::Absent`] otherwise).
//!
//! # Creating an entry
//! An entry that did not exist when read is written with
//! [`Host::shared_create`]. The native module's store creates it only if it
//! is still absent (a conflict retries from the read, like any other), so
//! every update is a compare-and-swap there. Envoy's shared data offers a
//! wasm filter no create-if-absent: a missing key is written
//! unconditionally. So on the wasm filter, two workers that find the same
//! entry missing and write it at once both succeed, and the later write
//! replaces what the earlier one and any update after it stored. It can
//! happen only while an entry does not exist yet: once per entry for the
//! life of the process (entries are never deleted; the table has
//! `key_table_entries` of them), and only inside one worker's read-to-write
//! window of its first update of that entry. What such a race can lose is
//! the charges the other workers wrote to that entry in that window (a
//! limit admits more by at most those); the native module's store, whose
//! racing-threads test catches it, cannot lose them.
//!
//! # Bounds
//! An update makes at most `MAX_CAS_ATTEMPTS × (PROBES + 1)` reads and
//! `MAX_CAS_ATTEMPTS` writes. With [`Buffers`] reused across requests it
//! allocates nothing on the table's side once the buffers have grown to
//! the largest entry (overflow keys are formatted when a key overflows).

pub mod layout;

use crate::host::{CasResult, Host, HostError};
pub use layout::{
    decode_entry, decode_records, encode_entry, fnv1a64, push_record, push_record_with, EntryKey, Record,
    Records, Slot, Slots, MAX_KEY_LEN, MAX_RECORDS, MAX_RECORDS_LEN, PROBES, RECORD_HEADER_LEN,
    SLOTS_PER_ENTRY,
};

/// Attempts of one update (reads and compare-and-swap writes) before it
/// gives up with [`Failure::Exhausted`].
pub const MAX_CAS_ATTEMPTS: u32 = 16;

const PROBE_BUFFERS: usize = PROBES as usize;

/// The slot key of a fixed entry (guards, overflow): it has one slot.
const FIXED_SLOT: &[u8] = b"*";

/// Where a set of limits keeps its state.
#[derive(Debug, Clone, Copy)]
pub enum Place<'a> {
    /// A dynamic key in the key table of `entries` entries.
    Table {
        logical: &'a [u8],
        entries: u64,
        overflow: Overflow<'a>,
    },
    /// A fixed shared-data key with a single slot (a guard).
    Fixed { key: &'a str },
}

/// Whose overflow entry a key falls back to.
#[derive(Debug, Clone, Copy)]
pub struct Overflow<'a> {
    pub action: &'a str,
    pub plan: &'a str,
}

/// Which slots an update may take.
#[derive(Clone, Copy)]
pub enum Reach<'a> {
    /// Only the key's own slot.
    Existing,
    /// The key's own slot, else a free or idle one, else the overflow
    /// entry. `is_idle(record, now)`: the record is back to its fresh state.
    Insert {
        is_idle: &'a dyn Fn(&Record<'_>, u64) -> bool,
    },
}

/// How the closure's new records are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Commit {
    /// Compare-and-swap, retried on conflict.
    Write,
    /// One compare-and-swap; a conflict or a host error is not retried.
    BestEffort,
    /// Nothing to write.
    Skip,
}

/// What happened to the key table for this update (for stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TableEvent {
    #[default]
    None,
    /// The key took a free slot.
    Inserted,
    /// The key took an idle slot from another key.
    Reclaimed,
    /// Every probed slot was busy: the overflow entry was used.
    Overflow,
}

/// A finished update: the closure's result of the last attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Updated<R> {
    pub result: R,
    pub event: TableEvent,
    /// Conflicts retried through.
    pub retries: u32,
    /// Whether the new records were written.
    pub written: bool,
}

/// Why an update did not finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// [`Reach::Existing`]: the key has no slot.
    Absent,
    /// The host failed a read or a write, after `retries` conflicts.
    Unavailable { retries: u32 },
    /// Every one of [`MAX_CAS_ATTEMPTS`] attempts conflicted.
    Exhausted,
    /// The new slot's records would pass [`MAX_RECORDS_LEN`]: nothing was
    /// written (the policy refuses plans that could get there, so this is
    /// a second line of defence, never a truncated write).
    TooLarge,
}

/// Buffers an update reuses (keep one per worker, or per request).
#[derive(Debug, Default)]
pub struct Buffers {
    probed: [Vec<u8>; PROBE_BUFFERS],
    fixed: Vec<u8>,
    overflow_key: String,
    records: Vec<u8>,
    entry: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotChoice {
    Existing(usize),
    Free,
    Reclaim(usize),
}

#[derive(Clone, Copy)]
enum Name<'a> {
    Entry(EntryKey),
    Fixed(&'a str),
}

impl Name<'_> {
    fn as_str(&self) -> &str {
        match self {
            Name::Entry(e) => e.as_str(),
            Name::Fixed(k) => k,
        }
    }
}

/// Where a key's slot is (or will be), as read in one attempt.
struct Target<'a> {
    name: Name<'a>,
    cas: Option<u32>,
    slots: Slots<'a>,
    slot_key: &'a [u8],
    slot: SlotChoice,
    event: TableEvent,
}

/// Updates the key's slot at `place` with `change` (see the module header).
///
/// `change(records, out)` gets the slot's records as stored (`None`: a new
/// slot, or records this version cannot read), appends the slot's new
/// records to the empty `out` (its count byte first, see [`layout`]) and
/// says how to commit them. It runs once per attempt, so it must not keep
/// state across calls.
pub fn update<H: Host, R>(
    host: &H,
    place: &Place<'_>,
    reach: &Reach<'_>,
    now: u64,
    buffers: &mut Buffers,
    mut change: impl FnMut(Option<&Records<'_>>, &mut Vec<u8>) -> (Commit, R),
) -> Result<Updated<R>, Failure> {
    let Buffers {
        probed,
        fixed,
        overflow_key,
        records,
        entry,
    } = buffers;
    for attempt in 0..MAX_CAS_ATTEMPTS {
        let target = match locate(host, place, reach, now, probed, fixed, overflow_key) {
            Ok(Some(target)) => target,
            Ok(None) => return Err(Failure::Absent),
            Err(HostError) => return Err(Failure::Unavailable { retries: attempt }),
        };
        let current = match target.slot {
            SlotChoice::Existing(i) => target.slots.get(i).and_then(|s| decode_records(s.records)),
            SlotChoice::Free | SlotChoice::Reclaim(_) => None,
        };
        records.clear();
        let (commit, result) = change(current.as_ref(), records);
        let mut done = Updated {
            result,
            event: target.event,
            retries: attempt,
            written: false,
        };
        if commit == Commit::Skip {
            return Ok(done);
        }
        let new_slot = Slot {
            key: target.slot_key,
            records,
        };
        let encoded = match target.slot {
            SlotChoice::Existing(i) | SlotChoice::Reclaim(i) => encode_entry(
                target
                    .slots
                    .iter()
                    .enumerate()
                    .map(|(j, s)| if j == i { new_slot } else { *s }),
                entry,
            ),
            SlotChoice::Free => encode_entry(
                target.slots.iter().copied().chain(core::iter::once(new_slot)),
                entry,
            ),
        };
        if !encoded {
            return match commit {
                Commit::BestEffort => Ok(done),
                _ => Err(Failure::TooLarge),
            };
        }
        let written = match target.cas {
            Some(cas) => host.shared_set(target.name.as_str(), entry, Some(cas)),
            None => host.shared_create(target.name.as_str(), entry),
        };
        match written {
            Ok(CasResult::Written) => {
                done.written = true;
                return Ok(done);
            }
            Ok(CasResult::Conflict) | Err(HostError) if commit == Commit::BestEffort => return Ok(done),
            Ok(CasResult::Conflict) => continue,
            Err(HostError) => return Err(Failure::Unavailable { retries: attempt }),
        }
    }
    Err(Failure::Exhausted)
}

/// Whether every record of a slot is idle (unreadable records are).
fn slot_is_idle(slot: &Slot<'_>, now: u64, is_idle: &dyn Fn(&Record<'_>, u64) -> bool) -> bool {
    decode_records(slot.records).is_none_or(|records| records.iter().all(|r| is_idle(r, now)))
}

/// Reads a fixed entry: its one slot, or a fresh entry in its place.
fn fixed_target<'a, H: Host>(
    host: &H,
    key: &'a str,
    buf: &'a mut Vec<u8>,
    event: TableEvent,
) -> Result<Target<'a>, HostError> {
    let cas = host.shared_get_into(key, buf)?;
    let value: &'a Vec<u8> = buf;
    let (slots, slot) = match decode_entry(value).filter(|s| s.len() == 1) {
        Some(slots) => (slots, SlotChoice::Existing(0)),
        None => (Slots::default(), SlotChoice::Free),
    };
    Ok(Target {
        name: Name::Fixed(key),
        cas,
        slots,
        slot_key: FIXED_SLOT,
        slot,
        event,
    })
}

/// Finds the key's slot (see the module header); `None`: not in the table
/// and `reach` is [`Reach::Existing`].
fn locate<'a, H: Host>(
    host: &H,
    place: &Place<'a>,
    reach: &Reach<'_>,
    now: u64,
    probed: &'a mut [Vec<u8>; PROBE_BUFFERS],
    fixed: &'a mut Vec<u8>,
    overflow_key: &'a mut String,
) -> Result<Option<Target<'a>>, HostError> {
    let (logical, entries, overflow) = match *place {
        Place::Fixed { key } => {
            let target = fixed_target(host, key, fixed, TableEvent::None)?;
            let absent = matches!(reach, Reach::Existing) && target.slot == SlotChoice::Free;
            return Ok((!absent).then_some(target));
        }
        Place::Table {
            logical,
            entries,
            overflow,
        } => (logical, entries.max(1), overflow),
    };
    let home = fnv1a64(logical);
    let probes = usize::try_from(PROBES.min(entries)).unwrap_or(PROBE_BUFFERS);
    let mut candidate: Option<Target<'a>> = None;
    for (probe, buf) in (0u64..).zip(probed.iter_mut()).take(probes) {
        let name = EntryKey::new(home.wrapping_add(probe) % entries);
        let cas = host.shared_get_into(name.as_str(), buf)?;
        let value: &'a Vec<u8> = buf;
        let decoded = decode_entry(value);
        let readable = decoded.is_some();
        let slots = decoded.unwrap_or_default();
        if let Some(i) = slots.iter().position(|s| s.key == logical) {
            return Ok(Some(Target {
                name: Name::Entry(name),
                cas,
                slots,
                slot_key: logical,
                slot: SlotChoice::Existing(i),
                event: TableEvent::None,
            }));
        }
        let Reach::Insert { is_idle } = reach else {
            continue;
        };
        if candidate.is_some() {
            continue;
        }
        let choice = if slots.len() < SLOTS_PER_ENTRY {
            Some((SlotChoice::Free, TableEvent::Inserted))
        } else {
            slots
                .iter()
                .position(|s| slot_is_idle(s, now, *is_idle))
                .map(|i| (SlotChoice::Reclaim(i), TableEvent::Reclaimed))
        };
        if let Some((slot, event)) = choice {
            candidate = Some(Target {
                name: Name::Entry(name),
                cas,
                // An unreadable entry is rebuilt from scratch.
                slots: if readable { slots } else { Slots::default() },
                slot_key: logical,
                slot,
                event,
            });
        }
    }
    if candidate.is_some() || matches!(reach, Reach::Existing) {
        return Ok(candidate);
    }
    *overflow_key = crate::keys::overflow(overflow.action, overflow.plan);
    let key: &'a String = overflow_key;
    fixed_target(host, key, fixed, TableEvent::Overflow).map(Some)
}

#[cfg(test)]
mod tests;
