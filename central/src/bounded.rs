//! Bounded memory on every listener of `tenantgate serve` (sync and
//! reservation API, gRPC for the RLS and the RLQS, admin): the one serve
//! loop they all run, and its caps, each default stated once here
//! ([`ListenerLimits::default`]) and in docs/central-service.md.
//!
//! # The caps
//! * **Connections per listener** ([`ListenerLimits::max_connections`]):
//!   past it, a new connection waits in the kernel's backlog until one
//!   closes. An HTTP/1 connection that sends no request head within
//!   [`HEADER_READ_TIMEOUT`] is closed; an idle HTTP/2 connection is kept
//!   (Envoy keeps its pool's), so clients that may connect (loopback, or a
//!   certificate of the client CA) can hold the cap.
//! * **Streams per connection** ([`ListenerLimits::max_streams_per_connection`],
//!   HTTP/2's `SETTINGS_MAX_CONCURRENT_STREAMS`): a client opens more only
//!   as earlier ones end (Envoy opens another connection).
//! * **Bytes buffered per connection by HTTP/2** (its flow-control windows,
//!   [`ListenerLimits::h2_window_bytes`] per stream and per connection,
//!   adaptive windows off) and **header bytes**
//!   ([`ListenerLimits::max_header_bytes`], HTTP/1's read buffer and
//!   HTTP/2's header list).
//! * **Message size**: a gRPC message over
//!   [`ListenerLimits::max_grpc_message_bytes`] is refused unread
//!   (`OUT_OF_RANGE`, tonic's check); an HTTP body over `--max-body-bytes`
//!   `413` (the API's own check).
//! * **Bytes in flight in total** ([`ListenerLimits::max_bytes_in_flight`]):
//!   every request body byte read off any listener holds a unit of one
//!   budget, shared by all of them, until the request is answered. A body
//!   whose next part does not fit fails at once (the request is answered
//!   with an error: gRPC `RESOURCE_EXHAUSTED`, HTTP `400`) instead of
//!   waiting, so requests that each hold part of the budget never wait for
//!   one another, and memory never grows past it. A gRPC body holds the
//!   declared length of the message being read (what tonic's decoder
//!   reserves when the 5-byte prefix arrives), one message at a time, so a
//!   long RLQS stream holds only its current report; any other body holds
//!   every byte read until its answer.
//!
//! # THE BOUND
//! Request bytes held by the service are at most `max_bytes_in_flight`
//! (read or reserved, counted) plus, per connection, what HTTP/2's windows let a peer
//! send before it is read (`h2_window_bytes`) or HTTP/1's buffer
//! (`max_header_bytes`), over at most `max_connections` per listener.
//! Each request body read is held at most twice while it is decoded (the
//! read buffer and the decoded message). docs/central-service.md gives the
//! figure measured under 1,000 concurrent maximum-size messages
//! (`cli/tests/bounded_memory.rs`).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::extract::ConnectInfo;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::debug;

use crate::listener::{Peer, SyncListener};

/// The caps every listener of `tenantgate serve` runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    /// Open connections per listener.
    pub max_connections: usize,
    /// Concurrent HTTP/2 streams per connection.
    pub max_streams_per_connection: u32,
    /// HTTP/2 flow-control window, per stream and per connection.
    pub h2_window_bytes: u32,
    /// HTTP/1 read buffer and HTTP/2 header list, per connection.
    pub max_header_bytes: u32,
    /// Largest gRPC message (RLS, RLQS) decoded.
    pub max_grpc_message_bytes: usize,
    /// Request body bytes held at once, over every listener.
    pub max_bytes_in_flight: usize,
}

/// An HTTP/1 connection that sends no whole request head within this long
/// is closed, so idle connections do not keep [`DEFAULT_MAX_CONNECTIONS`]
/// taken (hyper's default, which needs a timer to apply).
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Open connections per listener (Envoy's RLS cluster opens about one per
/// worker per Envoy).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Concurrent streams per HTTP/2 connection.
pub const DEFAULT_MAX_STREAMS_PER_CONNECTION: u32 = 1024;
/// HTTP/2's own default window (65,535 bytes), not enlarged.
pub const DEFAULT_H2_WINDOW_BYTES: u32 = 65_535;
/// HTTP/1 read buffer and HTTP/2 header list: 64 KiB (Envoy's default
/// header limit is 60 KiB).
pub const DEFAULT_MAX_HEADER_BYTES: u32 = 64 * 1024;
/// A gRPC message: 4 MiB (tonic's default, and gRPC's).
pub const DEFAULT_MAX_GRPC_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// Request body bytes in flight over every listener: 64 MiB (16 gRPC
/// messages of the largest size, 32 sync bodies of `--max-body-bytes`'
/// default; thousands of ordinary ones).
pub const DEFAULT_MAX_BYTES_IN_FLIGHT: usize = 64 * 1024 * 1024;

impl Default for ListenerLimits {
    fn default() -> ListenerLimits {
        ListenerLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_streams_per_connection: DEFAULT_MAX_STREAMS_PER_CONNECTION,
            h2_window_bytes: DEFAULT_H2_WINDOW_BYTES,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_grpc_message_bytes: DEFAULT_MAX_GRPC_MESSAGE_BYTES,
            max_bytes_in_flight: DEFAULT_MAX_BYTES_IN_FLIGHT,
        }
    }
}

/// The budget of request bytes in flight, shared by every listener.
#[derive(Debug, Clone)]
pub struct Budget {
    bytes: Arc<Semaphore>,
}

impl Budget {
    pub fn new(max_bytes: usize) -> Budget {
        Budget {
            bytes: Arc::new(Semaphore::new(max_bytes.min(Semaphore::MAX_PERMITS))),
        }
    }

    /// Bytes free now.
    pub fn available(&self) -> usize {
        self.bytes.available_permits()
    }
}

/// What one request holds of the budget, until its answer and its body
/// are both gone.
type Held = Arc<Mutex<Option<OwnedSemaphorePermit>>>;

/// A request body that takes its bytes from the [`Budget`] before they are
/// read: a gRPC body each message's declared length when its 5-byte
/// prefix goes by (what tonic's decoder reserves at once), giving the
/// previous message's back (a stream holds one message at a time); any
/// other body each frame's bytes, held until the answer.
pub struct Budgeted<B> {
    inner: B,
    budget: Arc<Semaphore>,
    held: Held,
    /// `Some` for a gRPC body: where its message prefixes are.
    grpc: Option<GrpcScan>,
}

/// Where a gRPC body is in its length-prefixed messages.
#[derive(Debug, Default)]
struct GrpcScan {
    /// The prefix's bytes seen so far (of 5).
    prefix: [u8; 5],
    prefix_len: usize,
    /// Bytes of the current message still to go by.
    remaining: u64,
    /// The largest message the decoder reads (a larger one is refused
    /// unread, so it reserves nothing).
    max_message: u64,
}

impl GrpcScan {
    /// The declared lengths of the messages whose prefix ends in `data`.
    fn scan(&mut self, data: &[u8], starts: &mut Vec<u64>) {
        let mut at = 0usize;
        while at < data.len() {
            if self.remaining > 0 {
                let left = (data.len() - at) as u64;
                let skip = self.remaining.min(left);
                self.remaining -= skip;
                at += skip as usize;
                continue;
            }
            if let (Some(slot), Some(byte)) = (self.prefix.get_mut(self.prefix_len), data.get(at)) {
                *slot = *byte;
            }
            self.prefix_len += 1;
            at += 1;
            if self.prefix_len == 5 {
                self.prefix_len = 0;
                let [_, a, b, c, d] = self.prefix;
                let len = u64::from(u32::from_be_bytes([a, b, c, d]));
                self.remaining = len;
                starts.push(if len > self.max_message { 0 } else { len + 5 });
            }
        }
    }
}

/// The budget is spent: the body ends with this error.
#[derive(Debug, thiserror::Error)]
#[error("the service holds its most request bytes at once ({0} free): try again")]
pub struct OverBudget(usize);

impl<B> Budgeted<B> {
    /// Takes `n` bytes from the budget into what this request holds
    /// (`replace`: instead of what it held).
    fn take(&self, n: u64, replace: bool) -> Result<(), OverBudget> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if replace {
            *held = None;
        }
        if n == 0 {
            return Ok(());
        }
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        match self.budget.clone().try_acquire_many_owned(n) {
            Ok(permit) => {
                match held.as_mut() {
                    Some(p) => p.merge(permit),
                    None => *held = Some(permit),
                }
                Ok(())
            }
            Err(_) => {
                let free = self.budget.available_permits();
                debug!(bytes = n, free, "request body over the bytes-in-flight budget");
                Err(OverBudget(free))
            }
        }
    }
}

impl<B> Body for Budgeted<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        if let Some(data) = frame.data_ref() {
            let taken = match self.grpc.as_mut() {
                Some(scan) => {
                    let mut starts = Vec::new();
                    scan.scan(data, &mut starts);
                    starts.into_iter().try_for_each(|n| self.take(n, true))
                }
                None => self.take(data.len() as u64, false),
            };
            if let Err(e) = taken {
                // tonic answers with a `Status` it finds in a body's error.
                let error: Self::Error = if self.grpc.is_some() {
                    Box::new(tonic::Status::resource_exhausted(e.to_string()))
                } else {
                    Box::new(e)
                };
                return Poll::Ready(Some(Err(error)));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Serves `router` on `listener` under `limits` and `budget` until `stop`
/// resolves; then stops accepting, lets every connection finish what it
/// has begun, and returns.
pub async fn serve(
    mut listener: SyncListener,
    router: axum::Router,
    limits: ListenerLimits,
    budget: Budget,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::Listener as _;
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(
            usize::try_from(limits.max_header_bytes)
                .unwrap_or(usize::MAX)
                .max(8192),
        );
    builder
        .http2()
        .max_concurrent_streams(limits.max_streams_per_connection)
        .initial_stream_window_size(limits.h2_window_bytes)
        .initial_connection_window_size(limits.h2_window_bytes)
        .adaptive_window(false)
        .max_header_list_size(limits.max_header_bytes);
    let connections = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    tokio::pin!(stop);
    loop {
        let slot = tokio::select! {
            () = &mut stop => break,
            slot = connections.clone().acquire_owned() => slot,
        };
        let Ok(slot) = slot else { break };
        let (io, peer) = tokio::select! {
            () = &mut stop => break,
            conn = listener.accept() => conn,
        };
        while tasks.try_join_next().is_some() {}
        let builder = builder.clone();
        let router = router.clone();
        let budget = budget.bytes.clone();
        let max_message = limits.max_grpc_message_bytes as u64;
        let mut stop = stop_rx.clone();
        tasks.spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                handle(router.clone(), budget.clone(), max_message, peer.clone(), req)
            });
            let conn = builder.serve_connection(TokioIo::new(io), service);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        debug!(error = %e, "connection ended with an error");
                    }
                }
                () = async { let _ = stop.wait_for(|s| *s).await; } => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// One request: its body on the budget, its peer in its extensions (as
/// axum's `into_make_service_with_connect_info` puts it), the budget held
/// until the answer is ready.
async fn handle(
    router: axum::Router,
    budget: Arc<Semaphore>,
    max_message: u64,
    peer: Peer,
    req: http::Request<hyper::body::Incoming>,
) -> Result<axum::response::Response, std::convert::Infallible> {
    use tower_service::Service as _;
    let held: Held = Arc::new(Mutex::new(None));
    let (mut parts, body) = req.into_parts();
    parts.extensions.insert(ConnectInfo(peer));
    let grpc = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
        .then(|| GrpcScan {
            max_message,
            ..GrpcScan::default()
        });
    let body = axum::body::Body::new(Budgeted {
        inner: body,
        budget,
        held: held.clone(),
        grpc,
    });
    let mut router = router;
    let response = router.call(http::Request::from_parts(parts, body)).await;
    drop(held);
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_body_holds_its_bytes_until_dropped_and_fails_past_the_budget() {
        let budget = Budget::new(10);
        let held: Held = Arc::new(Mutex::new(None));
        let body = Budgeted {
            inner: http_body_util::Full::new(Bytes::from_static(b"123456")),
            budget: budget.bytes.clone(),
            held: held.clone(),
            grpc: None,
        };
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(bytes.len(), 6);
        assert_eq!(budget.available(), 4, "held until the request is answered");
        let over = Budgeted {
            inner: http_body_util::Full::new(Bytes::from_static(b"12345")),
            budget: budget.bytes.clone(),
            held: Arc::new(Mutex::new(None)),
            grpc: None,
        };
        assert!(over.collect().await.is_err(), "5 bytes do not fit in 4");
        drop(held);
        assert_eq!(budget.available(), 10, "given back");
    }

    /// gRPC messages of 3 and 4 bytes, the second's prefix split.
    fn grpc_body() -> Vec<u8> {
        let mut b = vec![0, 0, 0, 0, 3, 1, 2, 3];
        b.extend_from_slice(&[0, 0, 0, 0, 4, 9, 9, 9, 9]);
        b
    }

    #[test]
    fn a_grpc_scan_finds_each_prefix_however_the_body_is_cut() {
        let body = grpc_body();
        for cut in 0..=body.len() {
            let mut scan = GrpcScan {
                max_message: 100,
                ..GrpcScan::default()
            };
            let mut starts = Vec::new();
            scan.scan(&body[..cut], &mut starts);
            scan.scan(&body[cut..], &mut starts);
            assert_eq!(starts, [8, 9], "cut at {cut}");
        }
        let mut scan = GrpcScan {
            max_message: 3,
            ..GrpcScan::default()
        };
        let mut starts = Vec::new();
        scan.scan(&body, &mut starts);
        assert_eq!(
            starts,
            [8, 0],
            "a message over the cap is refused unread: nothing held"
        );
    }

    #[tokio::test]
    async fn a_grpc_stream_holds_one_message_at_a_time() {
        let budget = Budget::new(10);
        let held: Held = Arc::new(Mutex::new(None));
        let body = Budgeted {
            inner: http_body_util::Full::new(Bytes::from(grpc_body())),
            budget: budget.bytes.clone(),
            held: held.clone(),
            grpc: Some(GrpcScan {
                max_message: 100,
                ..GrpcScan::default()
            }),
        };
        body.collect().await.unwrap();
        assert_eq!(
            budget.available(),
            1,
            "the second message's 9 bytes, the first's given back"
        );
        drop(held);
        assert_eq!(budget.available(), 10);
    }
}
