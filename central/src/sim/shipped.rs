//! A simulated node that runs the code the filter ships: the engine's
//! charge path and `sync::shared` (claim, scan, request, sent, apply) over
//! the fake host, several workers sharing one shared-data store, with the
//! policy compiled from JSON like the filter's plugin configuration.

use std::cell::RefCell;
use std::rc::Rc;

use tenantgate::engine::{self, Reason};
use tenantgate::policy::Policy;
use tenantgate::sync::shared::{self, Claim, Scan};
use tenantgate::sync::{FailureMode, SyncRequest, SyncResponse};
use tenantgate::testing::{FakeHost, SharedStore};

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

/// The filter's policy for a simulation: one plan with the global limit.
pub fn policy(cfg: &SimConfig, mode: FailureMode, effective_from: u64) -> Result<Policy, ConfigError> {
    let json = format!(
        r#"{{"version": "sim", "identity": {{"header": "x-tenant-id"}},
        "plans": {{"free": {{"limits": [
            {{"name": "{LIMIT}", "rate": {rate}, "per": "{per}s", "burst": {burst}, "global": true}}]}}}},
        "default_plan": "free", "anonymous": {{"plan": "free"}},
        "routes": {{"api": {{"cost": {cost}}}}}, "default_route": "api",
        "key_table": {{"max_keys": 64}},
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
            scratch: Default::default(),
        }
    }

    fn worker(&mut self) -> FakeHost {
        self.next = (self.next + 1) % WORKERS;
        FakeHost::new(self.store.clone())
            .route_class("api")
            .header("x-tenant-id", TENANT)
    }

    /// One request of the route's cost: whether it was admitted.
    pub fn request(&mut self, now: u64) -> bool {
        let host = self.worker();
        let state = shared::read_state(&host).ok().and_then(|(s, _)| s);
        let Ok(prepared) = engine::prepare(&self.policy, &host) else {
            return false;
        };
        let Some(scratch) = self.scratch.get_mut(self.next) else {
            return false;
        };
        let d = engine::charge_synced(&self.policy, &prepared, &host, now, state.as_ref(), scratch);
        d.reason == Reason::Allowed
    }

    /// A worker's tick: when it wins the interval, the whole scan and the
    /// report to send (the glue spreads the scan over ticks; one table
    /// entry here).
    pub fn tick(&mut self, now: u64) -> Option<SyncRequest> {
        let settings = self.policy.sync.clone()?;
        let host = self.worker();
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
        Some(shared::request(
            &self.policy,
            &self.node_id,
            &self.region,
            acked,
            &scan,
        ))
    }

    /// The answer, applied by the worker that sent the report.
    pub fn apply(&mut self, resp: &SyncResponse, now: u64) {
        let Some(settings) = self.policy.sync.clone() else {
            return;
        };
        let host = FakeHost::new(self.store.clone());
        let _ = shared::apply(&host, &self.policy, &settings, resp, now);
    }
}
