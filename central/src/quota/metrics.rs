//! The reservation API's Prometheus metrics: a fixed set with bounded
//! labels (outcome × level, resource names from the policy), never one
//! series per tenant.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use super::{Outcome, Usage};

/// Outcome labels, in output order.
const OUTCOMES: [&str; 12] = [
    "reserved",
    "replayed",
    "quota_exceeded",
    "conflict",
    "committed",
    "released",
    "expired",
    "already_committed",
    "not_found",
    "invalid",
    "wrong_region",
    "quota_unavailable",
];

#[derive(Default)]
pub struct QuotaMetrics {
    /// (outcome, level) → count; level "" when the outcome has none.
    outcomes: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    pub reclaimed: AtomicU64,
    reclaim_lag_sum_ns: AtomicU64,
    reclaim_lag_max_ns: AtomicU64,
    /// Σ |counter − ledger| found by the last reconciliation, and in total.
    pub drift_last: AtomicU64,
    pub drift_total: AtomicU64,
    pub reconciliations: AtomicU64,
    db_count: AtomicU64,
    db_sum_ns: AtomicU64,
    db_max_ns: AtomicU64,
    pub db_errors: AtomicU64,
    /// Reservations granted from the borrowing account.
    pub borrowed: AtomicU64,
    /// Borrowed reservations repaid to their home region.
    pub borrow_repaid: AtomicU64,
    /// Repayer passes that failed (the home did not take a debt).
    pub borrow_repay_failures: AtomicU64,
    /// Units the borrowing account holds (outstanding debt, and units kept
    /// for good because the home took them above a limit), after the last
    /// repayer pass.
    pub borrow_debt_units: AtomicU64,
    /// At a home replica: units of repaid debts that landed above a limit.
    pub borrow_over_limit: AtomicU64,
}

impl QuotaMetrics {
    pub fn outcome(&self, o: Outcome) {
        let level = match o {
            Outcome::Exceeded(l) => l.as_str(),
            _ => "",
        };
        let mut m = self.outcomes.lock().unwrap_or_else(|e| e.into_inner());
        let c = m.entry((o.as_str(), level)).or_insert(0);
        *c = c.saturating_add(1);
    }

    pub fn reclaim_lag(&self, lag_ns: u64) {
        self.reclaimed.fetch_add(1, Relaxed);
        self.reclaim_lag_sum_ns.fetch_add(lag_ns, Relaxed);
        self.reclaim_lag_max_ns.fetch_max(lag_ns, Relaxed);
    }

    pub fn db(&self, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.db_count.fetch_add(1, Relaxed);
        self.db_sum_ns.fetch_add(ns, Relaxed);
        self.db_max_ns.fetch_max(ns, Relaxed);
    }

    /// Prometheus text; `totals`: reserved and committed per resource
    /// (`None`: the database did not answer).
    pub fn render(&self, totals: Option<&BTreeMap<String, Usage>>) -> String {
        let mut out = String::with_capacity(2048);
        let _ = writeln!(
            out,
            "# HELP tenantgate_quota_requests_total Reservation API requests by outcome (and the binding level of a refusal).\n# TYPE tenantgate_quota_requests_total counter"
        );
        let m = self.outcomes.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for o in OUTCOMES {
            let levels: &[&str] = if o == "quota_exceeded" {
                &["global", "tenant", "project"]
            } else {
                &[""]
            };
            for l in levels {
                let v = m.get(&(o, *l)).copied().unwrap_or(0);
                if l.is_empty() {
                    let _ = writeln!(out, "tenantgate_quota_requests_total{{outcome=\"{o}\"}} {v}");
                } else {
                    let _ = writeln!(
                        out,
                        "tenantgate_quota_requests_total{{outcome=\"{o}\",level=\"{l}\"}} {v}"
                    );
                }
            }
        }
        if let Some(totals) = totals {
            let _ = writeln!(out, "# HELP tenantgate_quota_reserved Units reserved per resource (global level).\n# TYPE tenantgate_quota_reserved gauge");
            for (r, u) in totals {
                let _ = writeln!(
                    out,
                    "tenantgate_quota_reserved{{resource=\"{r}\"}} {}",
                    u.reserved
                );
            }
            let _ = writeln!(out, "# HELP tenantgate_quota_committed Units committed per resource (global level).\n# TYPE tenantgate_quota_committed gauge");
            for (r, u) in totals {
                let _ = writeln!(
                    out,
                    "tenantgate_quota_committed{{resource=\"{r}\"}} {}",
                    u.committed
                );
            }
        }
        let secs = |ns: u64| ns as f64 / 1e9;
        let _ = writeln!(
            out,
            "# HELP tenantgate_quota_reclaimed_total Reservations the reclaimer expired.\n# TYPE tenantgate_quota_reclaimed_total counter\ntenantgate_quota_reclaimed_total {}",
            self.reclaimed.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP tenantgate_quota_reclaim_lag_seconds_sum Σ (reclaimed at − expires at).\n# TYPE tenantgate_quota_reclaim_lag_seconds_sum counter\ntenantgate_quota_reclaim_lag_seconds_sum {}\n# HELP tenantgate_quota_reclaim_lag_seconds_max The longest reclaim lag seen.\n# TYPE tenantgate_quota_reclaim_lag_seconds_max gauge\ntenantgate_quota_reclaim_lag_seconds_max {}",
            secs(self.reclaim_lag_sum_ns.load(Relaxed)),
            secs(self.reclaim_lag_max_ns.load(Relaxed))
        );
        let _ = writeln!(
            out,
            "# HELP tenantgate_quota_drift_units Σ |counter − ledger| the last reconciliation found (and repaired).\n# TYPE tenantgate_quota_drift_units gauge\ntenantgate_quota_drift_units {}\n# HELP tenantgate_quota_drift_units_total Σ of every reconciliation's drift.\n# TYPE tenantgate_quota_drift_units_total counter\ntenantgate_quota_drift_units_total {}\n# HELP tenantgate_quota_reconciliations_total Reconciliation passes.\n# TYPE tenantgate_quota_reconciliations_total counter\ntenantgate_quota_reconciliations_total {}",
            self.drift_last.load(Relaxed),
            self.drift_total.load(Relaxed),
            self.reconciliations.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP tenantgate_quota_db_seconds Quota database transactions (count, sum, max).\n# TYPE tenantgate_quota_db_seconds summary\ntenantgate_quota_db_seconds_count {}\ntenantgate_quota_db_seconds_sum {}\n# HELP tenantgate_quota_db_seconds_max The slowest quota database transaction.\n# TYPE tenantgate_quota_db_seconds_max gauge\ntenantgate_quota_db_seconds_max {}\n# HELP tenantgate_quota_db_errors_total Quota database errors.\n# TYPE tenantgate_quota_db_errors_total counter\ntenantgate_quota_db_errors_total {}\n# HELP tenantgate_quota_db_up Whether the quota database answered the last scrape.\n# TYPE tenantgate_quota_db_up gauge\ntenantgate_quota_db_up {}",
            self.db_count.load(Relaxed),
            secs(self.db_sum_ns.load(Relaxed)),
            secs(self.db_max_ns.load(Relaxed)),
            self.db_errors.load(Relaxed),
            u8::from(totals.is_some())
        );
        let _ = writeln!(
            out,
            "# HELP tenantgate_quota_borrowed_total Reservations granted from this replica's borrowing account (home region unreachable).\n# TYPE tenantgate_quota_borrowed_total counter\ntenantgate_quota_borrowed_total {}\n# HELP tenantgate_quota_borrow_repaid_total Borrowed reservations repaid to their home region.\n# TYPE tenantgate_quota_borrow_repaid_total counter\ntenantgate_quota_borrow_repaid_total {}\n# HELP tenantgate_quota_borrow_repay_failures_total Repayer passes the home region did not complete.\n# TYPE tenantgate_quota_borrow_repay_failures_total counter\ntenantgate_quota_borrow_repay_failures_total {}\n# HELP tenantgate_quota_borrow_debt_units Units the borrowing account holds against its ceilings (outstanding debt and units kept above a home limit).\n# TYPE tenantgate_quota_borrow_debt_units gauge\ntenantgate_quota_borrow_debt_units {}\n# HELP tenantgate_quota_borrow_over_limit_units_total At a home replica: units of repaid debts recorded above a limit (the oversell THE BOUND allows).\n# TYPE tenantgate_quota_borrow_over_limit_units_total counter\ntenantgate_quota_borrow_over_limit_units_total {}",
            self.borrowed.load(Relaxed),
            self.borrow_repaid.load(Relaxed),
            self.borrow_repay_failures.load(Relaxed),
            self.borrow_debt_units.load(Relaxed),
            self.borrow_over_limit.load(Relaxed)
        );
        out
    }
}
