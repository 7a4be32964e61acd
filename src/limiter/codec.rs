//! The byte helpers shared by the algorithms' state encodings.
//!
//! Fixed-width integers are little-endian; small counts are unsigned LEB128
//! (seven bits a byte, least significant group first, high bit = more).
//! Readers never panic: a short input, a varint longer than ten bytes, one
//! that overflows a `u64` or one with a redundant trailing zero group is
//! `None`, so every value has exactly one encoding.

/// Appends `v` as eight little-endian bytes.
pub(crate) fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Reads eight little-endian bytes at `*pos`, advancing it.
pub(crate) fn get_u64(bytes: &[u8], pos: &mut usize) -> Option<u64> {
    let end = pos.checked_add(8)?;
    let raw: [u8; 8] = bytes.get(*pos..end)?.try_into().ok()?;
    *pos = end;
    Some(u64::from_le_bytes(raw))
}

/// Appends `v` as an unsigned LEB128 varint (one byte below 128).
pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads a canonical unsigned LEB128 varint at `*pos`, advancing it.
pub(crate) fn get_varint(bytes: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v: u64 = 0;
    for i in 0..10u32 {
        let byte = *bytes.get(pos.checked_add(i as usize)?)?;
        let group = u64::from(byte & 0x7f);
        let shift = 7 * i;
        // The tenth byte holds only the top bit of a u64.
        if i == 9 && group > 1 {
            return None;
        }
        v |= group << shift;
        if byte & 0x80 == 0 {
            // A zero last group after the first byte is a redundant encoding.
            if i > 0 && group == 0 {
                return None;
            }
            *pos += i as usize + 1;
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_and_reject_redundant_or_overlong_forms() {
        for v in [0, 1, 127, 128, 300, 1 << 35, u64::MAX - 1, u64::MAX] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            let mut pos = 0;
            assert_eq!(get_varint(&out, &mut pos), Some(v));
            assert_eq!(pos, out.len());
            // Every strict prefix is truncated.
            for cut in 0..out.len() {
                assert_eq!(get_varint(&out[..cut], &mut 0), None);
            }
        }
        assert_eq!(get_varint(&[0x80, 0x00], &mut 0), None); // 0 padded
        assert_eq!(get_varint(&[0xff; 10], &mut 0), None); // overflows
        assert_eq!(get_varint(&[0xff; 11], &mut 0), None); // too long
        let mut max = vec![0xff; 9];
        max.push(0x01);
        assert_eq!(get_varint(&max, &mut 0), Some(u64::MAX));
    }

    #[test]
    fn fixed_width_reads_are_bounded() {
        let mut out = Vec::new();
        put_u64(&mut out, 0x0102_0304_0506_0708);
        assert_eq!(out[0], 0x08);
        let mut pos = 0;
        assert_eq!(get_u64(&out, &mut pos), Some(0x0102_0304_0506_0708));
        assert_eq!(pos, 8);
        assert_eq!(get_u64(&out[..7], &mut 0), None);
        let mut far = usize::MAX;
        assert_eq!(get_u64(&out, &mut far), None);
    }
}
