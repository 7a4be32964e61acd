//! How limit state is laid out in Envoy shared data (the bytes; probing,
//! placement and the update primitive are in [`crate::table`]).
//!
//! Shared data has no delete: a key lives until Envoy exits. So dynamic keys
//! (tenants, client addresses) never become shared-data keys of their own.
//! They live in a **key table** of fixed size, chosen by the policy
//! (`key_table.max_keys`): [`SLOTS_PER_ENTRY`] slots packed into each
//! shared-data entry `tg2|k|<index>`, so Envoy's per-key overhead (≈100–130
//! bytes) is paid once per entry, not once per tenant.
//!
//! A logical key (`action|t|tenant` or `action|a|address`) hashes to an
//! entry; it may also live in the next one ([`PROBES`] entries in all). A
//! slot holds the logical key itself (so two keys never share a bucket by a
//! hash collision) and one record per limit of the plan. A new key takes a
//! free slot, or reclaims an *idle* slot: one whose every limit is back to
//! its fresh state, so reclaiming it loses nothing. When every probed slot
//! is busy, the request is charged against an **overflow** entry shared by
//! all overflowing keys of the same action and plan (`tg2|o|…`): memory stays
//! bounded and nobody is silently allowed.
//!
//! Decoding allocates nothing: an entry decodes into at most
//! [`SLOTS_PER_ENTRY`] slots and a slot into at most [`MAX_RECORDS`]
//! records, in fixed arrays that borrow the shared-data bytes.
//!
//! Entry layout (little-endian), format version 2:
//! ```text
//! [0] version (2)   [1] n, slots in use (≤ SLOTS_PER_ENTRY)
//! n × slot:  [key_len u8][key][records_len u16][records]
//! records:   [count u8] count × ([name_hash u32][kind u8][p1 u64][p2 u64][state_len u16][state])
//! ```
//! `p1`/`p2` are the limit's parameters when the state was written, so a
//! reload that changes a live limit can carry its state over instead of
//! resetting it. An algorithm's `state` ends with a 16-byte stamp (the
//! writing policy's epoch and the write instant), which the reload rule
//! needs: see [`crate::limiter::algo`]. A one-limit token-bucket slot for a
//! 14-byte key is `1 + 14 + 2 + 1 + 23 + 8 + 16 = 65` bytes.
//!
//! # Bounds
//! A slot's records take at most [`MAX_RECORDS_LEN`] bytes (their length is
//! a `u16`): the policy refuses a plan whose limits could need more
//! ([`RECORD_HEADER_LEN`] plus the algorithm's largest state, per limit),
//! and [`encode_entry`] refuses, never truncates, a slot over it.

pub const FORMAT_VERSION: u8 = 2;
/// Slots per shared-data entry.
pub const SLOTS_PER_ENTRY: usize = 8;
/// Entries a key may live in: its home entry and the next one.
pub const PROBES: u64 = 2;
/// Most records (limits) one slot holds: a plan's or guard's limits.
pub const MAX_RECORDS: usize = 8;
/// Longest logical key stored in a slot.
pub const MAX_KEY_LEN: usize = 255;
/// Bytes of a record before its state: name hash, kind, `p1`, `p2`, state
/// length.
pub const RECORD_HEADER_LEN: usize = 4 + 1 + 8 + 8 + 2;
/// Most bytes of records one slot holds (their length field is a `u16`).
pub const MAX_RECORDS_LEN: usize = u16::MAX as usize;

/// One slot of a decoded entry, borrowing from the shared-data value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot<'a> {
    pub key: &'a [u8],
    pub records: &'a [u8],
}

/// One limit's stored record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    pub name_hash: u32,
    pub kind: u8,
    pub p1: u64,
    pub p2: u64,
    pub state: &'a [u8],
}

/// A little-endian reader that never panics: every read of shared-data
/// bytes (key-table entries here, sync state in `crate::sync::stored`).
pub(crate) struct Reader<'a>(pub(crate) &'a [u8]);

impl<'a> Reader<'a> {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }
    pub(crate) fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    pub(crate) fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    pub(crate) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    pub(crate) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    /// A `u64` that is stored only when `present` (a flag bit says so).
    pub(crate) fn opt_u64(&mut self, present: bool) -> Option<Option<u64>> {
        if present {
            self.u64().map(Some)
        } else {
            Some(None)
        }
    }
}

const NO_SLOT: Slot<'static> = Slot {
    key: &[],
    records: &[],
};
const NO_RECORD: Record<'static> = Record {
    name_hash: 0,
    kind: 0,
    p1: 0,
    p2: 0,
    state: &[],
};

/// A decoded entry's slots, in place (no allocation).
#[derive(Debug, Clone, Copy)]
pub struct Slots<'a> {
    items: [Slot<'a>; SLOTS_PER_ENTRY],
    len: usize,
}

impl Default for Slots<'_> {
    fn default() -> Self {
        Slots {
            items: [NO_SLOT; SLOTS_PER_ENTRY],
            len: 0,
        }
    }
}

impl<'a> core::ops::Deref for Slots<'a> {
    type Target = [Slot<'a>];
    fn deref(&self) -> &[Slot<'a>] {
        &self.items[..self.len]
    }
}

impl<'a> IntoIterator for Slots<'a> {
    type Item = Slot<'a>;
    type IntoIter = core::iter::Take<core::array::IntoIter<Slot<'a>, SLOTS_PER_ENTRY>>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter().take(self.len)
    }
}

impl<'b, 'a> IntoIterator for &'b Slots<'a> {
    type Item = &'b Slot<'a>;
    type IntoIter = core::slice::Iter<'b, Slot<'a>>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// A decoded slot's records, in place (no allocation).
#[derive(Debug, Clone, Copy)]
pub struct Records<'a> {
    items: [Record<'a>; MAX_RECORDS],
    len: usize,
}

impl Default for Records<'_> {
    fn default() -> Self {
        Records {
            items: [NO_RECORD; MAX_RECORDS],
            len: 0,
        }
    }
}

impl<'a> core::ops::Deref for Records<'a> {
    type Target = [Record<'a>];
    fn deref(&self) -> &[Record<'a>] {
        &self.items[..self.len]
    }
}

impl<'a> IntoIterator for Records<'a> {
    type Item = Record<'a>;
    type IntoIter = core::iter::Take<core::array::IntoIter<Record<'a>, MAX_RECORDS>>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter().take(self.len)
    }
}

impl<'b, 'a> IntoIterator for &'b Records<'a> {
    type Item = &'b Record<'a>;
    type IntoIter = core::slice::Iter<'b, Record<'a>>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Decodes an entry. `None` for anything that is not a well-formed
/// version-2 entry (the caller treats it as empty and counts it).
pub fn decode_entry(bytes: &[u8]) -> Option<Slots<'_>> {
    let mut r = Reader(bytes);
    if r.u8()? != FORMAT_VERSION {
        return None;
    }
    let n = usize::from(r.u8()?);
    if n > SLOTS_PER_ENTRY {
        return None;
    }
    let mut slots = Slots::default();
    for item in slots.items.iter_mut().take(n) {
        let key_len = usize::from(r.u8()?);
        let key = r.take(key_len)?;
        let records_len = usize::from(r.u16()?);
        let records = r.take(records_len)?;
        *item = Slot { key, records };
    }
    slots.len = n;
    r.is_empty().then_some(slots)
}

/// Encodes an entry from its slots. `false` (and `out` empty) if a key,
/// a slot's records or the number of slots does not fit its length field:
/// the caller writes nothing rather than an entry that would not decode.
#[must_use]
pub fn encode_entry<'a>(slots: impl IntoIterator<Item = Slot<'a>>, out: &mut Vec<u8>) -> bool {
    out.clear();
    out.push(FORMAT_VERSION);
    out.push(0);
    let mut n = 0u8;
    for s in slots {
        let (Ok(key_len), Ok(records_len), Some(next)) = (
            u8::try_from(s.key.len()),
            u16::try_from(s.records.len()),
            n.checked_add(1),
        ) else {
            out.clear();
            return false;
        };
        out.push(key_len);
        out.extend_from_slice(s.key);
        out.extend_from_slice(&records_len.to_le_bytes());
        out.extend_from_slice(s.records);
        n = next;
    }
    out[1] = n;
    true
}

/// Decodes a slot's records (`None`: malformed, or more than
/// [`MAX_RECORDS`], which this version never writes).
pub fn decode_records(bytes: &[u8]) -> Option<Records<'_>> {
    let mut r = Reader(bytes);
    let n = usize::from(r.u8()?);
    if n > MAX_RECORDS {
        return None;
    }
    let mut records = Records::default();
    for item in records.items.iter_mut().take(n) {
        let name_hash = r.u32()?;
        let kind = r.u8()?;
        let p1 = r.u64()?;
        let p2 = r.u64()?;
        let len = usize::from(r.u16()?);
        let state = r.take(len)?;
        *item = Record {
            name_hash,
            kind,
            p1,
            p2,
            state,
        };
    }
    records.len = n;
    r.is_empty().then_some(records)
}

/// Appends one record; `state` is the algorithm's encoded state.
pub fn push_record(out: &mut Vec<u8>, name_hash: u32, kind: u8, p1: u64, p2: u64, state: &[u8]) {
    push_record_with(out, name_hash, kind, p1, p2, |out| out.extend_from_slice(state));
}

/// Appends one record whose state `write_state` appends in place (no
/// intermediate buffer).
pub fn push_record_with(
    out: &mut Vec<u8>,
    name_hash: u32,
    kind: u8,
    p1: u64,
    p2: u64,
    write_state: impl FnOnce(&mut Vec<u8>),
) {
    out.extend_from_slice(&name_hash.to_le_bytes());
    out.push(kind);
    out.extend_from_slice(&p1.to_le_bytes());
    out.extend_from_slice(&p2.to_le_bytes());
    let at = out.len();
    out.extend_from_slice(&[0, 0]);
    write_state(out);
    // A state over u16::MAX puts its slot's records over MAX_RECORDS_LEN,
    // which `encode_entry` refuses: a saturated length never lands.
    let len = u16::try_from(out.len().saturating_sub(at + 2)).unwrap_or(u16::MAX);
    out[at..at + 2].copy_from_slice(&len.to_le_bytes());
}

/// FNV-1a, 64 bits: where a logical key's home entry is.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The shared-data key of key-table entry `index`.
pub fn entry_key(index: u64) -> String {
    EntryKey::new(index).as_str().to_owned()
}

/// The shared-data key of a key-table entry, formatted on the stack (the
/// request path names entries without allocating).
#[derive(Clone, Copy)]
pub struct EntryKey {
    buf: [u8; ENTRY_KEY_MAX],
    len: usize,
}

const ENTRY_KEY_PREFIX: &[u8] = crate::keys::ENTRY_PREFIX.as_bytes();
/// The prefix and the 20 digits of `u64::MAX`.
const ENTRY_KEY_MAX: usize = ENTRY_KEY_PREFIX.len() + 20;

impl EntryKey {
    pub fn new(index: u64) -> EntryKey {
        let mut digits = [0u8; 20];
        let mut n = 0;
        let mut rest = index;
        loop {
            digits[n] = b'0' + (rest % 10) as u8;
            n += 1;
            rest /= 10;
            if rest == 0 || n == digits.len() {
                break;
            }
        }
        let mut buf = [0u8; ENTRY_KEY_MAX];
        buf[..ENTRY_KEY_PREFIX.len()].copy_from_slice(ENTRY_KEY_PREFIX);
        for (i, d) in digits[..n].iter().rev().enumerate() {
            buf[ENTRY_KEY_PREFIX.len() + i] = *d;
        }
        EntryKey {
            buf,
            len: ENTRY_KEY_PREFIX.len() + n,
        }
    }

    pub fn as_str(&self) -> &str {
        core::str::from_utf8(&self.buf[..self.len]).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip() {
        let mut records = vec![2u8];
        push_record(&mut records, 7, 1, 10, 20, &[1, 2, 3]);
        push_record(&mut records, 8, 2, 30, 40, &[]);
        let slots = [
            Slot {
                key: b"api|t|acme",
                records: &records,
            },
            Slot {
                key: b"x",
                records: &[0],
            },
        ];
        let mut out = Vec::new();
        assert!(encode_entry(slots, &mut out));
        let decoded = decode_entry(&out).unwrap();
        assert_eq!(&*decoded, &slots);
        let recs = decode_records(decoded[0].records).unwrap();
        assert_eq!(recs.len(), 2);
        assert_eq!(
            recs[0],
            Record {
                name_hash: 7,
                kind: 1,
                p1: 10,
                p2: 20,
                state: &[1, 2, 3]
            }
        );
        assert_eq!(recs[1].state, &[] as &[u8]);
    }

    #[test]
    fn entry_keys_are_formatted_on_the_stack_like_format() {
        for i in [0, 7, 10, 99_999, u64::MAX] {
            assert_eq!(EntryKey::new(i).as_str(), format!("tg2|k|{i}"));
        }
    }

    #[test]
    fn garbage_never_decodes_and_never_panics() {
        assert!(decode_entry(&[]).is_none());
        assert!(decode_entry(&[1, 0]).is_none()); // version 1
        assert!(decode_entry(&[2, 9]).is_none()); // too many slots
        assert!(decode_entry(&[2, 1, 5, b'a']).is_none()); // truncated
        assert!(decode_entry(&[2, 0, 0]).is_none()); // trailing bytes
        assert!(decode_entry(&[2, 0]).is_some_and(|s| s.is_empty()));
        assert!(decode_records(&[1, 0, 0]).is_none());
        assert!(decode_records(&[9]).is_none()); // more records than a plan has limits
                                                 // Every prefix and every single-byte corruption of a valid entry.
        let mut records = vec![1u8];
        push_record(&mut records, 7, 1, 10, 20, &[9; 8]);
        let mut out = Vec::new();
        assert!(encode_entry(
            [Slot {
                key: b"k",
                records: &records,
            }],
            &mut out,
        ));
        let decode_all = |bytes: &[u8]| {
            for slot in decode_entry(bytes).unwrap_or_default() {
                let _ = decode_records(slot.records);
            }
        };
        for cut in 0..out.len() {
            decode_all(&out[..cut]);
        }
        for i in 0..out.len() {
            for b in [0u8, 1, 0x7f, 0xff] {
                let mut bad = out.clone();
                bad[i] = b;
                decode_all(&bad);
            }
        }
    }

    #[test]
    fn records_over_64_kib_are_refused_not_truncated() {
        // Regression: `records.len() as u16` wrapped, so the entry no longer
        // decoded and every key in it lost its state.
        let mut out = vec![9];
        let big = vec![0u8; MAX_RECORDS_LEN + 1];
        let slot = |records| Slot { key: b"k", records };
        assert!(!encode_entry([slot(&big)], &mut out));
        assert!(out.is_empty(), "nothing to write");
        let long_key = [b'k'; 256];
        let bad_key = Slot {
            key: &long_key,
            records: &[0],
        };
        assert!(!encode_entry([bad_key], &mut out));
        // At the bound, the entry round-trips.
        let max = vec![0u8; MAX_RECORDS_LEN];
        assert!(encode_entry([slot(&max)], &mut out));
        assert_eq!(&*decode_entry(&out).unwrap(), &[slot(&max)]);
    }
}
