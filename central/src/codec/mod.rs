//! Format 3: the compact encoding of a store's records (see
//! [`super::Record`]), a serde data format.
//!
//! Unsigned integers are LEB128 varints (a count below 128 is one byte),
//! signed ones zigzag varints, an `f64` is its bits byte-reversed as a
//! varint (round values such as `1.0` or `0.5` have zero low mantissa
//! bits: two or three bytes), byte strings, sequences and maps carry a
//! varint length, `Option` and `bool` one byte, an enum variant its index.
//! No field names: a struct is its field count, then its fields in
//! declaration order. Two things a record repeats are written once:
//! * a `u64` carries a tag bit: plain, or the difference from the record's
//!   first `u64` at or above 2^40 (its base): a record's nanosecond
//!   timestamps lie seconds apart, so each after the first takes five or
//!   six bytes instead of nine;
//! * a string carries a tag bit: its bytes, or the index of an equal
//!   string earlier in the record (a session names each of its keys twice,
//!   and every key the same limit).
//!
//! # Evolution
//! The field count is what keeps records readable across versions: a
//! field appended to a struct with `#[serde(default)]` (the allocator's
//! rule for new fields) is absent from an older record, whose count says
//! so, and gets its default. A record with more fields than this build
//! knows (written by a newer one) does not decode: `Corrupt`, as with any
//! format a build cannot read. Fields are never removed or reordered.
//!
//! # Records written by hand
//! A type may write and read itself field by field ([`Compact`]) through
//! the same [`Encoder`] and [`Decoder`] primitives: the (key, limit)
//! record does (`crate::alloc::record`), since every key report reads and
//! writes one, and serde's per-field visitor calls were most of that cost.
//! The bytes are the same; tests there compare both ways.
//!
//! Not self-describing: decoding follows the Rust type (`deserialize_any`
//! is refused), so `#[serde(flatten)]`, untagged enums and
//! `skip_serializing_if` cannot be used in a record.
//!
//! Bounds: every length is checked against the bytes left before anything
//! is allocated, so a corrupt record fails without a large allocation; the
//! nesting depth is bounded by the Rust type.

//!
//! Files: this one holds the format's entry points, its error, the
//! [`Compact`] trait and the varint arithmetic both directions share;
//! `encode.rs` the [`Encoder`] (and its serde `Serializer`), `decode.rs`
//! the [`Decoder`] (and its serde `Deserializer`). The codec is plumbing
//! beneath both the allocator's records (`crate::alloc::record`) and the
//! stores (`crate::store`), so it names neither.

mod decode;
mod encode;
#[cfg(test)]
mod tests;

pub use decode::{Decoder, Fields};
pub use encode::Encoder;
use serde::de;
use serde::ser::{self, Serialize};

/// Why a record did not encode or decode.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Error(String);

impl ser::Error for Error {
    fn custom<T: std::fmt::Display>(msg: T) -> Error {
        Error(msg.to_string())
    }
}

impl de::Error for Error {
    fn custom<T: std::fmt::Display>(msg: T) -> Error {
        Error(msg.to_string())
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Appends `value`'s encoding to `out`.
pub fn to_writer<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) -> Result<()> {
    encode_with(out, |e| value.serialize(e))
}

/// Appends `value`'s encoding to `out`, written by its own [`Compact`]
/// code: the same bytes as [`to_writer`].
pub fn to_writer_compact<T: Compact>(out: &mut Vec<u8>, value: &T) -> Result<()> {
    encode_with(out, |e| {
        value.write(e);
        Ok(())
    })
}

fn encode_with(out: &mut Vec<u8>, f: impl FnOnce(&mut Encoder<'_>) -> Result<()>) -> Result<()> {
    // The string tables of the last record this thread wrote, cleared:
    // most records need them, and allocating them each time cost as much
    // as the rest of an encode.
    thread_local! {
        static TABLES: std::cell::Cell<Option<Tables>> = const { std::cell::Cell::new(None) };
    }
    let (strings, seen) = TABLES.with(|t| t.take()).unwrap_or_default();
    let mut e = Encoder {
        out,
        base: None,
        strings,
        seen,
    };
    let r = f(&mut e);
    let (mut strings, mut seen) = (e.strings, e.seen);
    strings.clear();
    seen.clear();
    TABLES.with(|t| t.set(Some((strings, seen))));
    r
}

type Tables = (Vec<(usize, usize)>, hashbrown::HashMap<u64, u32>);

/// Decodes a whole record: every byte must be used.
pub fn from_slice<'de, T: de::Deserialize<'de>>(bytes: &'de [u8]) -> Result<T> {
    decode_with(bytes, |d| T::deserialize(d))
}

/// Decodes a whole record by its own [`Compact`] code: what
/// [`from_slice`] gives.
pub fn from_slice_compact<T: Compact>(bytes: &[u8]) -> Result<T> {
    decode_with(bytes, T::read)
}

fn decode_with<'de, T>(bytes: &'de [u8], f: impl FnOnce(&mut Decoder<'de>) -> Result<T>) -> Result<T> {
    let mut d = Decoder {
        input: bytes,
        base: None,
        // A (key, limit) record held by a few nodes in a few regions
        // names up to about eight strings: one allocation, no regrowth.
        strings: Vec::with_capacity(8),
    };
    let v = f(&mut d)?;
    if !d.input.is_empty() {
        return Err(Error(format!("{} bytes after the record", d.input.len())));
    }
    Ok(v)
}

/// A record type whose format 3 encoding is written by hand rather than
/// through serde: the (key, limit) record, which every key report decodes
/// and encodes once (serde's visitors and per-field calls were most of a
/// key report's CPU). It must give exactly the bytes its `Serialize`
/// gives, and read them as its `Deserialize` does, fields in declaration
/// order: a struct is [`Encoder::fields`] then each field, read back
/// through [`Fields`] (a field past an older record's count takes its
/// default). `crate::alloc::record`'s tests compare both ways.
pub trait Compact: Sized {
    fn write(&self, e: &mut Encoder<'_>);
    fn read(d: &mut Decoder<'_>) -> Result<Self>;
}

#[inline(always)]
fn put_varint64(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        // The low seven bits, with the continuation bit.
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_varint(out: &mut Vec<u8>, mut v: u128) {
    if let Ok(v) = u64::try_from(v) {
        return put_varint64(out, v);
    }
    while v >= 0x80 {
        // The low seven bits, with the continuation bit.
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn zigzag(v: i128) -> u128 {
    ((v << 1) ^ (v >> 127)) as u128
}

fn unzigzag(v: u128) -> i128 {
    ((v >> 1) as i128) ^ -((v & 1) as i128)
}

/// `u64`s at or above this start a record's base (see the module header).
const BASE_MIN: u64 = 1 << 40;

fn varint_len(v: u64) -> u32 {
    (64 - v.leading_zeros()).div_ceil(7).max(1)
}
