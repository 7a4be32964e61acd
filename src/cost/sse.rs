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
//! **The running cost** ([`Events::running`]), for metering a stream as it
//! flows: the weighted sum of the fields' last values (a field not seen yet
//! counts 0), plus, for every event with data since the last event that
//! carried a field's value, one token at the largest field weight. Why it
//! bounds what has passed: a usage figure reported along the way (Gemini's
//! `usageMetadata`, Anthropic's `message_start` and `message_delta`, an
//! OpenAI-compatible server's continuous usage) is a running total of the
//! answer so far, and the providers' streams send a delta event per token
//! generated (OpenAI's chat chunks, Anthropic's `content_block_delta`, the
//! Responses API's `output_text.delta`): a stream that packs k tokens in an
//! event makes the bound k times loose, which the real cost at the end
//! settles. The input tokens of a format that reports no usage before its
//! end (OpenAI's, without continuous usage) are not in it: the estimate
//! covers them.
//!
//! Bounded memory whatever the stream: one scanner and a few bytes of the
//! current line's start (to recognise `data:` and `event:`) and of an
//! event's name, never a whole line.

use super::json::{Found, Scanner};
use crate::policy::settle::Field;

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

/// The kind of event stream, told by its event names: what terminal event
/// ends it when the filter ends it early ([`Style::terminal_event`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Style {
    /// Data only (OpenAI's Chat Completions and compatible servers).
    #[default]
    Data,
    /// Anthropic's Messages (`event: message_start`).
    Anthropic,
    /// OpenAI's Responses API (`event: response.…`).
    Responses,
}

impl Style {
    /// The terminal event the filter sends when it ends a stream of this
    /// style early: the provider's own, so a client reads a finished answer.
    pub fn terminal_event(self) -> &'static [u8] {
        match self {
            Style::Data => b"data: [DONE]\n\n",
            Style::Anthropic => b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
            Style::Responses => {
                b"event: response.incomplete\ndata: {\"type\":\"response.incomplete\",\"response\":{\"status\":\"incomplete\",\"incomplete_details\":{\"reason\":\"max_output_tokens\"}}}\n\n"
            }
        }
    }
}

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
    /// Events with data since the last one that carried a field's value.
    since_usage: u64,
    style: Style,
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
            since_usage: 0,
            style: Style::Data,
            found: Found::default(),
        }
    }
}

impl Events {
    /// Reads the next bytes of the stream.
    pub fn feed(&mut self, bytes: &[u8], fields: &[Field]) {
        self.feed_until(bytes, fields, u64::MAX);
    }

    /// Reads the next bytes of the stream until an event takes the running
    /// cost ([`Events::running`]) past `limit`: then stops right after that
    /// event (and its line break) and returns how many bytes it read.
    /// `None`: all were read (or a terminal event ended the reading).
    pub fn feed_until(&mut self, bytes: &[u8], fields: &[Field], limit: u64) -> Option<usize> {
        for (i, &b) in bytes.iter().enumerate() {
            if self.ended {
                return None;
            }
            if b == b'\n' && self.after_cr {
                self.after_cr = false;
                continue;
            }
            self.after_cr = b == b'\r';
            if b == b'\n' || b == b'\r' {
                if self.end_line(fields) && !self.ended && self.running(fields) > limit {
                    let crlf = self.after_cr && bytes.get(i + 1) == Some(&b'\n');
                    if crlf {
                        self.after_cr = false;
                    }
                    return Some(i + 1 + usize::from(crlf));
                }
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
        None
    }

    /// The running cost of what has been read (see the module header),
    /// in units.
    pub fn running(&self, fields: &[Field]) -> u64 {
        self.found.running(self.since_usage, fields)
    }

    /// The stream's kind, by the event names read so far.
    pub fn style(&self) -> Style {
        self.style
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

    /// A line ended; `true` if it was blank and ended an event with data.
    fn end_line(&mut self, fields: &[Field]) -> bool {
        let blank = self.line == Line::Start(0);
        self.line = Line::Start(0);
        // A blank line ends the event.
        blank && self.dispatch(fields)
    }

    /// The event ends: its values, if its document is whole, win; a
    /// terminal event ends the reading.
    fn dispatch(&mut self, fields: &[Field]) -> bool {
        let name = self.name.get(..self.name_len).unwrap_or_default();
        let terminal_name = TERMINAL_NAMES.contains(&name);
        if name == b"message_start" {
            self.style = Style::Anthropic;
        } else if name.starts_with(b"response.") {
            self.style = Style::Responses;
        }
        self.name_len = 0;
        let done = self.done.replace(0) == Some(DONE.len());
        // An event without data is no event (its name is dropped).
        let Some(mut s) = self.event.take() else {
            return false;
        };
        self.ended = terminal_name || done;
        let usage = s.finish(fields).is_some_and(|found| self.found.merge(&found));
        self.since_usage = if usage {
            0
        } else {
            self.since_usage.saturating_add(1)
        };
        true
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
                negative: false,
                optional: false,
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
