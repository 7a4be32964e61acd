//! The binary encoding of one limit key's state in Envoy shared data.
//!
//! One shared-data entry per key (tenant × API action) holds the state of
//! every limit of the tenant's plan, so a request is checked and charged
//! against all of them with a single compare-and-swap: all or nothing.
//!
//! Layout (little-endian), version 1:
//! ```text
//! [0]      format version (1)
//! [1]      n, the number of limits
//! [2..]    n × 28 bytes: name_hash u32 | interval_ns u64 | tolerance_ns u64 | tat u64
//! ```
//! Each limit's GCRA parameters are stored beside its TAT so that a policy
//! reload that changes a live limit can carry the bucket's fill level over
//! ([`crate::limiter::Gcra::migrate_tat`]) instead of resetting it.

use crate::limiter::Gcra;
use crate::policy::Limit;

pub const FORMAT_VERSION: u8 = 1;
const HEADER_LEN: usize = 2;
const ENTRY_LEN: usize = 28;

/// One limit's stored state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub name_hash: u32,
    pub interval_ns: u64,
    pub tolerance_ns: u64,
    pub tat: u64,
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    let raw: [u8; 8] = bytes.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_le_bytes(raw))
}

/// Decodes a stored value. `None` for anything that is not a well-formed
/// version-1 value (the caller treats the key as new and counts it).
pub fn decode(bytes: &[u8]) -> Option<Vec<Entry>> {
    let (&version, rest) = bytes.split_first()?;
    let (&n, body) = rest.split_first()?;
    if version != FORMAT_VERSION || body.len() != usize::from(n) * ENTRY_LEN {
        return None;
    }
    body.chunks_exact(ENTRY_LEN)
        .map(|c| {
            Some(Entry {
                name_hash: u32::from_le_bytes(c.get(0..4)?.try_into().ok()?),
                interval_ns: u64_at(c, 4)?,
                tolerance_ns: u64_at(c, 12)?,
                tat: u64_at(c, 20)?,
            })
        })
        .collect()
}

/// Encodes the state of `limits` with the given TATs (same order).
pub fn encode(limits: &[Limit], tats: &[u64], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(HEADER_LEN + limits.len() * ENTRY_LEN);
    out.push(FORMAT_VERSION);
    out.push(limits.len() as u8); // at most MAX_LIMITS_PER_PLAN
    for (limit, tat) in limits.iter().zip(tats) {
        out.extend_from_slice(&limit.name_hash.to_le_bytes());
        out.extend_from_slice(&limit.gcra.interval_ns().to_le_bytes());
        out.extend_from_slice(&limit.gcra.tolerance_ns().to_le_bytes());
        out.extend_from_slice(&tat.to_le_bytes());
    }
}

/// The TAT of `limit` given the stored entries: carried over by name, full
/// (0) if the limit is new. If the stored parameters differ (a reload
/// changed the limit), the bucket's fill level is carried over as of
/// `effective_from`, the instant the current policy took effect: the old
/// rate applies before it, the new rate after. Returns the TAT and whether
/// it differs from what is stored (so a denial can persist the migration).
pub fn tat_for(limit: &Limit, stored: &[Entry], effective_from: u64) -> (u64, bool) {
    let Some(e) = stored.iter().find(|e| e.name_hash == limit.name_hash) else {
        return (0, false);
    };
    if e.interval_ns == limit.gcra.interval_ns() && e.tolerance_ns == limit.gcra.tolerance_ns() {
        return (e.tat, false);
    }
    let tat = match Gcra::from_stored(e.interval_ns, e.tolerance_ns) {
        Some(old) => limit.gcra.migrate_tat(&old, e.tat, effective_from),
        // Unusable stored parameters: be conservative, start empty.
        None => effective_from.saturating_add(limit.gcra.tolerance_ns()),
    };
    (tat, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_never_decodes() {
        assert_eq!(decode(&[]), None);
        assert_eq!(decode(&[1]), None);
        assert_eq!(decode(&[2, 0]), None);
        assert_eq!(decode(&[1, 1, 0, 0]), None);
        assert_eq!(decode(&[1, 0]), Some(vec![]));
        assert_eq!(decode(&[1, 0, 9]), None);
    }
}
