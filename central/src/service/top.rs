//! Who is being limited right now: the heaviest limit keys by demand and by
//! denials, per region, in bounded memory (`GET /v1/top?k=N` on the admin
//! listener; `tenantgate top` shows it).
//!
//! **Sketch.** Per region and per measure (demand, denials) a Space-Saving
//! summary (Metwally et al.) of [`CAPACITY`] counters: a key already
//! counted adds its weight; a new key takes a free counter, or else the
//! smallest one, inheriting its count as its `error`. Every key whose true
//! (decayed) weight exceeds `total / CAPACITY` is in the summary, and each
//! reported count over-estimates the truth by at most its `error` (shown).
//! Weights decay: every [`HALF_LIFE_NS`] of the service clock every count
//! and error is halved, so the view follows the present (a uniform scale
//! keeps the summary's guarantees).
//!
//! **Bounds.** At most [`MAX_REGIONS`] regions are kept (later ones are
//! folded into [`OTHER_REGION`]); each holds `2 × CAPACITY` counters of a
//! key of at most the protocol's key length: under 64 × 2 × 256 counters
//! (≈ 32,768, a few MiB at the longest keys) whatever the number of
//! tenants. A report of a counted key costs one hash lookup; a new key
//! takes the smallest counter from a min-heap of the counts (entries a later
//! increment made stale are skipped, and the heap is rebuilt once it holds
//! four entries per counter), O(log CAPACITY) amortized.
//!
//! **What is counted.** Each accepted sync report's new `demand` and
//! denials (`demand − consumed`, saturating), after the allocator's
//! deduplication: a node that retries a report whose answer it lost
//! reports the same counts again, and only what was not counted before is
//! added (a stale or replayed request adds nothing).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::{Arc, Mutex};

use hashbrown::HashMap;

use serde::Serialize;

/// One (key, limit)'s new counts in an accepted sync request.
#[derive(Debug, Clone, Copy)]
pub struct Seen<'a> {
    pub key: &'a str,
    pub demand: u64,
    pub consumed: u64,
}

/// Counters per region and measure.
pub const CAPACITY: usize = 256;
/// Regions kept apart; beyond, they share [`OTHER_REGION`].
pub const MAX_REGIONS: usize = 64;
/// The region that regions beyond [`MAX_REGIONS`] are counted in.
pub const OTHER_REGION: &str = "(other)";
/// Counts halve every this much service time.
pub const HALF_LIFE_NS: u64 = 60_000_000_000;
/// Most entries one `/v1/top` answer lists per region and measure (and the
/// default of its `k`).
pub const MAX_K: usize = 100;
pub const DEFAULT_K: usize = 20;

#[derive(Debug, Clone, PartialEq)]
struct Counter {
    /// Shared with the index: one allocation per key taken in.
    key: Arc<str>,
    count: f64,
    error: f64,
}

/// One Space-Saving summary.
#[derive(Debug, Default)]
struct Summary {
    counters: Vec<Counter>,
    /// A counter's position by its key.
    index: HashMap<Arc<str>, usize>,
    /// (count's bits, position) of every counter, and stale entries a later
    /// increment left (counts are never negative, so their bits order like
    /// them).
    heap: BinaryHeap<Reverse<(u64, usize)>>,
    total: f64,
}

impl Summary {
    fn add(&mut self, key: &str, weight: f64) {
        if weight <= 0.0 {
            return;
        }
        self.total += weight;
        if let Some(&i) = self.index.get(key) {
            if let Some(c) = self.counters.get_mut(i) {
                c.count += weight;
                self.heap.push(Reverse((c.count.to_bits(), i)));
            }
            if self.heap.len() > 4 * CAPACITY {
                self.rebuild_heap();
            }
            return;
        }
        if self.counters.len() < CAPACITY {
            self.heap.push(Reverse((weight.to_bits(), self.counters.len())));
            let key: Arc<str> = Arc::from(key);
            self.index.insert(key.clone(), self.counters.len());
            self.counters.push(Counter {
                key,
                count: weight,
                error: 0.0,
            });
            return;
        }
        let Some(i) = self.smallest() else {
            return;
        };
        if let Some(c) = self.counters.get_mut(i) {
            let floor = c.count;
            self.index.remove(&c.key);
            let key: Arc<str> = Arc::from(key);
            *c = Counter {
                key: key.clone(),
                count: floor + weight,
                error: floor,
            };
            self.index.insert(key, i);
            self.heap.push(Reverse((c.count.to_bits(), i)));
        }
    }

    /// The position of the smallest counter (its heap entry is taken).
    fn smallest(&mut self) -> Option<usize> {
        while let Some(Reverse((bits, i))) = self.heap.pop() {
            if self.counters.get(i).is_some_and(|c| c.count.to_bits() == bits) {
                return Some(i);
            }
        }
        None
    }

    fn rebuild_heap(&mut self) {
        self.heap = self
            .counters
            .iter()
            .enumerate()
            .map(|(i, c)| Reverse((c.count.to_bits(), i)))
            .collect();
    }

    fn scale(&mut self, factor: f64) {
        self.total *= factor;
        for c in &mut self.counters {
            c.count *= factor;
            c.error *= factor;
        }
        // Counters decayed to nothing free their place.
        self.counters.retain(|c| c.count >= 0.5);
        self.index = self
            .counters
            .iter()
            .enumerate()
            .map(|(i, c)| (c.key.clone(), i))
            .collect();
        self.rebuild_heap();
    }

    fn top(&self, k: usize) -> Vec<Entry> {
        let mut v: Vec<&Counter> = self.counters.iter().collect();
        v.sort_by(|a, b| b.count.total_cmp(&a.count).then_with(|| a.key.cmp(&b.key)));
        v.into_iter()
            .take(k)
            .map(|c| Entry {
                key: c.key.to_string(),
                count: c.count.round() as u64,
                error: c.error.round() as u64,
            })
            .collect()
    }
}

#[derive(Debug, Default)]
struct Region {
    demand: Summary,
    denials: Summary,
    reports: u64,
    last_report_ns: u64,
}

#[derive(Debug, Default)]
struct Inner {
    regions: BTreeMap<String, Region>,
    /// The service time the counts were last halved at.
    decayed_at_ns: u64,
}

/// The service's top-K view (see the module header).
#[derive(Debug, Default)]
pub struct Top {
    inner: Mutex<Inner>,
}

/// One key in a `/v1/top` list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Entry {
    pub key: String,
    /// Decayed units (over-estimated by at most `error`).
    pub count: u64,
    pub error: u64,
}

/// One region in a `/v1/top` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegionTop {
    pub region: String,
    /// Sync requests accepted from the region's nodes.
    pub reports: u64,
    /// Service-clock milliseconds since the region's last accepted sync.
    pub last_sync_ms_ago: u64,
    pub by_demand: Vec<Entry>,
    pub by_denials: Vec<Entry>,
}

impl Top {
    /// Counts one accepted sync request's reports.
    pub fn record<'a>(&self, region: &str, seen: impl IntoIterator<Item = Seen<'a>>, now_ns: u64) {
        let Ok(mut inner) = self.inner.lock() else { return };
        inner.decay(now_ns);
        let name = if inner.regions.contains_key(region) || inner.regions.len() < MAX_REGIONS {
            region
        } else {
            OTHER_REGION
        };
        let r = inner.regions.entry(name.to_owned()).or_default();
        r.reports = r.reports.saturating_add(1);
        r.last_report_ns = now_ns;
        for s in seen {
            r.demand.add(s.key, s.demand as f64);
            r.denials.add(s.key, s.demand.saturating_sub(s.consumed) as f64);
        }
    }

    /// The `k` heaviest keys of every region (`k` at most [`MAX_K`]).
    pub fn snapshot(&self, k: usize, now_ns: u64) -> Vec<RegionTop> {
        let k = k.min(MAX_K);
        let Ok(mut inner) = self.inner.lock() else {
            return Vec::new();
        };
        inner.decay(now_ns);
        inner
            .regions
            .iter()
            .map(|(name, r)| RegionTop {
                region: name.clone(),
                reports: r.reports,
                last_sync_ms_ago: now_ns.saturating_sub(r.last_report_ns) / 1_000_000,
                by_demand: r.demand.top(k),
                by_denials: r.denials.top(k),
            })
            .collect()
    }

    /// Counters held (for tests of the bound).
    pub fn counters(&self) -> usize {
        self.inner.lock().map_or(0, |i| {
            i.regions
                .values()
                .map(|r| r.demand.counters.len() + r.denials.counters.len())
                .sum()
        })
    }
}

impl Inner {
    fn decay(&mut self, now_ns: u64) {
        if self.decayed_at_ns == 0 || now_ns < self.decayed_at_ns {
            self.decayed_at_ns = now_ns;
            return;
        }
        let halvings = (now_ns - self.decayed_at_ns) / HALF_LIFE_NS;
        if halvings == 0 {
            return;
        }
        let factor = 0.5f64.powi(halvings.min(64) as i32);
        for r in self.regions.values_mut() {
            r.demand.scale(factor);
            r.denials.scale(factor);
        }
        self.decayed_at_ns = self
            .decayed_at_ns
            .saturating_add(halvings.saturating_mul(HALF_LIFE_NS));
    }
}

/// `GET /v1/top?k=N` (admin listener): the top-K per region, the sketch's
/// parameters and sync health (requests by result), as JSON.
pub async fn handler(
    axum::extract::State(service): axum::extract::State<std::sync::Arc<super::Service>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let k = query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .find_map(|kv| kv.strip_prefix("k="))
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(DEFAULT_K)
        .min(MAX_K);
    let now = service.now_ns();
    let by_result: serde_json::Map<String, serde_json::Value> = super::metrics::Outcome::ALL
        .iter()
        .map(|o| (o.label().to_owned(), service.metrics.requests(*o).into()))
        .collect();
    let body = serde_json::json!({
        "k": k,
        "capacity": CAPACITY,
        "max_regions": MAX_REGIONS,
        "half_life_s": HALF_LIFE_NS / 1_000_000_000,
        "policy_version": service.config().map(|c| c.policy_version.clone()),
        "sync_requests": by_result,
        "regions": service.top.snapshot(k, now),
    });
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(key: &str, demand: u64, consumed: u64) -> Seen<'_> {
        Seen {
            key,
            demand,
            consumed,
        }
    }

    #[test]
    fn heavy_keys_are_found_among_a_flood_of_distinct_tenants_in_bounded_memory() {
        let top = Top::default();
        let now = 1_000_000_000;
        // 100,000 distinct tenants with 1 unit each, and three heavy ones.
        for i in 0..100_000u64 {
            let tenant = format!("api|t|tenant-{i}");
            let mut reps = vec![report(&tenant, 1, 1)];
            if i % 100 == 0 {
                reps.push(report("api|t|heavy-a", 30, 10));
                reps.push(report("api|t|heavy-b", 20, 20));
                reps.push(report("api|t|heavy-c", 10, 0));
            }
            top.record("eu", reps, now);
        }
        assert!(top.counters() <= 2 * CAPACITY, "{}", top.counters());
        let snap = top.snapshot(3, now);
        let eu = &snap[0];
        let keys: Vec<&str> = eu.by_demand.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(keys, ["api|t|heavy-a", "api|t|heavy-b", "api|t|heavy-c"]);
        // Over-estimated by at most the error shown.
        let a = &eu.by_demand[0];
        assert!(a.count - a.error <= 30_000 && a.count >= 30_000, "{a:?}");
        let denied: Vec<&str> = eu.by_denials.iter().map(|e| e.key.as_str()).take(2).collect();
        assert_eq!(denied, ["api|t|heavy-a", "api|t|heavy-c"]);
    }

    #[test]
    fn regions_are_bounded_and_counts_decay() {
        let top = Top::default();
        let now = 1_000_000_000;
        for r in 0..(MAX_REGIONS + 10) {
            top.record(&format!("r{r}"), [report("k", 8, 0)], now);
        }
        let snap = top.snapshot(5, now);
        assert_eq!(snap.len(), MAX_REGIONS + 1);
        let other = snap.iter().find(|r| r.region == OTHER_REGION).unwrap();
        assert_eq!(other.by_demand[0].count, 80);
        let later = top.snapshot(5, now + 2 * HALF_LIFE_NS);
        let other = later.iter().find(|r| r.region == OTHER_REGION).unwrap();
        assert_eq!(other.by_demand[0].count, 20);
        assert_eq!(other.last_sync_ms_ago, 120_000);
        assert!(top
            .snapshot(1_000, now)
            .iter()
            .all(|r| r.by_demand.len() <= MAX_K));
    }
}
