//! The embedded quota store: one SQLite file (`quota.sqlite3`) in the
//! configured data directory, rusqlite with its bundled library.
//!
//! WAL journal, `synchronous=FULL`: a transaction that committed survives a
//! crash of the process or the machine. One connection, behind a mutex;
//! every transaction runs on tokio's blocking pool and is one `BEGIN
//! IMMEDIATE` transaction, so transactions are serialized (one writer) and
//! the decision reads what the previous transaction wrote. Reserve, commit
//! and release are applied in batches ([`super::batch`]): the operations
//! that arrived while the previous batch was written are one transaction
//! (one `fsync`). One process owns the file: several replicas need
//! [`super::PostgresStore`]. The schema's tables and how a row becomes a
//! reservation, a ledger entry or a counter are shared with it
//! (`super::rows`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use super::batch::{self, Batcher, Op};
use super::rows::{
    self, i, reservation_columns, tables, u, RESERVATION_COLUMNS, SELECT_COUNTERS, SELECT_LEDGER,
};
use super::{
    decide_expire, drifts, replay, Answer, CounterKey, LedgerEntry, LedgerKind, QuotaStore, QuotaStoreError,
    Reclaimed, Reconciliation, Reservation, State, Usage, Write,
};

/// The file inside the data directory.
pub const FILE_NAME: &str = "quota.sqlite3";

/// Versioned migrations, applied in order at open; `PRAGMA user_version`
/// records the last applied.
const MIGRATIONS: [&str; 2] = [
    concat!(
        tables!("INTEGER", "INTEGER PRIMARY KEY AUTOINCREMENT"),
        r#"CREATE TRIGGER ledger_no_update BEFORE UPDATE ON ledger
    BEGIN SELECT RAISE(ABORT, 'the ledger is append-only'); END;
CREATE TRIGGER ledger_no_delete BEFORE DELETE ON ledger
    BEGIN SELECT RAISE(ABORT, 'the ledger is append-only'); END;
"#
    ),
    r#"
CREATE TABLE repaid (reservation_id TEXT PRIMARY KEY, at_ns INTEGER NOT NULL);
"#,
];

pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    path: PathBuf,
    batcher: std::sync::OnceLock<Batcher>,
    max_batch: usize,
}

fn refused(e: rusqlite::Error) -> QuotaStoreError {
    match &e {
        rusqlite::Error::SqliteFailure(f, _)
            if matches!(
                f.code,
                rusqlite::ErrorCode::DatabaseBusy
                    | rusqlite::ErrorCode::DatabaseLocked
                    | rusqlite::ErrorCode::SystemIoFailure
                    | rusqlite::ErrorCode::DiskFull
                    | rusqlite::ErrorCode::CannotOpen
            ) =>
        {
            QuotaStoreError::Unavailable(e.to_string())
        }
        _ => QuotaStoreError::Refused(e.to_string()),
    }
}

/// Statements a batch runs per operation are constants, prepared once per
/// connection (`prepare_cached`) instead of parsed each time.
const SELECT_RESERVATION: &str = concat!(
    "SELECT ",
    reservation_columns!(),
    " FROM reservations WHERE id = ?1"
);
const INSERT_RESERVATION: &str = concat!(
    "INSERT INTO reservations (",
    reservation_columns!(),
    ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)"
);
const SELECT_COUNTER: &str =
    "SELECT reserved, committed FROM counters WHERE resource = ?1 AND tenant = ?2 AND project = ?3";

fn reservation(row: &rusqlite::Row<'_>) -> rusqlite::Result<Reservation> {
    rows::reservation(row)
}

fn load(tx: &rusqlite::Transaction<'_>, id: &str) -> rusqlite::Result<Option<Reservation>> {
    tx.prepare_cached(SELECT_RESERVATION)?
        .query_row([id], reservation)
        .optional()
}

/// One counter row, if it exists.
fn counter(tx: &rusqlite::Transaction<'_>, k: &CounterKey) -> rusqlite::Result<Option<Usage>> {
    tx.prepare_cached(SELECT_COUNTER)?
        .query_row(params![k.resource, k.tenant, k.project], |r| {
            Ok(Usage {
                reserved: u(r.get::<_, i64>(0)?),
                committed: u(r.get::<_, i64>(1)?),
            })
        })
        .optional()
}

fn usage_of(tx: &rusqlite::Transaction<'_>, keys: &[CounterKey; 3]) -> rusqlite::Result<[Usage; 3]> {
    let mut out = [Usage::default(); 3];
    for (slot, k) in out.iter_mut().zip(keys) {
        if let Some(c) = counter(tx, k)? {
            *slot = c;
        }
    }
    Ok(out)
}

fn append(tx: &rusqlite::Transaction<'_>, e: &LedgerEntry) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "INSERT INTO ledger (at_ns, kind, reservation_id, resource, tenant, project, d_reserved, d_committed, note) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    )?
    .execute(params![
            i(e.at_ns),
            e.kind.as_str(),
            e.reservation_id,
            e.resource,
            e.tenant,
            e.project,
            e.d_reserved,
            e.d_committed,
            e.note
    ])?;
    Ok(())
}

fn write_reservation(tx: &rusqlite::Transaction<'_>, r: &Reservation, insert: bool) -> rusqlite::Result<()> {
    if insert {
        tx.prepare_cached(INSERT_RESERVATION)?.execute(params![
            r.id,
            r.resource,
            r.tenant,
            r.project,
            i(r.amount),
            i(r.ttl_ms),
            r.state.as_str(),
            i(r.created_ns),
            i(r.expires_ns),
            i(r.committed),
            r.finished_ns.map(i),
            r.reserve_body,
            r.commit_body
        ])?;
    } else {
        tx.prepare_cached(
            "UPDATE reservations SET state = ?2, committed = ?3, finished_ns = ?4, commit_body = ?5 WHERE id = ?1",
        )?
        .execute(params![r.id, r.state.as_str(), i(r.committed), r.finished_ns.map(i), r.commit_body])?;
    }
    Ok(())
}

/// One batch of reserve, commit and release (see [`super::batch`]) in
/// this transaction: the rows it names read, decided in memory, written.
fn write_batch(tx: &rusqlite::Transaction<'_>, ops: &[Op]) -> rusqlite::Result<Vec<Answer>> {
    let mut found = std::collections::HashMap::new();
    for op in ops {
        if !found.contains_key(op.id()) {
            if let Some(r) = load(tx, op.id())? {
                found.insert(r.id.clone(), r);
            }
        }
    }
    let mut counters = BTreeMap::new();
    for k in batch::keys_of(ops, &found) {
        if let Some(c) = counter(tx, &k)? {
            counters.insert(k, c);
        }
    }
    let decided = batch::decide(ops, found, counters, &mut |k| earliest_expiry(tx, k));
    for (r, insert) in &decided.reservations {
        write_reservation(tx, r, *insert)?;
    }
    for (k, c) in &decided.counters {
        tx.prepare_cached(
            "INSERT INTO counters (resource, tenant, project, reserved, committed) VALUES (?1, ?2, ?3, ?4, ?5) \
             ON CONFLICT (resource, tenant, project) DO UPDATE SET reserved = ?4, committed = ?5",
        )?
        .execute(params![k.resource, k.tenant, k.project, i(c.reserved), i(c.committed)])?;
    }
    for e in &decided.ledger {
        append(tx, e)?;
    }
    Ok(decided.answers)
}

fn apply(tx: &rusqlite::Transaction<'_>, w: &Write, now_ns: u64) -> rusqlite::Result<()> {
    let r = &w.reservation;
    write_reservation(tx, r, w.insert)?;
    for k in r.keys() {
        tx.execute(
            "INSERT INTO counters (resource, tenant, project, reserved, committed) VALUES (?1, ?2, ?3, ?4, ?5) \
             ON CONFLICT (resource, tenant, project) DO UPDATE SET reserved = reserved + ?4, committed = committed + ?5",
            params![k.resource, k.tenant, k.project, w.d_reserved, w.d_committed],
        )?;
    }
    append(tx, &w.ledger_entry(now_ns))
}

fn earliest_expiry(tx: &rusqlite::Transaction<'_>, key: &CounterKey) -> Option<u64> {
    // One query per level, so that the live-reservations index serves it.
    let base = "SELECT MIN(expires_ns) FROM reservations WHERE state = 'reserved' AND resource = ?1";
    let row = match key.level() {
        super::Level::Global => tx.query_row(base, params![key.resource], |r| r.get::<_, Option<i64>>(0)),
        super::Level::Tenant => tx.query_row(
            &format!("{base} AND tenant = ?2"),
            params![key.resource, key.tenant],
            |r| r.get::<_, Option<i64>>(0),
        ),
        super::Level::Project => tx.query_row(
            &format!("{base} AND tenant = ?2 AND project = ?3"),
            params![key.resource, key.tenant, key.project],
            |r| r.get::<_, Option<i64>>(0),
        ),
    };
    row.ok().flatten().map(u)
}

impl SqliteStore {
    /// Opens (creating) `dir/quota.sqlite3` and applies the migrations.
    pub async fn open(dir: &Path) -> Result<SqliteStore, QuotaStoreError> {
        let dir = dir.to_owned();
        tokio::task::spawn_blocking(move || SqliteStore::open_blocking(&dir))
            .await
            .map_err(|e| QuotaStoreError::Refused(e.to_string()))?
    }

    fn open_blocking(dir: &Path) -> Result<SqliteStore, QuotaStoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| QuotaStoreError::Unavailable(format!("{}: {e}", dir.display())))?;
        let path = dir.join(FILE_NAME);
        let mut conn = Connection::open(&path).map_err(refused)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(refused)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(refused)?;
        conn.pragma_update(None, "synchronous", "FULL").map_err(refused)?;
        let version: i64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .map_err(refused)?;
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(refused)?;
        for (n, m) in MIGRATIONS.iter().enumerate().skip(u(version) as usize) {
            tx.execute_batch(m).map_err(refused)?;
            tx.pragma_update(None, "user_version", (n + 1) as i64)
                .map_err(refused)?;
        }
        tx.commit().map_err(refused)?;
        Ok(SqliteStore {
            conn: Arc::new(Mutex::new(conn)),
            path,
            batcher: std::sync::OnceLock::new(),
            max_batch: batch::MAX_BATCH,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` in one IMMEDIATE transaction on the blocking pool.
    async fn tx<T: Send + 'static>(
        &self,
        f: impl FnOnce(&rusqlite::Transaction<'_>) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, QuotaStoreError> {
        let conn = self.conn.clone();
        tokio::task::spawn_blocking(move || {
            let mut c = conn.lock().unwrap_or_else(|e| e.into_inner());
            let tx = c
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(refused)?;
            let out = f(&tx).map_err(refused)?;
            tx.commit().map_err(refused)?;
            Ok(out)
        })
        .await
        .map_err(|e| QuotaStoreError::Refused(format!("the store's task failed: {e}")))?
    }

    /// At most `n` operations per transaction (1: one transaction per
    /// operation, the path before batching; `make bench-service` compares
    /// them). Before the first operation only.
    pub fn with_max_batch(mut self, n: usize) -> SqliteStore {
        self.max_batch = n;
        self
    }

    /// Queues `op` for the next batch (the writer starts on first use).
    async fn batched(&self, op: Op) -> Result<Answer, QuotaStoreError> {
        let batcher = self.batcher.get_or_init(|| {
            let conn = self.conn.clone();
            Batcher::start(self.max_batch, 1, move |ops: Vec<Op>| {
                let conn = conn.clone();
                async move {
                    tokio::task::spawn_blocking(move || {
                        let mut c = conn.lock().unwrap_or_else(|e| e.into_inner());
                        let tx = c
                            .transaction_with_behavior(TransactionBehavior::Immediate)
                            .map_err(refused)?;
                        let answers = write_batch(&tx, &ops).map_err(refused)?;
                        tx.commit().map_err(refused)?;
                        Ok(answers)
                    })
                    .await
                    .map_err(|e| QuotaStoreError::Refused(format!("the store's task failed: {e}")))?
                }
            })
        });
        batcher.submit(op).await
    }

    /// Up to `max` finished reservations (committed, released, expired)
    /// not yet marked repaid, oldest first: a borrowing account's debts
    /// ([`super::borrow`]). It reads every reservation of the store (no
    /// index, so that a store that never borrows pays nothing on its
    /// writes): linear in what the account ever borrowed.
    pub async fn debts(&self, max: usize) -> Result<Vec<Reservation>, QuotaStoreError> {
        self.tx(move |tx| {
            let mut st = tx.prepare(&format!(
                "SELECT {RESERVATION_COLUMNS} FROM reservations r WHERE state != 'reserved' \
                 AND NOT EXISTS (SELECT 1 FROM repaid p WHERE p.reservation_id = r.id) \
                 ORDER BY finished_ns LIMIT ?1"
            ))?;
            let rows = st.query_map(params![i(max as u64)], reservation)?;
            rows.collect::<rusqlite::Result<_>>()
        })
        .await
    }

    /// Marks a finished reservation repaid (its debt now lives in the
    /// home region), in one transaction: its committed amount but `kept`
    /// leaves the counters through one `repaid` ledger row (`kept`: the
    /// part the home region took above a limit, which stays against the
    /// borrowing ceiling for good). Idempotent: `false` when it was
    /// already repaid, is unknown or still reserved.
    pub async fn mark_repaid(&self, id: &str, kept: u64, now_ns: u64) -> Result<bool, QuotaStoreError> {
        let id = id.to_owned();
        self.tx(move |tx| {
            let Some(r) = load(tx, &id)? else {
                return Ok(false);
            };
            if r.state == State::Reserved {
                return Ok(false);
            }
            let fresh = tx.execute(
                "INSERT INTO repaid (reservation_id, at_ns) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
                params![id, i(now_ns)],
            )? == 1;
            let moved = r.committed.saturating_sub(kept);
            if fresh && moved > 0 {
                let d_committed = -i(moved);
                for k in r.keys() {
                    tx.execute(
                        "UPDATE counters SET committed = committed + ?4 \
                         WHERE resource = ?1 AND tenant = ?2 AND project = ?3",
                        params![k.resource, k.tenant, k.project, d_committed],
                    )?;
                }
                append(
                    tx,
                    &LedgerEntry {
                        seq: 0,
                        at_ns: now_ns,
                        kind: LedgerKind::Repaid,
                        reservation_id: Some(r.id.clone()),
                        resource: r.resource.clone(),
                        tenant: r.tenant.clone(),
                        project: r.project.clone(),
                        d_reserved: 0,
                        d_committed,
                        note: (kept > 0).then(|| format!("{kept} kept: over a limit at home")),
                    },
                )?;
            }
            Ok(fresh)
        })
        .await
    }

    /// Runs raw SQL outside the service's logic (tests inject drift with it).
    pub async fn execute_raw(&self, sql: &str) -> Result<(), QuotaStoreError> {
        let sql = sql.to_owned();
        self.tx(move |tx| tx.execute_batch(&sql)).await
    }
}

#[async_trait]
impl QuotaStore for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn ping(&self) -> Result<(), QuotaStoreError> {
        self.tx(|tx| tx.query_row("SELECT 1", [], |_| Ok(()))).await
    }

    async fn apply(&self, op: Op) -> Result<Answer, QuotaStoreError> {
        self.batched(op).await
    }

    async fn get(&self, id: &str) -> Result<Option<Reservation>, QuotaStoreError> {
        let id = id.to_owned();
        self.tx(move |tx| load(tx, &id)).await
    }

    async fn usage(
        &self,
        resource: &str,
        tenant: &str,
        project: &str,
    ) -> Result<[Usage; 3], QuotaStoreError> {
        let keys = CounterKey::levels(resource, tenant, project);
        self.tx(move |tx| usage_of(tx, &keys)).await
    }

    async fn reclaim(&self, now_ns: u64, max: usize) -> Result<Vec<Reclaimed>, QuotaStoreError> {
        self.tx(move |tx| {
            let due: Vec<Reservation> = {
                let mut st = tx.prepare(&format!(
                    "SELECT {RESERVATION_COLUMNS} FROM reservations WHERE state = 'reserved' AND expires_ns <= ?1 \
                     ORDER BY expires_ns LIMIT ?2"
                ))?;
                let rows = st.query_map(params![i(now_ns), i(max as u64)], reservation)?;
                rows.collect::<rusqlite::Result<_>>()?
            };
            let mut out = Vec::with_capacity(due.len());
            for r in due {
                if let Some(w) = decide_expire(&r, now_ns) {
                    apply(tx, &w, now_ns)?;
                    out.push(Reclaimed {
                        id: r.id.clone(),
                        resource: r.resource.clone(),
                        lag_ns: now_ns.saturating_sub(r.expires_ns),
                    });
                }
            }
            Ok(out)
        })
        .await
    }

    async fn reconcile(&self, now_ns: u64) -> Result<Reconciliation, QuotaStoreError> {
        self.tx(move |tx| {
            let ledger = read_ledger(tx)?;
            let counters = read_counters(tx)?;
            let derived = replay(&ledger);
            let repaired = drifts(&counters, &derived);
            for d in &repaired {
                tx.execute(
                    "INSERT INTO counters (resource, tenant, project, reserved, committed) VALUES (?1, ?2, ?3, ?4, ?5) \
                     ON CONFLICT (resource, tenant, project) DO UPDATE SET reserved = ?4, committed = ?5",
                    params![d.key.resource, d.key.tenant, d.key.project, i(d.ledger.reserved), i(d.ledger.committed)],
                )?;
                append(tx, &d.compensation(now_ns))?;
            }
            Ok(Reconciliation {
                counters: counters.len() as u64,
                ledger_entries: ledger.len() as u64,
                repaired,
            })
        })
        .await
    }

    async fn ledger(&self) -> Result<Vec<LedgerEntry>, QuotaStoreError> {
        self.tx(read_ledger).await
    }

    async fn counters(&self) -> Result<BTreeMap<CounterKey, Usage>, QuotaStoreError> {
        self.tx(read_counters).await
    }
}

fn read_ledger(tx: &rusqlite::Transaction<'_>) -> rusqlite::Result<Vec<LedgerEntry>> {
    let mut st = tx.prepare(SELECT_LEDGER)?;
    let rows = st.query_map([], |r| rows::ledger_entry(r))?;
    rows.collect()
}

fn read_counters(tx: &rusqlite::Transaction<'_>) -> rusqlite::Result<BTreeMap<CounterKey, Usage>> {
    let mut st = tx.prepare(SELECT_COUNTERS)?;
    let rows = st.query_map([], |r| rows::counter(r).map(|c| (c.key, c.usage)))?;
    rows.collect()
}
