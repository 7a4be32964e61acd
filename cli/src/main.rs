//! `tenantgate`: the command-line tool. Policy tools, the allowance
//! reconciliation simulator, and the central service (`tenantgate serve`).

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
    /// Run the central service: POST /v1/sync, /healthz, /readyz, /metrics.
    Serve(ServeArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// The policies YAML (the filter's); reloaded when it changes.
    #[arg(long)]
    policy: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8081")]
    listen: std::net::SocketAddr,
    /// Where the allocator's state lives: `embedded` (in this process) or
    /// `redis://HOST:PORT[/DB]` (shared by every replica).
    #[arg(long, default_value = "embedded")]
    store: String,
    /// The sync interval nodes are told to use, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
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
    /// Also write one filter instance per route class, each with its class
    /// fixed (`<name>.<class>` in `<ecds stem>.<class>.<ext>`): enabled per
    /// route with Envoy's `FilterConfig`, they classify with no lookup.
    #[arg(long)]
    instances: bool,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Policy(PolicyCommand::Check { files }) => check(&files),
        Command::Policy(PolicyCommand::Compile { file, pretty }) => compile(&file, pretty),
        Command::Policy(PolicyCommand::Apply(args)) => apply(&args),
        Command::Sim(args) => sim::run(&args),
        Command::Serve(args) => serve(&args),
    }
}

fn serve(args: &ServeArgs) -> ExitCode {
    use tenantgate_central::service::{self, ServeOptions, Settings};
    let defaults = Settings::default();
    let interval_ns = args.interval_ms.saturating_mul(1_000_000);
    if interval_ns == 0 || interval_ns > defaults.lease_ttl_ns {
        eprintln!("--interval-ms: must be 1..={}", defaults.lease_ttl_ns / 1_000_000);
        return ExitCode::FAILURE;
    }
    let settings = Settings {
        interval_ns,
        ..defaults
    };
    let opts = ServeOptions {
        listen: args.listen,
        policy: args.policy.clone(),
        policy_poll: std::time::Duration::from_secs(1),
    };
    match service::run(&args.store, opts, settings) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tenantgate serve: {e}");
            ExitCode::FAILURE
        }
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
    let policy_json = loaded.document.to_json();
    if args.instances {
        let instances = match ecds::instances(&policy_json, &args.name, &args.ecds) {
            Ok(list) => list,
            Err(e) => {
                eprintln!("{}: {e}", args.file.display());
                eprintln!("not applied: {} is unchanged", args.ecds.display());
                return ExitCode::FAILURE;
            }
        };
        for i in &instances {
            if let Err(errors) = tenantgate::policy::Policy::from_json(i.policy_json.as_bytes()) {
                for e in &errors.0 {
                    eprintln!("{} (instance {}): {e}", args.file.display(), i.class);
                }
                return ExitCode::FAILURE;
            }
        }
        for i in &instances {
            let resource = ecds::Resource {
                name: &i.resource_name,
                vm_id: &args.vm_id,
                wasm: &args.wasm,
            };
            if let Err(e) = resource.write(&i.policy_json, &i.path) {
                eprintln!("cannot write {}: {e}", i.path.display());
                return ExitCode::FAILURE;
            }
            println!("applied: instance {} -> {}", i.resource_name, i.path.display());
        }
    }
    let resource = ecds::Resource {
        name: &args.name,
        vm_id: &args.vm_id,
        wasm: &args.wasm,
    };
    match resource.write(&policy_json, &args.ecds) {
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
