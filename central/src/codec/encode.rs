//! Format 3 written: the [`Encoder`] and its serde `Serializer` (see the
//! format in [`super`]).

use serde::ser::{self, Serialize};

use super::format::{put_varint, put_varint64, varint_len, zigzag, Error, Result, BASE_MIN};

/// Appends `value`'s encoding to `out`.
pub fn to_writer<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) -> Result<()> {
    encode_with(out, |e| value.serialize(e))
}

pub(super) fn encode_with(out: &mut Vec<u8>, f: impl FnOnce(&mut Encoder<'_>) -> Result<()>) -> Result<()> {
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

/// Writes format 3 (see the module header); [`Compact`](super::Compact) types call its
/// methods field by field.
pub struct Encoder<'a> {
    pub(super) out: &'a mut Vec<u8>,
    pub(super) base: Option<u64>,
    /// Every string written literally: (start in `out`, length).
    pub(super) strings: Vec<(usize, usize)>,
    /// A hash of each literal string → its index in `strings`.
    pub(super) seen: hashbrown::HashMap<u64, u32>,
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

/// The values [`Compact`](super::Compact) code writes, each exactly as serde's path for
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
