//! The shared quota store: PostgreSQL (tokio-postgres, a deadpool pool),
//! for several service replicas on one database.
//!
//! Isolation: READ COMMITTED with row locks in a fixed order. Every
//! transaction that changes a reservation first locks its resource's three
//! counter rows (`SELECT … ORDER BY tenant, project FOR UPDATE`: global,
//! tenant, project), then reads the reservation (a fresh statement, so it
//! sees whatever the previous holder of the locks committed), decides with
//! the shared `decide_*` functions and writes. Transactions on one resource
//! are therefore serialized by its global row, and no two hold locks
//! crosswise. A first reserve of a new id can still race another one with
//! other keys on the reservation's primary key; the loser (unique
//! violation), like a detected deadlock or a serialization failure, is
//! rolled back and retried, at most [`MAX_ATTEMPTS`] times.
//! Reconciliation takes `LOCK TABLE counters IN EXCLUSIVE MODE`, so it sees
//! counters and ledger at rest.
//!
//! Reserve, commit and release are applied in batches ([`super::batch`]):
//! one transaction per batch of the operations that arrived while the
//! previous one was written, in five round trips whatever its size:
//! `BEGIN`; the named reservations read (`= ANY`: the counter keys of the
//! commits and releases); in one round trip, the counter rows created if
//! missing, locked (`FOR UPDATE`, in key order, so batches of several
//! replicas never hold them crosswise) and the reservations read again
//! under the locks (three statements pipelined, which the server runs in
//! the order sent); the batch decided in memory, then its new
//! reservations, its changed reservations, its counters and its ledger
//! rows written with one `unnest` statement each (pipelined: one round
//! trip); and one commit (one WAL flush). Every connection plans each
//! execution for its own values ([`PLAN_EACH_EXECUTION`]).
//!
//! Migrations are versioned (`schema_migrations`), applied once under an
//! advisory lock by whichever replica gets there first, on the first
//! operation (so a replica starts while the database is down and answers
//! `quota_unavailable` until it is back).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::Transaction;
use deadpool_postgres::{Config, Hook, HookError, Pool, PoolConfig, Runtime, Timeouts};
use tokio::sync::OnceCell;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{NoTls, Row};

use super::batch::{self, Batcher, Op};
use super::{
    decide_expire, drifts, not_found, replay, Answer, CounterKey, LedgerEntry, LedgerKind, QuotaStore,
    QuotaStoreError, Reclaimed, Reconciliation, Reservation, State, Step, Usage, Write,
};

/// Batches in flight at once per replica (see [`Batcher::start`]).
pub const BATCH_WRITERS: usize = 1;
/// Run on every new connection. The statements are prepared once per
/// connection and run thousands of times; after five runs PostgreSQL may
/// keep a generic plan made while a table was nearly empty: a sequential
/// scan of `reservations` for `id = ANY($1)`, which then read the whole
/// table for every batch (one backend at 87 % CPU for 1,800 pairs/s in
/// `make bench-service`). Each run planned for its own values takes the
/// primary key's index whatever the tables held when it was prepared.
const PLAN_EACH_EXECUTION: &str = "SET plan_cache_mode = force_custom_plan";
/// Attempts of a transaction that lost a race (see the module header).
pub const MAX_ATTEMPTS: u32 = 20;
/// How long opening a connection may take (an unreachable database is
/// known within this).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a request waits for a pooled connection (queueing under load).
pub const POOL_WAIT: Duration = Duration::from_secs(30);

const MIGRATIONS: [&str; 1] = [r#"
CREATE TABLE reservations (
    id TEXT PRIMARY KEY, resource TEXT NOT NULL, tenant TEXT NOT NULL, project TEXT NOT NULL,
    amount BIGINT NOT NULL, ttl_ms BIGINT NOT NULL, state TEXT NOT NULL,
    created_ns BIGINT NOT NULL, expires_ns BIGINT NOT NULL, committed BIGINT NOT NULL,
    finished_ns BIGINT, reserve_body TEXT NOT NULL, commit_body TEXT
);
CREATE INDEX reservations_due ON reservations (expires_ns) WHERE state = 'reserved';
CREATE INDEX reservations_live ON reservations (resource, tenant, project, expires_ns) WHERE state = 'reserved';
CREATE TABLE counters (
    resource TEXT NOT NULL, tenant TEXT NOT NULL, project TEXT NOT NULL,
    reserved BIGINT NOT NULL DEFAULT 0, committed BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (resource, tenant, project)
);
CREATE TABLE ledger (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, at_ns BIGINT NOT NULL, kind TEXT NOT NULL,
    reservation_id TEXT, resource TEXT NOT NULL, tenant TEXT NOT NULL, project TEXT NOT NULL,
    d_reserved BIGINT NOT NULL, d_committed BIGINT NOT NULL, note TEXT
);
CREATE FUNCTION tenantgate_ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'the ledger is append-only'; END $$;
CREATE TRIGGER ledger_no_update_delete BEFORE UPDATE OR DELETE ON ledger
    FOR EACH ROW EXECUTE FUNCTION tenantgate_ledger_append_only();
CREATE TRIGGER ledger_no_truncate BEFORE TRUNCATE ON ledger
    FOR EACH STATEMENT EXECUTE FUNCTION tenantgate_ledger_append_only();
"#];

/// The advisory lock key the migrations run under.
const MIGRATION_LOCK: i64 = 0x7465_6e61_6e74_6761;

pub struct PostgresStore {
    pool: Pool,
    migrated: OnceCell<()>,
    batcher: std::sync::OnceLock<Batcher>,
    max_batch: usize,
}

fn classify(e: tokio_postgres::Error) -> Failure {
    let text = match e.as_db_error() {
        Some(d) => format!("{}: {}", d.code().code(), d.message()),
        None => e.to_string(),
    };
    classify_text(e.code(), text)
}

fn classify_text(code: Option<&SqlState>, text: String) -> Failure {
    match code {
        Some(c)
            if *c == SqlState::T_R_SERIALIZATION_FAILURE
                || *c == SqlState::T_R_DEADLOCK_DETECTED
                || *c == SqlState::UNIQUE_VIOLATION =>
        {
            Failure::Retry(text)
        }
        Some(c) if c.code().starts_with("08") || c.code().starts_with("57") || c.code().starts_with("53") => {
            Failure::Fatal(QuotaStoreError::Unavailable(text))
        }
        Some(_) => Failure::Fatal(QuotaStoreError::Refused(text)),
        // No SQLSTATE: the connection broke or could not be made.
        None => Failure::Fatal(QuotaStoreError::Unavailable(text)),
    }
}

enum Failure {
    Retry(String),
    Fatal(QuotaStoreError),
}

impl From<tokio_postgres::Error> for Failure {
    fn from(e: tokio_postgres::Error) -> Failure {
        classify(e)
    }
}

fn u(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn i(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

const RESERVATION_COLUMNS: &str = "id, resource, tenant, project, amount, ttl_ms, state, created_ns, \
     expires_ns, committed, finished_ns, reserve_body, commit_body";

fn reservation(row: &Row) -> Result<Reservation, tokio_postgres::Error> {
    let state: String = row.try_get(6)?;
    Ok(Reservation {
        id: row.try_get(0)?,
        resource: row.try_get(1)?,
        tenant: row.try_get(2)?,
        project: row.try_get(3)?,
        amount: u(row.try_get(4)?),
        ttl_ms: u(row.try_get(5)?),
        state: State::parse(&state).unwrap_or(State::Expired),
        created_ns: u(row.try_get(7)?),
        expires_ns: u(row.try_get(8)?),
        committed: u(row.try_get(9)?),
        finished_ns: row.try_get::<_, Option<i64>>(10)?.map(u),
        reserve_body: row.try_get(11)?,
        commit_body: row.try_get(12)?,
    })
}

async fn load(tx: &Transaction<'_>, id: &str) -> Result<Option<Reservation>, Failure> {
    let row = cached_query_opt(
        tx,
        &format!("SELECT {RESERVATION_COLUMNS} FROM reservations WHERE id = $1"),
        &[&id],
    )
    .await?;
    Ok(row.as_ref().map(reservation).transpose()?)
}

/// Creates the three counter rows if `create` (some may be missing), then
/// locks them in order and returns their values.
async fn lock_levels(
    tx: &Transaction<'_>,
    keys: &[CounterKey; 3],
    create: bool,
) -> Result<[Usage; 3], Failure> {
    let [g, t, p] = keys;
    if create {
        cached_execute(
            tx,
            "INSERT INTO counters (resource, tenant, project) VALUES ($1, '', ''), ($1, $2, ''), ($1, $2, $3) \
             ON CONFLICT DO NOTHING",
            &[&g.resource, &t.tenant, &p.project],
        )
        .await?;
    }
    let rows = cached_query(tx,
            "SELECT tenant, project, reserved, committed FROM counters WHERE resource = $1 \
             AND ((tenant = '' AND project = '') OR (tenant = $2 AND project = '') OR (tenant = $2 AND project = $3)) \
             ORDER BY tenant, project FOR UPDATE",
            &[&g.resource, &t.tenant, &p.project],
        )
        .await?;
    levels_of(&g.resource, &rows)
}

/// The three levels' counters from rows of (tenant, project, reserved,
/// committed) of `resource`; a missing row counts zero.
/// A counter row read as `resource, tenant, project, reserved, committed`.
fn counter_row(row: &Row) -> Result<(CounterKey, Usage), Failure> {
    Ok((
        CounterKey {
            resource: row.try_get(0)?,
            tenant: row.try_get(1)?,
            project: row.try_get(2)?,
        },
        Usage {
            reserved: u(row.try_get(3)?),
            committed: u(row.try_get(4)?),
        },
    ))
}

fn levels_of(resource: &str, rows: &[Row]) -> Result<[Usage; 3], Failure> {
    let mut out = [Usage::default(); 3];
    for row in rows {
        let key = CounterKey {
            resource: resource.to_owned(),
            tenant: row.try_get(0)?,
            project: row.try_get(1)?,
        };
        if let Some(slot) = out.get_mut(key.level() as usize) {
            *slot = Usage {
                reserved: u(row.try_get(2)?),
                committed: u(row.try_get(3)?),
            };
        }
    }
    Ok(out)
}

async fn cached_query(
    tx: &Transaction<'_>,
    sql: &str,
    p: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, Failure> {
    let st = tx.prepare_cached(sql).await?;
    Ok(tx.query(&st, p).await?)
}

async fn cached_query_one(
    tx: &Transaction<'_>,
    sql: &str,
    p: &[&(dyn ToSql + Sync)],
) -> Result<Row, Failure> {
    let st = tx.prepare_cached(sql).await?;
    Ok(tx.query_one(&st, p).await?)
}

async fn cached_query_opt(
    tx: &Transaction<'_>,
    sql: &str,
    p: &[&(dyn ToSql + Sync)],
) -> Result<Option<Row>, Failure> {
    let st = tx.prepare_cached(sql).await?;
    Ok(tx.query_opt(&st, p).await?)
}

async fn cached_execute(tx: &Transaction<'_>, sql: &str, p: &[&(dyn ToSql + Sync)]) -> Result<u64, Failure> {
    let st = tx.prepare_cached(sql).await?;
    Ok(tx.execute(&st, p).await?)
}

async fn append(tx: &Transaction<'_>, e: &LedgerEntry) -> Result<(), Failure> {
    cached_execute(tx,
        "INSERT INTO ledger (at_ns, kind, reservation_id, resource, tenant, project, d_reserved, d_committed, note) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        &[
            &i(e.at_ns),
            &e.kind.as_str(),
            &e.reservation_id,
            &e.resource,
            &e.tenant,
            &e.project,
            &e.d_reserved,
            &e.d_committed,
            &e.note,
        ],
    )
    .await?;
    Ok(())
}

async fn apply(tx: &Transaction<'_>, w: &Write, now_ns: u64) -> Result<(), Failure> {
    let r = &w.reservation;
    if w.insert {
        cached_execute(tx,
            &format!(
                "INSERT INTO reservations ({RESERVATION_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"
            ),
            &[
                &r.id,
                &r.resource,
                &r.tenant,
                &r.project,
                &i(r.amount),
                &i(r.ttl_ms),
                &r.state.as_str(),
                &i(r.created_ns),
                &i(r.expires_ns),
                &i(r.committed),
                &r.finished_ns.map(i),
                &r.reserve_body,
                &r.commit_body,
            ],
        )
        .await?;
    } else {
        cached_execute(tx,
            "UPDATE reservations SET state = $2, committed = $3, finished_ns = $4, commit_body = $5 WHERE id = $1",
            &[
                &r.id,
                &r.state.as_str(),
                &i(r.committed),
                &r.finished_ns.map(i),
                &r.commit_body,
            ],
        )
        .await?;
    }
    cached_execute(tx,
        "UPDATE counters SET reserved = reserved + $4, committed = committed + $5 WHERE resource = $1 \
         AND ((tenant = '' AND project = '') OR (tenant = $2 AND project = '') OR (tenant = $2 AND project = $3))",
        &[&r.resource, &r.tenant, &r.project, &w.d_reserved, &w.d_committed],
    )
    .await?;
    append(tx, &w.ledger_entry(now_ns)).await
}

/// The stored reservations of `ids`.
async fn load_many(tx: &Transaction<'_>, ids: &[String]) -> Result<HashMap<String, Reservation>, Failure> {
    let rows = cached_query(tx, &select_many(), &[&ids]).await?;
    by_id(&rows)
}

/// The reservations named in `$1` (a `text[]`).
fn select_many() -> String {
    format!("SELECT {RESERVATION_COLUMNS} FROM reservations WHERE id = ANY($1)")
}

fn by_id(rows: &[Row]) -> Result<HashMap<String, Reservation>, Failure> {
    let mut out = HashMap::with_capacity(rows.len());
    for row in rows {
        let r = reservation(row)?;
        out.insert(r.id.clone(), r);
    }
    Ok(out)
}

/// One batch (see the module header): its answers, in order.
async fn write_batch(tx: &Transaction<'_>, ops: &[Op]) -> Result<Vec<Answer>, Failure> {
    let mut ids: Vec<String> = ops.iter().map(|o| o.id().to_owned()).collect();
    ids.sort();
    ids.dedup();
    let first = load_many(tx, &ids).await?;
    let keys = batch::keys_of(ops, &first);
    let col = |f: fn(&CounterKey) -> &str| keys.iter().map(|k| f(k).to_owned()).collect::<Vec<String>>();
    let (res, ten, proj) = (col(|k| &k.resource), col(|k| &k.tenant), col(|k| &k.project));
    // Three statements in one round trip, run by the server in the order
    // sent (`biased`: each request goes out at its future's first poll, and
    // these are polled in order): the missing counter rows created, every
    // counter row locked in key order (waiting for the previous holder's
    // commit), then the named reservations read in a snapshot taken after
    // the locks: what the previous holders committed.
    let create = tx
        .prepare_cached(
            "INSERT INTO counters (resource, tenant, project) \
             SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) ON CONFLICT DO NOTHING",
        )
        .await?;
    let lock = tx
        .prepare_cached(
            "SELECT c.resource, c.tenant, c.project, c.reserved, c.committed FROM counters c \
             JOIN unnest($1::text[], $2::text[], $3::text[]) AS k(resource, tenant, project) \
             ON c.resource = k.resource AND c.tenant = k.tenant AND c.project = k.project \
             ORDER BY c.resource, c.tenant, c.project FOR UPDATE OF c",
        )
        .await?;
    let load = tx.prepare_cached(&select_many()).await?;
    let keys: [&(dyn ToSql + Sync); 3] = [&res, &ten, &proj];
    let named: [&(dyn ToSql + Sync); 1] = [&ids];
    let (created, locked, loaded) = tokio::join!(
        biased;
        tx.execute(&create, &keys),
        tx.query(&lock, &keys),
        tx.query(&load, &named),
    );
    created?;
    let rows = locked?;
    let found = by_id(&loaded?)?;
    let mut counters = BTreeMap::new();
    for row in &rows {
        let (k, c) = counter_row(row)?;
        counters.insert(k, c);
    }
    // A refusal's retry hint needs a query per level that binds: decide
    // once to learn which, fetch them, decide again (the same decisions).
    let mut asked: Vec<CounterKey> = Vec::new();
    let mut decided = batch::decide(ops, found.clone(), counters.clone(), &mut |k| {
        asked.push(k.clone());
        None
    });
    if !asked.is_empty() {
        asked.sort();
        asked.dedup();
        let mut hints = HashMap::new();
        for k in asked {
            let h = earliest_expiry(tx, &k).await?;
            hints.insert(k, h);
        }
        decided = batch::decide(ops, found, counters, &mut |k| hints.get(k).copied().flatten());
    }
    write_decided(tx, &decided).await?;
    Ok(decided.answers)
}

async fn write_decided(tx: &Transaction<'_>, d: &batch::Decided) -> Result<(), Failure> {
    let (new, changed): (Vec<&Reservation>, Vec<&Reservation>) = {
        let mut new = Vec::new();
        let mut changed = Vec::new();
        for (r, insert) in &d.reservations {
            if *insert {
                new.push(r);
            } else {
                changed.push(r);
            }
        }
        (new, changed)
    };
    // Four independent statements, pipelined on the connection: one round
    // trip's wait instead of four.
    let (a, b, c, e) = tokio::join!(
        write_new(tx, &new),
        write_changed(tx, &changed),
        write_counters(tx, &d.counters),
        write_ledger(tx, &d.ledger)
    );
    a?;
    b?;
    c?;
    e
}

async fn write_new(tx: &Transaction<'_>, new: &[&Reservation]) -> Result<(), Failure> {
    if !new.is_empty() {
        let text = |f: fn(&Reservation) -> &str| new.iter().map(|r| f(r).to_owned()).collect::<Vec<String>>();
        let int = |f: fn(&Reservation) -> u64| new.iter().map(|r| i(f(r))).collect::<Vec<i64>>();
        let finished: Vec<Option<i64>> = new.iter().map(|r| r.finished_ns.map(i)).collect();
        let commit_body: Vec<Option<String>> = new.iter().map(|r| r.commit_body.clone()).collect();
        let state: Vec<String> = new.iter().map(|r| r.state.as_str().to_owned()).collect();
        // A plain INSERT: an id another replica inserted meanwhile is a
        // unique violation, and the batch is retried (never overwritten).
        cached_execute(
            tx,
            &format!(
                "INSERT INTO reservations ({RESERVATION_COLUMNS}) SELECT * FROM unnest($1::text[], $2::text[], \
                 $3::text[], $4::text[], $5::int8[], $6::int8[], $7::text[], $8::int8[], $9::int8[], $10::int8[], \
                 $11::int8[], $12::text[], $13::text[])"
            ),
            &[
                &text(|r| &r.id),
                &text(|r| &r.resource),
                &text(|r| &r.tenant),
                &text(|r| &r.project),
                &int(|r| r.amount),
                &int(|r| r.ttl_ms),
                &state,
                &int(|r| r.created_ns),
                &int(|r| r.expires_ns),
                &int(|r| r.committed),
                &finished,
                &text(|r| &r.reserve_body),
                &commit_body,
            ],
        )
        .await?;
    }
    Ok(())
}

async fn write_changed(tx: &Transaction<'_>, changed: &[&Reservation]) -> Result<(), Failure> {
    if !changed.is_empty() {
        let id: Vec<String> = changed.iter().map(|r| r.id.clone()).collect();
        let state: Vec<String> = changed.iter().map(|r| r.state.as_str().to_owned()).collect();
        let committed: Vec<i64> = changed.iter().map(|r| i(r.committed)).collect();
        let finished: Vec<Option<i64>> = changed.iter().map(|r| r.finished_ns.map(i)).collect();
        let commit_body: Vec<Option<String>> = changed.iter().map(|r| r.commit_body.clone()).collect();
        cached_execute(
            tx,
            "UPDATE reservations r SET state = v.state, committed = v.committed, finished_ns = v.finished_ns, \
             commit_body = v.commit_body FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::text[]) \
             AS v(id, state, committed, finished_ns, commit_body) WHERE r.id = v.id",
            &[&id, &state, &committed, &finished, &commit_body],
        )
        .await?;
    }
    Ok(())
}

async fn write_counters(tx: &Transaction<'_>, counters: &[(CounterKey, Usage)]) -> Result<(), Failure> {
    if !counters.is_empty() {
        let col = |f: fn(&CounterKey) -> &str| {
            counters
                .iter()
                .map(|(k, _)| f(k).to_owned())
                .collect::<Vec<String>>()
        };
        let reserved: Vec<i64> = counters.iter().map(|(_, c)| i(c.reserved)).collect();
        let committed: Vec<i64> = counters.iter().map(|(_, c)| i(c.committed)).collect();
        cached_execute(
            tx,
            "UPDATE counters c SET reserved = v.reserved, committed = v.committed \
             FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::int8[]) \
             AS v(resource, tenant, project, reserved, committed) \
             WHERE c.resource = v.resource AND c.tenant = v.tenant AND c.project = v.project",
            &[
                &col(|k| &k.resource),
                &col(|k| &k.tenant),
                &col(|k| &k.project),
                &reserved,
                &committed,
            ],
        )
        .await?;
    }
    Ok(())
}

async fn write_ledger(tx: &Transaction<'_>, l: &[LedgerEntry]) -> Result<(), Failure> {
    if !l.is_empty() {
        let at: Vec<i64> = l.iter().map(|e| i(e.at_ns)).collect();
        let kind: Vec<String> = l.iter().map(|e| e.kind.as_str().to_owned()).collect();
        let rid: Vec<Option<String>> = l.iter().map(|e| e.reservation_id.clone()).collect();
        let text = |f: fn(&LedgerEntry) -> &str| l.iter().map(|e| f(e).to_owned()).collect::<Vec<String>>();
        let dr: Vec<i64> = l.iter().map(|e| e.d_reserved).collect();
        let dc: Vec<i64> = l.iter().map(|e| e.d_committed).collect();
        let note: Vec<Option<String>> = l.iter().map(|e| e.note.clone()).collect();
        // In the batch's order: the identity follows the ordinality.
        cached_execute(
            tx,
            "INSERT INTO ledger (at_ns, kind, reservation_id, resource, tenant, project, d_reserved, d_committed, note) \
             SELECT at_ns, kind, reservation_id, resource, tenant, project, d_reserved, d_committed, note \
             FROM unnest($1::int8[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::int8[], \
             $8::int8[], $9::text[]) WITH ORDINALITY \
             AS v(at_ns, kind, reservation_id, resource, tenant, project, d_reserved, d_committed, note, n) ORDER BY n",
            &[
                &at,
                &kind,
                &rid,
                &text(|e| &e.resource),
                &text(|e| &e.tenant),
                &text(|e| &e.project),
                &dr,
                &dc,
                &note,
            ],
        )
        .await?;
    }
    Ok(())
}

async fn earliest_expiry(tx: &Transaction<'_>, key: &CounterKey) -> Result<Option<u64>, Failure> {
    let base = "SELECT MIN(expires_ns) FROM reservations WHERE state = 'reserved' AND resource = $1";
    let row = match key.level() {
        super::Level::Global => cached_query_one(tx, base, &[&key.resource]).await?,
        super::Level::Tenant => {
            cached_query_one(
                tx,
                &format!("{base} AND tenant = $2"),
                &[&key.resource, &key.tenant],
            )
            .await?
        }
        super::Level::Project => {
            cached_query_one(
                tx,
                &format!("{base} AND tenant = $2 AND project = $3"),
                &[&key.resource, &key.tenant, &key.project],
            )
            .await?
        }
    };
    Ok(row.try_get::<_, Option<i64>>(0)?.map(u))
}

async fn read_ledger(tx: &Transaction<'_>) -> Result<Vec<LedgerEntry>, Failure> {
    let rows = cached_query(
        tx,
        "SELECT seq, at_ns, kind, reservation_id, resource, tenant, project, d_reserved, d_committed, note \
             FROM ledger ORDER BY seq",
        &[],
    )
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let kind: String = r.try_get(2)?;
        out.push(LedgerEntry {
            seq: r.try_get(0)?,
            at_ns: u(r.try_get(1)?),
            kind: LedgerKind::parse(&kind).unwrap_or(LedgerKind::Compensation),
            reservation_id: r.try_get(3)?,
            resource: r.try_get(4)?,
            tenant: r.try_get(5)?,
            project: r.try_get(6)?,
            d_reserved: r.try_get(7)?,
            d_committed: r.try_get(8)?,
            note: r.try_get(9)?,
        });
    }
    Ok(out)
}

async fn read_counters(tx: &Transaction<'_>) -> Result<BTreeMap<CounterKey, Usage>, Failure> {
    let rows = cached_query(
        tx,
        "SELECT resource, tenant, project, reserved, committed FROM counters",
        &[],
    )
    .await?;
    let mut out = BTreeMap::new();
    for r in &rows {
        let (k, c) = counter_row(r)?;
        out.insert(k, c);
    }
    Ok(out)
}

/// A transaction body: borrows the transaction, returns a boxed future.
type Body<'a, T> = Box<
    dyn for<'t> Fn(&'t Transaction<'t>) -> futures_box::BoxFuture<'t, Result<T, Failure>> + Send + Sync + 'a,
>;

mod futures_box {
    pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
}

impl PostgresStore {
    /// A pool of up to `pool_size` connections to `url` (a `postgres://`
    /// URL or a `host=… port=…` string). Connects lazily.
    pub async fn connect(url: &str, pool_size: usize) -> Result<PostgresStore, QuotaStoreError> {
        let mut cfg = Config::new();
        cfg.url = Some(url.to_owned());
        let mut pool = PoolConfig::new(pool_size.max(1));
        pool.timeouts = Timeouts {
            wait: Some(POOL_WAIT),
            create: Some(CONNECT_TIMEOUT),
            recycle: Some(CONNECT_TIMEOUT),
        };
        cfg.pool = Some(pool);
        let pool = cfg
            .builder(NoTls)
            .map_err(|e| QuotaStoreError::Refused(e.to_string()))?
            .runtime(Runtime::Tokio1)
            .post_create(Hook::async_fn(|client, _| {
                Box::pin(async move {
                    client
                        .batch_execute(PLAN_EACH_EXECUTION)
                        .await
                        .map_err(HookError::Backend)
                })
            }))
            .build()
            .map_err(|e| QuotaStoreError::Refused(e.to_string()))?;
        Ok(PostgresStore {
            pool,
            migrated: OnceCell::new(),
            batcher: std::sync::OnceLock::new(),
            max_batch: batch::MAX_BATCH,
        })
    }

    async fn migrate(&self) -> Result<(), QuotaStoreError> {
        self.migrated
            .get_or_try_init(|| async {
                let body: Body<'_, ()> = Box::new(|tx| {
                    Box::pin(async move {
                        cached_execute(tx, "SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK]).await?;
                        tx.batch_execute(
                            "CREATE TABLE IF NOT EXISTS schema_migrations (version INT PRIMARY KEY, applied_ns BIGINT NOT NULL)",
                        )
                        .await?;
                        let row = cached_query_one(tx, "SELECT COALESCE(MAX(version), 0) FROM schema_migrations", &[])
                            .await?;
                        let applied: i32 = row.try_get(0)?;
                        for (n, m) in MIGRATIONS.iter().enumerate().skip(usize::try_from(applied).unwrap_or(0)) {
                            tx.batch_execute(m).await?;
                            let version = i32::try_from(n + 1).unwrap_or(i32::MAX);
                            cached_execute(tx,
                                "INSERT INTO schema_migrations (version, applied_ns) VALUES ($1, 0)",
                                &[&version],
                            )
                            .await?;
                        }
                        Ok(())
                    })
                });
                self.run_unmigrated(body).await
            })
            .await
            .map(|_| ())
    }

    /// Runs `body` in a transaction, retried on a lost race.
    async fn run<T>(&self, body: Body<'_, T>) -> Result<T, QuotaStoreError> {
        self.migrate().await?;
        self.run_unmigrated(body).await
    }

    async fn run_unmigrated<T>(&self, body: Body<'_, T>) -> Result<T, QuotaStoreError> {
        run_on(&self.pool, body).await
    }

    /// At most `n` operations per transaction (1: one transaction per
    /// operation, the path before batching; `make bench-service` compares
    /// them). Before the first operation only.
    pub fn with_max_batch(mut self, n: usize) -> PostgresStore {
        self.max_batch = n;
        self
    }

    /// Queues `op` for the next batch (the writer starts on first use).
    async fn batched(&self, op: Op) -> Result<Answer, QuotaStoreError> {
        self.migrate().await?;
        let batcher = self.batcher.get_or_init(|| {
            let pool = self.pool.clone();
            Batcher::start(self.max_batch, BATCH_WRITERS, move |ops: Vec<Op>| {
                let pool = pool.clone();
                let ops = Arc::new(ops);
                async move {
                    let body: Body<'_, Vec<Answer>> = Box::new(move |tx| {
                        let ops = ops.clone();
                        Box::pin(async move { write_batch(tx, &ops).await })
                    });
                    run_on(&pool, body).await
                }
            })
        });
        batcher.submit(op).await
    }
}

/// Runs `body` in a transaction on a connection of `pool`, retried on a
/// lost race.
async fn run_on<T>(pool: &Pool, body: Body<'_, T>) -> Result<T, QuotaStoreError> {
    {
        let mut last = String::new();
        for _ in 0..MAX_ATTEMPTS {
            let mut client = pool
                .get()
                .await
                .map_err(|e| QuotaStoreError::Unavailable(e.to_string()))?;
            let tx = match client.transaction().await {
                Ok(tx) => tx,
                Err(e) => match classify(e) {
                    Failure::Retry(m) => {
                        last = m;
                        continue;
                    }
                    Failure::Fatal(e) => return Err(e),
                },
            };
            let result = match body(&tx).await {
                Ok(v) => tx.commit().await.map(|()| v).map_err(classify),
                Err(f) => {
                    let _ = tx.rollback().await;
                    Err(f)
                }
            };
            match result {
                Ok(v) => return Ok(v),
                Err(Failure::Retry(m)) => last = m,
                Err(Failure::Fatal(e)) => return Err(e),
            }
        }
        Err(QuotaStoreError::Unavailable(format!(
            "{MAX_ATTEMPTS} attempts lost a race in a row: {last}"
        )))
    }
}

impl PostgresStore {
    /// Runs raw SQL outside the service's logic (tests inject drift with it).
    pub async fn execute_raw(&self, sql: &str) -> Result<(), QuotaStoreError> {
        let sql = sql.to_owned();
        let body: Body<'_, ()> = Box::new(move |tx| {
            let sql = sql.clone();
            Box::pin(async move { Ok(tx.batch_execute(&sql).await?) })
        });
        self.run(body).await
    }

    /// One transition of an existing reservation under its counters' locks.
    async fn transition(
        &self,
        id: &str,
        now_ns: u64,
        decide: impl Fn(&Reservation) -> Step + Send + Sync + Copy + 'static,
    ) -> Result<Answer, QuotaStoreError> {
        let id = id.to_owned();
        let body: Body<'_, Answer> = Box::new(move |tx| {
            let id = id.clone();
            Box::pin(async move {
                let Some(first) = load(tx, &id).await? else {
                    return Ok(not_found(&id));
                };
                // A reservation's counter rows exist (its reserve made them).
                lock_levels(tx, &first.keys(), false).await?;
                let Some(r) = load(tx, &id).await? else {
                    return Ok(not_found(&id));
                };
                let step = decide(&r);
                if let Some(w) = &step.write {
                    apply(tx, w, now_ns).await?;
                }
                Ok(step.answer)
            })
        });
        self.run(body).await
    }
}

#[async_trait]
impl QuotaStore for PostgresStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    async fn ping(&self) -> Result<(), QuotaStoreError> {
        let body: Body<'_, ()> = Box::new(|tx| {
            Box::pin(async move {
                cached_query_one(tx, "SELECT 1", &[]).await?;
                Ok(())
            })
        });
        self.run(body).await
    }

    async fn apply(&self, op: Op) -> Result<Answer, QuotaStoreError> {
        self.batched(op).await
    }

    async fn get(&self, id: &str) -> Result<Option<Reservation>, QuotaStoreError> {
        let id = id.to_owned();
        let body: Body<'_, Option<Reservation>> = Box::new(move |tx| {
            let id = id.clone();
            Box::pin(async move { load(tx, &id).await })
        });
        self.run(body).await
    }

    async fn usage(
        &self,
        resource: &str,
        tenant: &str,
        project: &str,
    ) -> Result<[Usage; 3], QuotaStoreError> {
        let keys = CounterKey::levels(resource, tenant, project);
        let body: Body<'_, [Usage; 3]> = Box::new(move |tx| {
            let keys = keys.clone();
            Box::pin(async move {
                let mut out = [Usage::default(); 3];
                for (slot, k) in out.iter_mut().zip(&keys) {
                    if let Some(row) = cached_query_opt(tx,
                            "SELECT reserved, committed FROM counters WHERE resource = $1 AND tenant = $2 AND project = $3",
                            &[&k.resource, &k.tenant, &k.project],
                        )
                        .await?
                    {
                        *slot = Usage {
                            reserved: u(row.try_get(0)?),
                            committed: u(row.try_get(1)?),
                        };
                    }
                }
                Ok(out)
            })
        });
        self.run(body).await
    }

    async fn reclaim(&self, now_ns: u64, max: usize) -> Result<Vec<Reclaimed>, QuotaStoreError> {
        let body: Body<'_, Vec<(String, u64, String)>> = Box::new(move |tx| {
            Box::pin(async move {
                let rows = cached_query(tx,
                        "SELECT id, expires_ns, resource FROM reservations WHERE state = 'reserved' AND expires_ns <= $1 \
                         ORDER BY expires_ns LIMIT $2",
                        &[&i(now_ns), &i(max as u64)],
                    )
                    .await?;
                let mut out = Vec::with_capacity(rows.len());
                for r in rows {
                    out.push((r.try_get(0)?, u(r.try_get(1)?), r.try_get(2)?));
                }
                Ok(out)
            })
        });
        let due = self.run(body).await?;
        let mut out = Vec::with_capacity(due.len());
        for (id, expires_ns, resource) in due {
            // Each in its own transaction under its counters' locks: a
            // commit that got there first wins, and this finds it committed.
            let answer = self
                .transition(&id, now_ns, move |r| match decide_expire(r, now_ns) {
                    Some(w) => Step {
                        answer: Answer {
                            status: 200,
                            body: String::new(),
                            outcome: super::Outcome::Expired,
                        },
                        write: Some(w),
                    },
                    None => Step {
                        answer: Answer {
                            status: 304,
                            body: String::new(),
                            outcome: super::Outcome::Replayed,
                        },
                        write: None,
                    },
                })
                .await?;
            if answer.status == 200 {
                out.push(Reclaimed {
                    id,
                    resource,
                    lag_ns: now_ns.saturating_sub(expires_ns),
                });
            }
        }
        Ok(out)
    }

    async fn reconcile(&self, now_ns: u64) -> Result<Reconciliation, QuotaStoreError> {
        let body: Body<'_, Reconciliation> = Box::new(move |tx| {
            Box::pin(async move {
                tx.batch_execute("LOCK TABLE counters IN EXCLUSIVE MODE").await?;
                let counters = read_counters(tx).await?;
                let ledger = read_ledger(tx).await?;
                let derived = replay(&ledger);
                let repaired = drifts(&counters, &derived);
                for d in &repaired {
                    cached_execute(tx,
                        "INSERT INTO counters (resource, tenant, project, reserved, committed) VALUES ($1, $2, $3, $4, $5) \
                         ON CONFLICT (resource, tenant, project) DO UPDATE SET reserved = $4, committed = $5",
                        &[
                            &d.key.resource,
                            &d.key.tenant,
                            &d.key.project,
                            &i(d.ledger.reserved),
                            &i(d.ledger.committed),
                        ],
                    )
                    .await?;
                    append(tx, &d.compensation(now_ns)).await?;
                }
                Ok(Reconciliation {
                    counters: counters.len() as u64,
                    ledger_entries: ledger.len() as u64,
                    repaired,
                })
            })
        });
        self.run(body).await
    }

    async fn ledger(&self) -> Result<Vec<LedgerEntry>, QuotaStoreError> {
        let body: Body<'_, Vec<LedgerEntry>> = Box::new(|tx| Box::pin(read_ledger(tx)));
        self.run(body).await
    }

    async fn counters(&self) -> Result<BTreeMap<CounterKey, Usage>, QuotaStoreError> {
        let body: Body<'_, BTreeMap<CounterKey, Usage>> = Box::new(|tx| Box::pin(read_counters(tx)));
        self.run(body).await
    }
}
