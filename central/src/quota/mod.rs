//! Quota reservations: amounts that must never be oversold (concurrent
//! jobs, bytes, GPU hours, seats), reserved before use, committed after
//! success, released on failure, and reclaimed when their holder vanishes.
//!
//! # THE GUARANTEE
//! At every level of a resource (global, tenant, project) and at every
//! instant a transaction commits, `committed + reserved ≤ limit`, where
//! `limit` is the limit in force when the last reservation at that level was
//! made (a reload that lowers a limit below usage refuses new reservations
//! and never cancels existing ones, so usage may then stay above the new
//! limit until it drains). One more exception, bounded: a home region
//! records the repaid debts of regions that borrowed while it did not
//! answer whatever its limits say, at most Σ ceilings in all
//! ([`borrow`]'s THE BOUND).
//!
//! Why it holds: a reservation is one transaction that reads the three
//! levels' counters, checks `committed + reserved + amount ≤ limit` at each
//! (in the fixed order global, tenant, project; a refusal names the first
//! level that binds), and debits all three or none. Concurrent transactions
//! on a resource are serialized by the store (SQLite: one writer,
//! `BEGIN IMMEDIATE`; PostgreSQL: `SELECT … FOR UPDATE` on the three counter
//! rows in that same order, so two transactions never hold them crosswise).
//! Commit, release and expiry only move amounts from `reserved` to
//! `committed` or away, never up.
//!
//! # A reservation's states
//! ```text
//!   reserve ──► reserved ──commit(a ≤ amount)──► committed   (amount − a returns at once)
//!                  │  └────release────────────► released    (amount returns)
//!                  └──now ≥ expires_at─────────► expired     (amount returns; reclaimer or a late commit)
//! ```
//! Every transition is decided in one transaction from the reservation's
//! state as stored, so a commit racing the reclaimer has exactly one
//! winner: whichever transaction runs first; the other finds the new state.
//! Nothing expires before `expires_at` on the service's clock (a commit at
//! or after it answers `409 expired` and performs the expiry itself).
//!
//! # Idempotency
//! `reservation_id` is the idempotency key. A reserve that was granted is
//! stored with its answer: the same id with the same parameters (resource,
//! tenant, project, amount, ttl) gets that answer again, byte for byte,
//! whatever happened since; other parameters get `409 conflict` naming the
//! first differing field in that order. A refused reserve stores nothing
//! (capacity may free up; a retry is judged afresh). A commit is stored
//! with its answer too: the same commit again gets it; a commit of another
//! amount gets `409 conflict` naming `amount`, and so does a commit of more
//! than was reserved. Release is repeatable.
//!
//! # The ledger
//! Every reserve, commit, release, expiry and compensation appends one row
//! (the databases' triggers refuse UPDATE and DELETE on it). The counters
//! are derived: [`replay`] of the ledger's usage rows (all but
//! compensations) reproduces them exactly. [`QuotaStore::reconcile`]
//! re-derives every counter from the ledger and, where one differs (written
//! behind the service's back), corrects it in the same transaction as a
//! `compensation` row that records the level, the correction and the
//! counter's old value. Compensations move counters back to the ledger;
//! they are not usage themselves.
//!
//! Bounds: a reserve reads and writes three counter rows, one reservation
//! row and one ledger row; reconciliation reads the whole ledger (linear in
//! its length); the reclaimer works in batches of [`RECLAIM_BATCH`].

pub mod api;
pub mod batch;
pub mod borrow;
pub mod metrics;
pub mod postgres;
pub mod sqlite;

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde::Serialize;
use serde_json::json;
use tenantgate::policy::quota::LevelLimits;

pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;

/// Reservations the reclaimer expires per transaction batch.
pub const RECLAIM_BATCH: usize = 256;
/// Longest reservation id, resource, tenant and project, in bytes.
pub const MAX_ID_LEN: usize = 128;

mod record;
mod rows;

use self::record::NANOS_PER_MS;
pub use self::record::{
    rfc3339_ms, CounterKey, LedgerEntry, LedgerKind, Level, Reservation, ReserveRequest, State, Usage, Write,
};

/// An answer: what kind it is, its JSON body, and what to count. The
/// reservation API's HTTP edge writes it as a response
/// ([`api::http_status`]: each [`Kind`] has one status).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub kind: Kind,
    pub body: String,
    pub outcome: Outcome,
}

/// What kind of answer a quota operation gives, in the API's own words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A reservation was made (or its making is replayed).
    Created,
    /// Done (committed, released, swept), or read.
    Done,
    /// Nothing to do: already settled (the expiry sweep's answer).
    Unchanged,
    /// Refused: the request is malformed or names something unknown.
    Invalid,
    /// Refused: no credentials, or unknown ones.
    Unauthenticated,
    /// Refused: the caller may not act for this tenant or resource.
    Forbidden,
    /// No such reservation.
    NotFound,
    /// Refused: the reservation's state, another request with its id, its
    /// home region or a quota level is in the way.
    Conflict,
    /// Not decided: the store or the service cannot answer now.
    Unavailable,
}

/// What a request came to (the metrics' `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Reserved,
    Replayed,
    Exceeded(Level),
    Conflict,
    Committed,
    Released,
    Expired,
    AlreadyCommitted,
    NotFound,
    Invalid,
    WrongRegion,
    Unavailable,
    /// More requests in progress than `--max-in-flight`: nothing was done.
    Busy,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Reserved => "reserved",
            Outcome::Replayed => "replayed",
            Outcome::Exceeded(_) => "quota_exceeded",
            Outcome::Conflict => "conflict",
            Outcome::Committed => "committed",
            Outcome::Released => "released",
            Outcome::Expired => "expired",
            Outcome::AlreadyCommitted => "already_committed",
            Outcome::NotFound => "not_found",
            Outcome::Invalid => "invalid",
            Outcome::WrongRegion => "wrong_region",
            Outcome::Unavailable => "quota_unavailable",
            Outcome::Busy => "busy",
        }
    }
}

/// An error answer: `{"error": code, "message": …, more fields}`.
pub fn error_answer(kind: Kind, outcome: Outcome, message: &str, extra: serde_json::Value) -> Answer {
    let mut body = json!({ "error": outcome.as_str(), "message": message });
    if let (Some(b), serde_json::Value::Object(extra)) = (body.as_object_mut(), extra) {
        b.extend(extra);
    }
    Answer {
        kind,
        body: body.to_string(),
        outcome,
    }
}

fn ok_answer(kind: Kind, outcome: Outcome, body: String) -> Answer {
    Answer { kind, body, outcome }
}

/// What a transaction decided: its answer and what to write (nothing for
/// a refusal or a replay).
#[derive(Debug, Clone)]
pub struct Step {
    pub answer: Answer,
    pub write: Option<Write>,
}

impl Step {
    fn answer(answer: Answer) -> Step {
        Step { answer, write: None }
    }
}

fn signed(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The first level at which `amount` does not fit, in checking order.
pub fn binding_level(usage: &[Usage; 3], limits: &LevelLimits, amount: u64) -> Option<Level> {
    let limit = [limits.global, limits.tenant, limits.project];
    Level::ALL
        .into_iter()
        .zip(usage.iter().zip(limit))
        .find(|(_, (u, l))| u.used().saturating_add(amount) > *l)
        .map(|(level, _)| level)
}

pub(crate) fn levels_json(usage: &[Usage; 3], limits: &LevelLimits) -> serde_json::Value {
    let limit = [limits.global, limits.tenant, limits.project];
    let mut m = serde_json::Map::new();
    for (level, (u, l)) in Level::ALL.into_iter().zip(usage.iter().zip(limit)) {
        m.insert(
            level.as_str().to_owned(),
            json!({
                "limit": l,
                "committed": u.committed,
                "reserved": u.reserved,
                "remaining": l.saturating_sub(u.used()),
            }),
        );
    }
    serde_json::Value::Object(m)
}

/// Decides a reserve. `existing`: the stored reservation of that id.
/// `usage`: the three levels as locked. `earliest_expiry`: when the first
/// live reservation at a level expires (asked for the retry hint of a
/// refusal only).
pub fn decide_reserve(
    req: &ReserveRequest,
    existing: Option<&Reservation>,
    usage: &[Usage; 3],
    limits: &LevelLimits,
    now_ns: u64,
    earliest_expiry: &mut dyn FnMut(Level) -> Option<u64>,
) -> Step {
    if let Some(r) = existing {
        let differing = [
            ("resource", r.resource != req.resource),
            ("tenant", r.tenant != req.tenant),
            ("project", r.project != req.project),
            ("amount", r.amount != req.amount),
            ("ttl", r.ttl_ms != req.ttl_ms),
        ]
        .into_iter()
        .find(|(_, d)| *d)
        .map(|(f, _)| f);
        return Step::answer(match differing {
            Some(field) => error_answer(
                Kind::Conflict,
                Outcome::Conflict,
                &format!("reservation {} exists with another {field}", r.id),
                json!({ "field": field }),
            ),
            None => ok_answer(Kind::Created, Outcome::Replayed, r.reserve_body.clone()),
        });
    }
    if let Some(level) = binding_level(usage, limits, req.amount) {
        let i = level as usize;
        let limit = [limits.global, limits.tenant, limits.project][i];
        let used = usage.get(i).map(Usage::used).unwrap_or(0);
        let retry_after_ms = usage
            .get(i)
            .filter(|u| u.reserved > 0)
            .and_then(|_| earliest_expiry(level))
            .map(|at| at.saturating_sub(now_ns).div_ceil(NANOS_PER_MS).max(1));
        return Step::answer(error_answer(
            Kind::Conflict,
            Outcome::Exceeded(level),
            &format!(
                "{} {} more would exceed the {} limit of {}",
                req.amount,
                req.resource,
                level.as_str(),
                limit
            ),
            json!({
                "level": level.as_str(),
                "limit": limit,
                "remaining": limit.saturating_sub(used),
                "retry_after_ms": retry_after_ms,
            }),
        ));
    }
    let expires_ns = now_ns.saturating_add(req.ttl_ms.saturating_mul(NANOS_PER_MS));
    let after = usage.map(|u| Usage {
        reserved: u.reserved.saturating_add(req.amount),
        ..u
    });
    let body = json!({
        "reservation_id": req.reservation_id,
        "state": "reserved",
        "resource": req.resource,
        "tenant": req.tenant,
        "project": req.project,
        "amount": req.amount,
        "expires_at": rfc3339_ms(expires_ns),
        "levels": levels_json(&after, limits),
    })
    .to_string();
    let reservation = Reservation {
        id: req.reservation_id.clone(),
        resource: req.resource.clone(),
        tenant: req.tenant.clone(),
        project: req.project.clone(),
        amount: req.amount,
        ttl_ms: req.ttl_ms,
        state: State::Reserved,
        created_ns: now_ns,
        expires_ns,
        committed: 0,
        finished_ns: None,
        reserve_body: body.clone(),
        commit_body: None,
    };
    Step {
        answer: ok_answer(Kind::Created, Outcome::Reserved, body),
        write: Some(Write {
            reservation,
            insert: true,
            kind: LedgerKind::Reserve,
            d_reserved: signed(req.amount),
            d_committed: 0,
        }),
    }
}

fn expire(r: &Reservation, now_ns: u64) -> Write {
    let mut reservation = r.clone();
    reservation.state = State::Expired;
    reservation.finished_ns = Some(now_ns);
    Write {
        reservation,
        insert: false,
        kind: LedgerKind::Expire,
        d_reserved: -signed(r.amount),
        d_committed: 0,
    }
}

fn state_answer(r: &Reservation, kind: Kind, outcome: Outcome, message: &str) -> Answer {
    error_answer(
        kind,
        outcome,
        message,
        json!({ "reservation_id": r.id, "state": r.state.as_str() }),
    )
}

/// Decides a commit of `amount` (`None`: all of it).
pub fn decide_commit(r: &Reservation, amount: Option<u64>, now_ns: u64) -> Step {
    let amount_ok = |a: u64| a == amount.unwrap_or(r.amount);
    match r.state {
        State::Committed => Step::answer(match &r.commit_body {
            Some(body) if amount_ok(r.committed) => ok_answer(Kind::Done, Outcome::Replayed, body.clone()),
            _ => error_answer(
                Kind::Conflict,
                Outcome::Conflict,
                &format!(
                    "reservation {} was committed with another amount ({})",
                    r.id, r.committed
                ),
                json!({ "field": "amount", "committed": r.committed }),
            ),
        }),
        State::Released => Step::answer(state_answer(
            r,
            Kind::Conflict,
            Outcome::Released,
            "the reservation was released",
        )),
        State::Expired => Step::answer(state_answer(
            r,
            Kind::Conflict,
            Outcome::Expired,
            "the reservation expired",
        )),
        State::Reserved if now_ns >= r.expires_ns => {
            let mut w = expire(r, now_ns);
            w.reservation.state = State::Expired;
            Step {
                answer: state_answer(
                    &w.reservation,
                    Kind::Conflict,
                    Outcome::Expired,
                    "the reservation expired",
                ),
                write: Some(w),
            }
        }
        State::Reserved => {
            let a = amount.unwrap_or(r.amount);
            if a > r.amount {
                // Well-formed, but more than this reservation holds: a
                // conflict with its state, not a malformed request (400 is
                // kept for what the OpenAPI document's schema refuses).
                return Step::answer(error_answer(
                    Kind::Conflict,
                    Outcome::Conflict,
                    &format!("amount {a} is more than the {} reserved", r.amount),
                    json!({ "field": "amount", "reserved": r.amount }),
                ));
            }
            let mut reservation = r.clone();
            reservation.state = State::Committed;
            reservation.committed = a;
            reservation.finished_ns = Some(now_ns);
            let body = json!({
                "reservation_id": r.id,
                "state": "committed",
                "committed": a,
                "returned": r.amount.saturating_sub(a),
            })
            .to_string();
            reservation.commit_body = Some(body.clone());
            Step {
                answer: ok_answer(Kind::Done, Outcome::Committed, body),
                write: Some(Write {
                    reservation,
                    insert: false,
                    kind: LedgerKind::Commit,
                    d_reserved: -signed(r.amount),
                    d_committed: signed(a),
                }),
            }
        }
    }
}

fn released_body(r: &Reservation, released: u64) -> String {
    json!({ "reservation_id": r.id, "state": r.state.as_str(), "released": released }).to_string()
}

/// Decides a release (repeatable).
pub fn decide_release(r: &Reservation, now_ns: u64) -> Step {
    match r.state {
        State::Committed => Step::answer(state_answer(
            r,
            Kind::Conflict,
            Outcome::AlreadyCommitted,
            "the reservation was committed",
        )),
        State::Released | State::Expired => Step::answer(ok_answer(
            Kind::Done,
            Outcome::Released,
            released_body(r, r.amount),
        )),
        State::Reserved => {
            let mut reservation = r.clone();
            reservation.state = State::Released;
            reservation.finished_ns = Some(now_ns);
            let body = released_body(&reservation, r.amount);
            Step {
                answer: ok_answer(Kind::Done, Outcome::Released, body),
                write: Some(Write {
                    reservation,
                    insert: false,
                    kind: LedgerKind::Release,
                    d_reserved: -signed(r.amount),
                    d_committed: 0,
                }),
            }
        }
    }
}

/// Decides the reclaimer's expiry: only a reservation still `reserved` at
/// or past its expiry.
pub fn decide_expire(r: &Reservation, now_ns: u64) -> Option<Write> {
    (r.state == State::Reserved && now_ns >= r.expires_ns).then(|| expire(r, now_ns))
}

pub fn not_found(id: &str) -> Answer {
    error_answer(
        Kind::NotFound,
        Outcome::NotFound,
        &format!("no reservation {id}"),
        json!({ "reservation_id": id }),
    )
}

/// The counters the ledger's usage rows add up to.
pub fn replay(entries: &[LedgerEntry]) -> BTreeMap<CounterKey, Usage> {
    let mut out: BTreeMap<CounterKey, (i128, i128)> = BTreeMap::new();
    for e in entries.iter().filter(|e| e.kind != LedgerKind::Compensation) {
        for k in CounterKey::levels(&e.resource, &e.tenant, &e.project) {
            let c = out.entry(k).or_default();
            c.0 += i128::from(e.d_reserved);
            c.1 += i128::from(e.d_committed);
        }
    }
    out.into_iter()
        .map(|(k, (r, c))| {
            let clamp = |v: i128| u64::try_from(v.max(0)).unwrap_or(u64::MAX);
            (
                k,
                Usage {
                    reserved: clamp(r),
                    committed: clamp(c),
                },
            )
        })
        .collect()
}

/// One reclaimed reservation: how long after its expiry it was reclaimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reclaimed {
    pub id: String,
    pub resource: String,
    pub lag_ns: u64,
}

/// What a reconciliation found and repaired.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Reconciliation {
    pub counters: u64,
    pub ledger_entries: u64,
    /// Counters that differed from the ledger, each repaired by one
    /// compensation row.
    pub repaired: Vec<Drift>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Drift {
    pub key: CounterKey,
    pub level: Level,
    pub counter: Usage,
    pub ledger: Usage,
}

impl Reconciliation {
    /// Σ |counter − ledger| over every repaired counter.
    pub fn drift_units(&self) -> u64 {
        self.repaired
            .iter()
            .map(|d| {
                d.counter
                    .reserved
                    .abs_diff(d.ledger.reserved)
                    .saturating_add(d.counter.committed.abs_diff(d.ledger.committed))
            })
            .fold(0u64, u64::saturating_add)
    }
}

/// A store's failure.
#[derive(Debug, thiserror::Error)]
pub enum QuotaStoreError {
    /// The database cannot be reached or gave up (transient): nothing was
    /// written (a transaction that did not commit wrote nothing).
    #[error("quota database unavailable: {0}")]
    Unavailable(String),
    /// The database refused (a bug or a broken schema).
    #[error("quota database refused: {0}")]
    Refused(String),
}

/// Where reservations live. Each operation is one transaction; the
/// semantics are the `decide_*` functions above, shared by every store.
#[async_trait]
pub trait QuotaStore: Send + Sync {
    fn kind(&self) -> &'static str;
    async fn ping(&self) -> Result<(), QuotaStoreError>;
    /// Decides and writes one reserve, commit or release (every store
    /// batches them: [`batch`]).
    async fn apply(&self, op: batch::Op) -> Result<Answer, QuotaStoreError>;
    async fn reserve(
        &self,
        req: &ReserveRequest,
        limits: LevelLimits,
        now_ns: u64,
    ) -> Result<Answer, QuotaStoreError> {
        self.apply(batch::Op::Reserve {
            req: req.clone(),
            limits,
            now_ns,
        })
        .await
    }
    async fn commit(&self, id: &str, amount: Option<u64>, now_ns: u64) -> Result<Answer, QuotaStoreError> {
        self.apply(batch::Op::Commit {
            id: id.to_owned(),
            amount,
            now_ns,
        })
        .await
    }
    async fn release(&self, id: &str, now_ns: u64) -> Result<Answer, QuotaStoreError> {
        self.apply(batch::Op::Release {
            id: id.to_owned(),
            now_ns,
        })
        .await
    }
    async fn get(&self, id: &str) -> Result<Option<Reservation>, QuotaStoreError>;
    /// The three levels' counters of (resource, tenant, project).
    async fn usage(&self, resource: &str, tenant: &str, project: &str)
        -> Result<[Usage; 3], QuotaStoreError>;
    /// Expires up to `max` reservations due at `now_ns`, each in its own
    /// decision (the state as stored decides).
    async fn reclaim(&self, now_ns: u64, max: usize) -> Result<Vec<Reclaimed>, QuotaStoreError>;
    async fn reconcile(&self, now_ns: u64) -> Result<Reconciliation, QuotaStoreError>;
    /// Every ledger row, in order (tests, audits).
    async fn ledger(&self) -> Result<Vec<LedgerEntry>, QuotaStoreError>;
    /// Every counter.
    async fn counters(&self) -> Result<BTreeMap<CounterKey, Usage>, QuotaStoreError>;
    /// Reserved and committed per resource (gauges).
    async fn totals(&self) -> Result<BTreeMap<String, Usage>, QuotaStoreError> {
        let mut out: BTreeMap<String, Usage> = BTreeMap::new();
        for (k, u) in self.counters().await? {
            if k.level() == Level::Global {
                out.insert(k.resource, u);
            }
        }
        Ok(out)
    }
}

/// Opens the quota store named on the command line: `sqlite:DIR` (a file
/// in that directory) or a `postgres://` / `postgresql://` URL.
pub async fn open(spec: &str) -> Result<Arc<dyn QuotaStore>, String> {
    if let Some(dir) = spec.strip_prefix("sqlite:") {
        return SqliteStore::open(std::path::Path::new(dir))
            .await
            .map(|s| Arc::new(s) as Arc<dyn QuotaStore>)
            .map_err(|e| e.to_string());
    }
    if spec.starts_with("postgres://") || spec.starts_with("postgresql://") || spec.contains("host=") {
        return PostgresStore::connect(spec, 16)
            .await
            .map(|s| Arc::new(s) as Arc<dyn QuotaStore>)
            .map_err(|e| e.to_string());
    }
    Err(format!(
        "--quota-store {spec}: expected sqlite:DIR or a postgres:// URL"
    ))
}

/// The compensation rows and counter values that bring `counters` back to
/// `ledger` (shared by the stores' reconcile).
pub fn drifts(counters: &BTreeMap<CounterKey, Usage>, ledger: &BTreeMap<CounterKey, Usage>) -> Vec<Drift> {
    let mut keys: Vec<&CounterKey> = counters.keys().chain(ledger.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter_map(|k| {
            let c = counters.get(k).copied().unwrap_or_default();
            let l = ledger.get(k).copied().unwrap_or_default();
            (c != l).then(|| Drift {
                key: k.clone(),
                level: k.level(),
                counter: c,
                ledger: l,
            })
        })
        .collect()
}

impl Drift {
    /// The compensation row that repairs it.
    pub fn compensation(&self, now_ns: u64) -> LedgerEntry {
        let d = |to: u64, from: u64| signed(to).saturating_sub(signed(from));
        LedgerEntry {
            seq: 0,
            at_ns: now_ns,
            kind: LedgerKind::Compensation,
            reservation_id: None,
            resource: self.key.resource.clone(),
            tenant: self.key.tenant.clone(),
            project: self.key.project.clone(),
            d_reserved: d(self.ledger.reserved, self.counter.reserved),
            d_committed: d(self.ledger.committed, self.counter.committed),
            note: Some(format!(
                "{} counter was reserved={} committed={}; the ledger says reserved={} committed={}",
                self.level.as_str(),
                self.counter.reserved,
                self.counter.committed,
                self.ledger.reserved,
                self.ledger.committed
            )),
        }
    }
}

#[cfg(test)]
mod tests;
