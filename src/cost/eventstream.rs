//! The AWS event stream encoding (`application/vnd.amazon.eventstream`),
//! read as it passes: how AWS Bedrock's `ConverseStream` (and
//! `InvokeModelWithResponseStream`) answer. Each message's payload is one
//! JSON document, scanned by [`Scanner`]; a message that is whole, whose
//! two checksums hold and whose document is well formed gives its fields'
//! values, and the last value seen of each field wins (ConverseStream's
//! usage comes in its last event, `metadata`: `{"usage": {"inputTokens":
//! …, "outputTokens": …, "totalTokens": …}, "metrics": …}`).
//!
//! A message, all integers big-endian: its total length (4 bytes), its
//! headers' length (4), the CRC-32 of those 8 bytes (4), the headers, the
//! payload, the CRC-32 of everything before it (4). The headers are not
//! read (a message of another type, an `exception`, has no usage in its
//! payload). A length out of bounds or a checksum that does not hold
//! breaks the stream: nothing after it is read, and the stream has no
//! figure.
//!
//! Bounded memory whatever the stream: the 12 bytes of a prelude, a
//! checksum and one scanner.

use super::json::{Found, Scanner};
use crate::policy::settle::Field;

/// A prelude's bytes: total length, headers' length, their checksum.
const PRELUDE: usize = 12;
/// The shortest message: a prelude and the message's checksum.
const MIN_MESSAGE: u32 = 16;
/// The longest message the encoding allows (16 MiB).
const MAX_MESSAGE: u32 = 16 * 1024 * 1024;
/// The longest headers the encoding allows (128 KiB).
const MAX_HEADERS: u32 = 128 * 1024;

/// CRC-32 (IEEE 802.3, as zlib's `crc32`), a byte at a time by table.
const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut n = 0;
    while n < 256 {
        let mut c = n as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[n] = c;
        n += 1;
    }
    table
};

/// A running CRC-32.
#[derive(Debug, Clone, Copy)]
struct Crc(u32);

impl Crc {
    fn new() -> Crc {
        Crc(0xFFFF_FFFF)
    }

    fn byte(&mut self, b: u8) {
        let index = usize::from((self.0 as u8) ^ b);
        self.0 = CRC_TABLE.get(index).copied().unwrap_or(0) ^ (self.0 >> 8);
    }

    fn value(self) -> u32 {
        self.0 ^ 0xFFFF_FFFF
    }
}

/// Where in a message the reader is.
#[derive(Debug, Clone)]
enum Part {
    /// Its prelude's first `n` bytes are in `prelude`.
    Prelude(usize),
    /// Headers: `left` bytes more.
    Headers { left: u32 },
    /// Payload: `left` bytes more, fed to the scanner.
    Payload { left: u32 },
    /// The message's checksum: its first `n` bytes are in `prelude`.
    Checksum(usize),
    /// A length or checksum did not hold: nothing more is read.
    Broken,
}

/// The reader (see the module header).
#[derive(Debug, Clone)]
pub struct Messages {
    part: Part,
    prelude: [u8; PRELUDE],
    /// The message's running checksum.
    crc: Crc,
    /// Its payload's length.
    payload: u32,
    scanner: Scanner,
    found: Found,
    /// Messages read since one gave a field's value.
    since_usage: u64,
}

impl Default for Messages {
    fn default() -> Messages {
        Messages {
            part: Part::Prelude(0),
            prelude: [0; PRELUDE],
            crc: Crc::new(),
            payload: 0,
            scanner: Scanner::default(),
            found: Found::default(),
            since_usage: 0,
        }
    }
}

fn be32(bytes: &[u8]) -> u32 {
    let mut four = [0u8; 4];
    if let Some(b) = bytes.get(..4) {
        four.copy_from_slice(b);
    }
    u32::from_be_bytes(four)
}

impl Messages {
    /// Reads the next bytes of the stream.
    pub fn feed(&mut self, bytes: &[u8], fields: &[Field]) {
        self.feed_until(bytes, fields, u64::MAX);
    }

    /// Reads the next bytes of the stream until a message takes the
    /// running cost ([`Messages::running`]) past `limit`: then stops right
    /// after that message and returns how many bytes it read. `None`: all
    /// were read (or the stream broke).
    pub fn feed_until(&mut self, bytes: &[u8], fields: &[Field], limit: u64) -> Option<usize> {
        for (i, &b) in bytes.iter().enumerate() {
            let ended = self.byte(b, fields);
            if matches!(self.part, Part::Broken) {
                return None;
            }
            if ended && self.running(fields) > limit {
                return Some(i.saturating_add(1));
            }
        }
        None
    }

    /// The running cost of what has been read (see
    /// [`Found::running`]): each message counts as an event.
    pub fn running(&self, fields: &[Field]) -> u64 {
        self.found.running(self.since_usage, fields)
    }

    /// The stream ended: the fields' last values, if it ended between
    /// messages and was never broken (`None`: broken or cut short).
    pub fn finish(&self) -> Option<Found> {
        matches!(self.part, Part::Prelude(0)).then_some(self.found)
    }

    /// Reads one byte; whether it ended a whole message.
    fn byte(&mut self, b: u8, fields: &[Field]) -> bool {
        match self.part {
            Part::Prelude(n) => {
                if let Some(slot) = self.prelude.get_mut(n) {
                    *slot = b;
                }
                if n < 8 {
                    self.crc.byte(b);
                }
                self.part = if n + 1 == PRELUDE {
                    self.start_message()
                } else {
                    Part::Prelude(n + 1)
                };
            }
            Part::Headers { left } => {
                self.crc.byte(b);
                self.part = self.after_headers(left.saturating_sub(1));
            }
            Part::Payload { left } => {
                self.crc.byte(b);
                self.scanner.feed(&[b], fields);
                let left = left.saturating_sub(1);
                self.part = if left == 0 {
                    Part::Checksum(0)
                } else {
                    Part::Payload { left }
                };
            }
            Part::Checksum(n) => {
                if let Some(slot) = self.prelude.get_mut(n) {
                    *slot = b;
                }
                if n + 1 == 4 {
                    self.part = self.end_message(fields);
                    return matches!(self.part, Part::Prelude(0));
                }
                self.part = Part::Checksum(n + 1);
            }
            Part::Broken => {}
        }
        false
    }

    /// A whole prelude: its lengths and checksum, then the message's
    /// checksum runs on over the prelude's checksum too.
    fn start_message(&mut self) -> Part {
        let total = be32(&self.prelude);
        let headers = be32(self.prelude.get(4..).unwrap_or_default());
        let prelude_crc = be32(self.prelude.get(8..).unwrap_or_default());
        let lengths_hold = (MIN_MESSAGE..=MAX_MESSAGE).contains(&total)
            && headers <= MAX_HEADERS
            && headers <= total - MIN_MESSAGE;
        if !lengths_hold || self.crc.value() != prelude_crc {
            return Part::Broken;
        }
        for b in prelude_crc.to_be_bytes() {
            self.crc.byte(b);
        }
        self.payload = total - MIN_MESSAGE - headers;
        self.scanner = Scanner::default();
        self.after_headers(headers)
    }

    fn after_headers(&self, left: u32) -> Part {
        match (left, self.payload) {
            (0, 0) => Part::Checksum(0),
            (0, payload) => Part::Payload { left: payload },
            (left, _) => Part::Headers { left },
        }
    }

    /// A whole message: its checksum holds, and its document's values win.
    fn end_message(&mut self, fields: &[Field]) -> Part {
        if self.crc.value() != be32(&self.prelude) {
            return Part::Broken;
        }
        let usage = self.payload > 0
            && self
                .scanner
                .finish(fields)
                .is_some_and(|found| self.found.merge(&found));
        self.since_usage = if usage {
            0
        } else {
            self.since_usage.saturating_add(1)
        };
        self.crc = Crc::new();
        Part::Prelude(0)
    }
}

/// Encodes one message (tests): headers `(name, string value)`, payload.
#[cfg(test)]
pub fn encode(headers: &[(&str, &str)], payload: &[u8]) -> Vec<u8> {
    let mut h = Vec::new();
    for (name, value) in headers {
        h.push(name.len() as u8);
        h.extend_from_slice(name.as_bytes());
        h.push(7); // a string
        h.extend_from_slice(&(value.len() as u16).to_be_bytes());
        h.extend_from_slice(value.as_bytes());
    }
    let total = (PRELUDE + h.len() + payload.len() + 4) as u32;
    let mut m = Vec::new();
    m.extend_from_slice(&total.to_be_bytes());
    m.extend_from_slice(&(h.len() as u32).to_be_bytes());
    let crc = |bytes: &[u8]| {
        let mut c = Crc::new();
        bytes.iter().for_each(|b| c.byte(*b));
        c.value()
    };
    let prelude_crc = crc(&m);
    m.extend_from_slice(&prelude_crc.to_be_bytes());
    m.extend_from_slice(&h);
    m.extend_from_slice(payload);
    let message_crc = crc(&m);
    m.extend_from_slice(&message_crc.to_be_bytes());
    m
}

/// A Bedrock `ConverseStream` answer of `text` in two deltas, with its
/// usage in the `metadata` event (tests).
#[cfg(test)]
pub fn converse_stream(input: u64, output: u64) -> Vec<u8> {
    let event = |kind: &str, payload: String| {
        encode(
            &[
                (":event-type", kind),
                (":content-type", "application/json"),
                (":message-type", "event"),
            ],
            payload.as_bytes(),
        )
    };
    let mut s = Vec::new();
    s.extend(event("messageStart", r#"{"p":"abcd","role":"assistant"}"#.into()));
    s.extend(event(
        "contentBlockDelta",
        r#"{"contentBlockIndex":0,"delta":{"text":"Hel"},"p":"abcdefgh"}"#.into(),
    ));
    s.extend(event(
        "contentBlockDelta",
        r#"{"contentBlockIndex":0,"delta":{"text":"lo"},"p":"ab"}"#.into(),
    ));
    s.extend(event(
        "contentBlockStop",
        r#"{"contentBlockIndex":0,"p":"a"}"#.into(),
    ));
    s.extend(event(
        "messageStop",
        r#"{"p":"abc","stopReason":"end_turn"}"#.into(),
    ));
    s.extend(event(
        "metadata",
        format!(
            r#"{{"metrics":{{"latencyMs":412}},"p":"abcdef","usage":{{"inputTokens":{input},"outputTokens":{output},"totalTokens":{}}}}}"#,
            input + output
        ),
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::settle::{parse_pointer, WEIGHT_SCALE};

    fn total() -> Vec<Field> {
        vec![Field {
            name: "/usage/totalTokens".into(),
            pointers: vec![parse_pointer("/usage/totalTokens").unwrap()],
            weight_milli: WEIGHT_SCALE,
            negative: false,
            optional: false,
        }]
    }

    fn read(stream: &[u8], chunk: usize) -> Option<Found> {
        let f = total();
        let mut m = Messages::default();
        for part in stream.chunks(chunk.max(1)) {
            m.feed(part, &f);
        }
        m.finish()
    }

    #[test]
    fn the_checksum_is_zlibs_crc32() {
        let mut c = Crc::new();
        b"123456789".iter().for_each(|b| c.byte(*b));
        assert_eq!(c.value(), 0xCBF4_3926);
    }

    #[test]
    fn a_converse_stream_gives_its_metadata_usage_in_any_chunking() {
        let stream = converse_stream(30, 628);
        for chunk in [1, 2, 3, 7, 16, 100, stream.len()] {
            assert_eq!(
                read(&stream, chunk).and_then(|f| f.values[0]),
                Some(658),
                "{chunk}"
            );
        }
        // Cut anywhere before its end: no figure (cut inside a message), or
        // no usage yet (cut between messages before `metadata`).
        for cut in 0..stream.len() {
            let got = read(&stream[..cut], 5).and_then(|f| f.values[0]);
            assert_eq!(got, None, "cut at {cut}");
        }
    }

    #[test]
    fn a_checksum_or_length_that_does_not_hold_breaks_the_stream() {
        let good = converse_stream(1, 2);
        let f = total();
        // Every single flipped byte: never a figure other than the true one.
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x01;
            let got = read(&bad, 9).and_then(|found| found.values[0]);
            assert!(got.is_none() || got == Some(3), "byte {i}: {got:?}");
        }
        // A length past the encoding's bound.
        let mut huge = encode(&[], b"{}");
        huge[..4].copy_from_slice(&(MAX_MESSAGE + 1).to_be_bytes());
        let mut m = Messages::default();
        m.feed(&huge, &f);
        assert!(m.finish().is_none());
    }

    #[test]
    fn random_bytes_never_panic() {
        let f = total();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..500 {
            let mut m = Messages::default();
            let bytes: Vec<u8> = (0..(x % 300))
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            m.feed(&bytes, &f);
            let _ = m.finish();
        }
    }
}
