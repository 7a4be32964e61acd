//! Envoy's rate limit quota service (RLQS,
//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas`)
//! served by `tenantgate serve --grpc-listen`, for Envoys that run the
//! native `envoy.filters.http.rate_limit_quota` filter: a tenantgate
//! global limit enforced by Envoy's own token buckets, with no wasm and no
//! call per request.
//!
//! # Semantics
//! Each stream is one Envoy (its filter's one client). Envoy groups
//! requests into buckets (`BucketId`, a map) and reports each bucket's
//! usage: once when a bucket is first hit, then every reporting interval.
//! * **Bucket → key.** The stream's `domain` and the bucket id's entries,
//!   read as one descriptor in the rule tree's order
//!   (`Descriptors::find_unordered`), are matched to the policy's
//!   `descriptors:` rules exactly as the RLS matches a descriptor: the same
//!   rule gives the same key (rule path × entries), so one policy serves
//!   RLS and RLQS and both count a key in one place. A bucket that matches
//!   no rule, an `unlimited` rule, or `mode: off` is sent `ALLOW_ALL`;
//!   `mode: shadow`, or a plan with only shadow or soft limits, is counted
//!   and sent `ALLOW_ALL`.
//! * **The limit a key's token buckets carry** is its plan's enforced
//!   limit of shortest window (then lowest rate), as a token bucket: `rate`
//!   per `per`, capacity `burst` (a window's capacity is its rate). Envoy's
//!   filter has one token bucket per bucket, so the plan's other enforced
//!   limits (a daily quota beside a per-minute rate) are enforced through
//!   the count: when folding usage leaves one of them refusing the next
//!   request, every holder of the key is sent `DENY_ALL` until it has room
//!   again, then its token bucket.
//! * **Allocation.** Every (stream, bucket) on a limited key holds a share
//!   of it: an even split among the holders on open streams, in the order
//!   they joined (`share::split`), of what is left after the holders on
//!   closed streams (see below). Each report is answered, per bucket, with
//!   `QuotaAssignmentAction { assignment_time_to_live: TTL, token_bucket
//!   { max_tokens, tokens_per_fill, fill_interval } }`; when a key's set
//!   of holders changes, every holder whose share changed is sent its new
//!   one at once on its stream.
//! * **Usage.** `num_requests_allowed` is charged to the key's records in
//!   the store (`--store`, as the RLS charges a request: the same
//!   records), as far as every limit of the plan has room; what does not
//!   fit is counted (`tenantgate_rlqs_usage_over_total`). Denials are
//!   counted. A report is answered first, then folded.
//! * **Release.** A bucket reported idle (no request) for
//!   [`Settings::idle_reports`] reports in a row is abandoned
//!   (`AbandonAction`: Envoy forgets it and re-subscribes on its next
//!   request) and its share released at once. A closed stream's shares
//!   stay reserved until its last assignment has expired on Envoy's side
//!   (sent + TTL + [`Settings::margin`]), then are split among the others.
//!
//! # THE BOUND
//! Envoy 1.40 reads `fill_interval` and `assignment_time_to_live` in whole
//! seconds (we send whole seconds, at least 1), starts a replaced token
//! bucket full, keeps an unchanged one, and reports every reporting
//! interval (`reporting_interval`, at least as often as TTL / 2 for the
//! assignments to stay alive). For a key of `rate` per `per` with capacity
//! `B`, over any interval of length `d` in which the service assigned `A`
//! sets of shares (the first holder's subscription is one; each join,
//! leave or expiry of a holder another), Envoy admits at most
//!
//! ```text
//!   A × max(B, S) + rate × d / per + overlap
//! ```
//!
//! where `S` is the most holders at once (Σ `max_tokens` ≤ `max(B, S)`:
//! every share holds at least one token), and the shares' fill rates add
//! up to at most `rate / per` (rounded down, intervals rounded up), also
//! while a closed stream's share drains. `overlap` is what a holder whose
//! share shrank admits at its old rate until the new assignment reaches
//! it (one push, a round trip: `< 1` request at the rates Envoy's
//! whole-second intervals express), plus what the filter's
//! `no_assignment_behavior` admits before the first assignment arrives
//! (`DENY_ALL`: 0; `ALLOW_ALL`: every request in that round trip). When
//! the service is unreachable an assignment lives its TTL, then the
//! filter's `expired_assignment_behavior` applies, then
//! `no_assignment_behavior`: those are Envoy's, and outside this bound.
//! Each replica splits among the streams it serves: run one replica for
//! RLQS (the bound multiplies by the replicas otherwise). A plan's other
//! limits (enforced through the count) are checked when usage is folded,
//! so one of them may run past its own limit by what the holders admit
//! before their next report: at most one reporting interval at the token
//! buckets' rate, plus their burst; each `DENY_ALL` and each reopening
//! counts in `A`.
//!
//! # Limits
//! Every value from the network is bounded: a message over 4 MiB
//! (`crate::bounded`'s gRPC message cap) is refused unread; at most [`Settings::max_streams`]
//! streams (then `RESOURCE_EXHAUSTED`), at most
//! [`Settings::max_buckets_per_stream`] buckets per stream (a bucket over
//! it gets no answer, so Envoy keeps its `no_assignment_behavior`, and is
//! counted), bucket ids of 1 to `MAX_DEPTH` entries of 1 to
//! `MAX_TEXT_LEN` bytes, a domain of 1 to `MAX_TEXT_LEN` bytes that
//! stays the stream's (otherwise the stream ends with
//! `INVALID_ARGUMENT`). Counts add up saturating. A stream that does not
//! read its answers ([`CHANNEL_DEPTH`] queued) is ended. A closed stream
//! releases its shares as above.

pub mod share;
pub mod state;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use tenantgate::limiter::charge::{check_key, idle_after_ns, KeyLimit};
use tenantgate::policy::descriptors::{MAX_DEPTH, MAX_TEXT_LEN};
use tenantgate::policy::Mode;
use tokio::sync::mpsc;

use self::share::KeyRate;
use self::state::{Book, Limits, Outcome, StreamId, Target, Usage};
use super::counters::Counters;
use super::rls::{RlsLimit, RlsPolicy};
use crate::clock::Clock;

/// Answers queued on one stream before it is ended as not reading.
pub const CHANNEL_DEPTH: usize = 1024;

/// The server's bounds and timings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Assignments' time to live, whole seconds: longer than Envoy's
    /// reporting interval (5 s by default), and how long a closed stream's
    /// share stays reserved.
    pub ttl_secs: u64,
    pub max_streams: usize,
    pub max_buckets_per_stream: usize,
    /// Reports in a row with no request before a bucket is abandoned (0:
    /// never).
    pub idle_reports: u32,
    /// Added to a holder's expiry (Envoy starts its TTL on receipt).
    pub margin: Duration,
    /// How often expired holders are swept.
    pub sweep_every: Duration,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            ttl_secs: 15,
            max_streams: 1024,
            max_buckets_per_stream: 4096,
            idle_reports: 12,
            margin: Duration::from_secs(1),
            sweep_every: Duration::from_millis(500),
        }
    }
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct RlqsMetrics {
    pub streams: AtomicU64,
    pub holders: AtomicU64,
    pub reports: AtomicU64,
    pub allowed: AtomicU64,
    pub denied: AtomicU64,
    pub usage_over: AtomicU64,
    pub assignments: AtomicU64,
    pub changed: AtomicU64,
    pub abandoned: AtomicU64,
    pub refused_buckets: AtomicU64,
    pub refused_streams: AtomicU64,
    pub invalid: AtomicU64,
    pub store_errors: AtomicU64,
    pub stalled: AtomicU64,
}

impl RlqsMetrics {
    /// Prometheus text (`tenantgate_rlqs_*`).
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (name, kind, help, v) in [
            (
                "streams",
                "gauge",
                "Open RLQS streams (one per Envoy).",
                &self.streams,
            ),
            (
                "holders",
                "gauge",
                "Buckets holding a share of a limited key (closed streams' included until they expire).",
                &self.holders,
            ),
            (
                "reports_total",
                "counter",
                "RLQS usage report messages.",
                &self.reports,
            ),
            (
                "requests_allowed_total",
                "counter",
                "Requests Envoy reported admitted (num_requests_allowed).",
                &self.allowed,
            ),
            (
                "requests_denied_total",
                "counter",
                "Requests Envoy reported denied (num_requests_denied).",
                &self.denied,
            ),
            (
                "usage_over_total",
                "counter",
                "Admitted requests that did not fit the key's limits when folded into its count.",
                &self.usage_over,
            ),
            (
                "assignments_total",
                "counter",
                "Bucket actions sent.",
                &self.assignments,
            ),
            (
                "assignments_changed_total",
                "counter",
                "Assignments that changed a holder's token bucket (each a fresh burst in Envoy).",
                &self.changed,
            ),
            (
                "abandoned_total",
                "counter",
                "Buckets abandoned for being idle.",
                &self.abandoned,
            ),
            (
                "refused_buckets_total",
                "counter",
                "Bucket reports refused for the stream's bucket cap.",
                &self.refused_buckets,
            ),
            (
                "refused_streams_total",
                "counter",
                "Streams refused for the stream cap.",
                &self.refused_streams,
            ),
            (
                "invalid_total",
                "counter",
                "Streams ended for an invalid message.",
                &self.invalid,
            ),
            (
                "store_errors_total",
                "counter",
                "Usage that could not be folded into the store.",
                &self.store_errors,
            ),
            (
                "stalled_total",
                "counter",
                "Streams ended for not reading their answers.",
                &self.stalled,
            ),
        ] {
            out.push_str(&format!(
                "# HELP tenantgate_rlqs_{name} {help}\n# TYPE tenantgate_rlqs_{name} {kind}\ntenantgate_rlqs_{name} {}\n",
                v.load(Relaxed)
            ));
        }
        out
    }
}

type Reply = Result<RateLimitQuotaResponse, tonic::Status>;

/// The rate limit quota service of one replica.
pub struct Rlqs {
    counters: Arc<dyn Counters>,
    clock: Arc<dyn Clock>,
    settings: Settings,
    in_force: super::PolicyInForce,
    book: Mutex<Book>,
    senders: Mutex<HashMap<StreamId, mpsc::Sender<Reply>>>,
    next_stream: AtomicU64,
    sweeping: AtomicBool,
    pub metrics: RlqsMetrics,
}

/// A usage line resolved, with what folding it needs.
struct Resolved {
    usage: Usage,
    plan: Option<usize>,
}

impl Rlqs {
    pub fn new(counters: Arc<dyn Counters>, clock: Arc<dyn Clock>, settings: Settings) -> Rlqs {
        Rlqs {
            counters,
            clock,
            settings,
            in_force: Default::default(),
            book: Mutex::new(Book::default()),
            senders: Mutex::new(HashMap::new()),
            next_stream: AtomicU64::new(1),
            sweeping: AtomicBool::new(false),
            metrics: RlqsMetrics::default(),
        }
    }

    /// Puts a policy in force (a reload of the same rules keeps its epoch);
    /// each bucket's key and share follow it at its next report.
    pub fn set_policy(&self, policy: RlsPolicy) {
        self.in_force.set(policy, self.clock.now_ns());
    }

    fn in_force(&self) -> (Arc<RlsPolicy>, u64) {
        self.in_force.get()
    }

    fn limits(&self) -> Limits {
        Limits {
            max_buckets_per_stream: self.settings.max_buckets_per_stream,
            ttl_secs: self.settings.ttl_secs.max(1),
            margin_ns: u64::try_from(self.settings.margin.as_nanos()).unwrap_or(u64::MAX),
            idle_reports: self.settings.idle_reports,
        }
    }

    fn with_book<R>(&self, f: impl FnOnce(&mut Book) -> R) -> R {
        let mut book = match self.book.lock() {
            Ok(b) => b,
            Err(e) => e.into_inner(),
        };
        let r = f(&mut book);
        self.metrics.streams.store(book.streams() as u64, Relaxed);
        self.metrics.holders.store(book.holders() as u64, Relaxed);
        r
    }

    fn senders(&self) -> std::sync::MutexGuard<'_, HashMap<StreamId, mpsc::Sender<Reply>>> {
        match self.senders.lock() {
            Ok(s) => s,
            Err(e) => e.into_inner(),
        }
    }

    /// Registers a stream (refused beyond the stream cap).
    fn open(&self, tx: mpsc::Sender<Reply>) -> Result<StreamId, tonic::Status> {
        let mut senders = self.senders();
        if senders.len() >= self.settings.max_streams {
            self.metrics.refused_streams.fetch_add(1, Relaxed);
            return Err(tonic::Status::resource_exhausted(format!(
                "at most {} RLQS streams",
                self.settings.max_streams
            )));
        }
        let id = self.next_stream.fetch_add(1, Relaxed);
        senders.insert(id, tx);
        drop(senders);
        self.with_book(|b| b.open(id));
        Ok(id)
    }

    fn close(&self, id: StreamId) {
        self.senders().remove(&id);
        self.with_book(|b| b.close(id));
    }

    /// Sends what a change of the book produced; a stream that cannot take
    /// it is ended (its shares then drain as a closed stream's).
    fn deliver(&self, out: Outcome) {
        self.metrics.changed.fetch_add(out.changed, Relaxed);
        self.metrics.abandoned.fetch_add(out.abandoned, Relaxed);
        self.metrics.refused_buckets.fetch_add(out.refused, Relaxed);
        self.metrics.denied.fetch_add(out.denied, Relaxed);
        let mut stalled = Vec::new();
        {
            let senders = self.senders();
            for (stream, actions) in out.send {
                let n = actions.len() as u64;
                let Some(tx) = senders.get(&stream) else {
                    continue;
                };
                let reply = RateLimitQuotaResponse {
                    bucket_action: actions,
                };
                match tx.try_send(Ok(reply)) {
                    Ok(()) => {
                        self.metrics.assignments.fetch_add(n, Relaxed);
                    }
                    Err(_) => stalled.push(stream),
                }
            }
        }
        for stream in stalled {
            self.metrics.stalled.fetch_add(1, Relaxed);
            self.close(stream);
        }
    }

    /// One message of a stream.
    async fn on_reports(
        &self,
        stream: StreamId,
        domain: &mut Option<String>,
        msg: RateLimitQuotaUsageReports,
    ) -> Result<(), tonic::Status> {
        self.metrics.reports.fetch_add(1, Relaxed);
        tracing::debug!(stream, domain = %msg.domain, usages = ?msg.bucket_quota_usages, "RLQS report");
        check_message(&msg, domain.as_deref(), self.settings.max_buckets_per_stream)
            .map_err(tonic::Status::invalid_argument)?;
        if domain.is_none() {
            *domain = Some(msg.domain.clone());
        }
        let domain = domain.as_deref().unwrap_or_default();
        let (policy, effective_from) = self.in_force();
        let resolved: Vec<Resolved> = msg
            .bucket_quota_usages
            .into_iter()
            .filter_map(|u| {
                let id = u.bucket_id?;
                let (target, plan) = resolve(&policy, domain, &id);
                let mut name: Vec<(String, String)> =
                    id.bucket.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                name.sort_unstable();
                Some(Resolved {
                    usage: Usage {
                        name,
                        id,
                        target,
                        allowed: u.num_requests_allowed,
                        denied: u.num_requests_denied,
                    },
                    plan,
                })
            })
            .collect();
        let mut folds: Vec<(String, usize, u64)> = Vec::new();
        for r in &resolved {
            self.metrics.allowed.fetch_add(r.usage.allowed, Relaxed);
            if let (Some(key), Some(plan)) = (target_key(&r.usage.target), r.plan) {
                if r.usage.allowed > 0 {
                    folds.push((key.to_owned(), plan, r.usage.allowed));
                }
            }
        }
        let now = self.clock.now_ns();
        let limits = self.limits();
        let usages = resolved.into_iter().map(|r| r.usage).collect();
        let out = self.with_book(|b| b.report(stream, usages, now, limits));
        self.deliver(out);
        for (key, plan, n) in folds {
            self.fold(&policy, effective_from, key, plan, n).await;
        }
        Ok(())
    }

    /// Charges `n` admitted requests to a key's records, as far as every
    /// limit has room (see the module header).
    async fn fold(&self, policy: &RlsPolicy, effective_from: u64, key: String, plan: usize, n: u64) {
        let Some(plan_limits) = policy.plans.get(plan) else {
            return;
        };
        let limits: Vec<KeyLimit> = plan_limits.iter().map(|l| l.key).collect();
        let bucket = bucket_limit(plan_limits).map(|l| l.key.name_hash);
        let now = self.clock.now_ns();
        let ttl = Duration::from_nanos(idle_after_ns(&limits)).saturating_add(Duration::from_secs(1));
        let mut charged = 0u64;
        let mut closed_for = None;
        let mut decide = |stored: &[Option<Vec<u8>>]| {
            let record = stored.first().and_then(|s| s.as_deref());
            let full = check_key(record, &limits, effective_from, now, n);
            let fits = if full.denied { room(&full, n) } else { n };
            let check = if fits == n {
                full
            } else {
                check_key(record, &limits, effective_from, now, fits)
            };
            let write = fits > 0 && !check.denied;
            charged = if write { fits } else { 0 };
            let after = if write {
                Some(check.charged.as_slice())
            } else {
                record
            };
            closed_for = exhausted_for(after, plan_limits, bucket, effective_from, now);
            write.then(|| vec![check.charged.clone()])
        };
        match self
            .counters
            .update(std::slice::from_ref(&key), ttl, now, &mut decide)
            .await
        {
            Ok(()) => {
                self.metrics
                    .usage_over
                    .fetch_add(n.saturating_sub(charged), Relaxed);
            }
            Err(e) => {
                tracing::debug!(error = %e, "RLQS usage not folded");
                self.metrics.store_errors.fetch_add(1, Relaxed);
            }
        }
        if let Some(wait) = closed_for {
            let limits = self.limits();
            let out = self.with_book(|b| b.close_key(&key, now.saturating_add(wait), now, limits));
            self.deliver(out);
        }
    }

    /// Drops expired holders and re-splits their keys.
    fn sweep(&self) {
        let now = self.clock.now_ns();
        let limits = self.limits();
        let out = self.with_book(|b| b.expire(now, limits));
        self.deliver(out);
    }

    /// Serves one stream until Envoy ends it, it fails, or its answers
    /// cannot be sent.
    async fn serve_stream(
        self: Arc<Self>,
        id: StreamId,
        mut inbound: tonic::Streaming<RateLimitQuotaUsageReports>,
        tx: mpsc::Sender<Reply>,
    ) {
        let mut domain = None;
        loop {
            let msg = tokio::select! {
                m = inbound.message() => m,
                () = tx.closed() => break,
            };
            match msg {
                Ok(Some(m)) => {
                    if let Err(status) = self.on_reports(id, &mut domain, m).await {
                        self.metrics.invalid.fetch_add(1, Relaxed);
                        let _ = tx.try_send(Err(status));
                        break;
                    }
                }
                Ok(None) | Err(_) => break,
            }
        }
        self.close(id);
    }

    /// Starts the sweep (once), for as long as the service lives.
    fn start_sweeping(self: &Arc<Self>) {
        if self.sweeping.swap(true, Relaxed) {
            return;
        }
        let weak: Weak<Rlqs> = Arc::downgrade(self);
        let every = self.settings.sweep_every.max(Duration::from_millis(10));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let Some(rlqs) = weak.upgrade() else {
                    return;
                };
                rlqs.sweep();
            }
        });
    }
}

/// How long the next request of a key would be refused by an enforced
/// limit other than the one its token buckets carry (`bucket`, by name
/// hash), given its records `after` a charge; `None`: it would not be.
fn exhausted_for(
    after: Option<&[u8]>,
    plan_limits: &[RlsLimit],
    bucket: Option<u32>,
    effective_from: u64,
    now: u64,
) -> Option<u64> {
    let limits: Vec<KeyLimit> = plan_limits.iter().map(|l| l.key).collect();
    let next = check_key(after, &limits, effective_from, now, 1);
    next.standings
        .iter()
        .zip(plan_limits)
        .filter(|(_, l)| !l.key.shadow && Some(l.key.name_hash) != bucket)
        .filter_map(|(s, _)| s.refused_for_ns)
        .max()
}

/// The most of `n` every limit still has room for.
fn room(check: &tenantgate::limiter::charge::KeyCheck, n: u64) -> u64 {
    check
        .standings
        .iter()
        .map(|s| {
            if s.refused_for_ns.is_some() {
                s.remaining
            } else {
                s.remaining.saturating_add(n)
            }
        })
        .min()
        .unwrap_or(0)
        .min(n)
}

fn target_key(t: &Target) -> Option<&str> {
    match t {
        Target::Allow => None,
        Target::Count { key } | Target::Limit { key, .. } => Some(key),
    }
}

/// A bucket's target under `policy` (see the module header), and its plan.
fn resolve(policy: &RlsPolicy, domain: &str, id: &BucketId) -> (Target, Option<usize>) {
    if policy.mode == Mode::Off {
        return (Target::Allow, None);
    }
    let entries: Vec<(&str, &str)> = id.bucket.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let Some(found) = policy.descriptors.find_unordered(domain, &entries) else {
        return (Target::Allow, None);
    };
    let Some((plan, limits)) = found.rule.plan.and_then(|p| policy.plans.get(p).map(|l| (p, l))) else {
        return (Target::Allow, None);
    };
    let key = super::record_key(&found.rule.path, &found.tenant);
    match bucket_limit(limits) {
        Some(l) if policy.mode == Mode::Enforce => (
            Target::Limit {
                key,
                rate: KeyRate {
                    rate: l.rate,
                    per_secs: l.per_secs,
                    burst: l.burst,
                },
            },
            Some(plan),
        ),
        _ => (Target::Count { key }, Some(plan)),
    }
}

/// The limit a key's token buckets carry: its plan's enforced limit of
/// shortest window (then lowest rate); the others are enforced through the
/// count (see the module header).
fn bucket_limit(limits: &[RlsLimit]) -> Option<&RlsLimit> {
    limits
        .iter()
        .filter(|l| !l.key.shadow)
        .min_by_key(|l| (l.per_secs, l.rate))
}

fn text_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_TEXT_LEN
}

/// A message's bounds (see the module header).
fn check_message(msg: &RateLimitQuotaUsageReports, domain: Option<&str>, max: usize) -> Result<(), String> {
    match domain {
        None if !text_ok(&msg.domain) => {
            return Err(format!(
                "the first report's domain must be 1 to {MAX_TEXT_LEN} bytes"
            ));
        }
        Some(d) if !msg.domain.is_empty() && msg.domain != d => {
            return Err("a stream keeps its first report's domain".to_owned());
        }
        _ => {}
    }
    if msg.bucket_quota_usages.len() > max {
        return Err(format!("at most {max} buckets per report"));
    }
    for u in &msg.bucket_quota_usages {
        let Some(id) = &u.bucket_id else {
            return Err("every usage names its bucket_id".to_owned());
        };
        if id.bucket.is_empty() || id.bucket.len() > MAX_DEPTH {
            return Err(format!("a bucket id has 1 to {MAX_DEPTH} entries"));
        }
        if id.bucket.iter().any(|(k, v)| !text_ok(k) || !text_ok(v)) {
            return Err(format!("bucket id keys and values are 1 to {MAX_TEXT_LEN} bytes"));
        }
    }
    Ok(())
}

/// The tonic service over a shared [`Rlqs`].
pub struct RlqsService(pub Arc<Rlqs>);

type ReplyStream = Pin<Box<dyn tokio_stream::Stream<Item = Reply> + Send>>;

#[tonic::async_trait]
impl RateLimitQuotaService for RlqsService {
    type StreamRateLimitQuotasStream = ReplyStream;

    async fn stream_rate_limit_quotas(
        &self,
        request: tonic::Request<tonic::Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<tonic::Response<ReplyStream>, tonic::Status> {
        let rlqs = self.0.clone();
        rlqs.start_sweeping();
        let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
        let id = rlqs.open(tx.clone())?;
        tokio::spawn(rlqs.serve_stream(id, request.into_inner(), tx));
        Ok(tonic::Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::grpc::counters::MemoryCounters;
    use crate::grpc::rls::Rls;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

    const POLICY: &str = r#"
version: "t"
identity: { header: x-tenant-id }
plans:
  shared: { limits: [ { name: short, rate: 30, per: 10s, burst: 6 }, { name: daily, rate: 1000, per: 1d } ] }
  quiet:  { limits: [ { rate: 5, per: 1s, shadow: true } ] }
default_plan: shared
anonymous: { plan: shared }
routes: { api: {} }
default_route: api
descriptors:
  shop:
    - key: tenant
      plan: shared
    - key: tenant
      value: vip
      unlimited: true
    - key: watched
      plan: quiet
"#;

    fn policy(text: &str) -> RlsPolicy {
        crate::service::policy::parse(text).unwrap().rls
    }

    fn id(entries: &[(&str, &str)]) -> BucketId {
        BucketId {
            bucket: entries
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    fn reports(domain: &str, ids: &[BucketId], allowed: u64) -> RateLimitQuotaUsageReports {
        RateLimitQuotaUsageReports {
            domain: domain.to_owned(),
            bucket_quota_usages: ids
                .iter()
                .map(|i| BucketQuotaUsage {
                    bucket_id: Some(i.clone()),
                    time_elapsed: None,
                    num_requests_allowed: allowed,
                    num_requests_denied: 0,
                })
                .collect(),
        }
    }

    #[test]
    fn buckets_resolve_to_the_rls_keys() {
        let p = policy(POLICY);
        let (t, plan) = resolve(&p, "shop", &id(&[("tenant", "a")]));
        assert_eq!(
            t,
            Target::Limit {
                key: "shop.tenant|6:tenant1:a".into(),
                rate: KeyRate {
                    rate: 30,
                    per_secs: 10,
                    burst: 6
                }
            }
        );
        let names: Vec<&str> = p.plans[plan.unwrap()].iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["short", "daily"]);
        for (domain, entries) in [
            ("shop", &[("tenant", "vip")][..]),
            ("shop", &[("team", "x")]),
            ("other", &[("tenant", "a")]),
            ("shop", &[("tenant", "a"), ("x", "y")]),
        ] {
            assert_eq!(resolve(&p, domain, &id(entries)).0, Target::Allow, "{entries:?}");
        }
        assert!(matches!(
            resolve(&p, "shop", &id(&[("watched", "w")])).0,
            Target::Count { .. }
        ));
        let shadow = policy(&POLICY.replace("version: \"t\"", "version: \"t\"\nmode: shadow"));
        assert!(matches!(
            resolve(&shadow, "shop", &id(&[("tenant", "a")])).0,
            Target::Count { .. }
        ));
        let off = policy(&POLICY.replace("version: \"t\"", "version: \"t\"\nmode: off"));
        assert_eq!(resolve(&off, "shop", &id(&[("tenant", "a")])).0, Target::Allow);
    }

    #[test]
    fn messages_out_of_bounds_are_refused() {
        let ok = reports("shop", &[id(&[("tenant", "a")])], 1);
        assert!(check_message(&ok, None, 4).is_ok());
        assert!(check_message(&reports("", &[id(&[("tenant", "a")])], 1), None, 4).is_err());
        // Later messages may leave the domain out, never change it.
        assert!(check_message(&reports("", &[id(&[("tenant", "a")])], 1), Some("shop"), 4).is_ok());
        assert!(check_message(&reports("x", &[id(&[("tenant", "a")])], 1), Some("shop"), 4).is_err());
        let long = "v".repeat(MAX_TEXT_LEN + 1);
        let deep: Vec<(String, String)> = (0..=MAX_DEPTH)
            .map(|i| (format!("k{i}"), "v".to_owned()))
            .collect();
        let deep: Vec<(&str, &str)> = deep.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        for bad in [
            id(&[]),
            id(&[("tenant", "")]),
            id(&[("tenant", long.as_str())]),
            id(&deep),
        ] {
            assert!(
                check_message(&reports("shop", std::slice::from_ref(&bad), 1), None, 4).is_err(),
                "{bad:?}"
            );
        }
        let many: Vec<BucketId> = (0..5).map(|i| id(&[("tenant", &i.to_string())])).collect();
        assert!(check_message(&reports("shop", &many, 1), None, 4).is_err());
        let no_id = RateLimitQuotaUsageReports {
            domain: "shop".into(),
            bucket_quota_usages: vec![BucketQuotaUsage::default()],
        };
        assert!(check_message(&no_id, None, 4).is_err());
    }

    /// Usage reported over RLQS is charged to the records the RLS decides
    /// from: one count per key.
    #[tokio::test]
    async fn reported_usage_is_the_rls_count() {
        let clock = Arc::new(ManualClock::new(1_000_000_000_000));
        let counters: Arc<dyn Counters> = Arc::new(MemoryCounters::new(100));
        let rlqs = Rlqs::new(counters.clone(), clock.clone(), Settings::default());
        let rls = Rls::new(counters, clock);
        rlqs.set_policy(policy(POLICY));
        rls.set_policy(policy(POLICY));
        let (tx, mut rx) = mpsc::channel(8);
        let stream = rlqs.open(tx).unwrap();
        let mut domain = None;
        // 10 admitted by Envoy: 6 fit the burst, 4 are over.
        rlqs.on_reports(
            stream,
            &mut domain,
            reports("shop", &[id(&[("tenant", "a")])], 10),
        )
        .await
        .unwrap();
        let answer = rx.try_recv().unwrap().unwrap();
        assert_eq!(answer.bucket_action.len(), 1);
        assert_eq!(rlqs.metrics.usage_over.load(Relaxed), 4);
        assert_eq!(rlqs.metrics.allowed.load(Relaxed), 10);
        let request = RateLimitRequest {
            domain: "shop".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "tenant".into(),
                    value: "a".into(),
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        let decided = rls.decide(&request).await.unwrap();
        assert_eq!(decided.overall_code, Code::OverLimit as i32);
        // A later message changing the domain ends the stream.
        assert!(rlqs
            .on_reports(
                stream,
                &mut domain,
                reports("other", &[id(&[("tenant", "a")])], 0)
            )
            .await
            .is_err());
    }

    /// The plan's other limit (a daily quota beside the rate the token
    /// buckets carry) is enforced through the count: exhausted, every
    /// holder is sent DENY_ALL.
    #[tokio::test]
    async fn an_exhausted_daily_quota_denies_every_holder() {
        use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
        use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
        let text = POLICY.replace(
            "{ name: daily, rate: 1000, per: 1d }",
            "{ name: daily, algorithm: fixed_window, rate: 8, per: 1d }",
        );
        let clock = Arc::new(ManualClock::new(1_000_000_000_000));
        let rlqs = Rlqs::new(
            Arc::new(MemoryCounters::new(100)),
            clock.clone(),
            Settings::default(),
        );
        rlqs.set_policy(policy(&text));
        let (tx, mut rx) = mpsc::channel(8);
        let stream = rlqs.open(tx).unwrap();
        let mut domain = None;
        let a = [id(&[("tenant", "a")])];
        let strategy = |r: RateLimitQuotaResponse| match r.bucket_action.first().and_then(|a| a.bucket_action)
        {
            Some(Action::QuotaAssignmentAction(q)) => q.rate_limit_strategy.and_then(|s| s.strategy),
            _ => None,
        };
        rlqs.on_reports(stream, &mut domain, reports("shop", &a, 6))
            .await
            .unwrap();
        assert!(matches!(
            strategy(rx.try_recv().unwrap().unwrap()),
            Some(Strategy::TokenBucket(_))
        ));
        assert!(rx.try_recv().is_err(), "6 of 8 a day: still open");
        clock.advance(Duration::from_secs(10));
        rlqs.on_reports(stream, &mut domain, reports("shop", &a, 6))
            .await
            .unwrap();
        assert!(matches!(
            strategy(rx.try_recv().unwrap().unwrap()),
            Some(Strategy::TokenBucket(_))
        ));
        // 2 of the 6 fit the day; it is spent: DENY_ALL pushed.
        assert_eq!(rlqs.metrics.usage_over.load(Relaxed), 4);
        assert_eq!(
            strategy(rx.try_recv().unwrap().unwrap()),
            Some(Strategy::BlanketRule(BlanketRule::DenyAll as i32))
        );
    }

    #[tokio::test]
    async fn streams_beyond_the_cap_are_refused() {
        let settings = Settings {
            max_streams: 1,
            ..Settings::default()
        };
        let rlqs = Rlqs::new(
            Arc::new(MemoryCounters::new(10)),
            Arc::new(ManualClock::new(0)),
            settings,
        );
        let (tx, _rx) = mpsc::channel(1);
        let first = rlqs.open(tx.clone()).unwrap();
        assert_eq!(
            rlqs.open(tx.clone()).unwrap_err().code(),
            tonic::Code::ResourceExhausted
        );
        rlqs.close(first);
        assert!(rlqs.open(tx).is_ok());
    }
}
