//! The quota's records: a reservation and its request, the three levels'
//! counters of a key, the ledger's rows, and what one transaction writes.
//! Plain data beneath the decisions ([`super`]) and every store.

use serde::{Deserialize, Serialize};
use serde_json::json;

pub(super) const NANOS_PER_MS: u64 = 1_000_000;

/// A level of a resource's hierarchy, in checking order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    Global,
    Tenant,
    Project,
}

impl Level {
    pub const ALL: [Level; 3] = [Level::Global, Level::Tenant, Level::Project];

    pub fn as_str(self) -> &'static str {
        match self {
            Level::Global => "global",
            Level::Tenant => "tenant",
            Level::Project => "project",
        }
    }
}

/// A counter's key: `(resource, "", "")` for the global level,
/// `(resource, tenant, "")` for a tenant, `(resource, tenant, project)`.
/// Sorting keys sorts levels in checking order, which is the lock order.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct CounterKey {
    pub resource: String,
    pub tenant: String,
    pub project: String,
}

impl CounterKey {
    /// The three keys a reservation touches, in lock order.
    pub fn levels(resource: &str, tenant: &str, project: &str) -> [CounterKey; 3] {
        let k = |t: &str, p: &str| CounterKey {
            resource: resource.to_owned(),
            tenant: t.to_owned(),
            project: p.to_owned(),
        };
        [k("", ""), k(tenant, ""), k(tenant, project)]
    }

    pub fn level(&self) -> Level {
        match (self.tenant.is_empty(), self.project.is_empty()) {
            (true, _) => Level::Global,
            (false, true) => Level::Tenant,
            (false, false) => Level::Project,
        }
    }
}

/// What a level holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub reserved: u64,
    pub committed: u64,
}

impl Usage {
    pub fn used(&self) -> u64 {
        self.reserved.saturating_add(self.committed)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Reserved,
    Committed,
    Released,
    Expired,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Reserved => "reserved",
            State::Committed => "committed",
            State::Released => "released",
            State::Expired => "expired",
        }
    }

    pub fn parse(s: &str) -> Option<State> {
        match s {
            "reserved" => Some(State::Reserved),
            "committed" => Some(State::Committed),
            "released" => Some(State::Released),
            "expired" => Some(State::Expired),
            _ => None,
        }
    }
}

/// `POST /v1/reservations`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveRequest {
    pub reservation_id: String,
    pub resource: String,
    pub tenant: String,
    pub project: String,
    pub amount: u64,
    pub ttl_ms: u64,
}

/// A reservation as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub id: String,
    pub resource: String,
    pub tenant: String,
    pub project: String,
    pub amount: u64,
    pub ttl_ms: u64,
    pub state: State,
    pub created_ns: u64,
    pub expires_ns: u64,
    /// What was committed (0 unless committed).
    pub committed: u64,
    /// When it left `reserved`.
    pub finished_ns: Option<u64>,
    /// The reserve's answer, replayed to a retry.
    pub reserve_body: String,
    /// The commit's answer, replayed to a retry.
    pub commit_body: Option<String>,
}

impl Reservation {
    pub fn keys(&self) -> [CounterKey; 3] {
        CounterKey::levels(&self.resource, &self.tenant, &self.project)
    }

    /// `GET /v1/reservations/{id}`.
    pub fn view(&self) -> serde_json::Value {
        json!({
            "reservation_id": self.id,
            "resource": self.resource,
            "tenant": self.tenant,
            "project": self.project,
            "amount": self.amount,
            "ttl": self.ttl_ms,
            "state": self.state.as_str(),
            "committed": self.committed,
            "created_at": rfc3339_ms(self.created_ns),
            "expires_at": rfc3339_ms(self.expires_ns),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LedgerKind {
    Reserve,
    Commit,
    Release,
    Expire,
    Compensation,
    /// A borrowing region's debt moved to the home region
    /// ([`borrow`](crate::quota::borrow)): the borrowed reservation's committed amount leaves
    /// the borrowing account (usage: `d_committed` = −committed).
    Repaid,
}

impl LedgerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LedgerKind::Reserve => "reserve",
            LedgerKind::Commit => "commit",
            LedgerKind::Release => "release",
            LedgerKind::Expire => "expire",
            LedgerKind::Compensation => "compensation",
            LedgerKind::Repaid => "repaid",
        }
    }

    pub fn parse(s: &str) -> Option<LedgerKind> {
        match s {
            "reserve" => Some(LedgerKind::Reserve),
            "commit" => Some(LedgerKind::Commit),
            "release" => Some(LedgerKind::Release),
            "expire" => Some(LedgerKind::Expire),
            "compensation" => Some(LedgerKind::Compensation),
            "repaid" => Some(LedgerKind::Repaid),
            _ => None,
        }
    }
}

/// One ledger row. Usage rows apply their deltas to all three levels of
/// (resource, tenant, project); a compensation applies to the one counter
/// its key names (tenant and project empty above their level).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LedgerEntry {
    pub seq: i64,
    pub at_ns: u64,
    pub kind: LedgerKind,
    pub reservation_id: Option<String>,
    pub resource: String,
    pub tenant: String,
    pub project: String,
    pub d_reserved: i64,
    pub d_committed: i64,
    /// A compensation's note (the counter's old value).
    pub note: Option<String>,
}

/// What one transaction writes: the reservation's new row, the deltas to
/// its three counters and one ledger row.
#[derive(Debug, Clone)]
pub struct Write {
    pub reservation: Reservation,
    /// The reservation is new (INSERT) rather than changed (UPDATE).
    pub insert: bool,
    pub kind: LedgerKind,
    pub d_reserved: i64,
    pub d_committed: i64,
}

impl Write {
    /// The ledger row this write appends at `now_ns` (the store numbers
    /// it: `seq` 0 here).
    pub fn ledger_entry(&self, now_ns: u64) -> LedgerEntry {
        let r = &self.reservation;
        LedgerEntry {
            seq: 0,
            at_ns: now_ns,
            kind: self.kind,
            reservation_id: Some(r.id.clone()),
            resource: r.resource.clone(),
            tenant: r.tenant.clone(),
            project: r.project.clone(),
            d_reserved: self.d_reserved,
            d_committed: self.d_committed,
            note: None,
        }
    }
}

/// RFC 3339 in UTC with milliseconds, from ns since the epoch.
pub fn rfc3339_ms(ns: u64) -> String {
    let ms = ns / NANOS_PER_MS;
    let secs = ms / 1000;
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil from days (Howard Hinnant's algorithm), for days ≥ 0.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60,
        ms % 1000
    )
}
