//! One request on its way through the stages: what it asked ([`Request`],
//! read once, kept if it is held) and what it took ([`Stream`]: its slots,
//! signal, capture, settling, headers), in one context ([`Req`]) that every
//! stage and [`super::conclude`] take instead of long argument lists; the
//! step a stage returns ([`Step`]) and the outcome a request's stages end
//! with ([`Outcome`]).

use std::rc::Rc;

use super::stream::Stream;
use super::StreamId;
use crate::decision::{Decision, LimitName};
use crate::engine::Prepared;
use crate::host::Host;
use crate::policy::admission::Dependency;
use crate::policy::Policy;
use crate::response::LocalReply;

/// What a request is: read on its headers, and all that answering or
/// resuming it needs once it is held (its answer is sent from the tick, on
/// its own stream).
#[derive(Debug, Clone)]
pub struct Request {
    pub stream: StreamId,
    pub policy: Rc<Policy>,
    pub prepared: Prepared,
    /// A primary request of a retry-budgeted dependency: counted when admitted.
    pub primary: bool,
    /// Its `x-request-id`, echoed in a refusal (validated when answered):
    /// read when it is held (a held request is answered from the tick,
    /// where its headers cannot be read); a request answered on its
    /// headers reads it then.
    pub request_id: Option<Vec<u8>>,
    /// A degradable class's GET or HEAD: its method and path, to answer
    /// it from the cache if it is refused.
    pub read: Option<Read>,
}

/// A degradable request's method and path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub method: Vec<u8>,
    pub path: Vec<u8>,
}

impl Request {
    /// A request of `prepared`'s class on its headers.
    pub(super) fn read<H: Host>(
        host: &H,
        policy: &Rc<Policy>,
        prepared: Prepared,
        stream: StreamId,
    ) -> Request {
        Request {
            stream,
            policy: policy.clone(),
            read: read_of(host, &prepared),
            prepared,
            primary: false,
            request_id: None,
        }
    }

    /// Its class's dependency, if it has one.
    pub(super) fn dependency(&self) -> Option<&Dependency> {
        self.prepared
            .class
            .labels
            .dependency
            .and_then(|i| self.policy.dependency(i))
    }
}

/// A degradable class's request method and path (`None` for other classes:
/// nothing is read).
fn read_of<H: Host>(host: &H, prepared: &Prepared) -> Option<Read> {
    prepared.class.degradable.as_ref()?;
    Some(Read {
        method: host.request_header(":method").unwrap_or_default(),
        path: host.request_header(":path").unwrap_or_default(),
    })
}

/// A request in the stages: the context every stage and the conclusion take.
#[derive(Debug)]
pub(super) struct Req {
    pub ask: Request,
    /// What it took and keeps for its later callbacks; given back by the
    /// conclusion if it is refused.
    pub took: Stream,
    /// Its decision record (a class with admission labels, a request over
    /// a soft limit), written by the stage that decides it.
    pub record: Option<String>,
    /// On its own headers callback: its request headers can be read from
    /// the host (a held request's cannot).
    pub on_headers: bool,
    /// How long it waited in the hold (0 on its headers), for its record.
    pub waited_ns: u64,
}

impl Req {
    /// A request on its headers, nothing taken yet.
    pub fn on_headers(ask: Request) -> Req {
        Req {
            ask,
            took: Stream::default(),
            record: None,
            on_headers: true,
            waited_ns: 0,
        }
    }

    /// A held request taken out of the hold at `now`, with what it kept
    /// while it was held (`took`); `enqueued`: when it was held.
    pub fn resumed(ask: Request, mut took: Stream, enqueued: u64, now: u64) -> Req {
        took.held = false;
        Req {
            ask,
            took,
            record: None,
            on_headers: false,
            waited_ns: now.saturating_sub(enqueued),
        }
    }

    /// Its `x-request-id` as read now (on its headers) or when it was held.
    pub fn request_id<H: Host>(&self, host: &H) -> Option<Vec<u8>> {
        if self.on_headers {
            host.request_header("x-request-id")
        } else {
            self.ask.request_id.clone()
        }
    }
}

/// What a stage says of its request.
pub(super) enum Step {
    /// On to the next stage.
    Next,
    /// On to the rate limits, past the admission stages left (a refusal
    /// in shadow mode: counted and recorded, never enforced, no slot taken).
    Limits,
    /// Held (the stage put it in the hold): answered from the tick.
    Hold,
    /// Decided: the conclusion answers it (boxed: only a refusal comes here).
    Done(Box<Outcome>),
}

/// How a request's stages ended.
pub(super) enum Outcome {
    /// A decision: admitted (on its way), or denied (its refusal).
    Decided(Decision),
    /// Refused (this decision, counted like any refusal) and answered 200
    /// from its class's degraded-answer cache.
    Degraded(LocalReply, Decision),
}

/// Where a request was decided, for its record.
#[derive(Debug, Clone, Default)]
pub(super) struct Decided {
    pub in_flight: u32,
    pub queue_wait_ns: u64,
    pub limit: Option<LimitName>,
}
