//! The HTTP API (axum) and `serve`: two listeners, timers, graceful
//! shutdown.
//!
//! The **sync listener** serves only the sync API; the **admin listener**
//! serves health, readiness and metrics, so exposing metrics never exposes
//! the sync API.
//!
//! | listener | endpoint | answer |
//! |---|---|---|
//! | sync | `POST /v1/sync` | `SyncRequest` JSON → `200` `SyncResponse` JSON; `400` invalid, `401` no identity where one is required, `403` another node's id or region, `409` stale, `413` body too large, `429` the session cap is reached (a new node), `503` not ready / busy / store unavailable / too slow, `500` store refused or internal; errors are `{"error": …, "transient": bool}` |
//! | admin | `GET /healthz` | `200 ok` while the process serves |
//! | admin | `GET /readyz` | `200 ready` when a policy is loaded and the store answers, else `503` with the reason |
//! | admin | `GET /metrics` | Prometheus text |
//!
//! # Authentication
//! With [`Auth::tls`] the sync listener speaks TLS only, and requires a
//! client certificate signed by the configured CA ([`crate::listener::SyncListener::tls`]); the
//! certificate names the node (and maybe its region), and a node may report
//! only as itself. A sync listener on a non-loopback address without it
//! refuses to start ([`check_exposure`]) unless [`Auth::insecure`] is set.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tracing::{info, warn};

use super::metrics::Gauges;
use super::{watch_policy, Service, SyncError};
use crate::bounded::{Budget, ListenerLimits};
use crate::listener::{Peer, SyncListener, TlsFiles};
use crate::store::Store;

/// The sync API over one service replica (on the sync listener).
/// With a quota store attached, the reservation API too
/// (`crate::quota::api`).
pub fn sync_router(service: Arc<Service>) -> Router {
    let max_body = service.intake_limits().max_body_bytes;
    let quota = service.quota().cloned();
    let router = Router::new().route("/v1/sync", post(sync)).with_state(service);
    let router = match quota {
        Some(q) => router.merge(crate::quota::api::router(q)),
        None => router,
    };
    router.layer(DefaultBodyLimit::max(max_body))
}

/// Health, readiness and metrics (on the admin listener).
pub fn admin_router(service: Arc<Service>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/top", get(super::top::handler))
        .with_state(service)
}

fn json(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn sync(
    State(service): State<Arc<Service>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Response {
    if peer.tls && peer.identity.is_none() {
        let e =
            SyncError::Forbidden("the client certificate names no node (see docs/security.md)".to_owned());
        service
            .metrics
            .request(super::metrics::Outcome::Forbidden, Duration::ZERO);
        let body = serde_json::json!({ "error": e.to_string(), "transient": false });
        return json(StatusCode::FORBIDDEN, body.to_string());
    }
    match service.sync_json(body, peer.identity).await {
        Ok(resp) => json(StatusCode::OK, resp.to_json()),
        Err(e) => {
            let (status, transient) = match &e {
                SyncError::Invalid(_) | SyncError::SeqJump(_) => (StatusCode::BAD_REQUEST, false),
                SyncError::Forbidden(_) => (StatusCode::FORBIDDEN, false),
                SyncError::Stale(_) => (StatusCode::CONFLICT, false),
                SyncError::SessionsFull(_) => (StatusCode::TOO_MANY_REQUESTS, true),
                SyncError::NotReady | SyncError::Timeout(_) | SyncError::Busy(_) => {
                    (StatusCode::SERVICE_UNAVAILABLE, true)
                }
                SyncError::Store(s) if s.is_transient() => (StatusCode::SERVICE_UNAVAILABLE, true),
                SyncError::Store(_) | SyncError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, false),
            };
            if status.is_server_error() && !matches!(e, SyncError::Busy(_)) {
                warn!(error = %e, "sync failed");
            }
            let body = serde_json::json!({ "error": e.to_string(), "transient": transient });
            json(status, body.to_string())
        }
    }
}

async fn readyz(State(service): State<Arc<Service>>) -> Response {
    match service.ready().await {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}\n")).into_response(),
    }
}

async fn metrics(State(service): State<Arc<Service>>) -> Response {
    let store = service.store();
    let (keys, up) = match store.key_count().await {
        Ok(n) => (Some(n), true),
        Err(_) => (None, false),
    };
    let sessions = store.session_count().await.ok();
    let cfg = service.config();
    let mut text = service.metrics.render(&Gauges {
        keys,
        sessions,
        policy_version: cfg.as_deref().map(|c| c.policy_version.as_str()),
        store: store.kind(),
        store_up: up,
    });
    if let Some(q) = service.quota() {
        let totals = q.store().totals().await.ok();
        text.push_str(&q.metrics.render(totals.as_ref()));
    }
    if let Some(r) = service.rls() {
        text.push_str(&r.metrics.render());
    }
    if let Some(r) = service.rlqs() {
        text.push_str(&r.metrics.render());
    }
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        text,
    )
        .into_response()
}

/// How the sync listener authenticates nodes.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    /// mTLS: the service's certificate and key, and the CA that signs the
    /// nodes' certificates.
    pub tls: Option<TlsFiles>,
    /// Serve the sync API unauthenticated on a non-loopback address (a
    /// private network): logged as a warning at start.
    pub insecure: bool,
}

/// What `tenantgate serve` runs.
pub struct ServeOptions {
    /// The sync API's address.
    pub listen: SocketAddr,
    /// Health, readiness and metrics.
    pub admin: SocketAddr,
    pub policy: PathBuf,
    /// How often the policy file is checked for changes.
    pub policy_poll: Duration,
    pub auth: Auth,
    /// Envoy's rate limit protocols over gRPC (`--grpc-listen`; `None`:
    /// not served). Needs [`Service::attach_rls`] and [`Service::attach_rlqs`].
    pub grpc: Option<SocketAddr>,
    /// The caps every listener runs under (`crate::bounded`).
    pub limits: ListenerLimits,
}

/// The default sync address (`--listen`).
pub const DEFAULT_LISTEN: &str = "127.0.0.1:10002";
/// The default admin address (`--admin`).
pub const DEFAULT_ADMIN: &str = "127.0.0.1:9902";

/// Refuses an unauthenticated sync API beyond loopback: anyone who can
/// reach it decides every node's allowance.
pub fn check_exposure(listen: SocketAddr, auth: &Auth) -> Result<(), String> {
    if auth.tls.is_some() || listen.ip().is_loopback() {
        return Ok(());
    }
    if auth.insecure {
        warn!(%listen, "--insecure: the sync API is served WITHOUT authentication; anyone who can reach it can change every node's allowance");
        return Ok(());
    }
    Err(format!(
        "--listen {listen} is not a loopback address and no authentication is configured: \
         anyone who could reach it would decide every node's allowance. Configure mTLS \
         (`tenantgate certs init --dir DIR`, then --tls-cert DIR/service.pem --tls-key DIR/service.key \
         --client-ca DIR/ca.pem), or pass --insecure on a private network"
    ))
}

/// The bound listeners of one replica.
pub struct Listeners {
    pub sync: tokio::net::TcpListener,
    pub admin: tokio::net::TcpListener,
}

/// Serves until `shutdown` resolves; then stops accepting, finishes the
/// requests in flight and returns.
pub async fn serve(
    service: Arc<Service>,
    opts: ServeOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    check_exposure(opts.listen, &opts.auth).map_err(std::io::Error::other)?;
    if let Some(grpc) = opts.grpc {
        // The same rule, for Envoy's rate limit service.
        check_exposure(grpc, &opts.auth).map_err(|_| {
            std::io::Error::other(format!(
                "--grpc-listen {grpc} is not a loopback address and no authentication is configured: \
                 anyone who could reach it would decide every rate limit it serves. Configure mTLS \
                 (--tls-cert, --tls-key, --client-ca, as for --listen), or pass --insecure on a private network"
            ))
        })?;
    }
    let bind = |addr: SocketAddr| async move {
        tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))
    };
    let listeners = Listeners {
        sync: bind(opts.listen).await?,
        admin: bind(opts.admin).await?,
    };
    serve_on(service, listeners, opts, shutdown).await
}

/// [`serve`] on bound listeners (tests bind port 0).
pub async fn serve_on(
    service: Arc<Service>,
    listeners: Listeners,
    opts: ServeOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr = listeners.sync.local_addr()?;
    let admin_addr = listeners.admin.local_addr()?;
    let sync_listener = match &opts.auth.tls {
        Some(files) => SyncListener::tls(listeners.sync, files)?,
        None => SyncListener::plain(listeners.sync),
    };
    if service.config().is_none() {
        // Not ready until a valid policy appears (the watcher reloads it).
        let _ = service.reload(&opts.policy);
    }
    let store: &Arc<dyn Store> = service.store();
    info!(%addr, admin = %admin_addr, tls = opts.auth.tls.is_some(), store = store.kind(), policy = %opts.policy.display(), "tenantgate serve listening");
    let watcher = tokio::spawn(watch_policy(
        service.clone(),
        opts.policy.clone(),
        opts.policy_poll,
    ));
    let sweeper = tokio::spawn(super::sweep_every_interval(service.clone()));
    let reclaimer = service
        .quota()
        .cloned()
        .map(|q| tokio::spawn(crate::quota::api::reclaim_every(q)));
    let repayer = service
        .quota()
        .filter(|q| q.borrowing().is_some())
        .cloned()
        .map(|q| tokio::spawn(crate::quota::borrow::repay_every(q)));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut stop_admin = stop_rx.clone();
    let grpc_stop = stop_rx.clone();
    let grpc_service = match (service.rls(), service.rlqs()) {
        (Some(rls), Some(rlqs)) => Some(crate::grpc::Services {
            rls: rls.clone(),
            rlqs: rlqs.clone(),
        }),
        _ => None,
    };
    let mut stop_sync = stop_rx;
    let limits = opts.limits;
    let budget = Budget::new(limits.max_bytes_in_flight);
    let admin = tokio::spawn(crate::bounded::serve(
        SyncListener::plain(listeners.admin),
        admin_router(service.clone()),
        limits,
        budget.clone(),
        async move {
            let _ = stop_admin.wait_for(|s| *s).await;
        },
    ));
    let sync = crate::bounded::serve(
        sync_listener,
        sync_router(service),
        limits,
        budget.clone(),
        async move {
            let _ = stop_sync.wait_for(|s| *s).await;
        },
    );
    let signal = tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let grpc = match (opts.grpc, grpc_service) {
        (Some(addr), Some(services)) => Some(tokio::spawn(serve_grpc(
            addr,
            opts.auth.tls.clone(),
            services,
            (limits, budget),
            grpc_stop,
        ))),
        _ => None,
    };
    let result = sync.await;
    if let Some(g) = grpc {
        match g.await {
            Ok(Err(e)) => warn!(error = %e, "the gRPC listener failed"),
            Err(e) => warn!(error = %e, "the gRPC listener failed"),
            Ok(Ok(())) => {}
        }
    }
    let admin_result = match admin.await {
        Ok(r) => r,
        Err(e) => Err(std::io::Error::other(e)),
    };
    signal.abort();
    watcher.abort();
    sweeper.abort();
    for r in [reclaimer, repayer].into_iter().flatten() {
        r.abort();
    }
    info!("tenantgate serve stopped");
    result.and(admin_result)
}

/// Serves Envoy's rate limit protocols on `addr` (h2c, or mTLS with ALPN
/// `h2` under the sync listener's certificates) until `stop` turns true.
async fn serve_grpc(
    addr: SocketAddr,
    tls: Option<TlsFiles>,
    services: crate::grpc::Services,
    (limits, budget): (ListenerLimits, Budget),
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let tcp = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))?;
    let listener = match &tls {
        Some(files) => SyncListener::tls_alpn(tcp, files, b"h2")?,
        None => SyncListener::plain(tcp),
    };
    info!(%addr, tls = tls.is_some(), "gRPC (Envoy rate limit service and rate limit quota service) listening");
    crate::bounded::serve(
        listener,
        crate::grpc::router_with(services, limits.max_grpc_message_bytes),
        limits,
        budget,
        async move {
            let _ = stop.wait_for(|s| *s).await;
        },
    )
    .await
}

/// Resolves on SIGTERM or ctrl-c.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            warn!(error = %e, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => info!("ctrl-c: shutting down"),
        () = term => info!("SIGTERM: shutting down"),
    }
}

/// Builds the store named on the command line (see [`crate::store::open`]).
pub fn open_store(spec: &str) -> Result<Arc<dyn Store>, String> {
    crate::store::open(spec)
}

/// `tenantgate serve`: logs to stderr (`RUST_LOG` filters, default `info`),
/// a multi-threaded runtime, serve until SIGTERM or ctrl-c.
/// The reservation API's settings (`--quota-store` and friends).
pub struct QuotaOptions {
    /// `sqlite:DIR` or a `postgres://` URL.
    pub store: String,
    /// `--quota-clients`: who may act for which tenants.
    pub clients: Option<PathBuf>,
    /// This replica's region (home-region pinning).
    pub region: Option<String>,
    /// `--borrow-store DIR`: the borrowing account (SQLite), with
    /// `--home-region-url REGION=http://host:port` for each home region.
    pub borrow_store: Option<PathBuf>,
    pub home_urls: Vec<String>,
}

/// The borrowing account and home regions the flags name, if any.
async fn borrowing(q: &QuotaOptions) -> Result<Option<crate::quota::borrow::Borrowing>, String> {
    let Some(dir) = &q.borrow_store else {
        if q.home_urls.is_empty() {
            return Ok(None);
        }
        return Err("--home-region-url needs --borrow-store DIR".into());
    };
    if q.region.is_none() {
        return Err("--borrow-store needs --region".into());
    }
    let homes = q
        .home_urls
        .iter()
        .map(|h| crate::quota::borrow::parse_home(h))
        .collect::<Result<_, _>>()?;
    let account = crate::quota::SqliteStore::open(dir)
        .await
        .map_err(|e| format!("--borrow-store {}: {e}", dir.display()))?;
    Ok(Some(crate::quota::borrow::Borrowing {
        account: Arc::new(account),
        homes,
    }))
}

pub fn run(
    store: &str,
    opts: ServeOptions,
    settings: super::Settings,
    intake: super::IntakeLimits,
    state: super::StateLimits,
    quota: Option<QuotaOptions>,
) -> Result<(), String> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let store_spec = store;
    runtime.block_on(async {
        let store = open_store(store)?;
        let service = Arc::new(Service::with_limits(
            store,
            Arc::new(super::SystemClock::default()),
            settings,
            intake,
            state,
        ));
        if opts.grpc.is_some() {
            let counters = crate::grpc::open_counters(store_spec, service.state_limits().max_keys)?;
            service.attach_rls(Arc::new(crate::grpc::rls::Rls::new(
                counters.clone(),
                service.clock(),
            )));
            service.attach_rlqs(Arc::new(crate::grpc::rlqs::Rlqs::new(
                counters,
                service.clock(),
                crate::grpc::rlqs::Settings::default(),
            )));
        }
        if let Some(q) = quota {
            let clients = match &q.clients {
                Some(p) => Some(crate::quota::api::QuotaClients::load(p)?),
                None => None,
            };
            let qstore = crate::quota::open(&q.store).await?;
            let max_in_flight = service.intake_limits().max_in_flight;
            let borrowing = borrowing(&q).await?;
            let mut api = crate::quota::api::QuotaApi::new(qstore, service.clock(), clients, q.region)
                .with_max_in_flight(max_in_flight);
            if let Some(b) = borrowing {
                api = api.with_borrowing(b);
            }
            service.attach_quota(Arc::new(api));
        }
        serve(service, opts, shutdown_signal())
            .await
            .map_err(|e| e.to_string())
    })
}
