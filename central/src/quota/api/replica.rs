//! One replica's reservation API: [`QuotaApi`], its operations (reserve,
//! commit, release, query, debts, reconcile) answered in the quota's own
//! [`Answer`]s, and its reclaimer (see the API's header in [`super`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use axum::http::{header, HeaderMap};
use serde_json::{json, Value};
use tenantgate::policy::quota::{
    project_id, Quotas, Resource, Risk, MAX_MAX_TTL_NS, MAX_QUOTA_AMOUNT, MIN_TTL_NS,
};
use tracing::warn;

use crate::clock::Clock;
use crate::listener::{Peer, DEFAULT_MAX_IN_FLIGHT};
use crate::quota::borrow::{self, Borrowing};
use crate::quota::metrics::QuotaMetrics;
use crate::quota::{
    error_answer, not_found, Answer, Kind, Outcome, QuotaStore, QuotaStoreError, ReserveRequest,
    RECLAIM_BATCH,
};

const NANOS_PER_MS: u64 = 1_000_000;
/// A `ttl` (ms) outside this range is malformed (`400`); inside it but over
/// the resource's `max_ttl`, refused by the policy (`409`).
const MIN_TTL_MS: u64 = MIN_TTL_NS / NANOS_PER_MS;
const MAX_TTL_MS: u64 = MAX_MAX_TTL_NS / NANOS_PER_MS;

use super::clients::{Grant, QuotaClients};

/// The last figures a query saw, for `estimate: true` answers.
type LastKnown = HashMap<(String, String, String), (Value, u64)>;

/// The reservation API of one replica.
pub struct QuotaApi {
    store: Arc<dyn QuotaStore>,
    clock: Arc<dyn Clock>,
    quotas: RwLock<Arc<Quotas>>,
    clients: Option<QuotaClients>,
    /// This replica's region (`--region`).
    region: Option<String>,
    pub metrics: QuotaMetrics,
    last_known: Mutex<LastKnown>,
    /// How often the reclaimer runs.
    pub reclaim_every: std::time::Duration,
    /// Requests in progress at most (see [`QuotaApi::with_max_in_flight`]).
    pub(super) in_flight: Arc<tokio::sync::Semaphore>,
    pub(super) max_in_flight: usize,
    /// This replica's borrowing account and home regions, if it borrows.
    borrowing: Option<Arc<Borrowing>>,
}

/// At most this many last-known query answers are kept.
const MAX_LAST_KNOWN: usize = 10_000;

fn invalid(field: &str, message: &str) -> Answer {
    error_answer(
        Kind::Invalid,
        Outcome::Invalid,
        &format!("{field}: {message}"),
        json!({ "field": field }),
    )
}

fn unknown_resource(name: &str) -> Answer {
    error_answer(
        Kind::NotFound,
        Outcome::NotFound,
        &format!("no resource `{name}` in the policy's quotas"),
        json!({ "field": "resource", "resource": name }),
    )
}

pub(super) fn unavailable(e: &QuotaStoreError) -> Answer {
    error_answer(
        Kind::Unavailable,
        Outcome::Unavailable,
        &format!("the quota database is unavailable; nothing was changed ({e})"),
        json!({ "transient": true }),
    )
}

/// A JSON whole number up to `max` (JSON Schema's `integer`: `15.0` is one).
/// Every `max` here is below 2^53, where an `f64` is exact.
fn whole(v: &Value, max: u64) -> Option<u64> {
    let n = v.as_u64().or_else(|| {
        let f = v.as_f64()?;
        // In range and without a fraction: the cast is exact.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        (f >= 0.0 && f.fract() == 0.0 && f <= max as f64).then_some(f as u64)
    })?;
    (n <= max).then_some(n)
}

fn is_visible_id(s: &str) -> bool {
    (1..=crate::quota::MAX_ID_LEN).contains(&s.len())
        && s.bytes().all(|b| (0x21..0x7f).contains(&b) && b != b'/')
}

impl QuotaApi {
    pub fn new(
        store: Arc<dyn QuotaStore>,
        clock: Arc<dyn Clock>,
        clients: Option<QuotaClients>,
        region: Option<String>,
    ) -> QuotaApi {
        QuotaApi {
            store,
            clock,
            quotas: RwLock::new(Arc::new(Quotas::default())),
            clients,
            region,
            metrics: QuotaMetrics::default(),
            last_known: Mutex::new(HashMap::new()),
            reclaim_every: std::time::Duration::from_secs(1),
            in_flight: Arc::new(tokio::sync::Semaphore::new(DEFAULT_MAX_IN_FLIGHT)),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            borrowing: None,
        }
    }

    /// Borrows for resources homed elsewhere while their home does not
    /// answer ([`crate::quota::borrow`]).
    pub fn with_borrowing(mut self, b: Borrowing) -> QuotaApi {
        self.borrowing = Some(Arc::new(b));
        self
    }

    pub fn borrowing(&self) -> Option<&Arc<Borrowing>> {
        self.borrowing.as_ref()
    }

    pub fn region(&self) -> Option<&str> {
        self.region.as_deref()
    }

    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// The `quotas:` in force.
    pub fn quotas_now(&self) -> Arc<Quotas> {
        self.quotas()
    }

    /// At most `n` reservation requests in progress at once; beyond that,
    /// `503 busy` at once with nothing changed. The service passes its
    /// `--max-in-flight`, counted apart from `/v1/sync`'s, so neither API
    /// can starve the other.
    pub fn with_max_in_flight(mut self, n: usize) -> QuotaApi {
        let n = n.max(1);
        self.in_flight = Arc::new(tokio::sync::Semaphore::new(n));
        self.max_in_flight = n;
        self
    }

    pub fn store(&self) -> &Arc<dyn QuotaStore> {
        &self.store
    }

    /// Puts a reloaded policy's `quotas:` in force (see the policy's
    /// hot-reload rule: lower limits refuse new reservations only).
    pub fn set_quotas(&self, q: Quotas) {
        let q = Arc::new(q);
        match self.quotas.write() {
            Ok(mut g) => *g = q,
            Err(e) => *e.into_inner() = q,
        }
    }

    fn quotas(&self) -> Arc<Quotas> {
        self.quotas
            .read()
            .map(|q| q.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    /// Who the caller is and the tenants it may act for; `401` for a
    /// caller `--quota-clients` does not know.
    pub(super) fn caller(&self, headers: &HeaderMap, peer: &Peer) -> Result<Grant, Answer> {
        self.grant(headers, peer).ok_or_else(|| {
            error_answer(
                Kind::Unauthenticated,
                Outcome::Invalid,
                "no known bearer token or identity",
                json!({}),
            )
        })
    }

    fn grant(&self, headers: &HeaderMap, peer: &Peer) -> Option<Grant> {
        let Some(clients) = &self.clients else {
            return Some(Grant::All);
        };
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let found =
            clients
                .clients
                .iter()
                .find(|c| match (token, &c.token, &peer.identity, &c.identity) {
                    (Some(t), Some(ct), _, _) => t == ct,
                    (None, _, Some(id), Some(ci)) => &id.node_id == ci,
                    _ => false,
                })?;
        Some(Grant::Tenants(found.tenants.clone()))
    }

    /// `403` unless the caller may act for `tenant`.
    fn authorize(grant: &Grant, tenant: &str) -> Result<(), Answer> {
        if grant.allows(tenant) {
            return Ok(());
        }
        Err(error_answer(
            Kind::Forbidden,
            Outcome::Invalid,
            &format!("this caller may not act for tenant {tenant}"),
            json!({ "field": "tenant" }),
        ))
    }

    fn resource(&self, name: &str) -> Result<Resource, Answer> {
        self.quotas()
            .resources
            .get(name)
            .cloned()
            .ok_or_else(|| unknown_resource(name))
    }

    fn home_check(&self, r: &Resource) -> Result<(), Answer> {
        match (&r.home_region, &self.region) {
            (Some(home), mine) if mine.as_ref() != Some(home) => Err(error_answer(
                Kind::Conflict,
                Outcome::WrongRegion,
                &format!(
                    "{} is served only in its home region {home} (this replica: {})",
                    r.name,
                    mine.as_deref().unwrap_or("none")
                ),
                json!({ "home_region": home }),
            )),
            _ => Ok(()),
        }
    }

    async fn timed<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, QuotaStoreError>>,
    ) -> Result<T, QuotaStoreError> {
        let started = Instant::now();
        let r = f.await;
        self.metrics.db(started.elapsed());
        if r.is_err() {
            self.metrics
                .db_errors
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        r
    }

    fn parse_reserve(&self, body: &[u8]) -> Result<(ReserveRequest, Resource), Answer> {
        let v: Value =
            serde_json::from_slice(body).map_err(|e| invalid("(body)", &format!("invalid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| invalid("(body)", "expected a JSON object"))?;
        for k in obj.keys() {
            if !["reservation_id", "resource", "tenant", "project", "amount", "ttl"].contains(&k.as_str()) {
                return Err(invalid(k, "unknown field"));
            }
        }
        let text = |f: &str| -> Result<String, Answer> {
            obj.get(f)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| invalid(f, "required, a string"))
        };
        let id = text("reservation_id")?;
        if !is_visible_id(&id) {
            return Err(invalid(
                "reservation_id",
                "1 to 128 visible ASCII characters, no `/`",
            ));
        }
        let resource_name = text("resource")?;
        let tenant = text("tenant")?;
        if tenantgate::policy::tenant_id(tenant.as_bytes()).is_none() {
            return Err(invalid(
                "tenant",
                "1 to 128 bytes with no whitespace or control characters",
            ));
        }
        let project = text("project")?;
        if project_id(&project).is_none() {
            return Err(invalid(
                "project",
                "1 to 128 bytes with no whitespace, control characters or `/`",
            ));
        }
        let amount = obj
            .get("amount")
            .and_then(|a| whole(a, MAX_QUOTA_AMOUNT))
            .filter(|a| *a >= 1)
            .ok_or_else(|| {
                invalid(
                    "amount",
                    &format!("required, a whole number from 1 to {MAX_QUOTA_AMOUNT}"),
                )
            })?;
        let ttl = match obj.get("ttl") {
            None => None,
            Some(t) => Some(whole(t, MAX_TTL_MS).filter(|t| *t >= MIN_TTL_MS).ok_or_else(|| {
                invalid("ttl", &format!("milliseconds, from {MIN_TTL_MS} to {MAX_TTL_MS}"))
            })?),
        };
        // Well-formed: from here on a refusal is the policy's, not the
        // schema's.
        let resource = self.resource(&resource_name)?;
        let max_ms = resource.max_ttl_ns / NANOS_PER_MS;
        let ttl_ms = match ttl {
            None => resource.default_ttl_ns / NANOS_PER_MS,
            Some(t) if t <= max_ms => t,
            Some(t) => {
                return Err(error_answer(
                    Kind::Conflict,
                    Outcome::Conflict,
                    &format!(
                        "ttl {t} ms is longer than {}'s max_ttl ({max_ms} ms)",
                        resource.name
                    ),
                    json!({ "field": "ttl", "max_ttl": max_ms }),
                ))
            }
        };
        Ok((
            ReserveRequest {
                reservation_id: id,
                resource: resource.name.clone(),
                tenant,
                project,
                amount,
                ttl_ms,
            },
            resource,
        ))
    }

    pub(super) async fn reserve(&self, headers: &HeaderMap, peer: &Peer, body: &[u8]) -> Answer {
        let grant = match self.caller(headers, peer) {
            Ok(g) => g,
            Err(a) => return a,
        };
        let (req, resource) = match self.parse_reserve(body) {
            Ok(r) => r,
            Err(a) => return a,
        };
        if let Err(a) = Self::authorize(&grant, &req.tenant) {
            return a;
        }
        if let Err(a) = self.home_check(&resource) {
            return self.borrow_reserve(&req, &resource, a).await;
        }
        let limits = resource.limits_for(&req.tenant, &req.project);
        let now = self.clock.now_ns();
        match self.timed(self.store.reserve(&req, limits, now)).await {
            Ok(a) => a,
            Err(e) => unavailable(&e),
        }
    }

    /// A reserve of a resource homed elsewhere: `wrong_region` (as
    /// `refused`) unless it may borrow here and its home does not answer
    /// (a retry of a borrowed id gets its original answer at once).
    async fn borrow_reserve(&self, req: &ReserveRequest, r: &Resource, refused: Answer) -> Answer {
        let (Some(b), Some(mine), Some(home)) = (&self.borrowing, &self.region, &r.home_region) else {
            return refused;
        };
        let Some(ceiling) = r.borrow.get(mine).copied().filter(|_| r.risk == Risk::Low) else {
            return refused;
        };
        let known = matches!(b.account.get(&req.reservation_id).await, Ok(Some(_)));
        if !known && b.home_answers(home, r, &req.tenant, &req.project).await {
            return refused;
        }
        let limits = borrow::capped(r.limits_for(&req.tenant, &req.project), ceiling);
        match self
            .timed(b.account.reserve(req, limits, self.clock.now_ns()))
            .await
        {
            Ok(a) => {
                if a.outcome == Outcome::Reserved {
                    self.metrics
                        .borrowed
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                borrow::marked(a, home, ceiling)
            }
            Err(e) => unavailable(&e),
        }
    }

    /// `POST /v1/quotas/debts` at a home replica: records a borrowing
    /// region's finished reservation ([`crate::quota::borrow`]).
    pub(super) async fn accept_debt(&self, body: &[u8]) -> Answer {
        let d: borrow::Debt = match serde_json::from_slice(body) {
            Ok(d) => d,
            Err(e) => return invalid("(body)", &e.to_string()),
        };
        let r = match self.resource(&d.resource) {
            Ok(r) => r,
            Err(a) => return a,
        };
        if r.home_region.is_none() || r.home_region != self.region || !r.borrow.contains_key(&d.region) {
            return error_answer(
                Kind::Conflict,
                Outcome::WrongRegion,
                &format!("{} is not homed here with a ceiling for {}", r.name, d.region),
                json!({ "field": "region" }),
            );
        }
        match borrow::record_debt(self.store.as_ref(), &r, &d, self.clock.now_ns()).await {
            Ok(a) => {
                if let Some(over) = serde_json::from_str::<Value>(&a.body)
                    .ok()
                    .and_then(|v| v.get("over_limit").and_then(Value::as_u64))
                {
                    self.metrics
                        .borrow_over_limit
                        .fetch_add(over, std::sync::atomic::Ordering::Relaxed);
                }
                a
            }
            Err(e) => unavailable(&e),
        }
    }

    /// Knows the caller, finds the reservation (in the store, else in the
    /// borrowing account) and checks the caller may act for its tenant.
    async fn owned(&self, headers: &HeaderMap, peer: &Peer, id: &str) -> Result<Owned, Answer> {
        let grant = self.caller(headers, peer)?;
        match self.timed(self.store.get(id)).await {
            Err(e) => Err(unavailable(&e)),
            Ok(None) => match self.borrowed(id).await? {
                Some(o) => {
                    Self::authorize(&grant, &o.reservation.tenant)?;
                    Ok(o)
                }
                None => Err(not_found(id)),
            },
            Ok(Some(r)) => {
                Self::authorize(&grant, &r.tenant)?;
                if let Ok(res) = self.resource(&r.resource) {
                    self.home_check(&res)?;
                }
                Ok(Owned {
                    reservation: r,
                    store: self.store.clone(),
                    borrowed: None,
                })
            }
        }
    }

    /// A reservation of the borrowing account, with its home and ceiling.
    async fn borrowed(&self, id: &str) -> Result<Option<Owned>, Answer> {
        let Some(b) = &self.borrowing else {
            return Ok(None);
        };
        let Some(r) = self.timed(b.account.get(id)).await.map_err(|e| unavailable(&e))? else {
            return Ok(None);
        };
        let res = self.resource(&r.resource).ok();
        let home = res
            .as_ref()
            .and_then(|x| x.home_region.clone())
            .unwrap_or_default();
        let ceiling = res
            .as_ref()
            .zip(self.region.as_ref())
            .and_then(|(x, m)| x.borrow.get(m).copied())
            .unwrap_or(0);
        Ok(Some(Owned {
            reservation: r,
            store: b.account.clone(),
            borrowed: Some((home, ceiling)),
        }))
    }

    pub(super) async fn commit(&self, headers: &HeaderMap, peer: &Peer, id: &str, body: &[u8]) -> Answer {
        if let Err(a) = self.caller(headers, peer) {
            return a;
        }
        // No body: all of it. A body is a JSON object (whitespace alone is
        // not JSON: 400, as the document's schema says).
        let amount = if body.is_empty() {
            None
        } else {
            let v: Value = match serde_json::from_slice(body) {
                Ok(v) => v,
                Err(e) => return invalid("(body)", &format!("invalid JSON: {e}")),
            };
            let Some(obj) = v.as_object() else {
                return invalid("(body)", "expected a JSON object");
            };
            if let Some(k) = obj.keys().find(|k| *k != "amount") {
                return invalid(k, "unknown field");
            }
            match obj.get("amount") {
                None => None,
                Some(a) => match whole(a, MAX_QUOTA_AMOUNT) {
                    Some(a) => Some(a),
                    None => {
                        return invalid("amount", &format!("a whole number from 0 to {MAX_QUOTA_AMOUNT}"))
                    }
                },
            }
        };
        let o = match self.owned(headers, peer, id).await {
            Ok(o) => o,
            Err(a) => return a,
        };
        match self.timed(o.store.commit(id, amount, self.clock.now_ns())).await {
            Ok(a) => o.mark(a),
            Err(e) => unavailable(&e),
        }
    }

    pub(super) async fn release(&self, headers: &HeaderMap, peer: &Peer, id: &str) -> Answer {
        let o = match self.owned(headers, peer, id).await {
            Ok(o) => o,
            Err(a) => return a,
        };
        match self.timed(o.store.release(id, self.clock.now_ns())).await {
            Ok(a) => o.mark(a),
            Err(e) => unavailable(&e),
        }
    }

    pub(super) async fn get(&self, headers: &HeaderMap, peer: &Peer, id: &str) -> Answer {
        match self.owned(headers, peer, id).await {
            Ok(o) => Answer {
                kind: Kind::Done,
                body: o.reservation.view().to_string(),
                outcome: Outcome::Replayed,
            },
            Err(a) => a,
        }
    }

    pub(super) async fn query(
        &self,
        headers: &HeaderMap,
        peer: &Peer,
        resource: &str,
        q: &BTreeMap<String, String>,
    ) -> Answer {
        let grant = match self.caller(headers, peer) {
            Ok(g) => g,
            Err(a) => return a,
        };
        for k in q.keys() {
            if k != "tenant" && k != "project" {
                return invalid(k, "unknown parameter");
            }
        }
        let tenant = q.get("tenant").cloned().unwrap_or_default();
        if tenantgate::policy::tenant_id(tenant.as_bytes()).is_none() {
            return invalid(
                "tenant",
                "required: 1 to 128 bytes with no whitespace or control characters",
            );
        }
        let project = q.get("project").cloned().unwrap_or_default();
        if project_id(&project).is_none() {
            return invalid(
                "project",
                "required: 1 to 128 bytes with no whitespace, control characters or `/`",
            );
        }
        let r = match self.resource(resource) {
            Ok(r) => r,
            Err(a) => return a,
        };
        if let Err(a) = Self::authorize(&grant, &tenant) {
            return a;
        }
        let limits = r.limits_for(&tenant, &project);
        let now = self.clock.now_ns();
        let key = (r.name.clone(), tenant.clone(), project.clone());
        match self.timed(self.store.usage(&r.name, &tenant, &project)).await {
            Ok(usage) => {
                let levels = crate::quota::levels_json(&usage, &limits);
                if r.risk == Risk::Low {
                    let mut m = self.last_known.lock().unwrap_or_else(|e| e.into_inner());
                    if m.len() < MAX_LAST_KNOWN || m.contains_key(&key) {
                        m.insert(key, (levels.clone(), now));
                    }
                }
                Answer {
                    kind: Kind::Done,
                    body: query_body(&r, &tenant, &project, levels, now, false),
                    outcome: Outcome::Replayed,
                }
            }
            Err(e) => {
                let last = self
                    .last_known
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&key)
                    .cloned();
                match (r.risk, last) {
                    (Risk::Low, Some((levels, at))) => Answer {
                        kind: Kind::Done,
                        body: query_body(&r, &tenant, &project, levels, at, true),
                        outcome: Outcome::Unavailable,
                    },
                    _ => unavailable(&e),
                }
            }
        }
    }

    /// One reclaimer pass: expires every reservation due now, in batches.
    pub async fn reclaim_once(&self) -> Result<u64, QuotaStoreError> {
        let mut n = 0u64;
        loop {
            let now = self.clock.now_ns();
            let done = self.timed(self.store.reclaim(now, RECLAIM_BATCH)).await?;
            for r in &done {
                self.metrics.reclaim_lag(r.lag_ns);
            }
            n = n.saturating_add(done.len() as u64);
            if done.len() < RECLAIM_BATCH {
                return Ok(n);
            }
        }
    }

    pub async fn reconcile_once(&self) -> Result<crate::quota::Reconciliation, QuotaStoreError> {
        let r = self.timed(self.store.reconcile(self.clock.now_ns())).await?;
        let drift = r.drift_units();
        use std::sync::atomic::Ordering::Relaxed;
        self.metrics.drift_last.store(drift, Relaxed);
        self.metrics.drift_total.fetch_add(drift, Relaxed);
        self.metrics.reconciliations.fetch_add(1, Relaxed);
        if drift > 0 {
            warn!(
                drift,
                counters = r.repaired.len(),
                "quota counters drifted from the ledger; repaired by compensation entries"
            );
        }
        Ok(r)
    }
}

/// A reservation found for a commit, release or get, and where it lives.
struct Owned {
    reservation: crate::quota::Reservation,
    store: Arc<dyn QuotaStore>,
    /// Borrowed: (home region, this region's ceiling).
    borrowed: Option<(String, u64)>,
}

impl Owned {
    /// An answer about a borrowed reservation carries the marker.
    fn mark(&self, a: Answer) -> Answer {
        match &self.borrowed {
            Some((home, ceiling)) => borrow::marked(a, home, *ceiling),
            None => a,
        }
    }
}

fn query_body(
    r: &Resource,
    tenant: &str,
    project: &str,
    levels: Value,
    as_of: u64,
    estimate: bool,
) -> String {
    json!({
        "resource": r.name,
        "unit": r.unit,
        "tenant": tenant,
        "project": project,
        "levels": levels,
        "as_of": crate::quota::rfc3339_ms(as_of),
        "estimate": estimate,
    })
    .to_string()
}

/// Runs the reclaimer every [`QuotaApi::reclaim_every`] until dropped.
pub async fn reclaim_every(api: Arc<QuotaApi>) {
    let mut tick = tokio::time::interval(api.reclaim_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = api.reclaim_once().await {
            warn!(error = %e, "quota reclaimer pass failed; the next one runs as usual");
        }
    }
}

/// The repayer's view of this replica (see [`borrow::Repaying`]).
impl borrow::Repaying for QuotaApi {
    fn borrowing(&self) -> Option<&Arc<Borrowing>> {
        QuotaApi::borrowing(self)
    }

    fn region(&self) -> Option<&str> {
        QuotaApi::region(self)
    }

    fn now_ns(&self) -> u64 {
        QuotaApi::now_ns(self)
    }

    fn quotas_now(&self) -> Arc<Quotas> {
        QuotaApi::quotas_now(self)
    }

    fn metrics(&self) -> &QuotaMetrics {
        &self.metrics
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::listener::{Peer, SyncListener};
    use crate::quota::api::router;
    use crate::quota::sqlite::SqliteStore;
    use std::future::IntoFuture;

    #[tokio::test]
    async fn past_max_in_flight_a_request_is_refused_with_503_busy_and_served_once_a_permit_frees() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn QuotaStore> = Arc::new(SqliteStore::open(dir.path()).await.unwrap());
        let api =
            Arc::new(QuotaApi::new(store, Arc::new(ManualClock::new(1)), None, None).with_max_in_flight(1));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = router(api.clone()).into_make_service_with_connect_info::<Peer>();
        tokio::spawn(axum::serve(SyncListener::plain(listener), app).into_future());

        // The one permit is taken (a request in progress).
        let held = api.in_flight.clone().try_acquire_owned().unwrap();
        let (status, body) = crate::testing::http(addr, "GET", "/v1/reservations/r1", "")
            .await
            .unwrap();
        assert_eq!(status, 503, "{body}");
        assert!(body.contains(r#""error":"busy""#), "{body}");
        drop(held);
        let (status, body) = crate::testing::http(addr, "GET", "/v1/reservations/r1", "")
            .await
            .unwrap();
        assert_eq!(status, 404, "served once a permit is free: {body}");
    }
}
