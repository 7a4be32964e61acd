//! Server-sent events (`text/event-stream`, the WHATWG event stream
//! format) read as they pass: each event's `data:` lines (joined by a line
//! feed) are one JSON document, scanned by [`Scanner`]; an event whose
//! document is whole and well formed gives its fields' values, and the
//! last value seen of each field wins. Other events (`data: [DONE]`, a
//! malformed document, comments, `event:` and `id:` lines) say nothing.
//!
//! **Terminal events.** An event that says the answer is over (see
//! [`Events::ended`]) ends the reading: what the stream said up to it is
//! final, and nothing after it is read. They are the providers' own:
//! OpenAI's `data: [DONE]`, Anthropic's `event: message_stop`, the
//! Responses API's `event: response.completed` (or `.incomplete`,
//! `.failed`). An event counts once a blank line has ended it.
//!
//! Bounded memory whatever the stream: one scanner and a few bytes of the
//! current line's start (to recognise `data:` and `event:`) and of an
//! event's name, never a whole line.

use super::json::{Found, Scanner};
use crate::policy::settle::{Field, MAX_FIELDS};

const DATA: &[u8] = b"data:";
const EVENT: &[u8] = b"event:";
/// The data of OpenAI's terminal event.
const DONE: &[u8] = b"[DONE]";
/// The names (`event:`) of terminal events.
const TERMINAL_NAMES: [&[u8]; 4] = [
    b"message_stop",
    b"response.completed",
    b"response.incomplete",
    b"response.failed",
];
/// Longest event name kept (longer ones are no terminal event's).
const MAX_NAME: usize = 24;

/// Where in a line the reader is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// At its `n`-th byte, which may still begin `data:` or `event:`.
    Start(usize),
    /// After `data:` (and its optional space): the rest goes to the event.
    Data { first: bool },
    /// After `event:` (and its optional space): the event's name.
    Name { first: bool },
    /// A line of another field, or a comment: ignored to its end.
    Other,
}

/// The reader (see the module header).
#[derive(Debug, Clone)]
pub struct Events {
    line: Line,
    /// The last byte was `\r` (a `\n` after it ends no second line).
    after_cr: bool,
    /// The current event's document, if it has a `data:` line yet.
    event: Option<Scanner>,
    /// The current line's first bytes (to tell `data:` from `event:`).
    head: [u8; 6],
    /// The current event's name (`len > MAX_NAME`: too long to be one).
    name: [u8; MAX_NAME],
    name_len: usize,
    /// Bytes of the current event's data that match [`DONE`] so far
    /// (`None`: it is not `[DONE]`).
    done: Option<usize>,
    /// A terminal event has been read: nothing more is.
    ended: bool,
    found: Found,
}

impl Default for Events {
    fn default() -> Events {
        Events {
            line: Line::Start(0),
            after_cr: false,
            event: None,
            head: [0; 6],
            name: [0; MAX_NAME],
            name_len: 0,
            done: Some(0),
            ended: false,
            found: Found::default(),
        }
    }
}

impl Events {
    /// Reads the next bytes of the stream.
    pub fn feed(&mut self, bytes: &[u8], fields: &[Field]) {
        for &b in bytes {
            if self.ended {
                return;
            }
            if b == b'\n' && self.after_cr {
                self.after_cr = false;
                continue;
            }
            self.after_cr = b == b'\r';
            if b == b'\n' || b == b'\r' {
                self.end_line(fields);
                continue;
            }
            self.line = match self.line {
                Line::Start(n) => self.line_start(n, b, fields),
                Line::Other => Line::Other,
                Line::Data { first } => {
                    // One space after the colon is not part of the data.
                    if !(first && b == b' ') {
                        if let Some(s) = self.event.as_mut() {
                            s.feed(&[b], fields);
                        }
                        self.done = self.done.and_then(|n| (DONE.get(n) == Some(&b)).then_some(n + 1));
                    }
                    Line::Data { first: false }
                }
                Line::Name { first } => {
                    if !(first && b == b' ') {
                        match self.name.get_mut(self.name_len) {
                            Some(slot) => {
                                *slot = b;
                                self.name_len += 1;
                            }
                            None => self.name_len = MAX_NAME + 1,
                        }
                    }
                    Line::Name { first: false }
                }
            };
        }
    }

    /// The `n`-th byte `b` of a line that may still begin `data:` or
    /// `event:`.
    fn line_start(&mut self, n: usize, b: u8, fields: &[Field]) -> Line {
        let Some(slot) = self.head.get_mut(n) else {
            return Line::Other;
        };
        *slot = b;
        let head = self.head.get(..=n).unwrap_or_default();
        if head == DATA {
            self.start_data(fields);
            Line::Data { first: true }
        } else if head == EVENT {
            // A later `event:` line of the same event replaces the name.
            self.name_len = 0;
            Line::Name { first: true }
        } else if DATA.starts_with(head) || EVENT.starts_with(head) {
            Line::Start(n + 1)
        } else {
            Line::Other
        }
    }

    /// A terminal event has been read (see the module header): the answer
    /// is over, and what the stream said up to it is final.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// The stream ended: the fields' last values (an event not yet closed
    /// by a blank line counts too).
    pub fn finish(&mut self, fields: &[Field]) -> Found {
        self.dispatch(fields);
        self.found
    }

    /// A `data:` line starts: a later line of the same event is joined to
    /// the earlier ones by a line feed.
    fn start_data(&mut self, fields: &[Field]) {
        match self.event.as_mut() {
            Some(s) => {
                s.feed(b"\n", fields);
                // Data of several lines is not `[DONE]`.
                self.done = None;
            }
            None => self.event = Some(Scanner::default()),
        }
    }

    fn end_line(&mut self, fields: &[Field]) {
        if self.line == Line::Start(0) {
            // A blank line ends the event.
            self.dispatch(fields);
        }
        self.line = Line::Start(0);
    }

    /// The event ends: its values, if its document is whole, win; a
    /// terminal event ends the reading.
    fn dispatch(&mut self, fields: &[Field]) {
        let name = self.name.get(..self.name_len).unwrap_or_default();
        let terminal_name = TERMINAL_NAMES.contains(&name);
        self.name_len = 0;
        let done = std::mem::replace(&mut self.done, Some(0)) == Some(DONE.len());
        // An event without data is no event (its name is dropped).
        let Some(mut s) = self.event.take() else { return };
        self.ended = terminal_name || done;
        let Some(found) = s.finish(fields) else { return };
        for i in 0..MAX_FIELDS {
            if let Some(v) = found.values.get(i).copied().flatten() {
                if let Some(slot) = self.found.values.get_mut(i) {
                    *slot = Some(v);
                }
            }
        }
        self.found.malformed |= found.malformed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::settle::{parse_pointer, WEIGHT_SCALE};

    fn fields(pointers: &[&[&str]]) -> Vec<Field> {
        pointers
            .iter()
            .map(|ps| Field {
                name: ps[0].to_owned(),
                pointers: ps.iter().map(|p| parse_pointer(p).unwrap()).collect(),
                weight_milli: WEIGHT_SCALE,
            })
            .collect()
    }

    fn read(stream: &str, f: &[Field]) -> Found {
        let mut answers = Vec::new();
        for chunk in [1, 2, 3, 7, 64, stream.len().max(1)] {
            let mut e = Events::default();
            for part in stream.as_bytes().chunks(chunk) {
                e.feed(part, f);
            }
            answers.push(e.finish(f));
        }
        assert!(answers.windows(2).all(|w| w[0] == w[1]), "{answers:?}");
        answers[0]
    }

    #[test]
    fn the_usage_of_an_openai_stream_comes_in_its_last_event() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}],\"usage\":null}\n\n\
                      data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}],\"usage\":null}\n\n\
                      data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11}}\n\n\
                      data: [DONE]\n\n";
        let f = fields(&[&["/usage/total_tokens"]]);
        let found = read(stream, &f);
        assert_eq!(found.values[0], Some(11));
        // `"usage": null` in the earlier events is not at the field.
        assert!(!found.malformed);
    }

    #[test]
    fn an_anthropic_stream_gives_input_first_and_output_last() {
        let stream = "event: message_start\r\n\
            data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\r\n\r\n\
            event: content_block_delta\r\n\
            data: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"Hi\"}}\r\n\r\n\
            : a comment\r\n\r\n\
            event: message_delta\r\n\
            data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\r\n\r\n\
            event: message_stop\r\n\
            data: {\"type\":\"message_stop\"}\r\n\r\n";
        let f = fields(&[
            &["/usage/input_tokens", "/message/usage/input_tokens"],
            &["/usage/output_tokens", "/message/usage/output_tokens"],
        ]);
        let found = read(stream, &f);
        assert_eq!(&found.values[..2], &[Some(25), Some(15)]);
        assert!(!found.malformed);
    }

    #[test]
    fn multi_line_data_joins_and_a_cut_event_says_nothing() {
        let f = fields(&[&["/usage/total_tokens"]]);
        let joined = "data: {\"usage\":\ndata: {\"total_tokens\": 7}}\n\n";
        assert_eq!(read(joined, &f).values[0], Some(7));
        let cut = "data: {\"usage\":{\"total_tokens\":5}}\n\ndata: {\"usage\":{\"total_tok";
        assert_eq!(read(cut, &f).values[0], Some(5));
        let last_unterminated =
            "data: {\"usage\":{\"total_tokens\":5}}\n\ndata: {\"usage\":{\"total_tokens\":6}}";
        assert_eq!(read(last_unterminated, &f).values[0], Some(6));
        let not_data = "dat: {\"usage\":{\"total_tokens\":5}}\n\ndata:{\"usage\":{\"total_tokens\":8}}\r\r";
        assert_eq!(read(not_data, &f).values[0], Some(8));
    }
}
