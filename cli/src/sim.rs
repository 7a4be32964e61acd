//! `tenantgate sim`: runs the allowance reconciliation simulator and
//! prints one JSON object per scenario and topology.

use std::process::ExitCode;

use tenantgate_central::sim::{self, SimConfig, Topology};

use crate::SimArgs;

fn topologies(arg: Option<&str>) -> Result<Vec<Topology>, String> {
    let Some(arg) = arg else {
        return Ok(vec![Topology::SMALL, Topology::LARGE]);
    };
    let parsed = arg
        .split_once('x')
        .and_then(|(r, n)| Some((r.parse::<usize>().ok()?, n.parse::<usize>().ok()?)));
    match parsed {
        Some((regions, nodes_per_region)) if regions > 0 && nodes_per_region > 0 => Ok(vec![Topology {
            regions,
            nodes_per_region,
        }]),
        _ => Err(format!("--topology {arg}: expected REGIONSxNODES, e.g. 3x3")),
    }
}

pub(super) fn run(args: &SimArgs) -> ExitCode {
    let scenarios: Vec<_> = match &args.scenario {
        None => sim::scenarios(),
        Some(name) => match sim::scenario::named(name) {
            Some(s) => vec![s],
            None => {
                let names: Vec<_> = sim::scenarios()
                    .iter()
                    .chain(&sim::scenario::lossy_parts())
                    .map(|s| s.name)
                    .collect();
                eprintln!("unknown scenario {name:?}; one of: {}", names.join(", "));
                return ExitCode::FAILURE;
            }
        },
    };
    let topologies = match topologies(args.topology.as_deref()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(dir) = &args.svg {
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!("cannot create {}: {e}", dir.display());
            return tenantgate_cli::exit::code(tenantgate_cli::exit::FAILED);
        }
    }
    let cfg = SimConfig::default();
    let mut outside = false;
    for topo in topologies {
        for spec in &scenarios {
            let run = match sim::run(spec, topo, &cfg, args.seed) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("{}: {e}", spec.name);
                    return ExitCode::FAILURE;
                }
            };
            outside |= !run.outcome.within_bound;
            let json = if args.pretty {
                serde_json::to_string_pretty(&run.outcome)
            } else {
                serde_json::to_string(&run.outcome)
            };
            match json {
                Ok(j) => println!("{j}"),
                Err(e) => {
                    eprintln!("{}: cannot render JSON: {e}", spec.name);
                    return ExitCode::FAILURE;
                }
            }
            if let Some(dir) = &args.svg {
                let path = dir.join(format!("{}-{}.svg", topo.name(), spec.name));
                if let Err(e) = std::fs::write(&path, run.svg()) {
                    eprintln!("cannot write {}: {e}", path.display());
                    return tenantgate_cli::exit::code(tenantgate_cli::exit::FAILED);
                }
            }
        }
    }
    // A run above its bound is a finding, not a crash: say so in the status.
    if outside {
        eprintln!("at least one run admitted more than its bound");
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
