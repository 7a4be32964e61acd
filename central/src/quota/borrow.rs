//! Regional borrowing: a replica outside a resource's home region reserves
//! from its own borrowing account while the home region does not answer,
//! up to the resource's ceiling for its region, and repays the debt to the
//! home region when it answers again.
//!
//! # THE BOUND
//! At every level of a resource and at every instant,
//! `home's committed + reserved + Σ regions' outstanding debt
//!  ≤ limit + Σ ceilings` (the ceilings of every borrowing region,
//! [`Resource::borrow_bound`]): the oversell is at most Σ ceilings, over
//! the resource's whole life (not per outage).
//!
//! Why it holds: the home region alone keeps `committed + reserved ≤ limit`
//! for what it admits (the module [`super`]'s guarantee). A borrowing
//! replica admits into its own account only under `min(limit, ceiling)` at
//! each level, and the account's counters hold every borrowed reservation
//! still reserved, every committed amount not yet repaid, and every unit a
//! repayment took above a limit at home (`kept`, for good): so a region's
//! debt plus its oversell so far never exceed its ceiling. A debt leaves
//! the account (a `repaid` ledger row, less `kept`) only after the home
//! region recorded it, so each unit is counted in the account, at home, or
//! both (never neither). The home records a repaid debt whatever its
//! limits say (the capacity was already used) and answers `over_limit`:
//! `min(committed, max over levels of (used − limit))`, which is at least
//! this debt's share of the excess (a retry gets at least as much), so
//! the units above a limit at home never exceed Σ kept ≤ Σ ceilings.
//!
//! # How
//! - Policy: `borrow: { ceilings: { <region>: N } }` on a `risk: low`
//!   resource with a `home_region` (validation refuses it on a high-risk
//!   one: those keep failing closed).
//! - A replica of another region answers `409 wrong_region` as before when
//!   the home region answers. Before borrowing it asks the home replica
//!   (`--home-region-url REGION=http://host:port`) for the figures of that
//!   (resource, tenant, project): a `200` with `estimate: false`, or any
//!   4xx, means the home answers (`wrong_region`); no connection, no answer
//!   within [`PROBE_TIMEOUT`], a `503`, or an estimate mean it does not,
//!   and the replica reserves from its account (a SQLite quota store). The
//!   answer is the usual one plus `"borrowed": true` and `home_region`; a
//!   refusal at the ceiling is `409 quota_exceeded` with
//!   `borrowing_ceiling`.
//! - Commit, release and query of a borrowed reservation happen in the
//!   account (the borrowing replica finds the id there).
//! - The debt is the account's ledger. A repayer ([`repay_every`]) runs
//!   every second (doubling to [`MAX_BACKOFF`] while the home fails): it
//!   expires due borrowed reservations, then sends each finished one that
//!   is not yet repaid (at most [`REPAY_BATCH`] per pass) to the home's
//!   `POST /v1/quotas/debts`. The home applies it as a reservation
//!   `<region>:<id>` reserved and committed (or released) at once, without
//!   its limits, idempotent by that id: a retry double-counts nothing. Then
//!   the account marks it repaid (one `repaid` row moves the committed
//!   amount out). A live borrowed reservation is repaid when it finishes
//!   (at most its ttl later).
//! - An exhausted home still records a repaid debt, and answers the
//!   oversell (`over_limit`); new reservations there are refused until
//!   usage falls below the limit, as after a lowered limit. Nothing is
//!   lost or refused; the borrowing region keeps those units against its
//!   ceiling, so it never oversells more than its ceiling in all.
//!
//! The ceiling is enforced by one account: a region must run its
//! borrowing account on one replica (two replicas with their own accounts
//! would each borrow the ceiling; nothing detects that yet).
//!
//! The home client speaks plain HTTP/1.1 (loopback or a private network):
//! mTLS to the home region is not supported yet.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tenantgate::policy::quota::{LevelLimits, Quotas, Resource, MAX_MAX_TTL_NS};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::warn;

use super::metrics::QuotaMetrics;
use super::{
    Answer, Kind, Outcome, QuotaStore, QuotaStoreError, Reservation, ReserveRequest, SqliteStore, State,
    RECLAIM_BATCH,
};

/// How long a replica waits for the home region before it borrows.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Debts sent per repayer pass.
pub const REPAY_BATCH: usize = 256;
/// The repayer's longest wait between passes while the home fails.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// The largest answer read from the home region.
const MAX_ANSWER_BYTES: usize = 64 * 1024;
/// A repaid debt's ttl at home: the longest there is, so that a retry of a
/// half-applied repayment (reserved, not yet committed) finds it live.
pub const DEBT_TTL_MS: u64 = MAX_MAX_TTL_NS / 1_000_000;

/// A borrowing replica's account and the home regions it can reach.
pub struct Borrowing {
    pub account: Arc<SqliteStore>,
    /// Home region → `host:port` of a replica there (plain HTTP).
    pub homes: BTreeMap<String, String>,
}

/// `POST /v1/quotas/debts`: one finished borrowed reservation.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Debt {
    pub region: String,
    pub reservation_id: String,
    pub resource: String,
    pub tenant: String,
    pub project: String,
    pub amount: u64,
    pub committed: u64,
    pub state: State,
}

/// Records `d` in the home region's store as the reservation
/// `<region>:<id>`, reserved without limits (the capacity was already
/// used) and committed or released at once; idempotent by that id. The
/// answer's `over_limit` is what the borrowing region keeps against its
/// ceiling (see THE BOUND).
pub async fn record_debt(
    store: &dyn QuotaStore,
    r: &Resource,
    d: &Debt,
    now_ns: u64,
) -> Result<Answer, QuotaStoreError> {
    let id = format!("{}:{}", d.region, d.reservation_id);
    if d.amount == 0 || d.committed > d.amount || d.state == State::Reserved {
        return Ok(super::error_answer(
            Kind::Invalid,
            Outcome::Invalid,
            "a debt is a finished reservation: amount ≥ 1, committed ≤ amount",
            json!({ "field": "amount" }),
        ));
    }
    let req = ReserveRequest {
        reservation_id: id.clone(),
        resource: r.name.clone(),
        tenant: d.tenant.clone(),
        project: d.project.clone(),
        amount: d.amount,
        ttl_ms: DEBT_TTL_MS,
    };
    let open = LevelLimits {
        global: u64::MAX,
        tenant: u64::MAX,
        project: u64::MAX,
    };
    let a = store.reserve(&req, open, now_ns).await?;
    if a.kind != Kind::Created {
        return Ok(a);
    }
    let a = match d.state {
        State::Committed => store.commit(&id, Some(d.committed), now_ns).await?,
        _ => store.release(&id, now_ns).await?,
    };
    if a.kind != Kind::Done {
        return Ok(a);
    }
    let usage = store.usage(&r.name, &d.tenant, &d.project).await?;
    let l = r.limits_for(&d.tenant, &d.project);
    let over = usage
        .iter()
        .zip([l.global, l.tenant, l.project])
        .map(|(u, limit)| u.used().saturating_sub(limit))
        .max()
        .unwrap_or(0);
    let over_limit = if d.state == State::Committed {
        over.min(d.committed)
    } else {
        0
    };
    Ok(Answer {
        kind: Kind::Done,
        body: json!({ "reservation_id": id, "state": d.state.as_str(), "over_limit": over_limit })
            .to_string(),
        outcome: a.outcome,
    })
}

/// `REGION=http://host:port` (the `--home-region-url` flag).
pub fn parse_home(spec: &str) -> Result<(String, String), String> {
    let (region, url) = spec
        .split_once('=')
        .ok_or_else(|| format!("--home-region-url {spec}: expected REGION=http://host:port"))?;
    let addr = url
        .strip_prefix("http://")
        .map(|a| a.trim_end_matches('/'))
        .filter(|a| !a.is_empty() && !a.contains('/'))
        .ok_or_else(|| format!("--home-region-url {spec}: only http://host:port is supported"))?;
    Ok((region.to_owned(), addr.to_owned()))
}

/// The limits a borrowing replica admits under: each level capped at its
/// ceiling.
pub fn capped(limits: LevelLimits, ceiling: u64) -> LevelLimits {
    LevelLimits {
        global: limits.global.min(ceiling),
        tenant: limits.tenant.min(ceiling),
        project: limits.project.min(ceiling),
    }
}

/// Adds the borrowing marker (and, for a refusal at the ceiling, the
/// ceiling) to an answer from the account.
pub fn marked(mut a: Answer, home: &str, ceiling: u64) -> Answer {
    let Ok(Value::Object(mut m)) = serde_json::from_str::<Value>(&a.body) else {
        return a;
    };
    m.insert("borrowed".into(), json!(true));
    m.insert("home_region".into(), json!(home));
    if m.get("error").and_then(Value::as_str) == Some("quota_exceeded") {
        m.insert("borrowing_ceiling".into(), json!(ceiling));
        m.insert(
            "message".into(),
            json!(format!(
                "home region {home} does not answer and this region's borrowing ceiling ({ceiling}) is reached: {}",
                m.get("message").and_then(Value::as_str).unwrap_or("")
            )),
        );
    }
    a.body = Value::Object(m).to_string();
    a
}

/// Percent-encodes a query value (RFC 3986 unreserved kept).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// One HTTP/1.1 exchange with a home replica, within `timeout`: the status
/// and body (at most [`MAX_ANSWER_BYTES`]).
pub async fn call(
    addr: &str,
    method: &str,
    path: &str,
    body: &str,
    timeout: Duration,
) -> Result<(u16, String), String> {
    tokio::time::timeout(timeout, exchange(addr, method, path, body))
        .await
        .map_err(|_| format!("{addr}: no answer within {timeout:?}"))?
}

async fn exchange(addr: &str, method: &str, path: &str, body: &str) -> Result<(u16, String), String> {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    // One write per call, but the home's answer never waits on our ACK.
    s.set_nodelay(true).map_err(|e| format!("nodelay {addr}: {e}"))?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| format!("write {addr}: {e}"))?;
    let mut out = Vec::new();
    (&mut s)
        .take(MAX_ANSWER_BYTES as u64)
        .read_to_end(&mut out)
        .await
        .map_err(|e| format!("read {addr}: {e}"))?;
    let text = String::from_utf8_lossy(&out);
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{addr}: no end of headers"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("{addr}: no status"))?;
    Ok((status, rest.to_owned()))
}

impl Borrowing {
    /// Whether the home region answers for (resource, tenant, project):
    /// see the module header.
    pub async fn home_answers(&self, home: &str, r: &Resource, tenant: &str, project: &str) -> bool {
        let Some(addr) = self.homes.get(home) else {
            return true;
        };
        let path = format!(
            "/v1/quotas/{}?tenant={}&project={}",
            encode(&r.name),
            encode(tenant),
            encode(project)
        );
        match call(addr, "GET", &path, "", PROBE_TIMEOUT).await {
            Ok((200, body)) => {
                serde_json::from_str::<Value>(&body)
                    .ok()
                    .and_then(|v| v.get("estimate").and_then(Value::as_bool))
                    == Some(false)
            }
            Ok((s, _)) => (400..500).contains(&s),
            Err(_) => false,
        }
    }

    /// Sends one finished borrowed reservation to its home region and
    /// marks it repaid here once recorded there. `Err`: not repaid (try
    /// again later).
    pub async fn repay(
        &self,
        region: &str,
        home: &str,
        r: &Reservation,
        now_ns: u64,
    ) -> Result<(), RepayError> {
        let addr = self
            .homes
            .get(home)
            .ok_or_else(|| RepayError::Refused(format!("no --home-region-url for {home}")))?;
        let body = json!({
            "region": region,
            "reservation_id": r.id,
            "resource": r.resource,
            "tenant": r.tenant,
            "project": r.project,
            "amount": r.amount,
            "committed": r.committed,
            "state": r.state.as_str(),
        })
        .to_string();
        let answer = call(addr, "POST", "/v1/quotas/debts", &body, PROBE_TIMEOUT)
            .await
            .map_err(RepayError::Unreachable)?;
        match answer {
            (200, answer) => {
                let kept = serde_json::from_str::<Value>(&answer)
                    .ok()
                    .and_then(|v| v.get("over_limit").and_then(Value::as_u64))
                    .unwrap_or(r.committed)
                    .min(r.committed);
                self.account
                    .mark_repaid(&r.id, kept, now_ns)
                    .await
                    .map_err(|e| RepayError::Unreachable(e.to_string()))?;
                Ok(())
            }
            (status, answer) if status >= 500 => Err(RepayError::Unreachable(format!(
                "{home} answered {status}: {answer}"
            ))),
            (status, answer) => Err(RepayError::Refused(format!("{home} answered {status}: {answer}"))),
        }
    }

    /// Units borrowed and not yet repaid (reserved or committed), per
    /// resource, at the global level.
    pub async fn outstanding(&self) -> Result<BTreeMap<String, u64>, String> {
        let totals = self.account.totals().await.map_err(|e| e.to_string())?;
        Ok(totals.into_iter().map(|(k, u)| (k, u.used())).collect())
    }
}

/// Why a debt was not repaid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RepayError {
    /// The home (or this account) did not answer or is unavailable: the
    /// pass stops and backs off.
    Unreachable(String),
    /// The home answered and refused this debt (a policy that differs, an
    /// id taken): the pass goes on with the others; the debt stays.
    Refused(String),
}

/// What one repayer pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RepayPass {
    pub expired: u64,
    pub repaid: u64,
    /// Debts whose resource no longer names a home region: kept.
    pub kept: u64,
}

/// What the repayer reads of the API replica it runs in (the quota API,
/// `super::api::QuotaApi`, implements it): the repayer sits beneath the
/// API and never names it.
pub trait Repaying: Send + Sync + 'static {
    /// The borrowing account, when this replica has one.
    fn borrowing(&self) -> Option<&Arc<Borrowing>>;
    /// This replica's region, when it has one.
    fn region(&self) -> Option<&str>;
    fn now_ns(&self) -> u64;
    /// The `quotas:` in force.
    fn quotas_now(&self) -> Arc<Quotas>;
    fn metrics(&self) -> &QuotaMetrics;
}

/// One repayer pass of `api`'s borrowing account (see the module header).
/// `api` is the replica or what holds it (the service's `Arc`).
pub async fn repay_once<A: Repaying>(api: &impl Deref<Target = A>) -> Result<RepayPass, String> {
    let api: &A = api;
    let (Some(b), Some(region)) = (api.borrowing(), api.region()) else {
        return Ok(RepayPass::default());
    };
    let now = api.now_ns();
    let mut pass = RepayPass {
        expired: b
            .account
            .reclaim(now, RECLAIM_BATCH)
            .await
            .map_err(|e| e.to_string())?
            .len() as u64,
        ..RepayPass::default()
    };
    let debts = b.account.debts(REPAY_BATCH).await.map_err(|e| e.to_string())?;
    let quotas = api.quotas_now();
    // One debt the home refuses does not hold up the others; the pass
    // still fails (and backs off) if any was not taken.
    let mut first_error = None;
    for r in debts.iter().filter(|r| r.state != State::Reserved) {
        let home = quotas
            .resources
            .get(&r.resource)
            .and_then(|res| res.home_region.clone());
        let Some(home) = home else {
            pass.kept = pass.kept.saturating_add(1);
            continue;
        };
        match b.repay(region, &home, r, api.now_ns()).await {
            Ok(()) => {
                pass.repaid = pass.repaid.saturating_add(1);
                api.metrics().borrow_repaid.fetch_add(1, Relaxed);
            }
            Err(RepayError::Refused(e)) => {
                first_error.get_or_insert(e);
            }
            Err(RepayError::Unreachable(e)) => return Err(e),
        }
    }
    let debt = b
        .outstanding()
        .await?
        .values()
        .fold(0u64, |a, v| a.saturating_add(*v));
    api.metrics().borrow_debt_units.store(debt, Relaxed);
    match first_error {
        Some(e) => Err(e),
        None => Ok(pass),
    }
}

/// Runs [`repay_once`] every second, doubling the wait up to
/// [`MAX_BACKOFF`] while a pass fails, until dropped.
pub async fn repay_every<A: Repaying>(api: Arc<A>) {
    let base = Duration::from_secs(1);
    let mut wait = base;
    loop {
        tokio::time::sleep(wait).await;
        match repay_once(&api).await {
            Ok(_) => wait = base,
            Err(e) => {
                api.metrics().borrow_repay_failures.fetch_add(1, Relaxed);
                warn!(error = %e, retry_in = ?wait.saturating_mul(2).min(MAX_BACKOFF), "repaying borrowed quota to the home region failed");
                wait = wait.saturating_mul(2).min(MAX_BACKOFF);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn home_urls_and_capped_limits() {
        assert_eq!(
            parse_home("eu=http://127.0.0.1:10002/").unwrap(),
            ("eu".to_owned(), "127.0.0.1:10002".to_owned())
        );
        assert!(parse_home("eu=https://x").is_err());
        assert!(parse_home("eu").is_err());
        let l = LevelLimits {
            global: 100,
            tenant: 5,
            project: 50,
        };
        assert_eq!(
            capped(l, 10),
            LevelLimits {
                global: 10,
                tenant: 5,
                project: 10
            }
        );
        assert_eq!(encode("a b/&"), "a%20b%2F%26");
    }
}
