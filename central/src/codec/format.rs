//! Format 3's error and the varint arithmetic the encoder and the decoder
//! share (see the format in [`super`]).

use serde::{de, ser};

/// Why a record did not encode or decode.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Error(pub(super) String);

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

#[inline(always)]
pub(super) fn put_varint64(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        // The low seven bits, with the continuation bit.
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(super) fn put_varint(out: &mut Vec<u8>, mut v: u128) {
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

pub(super) fn zigzag(v: i128) -> u128 {
    ((v << 1) ^ (v >> 127)) as u128
}

pub(super) fn unzigzag(v: u128) -> i128 {
    ((v >> 1) as i128) ^ -((v & 1) as i128)
}

/// `u64`s at or above this start a record's base (see the module header).
pub(super) const BASE_MIN: u64 = 1 << 40;

pub(super) fn varint_len(v: u64) -> u32 {
    (64 - v.leading_zeros()).div_ceil(7).max(1)
}
