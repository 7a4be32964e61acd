//! The nested-levels simulation (`tenantgate_central::sim::nested`) on
//! 3 × 3 and 10 × 10 nodes: one JSON line per topology.
//! `cargo run --release -p tenantgate-central --example nested`.

use tenantgate_central::sim::nested::{run, NestedConfig};
use tenantgate_central::sim::Topology;

fn main() {
    for topology in [Topology::SMALL, Topology::LARGE] {
        let cfg = NestedConfig {
            topology,
            ..NestedConfig::default()
        };
        match run(&cfg) {
            Ok(out) => println!("{}", serde_json::to_string(&out).unwrap_or_default()),
            Err(e) => eprintln!("{}: {e}", topology.name()),
        }
    }
}
