//! Format 3 read: the [`Decoder`] and its serde `Deserializer` (see the
//! format in [`super`]).

use serde::de::{self, DeserializeSeed, IntoDeserializer, Visitor};

use super::format::{unzigzag, Error, Result, BASE_MIN};

/// Decodes a whole record: every byte must be used.
pub fn from_slice<'de, T: de::Deserialize<'de>>(bytes: &'de [u8]) -> Result<T> {
    decode_with(bytes, |d| T::deserialize(d))
}

pub(super) fn decode_with<'de, T>(
    bytes: &'de [u8],
    f: impl FnOnce(&mut Decoder<'de>) -> Result<T>,
) -> Result<T> {
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

/// Reads format 3; [`Compact`](super::Compact) types call its methods field by field.
pub struct Decoder<'de> {
    pub(super) input: &'de [u8],
    pub(super) base: Option<u64>,
    /// Every string read literally, in order.
    pub(super) strings: Vec<&'de str>,
}

/// The values [`Compact`](super::Compact) code reads, each exactly as serde's path for its
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

/// The fields of a struct a [`Compact`](super::Compact) type reads, in declaration order:
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
