//! The HTTP API (axum) and `serve`: listener, timers, graceful shutdown.
//!
//! | endpoint | answer |
//! |---|---|
//! | `POST /v1/sync` | `SyncRequest` JSON → `200` `SyncResponse` JSON; `400` invalid, `409` stale, `503` not ready / store unavailable / too slow, `500` store refused; errors are `{"error": …, "transient": bool}` |
//! | `GET /healthz` | `200 ok` while the process serves |
//! | `GET /readyz` | `200 ready` when a policy is loaded and the store answers, else `503` with the reason |
//! | `GET /metrics` | Prometheus text |

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tracing::{info, warn};

use super::metrics::Gauges;
use super::{watch_policy, Service, SyncError};
use crate::store::Store;

/// The API over one service replica.
pub fn router(service: Arc<Service>) -> Router {
    Router::new()
        .route("/v1/sync", post(sync))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(service)
}

fn json(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn sync(State(service): State<Arc<Service>>, body: Bytes) -> Response {
    match service.sync_json(&body).await {
        Ok(resp) => json(StatusCode::OK, resp.to_json()),
        Err(e) => {
            let (status, transient) = match &e {
                SyncError::Invalid(_) => (StatusCode::BAD_REQUEST, false),
                SyncError::Stale(_) => (StatusCode::CONFLICT, false),
                SyncError::NotReady | SyncError::Timeout(_) => (StatusCode::SERVICE_UNAVAILABLE, true),
                SyncError::Store(s) if s.is_transient() => (StatusCode::SERVICE_UNAVAILABLE, true),
                SyncError::Store(_) => (StatusCode::INTERNAL_SERVER_ERROR, false),
            };
            if status.is_server_error() {
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
    let cfg = service.config();
    let text = service.metrics.render(&Gauges {
        keys,
        policy_version: cfg.as_deref().map(|c| c.policy_version.as_str()),
        store: store.kind(),
        store_up: up,
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        text,
    )
        .into_response()
}

/// What `tenantgate serve` runs.
pub struct ServeOptions {
    pub listen: SocketAddr,
    pub policy: PathBuf,
    /// How often the policy file is checked for changes.
    pub policy_poll: Duration,
}

/// Serves until `shutdown` resolves; then stops accepting, finishes the
/// requests in flight and returns.
pub async fn serve(
    service: Arc<Service>,
    opts: ServeOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(opts.listen).await?;
    serve_on(service, listener, opts, shutdown).await
}

/// [`serve`] on a bound listener (tests bind port 0).
pub async fn serve_on(
    service: Arc<Service>,
    listener: tokio::net::TcpListener,
    opts: ServeOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    if service.config().is_none() {
        // Not ready until a valid policy appears (the watcher reloads it).
        let _ = service.reload(&opts.policy);
    }
    let store: &Arc<dyn Store> = service.store();
    info!(%addr, store = store.kind(), policy = %opts.policy.display(), "tenantgate serve listening");
    let watcher = tokio::spawn(watch_policy(
        service.clone(),
        opts.policy.clone(),
        opts.policy_poll,
    ));
    let sweeper = tokio::spawn(super::sweep_every_interval(service.clone()));
    let result = axum::serve(listener, router(service))
        .with_graceful_shutdown(shutdown)
        .await;
    watcher.abort();
    sweeper.abort();
    info!("tenantgate serve stopped");
    result
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

/// Builds the store named on the command line: `embedded` or a
/// `redis://host:port[/db]` URL.
pub fn open_store(spec: &str) -> Result<Arc<dyn Store>, String> {
    if spec == "embedded" {
        return Ok(Arc::new(crate::store::EmbeddedStore::new()));
    }
    if spec.starts_with("redis://") {
        return crate::store::RedisStore::new(spec, "tg")
            .map(|s| Arc::new(s) as Arc<dyn Store>)
            .map_err(|e| e.to_string());
    }
    Err(format!("--store {spec}: expected `embedded` or a redis:// URL"))
}

/// `tenantgate serve`: logs to stderr (`RUST_LOG` filters, default `info`),
/// a multi-threaded runtime, serve until SIGTERM or ctrl-c.
pub fn run(store: &str, opts: ServeOptions, settings: super::Settings) -> Result<(), String> {
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
    runtime.block_on(async {
        let store = open_store(store)?;
        let service = Arc::new(Service::new(
            store,
            Arc::new(super::SystemClock::default()),
            settings,
        ));
        serve(service, opts, shutdown_signal())
            .await
            .map_err(|e| format!("cannot serve: {e}"))
    })
}
