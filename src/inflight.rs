//! The bytes of an in-flight record: who holds how many slots, until when.
//!
//! One record (kind [`kind::IN_FLIGHT`]) per dependency entry or per
//! tenant-share slot. Its state lists one **holder** per worker VM that
//! has published a count, each with the lease it wrote:
//! ```text
//! [version u8 = 1][n u8]  n × ([worker u64][lease_until u64][levels 4 × u32][streams u32])
//! ```
//! (little-endian; levels indexed by `Criticality::index`). At most
//! [`MAX_HOLDERS`] holders: 2,306 bytes. Decoding allocates nothing.
//!
//! Below the engine and admission control: admission writes these records,
//! the engine's key table reach reads their idleness ([`record_is_idle`]).

use crate::keys::kind;
use crate::table::{push_record_with, Record, Records};

/// Its name hash (one record per slot).
pub const IN_FLIGHT_NAME_HASH: u32 = 0x0000_1f11;
const VERSION: u8 = 1;
/// Most worker VMs one record lists (live or not yet dropped).
pub const MAX_HOLDERS: usize = 64;
const HOLDER_LEN: usize = 8 + 8 + 5 * 4;

/// Slots held, by criticality level and as streams.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Non-streaming requests, indexed by `Criticality::index`.
    pub levels: [u32; 4],
    /// Streaming requests (`max_streams`).
    pub streams: u32,
}

impl Counts {
    pub fn is_zero(&self) -> bool {
        *self == Counts::default()
    }

    /// Non-streaming requests in flight.
    pub fn in_flight(&self) -> u32 {
        self.levels.iter().fold(0u32, |a, b| a.saturating_add(*b))
    }

    /// Requests and streams: what a tenant's share counts.
    pub fn total(&self) -> u32 {
        self.in_flight().saturating_add(self.streams)
    }

    fn slot(&mut self, level: usize, streaming: bool) -> Option<&mut u32> {
        if streaming {
            Some(&mut self.streams)
        } else {
            self.levels.get_mut(level)
        }
    }

    /// One more slot (saturating).
    pub fn add(&mut self, level: usize, streaming: bool) {
        if let Some(c) = self.slot(level, streaming) {
            *c = c.saturating_add(1);
        }
    }

    /// One slot fewer; never below zero.
    pub fn sub(&mut self, level: usize, streaming: bool) {
        if let Some(c) = self.slot(level, streaming) {
            *c = c.saturating_sub(1);
        }
    }

    pub fn plus(&self, other: &Counts) -> Counts {
        let mut sum = *self;
        for (a, b) in sum.levels.iter_mut().zip(other.levels) {
            *a = a.saturating_add(b);
        }
        sum.streams = sum.streams.saturating_add(other.streams);
        sum
    }
}

/// One worker's published count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Holder {
    pub worker: u64,
    pub lease_until: u64,
    pub counts: Counts,
}

impl Holder {
    /// Counted by readers at `now`.
    pub fn is_live(&self, now: u64) -> bool {
        self.lease_until >= now && !self.counts.is_zero()
    }
}

/// A decoded holder list, in place.
#[derive(Debug, Clone, Copy)]
pub struct Holders {
    items: [Holder; MAX_HOLDERS],
    len: usize,
}

impl Default for Holders {
    fn default() -> Self {
        Holders {
            items: [Holder::default(); MAX_HOLDERS],
            len: 0,
        }
    }
}

impl core::ops::Deref for Holders {
    type Target = [Holder];
    fn deref(&self) -> &[Holder] {
        self.items.get(..self.len).unwrap_or_default()
    }
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        b.get(at..at.checked_add(8)?)?.try_into().ok()?,
    ))
}

/// Decodes a record's holders (`None`: not an in-flight record of this
/// version, or malformed: the caller starts from an empty list).
pub fn decode(record: &Record<'_>) -> Option<Holders> {
    if record.kind != kind::IN_FLIGHT {
        return None;
    }
    let s = record.state;
    let (&version, rest) = s.split_first()?;
    let (&n, body) = rest.split_first()?;
    let n = usize::from(n);
    if version != VERSION || n > MAX_HOLDERS || body.len() != n.checked_mul(HOLDER_LEN)? {
        return None;
    }
    let mut holders = Holders::default();
    for (i, item) in holders.items.iter_mut().take(n).enumerate() {
        let at = i * HOLDER_LEN;
        let mut levels = [0u32; 4];
        for (j, l) in levels.iter_mut().enumerate() {
            *l = u32_at(body, at + 16 + 4 * j)?;
        }
        *item = Holder {
            worker: u64_at(body, at)?,
            lease_until: u64_at(body, at + 8)?,
            counts: Counts {
                levels,
                streams: u32_at(body, at + 32)?,
            },
        };
    }
    holders.len = n;
    Some(holders)
}

/// The holders of a slot's records (its in-flight record; empty if none).
pub fn of_records(records: Option<&Records<'_>>) -> Holders {
    records
        .and_then(|rs| rs.iter().find(|r| r.kind == kind::IN_FLIGHT).and_then(decode))
        .unwrap_or_default()
}

/// What every live holder but `worker` holds at `now`.
pub fn others(holders: &Holders, worker: u64, now: u64) -> Counts {
    holders
        .iter()
        .filter(|h| h.worker != worker && h.is_live(now))
        .fold(Counts::default(), |sum, h| sum.plus(&h.counts))
}

/// What every live holder holds at `now`.
pub fn live(holders: &Holders, now: u64) -> Counts {
    holders
        .iter()
        .filter(|h| h.is_live(now))
        .fold(Counts::default(), |sum, h| sum.plus(&h.counts))
}

/// Writes the slot's records: one in-flight record listing the live holders
/// but `mine.worker`, then `mine` unless its counts are zero. Expired and
/// empty holders are dropped here: a worker gone for good disappears from
/// the list at the next write by anyone. `false`: the list is full (nothing
/// written to `out`).
pub fn write(holders: &Holders, mine: &Holder, now: u64, out: &mut Vec<u8>) -> bool {
    let kept = holders
        .iter()
        .filter(|h| h.worker != mine.worker && h.is_live(now));
    let n = kept.clone().count() + usize::from(!mine.counts.is_zero());
    let Ok(n8) = u8::try_from(n) else { return false };
    if n > MAX_HOLDERS {
        return false;
    }
    out.push(1);
    push_record_with(out, IN_FLIGHT_NAME_HASH, kind::IN_FLIGHT, 0, 0, |o| {
        o.push(VERSION);
        o.push(n8);
        for h in kept.chain((!mine.counts.is_zero()).then_some(mine)) {
            o.extend_from_slice(&h.worker.to_le_bytes());
            o.extend_from_slice(&h.lease_until.to_le_bytes());
            for l in h.counts.levels {
                o.extend_from_slice(&l.to_le_bytes());
            }
            o.extend_from_slice(&h.counts.streams.to_le_bytes());
        }
    });
    true
}

/// The key table's idleness test for an in-flight record: idle when no
/// holder is live (reclaiming the slot loses no count anyone reads).
pub fn record_is_idle(record: &Record<'_>, now: u64) -> bool {
    decode(record).is_none_or(|h| live(&h, now).is_zero())
}
