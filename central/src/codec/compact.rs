//! Records that write and read themselves field by field through the same
//! [`Encoder`] and [`Decoder`] primitives (see "Records written by hand" in
//! [`super`]).

use super::decode::{decode_with, Decoder};
use super::encode::{encode_with, Encoder};
use super::format::Result;

/// A record type whose format 3 encoding is written by hand rather than
/// through serde: the (key, limit) record, which every key report decodes
/// and encodes once (serde's visitors and per-field calls were most of a
/// key report's CPU). It must give exactly the bytes its `Serialize`
/// gives, and read them as its `Deserialize` does, fields in declaration
/// order: a struct is [`Encoder::fields`] then each field, read back
/// through [`Fields`](super::decode::Fields) (a field past an older record's count takes its
/// default). `crate::alloc::record`'s tests compare both ways.
pub trait Compact: Sized {
    fn write(&self, e: &mut Encoder<'_>);
    fn read(d: &mut Decoder<'_>) -> Result<Self>;
}

/// Appends `value`'s encoding to `out`, written by its own [`Compact`]
/// code: the same bytes as [`to_writer`](super::to_writer).
pub fn to_writer_compact<T: Compact>(out: &mut Vec<u8>, value: &T) -> Result<()> {
    encode_with(out, |e| {
        value.write(e);
        Ok(())
    })
}

/// Decodes a whole record by its own [`Compact`] code: what
/// [`from_slice`](super::from_slice) gives.
pub fn from_slice_compact<T: Compact>(bytes: &[u8]) -> Result<T> {
    decode_with(bytes, T::read)
}
