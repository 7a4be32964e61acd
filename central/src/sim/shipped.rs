//! A simulated node that runs the code the filter ships: the engine's
//! charge path and `sync::shared` (claim, scan, request, sent, apply) over
//! the in-memory host, several workers sharing one shared-data store, with the
//! policy compiled from JSON like the filter's plugin configuration.

use std::cell::RefCell;
use std::rc::Rc;

use tenantgate::engine::{self, Reason};
use tenantgate::host::Host;
use tenantgate::keys::kind;
use tenantgate::memory::{MemoryHost, SharedStore};
use tenantgate::policy::Policy;
use tenantgate::sync::apply;
use tenantgate::sync::shared::{self, Claim, Scan};
use tenantgate::sync::{stored, Admitted, Allowance, FailureMode, SyncRequest, SyncResponse};
use tenantgate::table::layout as state;

use super::{SimConfig, LIMIT};
use crate::error::ConfigError;

const NANOS_PER_MS: u64 = 1_000_000;
const NANOS_PER_SEC: u64 = 1_000_000_000;

/// The tenant every request names; its limit key is [`KEY`].
pub const TENANT: &str = "tenant-a";
/// The engine's limit key of [`TENANT`] on route class `api`.
pub const KEY: &str = "api|t|tenant-a";

/// Workers (VMs) per simulated Envoy.
pub const WORKERS: usize = 2;

/// What one request did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charged {
    /// How it was admitted (`None`: denied), told apart by how the stored
    /// allowance changed.
    pub admitted: Option<Admitted>,
    /// The request found no global allowance for its key (in its slot or
    /// its overflow entry) and left one: a key start.
    pub start: bool,
    /// A denial's `Retry-After`, in seconds (0 when admitted).
    pub retry_after_secs: u64,
    /// What an admitted request was charged, for a cost settled after its
    /// response ([`ShippedNode::settle`]).
    pub charged: Option<engine::Charged>,
    /// A denied request found a live lease too small for it (`false`: no
    /// live lease: none yet, expired, or a failure mode's local limit).
    pub lease_too_small: bool,
}

struct Stored {
    table: Option<Allowance>,
    overflow: Option<Allowance>,
}

/// One Envoy node: its workers and their shared data.
pub struct ShippedNode {
    policy: Policy,
    store: Rc<RefCell<SharedStore>>,
    node_id: String,
    region: String,
    /// Round-robin: the worker that serves the next request or tick.
    next: usize,
    /// The worker whose callout is in flight (answers go back to it).
    sender: usize,
    /// The report it sent last, kept to send again ([`ShippedNode::hedge`]).
    last_report: Option<SyncRequest>,
    /// What each worker reuses from one charge to the next, as in the glue.
    scratch: [engine::Scratch; WORKERS],
}

fn mode_name(mode: FailureMode) -> &'static str {
    match mode {
        FailureMode::FailOpenLocal => "fail_open_local",
        FailureMode::FailClosed => "fail_closed",
        FailureMode::FailOpen => "fail_open",
    }
}

/// The filter's policy for a simulation: one plan with the global limit
/// (and, with [`SimConfig::late`], the route's cost settled after the
/// response from a header, up to the ceiling, the limit's `max_debt`).
pub fn policy(cfg: &SimConfig, mode: FailureMode, effective_from: u64) -> Result<Policy, ConfigError> {
    let (debt, settle) = match cfg.late {
        Some(l) => (
            format!(r#", "max_debt": {}"#, l.max_debt),
            format!(r#", "settle": {{"header": "x-cost", "ceiling": {}}}"#, l.ceiling),
        ),
        None => (String::new(), String::new()),
    };
    let json = format!(
        r#"{{"version": "sim", "identity": {{"header": "x-tenant-id"}},
        "plans": {{"free": {{"limits": [
            {{"name": "{LIMIT}", "rate": {rate}, "per": "{per}s", "burst": {burst}, "global": true{debt}}}]}}}},
        "default_plan": "free", "anonymous": {{"plan": "free"}},
        "routes": {{"api": {{"cost": {cost}{settle}}}}}, "default_route": "api",
        "key_table": {{"max_keys": {max_keys}}},
        "sync": {{"cluster": "tenantgate", "interval": "{interval}ms", "timeout": "{timeout}ms",
            "provisional": {provisional}, "failure_mode": "{mode}"}}}}"#,
        rate = cfg.limit,
        per = cfg.window_ns / NANOS_PER_SEC,
        burst = cfg.burst,
        cost = cfg.max_cost.max(1),
        interval = cfg.interval_ns / NANOS_PER_MS,
        timeout = cfg.response_timeout_ns / NANOS_PER_MS,
        provisional = cfg.provisional,
        mode = mode_name(mode),
        max_keys = cfg.max_keys,
    );
    let mut p = Policy::from_json(json.as_bytes())
        .map_err(|_| ConfigError::new("policy", "the simulated policy is invalid"))?;
    p.effective_from_ns = effective_from;
    Ok(p)
}

impl ShippedNode {
    pub fn new(policy: Policy, node_id: String, region: String) -> ShippedNode {
        ShippedNode {
            policy,
            store: SharedStore::new(),
            node_id,
            region,
            next: 0,
            sender: 0,
            last_report: None,
            scratch: Default::default(),
        }
    }

    fn worker(&mut self, tenant: &str) -> MemoryHost {
        self.next = (self.next + 1) % WORKERS;
        MemoryHost::new(self.store.clone())
            .route_class("api")
            .header("x-tenant-id", tenant)
    }

    /// One request of the route's cost by `tenant`: how it was admitted
    /// (`None`: denied), and whether it was a key start.
    pub fn request(&mut self, tenant: &str, now: u64) -> Charged {
        let host = self.worker(tenant);
        let state = shared::read_state(&host).ok().and_then(|(s, _)| s);
        let Ok(prepared) = engine::prepare(&self.policy, &host) else {
            return Charged::default();
        };
        let logical = engine::logical_key(&prepared.class.action, &prepared.subject);
        let plan = self
            .policy
            .plan(prepared.plan)
            .map(|p| p.name.clone())
            .unwrap_or_default();
        let overflow = tenantgate::keys::overflow(&prepared.class.action, &plan);
        let before = self.allowance(&host, logical.as_bytes(), &overflow);
        let Some(scratch) = self.scratch.get_mut(self.next) else {
            return Charged::default();
        };
        let d = engine::charge_synced(&self.policy, &prepared, &host, now, state.as_ref(), scratch);
        let after = self.allowance(&host, logical.as_bytes(), &overflow);
        // The place the request was charged to: its table slot, or the
        // overflow entry when it has none.
        let (was, is) = if after.table.is_some() {
            (before.table, after.table)
        } else {
            (before.overflow, after.overflow)
        };
        let start = was.is_none() && is.is_some();
        let admitted = (d.reason == Reason::Allowed).then(|| {
            let was = was.unwrap_or_else(|| Allowance::fresh(self.provisional()));
            match is {
                Some(a) if a.provisional_left < was.provisional_left => Admitted::Provisional,
                // `consumed` counts every admission, `unleased` those
                // without a lease.
                Some(a) if a.pending.unleased == was.pending.unleased => Admitted::Lease,
                Some(a) if a.local_tat != was.local_tat => Admitted::FailOpenLocal,
                _ => Admitted::FailOpen,
            }
        });
        let retry_after_secs = if admitted.is_some() { 0 } else { d.retry_after_secs };
        let lease_too_small =
            admitted.is_none() && was.and_then(|a| a.lease).is_some_and(|l| now < l.expires_at);
        let charged = admitted.is_some().then_some(engine::Charged {
            limits: d.charged,
            guard: d.guard_charged,
            levels: d.levels_charged,
            at: now,
        });
        Charged {
            admitted,
            start,
            retry_after_secs,
            charged,
            lease_too_small,
        }
    }

    /// One request with `headers` (its identity and level values) on the
    /// route `api`, decided by the engine's charge path with the node's
    /// sync state, on the next worker: the filter's decision.
    pub fn charge(&mut self, headers: &[(&str, &str)], now: u64) -> engine::Decision {
        self.next = (self.next + 1) % WORKERS;
        let host = headers.iter().fold(
            MemoryHost::new(self.store.clone()).route_class("api"),
            |h, (k, v)| h.header(k, *v),
        );
        let state = shared::read_state(&host).ok().and_then(|(s, _)| s);
        let Ok(prepared) = engine::prepare(&self.policy, &host) else {
            return engine::Decision::unavailable();
        };
        let Some(scratch) = self.scratch.get_mut(self.next) else {
            return engine::Decision::unavailable();
        };
        engine::charge_synced(&self.policy, &prepared, &host, now, state.as_ref(), scratch)
    }

    /// Whether the key [`KEY`] holds a live lease at `now`.
    pub fn has_live_lease(&self, now: u64) -> bool {
        let host = MemoryHost::new(self.store.clone());
        let overflow = tenantgate::keys::overflow("api", "free");
        self.allowance(&host, KEY.as_bytes(), &overflow)
            .table
            .and_then(|a| a.lease)
            .is_some_and(|l| now < l.expires_at)
    }

    /// A request of `tenant` admitted with `charged` ended, its real cost
    /// `real`: the difference to its estimate settled by the filter's
    /// `engine::settle` (what it wrote off and what the key owes after).
    pub fn settle(
        &mut self,
        tenant: &str,
        charged: &engine::Charged,
        real: u64,
        now: u64,
    ) -> engine::Adjusted {
        let host = self.worker(tenant);
        let Ok(prepared) = engine::prepare(&self.policy, &host) else {
            return engine::Adjusted::default();
        };
        let difference = if real >= prepared.cost {
            engine::Difference::More(real - prepared.cost)
        } else {
            engine::Difference::Less(prepared.cost - real)
        };
        let Some(scratch) = self.scratch.get_mut(self.next) else {
            return engine::Adjusted::default();
        };
        engine::settle(&self.policy, &prepared, &host, charged, difference, now, scratch)
    }

    fn provisional(&self) -> u64 {
        self.policy.sync.as_ref().map_or(0, |s| s.provisional)
    }

    /// The global allowance stored for `logical` in its table slot, and
    /// the one of its overflow entry.
    fn allowance(&self, host: &MemoryHost, logical: &[u8], overflow: &str) -> Stored {
        let global = |value: &[u8], slot_key: Option<&[u8]>| {
            state::decode_entry(value)?
                .iter()
                .find(|s| slot_key.is_none_or(|k| s.key == k))
                .and_then(|s| state::decode_records(s.records))?
                .iter()
                .find(|r| r.kind == kind::GLOBAL_ALLOWANCE)
                .and_then(|r| stored::decode_allowance(r.state))
        };
        let entries = self.policy.key_table_entries.max(1);
        let home = state::fnv1a64(logical);
        let table = (0..state::PROBES.min(entries)).find_map(|probe| {
            let key = state::entry_key(home.wrapping_add(probe) % entries);
            let (value, _) = host.shared_get(&key).ok()?;
            global(&value?, Some(logical))
        });
        let overflow = host
            .shared_get(overflow)
            .ok()
            .and_then(|(v, _)| v)
            .and_then(|v| global(&v, None));
        Stored { table, overflow }
    }

    /// A worker's tick: when it wins the interval, the whole scan and the
    /// report to send (the glue spreads the scan over ticks; one table
    /// entry here).
    pub fn tick(&mut self, now: u64) -> Option<SyncRequest> {
        let settings = self.policy.sync.clone()?;
        let host = self.worker(TENANT);
        let Ok(Claim::Won { seq, .. }) = shared::claim(&host, &settings, now) else {
            return None;
        };
        let mut scan = Scan::new(seq, now);
        while !shared::scan_step(&host, &self.policy, &mut scan, shared::scan_budget(1)) {}
        let acked = shared::read_state(&host).ok()?.0?.acked_seq;
        if !shared::sent(&host, &scan, now).ok()? {
            return None;
        }
        self.sender = self.next;
        let req = shared::request(&self.policy, &self.node_id, &self.region, acked, &scan);
        self.last_report = Some(req.clone());
        Some(req)
    }

    /// The report in flight again, unchanged, if it is still unanswered
    /// half its callout timeout after it was sent (`shared::hedge`, as the
    /// glue's syncer does).
    pub fn hedge(&mut self, now: u64) -> Option<SyncRequest> {
        let settings = self.policy.sync.clone()?;
        let req = self.last_report.as_ref()?;
        let host = MemoryHost::new(self.store.clone());
        shared::hedge(&host, &settings, req.seq, now)
            .ok()?
            .then(|| req.clone())
    }

    /// The answer, applied by the worker that sent the report: whether it
    /// was (`false`: refused, late or stale).
    pub fn apply(&mut self, resp: &SyncResponse, now: u64) -> bool {
        let Some(settings) = self.policy.sync.clone() else {
            return false;
        };
        let host = MemoryHost::new(self.store.clone());
        apply::apply(&host, &self.policy, &settings, resp, now).is_ok()
    }
}
