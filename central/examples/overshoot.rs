//! The overshoot table of `docs/global-limits.md` (issue 35): measured
//! overshoot against the sync interval and the number of nodes at 1,000
//! requests per second, beside THE BOUND. See `tenantgate_central::sim::overshoot`.
//!
//! `cargo run --release -p tenantgate-central --example overshoot [-- --json]`

use std::process::ExitCode;

use tenantgate_central::sim::overshoot;

fn main() -> ExitCode {
    let json = std::env::args().any(|a| a == "--json");
    let cells = match overshoot::table(1_000, &[100, 250, 500, 1_000, 2_000], &[2, 3, 10, 100], 30, 1) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if json {
        for c in &cells {
            println!("{}", serde_json::to_string(c).unwrap_or_default());
        }
    } else {
        print!("{}", overshoot::markdown(&cells));
    }
    if cells.iter().all(|c| c.within_bound) {
        ExitCode::SUCCESS
    } else {
        eprintln!("at least one cell admitted more than its bound");
        ExitCode::FAILURE
    }
}
