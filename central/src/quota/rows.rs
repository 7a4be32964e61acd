//! What the two SQL quota stores share, written once: the schema's three
//! tables (each store's dialect fills in its integer and sequence types),
//! the columns they read, and how a row of either driver becomes a
//! [`Reservation`], a [`LedgerEntry`] or a counter. What differs stays in
//! each store: placeholders (`?1` in SQLite, `$1` in PostgreSQL), the
//! ledger's append-only triggers, how a transaction runs (SQLite's one
//! `IMMEDIATE` writer on the blocking pool, PostgreSQL's row locks and
//! retries) and how a batch is written. Beneath both stores (`sqlite.rs`,
//! `postgres/`).

use super::{CounterKey, LedgerEntry, LedgerKind, Reservation, State, Usage};

/// The schema's tables, indexes and ledger in a dialect: `$int` the type of
/// a 64-bit integer column, `$seq` the ledger's sequence column (its type
/// and key). The stores' first migration; each adds its own triggers.
macro_rules! tables {
    ($int:literal, $seq:literal) => {
        concat!(
            "
CREATE TABLE reservations (
    id TEXT PRIMARY KEY, resource TEXT NOT NULL, tenant TEXT NOT NULL, project TEXT NOT NULL,
    amount ",
            $int,
            " NOT NULL, ttl_ms ",
            $int,
            " NOT NULL, state TEXT NOT NULL,
    created_ns ",
            $int,
            " NOT NULL, expires_ns ",
            $int,
            " NOT NULL, committed ",
            $int,
            " NOT NULL,
    finished_ns ",
            $int,
            ", reserve_body TEXT NOT NULL, commit_body TEXT
);
CREATE INDEX reservations_due ON reservations (expires_ns) WHERE state = 'reserved';
CREATE INDEX reservations_live ON reservations (resource, tenant, project, expires_ns) WHERE state = 'reserved';
CREATE TABLE counters (
    resource TEXT NOT NULL, tenant TEXT NOT NULL, project TEXT NOT NULL,
    reserved ",
            $int,
            " NOT NULL DEFAULT 0, committed ",
            $int,
            " NOT NULL DEFAULT 0,
    PRIMARY KEY (resource, tenant, project)
);
CREATE TABLE ledger (
    seq ",
            $seq,
            ", at_ns ",
            $int,
            " NOT NULL, kind TEXT NOT NULL,
    reservation_id TEXT, resource TEXT NOT NULL, tenant TEXT NOT NULL, project TEXT NOT NULL,
    d_reserved ",
            $int,
            " NOT NULL, d_committed ",
            $int,
            " NOT NULL, note TEXT
);
"
        )
    };
}
pub(super) use tables;

/// The reservations' columns, in [`reservation`]'s order: a macro, so
/// statements built from it are constants.
macro_rules! reservation_columns {
    () => {
        "id, resource, tenant, project, amount, ttl_ms, state, created_ns, \
         expires_ns, committed, finished_ns, reserve_body, commit_body"
    };
}
pub(super) use reservation_columns;

/// The reservations' columns, in [`reservation`]'s order.
pub(super) const RESERVATION_COLUMNS: &str = reservation_columns!();

/// The ledger's columns, in [`ledger_entry`]'s order, oldest first.
pub(super) const SELECT_LEDGER: &str =
    "SELECT seq, at_ns, kind, reservation_id, resource, tenant, project, d_reserved, d_committed, note \
     FROM ledger ORDER BY seq";

/// Every counter, in [`counter`]'s order.
pub(super) const SELECT_COUNTERS: &str =
    "SELECT resource, tenant, project, reserved, committed FROM counters";

/// A stored integer as a count (a negative one, which the stores never
/// write, reads as 0).
pub(super) fn u(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// A count as a stored integer (saturating).
pub(super) fn i(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A row of either driver, read by column index.
pub(super) trait Columns {
    type Error;
    fn int(&self, at: usize) -> Result<i64, Self::Error>;
    fn opt_int(&self, at: usize) -> Result<Option<i64>, Self::Error>;
    fn text(&self, at: usize) -> Result<String, Self::Error>;
    fn opt_text(&self, at: usize) -> Result<Option<String>, Self::Error>;
}

impl Columns for rusqlite::Row<'_> {
    type Error = rusqlite::Error;
    fn int(&self, at: usize) -> rusqlite::Result<i64> {
        self.get(at)
    }
    fn opt_int(&self, at: usize) -> rusqlite::Result<Option<i64>> {
        self.get(at)
    }
    fn text(&self, at: usize) -> rusqlite::Result<String> {
        self.get(at)
    }
    fn opt_text(&self, at: usize) -> rusqlite::Result<Option<String>> {
        self.get(at)
    }
}

impl Columns for tokio_postgres::Row {
    type Error = tokio_postgres::Error;
    fn int(&self, at: usize) -> Result<i64, tokio_postgres::Error> {
        self.try_get(at)
    }
    fn opt_int(&self, at: usize) -> Result<Option<i64>, tokio_postgres::Error> {
        self.try_get(at)
    }
    fn text(&self, at: usize) -> Result<String, tokio_postgres::Error> {
        self.try_get(at)
    }
    fn opt_text(&self, at: usize) -> Result<Option<String>, tokio_postgres::Error> {
        self.try_get(at)
    }
}

/// A reservation read as [`RESERVATION_COLUMNS`] (an unknown state reads
/// as expired).
pub(super) fn reservation<R: Columns + ?Sized>(row: &R) -> Result<Reservation, R::Error> {
    let state = row.text(6)?;
    Ok(Reservation {
        id: row.text(0)?,
        resource: row.text(1)?,
        tenant: row.text(2)?,
        project: row.text(3)?,
        amount: u(row.int(4)?),
        ttl_ms: u(row.int(5)?),
        state: State::parse(&state).unwrap_or(State::Expired),
        created_ns: u(row.int(7)?),
        expires_ns: u(row.int(8)?),
        committed: u(row.int(9)?),
        finished_ns: row.opt_int(10)?.map(u),
        reserve_body: row.text(11)?,
        commit_body: row.opt_text(12)?,
    })
}

/// A ledger entry read as [`SELECT_LEDGER`] (an unknown kind reads as a
/// compensation).
pub(super) fn ledger_entry<R: Columns + ?Sized>(row: &R) -> Result<LedgerEntry, R::Error> {
    let kind = row.text(2)?;
    Ok(LedgerEntry {
        seq: row.int(0)?,
        at_ns: u(row.int(1)?),
        kind: LedgerKind::parse(&kind).unwrap_or(LedgerKind::Compensation),
        reservation_id: row.opt_text(3)?,
        resource: row.text(4)?,
        tenant: row.text(5)?,
        project: row.text(6)?,
        d_reserved: row.int(7)?,
        d_committed: row.int(8)?,
        note: row.opt_text(9)?,
    })
}

/// One counter, its key and its usage, read as [`SELECT_COUNTERS`].
pub(super) struct Counter {
    pub(super) key: CounterKey,
    pub(super) usage: Usage,
}

/// A counter read as [`SELECT_COUNTERS`].
pub(super) fn counter<R: Columns + ?Sized>(row: &R) -> Result<Counter, R::Error> {
    Ok(Counter {
        key: CounterKey {
            resource: row.text(0)?,
            tenant: row.text(1)?,
            project: row.text(2)?,
        },
        usage: Usage {
            reserved: u(row.int(3)?),
            committed: u(row.int(4)?),
        },
    })
}
