//! Costs known only after the response (model APIs' tokens): reserve an
//! estimate on the request, settle the real cost at the stream's end.
//!
//! # Semantics
//! A route class with `settle:` (see [`crate::policy::settle`]) charges an
//! **estimate** `E` on the request, all or nothing, like any cost: the
//! class's `cost`, or the integer of a trusted request header, or a
//! top-level field of the request's JSON body (then `cost` on the headers
//! and the difference when the body passes), cut to `[1, min(C, the
//! smallest burst)]`. It is charged on the exact path: never from or into
//! a worker lease (`crate::pipeline::lease`), so every unit of it is in
//! the node-wide entry at once.
//!
//! The **real cost** `R` comes from the upstream's response only, read as
//! it passes ([`Meter`]): a response header, a trailer, or fields of a JSON
//! body (a top-level array read as a stream of documents: Gemini's), of a
//! server-sent-events stream or of an AWS event stream (Bedrock's
//! `ConverseStream`) (the last value seen wins; the
//! cost is their weighted sum, rounded up), never from anything the client
//! sends. A figure above the ceiling `C` is cut to `C` (counted). A stream
//! that ends before its response did (client abort, upstream reset,
//! timeout, idle cut) costs `C`, whatever its events said so far: **the
//! abort rule** ([`Meter::end`] states it per format); an event stream's
//! response ends at its terminal event where the format has one (**the
//! terminal-event rule**, same place). A response that
//! ends without a usable figure ([`Unusable`]: missing, malformed, or a
//! body past `max_body_bytes`) costs `C` or `E` (`on_missing`; `C` by
//! default).
//!
//! At the response's end (its last body chunk, its trailers, or headers
//! that end it), or at the stream's end if the response never completed,
//! the difference `R − E` is **settled** to every limit the request was
//! charged against, and its guard (`crate::engine::settle`: one key-table
//! update per key, nothing when `R = E`): given back, or charged without
//! admission, past a limit's capacity by at most its `max_debt` `D` (the
//! key is then **in debt**: its requests are refused, with the `Retry-After`
//! of the debt's repayment; what does not fit `D` is **written off** and
//! counted).
//!
//! # Compression
//! A metered request goes to its upstream with `accept-encoding: identity`
//! (set by the filter, replacing the client's: `Directive::identity_encoding`),
//! so the answer the meter reads is uncompressed. Chosen over decoding
//! gzip, deflate, br and zstd in the filter: nothing to inflate (no
//! decompression bomb to cap, no decoder state per stream, no four decoders
//! in a wasm binary), and the answer toward the client can still be
//! compressed by Envoy's compressor filter placed before tenantgate. An
//! upstream that compresses anyway (`content-encoding` other than
//! `identity`) is not read: [`Unusable::Encoded`], charged by
//! `on_missing`. A leading UTF-8 byte order mark is skipped.
//!
//! # Metered as it flows
//! A streamed answer keeps a running cost as it passes, an upper bound of
//! what has passed that its format gives ([`sse::Events::running`]: usage
//! reported along the way, else one token per delta event), drawing on
//! what its request reserved. When an event takes it past that, the
//! pipeline reserves `settle.chunk` more through the same charge as
//! admission; if the limits refuse, the answer ends right after that event
//! with its provider's terminal event ([`Flow::End`]) and is settled at its
//! running cost ([`Figure::Ended`]). A non-streamed answer over its
//! reservation is charged, or under `over_reservation: refuse` reserved
//! and, if refused, its last chunk withheld. [`Meter::on_body_flow`] decides;
//! the pipeline charges (`crate::pipeline::settle`), hosts rewrite chunks.
//!
//! # THE BOUND
//! For a token bucket of rate `r`, burst `B` and debt allowance `D`, count
//! each request's real cost as used when it was admitted. The real cost of
//! the requests admitted in any interval of length `d` is at most
//!
//! `B + D + r·d + Σ_unsettled (C − E_i) + Σ_returned (E_j − R_j) + W`
//!
//! where *unsettled* are those of the interval's requests still in flight
//! at its end (at most the requests in flight at once, each `C − E` over
//! its reservation: **in-flight requests × (ceiling − estimate)**),
//! *returned* are requests admitted before the interval whose settlements
//! gave reservation back during it (0 when real costs are never below
//! estimates, e.g. the adversary whose costs are always at the ceiling),
//! and `W` the units written off in the interval (0 while the debt never
//! reaches `D`; `tenantgate.cost.written_off_units`). From the key's first
//! request on, nothing is returned from before: the total real cost is at
//! most `B + D + r·t + in-flight × (C − E) + W`.
//!
//! Why: every unit charged, estimate or settled difference, moves the key's
//! TAT by `T = 1/r` and every unit given back moves it back; the TAT stays
//! within `[now, now + τ + D·T]` (`τ = B·T`, `crate::limiter::token_bucket`,
//! "Debt") and forgetting idle time only lowers it. So the units charged in
//! the interval, estimates of its requests plus the differences settled in
//! it less the written-off ones, are at most `B + D + r·d`. The real cost of
//! its requests is that, less what requests from before settled in it
//! (their refunds, added back), plus what its own requests have not
//! settled yet (at most `C − E` each).
//!
//! With answers metered as they flow, what a key's clients are *served*
//! in any interval is at most `B + D + r·d + Σ_in-flight (E + chunk + e) +
//! W`, and from its first request `B + D + r·t + N·e + W` (`N` streams,
//! `e` the tokens of one event): every chunk is admitted like a request,
//! and a stream ends one event past its reservation when refused.
//! Every stream read is metered as it flows: server-sent events, a
//! top-level JSON array's elements (Gemini) and AWS event stream messages
//! (Bedrock) are its events. Non-streamed answers keep the `C − E` term.
//! Tested in `src/pipeline/flow_tests.rs` (1,200 streams lying about
//! `max_tokens`) and `cost::tests` (each stream format ended at an event).
//!
//! A fixed window or a sliding counter charges at most `rate + D` to an
//! aligned window (a late settlement goes to the window current at the
//! stream's end; a fixed window's debt ends with its window, a counter's
//! decays over the next); a sliding log, exact, takes a settlement only up
//! to its rate and writes the rest off. Another class of the same action
//! served from worker leases adds its own `r·τ` (one tick).
//!
//! Tested natively in `src/pipeline/settle_tests.rs` (the pipeline over two
//! workers on one store, seeded random schedules of estimates, real costs
//! and stream ends, the bound checked over every interval) and in a real
//! Envoy (`integration-tests/tests/settle.rs`).

pub mod eventstream;
pub mod json;
pub mod rewrite;
pub mod sse;

use eventstream::Messages;
use json::{Found, Scanner};
use sse::Events;

use crate::host::Host;
use crate::policy::settle::{Field, Settle, Source, WEIGHT_SCALE};
use crate::policy::spec::{Charge, OnMissing, OverReservation};

/// Why a stream's response gave no usable figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unusable {
    /// The stream ended before the figure (reset, client gone, no response).
    Reset,
    /// The response ended without it.
    Missing,
    /// It was there but not a non-negative integer, or the body was not
    /// well-formed JSON.
    Malformed,
    /// The body was longer than `max_body_bytes` before it ended.
    TooLarge,
    /// The upstream answered 500–599 (its body is not read).
    Upstream5xx,
    /// The upstream answered 400–499 (its body is not read).
    Upstream4xx,
    /// Envoy answered 400–599 itself (`response.code_details` is not
    /// `via_upstream`): no healthy upstream, a timeout, ...
    LocalReply,
    /// The stream ended before any response header.
    NoResponse,
    /// The body is compressed (`content-encoding` other than `identity`)
    /// although the request asked for `identity`: not read.
    Encoded,
}

impl Unusable {
    pub const ALL: [Unusable; 9] = [
        Unusable::Reset,
        Unusable::Missing,
        Unusable::Malformed,
        Unusable::TooLarge,
        Unusable::Upstream5xx,
        Unusable::Upstream4xx,
        Unusable::LocalReply,
        Unusable::NoResponse,
        Unusable::Encoded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Unusable::Reset => "reset",
            Unusable::Missing => "missing",
            Unusable::Malformed => "malformed",
            Unusable::TooLarge => "too_large",
            Unusable::Upstream5xx => "upstream_5xx",
            Unusable::Upstream4xx => "upstream_4xx",
            Unusable::LocalReply => "local_reply",
            Unusable::NoResponse => "no_response",
            Unusable::Encoded => "encoded",
        }
    }
}

/// The response's body is compressed: a `content-encoding` other than
/// `identity` (the request asked for `identity`: see "Compression").
fn encoded<H: Host>(host: &H) -> bool {
    host.response_header("content-encoding").is_some_and(|v| {
        v.split(|b| *b == b',')
            .map(<[u8]>::trim_ascii)
            .any(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"identity"))
    })
}

/// A UTF-8 byte order mark: read before a body's first byte, and skipped.
const BOM: [u8; 3] = [0xEF, 0xBB, 0xBF];

/// The outcome of a response whose status is 400 or more, by who answered
/// (`None`: below 400, the operation's answer, read for its figure).
fn outcome_of<H: Host>(host: &H) -> Option<Unusable> {
    let status: u32 = std::str::from_utf8(&host.response_header(":status")?)
        .ok()?
        .trim()
        .parse()
        .ok()?;
    if status < 400 {
        return None;
    }
    let details = host.property(&["response", "code_details"]);
    let upstream = details.as_deref() == Some(b"via_upstream".as_slice());
    Some(match (upstream, status >= 500) {
        (false, _) => Unusable::LocalReply,
        (true, true) => Unusable::Upstream5xx,
        (true, false) => Unusable::Upstream4xx,
    })
}

/// What a response said of its request's cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Figure {
    /// The upstream's figure (weighted and summed, before the ceiling).
    Cost(u64),
    Unusable(Unusable),
    /// The filter ended the answer early (its limits refused more, see
    /// "Metered as it flows"): what had passed cost at most this.
    Ended(u64),
}

/// What the host does with a response body chunk of a metered answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Pass it.
    Pass,
    /// End the answer here: pass the chunk's first `keep` bytes, then
    /// `terminal` (the provider's terminal event; empty: none), and nothing
    /// of the answer after them; `reset`: reset the stream at once (a
    /// refused non-streamed answer), else let its response end when the
    /// upstream's does (the client has a finished answer).
    End {
        keep: usize,
        terminal: &'static [u8],
        reset: bool,
    },
}

/// What the meter is reading.
#[derive(Debug, Clone)]
enum Reading {
    /// The response's headers have not come yet.
    Headers,
    /// Waiting for the trailer.
    Trailer,
    Json(Box<Scanner>),
    Events(Box<Events>),
    /// AWS's binary event stream (Bedrock `ConverseStream`).
    Messages(Box<Messages>),
    /// Decided.
    Done(Figure),
}

/// Reads one stream's response for its real cost (see the module header):
/// as it passes, in bounded memory, never delaying it.
#[derive(Debug, Clone)]
pub struct Meter {
    reading: Reading,
    /// Body bytes read so far.
    read: u64,
    /// Bytes of a leading [`BOM`] matched so far (`BOM.len()`: decided).
    bom: usize,
}

impl Default for Meter {
    fn default() -> Meter {
        Meter {
            reading: Reading::Headers,
            read: 0,
            bom: 0,
        }
    }
}

/// A figure of a header or trailer value: a non-negative integer.
fn figure_of(raw: Option<Vec<u8>>) -> Figure {
    let Some(raw) = raw else {
        return Figure::Unusable(Unusable::Missing);
    };
    let value = std::str::from_utf8(&raw)
        .ok()
        .map(str::trim)
        .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|t| t.parse::<u64>().ok());
    match value {
        Some(v) => Figure::Cost(v),
        None => Figure::Unusable(Unusable::Malformed),
    }
}

/// The weighted sum of the fields' values, rounded up (`None` unless every
/// field that is not optional has one; an optional one absent counts 0; a
/// negative one is subtracted, the sum never below 0).
fn weighted(found: &Found, fields: &[Field]) -> Option<u64> {
    let mut sum = Sum::default();
    for (i, f) in fields.iter().enumerate() {
        match found.values.get(i).copied().flatten() {
            Some(v) => sum.add(f, v),
            None if f.optional => {}
            None => return None,
        }
    }
    Some(sum.units())
}

/// A weighted sum in thousandths of a unit: what is added and what is
/// subtracted, apart (see [`Field::negative`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Sum {
    plus: u128,
    minus: u128,
}

impl Sum {
    /// Adds (or, for a negative field, subtracts) `value` at `field`'s weight.
    pub(crate) fn add(&mut self, field: &Field, value: u64) {
        let milli = u128::from(value) * u128::from(field.weight_milli);
        if field.negative {
            self.minus = self.minus.saturating_add(milli);
        } else {
            self.plus = self.plus.saturating_add(milli);
        }
    }

    /// The sum in whole units, rounded up, at least 0.
    pub(crate) fn units(self) -> u64 {
        let milli = self.plus.saturating_sub(self.minus);
        u64::try_from(milli.div_ceil(u128::from(WEIGHT_SCALE))).unwrap_or(u64::MAX)
    }
}

/// A document's figure.
fn figure_of_fields(found: Option<Found>, fields: &[Field]) -> Figure {
    let Some(found) = found else {
        return Figure::Unusable(Unusable::Malformed);
    };
    match weighted(&found, fields) {
        Some(cost) => Figure::Cost(cost),
        None if found.malformed => Figure::Unusable(Unusable::Malformed),
        None => Figure::Unusable(Unusable::Missing),
    }
}

impl Meter {
    /// The response's headers (`end_of_stream`: it has no body).
    pub fn on_headers<H: Host>(&mut self, settle: &Settle, host: &H, end_of_stream: bool) {
        if !matches!(self.reading, Reading::Headers) {
            return;
        }
        if let Some(outcome) = outcome_of(host) {
            self.reading = Reading::Done(Figure::Unusable(outcome));
            return;
        }
        self.reading = match &settle.source {
            Source::Header(name) => Reading::Done(figure_of(host.response_header(name))),
            Source::Trailer(_) if end_of_stream => Reading::Done(Figure::Unusable(Unusable::Missing)),
            Source::Trailer(_) => Reading::Trailer,
            Source::Body(_) if end_of_stream => Reading::Done(Figure::Unusable(Unusable::Missing)),
            Source::Body(_) if encoded(host) => Reading::Done(Figure::Unusable(Unusable::Encoded)),
            Source::Body(_) => {
                let content_type = host.response_header("content-type").unwrap_or_default();
                let is = |t: &[u8]| {
                    content_type
                        .get(..t.len())
                        .is_some_and(|p| p.eq_ignore_ascii_case(t))
                };
                if is(b"text/event-stream") {
                    Reading::Events(Box::default())
                } else if is(b"application/vnd.amazon.eventstream") {
                    Reading::Messages(Box::default())
                } else {
                    Reading::Json(Box::default())
                }
            }
        };
    }

    /// A chunk of the response's body (`size` bytes, read from the host as
    /// it passes, while the body is within `max_body_bytes`), with no
    /// reservation to keep to.
    pub fn on_body<H: Host>(&mut self, settle: &Settle, host: &H, size: usize, end_of_stream: bool) {
        self.on_body_flow(settle, host, size, end_of_stream, u64::MAX, &mut |_| None);
    }

    /// A chunk of the response's body, metered as it flows (see "Metered
    /// as it flows"): `reserved` is what the request holds; when an event
    /// of a stream takes the running cost past it, `more(running)` is asked
    /// to reserve more (`Some`: what the request holds now; `None`: refused,
    /// and the answer ends right after that event). A non-streamed answer
    /// over its reservation under `over_reservation: refuse` asks too, and
    /// ends before its last chunk if refused.
    pub fn on_body_flow<H: Host>(
        &mut self,
        settle: &Settle,
        host: &H,
        size: usize,
        end_of_stream: bool,
        reserved: u64,
        more: &mut dyn FnMut(u64) -> Option<u64>,
    ) -> Flow {
        if matches!(self.reading, Reading::Trailer) && end_of_stream {
            // The body ended the response: no trailers come.
            self.reading = Reading::Done(Figure::Unusable(Unusable::Missing));
        }
        if !matches!(
            self.reading,
            Reading::Json(_) | Reading::Events(_) | Reading::Messages(_)
        ) {
            return Flow::Pass;
        }
        let size64 = u64::try_from(size).unwrap_or(u64::MAX);
        self.read = self.read.saturating_add(size64);
        if self.read > settle.max_body_bytes {
            self.reading = Reading::Done(Figure::Unusable(Unusable::TooLarge));
            return Flow::Pass;
        }
        if size > 0 {
            let chunk = host.response_body(size).unwrap_or_default();
            let (held, rest) = self.skip_bom(&chunk);
            let offset = chunk.len().saturating_sub(rest.len());
            // The held bytes are a mark's prefix: no line ends in them.
            self.feed(settle, held, u64::MAX, &mut |_| None);
            if let Some((keep, terminal)) = self.feed(settle, rest, reserved, more) {
                return Flow::End {
                    keep: offset.saturating_add(keep),
                    terminal,
                    reset: false,
                };
            }
        }
        // The terminal-event rule (`Meter::end`): the answer is over.
        if end_of_stream || matches!(&self.reading, Reading::Events(e) if e.ended()) {
            self.end_body(settle);
            return self.over_reservation(settle, reserved, more);
        }
        Flow::Pass
    }

    /// Feeds `bytes` to the reader; `Some((n, terminal))`: a stream whose
    /// running cost passed `limit` at its `n`-th byte, at the end of an
    /// event, and `more` refused; `terminal` ends its format (see
    /// [`Flow::End`]).
    fn feed(
        &mut self,
        settle: &Settle,
        bytes: &[u8],
        mut limit: u64,
        more: &mut dyn FnMut(u64) -> Option<u64>,
    ) -> Option<(usize, &'static [u8])> {
        let fields = settle.fields();
        let mut at = 0;
        loop {
            let rest = bytes.get(at..)?;
            let (n, running, terminal) = match &mut self.reading {
                Reading::Events(e) => {
                    let n = e.feed_until(rest, fields, limit)?;
                    // Gemini's and Bedrock's streams have no terminal event.
                    let terminal = if settle.terminal_event {
                        e.style().terminal_event()
                    } else {
                        &[]
                    };
                    (n, e.running(fields), terminal)
                }
                // A top-level array (Gemini's stream) ends with its `]`.
                Reading::Json(s) => (s.feed_until(rest, fields, limit)?, s.running(fields), &b"]"[..]),
                // An AWS event stream ends between messages.
                Reading::Messages(m) => (m.feed_until(rest, fields, limit)?, m.running(fields), &b""[..]),
                _ => return None,
            };
            at = at.saturating_add(n);
            match more(running) {
                Some(now) => limit = now,
                None => {
                    self.reading = Reading::Done(Figure::Ended(running));
                    return Some((at, terminal));
                }
            }
        }
    }

    /// A non-streamed answer's figure, decided, over its reservation:
    /// charged (`over_reservation: charge`), or reserved and, if refused,
    /// its last chunk withheld.
    fn over_reservation(
        &mut self,
        settle: &Settle,
        reserved: u64,
        more: &mut dyn FnMut(u64) -> Option<u64>,
    ) -> Flow {
        let Reading::Done(Figure::Cost(c)) = self.reading else {
            return Flow::Pass;
        };
        let cost = c.min(settle.ceiling);
        if settle.over_reservation == OverReservation::Charge || cost <= reserved {
            return Flow::Pass;
        }
        if more(cost).is_some() {
            return Flow::Pass;
        }
        self.reading = Reading::Done(Figure::Ended(reserved));
        Flow::End {
            keep: 0,
            terminal: &[],
            reset: true,
        }
    }

    /// A body's first bytes without a leading UTF-8 byte order mark (it
    /// may come a byte at a time): the bytes of a mark's prefix that turned
    /// out not to be one (to read first), and the rest of `chunk`.
    fn skip_bom<'a>(&mut self, chunk: &'a [u8]) -> (&'static [u8], &'a [u8]) {
        let mut rest = chunk;
        while self.bom < BOM.len() {
            let Some((first, tail)) = rest.split_first() else {
                return (&[], rest);
            };
            if BOM.get(self.bom) == Some(first) {
                self.bom += 1;
                rest = tail;
            } else {
                let held = BOM.get(..self.bom).unwrap_or_default();
                self.bom = BOM.len();
                return (held, rest);
            }
        }
        (&[], rest)
    }

    /// The response's trailers: its body has ended.
    pub fn on_trailers<H: Host>(&mut self, settle: &Settle, host: &H) {
        match (&self.reading, &settle.source) {
            (Reading::Trailer, Source::Trailer(name)) => {
                self.reading = Reading::Done(figure_of(host.response_trailer(name)));
            }
            (Reading::Json(_) | Reading::Events(_) | Reading::Messages(_), _) => self.end_body(settle),
            _ => {}
        }
    }

    fn end_body(&mut self, settle: &Settle) {
        let fields = settle.fields();
        let figure = match &mut self.reading {
            Reading::Json(s) => figure_of_fields(s.finish(fields), fields),
            Reading::Events(e) => figure_of_fields(Some(e.finish(fields)), fields),
            Reading::Messages(m) => figure_of_fields(m.finish(), fields),
            _ => return,
        };
        self.reading = Reading::Done(figure);
    }

    /// The figure, once the response has said all it will.
    pub fn figure(&self) -> Option<Figure> {
        match self.reading {
            Reading::Done(f) => Some(f),
            _ => None,
        }
    }

    /// The stream ended: the figure, or [`Unusable::Reset`] if the
    /// response never completed.
    ///
    /// **The abort rule**, for every format read here: a response cut
    /// before its end (client abort, upstream reset, timeout, idle cut)
    /// gives no figure, whatever its events said so far, because no format
    /// makes a partial figure an upper bound of the whole answer's:
    /// Anthropic's `message_start` usage is the first output token and its
    /// `message_delta` usage is cumulative; Gemini's `usageMetadata` and
    /// OpenAI-compatible servers' continuous usage stats are running
    /// totals; OpenAI's `include_usage` chunk comes last, but the same
    /// fields in a server's earlier chunk would be partial. So the events
    /// of a stream cut short are never summed: it costs the ceiling
    /// ([`real_cost`]).
    ///
    /// **The terminal-event rule**: an event stream's end is its terminal
    /// event when it has one ([`sse`]: OpenAI's `data: [DONE]`, Anthropic's
    /// `message_stop`, the Responses API's `response.completed`), not only
    /// the response's last byte: the upstream says there the answer is
    /// over, so the fields' last values are final ([`Meter::on_body`]
    /// decides the figure there). A client that closes right after it is
    /// charged its usage, not the ceiling. Gemini has no terminal event
    /// (its last chunk carries `finishReason`, but with several candidates
    /// each finishes in its own chunk, and nothing says no chunk follows):
    /// a Gemini stream ends with its response.
    pub fn end(&mut self) -> Figure {
        match self.reading {
            Reading::Done(f) => f,
            Reading::Headers => Figure::Unusable(Unusable::NoResponse),
            _ => Figure::Unusable(Unusable::Reset),
        }
    }
}

/// A stream's real cost, by the policy's rule: the figure cut to the
/// ceiling, else `on_missing`. `cut`: the figure was above the ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Real {
    pub cost: u64,
    pub cut: bool,
    pub unusable: Option<Unusable>,
}

/// The real cost of a stream whose estimate was `estimate`.
pub fn real_cost(settle: &Settle, figure: Figure, estimate: u64) -> Real {
    match figure {
        Figure::Ended(c) => Real {
            cost: c.min(settle.ceiling),
            cut: c > settle.ceiling,
            unusable: None,
        },
        Figure::Cost(c) => Real {
            cost: c.min(settle.ceiling),
            cut: c > settle.ceiling,
            unusable: None,
        },
        Figure::Unusable(why) => Real {
            cost: match why {
                // The abort rule (`Meter::end`): whatever `on_missing` says.
                Unusable::Reset => settle.ceiling,
                Unusable::Missing | Unusable::Malformed | Unusable::TooLarge | Unusable::Encoded => {
                    match settle.on_missing {
                        OnMissing::Ceiling => settle.ceiling,
                        OnMissing::Estimate => estimate,
                    }
                }
                Unusable::Upstream5xx => charge(settle, settle.outcomes.upstream_5xx, estimate),
                Unusable::Upstream4xx => charge(settle, settle.outcomes.upstream_4xx, estimate),
                Unusable::LocalReply => charge(settle, settle.outcomes.local_reply, estimate),
                Unusable::NoResponse => charge(settle, settle.outcomes.no_response, estimate),
            },
            cut: false,
            unusable: Some(why),
        },
    }
}

/// An outcome's charge (`settle.on_outcome`).
fn charge(settle: &Settle, charge: Charge, estimate: u64) -> u64 {
    match charge {
        Charge::Nothing => 0,
        Charge::Estimate => estimate,
        Charge::Ceiling => settle.ceiling,
    }
}

/// A request's estimate from a request header's or body field's raw value:
/// its integer cut to `[1, max]`; `None` (use `cost`) if it is not one.
pub fn estimate_of(raw: &[u8], max: u64) -> Option<u64> {
    let text = std::str::from_utf8(raw).ok()?.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Digits only: an overflow is just a very large estimate.
    let v = text.parse::<u64>().unwrap_or(u64::MAX);
    Some(v.clamp(1, max.max(1)))
}

#[cfg(test)]
mod tests;
