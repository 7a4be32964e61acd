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
//! * **The limit a key is enforced with** is its plan's enforced limit of
//!   least rate per second, as a token bucket: `rate` per `per`, capacity
//!   `burst` (a window's capacity is its rate). Envoy's filter has one
//!   token bucket per bucket; the plan's other limits are counted (usage
//!   is folded into their records) and not enforced on this path.
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
//!   counted.
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
//! RLQS (the bound multiplies by the replicas otherwise).
//!
//! # Limits
//! Every value from the network is bounded: a message over 4 MiB (tonic's
//! decoding limit) is refused unread; at most [`Settings::max_streams`]
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
use std::sync::{Arc, Mutex, RwLock, Weak};
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

/// The policy in force and when it took effect (the reload rule's epoch).
struct InForce {
    policy: Arc<RlsPolicy>,
    effective_from: u64,
}

type Reply = Result<RateLimitQuotaResponse, tonic::Status>;

/// The rate limit quota service of one replica.
pub struct Rlqs {
    counters: Arc<dyn Counters>,
    clock: Arc<dyn Clock>,
    settings: Settings,
    in_force: RwLock<InForce>,
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
            in_force: RwLock::new(InForce {
                policy: Arc::new(RlsPolicy::default()),
                effective_from: 0,
            }),
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
        let now = self.clock.now_ns();
        let mut guard = match self.in_force.write() {
            Ok(g) => g,
            Err(e) => e.into_inner(),
        };
        if *guard.policy != policy {
            *guard = InForce {
                policy: Arc::new(policy),
                effective_from: now,
            };
        }
    }

    fn in_force(&self) -> (Arc<RlsPolicy>, u64) {
        let guard = match self.in_force.read() {
            Ok(g) => g,
            Err(e) => e.into_inner(),
        };
        (guard.policy.clone(), guard.effective_from)
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
        let now = self.clock.now_ns();
        let ttl = Duration::from_nanos(idle_after_ns(&limits)).saturating_add(Duration::from_secs(1));
        let mut charged = 0u64;
        let mut decide = |stored: &[Option<Vec<u8>>]| {
            let record = stored.first().and_then(|s| s.as_deref());
            let full = check_key(record, &limits, effective_from, now, n);
            let fits = if full.denied { room(&full, n) } else { n };
            charged = fits;
            if fits == 0 {
                return None;
            }
            let check = if fits == n {
                full
            } else {
                check_key(record, &limits, effective_from, now, fits)
            };
            if check.denied {
                charged = 0;
                return None;
            }
            Some(vec![check.charged])
        };
        match self.counters.update(&[key], ttl, now, &mut decide).await {
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
    let key = format!("{}|{}", found.rule.path, found.tenant);
    match tightest(limits) {
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

/// The enforced limit of least rate per second.
fn tightest(limits: &[RlsLimit]) -> Option<&RlsLimit> {
    limits.iter().filter(|l| !l.key.shadow).min_by(|a, b| {
        (u128::from(a.rate) * u128::from(b.per_secs.max(1)))
            .cmp(&(u128::from(b.rate) * u128::from(a.per_secs.max(1))))
    })
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
