//! The pipeline's stats sink on Envoy: each [`Metric`] defined once per
//! worker VM by its name (Envoy's metric ids are the VM's; every VM that
//! defines a name shares one metric), then incremented, recorded or read
//! with the raw hostcalls of [`abi`]. What is counted, when, and how a
//! node-wide gauge is kept is the pipeline's ([`crate::pipeline::stats`]).

use std::collections::HashMap;

use proxy_wasm::types::MetricType;

use super::abi;
use crate::stats::Kind;
use crate::stats::{Metric, Stats};

/// Envoy's metric ids by name (`None`: Envoy refused to define it: the
/// stat is then not kept, and not asked for again).
#[derive(Default)]
pub struct EnvoyStats {
    ids: HashMap<String, Option<u32>>,
    name: String,
}

impl EnvoyStats {
    /// The metric's id, defined on first use.
    fn id(&mut self, metric: &Metric<'_>) -> Option<u32> {
        metric.name(&mut self.name);
        if let Some(id) = self.ids.get(self.name.as_str()) {
            return *id;
        }
        let kind = match metric.kind() {
            Kind::Counter => MetricType::Counter,
            Kind::Gauge => MetricType::Gauge,
            Kind::Histogram => MetricType::Histogram,
        };
        let id = match abi::define_metric(kind, &self.name) {
            Ok(id) => Some(id),
            Err(status) => {
                log::warn!("tenantgate: cannot define metric {}: {status:?}", self.name);
                None
            }
        };
        self.ids.insert(self.name.clone(), id);
        id
    }
}

impl Stats for EnvoyStats {
    fn define(&mut self, metric: &Metric<'_>) {
        let _ = self.id(metric);
    }

    fn add(&mut self, metric: &Metric<'_>, n: i64) {
        if let (Some(id), true) = (self.id(metric), n != 0) {
            // A failed stat update must never fail the request.
            let _ = abi::increment_metric(id, n);
        }
    }

    fn set(&mut self, metric: &Metric<'_>, value: u64) {
        if let Some(id) = self.id(metric) {
            let _ = abi::record_metric(id, value);
        }
    }

    fn get(&mut self, metric: &Metric<'_>) -> Option<u64> {
        abi::get_metric(self.id(metric)?).ok()
    }
}
