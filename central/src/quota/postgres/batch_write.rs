//! The PostgreSQL store's batch writer: one batch of reserve, commit and
//! release (see [`crate::quota::batch`]) read, decided in memory and
//! written in a fixed number of round trips (the store's module header
//! says which).

use std::collections::{BTreeMap, HashMap};

use deadpool_postgres::Transaction;
use tokio_postgres::types::ToSql;

use super::sql::*;
use crate::quota::batch::{self, Op};
use crate::quota::{Answer, CounterKey, LedgerEntry, Reservation, Usage};

/// One batch (see the module header): its answers, in order.
pub(super) async fn write_batch(tx: &Transaction<'_>, ops: &[Op]) -> Result<Vec<Answer>, Failure> {
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

pub(super) async fn write_decided(tx: &Transaction<'_>, d: &batch::Decided) -> Result<(), Failure> {
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

pub(super) async fn write_new(tx: &Transaction<'_>, new: &[&Reservation]) -> Result<(), Failure> {
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

pub(super) async fn write_changed(tx: &Transaction<'_>, changed: &[&Reservation]) -> Result<(), Failure> {
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

pub(super) async fn write_counters(
    tx: &Transaction<'_>,
    counters: &[(CounterKey, Usage)],
) -> Result<(), Failure> {
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

pub(super) async fn write_ledger(tx: &Transaction<'_>, l: &[LedgerEntry]) -> Result<(), Failure> {
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
