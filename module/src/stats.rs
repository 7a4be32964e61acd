//! The pipeline's stats sink on the module: Envoy's metrics through the
//! config's metric callbacks.
//!
//! Envoy 1.40 lets a dynamic module define metrics only while its config
//! is created (`on_http_filter_config_new`; later definitions answer
//! `Frozen`), so a config defines every metric the filter reports
//! ([`Metric::fixed`]) and those its policy names
//! ([`tenantgate::stats::policy_metrics`], through `Pipeline::configure`)
//! then, and a metric first met later is dropped, never a failure. Metric
//! ids belong to the config that defined them; configs that define one
//! name share one Envoy metric, as wasm VMs do. With
//! `metrics_namespace: wasmcustom` (what `tenantgate policy apply --module`
//! writes), the names are the wasm filter's: `wasmcustom.tenantgate.*` in
//! `/stats`, `tenantgate_*` in `/stats/prometheus`, so one dashboard
//! serves both hosts.
//!
//! **A gauge's value, node-wide.** The ABI has no read of a metric, and
//! the pipeline reads a few gauges back ([`Stats::get`]): every change the
//! module makes to a gauge is mirrored in process memory (one map for the
//! process, as the gauge is one for the node), and `get` reads the mirror.
//!
//! Counters are atomic in Envoy and the config's metric table is frozen
//! before any worker sees it, so any thread may add; histograms are
//! recorded on Envoy's own threads only (the main thread's tick, a
//! worker's stream), as Envoy's thread-local histograms require.

use std::sync::{Mutex, OnceLock, PoisonError};

use hashbrown::HashMap;
use tenantgate::stats::{Kind, Metric, Stats};

use crate::abi::{self, HttpFilterConfigEnvoy, ModuleBuffer};

/// A metric's id in its config, by kind.
#[derive(Debug, Clone, Copy)]
enum Id {
    Counter(usize),
    Gauge(usize),
    Histogram(usize),
}

/// One config's metrics: ids by full name (`None`: Envoy refused it).
pub struct Metrics {
    config: HttpFilterConfigEnvoy,
    ids: Mutex<HashMap<String, Option<Id>>>,
    frozen: std::sync::atomic::AtomicBool,
}

// SAFETY: `config` is Envoy's config object, alive until the config is
// destroyed (the module drops its `Metrics` then); its metric callbacks are
// thread-safe once definitions are frozen (see the module header).
unsafe impl Send for Metrics {}
// SAFETY: as for `Send` above.
unsafe impl Sync for Metrics {}

/// The process's gauges as the module set them (see the module header).
fn gauges() -> &'static Mutex<HashMap<String, i64>> {
    static GAUGES: OnceLock<Mutex<HashMap<String, i64>>> = OnceLock::new();
    GAUGES.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Metrics {
    pub fn new(config: HttpFilterConfigEnvoy) -> Metrics {
        Metrics {
            config,
            ids: Mutex::new(HashMap::new()),
            frozen: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Ends the definitions (Envoy refuses later ones).
    pub fn freeze(&self) {
        self.frozen.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Defines a metric by its full name (while not frozen).
    pub fn define(&self, name: &str, kind: Kind) {
        let mut ids = self.ids.lock().unwrap_or_else(PoisonError::into_inner);
        if ids.contains_key(name) || self.frozen.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let define = match kind {
            Kind::Counter => abi::envoy_dynamic_module_callback_http_filter_config_define_counter,
            Kind::Gauge => abi::envoy_dynamic_module_callback_http_filter_config_define_gauge,
            Kind::Histogram => abi::envoy_dynamic_module_callback_http_filter_config_define_histogram,
        };
        let mut id = 0usize;
        // SAFETY: `config` is alive; no labels; `id` is ours.
        let result = unsafe {
            define(
                self.config,
                ModuleBuffer::of(name.as_bytes()),
                std::ptr::null_mut(),
                0,
                &mut id,
            )
        };
        let id = (result == abi::METRICS_SUCCESS).then_some(match kind {
            Kind::Counter => Id::Counter(id),
            Kind::Gauge => Id::Gauge(id),
            Kind::Histogram => Id::Histogram(id),
        });
        if id.is_none() {
            log::warn!("tenantgate: Envoy refused to define metric {name} ({result})");
        }
        ids.insert(name.to_owned(), id);
    }

    fn id(&self, name: &str) -> Option<Id> {
        let ids = self.ids.lock().unwrap_or_else(PoisonError::into_inner);
        ids.get(name).copied().flatten()
    }

    /// Adds to a counter (`n` > 0) or a gauge (either sign).
    pub fn add(&self, name: &str, n: i64) {
        let Some(id) = self.id(name) else { return };
        let config = self.config;
        let magnitude = n.unsigned_abs();
        // SAFETY: `config` is alive and the id is its own; no labels.
        unsafe {
            match id {
                Id::Counter(id) if n > 0 => {
                    abi::envoy_dynamic_module_callback_http_filter_config_increment_counter(
                        config,
                        id,
                        std::ptr::null_mut(),
                        0,
                        magnitude,
                    );
                }
                Id::Gauge(id) => {
                    let change = if n >= 0 {
                        abi::envoy_dynamic_module_callback_http_filter_config_increment_gauge
                    } else {
                        abi::envoy_dynamic_module_callback_http_filter_config_decrement_gauge
                    };
                    change(config, id, std::ptr::null_mut(), 0, magnitude);
                    let mut g = gauges().lock().unwrap_or_else(PoisonError::into_inner);
                    let v = g.entry(name.to_owned()).or_insert(0);
                    *v = v.saturating_add(n);
                }
                _ => {}
            }
        }
    }

    /// Sets a gauge or records a histogram's sample.
    pub fn set(&self, name: &str, value: u64) {
        let Some(id) = self.id(name) else { return };
        // SAFETY: as in `add`.
        unsafe {
            match id {
                Id::Gauge(id) => {
                    abi::envoy_dynamic_module_callback_http_filter_config_set_gauge(
                        self.config,
                        id,
                        std::ptr::null_mut(),
                        0,
                        value,
                    );
                    let mut g = gauges().lock().unwrap_or_else(PoisonError::into_inner);
                    g.insert(name.to_owned(), i64::try_from(value).unwrap_or(i64::MAX));
                }
                Id::Histogram(id) => {
                    abi::envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
                        self.config,
                        id,
                        std::ptr::null_mut(),
                        0,
                        value,
                    );
                }
                Id::Counter(_) => {}
            }
        }
    }

    /// A gauge's value as the module last left it, node-wide.
    pub fn get(&self, name: &str) -> Option<u64> {
        let g = gauges().lock().unwrap_or_else(PoisonError::into_inner);
        g.get(name).map(|v| u64::try_from(*v).unwrap_or(0))
    }
}

/// [`Stats`] over one config's [`Metrics`].
pub struct ModuleStats<'a> {
    metrics: &'a Metrics,
    name: String,
}

impl<'a> ModuleStats<'a> {
    pub fn new(metrics: &'a Metrics) -> ModuleStats<'a> {
        ModuleStats {
            metrics,
            name: String::with_capacity(64),
        }
    }
}

impl Stats for ModuleStats<'_> {
    fn define(&mut self, metric: &Metric<'_>) {
        metric.name(&mut self.name);
        self.metrics.define(&self.name, metric.kind());
    }

    fn add(&mut self, metric: &Metric<'_>, n: i64) {
        if n != 0 {
            metric.name(&mut self.name);
            self.metrics.add(&self.name, n);
        }
    }

    fn set(&mut self, metric: &Metric<'_>, value: u64) {
        metric.name(&mut self.name);
        self.metrics.set(&self.name, value);
    }

    fn get(&mut self, metric: &Metric<'_>) -> Option<u64> {
        metric.name(&mut self.name);
        self.metrics.get(&self.name)
    }
}
