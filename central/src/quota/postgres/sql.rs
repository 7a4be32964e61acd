//! The PostgreSQL store's SQL: rows read and written inside one
//! transaction (reservations, the three counters of a key, the ledger),
//! and how a database error is classified (retried or fatal). Beneath the
//! batch writer (`batch_write.rs`) and the store (`mod.rs`).

use std::collections::{BTreeMap, HashMap};

use deadpool_postgres::Transaction;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::quota::rows::{self, SELECT_COUNTERS, SELECT_LEDGER};
use crate::quota::{CounterKey, LedgerEntry, QuotaStoreError, Reservation, Usage, Write};

pub(super) fn classify(e: tokio_postgres::Error) -> Failure {
    let text = match e.as_db_error() {
        Some(d) => format!("{}: {}", d.code().code(), d.message()),
        None => e.to_string(),
    };
    classify_text(e.code(), text)
}

pub(super) fn classify_text(code: Option<&SqlState>, text: String) -> Failure {
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

pub(super) enum Failure {
    Retry(String),
    Fatal(QuotaStoreError),
}

impl From<tokio_postgres::Error> for Failure {
    fn from(e: tokio_postgres::Error) -> Failure {
        classify(e)
    }
}

pub(super) use crate::quota::rows::{i, u, RESERVATION_COLUMNS};

pub(super) fn reservation(row: &Row) -> Result<Reservation, tokio_postgres::Error> {
    rows::reservation(row)
}

pub(super) async fn load(tx: &Transaction<'_>, id: &str) -> Result<Option<Reservation>, Failure> {
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
pub(super) async fn lock_levels(
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

/// A counter row read as `resource, tenant, project, reserved, committed`.
pub(super) fn counter_row(row: &Row) -> Result<(CounterKey, Usage), Failure> {
    let c = rows::counter(row)?;
    Ok((c.key, c.usage))
}

/// The three levels' counters from rows of (tenant, project, reserved,
/// committed) of `resource`; a missing row counts zero.
pub(super) fn levels_of(resource: &str, rows: &[Row]) -> Result<[Usage; 3], Failure> {
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

pub(super) async fn cached_query(
    tx: &Transaction<'_>,
    sql: &str,
    p: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, Failure> {
    let st = tx.prepare_cached(sql).await?;
    Ok(tx.query(&st, p).await?)
}

pub(super) async fn cached_query_one(
    tx: &Transaction<'_>,
    sql: &str,
    p: &[&(dyn ToSql + Sync)],
) -> Result<Row, Failure> {
    let st = tx.prepare_cached(sql).await?;
    Ok(tx.query_one(&st, p).await?)
}

pub(super) async fn cached_query_opt(
    tx: &Transaction<'_>,
    sql: &str,
    p: &[&(dyn ToSql + Sync)],
) -> Result<Option<Row>, Failure> {
    let st = tx.prepare_cached(sql).await?;
    Ok(tx.query_opt(&st, p).await?)
}

pub(super) async fn cached_execute(
    tx: &Transaction<'_>,
    sql: &str,
    p: &[&(dyn ToSql + Sync)],
) -> Result<u64, Failure> {
    let st = tx.prepare_cached(sql).await?;
    Ok(tx.execute(&st, p).await?)
}

pub(super) async fn append(tx: &Transaction<'_>, e: &LedgerEntry) -> Result<(), Failure> {
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

pub(super) async fn apply(tx: &Transaction<'_>, w: &Write, now_ns: u64) -> Result<(), Failure> {
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
pub(super) async fn load_many(
    tx: &Transaction<'_>,
    ids: &[String],
) -> Result<HashMap<String, Reservation>, Failure> {
    let rows = cached_query(tx, &select_many(), &[&ids]).await?;
    by_id(&rows)
}

/// The reservations named in `$1` (a `text[]`).
pub(super) fn select_many() -> String {
    format!("SELECT {RESERVATION_COLUMNS} FROM reservations WHERE id = ANY($1)")
}

pub(super) fn by_id(rows: &[Row]) -> Result<HashMap<String, Reservation>, Failure> {
    let mut out = HashMap::with_capacity(rows.len());
    for row in rows {
        let r = reservation(row)?;
        out.insert(r.id.clone(), r);
    }
    Ok(out)
}

pub(super) async fn earliest_expiry(tx: &Transaction<'_>, key: &CounterKey) -> Result<Option<u64>, Failure> {
    let base = "SELECT MIN(expires_ns) FROM reservations WHERE state = 'reserved' AND resource = $1";
    let row = match key.level() {
        crate::quota::Level::Global => cached_query_one(tx, base, &[&key.resource]).await?,
        crate::quota::Level::Tenant => {
            cached_query_one(
                tx,
                &format!("{base} AND tenant = $2"),
                &[&key.resource, &key.tenant],
            )
            .await?
        }
        crate::quota::Level::Project => {
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

pub(super) async fn read_ledger(tx: &Transaction<'_>) -> Result<Vec<LedgerEntry>, Failure> {
    let rows = cached_query(tx, SELECT_LEDGER, &[]).await?;
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        out.push(rows::ledger_entry(r)?);
    }
    Ok(out)
}

pub(super) async fn read_counters(tx: &Transaction<'_>) -> Result<BTreeMap<CounterKey, Usage>, Failure> {
    let rows = cached_query(tx, SELECT_COUNTERS, &[]).await?;
    let mut out = BTreeMap::new();
    for r in &rows {
        let (k, c) = counter_row(r)?;
        out.insert(k, c);
    }
    Ok(out)
}
