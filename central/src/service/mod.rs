//! `tenantgate serve`: the allocator behind HTTP/JSON, its records in a
//! [`Store`].
//!
//! A sync request is the allocator's three steps (`crate::alloc`):
//! [`alloc::begin`] on the node's session, [`alloc::visit`] on every
//! (key, limit) it reports or holds, [`alloc::finish`] on the session, run
//! as **one store transaction** ([`Store::update_request`]): every record
//! it changes is written, or none is. Replicas sharing a store therefore
//! answer as one allocator would, and a request that fails anywhere (a
//! store error, a broken connection, a conflict past the retries, a panic
//! in a step) counts nothing: the node's next report carries the same
//! counts again and they are booked exactly once (`central/tests/service.rs`,
//! `a_failed_request_counts_nothing_and_its_retry_counts_once`).
//!
//! # Shared settings: the node's, used, never refused
//! Each request carries the settings its node enforces (callout timeout
//! `D`, `fail_open_local`'s duration, interval, failure mode per (key,
//! limit): `tenantgate::sync::NodeSettings`). The service computes that
//! node's leases from them ([`crate::alloc::NodeTerms`], kept with each
//! lease): a lease is dead by `answered_at` + the node's `D` + `ttl`, a
//! silent node's share stays reserved and charged until its own
//! `local_max` ran out, a `fail_closed` key keeps nothing reserved. So the
//! bound holds with the numbers that are enforced, whatever the service's
//! policy says. The alternative, refusing a node whose settings differ
//! from the policy's, would not keep the bound any better (the refused
//! node runs its failure mode on its own settings anyway, and the service
//! would still have to reserve for it) and would cut nodes off in the
//! middle of every rollout that changes `sync:`. Only values no policy
//! produces are refused (`400`, `tenantgate::sync::NodeSettings::check`).
//! A node older than the fields sends none: the policy's values are
//! assumed. `tenantgate_sync_settings_total{result}` counts `same`,
//! `differs` and `unreported`. The interval needs nothing: a node syncs at
//! the interval the answers ask for.
//!
//! Time is the service's own: [`Clock`] (never a node's timestamp). The
//! production clock is monotonic in each process and shares its epoch with
//! the other replicas through the system clock read once at start, so the
//! replicas' interval numbers agree to within their clock offset. A replica
//! behind the others cannot refill a bucket twice: a bucket's refill is
//! credited up to the latest time any replica brought it to.
//!
//! Each replica also runs a timer (every interval) that brings every key to
//! the current interval with no request ([`Service::sweep`], what
//! `Allocator::tick` does), so allocation, debt repayment and demand decay
//! go on for keys nobody reports. Several replicas doing it is harmless:
//! a key rolls over once per interval whoever gets there first.
//!
//! Every request is checked and bounded before the allocator sees it
//! ([`validate`]: sizes, identity, regions, plausible counts), and worked on
//! in a task of its own, at most [`IntakeLimits::max_in_flight`] at once
//! (beyond: `503`). The deadline ([`Service::deadline`]: half the policy's
//! `sync.timeout`, following every reload) answers the node `503` but
//! never cancels the task: its transaction lands whole or not at all
//! either way, and the node's retry carries the same counts, which its
//! session then deduplicates. A panic in a request (a bug) answers `500`
//! and writes nothing.

mod http;
pub mod metrics;
pub mod policy;
pub mod top;
pub mod validate;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tenantgate::sync::{SyncRequest, SyncResponse, PROTOCOL_VERSION};
use tokio::sync::Semaphore;
use tracing::{info, warn};

use crate::alloc::{self, AllocConfig, KeyId, KeyState, NodeTerms, SeqCheck, Session, Visit};
pub use crate::clock::{Clock, ManualClock, SystemClock};
pub use crate::listener::Identity;
use crate::store::{KeySlot, Store, StoreError};
pub use http::{
    admin_router, check_exposure, open_store, run, serve, serve_on, shutdown_signal, sync_router, Auth,
    Listeners, QuotaOptions, ServeOptions, DEFAULT_ADMIN, DEFAULT_LISTEN,
};
use metrics::{Metrics, Outcome};
pub use policy::{PolicyLimits, Settings};
pub use validate::{IntakeLimits, Refusal, StateLimits};

/// Why a sync request got no leases.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("{0}")]
    Invalid(String),
    /// The request names another node or region than its sender's
    /// identity, or it has none where one is required.
    #[error("{0}")]
    Forbidden(String),
    #[error("no policy loaded")]
    NotReady,
    #[error("stale sync request (seq {0}): nothing was counted")]
    Stale(u64),
    #[error("seq {0} jumps implausibly far ahead of this node's session: nothing was counted")]
    SeqJump(u64),
    #[error("the service holds its maximum of {0} node sessions: a new node is refused")]
    SessionsFull(u64),
    #[error("{0} sync requests in progress: try again")]
    Busy(usize),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("internal error: {0}")]
    Internal(String),
}

/// One service replica.
pub struct Service {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    settings: Settings,
    config: RwLock<Option<Arc<AllocConfig>>>,
    /// Why the last policy load was refused (cleared by a good one):
    /// `/readyz` says it while no policy is in force.
    refused: std::sync::Mutex<Option<String>>,
    pub metrics: Metrics,
    /// The heaviest keys by demand and denials, per region (bounded).
    pub top: top::Top,
    intake: IntakeLimits,
    state: StateLimits,
    in_flight: Arc<Semaphore>,
    /// The store's session and key counts as last seen (for the caps).
    sessions_seen: AtomicU64,
    keys_seen: AtomicU64,
    /// When the sweep last expired sessions (service clock).
    sessions_swept_at: AtomicU64,
    /// The reservation API, when a quota store is configured.
    quota: std::sync::OnceLock<Arc<crate::quota::api::QuotaApi>>,
    /// Envoy's rate limit service, when `--grpc-listen` serves it.
    rls: std::sync::OnceLock<Arc<crate::grpc::rls::Rls>>,
    /// Envoy's rate limit quota service, beside the RLS.
    rlqs: std::sync::OnceLock<Arc<crate::grpc::rlqs::Rlqs>>,
}

impl Service {
    pub fn new(store: Arc<dyn Store>, clock: Arc<dyn Clock>, settings: Settings) -> Service {
        Service::with_limits(
            store,
            clock,
            settings,
            IntakeLimits::default(),
            StateLimits::default(),
        )
    }

    pub fn with_limits(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        settings: Settings,
        intake: IntakeLimits,
        state: StateLimits,
    ) -> Service {
        let in_flight = Arc::new(Semaphore::new(intake.max_in_flight.max(1)));
        Service {
            store,
            clock,
            settings,
            refused: std::sync::Mutex::new(None),
            config: RwLock::new(None),
            metrics: Metrics::default(),
            top: top::Top::default(),
            intake,
            state,
            in_flight,
            sessions_seen: AtomicU64::new(0),
            keys_seen: AtomicU64::new(0),
            sessions_swept_at: AtomicU64::new(0),
            quota: std::sync::OnceLock::new(),
            rls: std::sync::OnceLock::new(),
            rlqs: std::sync::OnceLock::new(),
        }
    }

    /// Serves Envoy's rate limit service (set once, before serving; the
    /// policy's `descriptors:` follow every reload).
    pub fn attach_rls(&self, rls: Arc<crate::grpc::rls::Rls>) {
        let _ = self.rls.set(rls);
    }

    pub fn rls(&self) -> Option<&Arc<crate::grpc::rls::Rls>> {
        self.rls.get()
    }

    /// Serves Envoy's rate limit quota service (set once, before serving;
    /// it follows the policy's `descriptors:` as the RLS does).
    pub fn attach_rlqs(&self, rlqs: Arc<crate::grpc::rlqs::Rlqs>) {
        let _ = self.rlqs.set(rlqs);
    }

    pub fn rlqs(&self) -> Option<&Arc<crate::grpc::rlqs::Rlqs>> {
        self.rlqs.get()
    }

    /// Serves the reservation API beside the sync API (set once, before
    /// serving; the policy's `quotas:` follow every reload).
    pub fn attach_quota(&self, api: Arc<crate::quota::api::QuotaApi>) {
        let _ = self.quota.set(api);
    }

    pub fn quota(&self) -> Option<&Arc<crate::quota::api::QuotaApi>> {
        self.quota.get()
    }

    /// The service's clock (shared with the reservation API).
    pub fn clock(&self) -> Arc<dyn Clock> {
        self.clock.clone()
    }

    pub fn intake_limits(&self) -> &IntakeLimits {
        &self.intake
    }

    pub fn state_limits(&self) -> &StateLimits {
        &self.state
    }

    /// Node sessions in the store, as last seen.
    pub fn sessions_seen(&self) -> u64 {
        self.sessions_seen.load(Relaxed)
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// The allocator configuration in force, if a policy is loaded.
    pub fn config(&self) -> Option<Arc<AllocConfig>> {
        self.config
            .read()
            .map(|c| c.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    /// How long a sync request may take before it is answered `503`: half
    /// the callout timeout `D` in force (the policy's `sync.timeout`, so it
    /// follows every reload; the service's own setting before a policy is
    /// loaded), well within it: the node discards a later answer anyway.
    pub fn deadline(&self) -> Duration {
        let d = self
            .config()
            .map_or(self.settings.response_timeout_ns, |c| c.response_timeout_ns);
        Duration::from_nanos(d / 2)
    }

    /// Puts a validated policy in force.
    pub fn set_policy(&self, p: &PolicyLimits) {
        if let Some(q) = self.quota.get() {
            q.set_quotas(p.quotas.clone());
        }
        if let Some(r) = self.rls.get() {
            r.set_policy(p.rls.clone());
        }
        if let Some(r) = self.rlqs.get() {
            r.set_policy(p.rls.clone());
        }
        let cfg = Arc::new(self.settings.alloc_config(p));
        match self.config.write() {
            Ok(mut c) => *c = Some(cfg),
            Err(e) => *e.into_inner() = Some(cfg),
        }
    }

    /// Loads `path` and puts it in force; on an error the policy in force
    /// stays. Counted in `tenantgate_policy_reloads_total`.
    pub fn reload(&self, path: &std::path::Path) -> Result<String, String> {
        self.put_in_force(policy::load(path), path)
    }

    /// [`Service::reload`] from contents already read from `path`.
    pub fn reload_contents(&self, contents: &[u8], path: &std::path::Path) -> Result<String, String> {
        let parsed = std::str::from_utf8(contents)
            .map_err(|e| format!("not UTF-8: {e}"))
            .and_then(policy::parse)
            .map_err(|e| format!("{}: {e}", path.display()));
        self.put_in_force(parsed, path)
    }

    fn put_in_force(
        &self,
        loaded: Result<PolicyLimits, String>,
        path: &std::path::Path,
    ) -> Result<String, String> {
        match loaded {
            Ok(p) => {
                if !p.ambiguous.is_empty() {
                    warn!(limits = ?p.ambiguous, "limit names defined differently by several plans: the strictest applies");
                }
                self.set_policy(&p);
                self.set_refused(None);
                self.metrics.reloads_ok.fetch_add(1, Relaxed);
                info!(version = %p.version, limits = p.limits.len(), path = %path.display(), "policy loaded");
                Ok(p.version)
            }
            Err(e) => {
                self.metrics.reloads_failed.fetch_add(1, Relaxed);
                self.set_refused(Some(e.clone()));
                warn!(error = %e, "policy refused; the one in force stays");
                Err(e)
            }
        }
    }

    fn set_refused(&self, why: Option<String>) {
        match self.refused.lock() {
            Ok(mut r) => *r = why,
            Err(e) => *e.into_inner() = why,
        }
    }

    /// Ready: a policy is loaded and the store answers. `Err`: why not,
    /// with the last policy refusal while none is in force.
    pub async fn ready(&self) -> Result<(), String> {
        if self.config().is_none() {
            let refused = match self.refused.lock() {
                Ok(r) => r.clone(),
                Err(e) => e.into_inner().clone(),
            };
            return Err(match refused {
                Some(why) => format!("no policy loaded: {why}"),
                None => "no policy loaded".to_owned(),
            });
        }
        self.store
            .ping()
            .await
            .map_err(|e| format!("the store ({}) does not answer: {e}", self.store.kind()))
    }

    /// Answers one sync request body from a sender with `identity` (the
    /// one its certificate or token names; `None`: unauthenticated), within
    /// [`Service::deadline`], and counts it.
    pub async fn sync_json(
        self: &Arc<Self>,
        body: axum::body::Bytes,
        identity: Option<Identity>,
    ) -> Result<SyncResponse, SyncError> {
        let started = Instant::now();
        let result = self.sync_guarded(body, identity).await;
        let outcome = match &result {
            Ok(_) => Outcome::Ok,
            Err(SyncError::Invalid(_)) => Outcome::Invalid,
            Err(SyncError::Forbidden(_)) => Outcome::Forbidden,
            Err(SyncError::NotReady) => Outcome::NotReady,
            Err(SyncError::Stale(_)) => Outcome::Stale,
            Err(SyncError::SeqJump(_)) => Outcome::SeqJump,
            Err(SyncError::SessionsFull(_)) => Outcome::SessionsFull,
            Err(SyncError::Busy(_)) => Outcome::Busy,
            Err(SyncError::Store(e)) => {
                self.metrics.store_error(e.is_transient());
                Outcome::StoreError
            }
            Err(SyncError::Timeout(_)) => Outcome::Timeout,
            Err(SyncError::Internal(_)) => Outcome::Internal,
        };
        self.metrics.request(outcome, started.elapsed());
        result
    }

    /// At most `max_in_flight` at once, each in a task of its own that the
    /// deadline does not cancel (see the module header).
    async fn sync_guarded(
        self: &Arc<Self>,
        body: axum::body::Bytes,
        identity: Option<Identity>,
    ) -> Result<SyncResponse, SyncError> {
        let permit = self
            .in_flight
            .clone()
            .try_acquire_owned()
            .map_err(|_| SyncError::Busy(self.intake.max_in_flight))?;
        let this = self.clone();
        let task = tokio::spawn(async move {
            let _permit = permit;
            this.sync_inner(&body, identity.as_ref()).await
        });
        let deadline = self.deadline();
        match tokio::time::timeout(deadline, task).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(SyncError::Internal(format!("the request's task failed: {e}"))),
            Err(_) => Err(SyncError::Timeout(deadline)),
        }
    }

    async fn sync_inner(&self, body: &[u8], identity: Option<&Identity>) -> Result<SyncResponse, SyncError> {
        let mut req = SyncRequest::from_json(body).map_err(|e| SyncError::Invalid(e.to_string()))?;
        validate::check(&req, &self.intake, identity).map_err(|e| match e {
            Refusal::Invalid(m) => SyncError::Invalid(m),
            Refusal::Identity(m) => SyncError::Forbidden(m),
        })?;
        let cfg = self.config().ok_or(SyncError::NotReady)?;
        let clamped = validate::clamp(&mut req, &cfg);
        if clamped > 0 {
            self.metrics.clamped.fetch_add(clamped, Relaxed);
        }
        self.sync(&req).await
    }

    /// Answers one sync request (not counted in the request metrics).
    pub async fn sync(&self, req: &SyncRequest) -> Result<SyncResponse, SyncError> {
        if req.version != PROTOCOL_VERSION {
            return Err(SyncError::Invalid(format!("unsupported version {}", req.version)));
        }
        let cfg = self.config().ok_or(SyncError::NotReady)?;
        if req.policy_version != cfg.policy_version {
            self.metrics.policy_skew.fetch_add(1, Relaxed);
        }
        // The node's settings are used as reported (see the module header).
        self.metrics.settings(cfg.terms_of(req).1);
        let now = self.clock.now_ns();
        let mut txn = SyncTxn {
            req,
            cfg: &cfg,
            now,
            sessions_full: self.sessions_seen.load(Relaxed) >= self.state.max_sessions,
            max_sessions: self.state.max_sessions,
            keys_full: self.keys_seen.load(Relaxed) >= self.state.max_keys,
            refused: None,
            begun: None,
            nodes: 0,
            visits: Vec::new(),
            capped: 0,
        };
        let nodes = self.store.update_request(&req.node_id, &mut txn).await?;
        self.sessions_seen.store(nodes, Relaxed);
        if let Some(e) = txn.refused {
            return Err(e);
        }
        if txn.begun.is_none() {
            return Err(SyncError::Stale(req.seq));
        }
        self.top.record(
            &req.region,
            alloc::counted(&txn.visits).map(|((key, _), c)| top::Seen {
                key,
                demand: c.demand,
                consumed: c.consumed,
            }),
            now,
        );
        self.metrics.reports.fetch_add(req.reports.len() as u64, Relaxed);
        let capped = txn.capped;
        if capped > 0 {
            self.metrics.keys_refused.fetch_add(capped, Relaxed);
        }
        let visits = txn.visits;
        let unknown = visits
            .iter()
            .filter(|(_, v)| matches!(v, Visit::UnknownLimit { .. }))
            .count() as u64;
        self.metrics
            .unknown_limits
            .fetch_add(unknown.saturating_sub(capped), Relaxed);
        let resp = alloc::respond(&cfg, req, visits);
        self.metrics.leases.fetch_add(resp.leases.len() as u64, Relaxed);
        Ok(resp)
    }

    /// Brings every key to the current interval (the timer's pass), drops
    /// the (key, limit) records that hold nothing a new one would not, and
    /// (every tenth of the session idle time) the sessions idle past it.
    /// Returns how many keys it visited.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        let Some(cfg) = self.config() else {
            return Ok(0);
        };
        let now = self.clock.now_ns();
        let ids = self.store.key_ids().await?;
        let mut expired = 0u64;
        for chunk in ids.chunks(512) {
            self.store
                .update_keys(chunk, &mut |_, slot: &mut Option<KeyState>| match slot {
                    Some(ks) => {
                        alloc::advance(&cfg, ks, now);
                        if ks.is_idle() {
                            *slot = None;
                            expired += 1;
                        }
                        true
                    }
                    None => false,
                })
                .await?;
        }
        self.metrics.expired_keys.fetch_add(expired, Relaxed);
        self.metrics.sweeps.fetch_add(1, Relaxed);
        self.keys_seen
            .store((ids.len() as u64).saturating_sub(expired), Relaxed);
        let idle = self.session_idle_ns(&cfg, None);
        let due = self.sessions_swept_at.load(Relaxed).saturating_add(idle / 10);
        if now >= due {
            self.sessions_swept_at.store(now, Relaxed);
            self.expire_sessions(&cfg, now).await?;
        }
        Ok(ids.len() as u64)
    }

    /// The session idle time in force for a node that enforces `terms`:
    /// at least its lease's life plus its local fallback plus the settling
    /// time.
    fn session_idle_ns(&self, cfg: &AllocConfig, terms: Option<NodeTerms>) -> u64 {
        let terms = terms.unwrap_or_else(|| cfg.terms());
        let floor = terms
            .lease_life_ns(cfg)
            .saturating_add(terms.local_max_ns)
            .saturating_add(cfg.settle_ns);
        self.state.session_idle_ns.max(floor)
    }

    async fn expire_sessions(&self, cfg: &AllocConfig, now: u64) -> Result<(), StoreError> {
        let nodes = self.store.session_ids().await?;
        let mut left = nodes.len() as u64;
        for node in nodes {
            let mut expired = false;
            let count = self
                .store
                .update_session(&node, &mut |slot| {
                    expired = slot.as_ref().is_some_and(|s| {
                        let idle = self.session_idle_ns(cfg, s.terms());
                        s.heard_at.is_none_or(|h| now.saturating_sub(h) >= idle)
                    });
                    if expired {
                        *slot = None;
                    }
                    expired
                })
                .await?;
            left = count;
            if expired {
                self.metrics.expired_sessions.fetch_add(1, Relaxed);
            }
        }
        self.sessions_seen.store(left, Relaxed);
        Ok(())
    }

    /// The interval the service tells nodes to sync at.
    pub fn interval(&self) -> Duration {
        Duration::from_nanos(self.settings.interval_ns)
    }
}

/// One sync request's steps as one store transaction (see the module
/// header): [`alloc::begin`] on the session, then [`alloc::visit`] on every
/// (key, limit) and [`alloc::finish`] on the session. Its results are left
/// in its fields on every run (a store may run it again on a conflict).
struct SyncTxn<'a> {
    req: &'a SyncRequest,
    cfg: &'a AllocConfig,
    now: u64,
    sessions_full: bool,
    max_sessions: u64,
    keys_full: bool,
    refused: Option<SyncError>,
    begun: Option<alloc::Begun>,
    /// Nodes with a session, this one included.
    nodes: u64,
    visits: Vec<(KeyId, Visit)>,
    /// New (key, limit)s refused for the cap.
    capped: u64,
}

impl crate::store::Txn for SyncTxn<'_> {
    fn begin(&mut self, slot: &mut Option<Session>, sessions: u64) -> Option<Vec<KeyId>> {
        self.refused = None;
        self.begun = None;
        self.visits.clear();
        self.capped = 0;
        let check = match slot.as_ref() {
            Some(s) => s.seq_check(self.req, self.now),
            None if self.sessions_full => {
                self.refused = Some(SyncError::SessionsFull(self.max_sessions));
                return None;
            }
            None => Session::new(&self.req.region).seq_check(self.req, self.now),
        };
        if check == SeqCheck::Jump {
            self.refused = Some(SyncError::SeqJump(self.req.seq));
            return None;
        }
        self.nodes = sessions.saturating_add(u64::from(slot.is_none()));
        let begun = alloc::begin(slot, self.req, self.now)?;
        let ids = begun.visits().into_iter().map(|(id, _)| id).collect();
        self.begun = Some(begun);
        Some(ids)
    }

    fn apply(&mut self, session: &mut Option<Session>, keys: &mut [KeySlot]) -> bool {
        let Some(begun) = self.begun.as_ref() else {
            return false;
        };
        self.visits.clear();
        self.capped = 0;
        for (slot, (id, delta)) in keys.iter_mut().zip(begun.visits()) {
            if slot.record.is_none() && self.keys_full && delta.is_some() {
                // A new (key, limit) beyond the cap: no record, no lease;
                // the node applies its failure mode to it.
                self.capped = self.capped.saturating_add(1);
                self.visits.push((id, Visit::UnknownLimit { holds: false }));
                continue;
            }
            let v = alloc::visit(
                self.cfg,
                &mut slot.record,
                &id,
                delta,
                begun,
                self.nodes,
                self.now,
            );
            slot.write = slot.record.is_some();
            self.visits.push((id, v));
        }
        if let Some(s) = session.as_mut() {
            alloc::finish(s, &self.visits);
        }
        true
    }
}

/// Watches a policy file: every `poll`, if its contents changed and then
/// read the same at the next poll, puts them in force (a refused policy is
/// logged and the old one kept). Runs until the task is dropped.
///
/// Waiting for one unchanged poll means a file caught while an editor or
/// `cp` is still writing it is not loaded: a truncated policy can be valid
/// YAML with a limit missing, and it would be in force until the next
/// poll. The price is one poll (`--policy-poll`) more before a change
/// takes effect. The contents put in force are the bytes compared, not a
/// fresh read.
pub async fn watch_policy(service: Arc<Service>, path: PathBuf, poll: Duration) {
    let mut watch = PolicyWatch::new(std::fs::read(&path).ok());
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut unreadable = false;
    loop {
        tick.tick().await;
        match std::fs::read(&path) {
            Ok(contents) => {
                unreadable = false;
                if let Some(settled) = watch.observe(contents) {
                    let _ = service.reload_contents(settled, &path);
                }
            }
            Err(e) => {
                if !unreadable {
                    warn!(path = %path.display(), error = %e, "policy file unreadable; the policy in force stays");
                }
                unreadable = true;
            }
        }
    }
}

/// What [`watch_policy`] has seen of a policy file.
#[derive(Debug, Default)]
pub struct PolicyWatch {
    /// The contents last put in force (or found at start).
    applied: Option<Vec<u8>>,
    /// Contents read once, different from `applied`, not yet confirmed.
    candidate: Option<Vec<u8>>,
}

impl PolicyWatch {
    pub fn new(applied: Option<Vec<u8>>) -> PolicyWatch {
        PolicyWatch {
            applied,
            candidate: None,
        }
    }

    /// One poll's read: the contents to put in force now, if they are new
    /// and the same as the previous poll's read.
    pub fn observe(&mut self, contents: Vec<u8>) -> Option<&[u8]> {
        if self.applied.as_deref() == Some(contents.as_slice()) {
            self.candidate = None;
            return None;
        }
        if self.candidate.as_deref() == Some(contents.as_slice()) {
            self.candidate = None;
            self.applied = Some(contents);
            return self.applied.as_deref();
        }
        self.candidate = Some(contents);
        None
    }
}

/// Runs [`Service::sweep`] every interval, until the task is dropped. Each
/// pass runs in a task of its own: an error or a panic (a bug) in one pass
/// is logged and counted, and the next pass runs as usual.
pub async fn sweep_every_interval(service: Arc<Service>) {
    let mut tick = tokio::time::interval(service.interval());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let pass = service.clone();
        match tokio::spawn(async move { pass.sweep().await }).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                service.metrics.store_error(e.is_transient());
                warn!(error = %e, transient = e.is_transient(), "sweep failed");
            }
            Err(e) => {
                service.metrics.sweeps_failed.fetch_add(1, Relaxed);
                warn!(error = %e, "sweep pass failed; the next one runs as usual");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PolicyWatch;

    #[test]
    fn a_change_is_put_in_force_once_it_reads_the_same_twice() {
        let mut w = PolicyWatch::new(Some(b"v1".to_vec()));
        assert_eq!(w.observe(b"v1".to_vec()), None, "unchanged");
        // Caught mid-write, then complete: neither half is loaded alone.
        assert_eq!(w.observe(b"ver".to_vec()), None);
        assert_eq!(w.observe(b"version: v2".to_vec()), None);
        assert_eq!(w.observe(b"version: v2".to_vec()), Some(&b"version: v2"[..]));
        assert_eq!(w.observe(b"version: v2".to_vec()), None, "loaded once");
        // A write that goes back to what is in force before it settled.
        assert_eq!(w.observe(b"version: v3".to_vec()), None);
        assert_eq!(w.observe(b"version: v2".to_vec()), None);
        assert_eq!(
            w.observe(b"version: v3".to_vec()),
            None,
            "the candidate was dropped"
        );
        assert_eq!(w.observe(b"version: v3".to_vec()), Some(&b"version: v3"[..]));
    }

    #[test]
    fn a_file_missing_at_start_is_loaded_when_it_appears_and_settles() {
        let mut w = PolicyWatch::new(None);
        assert_eq!(w.observe(Vec::new()), None);
        assert_eq!(w.observe(b"p".to_vec()), None);
        assert_eq!(w.observe(b"p".to_vec()), Some(&b"p"[..]));
    }
}
