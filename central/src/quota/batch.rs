//! Reserve, commit and release applied in batches: one durable transaction
//! for every operation that arrived while the previous batch was being
//! written (group commit), each operation still answered on its own.
//!
//! # Why
//! Every operation on a resource updates its global counter row, so one
//! transaction per operation serializes a hot resource on that row, each
//! holding it through its own WAL flush: a few hundred pairs a second
//! whatever the cores. A batch pays one flush (and, on PostgreSQL, a fixed
//! number of round trips) for all of its operations.
//!
//! # THE GUARANTEE, unchanged
//! A batch decides its operations **in arrival order**, each with the same
//! `decide_*` functions as an operation alone, on the state the previous
//! ones in the batch left (reservations and counters held in memory for
//! the batch, read under the store's locks at its start): so every
//! operation's answer, and every `committed + reserved ≤ limit` check, is
//! exactly what running them one transaction each in that order gives. The
//! batch then writes every reservation's final row, every touched
//! counter's final value and one ledger row per change, in one
//! transaction, and only after it commits is any operation answered. So:
//! * a batch that fails wrote nothing, and no operation of it was
//!   answered: a transient failure answers each `503` (the caller's retry
//!   is judged afresh, idempotently); any other failure splits the batch
//!   and runs each operation alone (without double effect: nothing of the
//!   batch was written);
//! * the ledger records every operation's change in order, and replaying
//!   it gives the counters (the tests check it at every checkpoint);
//! * idempotency holds inside a batch too: a second reserve of an id the
//!   batch already reserved finds it in the batch's state.
//!
//! Bounds: at most [`MAX_BATCH`] operations per batch; one batch in flight
//! per store (per replica), so an operation waits at most for the batch
//! being written and its own.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;

use tenantgate::policy::quota::LevelLimits;
use tokio::sync::{mpsc, oneshot};

use super::{
    decide_commit, decide_release, decide_reserve, not_found, Answer, CounterKey, LedgerEntry,
    QuotaStoreError, Reservation, ReserveRequest, Usage, Write,
};

/// Operations in one batch at most.
pub const MAX_BATCH: usize = 256;

/// How many times a batch yields to let operations on their way join it
/// (see [`Batcher::start`]).
const MAX_YIELDS: u32 = 8;

/// One operation and the service's clock when it was asked.
#[derive(Debug, Clone)]
pub enum Op {
    Reserve {
        req: ReserveRequest,
        limits: LevelLimits,
        now_ns: u64,
    },
    Commit {
        id: String,
        amount: Option<u64>,
        now_ns: u64,
    },
    Release {
        id: String,
        now_ns: u64,
    },
}

impl Op {
    pub fn id(&self) -> &str {
        match self {
            Op::Reserve { req, .. } => &req.reservation_id,
            Op::Commit { id, .. } | Op::Release { id, .. } => id,
        }
    }
}

/// What a batch writes, decided in memory.
#[derive(Debug, Default)]
pub struct Decided {
    /// One per operation, in order.
    pub answers: Vec<Answer>,
    /// Every reservation the batch changed, in its final state; `true`:
    /// new (insert).
    pub reservations: Vec<(Reservation, bool)>,
    /// Every counter the batch changed, with its final value.
    pub counters: Vec<(CounterKey, Usage)>,
    /// One row per change, in order.
    pub ledger: Vec<LedgerEntry>,
}

/// The counter keys a batch needs locked: every reserve's three, and the
/// three of every reservation a commit or release names (`found`: the
/// stored ones).
pub fn keys_of(ops: &[Op], found: &HashMap<String, Reservation>) -> Vec<CounterKey> {
    // A set: a batch names a few keys many times.
    let mut keys: BTreeSet<CounterKey> = BTreeSet::new();
    for op in ops {
        match op {
            Op::Reserve { req, .. } => {
                keys.extend(CounterKey::levels(&req.resource, &req.tenant, &req.project));
            }
            Op::Commit { id, .. } | Op::Release { id, .. } => {
                if let Some(r) = found.get(id) {
                    keys.extend(r.keys());
                }
            }
        }
    }
    keys.into_iter().collect()
}

fn add(v: u64, d: i64) -> u64 {
    u64::try_from((i128::from(v) + i128::from(d)).max(0)).unwrap_or(u64::MAX)
}

/// Decides `ops` in order on `reservations` (the stored rows of the ids
/// they name) and `counters` (the locked values of [`keys_of`]; a missing
/// key counts zero). `earliest`: when the first stored live reservation at
/// a counter's level expires (a refusal's retry hint).
pub fn decide(
    ops: &[Op],
    mut reservations: HashMap<String, Reservation>,
    mut counters: BTreeMap<CounterKey, Usage>,
    earliest: &mut dyn FnMut(&CounterKey) -> Option<u64>,
) -> Decided {
    let mut out = Decided::default();
    // id → inserted by this batch; the ids changed, in first-change order.
    let mut changed: Vec<String> = Vec::new();
    let mut inserted: HashMap<String, bool> = HashMap::new();
    let mut touched: BTreeSet<CounterKey> = BTreeSet::new();
    for op in ops {
        let (step, now_ns) = match op {
            Op::Reserve { req, limits, now_ns } => {
                let keys = CounterKey::levels(&req.resource, &req.tenant, &req.project);
                let usage = keys
                    .clone()
                    .map(|k| counters.get(&k).copied().unwrap_or_default());
                let batch_live = &reservations;
                let step = decide_reserve(
                    req,
                    reservations.get(&req.reservation_id),
                    &usage,
                    limits,
                    *now_ns,
                    &mut |level| {
                        let key = &keys[level as usize];
                        // Stored ones, and those this batch reserved.
                        let here = batch_live
                            .values()
                            .filter(|r| r.state == super::State::Reserved && r.keys().contains(key))
                            .map(|r| r.expires_ns)
                            .min();
                        match (earliest(key), here) {
                            (Some(a), Some(b)) => Some(a.min(b)),
                            (a, b) => a.or(b),
                        }
                    },
                );
                (step, *now_ns)
            }
            Op::Commit { id, amount, now_ns } => match reservations.get(id) {
                None => {
                    out.answers.push(not_found(id));
                    continue;
                }
                Some(r) => (decide_commit(r, *amount, *now_ns), *now_ns),
            },
            Op::Release { id, now_ns } => match reservations.get(id) {
                None => {
                    out.answers.push(not_found(id));
                    continue;
                }
                Some(r) => (decide_release(r, *now_ns), *now_ns),
            },
        };
        if let Some(w) = &step.write {
            apply(w, now_ns, &mut counters, &mut touched, &mut out.ledger);
            let id = w.reservation.id.clone();
            if !inserted.contains_key(&id) {
                changed.push(id.clone());
                inserted.insert(id.clone(), w.insert);
            }
            reservations.insert(id, w.reservation.clone());
        }
        out.answers.push(step.answer);
    }
    for id in changed {
        if let Some(r) = reservations.remove(&id) {
            out.reservations
                .push((r, inserted.get(&id).copied().unwrap_or(false)));
        }
    }
    for k in touched {
        let v = counters.get(&k).copied().unwrap_or_default();
        out.counters.push((k, v));
    }
    out
}

fn apply(
    w: &Write,
    now_ns: u64,
    counters: &mut BTreeMap<CounterKey, Usage>,
    touched: &mut BTreeSet<CounterKey>,
    ledger: &mut Vec<LedgerEntry>,
) {
    let r = &w.reservation;
    for k in r.keys() {
        // A batch touches a few keys many times: each is cloned once.
        let c = match counters.get_mut(&k) {
            Some(c) => c,
            None => counters.entry(k.clone()).or_default(),
        };
        c.reserved = add(c.reserved, w.d_reserved);
        c.committed = add(c.committed, w.d_committed);
        touched.insert(k);
    }
    ledger.push(w.ledger_entry(now_ns));
}

struct Pending {
    op: Op,
    reply: oneshot::Sender<Result<Answer, QuotaStoreError>>,
}

/// The next batch: the first operation queued (`None`: the queue closed),
/// and what follows it, at most `max_batch`. The callers the last batch
/// answered are runnable by then, their next operations on the way: the
/// writer yields to let them queue, so one batch takes them instead of the
/// batch after it (without, two half-full batches alternate). No timer: it
/// stops as soon as a yield brings nothing, so an operation alone does not
/// wait.
async fn next_batch(rx: &mut mpsc::UnboundedReceiver<Pending>, max_batch: usize) -> Option<Vec<Pending>> {
    let mut batch = vec![rx.recv().await?];
    let max = max_batch.clamp(1, MAX_BATCH);
    for yields in 0..=MAX_YIELDS {
        let before = batch.len();
        while batch.len() < max {
            match rx.try_recv() {
                Ok(p) => batch.push(p),
                Err(_) => break,
            }
        }
        if batch.len() >= max || (yields > 0 && batch.len() == before) || yields == MAX_YIELDS {
            break;
        }
        tokio::task::yield_now().await;
    }
    Some(batch)
}

/// The queue of one store's operations and the task that writes them in
/// batches (started on first use, in the runtime that first used it; it
/// ends when the store is dropped).
pub struct Batcher {
    queue: mpsc::UnboundedSender<Pending>,
}

impl Batcher {
    /// `write` runs one batch of at most `max_batch` operations (1: one
    /// transaction per operation, as before batching) as one transaction:
    /// its answers, in order, or an error with nothing written.
    ///
    /// `writers` batches may be in flight at once (each takes the
    /// operations queued when it starts): with PostgreSQL, one batch reads
    /// and waits for the counters' locks while the previous one flushes its
    /// commit; the locks make them one serial order all the same.
    pub fn start<F, Fut>(max_batch: usize, writers: usize, write: F) -> Batcher
    where
        F: Fn(Vec<Op>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<Answer>, QuotaStoreError>> + Send + 'static,
    {
        let (queue, rx) = mpsc::unbounded_channel::<Pending>();
        let rx = std::sync::Arc::new(tokio::sync::Mutex::new(rx));
        let write = std::sync::Arc::new(write);
        for _ in 0..writers.max(1) {
            let (rx, write) = (rx.clone(), write.clone());
            tokio::spawn(async move {
                loop {
                    let Some(batch) = next_batch(&mut *rx.lock().await, max_batch).await else {
                        return;
                    };
                    run(&*write, batch).await;
                }
            });
        }
        Batcher { queue }
    }

    /// Queues `op` and waits for its answer (after its batch committed).
    pub async fn submit(&self, op: Op) -> Result<Answer, QuotaStoreError> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Pending { op, reply })
            .map_err(|_| QuotaStoreError::Unavailable("the batch writer stopped".to_owned()))?;
        answer
            .await
            .map_err(|_| QuotaStoreError::Unavailable("the batch writer stopped".to_owned()))?
    }
}

async fn run<F, Fut>(write: &F, batch: Vec<Pending>)
where
    F: Fn(Vec<Op>) -> Fut,
    Fut: Future<Output = Result<Vec<Answer>, QuotaStoreError>>,
{
    let ops: Vec<Op> = batch.iter().map(|p| p.op.clone()).collect();
    let n = ops.len();
    match write(ops).await {
        Ok(answers) if answers.len() == n => {
            for (p, a) in batch.into_iter().zip(answers) {
                let _ = p.reply.send(Ok(a));
            }
        }
        // Transient: nothing was written; each caller may retry.
        Err(QuotaStoreError::Unavailable(m)) => {
            for p in batch {
                let _ = p.reply.send(Err(QuotaStoreError::Unavailable(m.clone())));
            }
        }
        // Anything else (a refusal, a wrong count): nothing was written;
        // each operation alone, so one bad operation fails only itself.
        other => {
            let reason = match other {
                Err(e) => e.to_string(),
                Ok(a) => format!("{} answers for {n} operations", a.len()),
            };
            for p in batch {
                let r = if n == 1 {
                    Err(QuotaStoreError::Refused(reason.clone()))
                } else {
                    match write(vec![p.op.clone()]).await {
                        Ok(mut a) if a.len() == 1 => {
                            a.pop().ok_or_else(|| QuotaStoreError::Refused(reason.clone()))
                        }
                        Ok(_) => Err(QuotaStoreError::Refused(reason.clone())),
                        Err(e) => Err(e),
                    }
                };
                let _ = p.reply.send(r);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::State;

    fn reserve(id: &str, amount: u64, now_ns: u64) -> Op {
        Op::Reserve {
            req: ReserveRequest {
                reservation_id: id.into(),
                resource: "gpu".into(),
                tenant: "t".into(),
                project: "p".into(),
                amount,
                ttl_ms: 1000,
            },
            limits: LevelLimits {
                global: 10,
                tenant: 10,
                project: 10,
            },
            now_ns,
        }
    }

    /// A batch decides as its operations one at a time would: the second
    /// reserve sees the first, the same id again replays, a commit of a
    /// reservation the batch made finds it, and the limit binds inside it.
    #[test]
    fn a_batch_decides_in_order_on_its_own_state() {
        let ops = vec![
            reserve("a", 6, 1),
            reserve("a", 6, 2),
            reserve("b", 5, 3),
            Op::Commit {
                id: "a".into(),
                amount: Some(4),
                now_ns: 4,
            },
            reserve("b", 5, 5),
            Op::Release {
                id: "nope".into(),
                now_ns: 6,
            },
        ];
        let d = decide(&ops, HashMap::new(), BTreeMap::new(), &mut |_| None);
        use crate::quota::Kind;
        let kinds: Vec<Kind> = d.answers.iter().map(|a| a.kind).collect();
        // b (5) does not fit beside a (6) under 10; after a commits 4 of 6,
        // 4 are used and b fits.
        assert_eq!(
            kinds,
            vec![
                Kind::Created,
                Kind::Created,
                Kind::Conflict,
                Kind::Done,
                Kind::Created,
                Kind::NotFound
            ]
        );
        assert_eq!(d.ledger.len(), 3, "reserve a, commit a, reserve b");
        let a = d.reservations.iter().find(|(r, _)| r.id == "a").unwrap();
        assert_eq!((a.0.state, a.0.committed, a.1), (State::Committed, 4, true));
        let global = d.counters.iter().find(|(k, _)| k.tenant.is_empty()).unwrap().1;
        assert_eq!((global.reserved, global.committed), (5, 4));
        assert_eq!(
            crate::quota::replay(&d.ledger).get(&d.counters[0].0).copied(),
            Some(global)
        );
    }
}
