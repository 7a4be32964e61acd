//! Format 3: the compact encoding of a store's records (see
//! [`crate::store::Record`]), a serde data format.
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
//! Files, from the bottom up: `format.rs` the error and the varint
//! arithmetic both directions share; `encode.rs` the [`Encoder`] (and its
//! serde `Serializer`) and [`to_writer`]; `decode.rs` the [`Decoder`] (and
//! its serde `Deserializer`) and [`from_slice`]; `compact.rs` the
//! [`Compact`] trait over both. This file only names them. The codec is
//! plumbing beneath both the allocator's records (`crate::alloc::record`)
//! and the stores (`crate::store`), so it names neither.

mod compact;
mod decode;
mod encode;
mod format;
#[cfg(test)]
mod tests;

pub use compact::{from_slice_compact, to_writer_compact, Compact};
pub use decode::{from_slice, Decoder, Fields};
pub use encode::{to_writer, Encoder};
pub use format::{Error, Result};
