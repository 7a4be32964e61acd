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
//! `quota_unavailable` until it is back).//!
//! Files: this one holds the store (its pool, migrations, the retried
//! transaction and the [`QuotaStore`] operations); `sql.rs` the rows read
//! and written inside a transaction and the error classification;
//! `batch_write.rs` one batch's transaction. The schema's tables and how a
//! row becomes a reservation, a ledger entry or a counter are shared with
//! the SQLite store (`super::rows`).

mod batch_write;
mod sql;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::Transaction;
use deadpool_postgres::{Config, Hook, HookError, Pool, PoolConfig, Runtime, Timeouts};
use tokio::sync::OnceCell;
use tokio_postgres::NoTls;

use self::batch_write::write_batch;
use self::sql::*;
use super::batch::{self, Batcher, Op};
use super::rows::tables;
use super::{
    decide_expire, drifts, not_found, replay, Answer, CounterKey, LedgerEntry, QuotaStore, QuotaStoreError,
    Reclaimed, Reconciliation, Reservation, Step, Usage,
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

const MIGRATIONS: [&str; 1] = [concat!(
    tables!("BIGINT", "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY"),
    r#"CREATE FUNCTION tenantgate_ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'the ledger is append-only'; END $$;
CREATE TRIGGER ledger_no_update_delete BEFORE UPDATE OR DELETE ON ledger
    FOR EACH ROW EXECUTE FUNCTION tenantgate_ledger_append_only();
CREATE TRIGGER ledger_no_truncate BEFORE TRUNCATE ON ledger
    FOR EACH STATEMENT EXECUTE FUNCTION tenantgate_ledger_append_only();
"#
)];

/// The advisory lock key the migrations run under.
const MIGRATION_LOCK: i64 = 0x7465_6e61_6e74_6761;

pub struct PostgresStore {
    pool: Pool,
    migrated: OnceCell<()>,
    batcher: std::sync::OnceLock<Batcher>,
    max_batch: usize,
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
                            kind: super::Kind::Done,
                            body: String::new(),
                            outcome: super::Outcome::Expired,
                        },
                        write: Some(w),
                    },
                    None => Step {
                        answer: Answer {
                            kind: super::Kind::Unchanged,
                            body: String::new(),
                            outcome: super::Outcome::Replayed,
                        },
                        write: None,
                    },
                })
                .await?;
            if answer.kind == super::Kind::Done {
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
