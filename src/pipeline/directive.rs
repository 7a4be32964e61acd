//! What the pipeline asks of its host, in the host's terms: a
//! [`Directive`] for a stream (a [`Verdict`], the decision record, a route
//! marker, the request's encoding and body), an [`Answer`] for a stream
//! paused earlier, and the names of what a host writes for it (the filter
//! state of the record, the request header of a metered request, the
//! response headers of [`ResponseHeaders::added`]).
//!
//! A host builds a directive only through the constructors here
//! ([`Directive::go`], [`Directive::pause`], [`Directive::reply`],
//! [`Directive::of`]) and never writes a header name or a status of its
//! own: it carries out what the directive says.

use super::{ResponseHeaders, StreamId};
use crate::response::{self, LocalReply};

/// What the host does with a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// On its way (for a paused stream: resume it).
    Continue,
    /// Paused: the pipeline answers it later, through [`super::Pipeline::take_answers`].
    Pause,
    /// Answered here: the host sends this reply and the stream goes no further.
    Reply(LocalReply),
    /// On a request body chunk: the host keeps it, after the chunks it
    /// kept before, and delivers the next (see [`BodyEdit`]).
    Buffer,
}

/// A request body chunk as the host delivers it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Chunk {
    /// Where it starts in what [`crate::host::Host::request_body`] reads on this
    /// callback (after the chunks the host kept for a [`Verdict::Buffer`]).
    pub offset: usize,
    pub len: usize,
    /// The body's last chunk.
    pub end_of_stream: bool,
}

impl From<usize> for Chunk {
    /// A chunk of `len` bytes, not the last, read from its start.
    fn from(len: usize) -> Chunk {
        Chunk {
            offset: 0,
            len,
            end_of_stream: false,
        }
    }
}

/// What becomes of the request's body on its way upstream (a class with
/// `settle.include_usage`: [`crate::cost::rewrite`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum BodyEdit {
    #[default]
    None,
    /// On the request headers: remove `content-length`, as the body may
    /// change length (the upstream gets it chunked, or framed by HTTP/2);
    /// its chunks are then kept ([`Verdict::Buffer`]) until it ends.
    Unsized,
    /// On the body's last chunk: the whole body (the chunks kept and this
    /// one) is replaced by this.
    Replace(Vec<u8>),
}

/// The pipeline's answer for one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Directive {
    pub verdict: Verdict,
    /// The decision record for the access log (filter state
    /// [`RECORD_PROPERTY`]), for a class with admission labels or a
    /// request over a soft limit.
    pub record: Option<String>,
    /// A request header to set or remove before the request goes on, after
    /// which the host has the route picked again (a soft limit's marker).
    pub mark: Option<RouteMark>,
    /// Set the request's `accept-encoding` to `identity` before it goes on:
    /// a metered request of a class with `settle` asks its upstream for an
    /// uncompressed answer, whose usage the meter reads (see
    /// [`crate::cost`], "Compression"). No route is picked again.
    pub identity_encoding: bool,
    pub body: BodyEdit,
}

/// The request header a metered request's upstream is asked not to
/// compress by, and its value.
pub const ACCEPT_ENCODING: &str = "accept-encoding";
/// The request header a host removes for [`BodyEdit::Unsized`].
pub const CONTENT_LENGTH: &str = "content-length";
pub const IDENTITY: &str = "identity";

/// A change to the request's headers that route configuration matches:
/// the host makes it, then clears the route cache so that the route is
/// picked again with it (see [`crate::pipeline`]'s soft limits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteMark {
    /// The header (the policy's `soft_limit_header`).
    pub header: String,
    /// `Some`: set it to this value (replacing any); `None`: remove it
    /// (a client's own copy).
    pub value: Option<String>,
}

impl Directive {
    /// On its way, nothing else to do.
    pub fn go() -> Directive {
        Directive::of(Verdict::Continue, None)
    }

    /// Paused: answered later (through [`super::Pipeline::take_answers`]).
    pub fn pause(record: Option<String>) -> Directive {
        Directive::of(Verdict::Pause, record)
    }

    /// Answered here with `reply`.
    pub fn reply(reply: LocalReply, record: Option<String>) -> Directive {
        Directive::of(Verdict::Reply(reply), record)
    }

    /// `verdict`, with the decision record `record`; no marker, the
    /// request's encoding and body as they are.
    pub fn of(verdict: Verdict, record: Option<String>) -> Directive {
        Directive {
            verdict,
            record,
            mark: None,
            identity_encoding: false,
            body: BodyEdit::None,
        }
    }
}

impl ResponseHeaders {
    /// The response headers to add, name and value, in order: the
    /// decision's `RateLimit-Policy` and `RateLimit` headers, then a soft
    /// limit's marker.
    pub fn added(&self) -> impl Iterator<Item = (&str, &str)> {
        let ratelimit = self.ratelimit.iter().flat_map(|h| {
            [
                (response::RATELIMIT_POLICY_HEADER, h.policy.as_str()),
                (response::RATELIMIT_HEADER, h.ratelimit.as_str()),
            ]
        });
        let soft = self.soft.iter().map(|(n, v)| (n.as_str(), v.as_str()));
        ratelimit.chain(soft)
    }
}

/// A directive for a stream the pipeline paused earlier (or displaced from
/// a full queue): the host applies it on that stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub stream: StreamId,
    pub directive: Directive,
}

/// The filter state a decision record is kept under (`wasm.` + this in
/// Envoy's access log).
pub const RECORD_PROPERTY: &str = "tenantgate_admission";
