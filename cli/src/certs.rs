//! `tenantgate certs …`: a local CA and the certificates of the sync
//! service's mTLS (`tenantgate_central::listener` makes them).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;
use tenantgate_cli::exit::{self, code};

#[derive(Subcommand)]
pub enum CertsCommand {
    /// A new local CA (ca.pem, ca.key) and the service's certificate
    /// (service.pem, service.key) in DIR.
    Init {
        #[arg(long)]
        dir: PathBuf,
        /// DNS names and IP addresses the service is reached at (repeat).
        #[arg(long = "host", default_values_t = [String::from("localhost"), String::from("127.0.0.1")])]
        hosts: Vec<String>,
        /// Replace an existing CA in DIR (every certificate it issued then
        /// stops verifying: reissue them).
        #[arg(long)]
        force: bool,
    },
    /// A node's client certificate (NODE.pem, NODE.key), signed by DIR's
    /// CA, naming the node (Envoy's node.id) and optionally its region.
    Node {
        #[arg(long)]
        dir: PathBuf,
        /// The node id (Envoy's `node.id`; what the filter reports).
        #[arg(long)]
        node_id: String,
        /// The region the node may report (any, if omitted).
        #[arg(long)]
        region: Option<String>,
        /// The SPIFFE trust domain of the identity URI.
        #[arg(long, default_value = "tenantgate.local")]
        trust_domain: String,
    },
}

pub fn run(c: &CertsCommand) -> ExitCode {
    use tenantgate_central::listener as tls;
    let result = match c {
        CertsCommand::Init { dir, hosts, force } => {
            let existing: Vec<_> = ["ca.pem", "ca.key", "service.pem", "service.key"]
                .iter()
                .map(|f| dir.join(f))
                .filter(|p| p.exists())
                .collect();
            if !existing.is_empty() && !force {
                eprintln!(
                    "tenantgate certs init: {} already exists: a new CA would stop every certificate \
                     the old one issued from verifying. Keep it, or pass --force to replace it \
                     (then reissue every node's certificate with `tenantgate certs node`)",
                    existing[0].display()
                );
                return ExitCode::from(exit::INVALID);
            }
            tls::init_ca(dir, hosts)
        }
        CertsCommand::Node {
            dir,
            node_id,
            region,
            trust_domain,
        } => tls::issue_node(dir, trust_domain, node_id, region.as_deref()),
    };
    match result {
        Ok(issued) => {
            for f in issued.files {
                println!("wrote {}", f.display());
            }
            code(exit::OK)
        }
        Err(e) => {
            eprintln!("tenantgate certs: {e}");
            code(exit::INVALID)
        }
    }
}
