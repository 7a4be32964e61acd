//! The node's sync state as it lives in Envoy shared data, so every worker
//! VM of a node sees the same leases: small fixed binary encodings
//! (little-endian, versioned), never JSON.
//!
//! * Per (key, global limit): an [`Allowance`], stored as the record of
//!   that limit (kind [`kind::GLOBAL_ALLOWANCE`]) in the key's key-table
//!   slot, so it is updated by the same compare-and-swap as the key's
//!   other limits, all or nothing.
//! * Node-global: the [`SyncState`] under [`SYNC_STATE_KEY`] (sequence
//!   numbers, the report in flight, contact), which the worker that wins an
//!   interval updates by compare-and-swap.
//! * What the report in flight carried, under [`SYNC_CARRIED_KEY`]: per
//!   (key, limit) the counts it reported and how much had been admitted on
//!   leases when it was built. Kept apart from [`SYNC_STATE_KEY`] so the
//!   small key every worker reads each tick stays small.
//!
//! [`kind::GLOBAL_ALLOWANCE`]: crate::keys::kind::GLOBAL_ALLOWANCE

use core::num::NonZeroU64;

use super::cycle::{Applying, InFlight, Retry, SyncState};
use super::node::{Allowance, Counts, LeaseState};
use crate::table::layout::Reader;

/// The node-global sync state.
pub const SYNC_STATE_KEY: &str = crate::keys::SYNC_STATE;
/// What the report in flight carried.
pub const SYNC_CARRIED_KEY: &str = crate::keys::SYNC_CARRIED;

const ALLOWANCE_VERSION: u8 = 1;
/// An allowance with how full the service's bucket was (a `u16` last):
/// written only when the service said, so a record without it reads the
/// same in a release that does not know it.
const ALLOWANCE_VERSION_BUCKET: u8 = 2;
const SYNC_VERSION: u8 = 1;
const CARRIED_VERSION: u8 = 1;

const HAS_LEASE: u8 = 1;
const HAS_LOCAL: u8 = 2;
const HAS_AWAIT: u8 = 4;
const HAS_DEMAND_AT: u8 = 8;
/// The exact share follows (absent: 0, as written before it existed).
const HAS_SHARE_MILLI: u8 = 16;
/// The outage allowance follows, even when 0 (absent: none, as written
/// before it existed).
const HAS_OUTAGE: u8 = 32;
/// When the key started follows (until its first lease).
const HAS_STARTED: u8 = 64;
/// What a late-settled cost left owed follows (absent: 0).
const HAS_OWED: u8 = 128;

fn put(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn read_counts(r: &mut Reader<'_>) -> Option<Counts> {
    Some(Counts {
        consumed: r.u64()?,
        unleased: r.u64()?,
        demand: r.u64()?,
    })
}

fn put_counts(out: &mut Vec<u8>, c: &Counts) {
    put(out, c.consumed);
    put(out, c.unleased);
    put(out, c.demand);
}

/// The most bytes [`encode_allowance`] writes (the policy reserves this
/// much of a key's slot for each global limit; tested below).
pub use crate::policy::MAX_ALLOWANCE_LEN;

/// `[version][flags] [tokens_left expires_at]? provisional_left consumed
/// unleased demand lease_used share [local_tat]? [awaiting_since]?
/// [last_demand_at]? [share_milli]? [outage_milli]? [started_at]? [owed]?
/// [bucket_milli: u16, version 2 only]`
pub fn encode_allowance(a: &Allowance, out: &mut Vec<u8>) {
    out.push(if a.bucket_milli.is_some() {
        ALLOWANCE_VERSION_BUCKET
    } else {
        ALLOWANCE_VERSION
    });
    let flags = if a.lease.is_some() { HAS_LEASE } else { 0 }
        | if a.local_tat.is_some() { HAS_LOCAL } else { 0 }
        | if a.awaiting_since.is_some() { HAS_AWAIT } else { 0 }
        | if a.last_demand_at.is_some() {
            HAS_DEMAND_AT
        } else {
            0
        }
        | if a.share_milli > 0 { HAS_SHARE_MILLI } else { 0 }
        | if a.outage_milli.is_some() { HAS_OUTAGE } else { 0 }
        | if a.started_at.is_some() { HAS_STARTED } else { 0 }
        | if a.owed > 0 { HAS_OWED } else { 0 };
    out.push(flags);
    if let Some(l) = a.lease {
        put(out, l.tokens_left);
        put(out, l.expires_at);
    }
    put(out, a.provisional_left);
    put_counts(out, &a.pending);
    put(out, a.lease_used);
    put(out, a.share);
    if let Some(t) = a.local_tat {
        put(out, t);
    }
    if let Some(t) = a.awaiting_since {
        put(out, t);
    }
    if let Some(t) = a.last_demand_at {
        put(out, t);
    }
    if a.share_milli > 0 {
        put(out, a.share_milli);
    }
    if let Some(v) = a.outage_milli {
        put(out, v);
    }
    if let Some(v) = a.started_at {
        put(out, v.get());
    }
    if a.owed > 0 {
        put(out, a.owed);
    }
    if let Some(v) = a.bucket_milli {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// `None` for anything that is not a whole, well-formed allowance.
pub fn decode_allowance(bytes: &[u8]) -> Option<Allowance> {
    let mut r = Reader(bytes);
    let with_bucket = match r.u8()? {
        ALLOWANCE_VERSION => false,
        ALLOWANCE_VERSION_BUCKET => true,
        _ => return None,
    };
    let flags = r.u8()?;
    // Every bit of `flags` names a field (HAS_OWED is the eighth).
    let lease = if flags & HAS_LEASE != 0 {
        Some(LeaseState {
            tokens_left: r.u64()?,
            expires_at: r.u64()?,
        })
    } else {
        None
    };
    let a = Allowance {
        lease,
        provisional_left: r.u64()?,
        pending: read_counts(&mut r)?,
        lease_used: r.u64()?,
        share: r.u64()?,
        local_tat: r.opt_u64(flags & HAS_LOCAL != 0)?,
        awaiting_since: r.opt_u64(flags & HAS_AWAIT != 0)?,
        last_demand_at: r.opt_u64(flags & HAS_DEMAND_AT != 0)?,
        share_milli: r.opt_u64(flags & HAS_SHARE_MILLI != 0)?.unwrap_or(0),
        outage_milli: r.opt_u64(flags & HAS_OUTAGE != 0)?,
        started_at: r.opt_u64(flags & HAS_STARTED != 0)?.and_then(NonZeroU64::new),
        owed: r.opt_u64(flags & HAS_OWED != 0)?.unwrap_or(0),
        bucket_milli: if with_bucket { Some(r.u16()?) } else { None },
    };
    r.is_empty().then_some(a)
}

const IN_FLIGHT: u8 = 1;
const CONTACT: u8 = 2;
const APPLIED: u8 = 4;
const REPORTED: u8 = 8;
const FAILURES: u8 = 16;
const OPEN: u8 = 32;
const APPLYING: u8 = 64;
/// A retry is due or in flight, or the report in flight is hedged: one
/// more byte, its low two bits the retry (1 due, 2 in flight: [`Retry`]),
/// bit 2 the hedge ([`InFlight::hedged`]).
const EXTRA: u8 = 128;
const EXTRA_RETRY_DUE: u8 = 1;
const EXTRA_RETRY_IN_FLIGHT: u8 = 2;
const EXTRA_HEDGED: u8 = 4;

/// `[version][flags] next_seq acked_seq interval_ns [seq sent_at]?
/// [contact_until]? [last_applied_at]? [last_report_at]? [failures]?
/// [open_until]? [applying_seq applying_since]? [extra: u8]?` (the
/// breaker's fields only when set; `extra`, the retry and the hedge, since
/// issue 35: a filter older than it reads a state with a retry or a hedge
/// as unreadable and starts afresh).
pub fn encode_sync_state(s: &SyncState, out: &mut Vec<u8>) {
    out.clear();
    out.push(SYNC_VERSION);
    let flag = |set: bool, bit: u8| if set { bit } else { 0 };
    let extra = match s.retry {
        Retry::None => 0,
        Retry::Due => EXTRA_RETRY_DUE,
        Retry::InFlight => EXTRA_RETRY_IN_FLIGHT,
    } | flag(s.in_flight.is_some_and(|f| f.hedged), EXTRA_HEDGED);
    out.push(
        flag(s.in_flight.is_some(), IN_FLIGHT)
            | flag(s.contact_until.is_some(), CONTACT)
            | flag(s.last_applied_at.is_some(), APPLIED)
            | flag(s.last_report_at.is_some(), REPORTED)
            | flag(s.failures > 0, FAILURES)
            | flag(s.open_until.is_some(), OPEN)
            | flag(s.applying.is_some(), APPLYING)
            | flag(extra != 0, EXTRA),
    );
    put(out, s.next_seq);
    put(out, s.acked_seq);
    put(out, s.interval_ns);
    if let Some(f) = s.in_flight {
        put(out, f.seq);
        put(out, f.sent_at);
    }
    let failures = (s.failures > 0).then_some(u64::from(s.failures));
    for v in [
        s.contact_until,
        s.last_applied_at,
        s.last_report_at,
        failures,
        s.open_until,
    ]
    .into_iter()
    .flatten()
    {
        put(out, v);
    }
    if let Some(a) = s.applying {
        put(out, a.seq);
        put(out, a.since);
    }
    if extra != 0 {
        out.push(extra);
    }
}

pub fn decode_sync_state(bytes: &[u8]) -> Option<SyncState> {
    let mut r = Reader(bytes);
    if r.u8()? != SYNC_VERSION {
        return None;
    }
    let flags = r.u8()?;
    let next_seq = r.u64()?;
    let acked_seq = r.u64()?;
    let interval_ns = r.u64()?;
    let in_flight = if flags & IN_FLIGHT != 0 {
        Some(InFlight {
            seq: r.u64()?,
            sent_at: r.u64()?,
            hedged: false,
        })
    } else {
        None
    };
    let mut s = SyncState {
        next_seq,
        acked_seq,
        in_flight,
        interval_ns: interval_ns.max(1),
        contact_until: r.opt_u64(flags & CONTACT != 0)?,
        last_applied_at: r.opt_u64(flags & APPLIED != 0)?,
        last_report_at: r.opt_u64(flags & REPORTED != 0)?,
        failures: u32::try_from(r.opt_u64(flags & FAILURES != 0)?.unwrap_or(0)).ok()?,
        open_until: r.opt_u64(flags & OPEN != 0)?,
        applying: if flags & APPLYING != 0 {
            Some(Applying {
                seq: r.u64()?,
                since: r.u64()?,
            })
        } else {
            None
        },
        retry: Retry::None,
    };
    if flags & EXTRA != 0 {
        let extra = r.u8()?;
        s.retry = match extra & (EXTRA_RETRY_DUE | EXTRA_RETRY_IN_FLIGHT) {
            0 => Retry::None,
            EXTRA_RETRY_DUE => Retry::Due,
            EXTRA_RETRY_IN_FLIGHT => Retry::InFlight,
            _ => return None,
        };
        if extra & !(EXTRA_RETRY_DUE | EXTRA_RETRY_IN_FLIGHT | EXTRA_HEDGED) != 0 {
            return None;
        }
        if extra & EXTRA_HEDGED != 0 {
            s.in_flight.as_mut()?.hedged = true;
        }
    }
    r.is_empty().then_some(s)
}

/// One (key, limit) a report carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Carried {
    /// The logical key (the key-table slot's key).
    pub key: Vec<u8>,
    pub name_hash: u32,
    pub counts: Counts,
    /// The allowance's `lease_used` when the report was built.
    pub lease_used: u64,
}

/// `[version] seq n × ([key_len u8][key][name_hash u32] consumed unleased
/// demand lease_used)`
pub fn encode_carried(seq: u64, items: &[Carried], out: &mut Vec<u8>) {
    out.clear();
    out.push(CARRIED_VERSION);
    put(out, seq);
    for c in items {
        out.push(c.key.len().min(255) as u8);
        out.extend_from_slice(&c.key[..c.key.len().min(255)]);
        out.extend_from_slice(&c.name_hash.to_le_bytes());
        put_counts(out, &c.counts);
        put(out, c.lease_used);
    }
}

/// The `seq` of the report whose carried counts `bytes` hold, without
/// decoding them.
pub fn carried_seq(bytes: &[u8]) -> Option<u64> {
    let mut r = Reader(bytes);
    if r.u8()? != CARRIED_VERSION {
        return None;
    }
    r.u64()
}

pub fn decode_carried(bytes: &[u8]) -> Option<(u64, Vec<Carried>)> {
    let mut r = Reader(bytes);
    if r.u8()? != CARRIED_VERSION {
        return None;
    }
    let seq = r.u64()?;
    let mut items = Vec::new();
    while !r.is_empty() {
        let len = usize::from(r.u8()?);
        let key = r.take(len)?.to_vec();
        items.push(Carried {
            key,
            name_hash: r.u32()?,
            counts: read_counts(&mut r)?,
            lease_used: r.u64()?,
        });
    }
    Some((seq, items))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowances_sync_states_and_carried_reports_round_trip() {
        let mut a = Allowance::fresh(2);
        a.pending.demand = 5;
        a.lease = Some(LeaseState {
            tokens_left: 7,
            expires_at: 99,
        });
        a.local_tat = Some(3);
        a.awaiting_since = Some(4);
        a.last_demand_at = Some(5);
        a.share_milli = 185;
        a.outage_milli = Some(0);
        a.started_at = NonZeroU64::new(6);
        a.owed = 8;
        a.bucket_milli = Some(420);
        let mut full = Vec::new();
        encode_allowance(&a, &mut full);
        assert_eq!(full.len(), MAX_ALLOWANCE_LEN, "every optional field set");
        assert_eq!(full[0], ALLOWANCE_VERSION_BUCKET);
        // Written before the exact share, the outage allowance and the
        // bucket's level existed (no flags, version 1): read as 0 and none.
        let mut older = a;
        older.share_milli = 0;
        older.outage_milli = None;
        older.started_at = None;
        older.owed = 0;
        older.bucket_milli = None;
        let mut out = Vec::new();
        encode_allowance(&older, &mut out);
        assert_eq!(out.len(), MAX_ALLOWANCE_LEN - 34);
        assert_eq!(out[0], ALLOWANCE_VERSION);
        let decoded = decode_allowance(&out);
        assert_eq!(
            decoded.map(|d| (d.share_milli, d.outage_milli, d.bucket_milli)),
            Some((0, None, None))
        );
        // A version this release does not know reads as nothing.
        let mut newer = full.clone();
        newer[0] = 3;
        assert_eq!(decode_allowance(&newer), None);
        for a in [Allowance::fresh(2), a] {
            let mut out = Vec::new();
            encode_allowance(&a, &mut out);
            assert_eq!(decode_allowance(&out), Some(a));
            assert!(out.len() <= MAX_ALLOWANCE_LEN);
            for cut in 0..out.len() {
                assert_eq!(decode_allowance(&out[..cut]), None);
            }
        }
        let mut s = SyncState::new(1_000, 10, 5);
        let mut out = Vec::new();
        encode_sync_state(&s, &mut out);
        assert_eq!(decode_sync_state(&out), Some(s));
        s.begin_report(2_000, 5);
        encode_sync_state(&s, &mut out);
        assert_eq!(decode_sync_state(&out), Some(s));
        assert_eq!(decode_sync_state(&out[..out.len() - 1]), None);
        s.failures = 4;
        s.open_until = Some(9_000);
        encode_sync_state(&s, &mut out);
        assert_eq!(decode_sync_state(&out), Some(s));
        assert_eq!(decode_sync_state(&out[..out.len() - 1]), None);
        s.applying = Some(Applying { seq: 3, since: 9_500 });
        encode_sync_state(&s, &mut out);
        assert_eq!(decode_sync_state(&out), Some(s));
        assert_eq!(decode_sync_state(&out[..out.len() - 1]), None);
        // A retry and a hedge share one byte (issue 35); a bit this filter
        // does not know makes the state unreadable, not misread.
        s.applying = None;
        s.open_until = None;
        for retry in [Retry::None, Retry::Due, Retry::InFlight] {
            for hedged in [false, true] {
                s.retry = retry;
                if let Some(f) = s.in_flight.as_mut() {
                    f.hedged = hedged;
                }
                encode_sync_state(&s, &mut out);
                assert_eq!(decode_sync_state(&out), Some(s), "{retry:?} {hedged}");
            }
        }
        if let Some(last) = out.last_mut() {
            *last |= 8;
        }
        assert_eq!(decode_sync_state(&out), None);
        let items = vec![Carried {
            key: b"api|t|acme".to_vec(),
            name_hash: 9,
            counts: Counts {
                consumed: 1,
                unleased: 1,
                demand: 3,
            },
            lease_used: 4,
        }];
        encode_carried(7, &items, &mut out);
        assert_eq!(decode_carried(&out), Some((7, items)));
        assert_eq!(decode_carried(&out[..out.len() - 1]), None);
    }
}
