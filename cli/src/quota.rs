//! `tenantgate quota …`: the reservation API from the command line, for
//! operators and scripts. Prints the service's JSON answer on stdout; exits
//! 0 on a 2xx answer, 1 otherwise (the answer still printed), 2 when the
//! service cannot be reached.

use std::net::SocketAddr;
use std::process::ExitCode;

use tenantgate_cli::http::request;

use clap::{Args, Subcommand};

#[derive(Args)]
pub struct QuotaArgs {
    /// The service's API listener.
    #[arg(long, default_value = tenantgate_central::service::DEFAULT_LISTEN, global = true)]
    service: SocketAddr,
    /// A bearer token (see --quota-clients of `tenantgate serve`); also
    /// read from TENANTGATE_TOKEN when omitted.
    #[arg(long, global = true)]
    token: Option<String>,
    #[command(subcommand)]
    command: QuotaCommand,
}

#[derive(Subcommand)]
enum QuotaCommand {
    /// Reserve AMOUNT of RESOURCE for a tenant's project (idempotent by --id).
    Reserve {
        #[arg(long)]
        id: String,
        #[arg(long)]
        resource: String,
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        project: String,
        #[arg(long)]
        amount: u64,
        /// Time to live in milliseconds (default: the resource's default_ttl).
        #[arg(long)]
        ttl_ms: Option<u64>,
    },
    /// Commit a reservation (all of it, or --amount; the rest returns).
    Commit {
        id: String,
        #[arg(long)]
        amount: Option<u64>,
    },
    /// Release a reservation (repeatable).
    Release { id: String },
    /// Show a reservation.
    Get { id: String },
    /// Limit, committed, reserved and remaining at each level.
    Query {
        resource: String,
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        project: String,
    },
    /// Recompute usage from the ledger; repair drift with compensation entries.
    Reconcile,
}

fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

pub fn run(args: &QuotaArgs) -> ExitCode {
    let (method, path, body) = match &args.command {
        QuotaCommand::Reserve {
            id,
            resource,
            tenant,
            project,
            amount,
            ttl_ms,
        } => {
            let mut v = serde_json::json!({
                "reservation_id": id, "resource": resource, "tenant": tenant, "project": project, "amount": amount,
            });
            if let (Some(t), Some(o)) = (ttl_ms, v.as_object_mut()) {
                o.insert("ttl".into(), (*t).into());
            }
            ("POST", "/v1/reservations".to_owned(), v.to_string())
        }
        QuotaCommand::Commit { id, amount } => {
            let body = amount
                .map(|a| serde_json::json!({ "amount": a }).to_string())
                .unwrap_or_default();
            ("POST", format!("/v1/reservations/{}/commit", enc(id)), body)
        }
        QuotaCommand::Release { id } => (
            "POST",
            format!("/v1/reservations/{}/release", enc(id)),
            String::new(),
        ),
        QuotaCommand::Get { id } => ("GET", format!("/v1/reservations/{}", enc(id)), String::new()),
        QuotaCommand::Query {
            resource,
            tenant,
            project,
        } => (
            "GET",
            format!(
                "/v1/quotas/{}?tenant={}&project={}",
                enc(resource),
                enc(tenant),
                enc(project)
            ),
            String::new(),
        ),
        QuotaCommand::Reconcile => ("POST", "/v1/quotas/reconcile".to_owned(), String::new()),
    };
    let token = args
        .token
        .clone()
        .or_else(|| std::env::var("TENANTGATE_TOKEN").ok());
    match request(args.service, token.as_deref(), method, &path, &body) {
        Ok((status, body)) => {
            println!("{body}");
            if (200..300).contains(&status) {
                ExitCode::SUCCESS
            } else {
                eprintln!("tenantgate quota: HTTP {status}");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("tenantgate quota: {e}");
            tenantgate_cli::exit::code(tenantgate_cli::exit::FAILED)
        }
    }
}
