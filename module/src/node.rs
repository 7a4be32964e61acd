//! The process-wide state of the module: one per Envoy process (Envoy loads
//! the library once, whatever the number of configs and routes naming it).
//!
//! * [`Node::store`]: shared data ([`Store`]).
//! * One [`Worker`] per Envoy worker thread (by Envoy's worker index),
//!   each behind its own mutex: its [`Pipeline`] (exactly what a wasm VM
//!   holds), its policy for every live config, and the streams it paused.
//!   A worker's streams run on its thread; its ticks, its sync callouts'
//!   answers and its configuration run on Envoy's main thread. The mutex
//!   makes them take turns; a callback is never run with it held when it
//!   may re-enter the module (a local reply, a resumed request).
//! * The live [`Config`]s, one per filter configuration Envoy holds (a hot
//!   reload makes a new one; Envoy destroys the old one once its last
//!   stream ends).
//!
//! # Ticks
//! Envoy 1.40 gives an HTTP filter no per-worker timer: its timers are the
//! bootstrap extension's and the cluster's (`..._bootstrap_extension_timer_*`,
//! `..._cluster_worker_timer_*` in the binary), and its schedulers post work
//! *now* (`..._http_filter_scheduler_commit` to a stream's worker, bound to
//! that stream; `..._http_filter_config_scheduler_commit` to the main
//! thread). So a module thread ([`start_ticker`]) wakes every
//! [`TICK_NS`] and posts one event to the main thread, which ticks every
//! worker's pipeline in turn (each with each live config's policy, as each
//! wasm root context ticks its VM). A tick is therefore late by at most
//! the main thread's queue, and never waits for traffic: an idle worker
//! still gives its leases back, its counts to Envoy, its gauges their
//! value. Sync callouts are sent from the main thread (the config's
//! callout, the one that may be sent outside a stream) and their answers
//! come back to it. A held stream's answer is posted to its own worker
//! with the scheduler made when it was paused, and applied there.
//!
//! # One island per worker
//! A [`Worker`] holds `Rc`s (a policy and what refers to it) and is moved
//! between two threads, its own and the main thread. It is `Send` by the
//! argument that makes moving a whole `Rc` graph sound: every `Rc` it
//! holds points into memory only this worker's state reaches (its policies
//! are compiled for it, by [`Pipeline::configure`] on this worker; nothing
//! it returns holds an `Rc`), and it is only ever touched under its mutex.

use std::collections::HashMap as StdHashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock};
use std::time::Duration;

use hashbrown::HashMap;
use tenantgate::pipeline::{Answer, Callout, Directive, Pipeline, StreamId, TICK_NS};
use tenantgate::policy::Policy;
use tenantgate::stats::{Metric, Stats};
use tenantgate::sync::syncer::CalloutAnswer;

use crate::abi::{self, HttpFilterConfigEnvoy, HttpFilterConfigScheduler, HttpFilterScheduler, ModuleBuffer};
use crate::host::{EnvoyHost, Identity, SystemClock};
use crate::stats::{Metrics, ModuleStats};
use crate::store::Store;
use tenantgate::pipeline::failure::Failure;

/// The module's own counter of entry points that panicked (caught, turned
/// into the failure mode; see `lib.rs`).
pub const PANICS_METRIC: &str = "tenantgate.module.panics";
/// The config scheduler's event: tick every worker.
const TICK_EVENT: u64 = 1;

/// The process-wide state (see the module header).
pub struct Node {
    pub store: Store,
    pub identity: Identity,
    workers: OnceLock<Box<[Mutex<Worker>]>>,
    configs: Mutex<Vec<Arc<Config>>>,
    next_config: AtomicU64,
    next_token: AtomicU32,
    tick_pending: AtomicBool,
    ticker: Once,
}

/// The node (made on first use).
pub fn node() -> &'static Node {
    static NODE: OnceLock<Node> = OnceLock::new();
    NODE.get_or_init(|| Node {
        store: Store::default(),
        identity: Identity::from_env(),
        workers: OnceLock::new(),
        configs: Mutex::new(Vec::new()),
        next_config: AtomicU64::new(1),
        next_token: AtomicU32::new(1),
        tick_pending: AtomicBool::new(false),
        ticker: Once::new(),
    })
}

/// A stream this worker paused: how to reach it, and its answer once made.
pub struct Held {
    scheduler: Scheduler,
    /// The directive to apply on the stream's worker (taken there).
    pub answer: Option<Directive>,
    config: u64,
}

/// A stream's scheduler (deleted on drop, under its worker's mutex, so a
/// commit from the main thread never meets a deleted one).
struct Scheduler(HttpFilterScheduler);

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: made by `scheduler_new`, deleted once, here.
        unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_delete(self.0) }
    }
}

/// One Envoy worker's state (see the module header).
#[derive(Default)]
pub struct Worker {
    pub pipeline: Pipeline,
    /// This worker's compiled policy of each live config, by config id.
    pub policies: HashMap<u64, Rc<Policy>>,
    pub held: HashMap<StreamId, Held>,
}

// SAFETY: see "One island per worker" in the module header: every `Rc` a
// worker holds points into its own state, and it is touched only under its
// mutex; its schedulers' callbacks are thread-safe by the ABI.
unsafe impl Send for Worker {}

impl Worker {
    /// Remembers a stream the pipeline paused, with a scheduler to reach it.
    pub fn hold(&mut self, stream: StreamId, filter: abi::HttpFilterEnvoy, config: u64) {
        if self.held.contains_key(&stream) {
            return;
        }
        // SAFETY: `filter` is the current hook's stream, on its worker.
        let scheduler = unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_new(filter) };
        if scheduler.is_null() {
            log::error!("tenantgate: no scheduler for a held request: it waits for its timeout");
            return;
        }
        self.held.insert(
            stream,
            Held {
                scheduler: Scheduler(scheduler),
                answer: None,
                config,
            },
        );
    }

    /// Posts each answer to its stream's worker (applied there, see
    /// `lib.rs`'s `on_http_filter_scheduled`).
    pub fn deliver(&mut self, answers: Vec<Answer>) {
        for a in answers {
            match self.held.get_mut(&a.stream) {
                Some(h) => {
                    h.answer = Some(a.directive);
                    // SAFETY: the scheduler is alive (deleted only under
                    // this worker's mutex, which the caller holds).
                    unsafe {
                        abi::envoy_dynamic_module_callback_http_filter_scheduler_commit(
                            h.scheduler.0,
                            u64::from(a.stream),
                        );
                    }
                }
                None => log::warn!("tenantgate: an answer for stream {} that is not held", a.stream),
            }
        }
    }
}

/// One filter configuration (one policy) as Envoy holds it.
pub struct Config {
    pub id: u64,
    /// Envoy's config object: alive until `on_http_filter_config_destroy`.
    pub envoy: HttpFilterConfigEnvoy,
    pub json: Box<[u8]>,
    pub metrics: Metrics,
    pub failure: Failure,
    scheduler: HttpFilterConfigScheduler,
    /// Sync callouts in flight: Envoy's callout id → (worker, the token
    /// the worker's pipeline knows it by). Main thread only.
    callouts: Mutex<StdHashMap<u64, (usize, u32)>>,
}

// SAFETY: `envoy` and `scheduler` are Envoy's objects, used as the ABI
// allows: the scheduler from any thread, everything else on the main
// thread, except the metric callbacks (see `stats.rs`).
unsafe impl Send for Config {}
// SAFETY: as for `Send` above.
unsafe impl Sync for Config {}

impl Config {
    pub fn stats(&self) -> ModuleStats<'_> {
        ModuleStats::new(&self.metrics)
    }

    /// Counts a caught panic.
    pub fn count_panic(&self) {
        self.metrics.add(PANICS_METRIC, 1);
    }
}

/// Locks a mutex whatever a panic left in it (the caller repairs).
fn lock<T>(m: &Mutex<T>) -> (MutexGuard<'_, T>, bool) {
    match m.lock() {
        Ok(g) => (g, false),
        Err(poisoned) => {
            m.clear_poison();
            (poisoned.into_inner(), true)
        }
    }
}

impl Node {
    /// The workers (empty until the first config).
    fn workers(&self) -> &[Mutex<Worker>] {
        self.workers.get().map_or(&[], |w| w)
    }

    /// Locks worker `index` (of the filter's stream); a worker a panic
    /// left mid-change is [`Node::reset`] first.
    pub fn worker(&self, index: usize) -> Option<MutexGuard<'_, Worker>> {
        let workers = self.workers();
        let cell = workers
            .get(index)
            .or_else(|| workers.get(index % workers.len().max(1)))?;
        let (mut guard, poisoned) = lock(cell);
        if poisoned {
            self.reset(&mut guard);
        }
        Some(guard)
    }

    /// The live configs, newest last.
    pub fn configs(&self) -> Vec<Arc<Config>> {
        lock(&self.configs).0.clone()
    }

    /// A new config (main thread): the policy compiled once to refuse a bad
    /// one (Envoy keeps the one in force), then on every worker. `Err`:
    /// refused, with the reasons logged.
    pub fn configure(&'static self, envoy: HttpFilterConfigEnvoy, json: &[u8]) -> Result<Arc<Config>, ()> {
        let metrics = Metrics::new(envoy);
        let mut stats = ModuleStats::new(&metrics);
        for m in Metric::fixed() {
            stats.define(&m);
        }
        metrics.define(PANICS_METRIC, tenantgate::stats::Kind::Counter);
        let policy = match Policy::from_json(json) {
            Ok(p) => p,
            Err(errors) => {
                for e in &errors.0 {
                    log::error!("tenantgate: policy rejected: {e}");
                }
                stats.add(&Metric::ConfigRejections, 1);
                return Err(());
            }
        };
        if let Err(why) = crate::supported(&policy) {
            log::error!("tenantgate: policy rejected: {why}");
            stats.add(&Metric::ConfigRejections, 1);
            return Err(());
        }
        // The metrics its policy names, defined on this config too: a twin
        // (below) shares a compiled policy but not its config's metrics,
        // and a worker's counts reach Envoy through whichever config ticks
        // first (the newest), so each config defines them all.
        for m in tenantgate::stats::policy_metrics(&policy) {
            stats.define(&m);
        }
        // SAFETY: on the main thread, as the callback requires.
        let concurrency = unsafe { abi::envoy_dynamic_module_callback_get_concurrency() };
        let workers = usize::try_from(concurrency).unwrap_or(1).max(1);
        self.workers
            .get_or_init(|| (0..workers).map(|_| Mutex::new(Worker::default())).collect());
        let id = self.next_config.fetch_add(1, Ordering::Relaxed);
        let host = EnvoyHost::tick(&self.store, &self.identity);
        // A config with the same policy as a live one (every listener that
        // names the same ECDS resource gets its own config) shares its
        // compiled policy on each worker: one policy, one set of worker
        // leases, one tick (as a wasm VM's one root context for them).
        let twin = self.configs().into_iter().rev().find(|c| *c.json == *json);
        for index in 0..self.workers().len() {
            let Some(mut w) = self.worker(index) else { continue };
            let shared = twin.as_ref().and_then(|t| w.policies.get(&t.id).cloned());
            let policy = match shared {
                Some(p) => p,
                None => match w.pipeline.configure(&host, &SystemClock, &mut stats, json) {
                    Ok(p) => p,
                    Err(_) => {
                        drop(w);
                        self.forget(id);
                        return Err(());
                    }
                },
            };
            w.policies.insert(id, policy);
        }
        log::info!(
            "tenantgate: policy {} loaded on {} workers ({} plans, mode {:?})",
            policy.version,
            self.workers().len(),
            policy.plans().len(),
            policy.mode
        );
        metrics.freeze();
        // SAFETY: `envoy` is the config being created, on the main thread.
        let scheduler = unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(envoy) };
        let config = Arc::new(Config {
            id,
            envoy,
            json: json.into(),
            metrics,
            failure: Failure::of(&policy),
            scheduler,
            callouts: Mutex::new(StdHashMap::new()),
        });
        lock(&self.configs).0.push(config.clone());
        self.ticker.call_once(|| start_ticker(self));
        Ok(config)
    }

    /// Envoy destroyed a config (main thread): its policies leave every
    /// worker (requests held under it keep their own reference).
    pub fn remove(&self, config: &Config) {
        {
            let (mut configs, _) = lock(&self.configs);
            configs.retain(|c| c.id != config.id);
            // SAFETY: made in `configure`; the ticker commits only to
            // configs in the list, under this lock.
            unsafe {
                abi::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(config.scheduler)
            };
        }
        self.forget(config.id);
    }

    /// Drops config `id`'s policy from every worker.
    fn forget(&self, id: u64) {
        for index in 0..self.workers().len() {
            if let Some(mut w) = self.worker(index) {
                w.policies.remove(&id);
            }
        }
    }

    /// A worker a panic interrupted, made new (as a crashed wasm VM is):
    /// a fresh pipeline configured with every live config, each stream it
    /// held answered with its config's failure mode. What the old pipeline
    /// held in shared data comes back by its lease (2 s, see
    /// `tenantgate::admission`); its worker leases' units are lost (fewer
    /// admissions, never more).
    fn reset(&self, w: &mut Worker) {
        log::error!("tenantgate: a worker's pipeline is reset after a panic");
        w.pipeline = Pipeline::default();
        w.policies.clear();
        let host = EnvoyHost::tick(&self.store, &self.identity);
        let configs = self.configs();
        for (i, c) in configs.iter().enumerate() {
            let twin = configs[..i].iter().find(|t| t.json == c.json);
            let shared = twin.and_then(|t| w.policies.get(&t.id).cloned());
            let policy = match shared {
                Some(p) => Some(p),
                None => w
                    .pipeline
                    .configure(&host, &SystemClock, &mut c.stats(), &c.json)
                    .ok(),
            };
            if let Some(p) = policy {
                w.policies.insert(c.id, p);
            }
        }
        let answers: Vec<Answer> = w
            .held
            .iter()
            .filter(|(_, h)| h.answer.is_none())
            .map(|(stream, h)| Answer {
                stream: *stream,
                directive: configs
                    .iter()
                    .find(|c| c.id == h.config)
                    .map_or_else(Directive::go, |c| c.failure.directive(None)),
            })
            .collect();
        w.deliver(answers);
    }

    /// Every worker's tick (main thread; see "Ticks"): once per period
    /// with each distinct policy of the live configs, newest first.
    pub fn tick(&self) {
        self.tick_pending.store(false, Ordering::Release);
        let configs = self.configs();
        let host = EnvoyHost::tick(&self.store, &self.identity);
        for index in 0..self.workers().len() {
            // By address: no `Rc` of the worker's may leave its lock.
            let mut ticked: Vec<*const Policy> = Vec::new();
            for config in configs.iter().rev() {
                let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let Some(mut w) = self.worker(index) else { return };
                    let Some(policy) = w.policies.get(&config.id).cloned() else {
                        return;
                    };
                    if ticked.contains(&Rc::as_ptr(&policy)) {
                        return;
                    }
                    ticked.push(Rc::as_ptr(&policy));
                    #[cfg(feature = "test-faults")]
                    crate::fault::tick();
                    self.tick_one(&mut w, index, config, &policy, &host);
                }));
                if done.is_err() {
                    config.count_panic();
                    // Resets the worker the panic left locked mid-tick.
                    drop(self.worker(index));
                }
            }
        }
    }

    fn tick_one(
        &self,
        w: &mut Worker,
        index: usize,
        config: &Config,
        policy: &Rc<Policy>,
        host: &EnvoyHost<'_>,
    ) {
        let policy = policy.clone();
        let mut stats = config.stats();
        w.pipeline.on_tick(host, &SystemClock, &mut stats, Some(&policy));
        for callout in w.pipeline.take_callouts() {
            let token = self.send(config, index, &callout);
            w.pipeline
                .dispatched(host, &SystemClock, &mut stats, &policy, &callout, token);
        }
        let answers = w.pipeline.take_answers();
        w.deliver(answers);
    }

    /// Sends a sync callout through `config` (main thread); `Ok(token)`:
    /// sent, its answer to go to worker `index` under `token`.
    fn send(&self, config: &Config, index: usize, c: &Callout) -> Result<u32, ()> {
        let headers = c.headers();
        let mut raw: Vec<abi::ModuleHttpHeader> = headers
            .iter()
            .map(|(k, v)| abi::ModuleHttpHeader::of(k, v.as_bytes()))
            .collect();
        let timeout_ms = c.timeout_ns / 1_000_000;
        let mut id = 0u64;
        // SAFETY: on the main thread with the config alive; every buffer is
        // ours and outlives the call.
        let result = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_config_http_callout(
                config.envoy,
                &mut id,
                ModuleBuffer::of(c.cluster.as_bytes()),
                raw.as_mut_ptr(),
                raw.len(),
                ModuleBuffer::of(&c.body),
                timeout_ms.max(1),
            )
        };
        if result != abi::CALLOUT_INIT_SUCCESS {
            log::warn!("tenantgate: cannot call sync cluster {}: {result}", c.cluster);
            return Err(());
        }
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        lock(&config.callouts).0.insert(id, (index, token));
        Ok(token)
    }

    /// A sync callout's answer (main thread), to the worker that sent it.
    pub fn callout_done(&self, config: &Config, id: u64, answer: &impl CalloutAnswer) {
        let Some((index, token)) = lock(&config.callouts).0.remove(&id) else {
            return;
        };
        let host = EnvoyHost::tick(&self.store, &self.identity);
        let Some(mut w) = self.worker(index) else { return };
        let Some(policy) = w.policies.get(&config.id).cloned() else {
            return;
        };
        let mut stats = config.stats();
        w.pipeline
            .on_sync_answer(&host, &SystemClock, &mut stats, &policy, token, answer);
        let answers = w.pipeline.take_answers();
        w.deliver(answers);
    }
}

/// The module's ticker thread (see "Ticks"): every [`TICK_NS`], one event to
/// the main thread through the newest config's scheduler, unless the last
/// one has not run yet.
fn start_ticker(node: &'static Node) {
    let spawned = std::thread::Builder::new()
        .name(String::from("tenantgate-tick"))
        .spawn(move || loop {
            std::thread::sleep(Duration::from_nanos(TICK_NS));
            if node.tick_pending.swap(true, Ordering::AcqRel) {
                continue;
            }
            let (configs, _) = lock(&node.configs);
            match configs.last() {
                // SAFETY: the scheduler is deleted only under this lock.
                Some(c) => unsafe {
                    abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                        c.scheduler,
                        TICK_EVENT,
                    )
                },
                None => node.tick_pending.store(false, Ordering::Release),
            }
        });
    if let Err(e) = spawned {
        log::error!("tenantgate: cannot start the tick thread: {e}");
    }
}
