//! `tenantgate`: the command-line tool. Policy tools and the allowance
//! reconciliation simulator today; the central service (`tenantgate serve`)
//! joins it later.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tenantgate_cli::{ecds, policy_file};

mod sim;

#[derive(Parser)]
#[command(name = "tenantgate", version, about = "Multi-tenant rate limiting for Envoy")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate, compile and apply policies.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Simulate global limits across nodes and regions (virtual time):
    /// one JSON object per scenario and topology.
    Sim(SimArgs),
}

#[derive(Args)]
struct SimArgs {
    /// Run only this scenario (default: all).
    #[arg(long)]
    scenario: Option<String>,
    /// The PRNG seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write one SVG chart per run into this directory.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Only this topology, as REGIONSxNODES (default: 3x3 and 10x10).
    #[arg(long)]
    topology: Option<String>,
    /// Indent the JSON.
    #[arg(long)]
    pretty: bool,
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Validate policy files; exit 1 with path-qualified errors if any is invalid.
    Check {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Print the JSON plugin configuration the filter reads.
    Compile {
        file: PathBuf,
        /// Indent the JSON.
        #[arg(long)]
        pretty: bool,
    },
    /// Validate, then atomically write the Envoy ECDS file (Envoy hot-reloads it).
    Apply(ApplyArgs),
}

#[derive(Args)]
struct ApplyArgs {
    file: PathBuf,
    /// The ECDS resource file Envoy watches (`path_config_source.path`).
    #[arg(long)]
    ecds: PathBuf,
    /// The filter's .wasm (made absolute in the resource).
    #[arg(long, default_value = "target/wasm32-wasip1/wasm-release/tenantgate.wasm")]
    wasm: PathBuf,
    /// The ECDS resource name (the `http_filters` entry's `name`).
    #[arg(long, default_value = ecds::DEFAULT_RESOURCE_NAME)]
    name: String,
    /// The wasm `vm_id`: filters with the same id share buckets on a node.
    #[arg(long, default_value = ecds::DEFAULT_VM_ID)]
    vm_id: String,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Policy(PolicyCommand::Check { files }) => check(&files),
        Command::Policy(PolicyCommand::Compile { file, pretty }) => compile(&file, pretty),
        Command::Policy(PolicyCommand::Apply(args)) => apply(&args),
        Command::Sim(args) => sim::run(&args),
    }
}

fn check(files: &[PathBuf]) -> ExitCode {
    let mut failed = false;
    for file in files {
        match policy_file::load(file) {
            Ok(loaded) => {
                let p = &loaded.policy;
                println!(
                    "ok: {} (version {}, {} plans, mode {:?})",
                    file.display(),
                    p.version,
                    p.plans().len(),
                    p.mode
                );
            }
            Err(e) => {
                failed = true;
                eprintln!("{e}");
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn compile(file: &Path, pretty: bool) -> ExitCode {
    match policy_file::load(file) {
        Ok(loaded) => {
            if pretty {
                match serde_json::to_string_pretty(&loaded.document) {
                    Ok(json) => println!("{json}"),
                    Err(e) => {
                        eprintln!("{}: cannot render JSON: {e}", file.display());
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                println!("{}", loaded.document.to_json());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn apply(args: &ApplyArgs) -> ExitCode {
    let loaded = match policy_file::load(&args.file) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{e}");
            eprintln!("not applied: {} is unchanged", args.ecds.display());
            return ExitCode::FAILURE;
        }
    };
    let resource = ecds::Resource {
        name: &args.name,
        vm_id: &args.vm_id,
        wasm: &args.wasm,
    };
    match resource.write(&loaded.document.to_json(), &args.ecds) {
        Ok(()) => {
            println!(
                "applied: policy {} from {} -> {}",
                loaded.policy.version,
                args.file.display(),
                args.ecds.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cannot write {}: {e}", args.ecds.display());
            ExitCode::FAILURE
        }
    }
}
