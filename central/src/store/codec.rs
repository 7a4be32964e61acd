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

use serde::de::{self, DeserializeSeed, IntoDeserializer, Visitor};
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

/// Writes format 3 (see the module header); [`Compact`] types call its
/// methods field by field.
pub struct Encoder<'a> {
    out: &'a mut Vec<u8>,
    base: Option<u64>,
    /// Every string written literally: (start in `out`, length).
    strings: Vec<(usize, usize)>,
    /// A hash of each literal string → its index in `strings`.
    seen: hashbrown::HashMap<u64, u32>,
}

/// The strings' hash: fast, not keyed (a collision only costs a literal:
/// the bytes are compared before a reference is written).
fn hash_of(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ b.len() as u64;
    let mut chunks = b.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        h = (h ^ u64::from_le_bytes(w))
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(23);
    }
    for &x in chunks.remainder() {
        h = (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ (h >> 29)
}

/// The values [`Compact`] code writes, each exactly as serde's path for
/// its type writes it (see the `Serializer` below).
impl Encoder<'_> {
    /// A struct of `n` fields (then each field, in declaration order).
    #[inline]
    pub fn fields(&mut self, n: usize) {
        self.count(n);
    }

    /// A map's or sequence's length (then its elements).
    #[inline]
    pub fn count(&mut self, n: usize) {
        put_varint64(self.out, n as u64);
    }

    /// An unsigned integer other than `u64` (`u8` to `u128`): untagged.
    #[inline]
    pub fn uint(&mut self, v: u128) {
        put_varint(self.out, v);
    }

    /// A signed integer: zigzag.
    #[inline]
    pub fn int(&mut self, v: i128) {
        put_varint(self.out, zigzag(v));
    }

    #[inline]
    pub fn f64(&mut self, v: f64) {
        put_varint64(self.out, v.to_bits().swap_bytes());
    }

    #[inline]
    pub fn bool(&mut self, v: bool) {
        self.out.push(u8::from(v));
    }

    /// An `Option`'s tag (then its value when `some`).
    #[inline]
    pub fn option(&mut self, some: bool) {
        self.out.push(u8::from(some));
    }

    /// A unit enum variant: its index.
    #[inline]
    pub fn variant(&mut self, index: u32) {
        put_varint64(self.out, u64::from(index));
    }

    #[inline]
    pub fn str(&mut self, v: &str) {
        self.string(v.as_bytes());
    }

    /// A `u64`: tagged, a timestamp as its difference from the record's
    /// base (see the module header).
    #[inline(always)]
    pub fn u64(&mut self, v: u64) {
        // Most of a record's `u64`s are small counts: below 64 the plain
        // tagged form is one byte, which no difference can beat.
        if v < 64 {
            self.out.push((v as u8) << 1);
            return;
        }
        // Tagged values need 65 bits only for v ≥ 2^63 (never a count or a
        // timestamp before 2262): the u128 path is kept for them.
        let Ok(plain) = u64::try_from(u128::from(v) << 1) else {
            return put_varint(self.out, u128::from(v) << 1);
        };
        let Some(base) = self.base else {
            if v >= BASE_MIN {
                self.base = Some(v);
            }
            return put_varint64(self.out, plain);
        };
        // |v − base| < 2^62: the tagged zigzag fits 64 bits.
        let d = i128::from(v) - i128::from(base);
        let delta = i64::try_from(d)
            .ok()
            .filter(|d| d.unsigned_abs() < 1 << 62)
            .map(|d| (((d << 1) ^ (d >> 63)) as u64) << 1 | 1);
        match delta {
            Some(delta) if varint_len(delta) < varint_len(plain) => put_varint64(self.out, delta),
            _ => put_varint64(self.out, plain),
        }
    }

    fn string(&mut self, b: &[u8]) {
        let h = hash_of(b);
        if let Some(&i) = self.seen.get(&h) {
            let same = self
                .strings
                .get(i as usize)
                .and_then(|&(start, len)| self.out.get(start..start + len))
                == Some(b);
            if same {
                return put_varint(self.out, (u128::from(i) << 1) | 1);
            }
        }
        put_varint(self.out, (b.len() as u128) << 1);
        let index = u32::try_from(self.strings.len()).unwrap_or(u32::MAX);
        self.strings.push((self.out.len(), b.len()));
        self.seen.entry(h).or_insert(index);
        self.out.extend_from_slice(b);
    }

    fn len(&mut self, len: Option<usize>) -> Result<()> {
        let len = len.ok_or_else(|| Error("a sequence of unknown length".to_owned()))?;
        self.count(len);
        Ok(())
    }
}

macro_rules! unsigned {
    ($($f:ident: $t:ty),*) => {$(
        fn $f(self, v: $t) -> Result<()> {
            put_varint(self.out, u128::from(v));
            Ok(())
        }
    )*};
}

macro_rules! signed {
    ($($f:ident: $t:ty),*) => {$(
        fn $f(self, v: $t) -> Result<()> {
            put_varint(self.out, zigzag(i128::from(v)));
            Ok(())
        }
    )*};
}

impl<'a, 'b> ser::Serializer for &'a mut Encoder<'b> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Self;
    type SerializeTuple = Self;
    type SerializeTupleStruct = Self;
    type SerializeTupleVariant = Self;
    type SerializeMap = Self;
    type SerializeStruct = Self;
    type SerializeStructVariant = Self;

    unsigned!(serialize_u8: u8, serialize_u16: u16, serialize_u32: u32, serialize_u128: u128);

    #[inline]
    fn serialize_u64(self, v: u64) -> Result<()> {
        self.u64(v);
        Ok(())
    }
    signed!(serialize_i8: i8, serialize_i16: i16, serialize_i32: i32, serialize_i64: i64, serialize_i128: i128);

    fn serialize_bool(self, v: bool) -> Result<()> {
        self.out.push(u8::from(v));
        Ok(())
    }
    fn serialize_f32(self, v: f32) -> Result<()> {
        put_varint(self.out, u128::from(v.to_bits().swap_bytes()));
        Ok(())
    }
    fn serialize_f64(self, v: f64) -> Result<()> {
        put_varint(self.out, u128::from(v.to_bits().swap_bytes()));
        Ok(())
    }
    fn serialize_char(self, v: char) -> Result<()> {
        put_varint(self.out, u128::from(u32::from(v)));
        Ok(())
    }
    fn serialize_str(self, v: &str) -> Result<()> {
        self.string(v.as_bytes());
        Ok(())
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<()> {
        put_varint(self.out, v.len() as u128);
        self.out.extend_from_slice(v);
        Ok(())
    }
    fn serialize_none(self) -> Result<()> {
        self.out.push(0);
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, v: &T) -> Result<()> {
        self.out.push(1);
        v.serialize(self)
    }
    fn serialize_unit(self) -> Result<()> {
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<()> {
        Ok(())
    }
    fn serialize_unit_variant(self, _: &'static str, index: u32, _: &'static str) -> Result<()> {
        put_varint(self.out, u128::from(index));
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, v: &T) -> Result<()> {
        v.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        index: u32,
        _: &'static str,
        v: &T,
    ) -> Result<()> {
        put_varint(self.out, u128::from(index));
        v.serialize(self)
    }
    fn serialize_seq(self, len: Option<usize>) -> Result<Self> {
        self.len(len)?;
        Ok(self)
    }
    fn serialize_tuple(self, _: usize) -> Result<Self> {
        Ok(self)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Self> {
        Ok(self)
    }
    fn serialize_tuple_variant(self, _: &'static str, index: u32, _: &'static str, _: usize) -> Result<Self> {
        put_varint(self.out, u128::from(index));
        Ok(self)
    }
    fn serialize_map(self, len: Option<usize>) -> Result<Self> {
        self.len(len)?;
        Ok(self)
    }
    fn serialize_struct(self, _: &'static str, len: usize) -> Result<Self> {
        self.len(Some(len))?;
        Ok(self)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        index: u32,
        _: &'static str,
        len: usize,
    ) -> Result<Self> {
        put_varint(self.out, u128::from(index));
        self.len(Some(len))?;
        Ok(self)
    }
}

macro_rules! elements {
    ($($tr:ident :: $f:ident),*) => {$(
        impl ser::$tr for &mut Encoder<'_> {
            type Ok = ();
            type Error = Error;
            fn $f<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<()> {
                v.serialize(&mut **self)
            }
            fn end(self) -> Result<()> {
                Ok(())
            }
        }
    )*};
}

elements!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

impl ser::SerializeMap for &mut Encoder<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, k: &T) -> Result<()> {
        k.serialize(&mut **self)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<()> {
        v.serialize(&mut **self)
    }
    fn end(self) -> Result<()> {
        Ok(())
    }
}

macro_rules! struct_fields {
    ($($tr:ident),*) => {$(
        impl ser::$tr for &mut Encoder<'_> {
            type Ok = ();
            type Error = Error;
            #[inline]
            fn serialize_field<T: Serialize + ?Sized>(&mut self, _: &'static str, v: &T) -> Result<()> {
                v.serialize(&mut **self)
            }
            fn skip_field(&mut self, key: &'static str) -> Result<()> {
                // The count was written already: a skipped field would
                // shift every later one.
                Err(Error(format!("field {key} skipped: records may not skip fields")))
            }
            fn end(self) -> Result<()> {
                Ok(())
            }
        }
    )*};
}

struct_fields!(SerializeStruct, SerializeStructVariant);

/// Reads format 3; [`Compact`] types call its methods field by field.
pub struct Decoder<'de> {
    input: &'de [u8],
    base: Option<u64>,
    /// Every string read literally, in order.
    strings: Vec<&'de str>,
}

/// The values [`Compact`] code reads, each exactly as serde's path for its
/// type reads it (see the `Deserializer` below).
impl<'de> Decoder<'de> {
    /// A struct's field count, at most the `known` fields of this build's
    /// type (more: written by a newer build); read the fields through the
    /// [`Fields`] it returns.
    #[inline]
    pub fn fields(&mut self, known: usize) -> Result<Fields> {
        let left = self.count()?;
        if left > known {
            return Err(Error(format!(
                "{left} fields, {known} known: written by a newer build"
            )));
        }
        Ok(Fields { left })
    }

    #[inline]
    pub fn int<T: TryFrom<i128>>(&mut self) -> Result<T> {
        T::try_from(unzigzag(self.uint()?)).map_err(|_| Error("an integer out of range".to_owned()))
    }

    #[inline]
    pub fn f64(&mut self) -> Result<f64> {
        let bits: u64 = self.uint()?;
        Ok(f64::from_bits(bits.swap_bytes()))
    }

    #[inline]
    pub fn bool(&mut self) -> Result<bool> {
        self.flag("a bool")
    }

    /// An `Option`'s tag: whether a value follows.
    #[inline]
    pub fn option(&mut self) -> Result<bool> {
        self.flag("an option tag")
    }

    /// One byte, 0 or 1.
    #[inline]
    fn flag(&mut self, what: &str) -> Result<bool> {
        match self.byte()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(Error(format!("{what} of {b}"))),
        }
    }

    /// A unit enum variant's index.
    #[inline]
    pub fn variant(&mut self) -> Result<u32> {
        self.uint()
    }

    #[inline]
    pub fn string(&mut self) -> Result<String> {
        self.str().map(str::to_owned)
    }

    /// An error for a value this build does not know (an enum's index).
    pub fn unknown(what: &str, v: impl std::fmt::Display) -> Error {
        Error(format!("an unknown {what} {v}"))
    }

    #[inline]
    fn byte(&mut self) -> Result<u8> {
        let (&b, rest) = self
            .input
            .split_first()
            .ok_or_else(|| Error("the record ends early".to_owned()))?;
        self.input = rest;
        Ok(b)
    }

    /// A varint of at most 64 bits (the fast path); `None`, with nothing
    /// consumed, for a longer one or a record that ends inside it.
    #[inline(always)]
    fn varint64(&mut self) -> Option<u64> {
        // One byte: most of a record's integers.
        if let Some((&b, rest)) = self.input.split_first() {
            if b < 0x80 {
                self.input = rest;
                return Some(u64::from(b));
            }
        }
        let mut v: u64 = 0;
        for (i, &b) in self.input.iter().enumerate().take(10) {
            let bits = u64::from(b & 0x7f);
            let shift = 7 * i as u32;
            if shift == 63 && bits > 1 {
                break;
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                self.input = self.input.get(i + 1..).unwrap_or_default();
                return Some(v);
            }
        }
        None
    }

    fn varint(&mut self) -> Result<u128> {
        let mut v: u128 = 0;
        for shift in (0..128).step_by(7) {
            let b = self.byte()?;
            v |= u128::from(b & 0x7f)
                .checked_shl(shift)
                .ok_or_else(|| Error("a varint too long".to_owned()))?;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Error("a varint too long".to_owned()))
    }

    /// An unsigned integer other than `u64`, checked to fit `T`.
    #[inline]
    pub fn uint<T: TryFrom<u128>>(&mut self) -> Result<T> {
        let v = match self.varint64() {
            Some(v) => u128::from(v),
            // The general path reads it or names the error.
            None => self.varint()?,
        };
        T::try_from(v).map_err(|_| Error("an integer out of range".to_owned()))
    }

    /// A map's or sequence's length, checked against the bytes left (each
    /// element takes at least one byte, except units, which records do not
    /// hold in bulk).
    #[inline]
    pub fn count(&mut self) -> Result<usize> {
        let n: usize = self.uint()?;
        if n > self.input.len() {
            return Err(Error(format!(
                "a length of {n} with {} bytes left",
                self.input.len()
            )));
        }
        Ok(n)
    }

    fn bytes(&mut self) -> Result<&'de [u8]> {
        let n = self.count()?;
        Ok(self.take(n))
    }

    fn take(&mut self, n: usize) -> &'de [u8] {
        let (b, rest) = self.input.split_at(n.min(self.input.len()));
        self.input = rest;
        b
    }

    /// A `u64` (tagged: see the module header).
    #[inline(always)]
    pub fn u64(&mut self) -> Result<u64> {
        // The common case, a varint of at most 64 bits, without `u128`.
        if let Some(x) = self.varint64() {
            if x & 1 == 0 {
                let v = x >> 1;
                if self.base.is_none() && v >= BASE_MIN {
                    self.base = Some(v);
                }
                return Ok(v);
            }
            let z = x >> 1;
            let d = ((z >> 1) as i64) ^ -((z & 1) as i64);
            return self
                .base
                .ok_or_else(|| Error("a difference with no base".to_owned()))?
                .checked_add_signed(d)
                .ok_or_else(|| Error("an integer out of range".to_owned()));
        }
        self.u64_long()
    }

    /// [`Decoder::u64`] of a varint over 64 bits (a tagged value of 2^63
    /// or more), or one the record ends inside.
    fn u64_long(&mut self) -> Result<u64> {
        let x: u128 = self.uint()?;
        let out_of_range = || Error("an integer out of range".to_owned());
        if x & 1 == 0 {
            let v = u64::try_from(x >> 1).map_err(|_| out_of_range())?;
            if self.base.is_none() && v >= BASE_MIN {
                self.base = Some(v);
            }
            return Ok(v);
        }
        let base = self
            .base
            .ok_or_else(|| Error("a difference with no base".to_owned()))?;
        let v = i128::from(base)
            .checked_add(unzigzag(x >> 1))
            .ok_or_else(out_of_range)?;
        u64::try_from(v).map_err(|_| out_of_range())
    }

    fn str(&mut self) -> Result<&'de str> {
        let x: u128 = self.uint()?;
        if x & 1 == 1 {
            return usize::try_from(x >> 1)
                .ok()
                .and_then(|i| self.strings.get(i).copied())
                .ok_or_else(|| Error("a reference to no string".to_owned()));
        }
        let n = usize::try_from(x >> 1)
            .ok()
            .filter(|n| *n <= self.input.len())
            .ok_or_else(|| Error("a string longer than the record".to_owned()))?;
        let s = std::str::from_utf8(self.take(n)).map_err(|e| Error(e.to_string()))?;
        self.strings.push(s);
        Ok(s)
    }
}

/// The fields of a struct a [`Compact`] type reads, in declaration order:
/// a field past the record's count (written by an older build) is absent.
pub struct Fields {
    left: usize,
}

impl Fields {
    /// The next field, read by `read`; `None` past the record's count.
    #[inline(always)]
    pub fn next<'de, T>(
        &mut self,
        d: &mut Decoder<'de>,
        read: impl FnOnce(&mut Decoder<'de>) -> Result<T>,
    ) -> Result<Option<T>> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        read(d).map(Some)
    }

    /// A field every record has (no serde default): absent is corrupt.
    #[inline(always)]
    pub fn required<'de, T>(
        &mut self,
        d: &mut Decoder<'de>,
        name: &str,
        read: impl FnOnce(&mut Decoder<'de>) -> Result<T>,
    ) -> Result<T> {
        self.next(d, read)?
            .ok_or_else(|| Error(format!("missing field `{name}`")))
    }
}

/// `n` elements, then `None` (a struct's missing trailing fields).
struct Elements<'a, 'de> {
    d: &'a mut Decoder<'de>,
    left: usize,
}

impl<'de> de::SeqAccess<'de> for Elements<'_, 'de> {
    type Error = Error;
    #[inline]
    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        seed.deserialize(&mut *self.d).map(Some)
    }
    fn size_hint(&self) -> Option<usize> {
        Some(self.left)
    }
}

impl<'de> de::MapAccess<'de> for Elements<'_, 'de> {
    type Error = Error;
    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        seed.deserialize(&mut *self.d).map(Some)
    }
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value> {
        seed.deserialize(&mut *self.d)
    }
    fn size_hint(&self) -> Option<usize> {
        Some(self.left)
    }
}

impl<'de> de::EnumAccess<'de> for &mut Decoder<'de> {
    type Error = Error;
    type Variant = Self;
    fn variant_seed<V: DeserializeSeed<'de>>(self, seed: V) -> Result<(V::Value, Self)> {
        let index: u32 = self.uint()?;
        let v = seed.deserialize(index.into_deserializer())?;
        Ok((v, self))
    }
}

impl<'de> de::VariantAccess<'de> for &mut Decoder<'de> {
    type Error = Error;
    fn unit_variant(self) -> Result<()> {
        Ok(())
    }
    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value> {
        seed.deserialize(self)
    }
    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value> {
        visitor.visit_seq(Elements { d: self, left: len })
    }
    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        de::Deserializer::deserialize_struct(self, "", fields, visitor)
    }
}

macro_rules! decode_uint {
    ($($f:ident => $visit:ident),*) => {$(
        fn $f<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
            let v = self.uint()?;
            visitor.$visit(v)
        }
    )*};
}

macro_rules! decode_int {
    ($($f:ident => $visit:ident),*) => {$(
        fn $f<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
            let v = self.int()?;
            visitor.$visit(v)
        }
    )*};
}

impl<'de> de::Deserializer<'de> for &mut Decoder<'de> {
    type Error = Error;

    decode_uint!(deserialize_u8 => visit_u8, deserialize_u16 => visit_u16, deserialize_u32 => visit_u32,
        deserialize_u128 => visit_u128);

    #[inline]
    fn deserialize_u64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let v = self.u64()?;
        visitor.visit_u64(v)
    }
    decode_int!(deserialize_i8 => visit_i8, deserialize_i16 => visit_i16, deserialize_i32 => visit_i32,
        deserialize_i64 => visit_i64, deserialize_i128 => visit_i128);

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value> {
        Err(Error("format 3 is not self-describing".to_owned()))
    }
    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let v = self.bool()?;
        visitor.visit_bool(v)
    }
    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let bits: u32 = self.uint()?;
        visitor.visit_f32(f32::from_bits(bits.swap_bytes()))
    }
    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let bits: u64 = self.uint()?;
        visitor.visit_f64(f64::from_bits(bits.swap_bytes()))
    }
    fn deserialize_char<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let c: u32 = self.uint()?;
        visitor.visit_char(char::from_u32(c).ok_or_else(|| Error("not a char".to_owned()))?)
    }
    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let s = self.str()?;
        visitor.visit_borrowed_str(s)
    }
    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.deserialize_str(visitor)
    }
    fn deserialize_bytes<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_borrowed_bytes(self.bytes()?)
    }
    fn deserialize_byte_buf<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.deserialize_bytes(visitor)
    }
    #[inline]
    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        if self.option()? {
            visitor.visit_some(self)
        } else {
            visitor.visit_none()
        }
    }
    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_unit()
    }
    fn deserialize_unit_struct<V: Visitor<'de>>(self, _: &'static str, visitor: V) -> Result<V::Value> {
        visitor.visit_unit()
    }
    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _: &'static str, visitor: V) -> Result<V::Value> {
        visitor.visit_newtype_struct(self)
    }
    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let left = self.count()?;
        visitor.visit_seq(Elements { d: self, left })
    }
    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value> {
        visitor.visit_seq(Elements { d: self, left: len })
    }
    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value> {
        visitor.visit_seq(Elements { d: self, left: len })
    }
    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let left = self.count()?;
        visitor.visit_map(Elements { d: self, left })
    }
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        let left = self.fields(fields.len())?.left;
        visitor.visit_seq(Elements { d: self, left })
    }
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        visitor.visit_enum(self)
    }
    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let i: u32 = self.uint()?;
        visitor.visit_u32(i)
    }
    fn deserialize_ignored_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value> {
        Err(Error("format 3 cannot skip a value".to_owned()))
    }
    fn is_human_readable(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::{Deserialize, Serialize};
    use std::collections::BTreeMap;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum Mode {
        Open,
        Closed,
        Local(u64),
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Old {
        a: u64,
        b: String,
        m: BTreeMap<String, (u64, i64)>,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct New {
        a: u64,
        b: String,
        m: BTreeMap<String, (u64, i64)>,
        #[serde(default)]
        added: Option<Mode>,
    }

    fn enc<T: Serialize>(v: &T) -> Vec<u8> {
        let mut out = Vec::new();
        to_writer(&mut out, v).unwrap();
        out
    }

    #[test]
    fn values_round_trip_compactly() {
        let now_2026: u64 = 1_796_083_200_000_000_000;
        let ints = (
            0u64,
            127u64,
            128u64,
            now_2026,
            u64::MAX,
            -1i64,
            i64::MIN,
            u128::MAX,
        );
        let back: (u64, u64, u64, u64, u64, i64, i64, u128) = from_slice(&enc(&ints)).unwrap();
        assert_eq!(back, ints);
        let rest = (
            1.0f64,
            0.1f64,
            true,
            Some("x".to_owned()),
            None::<u8>,
            vec![Mode::Open, Mode::Closed, Mode::Local(7)],
        );
        let back: (f64, f64, bool, Option<String>, Option<u8>, Vec<Mode>) = from_slice(&enc(&rest)).unwrap();
        assert_eq!(back, rest);
        assert_eq!(enc(&63u64).len(), 1);
        assert_eq!(enc(&now_2026).len(), 9);
        assert_eq!(
            enc(&(now_2026, now_2026 + 2_000_000_000)).len(),
            9 + 5,
            "a timestamp 2 s after the base"
        );
        assert_eq!(enc(&1.0f64).len(), 3, "a round float is short");
        let (a, b) = ("tenant-1|api".to_owned(), "per-min".to_owned());
        let keys = vec![(a.clone(), b.clone()), (a.clone(), b.clone())];
        assert_eq!(
            enc(&keys).len(),
            1 + 1 + 12 + 1 + 7 + 1 + 1,
            "repeated strings by index"
        );
        assert_eq!(from_slice::<Vec<(String, String)>>(&enc(&keys)).unwrap(), keys);
    }

    #[test]
    fn forty_strings_each_repeated_are_written_once_each() {
        // 40 distinct names, each twice: the second of each is an index.
        let names: Vec<String> = (0..40).map(|i| format!("tenant-{i}|api")).collect();
        let twice: Vec<&String> = names.iter().chain(names.iter()).collect();
        let bytes = enc(&twice);
        let literals: usize = names.iter().map(|n| 1 + n.len()).sum();
        assert_eq!(bytes.len(), 1 + literals + 40, "each repeat one byte");
        assert_eq!(
            from_slice::<Vec<String>>(&bytes).unwrap(),
            [names.clone(), names].concat()
        );
    }

    #[test]
    fn an_appended_defaulted_field_reads_older_records_and_newer_records_are_refused() {
        let old = Old {
            a: 5,
            b: "k".into(),
            m: [("r".to_owned(), (1, -2))].into_iter().collect(),
        };
        let new: New = from_slice(&enc(&old)).unwrap();
        assert_eq!((new.a, new.b.as_str(), new.added), (5, "k", None));
        let newer = New {
            added: Some(Mode::Local(3)),
            ..new
        };
        assert!(from_slice::<Old>(&enc(&newer)).is_err());
    }

    #[test]
    fn corrupt_bytes_fail_without_a_large_allocation() {
        // A length of 2^62 with three bytes left.
        let mut bytes = Vec::new();
        put_varint(&mut bytes, 1 << 62);
        bytes.extend([1, 2, 3]);
        assert!(from_slice::<Vec<u8>>(&bytes).is_err());
        assert!(from_slice::<String>(&bytes).is_err());
        assert!(from_slice::<u64>(&[0xff; 20]).is_err());
        assert!(from_slice::<u8>(&[0x80, 0x02]).is_err(), "256 is no u8");
        assert!(from_slice::<u64>(&[2, 0]).is_err(), "trailing bytes");
        assert!(from_slice::<u64>(&[3]).is_err(), "a difference with no base");
        assert!(from_slice::<String>(&[5]).is_err(), "a reference to no string");
    }
}
