//! The reservation API (JSON over HTTP, on the service's API listener,
//! beside `/v1/sync`), described by `docs/openapi/reservations.yaml`.
//!
//! | endpoint | answer |
//! |---|---|
//! | `POST /v1/reservations` | `201` reserved (or the original answer of the same id and parameters); `409 quota_exceeded` (`level`, `limit`, `remaining`, `retry_after_ms`), `409 conflict` (`field`), `409 wrong_region`; `400 invalid` (`field`) |
//! | `POST /v1/reservations/{id}/commit` | `200` committed (`returned`: the rest); `409 expired` / `released` / `conflict`; `404` |
//! | `POST /v1/reservations/{id}/release` | `200` (repeatable); `409 already_committed`; `404` |
//! | `GET /v1/reservations/{id}` | `200` the reservation; `404` |
//! | `GET /v1/quotas/{resource}?tenant=&project=` | `200` limit, committed, reserved, remaining per level, `as_of`, `estimate` |
//! | `POST /v1/quotas/reconcile` | `200` what the reconciliation repaired (callers allowed every tenant) |
//!
//! Errors are `{"error": code, "message": …}` plus the fields above.
//! `400 invalid` means exactly "the OpenAPI document's schema refuses this
//! request" (a malformed body, a missing parameter, a value out of the
//! document's range); a well-formed request the policy or the stored state
//! refuses is `404` (an unknown resource or reservation) or `409` (over a
//! limit, a `ttl` over the resource's `max_ttl`, a commit of more than was
//! reserved, another region's resource). A third-party OpenAPI fuzzer
//! (schemathesis, `cli/tests/quota_serve.rs`) checks both directions
//! against the real service. When the
//! database is unreachable every reservation, commit and release fails
//! closed (`503 quota_unavailable`, nothing debited; a borrowing region
//! reserves from its own account meanwhile, see Regions); a query of a `low`
//! risk resource answers the last figures this replica saw, with their
//! `as_of` and `estimate: true`; a `high` risk one answers `503`.
//!
//! # Authentication
//! The caller is who its bearer token (`Authorization: Bearer …`) or its
//! mTLS identity (the node id its certificate names) says, mapped by
//! `--quota-clients FILE` to the tenants it may act for (`"*"`: all). With
//! no such file, every caller the listener admits may act for every
//! tenant: a loopback listener, or mTLS (the exposure check refuses
//! anything else). A caller the file does not know: `401`, before anything
//! else is looked at (it learns nothing, not even whether an id exists); a
//! tenant it may not act for: `403`.
//!
//! # Regions
//! A resource with `home_region` is served only by replicas of that region
//! (`--region`); others answer `409 wrong_region` naming it, and reserve
//! nothing, unless the resource declares a borrowing ceiling for their
//! region and the home region does not answer: then they reserve from
//! their borrowing account and repay the debt later ([`super::borrow`]).
//! Without `home_region` every replica serves it (one database).
//!
//! Files: `replica.rs` holds the API's operations ([`QuotaApi`], one
//! replica's); `routes.rs` its HTTP edge (routes, the in-flight cap, an
//! answer as a response); `clients.rs` who may call it. This file only
//! names them.

mod clients;
mod replica;
mod routes;

pub use clients::{QuotaClient, QuotaClients};
pub use replica::{reclaim_every, QuotaApi};
pub use routes::{http_status, router};
