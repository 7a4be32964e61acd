//! The reservation API's HTTP edge: its routes, the in-flight cap, and an
//! [`Answer`] written as an HTTP response (counted in the metrics).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, FromRequestParts, Path as UrlPath, Query, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::json;

use super::clients::Grant;
use super::replica::{unavailable, QuotaApi};
use crate::listener::Peer;
use crate::quota::{error_answer, Answer, Kind, Outcome};

/// The HTTP status of each kind of answer: the one place the quota API's
/// answers meet HTTP.
pub fn http_status(kind: Kind) -> StatusCode {
    match kind {
        Kind::Created => StatusCode::CREATED,
        Kind::Done => StatusCode::OK,
        Kind::Unchanged => StatusCode::NOT_MODIFIED,
        Kind::Invalid => StatusCode::BAD_REQUEST,
        Kind::Unauthenticated => StatusCode::UNAUTHORIZED,
        Kind::Forbidden => StatusCode::FORBIDDEN,
        Kind::NotFound => StatusCode::NOT_FOUND,
        Kind::Conflict => StatusCode::CONFLICT,
        Kind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
    }
}

fn respond(a: &Answer) -> Response {
    (
        http_status(a.kind),
        [(header::CONTENT_TYPE, "application/json")],
        a.body.clone(),
    )
        .into_response()
}

/// The reservation routes (merged into the API listener's router).
pub fn router(api: Arc<QuotaApi>) -> Router {
    Router::new()
        .route("/v1/reservations", post(reserve_h))
        .route("/v1/reservations/{id}", get(get_h))
        .route("/v1/reservations/{id}/commit", post(commit_h))
        .route("/v1/reservations/{id}/release", post(release_h))
        .route("/v1/quotas/reconcile", post(reconcile_h))
        .route("/v1/quotas/debts", post(debts_h))
        .route("/v1/quotas/{resource}", get(query_h))
        .route_layer(axum::middleware::from_fn_with_state(api.clone(), limit_in_flight))
        .with_state(api)
}

/// Runs a request only with a permit (see [`QuotaApi::with_max_in_flight`]).
/// A permit is held until the handler returns: a request is never cut
/// short by the cap, only refused before it starts.
async fn limit_in_flight(
    State(api): State<Arc<QuotaApi>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Ok(_permit) = api.in_flight.clone().try_acquire_owned() else {
        let a = error_answer(
            Kind::Unavailable,
            Outcome::Busy,
            &format!(
                "{} reservation requests in progress: try again",
                api.max_in_flight
            ),
            json!({ "transient": true }),
        );
        let mut r = counted(&api, a);
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        return r;
    };
    next.run(req).await
}

fn counted(api: &QuotaApi, a: Answer) -> Response {
    api.metrics.outcome(a.outcome);
    respond(&a)
}

/// Who calls and through which API: what every reservation route reads
/// before its own path and body (one extractor for all of them).
struct Caller {
    api: Arc<QuotaApi>,
    peer: Peer,
    headers: HeaderMap,
}

impl FromRequestParts<Arc<QuotaApi>> for Caller {
    type Rejection = <ConnectInfo<Peer> as FromRequestParts<Arc<QuotaApi>>>::Rejection;

    async fn from_request_parts(parts: &mut Parts, api: &Arc<QuotaApi>) -> Result<Caller, Self::Rejection> {
        let ConnectInfo(peer) = ConnectInfo::<Peer>::from_request_parts(parts, api).await?;
        Ok(Caller {
            api: api.clone(),
            peer,
            headers: parts.headers.clone(),
        })
    }
}

async fn reserve_h(c: Caller, body: Bytes) -> Response {
    let a = c.api.reserve(&c.headers, &c.peer, &body).await;
    counted(&c.api, a)
}

async fn commit_h(c: Caller, UrlPath(id): UrlPath<String>, body: Bytes) -> Response {
    let a = c.api.commit(&c.headers, &c.peer, &id, &body).await;
    counted(&c.api, a)
}

async fn release_h(c: Caller, UrlPath(id): UrlPath<String>) -> Response {
    let a = c.api.release(&c.headers, &c.peer, &id).await;
    counted(&c.api, a)
}

async fn get_h(c: Caller, UrlPath(id): UrlPath<String>) -> Response {
    respond(&c.api.get(&c.headers, &c.peer, &id).await)
}

async fn query_h(
    c: Caller,
    UrlPath(resource): UrlPath<String>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    respond(&c.api.query(&c.headers, &c.peer, &resource, &q).await)
}

/// `403` unless the caller may act for every tenant.
fn every_tenant(api: &QuotaApi, headers: &HeaderMap, peer: &Peer, what: &str) -> Result<(), Answer> {
    let grant = api.caller(headers, peer)?;
    if grant != Grant::All && !matches!(&grant, Grant::Tenants(t) if t.iter().any(|x| x == "*")) {
        return Err(error_answer(
            Kind::Forbidden,
            Outcome::Invalid,
            &format!("{what} needs a caller allowed every tenant (\"*\")"),
            json!({}),
        ));
    }
    Ok(())
}

async fn debts_h(c: Caller, body: Bytes) -> Response {
    if let Err(a) = every_tenant(&c.api, &c.headers, &c.peer, "repaying a debt") {
        return respond(&a);
    }
    respond(&c.api.accept_debt(&body).await)
}

async fn reconcile_h(c: Caller) -> Response {
    if let Err(a) = every_tenant(&c.api, &c.headers, &c.peer, "reconcile") {
        return respond(&a);
    }
    match c.api.reconcile_once().await {
        Ok(r) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            json!({ "counters": r.counters, "ledger_entries": r.ledger_entries, "drift_units": r.drift_units(), "repaired": r.repaired }).to_string(),
        )
            .into_response(),
        Err(e) => respond(&unavailable(&e)),
    }
}
