//! `tenantgate`: the command-line tool. Policy tools, the allowance
//! reconciliation simulator, and the central service (`tenantgate serve`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, CommandFactory, Parser, Subcommand};
use tenantgate_cli::exit::{self, code};
use tenantgate_cli::{ecds, policy_file};

mod certs;
mod package;
mod quota;
mod sim;

/// See [`tenantgate_central::ServiceAllocator`].
#[global_allocator]
static ALLOCATOR: tenantgate_central::ServiceAllocator = tenantgate_central::ServiceAllocator;

/// `tenantgate --version`: the version and the commit (cli/build.rs).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("TENANTGATE_COMMIT"),
    ")"
);

#[derive(Parser)]
#[command(name = "tenantgate", version = VERSION, about = "Multi-tenant rate limiting for Envoy")]
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
    /// Run the central service: POST /v1/sync on --listen; /healthz,
    /// /readyz, /metrics on --admin.
    Serve(ServeArgs),
    /// Make a local CA and certificates for the sync service's mTLS.
    #[command(subcommand)]
    Certs(certs::CertsCommand),
    /// Quota reservations: reserve, commit, release, get, query, reconcile.
    Quota(quota::QuotaArgs),
    /// Who is being limited now: the service's top keys by demand and by
    /// denials per region (its admin listener's /v1/top). Quit with q.
    Top(TopArgs),
    /// The filter's .wasm as an OCI image layout (the Wasm image Istio and
    /// Envoy Gateway pull); prints its digest and the .wasm's sha256. With
    /// --serve BINARY: the `tenantgate serve` image of that binary.
    Package(package::PackageArgs),
    /// Print the shell completion script for SHELL (docs/cli.md says where
    /// to put it).
    Completions {
        #[arg(value_enum)]
        shell: tenantgate_cli::generate::Shell,
    },
    /// Write the man pages (one per command and subcommand) into DIR.
    Man { dir: PathBuf },
}

#[derive(Args)]
struct TopArgs {
    /// The service's admin listener (`tenantgate serve --admin`).
    #[arg(long, default_value = "http://127.0.0.1:9902")]
    service: String,
    /// Keys per list.
    #[arg(long, default_value_t = tenantgate_central::service::top::DEFAULT_K)]
    k: usize,
    /// Refresh period of the live view, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
    /// Print one view and exit (no terminal needed).
    #[arg(long)]
    once: bool,
    /// With --once: the endpoint's JSON.
    #[arg(long, requires = "once")]
    json: bool,
}

#[derive(Args)]
struct ServeArgs {
    /// The policies YAML (the filter's); reloaded when it changes.
    #[arg(long)]
    policy: PathBuf,
    /// The sync API's address. Beyond loopback it needs mTLS (or --insecure).
    #[arg(long, default_value = tenantgate_central::service::DEFAULT_LISTEN)]
    listen: std::net::SocketAddr,
    /// Health, readiness and metrics (never the sync API).
    #[arg(long, default_value = tenantgate_central::service::DEFAULT_ADMIN)]
    admin: std::net::SocketAddr,
    /// Also serve Envoy's rate limit service (RLS, for the native
    /// ratelimit filter) and rate limit quota service (RLQS, for the native
    /// rate_limit_quota filter) over gRPC here, from the policy's
    /// `descriptors:`, with their state in --store. Same authentication as
    /// --listen.
    #[arg(long)]
    grpc_listen: Option<std::net::SocketAddr>,
    /// Where the allocator's state lives: `embedded` (in this process),
    /// `redis://HOST:PORT[/DB]` (shared by every replica) or
    /// `redis+cluster://HOST:PORT,HOST:PORT[?replicas=N&wait_ms=N]` (a Redis
    /// Cluster: writes wait for N replicas, 1 by default, at most wait_ms,
    /// 100 by default).
    #[arg(long, default_value = "embedded")]
    store: String,
    /// The sync interval nodes are told to use, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
    /// mTLS: the service's certificate (PEM). Needs --tls-key and --client-ca.
    #[arg(long, requires_all = ["tls_key", "client_ca"])]
    tls_cert: Option<PathBuf>,
    /// mTLS: the service's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// mTLS: the CA that signs the nodes' certificates (PEM).
    #[arg(long, requires = "tls_cert")]
    client_ca: Option<PathBuf>,
    /// Serve the sync API unauthenticated beyond loopback (private networks
    /// only; logged as a warning).
    #[arg(long)]
    insecure: bool,
    /// The regions nodes may report from, comma-separated (default: any).
    #[arg(long, value_delimiter = ',')]
    regions: Option<Vec<String>>,
    /// The largest sync request body, in bytes.
    #[arg(long, default_value_t = tenantgate_central::service::validate::DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// Sync requests worked on at once; beyond, 503.
    #[arg(long, default_value_t = tenantgate_central::service::validate::DEFAULT_MAX_IN_FLIGHT)]
    max_in_flight: usize,
    /// The most node sessions kept; beyond, a new node is refused (503).
    #[arg(long, default_value_t = tenantgate_central::service::validate::DEFAULT_MAX_SESSIONS)]
    max_sessions: u64,
    /// The most (key, limit) records kept; beyond, a new one gets no lease.
    #[arg(long, default_value_t = tenantgate_central::service::validate::DEFAULT_MAX_KEYS)]
    max_keys: u64,
    /// Serve the reservation API (/v1/reservations, /v1/quotas) with its
    /// state in `sqlite:DIR` (embedded) or a `postgres://` URL (shared).
    #[arg(long)]
    quota_store: Option<String>,
    /// Who may act for which tenants: a YAML/JSON file of
    /// `clients: [{token|identity, tenants: [...]}]` (default: every caller
    /// the listener admits may act for every tenant).
    #[arg(long, requires = "quota_store")]
    quota_clients: Option<PathBuf>,
    /// This replica's region: resources with another home_region are refused.
    #[arg(long)]
    region: Option<String>,
    /// Regional borrowing: this replica's borrowing account, a SQLite
    /// directory (needs --region and --home-region-url).
    #[arg(long, requires = "quota_store")]
    borrow_store: Option<PathBuf>,
    /// A home region's replica to probe and repay debts to:
    /// REGION=http://host:port (repeatable).
    #[arg(long = "home-region-url", requires = "borrow_store")]
    home_region_url: Vec<String>,
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
    /// Validate policy files; exit 1 with one FILE:LINE:COLUMN: path: message
    /// per error if any is invalid.
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
    /// How one request would be decided: class, identity, plan, limit key,
    /// every limit, and the headers of the first request (the filter's
    /// engine); for a class with admission checks, the filter's pipeline:
    /// the first request, a saturated dependency, its queue and breaker.
    Explain(ExplainArgs),
    /// What reloading OLD -> NEW does to live state. Exit 0: no change,
    /// 1: changes, 2: an error (like `diff`).
    Diff { old: PathBuf, new: PathBuf },
    /// The equivalent tenantgate policy of envoyproxy/ratelimit
    /// configuration files (one domain each), on stdout or --out; what does
    /// not map is reported on stderr.
    Import(ImportArgs),
    /// Print the policy file's JSON Schema (what editors validate and
    /// complete with; policies/tenantgate.schema.json is a copy).
    Schema,
}

#[derive(Args)]
struct ImportArgs {
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Write the policy here (atomically) instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// The policy's `version`.
    #[arg(long, default_value = "imported")]
    version: String,
}

#[derive(Args)]
struct ExplainArgs {
    file: PathBuf,
    /// The tenant id the identity source carries (omit: anonymous).
    #[arg(long)]
    tenant: Option<String>,
    /// The route's class (its metadata's `class`, or its route name).
    #[arg(long)]
    class: String,
    /// An extra request header, `name=value` (repeat).
    #[arg(long = "header", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// The connection's address, for anonymous requests.
    #[arg(long, default_value = tenantgate_cli::explain::DEFAULT_SOURCE)]
    source: String,
    /// The request's value at a nested level, `level=value` (repeat):
    /// put where the level reads it (its header or its claim).
    #[arg(long = "level", value_parser = parse_header)]
    levels: Vec<(String, String)>,
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_owned(), v.to_owned()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("expected name=value, got {s:?}"))
}

#[derive(Args)]
struct ApplyArgs {
    file: PathBuf,
    /// The ECDS resource file Envoy watches (`path_config_source.path`).
    #[arg(long, required_unless_present = "manifests")]
    ecds: Option<PathBuf>,
    /// The filter's .wasm (made absolute in the resource).
    #[arg(long, default_value = "target/wasm32-wasip1/wasm-release/tenantgate.wasm")]
    wasm: PathBuf,
    /// The ECDS resource name (the `http_filters` entry's `name`).
    #[arg(long, default_value = ecds::DEFAULT_RESOURCE_NAME)]
    name: String,
    /// The wasm `vm_id`: filters with the same id share buckets on a node.
    #[arg(long, default_value = ecds::DEFAULT_VM_ID)]
    vm_id: String,
    /// Write the native module's resource (`envoy.filters.http.dynamic_modules`,
    /// Envoy 1.40) instead of the wasm filter's: the same policy, the
    /// library at PATH (made absolute; default: the `make module` build).
    #[arg(long, value_name = "PATH", num_args = 0..=1,
          default_missing_value = "target/module-release/libtenantgate_module.so")]
    module: Option<PathBuf>,
    /// Also write one filter instance per route class, each with its class
    /// fixed (`<name>.<class>` in `<ecds stem>.<class>.<ext>`): enabled per
    /// route with Envoy's `FilterConfig`, they classify with no lookup.
    #[arg(long, requires = "ecds")]
    instances: bool,
    /// Write no capability allow-list: Envoy then calls every callback the
    /// module exports (see docs/operations.md).
    #[arg(long)]
    all_capabilities: bool,
    /// Also write Kubernetes manifests carrying this policy into DIR: Envoy
    /// Gateway `EnvoyExtensionPolicy` (image and HTTP) and Istio
    /// `WasmPlugin` and `TrafficExtension` (docs/kubernetes.md).
    #[arg(long)]
    manifests: Option<PathBuf>,
    /// With --manifests: the filter's OCI image (`make oci`), no scheme.
    #[arg(
        long,
        default_value = concat!("registry.example.internal/tenantgate/filter:", env!("CARGO_PKG_VERSION"))
    )]
    image: String,
    /// With --manifests: where Envoy Gateway's HTTP variant fetches the .wasm.
    #[arg(
        long,
        default_value = "https://artifacts.example.internal/tenantgate/tenantgate.wasm"
    )]
    wasm_url: String,
    /// With --manifests: the .wasm's sha256 (default: the --wasm file's).
    #[arg(long)]
    wasm_sha256: Option<String>,
    /// With --manifests: the namespace of the manifests.
    #[arg(long, default_value = "default")]
    namespace: String,
    /// With --manifests: the HTTPRoute Envoy Gateway's policy attaches to.
    #[arg(long, default_value = "api")]
    http_route: String,
    /// With --manifests: the `app` label of Istio's workloads.
    #[arg(long, default_value = "api")]
    app: String,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Policy(PolicyCommand::Check { files }) => check(&files),
        Command::Policy(PolicyCommand::Compile { file, pretty }) => compile(&file, pretty),
        Command::Policy(PolicyCommand::Apply(args)) => apply(&args),
        Command::Policy(PolicyCommand::Explain(args)) => explain(&args),
        Command::Policy(PolicyCommand::Diff { old, new }) => diff(&old, &new),
        Command::Policy(PolicyCommand::Import(args)) => import(&args),
        Command::Sim(args) => sim::run(&args),
        Command::Serve(args) => serve(&args),
        Command::Certs(c) => certs::run(&c),
        Command::Top(args) => top(&args),
        Command::Quota(args) => quota::run(&args),
        Command::Package(args) => package::run(&args),
        Command::Policy(PolicyCommand::Schema) => {
            print!("{}", tenantgate_cli::generate::policy_schema());
            code(exit::OK)
        }
        Command::Completions { shell } => {
            tenantgate_cli::generate::completions(Cli::command(), shell, &mut std::io::stdout());
            code(exit::OK)
        }
        Command::Man { dir } => man(&dir),
    }
}

fn man(dir: &Path) -> ExitCode {
    match tenantgate_cli::generate::man_pages(Cli::command(), dir) {
        Ok(written) => {
            for path in written {
                println!("wrote {}", path.display());
            }
            code(exit::OK)
        }
        Err(e) => {
            eprintln!("tenantgate man: cannot write into {}: {e}", dir.display());
            code(exit::FAILED)
        }
    }
}

fn serve(args: &ServeArgs) -> ExitCode {
    use tenantgate_central::service::{self, ServeOptions, Settings};
    let defaults = Settings::default();
    let interval_ns = args.interval_ms.saturating_mul(1_000_000);
    if interval_ns == 0 || interval_ns > defaults.lease_ttl_ns {
        eprintln!("--interval-ms: must be 1..={}", defaults.lease_ttl_ns / 1_000_000);
        return code(exit::USAGE);
    }
    let settings = Settings {
        interval_ns,
        ..defaults
    };
    // A policy it cannot read or validate at start is a mistake to say now
    // (exit 1), not a service that never becomes ready. Once running, a
    // bad reload keeps the policy in force and /readyz says why.
    if let Err(e) = service::policy::load(&args.policy) {
        // The CLI's reader locates a policy's own errors (FILE:LINE:COLUMN).
        match policy_file::load(&args.policy) {
            Err(located) => eprintln!("tenantgate serve: {located}"),
            Ok(_) => eprintln!("tenantgate serve: {e}"),
        }
        return code(exit::INVALID);
    }
    let tls = match (&args.tls_cert, &args.tls_key, &args.client_ca) {
        (Some(cert), Some(key), Some(ca)) => Some(tenantgate_central::listener::TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: ca.clone(),
        }),
        _ => None,
    };
    let opts = ServeOptions {
        listen: args.listen,
        admin: args.admin,
        policy: args.policy.clone(),
        policy_poll: std::time::Duration::from_secs(1),
        auth: service::Auth {
            tls,
            insecure: args.insecure,
        },
        grpc: args.grpc_listen,
        limits: Default::default(),
    };
    let intake = service::IntakeLimits {
        max_body_bytes: args.max_body_bytes,
        max_in_flight: args.max_in_flight,
        regions: args.regions.as_ref().map(|r| r.iter().cloned().collect()),
        ..service::IntakeLimits::default()
    };
    let state = service::StateLimits {
        max_sessions: args.max_sessions,
        max_keys: args.max_keys,
        ..service::StateLimits::default()
    };
    let quota = args.quota_store.as_ref().map(|q| service::QuotaOptions {
        store: q.clone(),
        clients: args.quota_clients.clone(),
        region: args.region.clone(),
        borrow_store: args.borrow_store.clone(),
        home_urls: args.home_region_url.clone(),
    });
    match service::run(&args.store, opts, settings, intake, state, quota) {
        Ok(()) => code(exit::OK),
        Err(e) => {
            eprintln!("tenantgate serve: {e}");
            code(exit::FAILED)
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
        code(exit::INVALID)
    } else {
        code(exit::OK)
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
                        return code(exit::INVALID);
                    }
                }
            } else {
                println!("{}", loaded.document.to_json());
            }
            code(exit::OK)
        }
        Err(e) => {
            eprintln!("{e}");
            code(exit::INVALID)
        }
    }
}

fn apply(args: &ApplyArgs) -> ExitCode {
    let unchanged = || match &args.ecds {
        Some(e) => eprintln!("not applied: {} is unchanged", e.display()),
        None => eprintln!("not applied"),
    };
    let (loaded, policy_json) = match checked_policy(args) {
        Ok(checked) => (checked.loaded, checked.json),
        Err(why) => {
            eprintln!("{why}");
            unchanged();
            return code(exit::INVALID);
        }
    };
    if let Some(dir) = &args.manifests {
        if let Err(e) = write_manifests(args, &policy_json, dir) {
            eprintln!("{e}");
            unchanged();
            return code(exit::INVALID);
        }
    }
    let Some(ecds_path) = &args.ecds else {
        return code(exit::OK);
    };
    // From the whole policy: its instances need the same list, so they
    // share one VM (see ecds.rs).
    let capabilities = ecds::Capabilities::for_events(&tenantgate::pipeline::events(&loaded.policy));
    let capabilities = (!args.all_capabilities).then_some(&capabilities);
    if args.instances {
        if let Err(exit) = apply_instances(args, &policy_json, ecds_path, capabilities, &unchanged) {
            return exit;
        }
    }
    let resource = ecds::Resource {
        name: &args.name,
        vm_id: &args.vm_id,
        wasm: &args.wasm,
        module: args.module.as_deref(),
        capabilities,
    };
    match resource.write(&policy_json, ecds_path) {
        Ok(()) => {
            println!(
                "applied: policy {} from {} -> {}",
                loaded.policy.version,
                args.file.display(),
                ecds_path.display()
            );
            code(exit::OK)
        }
        Err(e) => {
            eprintln!("cannot write {}: {e}", ecds_path.display());
            code(exit::FAILED)
        }
    }
}

/// A policy `policy apply` may hand to Envoy, and its JSON.
struct Checked {
    loaded: policy_file::Loaded,
    json: String,
}

/// The policy file loaded and checked as the host it goes to will check
/// it; `Err`: why it would be refused.
fn checked_policy(args: &ApplyArgs) -> Result<Checked, String> {
    let loaded = policy_file::load(&args.file).map_err(|e| e.to_string())?;
    let json = loaded.document.to_json();
    // What Envoy will be handed is checked as the filter and the module
    // check it (aliases can make the JSON larger than the YAML).
    if let Err(errors) = tenantgate::policy::check_size(json.len()) {
        return Err(format!("{} (as JSON): {errors}", args.file.display()));
    }
    if let Some(module) = &args.module {
        if let Err(why) = tenantgate_module::supported(&loaded.policy) {
            return Err(format!(
                "{}: the native module ({}) would refuse this policy at load: {why}",
                args.file.display(),
                module.display()
            ));
        }
    }
    if args.module.is_some() && args.instances {
        return Err(
            "--instances is for the wasm filter: the module's routes carry their class in their per-route config"
                .to_owned(),
        );
    }
    Ok(Checked { loaded, json })
}

/// `policy apply --instances`: one ECDS resource per instance of the
/// policy, each checked before any is written. `Err`: the exit code.
fn apply_instances(
    args: &ApplyArgs,
    policy_json: &str,
    ecds_path: &Path,
    capabilities: Option<&ecds::Capabilities>,
    unchanged: &dyn Fn(),
) -> Result<(), ExitCode> {
    let instances = match ecds::instances(policy_json, &args.name, ecds_path) {
        Ok(list) => list,
        Err(e) => {
            eprintln!("{}: {e}", args.file.display());
            unchanged();
            return Err(code(exit::INVALID));
        }
    };
    for i in &instances {
        if let Err(errors) = tenantgate::policy::Policy::from_json(i.policy_json.as_bytes()) {
            for e in &errors.0 {
                eprintln!("{} (instance {}): {e}", args.file.display(), i.class);
            }
            return Err(code(exit::INVALID));
        }
    }
    for i in &instances {
        let resource = ecds::Resource {
            name: &i.resource_name,
            vm_id: &args.vm_id,
            wasm: &args.wasm,
            module: None,
            capabilities,
        };
        if let Err(e) = resource.write(&i.policy_json, &i.path) {
            eprintln!("cannot write {}: {e}", i.path.display());
            return Err(code(exit::FAILED));
        }
        println!("applied: instance {} -> {}", i.resource_name, i.path.display());
    }
    Ok(())
}

/// `policy apply --manifests DIR`: the Kubernetes manifests of the policy.
fn write_manifests(args: &ApplyArgs, policy_json: &str, dir: &Path) -> Result<(), String> {
    use tenantgate_cli::manifests::{self, Code, Target};
    let sha256 = match &args.wasm_sha256 {
        Some(h)
            if h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()) =>
        {
            h.clone()
        }
        Some(h) => return Err(format!("--wasm-sha256: {h:?} is not 64 lower-case hex digits")),
        None => match std::fs::read(&args.wasm) {
            Ok(bytes) => tenantgate_cli::oci::wasm_sha256(&bytes),
            Err(e) => {
                return Err(format!(
                    "{}: {e} (the manifests need its sha256: build it, or pass --wasm-sha256)",
                    args.wasm.display()
                ))
            }
        },
    };
    let code = Code {
        image: &args.image,
        wasm_url: &args.wasm_url,
        wasm_sha256: &sha256,
    };
    let target = Target {
        namespace: &args.namespace,
        http_route: &args.http_route,
        app: &args.app,
    };
    let source = args.file.display().to_string();
    let list = manifests::render(policy_json, &source, &code, &target);
    for file in manifests::check_sizes(&list)? {
        eprintln!(
            "note: {file} is over {} bytes: apply it with `kubectl apply --server-side` \
             (a client-side apply copies it into an annotation, limited to 256 KiB)",
            manifests::MAX_CLIENT_SIDE_APPLY_BYTES
        );
    }
    let written =
        manifests::write(dir, &list).map_err(|e| format!("cannot write into {}: {e}", dir.display()))?;
    for path in written {
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn explain(args: &ExplainArgs) -> ExitCode {
    let loaded = match policy_file::load(&args.file) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{e}");
            return code(exit::INVALID);
        }
    };
    let req = tenantgate_cli::explain::Request {
        tenant: args.tenant.as_deref(),
        class: &args.class,
        headers: &args.headers,
        source: &args.source,
        levels: &args.levels,
    };
    let json = loaded.document.to_json();
    print!(
        "{}",
        tenantgate_cli::explain::explain(&loaded.policy, &json, &req)
    );
    code(exit::OK)
}

fn diff(old: &Path, new: &Path) -> ExitCode {
    let (a, b) = match (policy_file::load(old), policy_file::load(new)) {
        (Ok(a), Ok(b)) => (a, b),
        (a, b) => {
            for e in [a.err(), b.err()].into_iter().flatten() {
                eprintln!("{e}");
            }
            return code(exit::INVALID);
        }
    };
    let (text, differs) = tenantgate_cli::explain::diff(&a.policy, &b.policy);
    print!("{text}");
    code(if differs { exit::DIFFERS } else { exit::OK })
}

fn import(args: &ImportArgs) -> ExitCode {
    use tenantgate_cli::import::{self, Source};
    let mut texts = Vec::with_capacity(args.files.len());
    for file in &args.files {
        match std::fs::read_to_string(file) {
            Ok(t) => texts.push((file.display().to_string(), t)),
            Err(e) => {
                eprintln!("{}: cannot read: {e}", file.display());
                return code(exit::INVALID);
            }
        }
    }
    let sources: Vec<Source<'_>> = texts.iter().map(|(name, text)| Source { name, text }).collect();
    let imported = match import::import(&sources, &args.version) {
        Ok(i) => i,
        Err(e) => {
            eprintln!("{e}");
            return code(exit::INVALID);
        }
    };
    for line in &imported.report {
        eprintln!("not mapped: {line}");
    }
    eprintln!(
        "imported: {} rules, {} plans; {} not mapped",
        imported.rules,
        imported.plans,
        imported.report.len()
    );
    match &args.out {
        None => {
            print!("{}", imported.policy_yaml);
            code(exit::OK)
        }
        Some(out) => match tenantgate_cli::ecds::write_atomically(out, imported.policy_yaml.as_bytes()) {
            Ok(()) => code(exit::OK),
            Err(e) => {
                eprintln!("cannot write {}: {e}", out.display());
                code(exit::FAILED)
            }
        },
    }
}

fn top(args: &TopArgs) -> ExitCode {
    use tenantgate_cli::top;
    let result = if args.once {
        top::fetch(&args.service, args.k).map(|v| {
            if args.json {
                println!("{v}");
            } else {
                print!("{}", top::render(&v));
            }
        })
    } else {
        top::live(
            &args.service,
            args.k,
            std::time::Duration::from_millis(args.interval_ms.max(100)),
        )
    };
    match result {
        Ok(()) => code(exit::OK),
        Err(e) => {
            eprintln!("tenantgate top: {e}");
            code(exit::FAILED)
        }
    }
}
