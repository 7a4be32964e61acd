//! tenantgate as an Envoy dynamic module: `libtenantgate_module.so`, loaded
//! by Envoy 1.40's `envoy.filters.http.dynamic_modules` into its own
//! process, driving the same [`tenantgate::pipeline::Pipeline`] and engine
//! as the wasm filter for the same policy. The only code that names the
//! dynamic-module ABI (as `src/glue/` is for proxy-wasm): it translates
//! Envoy's hooks into pipeline calls and the pipeline's directives into
//! callbacks, and decides nothing but what a failure inside it does.
//!
//! | piece | here |
//! |---|---|
//! | the ABI (hooks and callbacks, by hand) | [`abi`] |
//! | the entry points Envoy calls: the stream hooks | `entry.rs` |
//! | the program's hook (logger, panic hook, the library pinned) | `entry/program.rs` |
//! | the config hooks (config, tick, sync callout's answer, route config) | `entry/configs.rs` |
//! | an answer ended early (its chunk rewritten, the stream reset) | `flow.rs` |
//! | the core's `Host` and `Clock` | `host.rs` |
//! | shared data: process memory, a sharded map with compare-and-swap | [`store`] |
//! | workers, configs, ticks, sync callouts | `node.rs` |
//! | Envoy's metrics as the pipeline's stats sink | `stats.rs` |
//! | a route's class in its per-route config | [`route`] |
//! | what a request gets when the module fails inside | the core's [`tenantgate::pipeline::failure`] |
//! | the test-only fault switch (feature `test-faults`, never in a release) | `fault.rs` |
//!
//! # Fail-safe
//! The module runs in Envoy's process: a panic that crossed into Envoy
//! would abort it, taking every connection down. So every `extern "C"`
//! entry point runs its work inside [`std::panic::catch_unwind`] (the
//! `module-release` profile unwinds), and a caught panic becomes the
//! policy's failure mode for that request (the core's `pipeline::failure`: 503
//! `state_unavailable` for a `fail_closed` class, on its way otherwise),
//! is counted (`tenantgate.module.panics`) and logged, and the worker it
//! interrupted is made new (`node.rs`, `Node::reset`). The workspace's lints
//! (no `unwrap`, `expect`, `panic!` outside tests) hold here too; the one
//! `panic!` is the test-only switch's, compiled only with the `test-faults`
//! feature (a separate test build, `make module-faults`) and off even there
//! unless Envoy's environment turns it on.

#![cfg_attr(test, allow(dead_code))]

pub mod abi;
#[cfg(not(test))]
mod entry;
#[cfg(all(not(test), feature = "test-faults"))]
mod fault;
#[cfg(not(test))]
mod flow;
#[cfg(not(test))]
mod host;
#[cfg(not(test))]
mod node;
pub mod route;
#[cfg(not(test))]
mod stats;
pub mod store;

use tenantgate::policy::{Identity, Policy};

/// Whether the module can run `policy` as the wasm filter would. `Err`:
/// why not (the config is refused, and Envoy keeps the one in force).
pub fn supported(policy: &Policy) -> Result<(), String> {
    if let Identity::JwtClaim { .. } = policy.identity {
        return Err(String::from(
            "identity.jwt: Envoy 1.40's dynamic-module ABI reads dynamic metadata one level deep \
             (a namespace's string field), not a claim inside jwt_authn's payload; have jwt_authn \
             copy the claim into a header (claim_to_headers) and use identity.header",
        ));
    }
    Ok(())
}

/// The filter state key of the decision record: the wasm filter's
/// (`wasm.` + [`tenantgate::pipeline::RECORD_PROPERTY`]), so one access-log
/// format (`%FILTER_STATE(wasm.tenantgate_admission:PLAIN)%`) serves both hosts.
pub const RECORD_KEY: &str = "wasm.tenantgate_admission";

/// The filter state key of a settled stream's cost record: the wasm
/// filter's (`wasm.` + [`tenantgate::pipeline::settle::COST_PROPERTY`]).
pub const COST_KEY: &str = "wasm.tenantgate_cost";

#[cfg(test)]
mod tests {
    #[test]
    fn the_record_key_is_the_wasm_filters() {
        assert_eq!(
            super::RECORD_KEY,
            format!("wasm.{}", tenantgate::pipeline::RECORD_PROPERTY)
        );
    }

    #[test]
    fn the_cost_key_is_the_wasm_filters() {
        assert_eq!(
            super::COST_KEY,
            format!("wasm.{}", tenantgate::pipeline::settle::COST_PROPERTY)
        );
    }

    #[test]
    fn a_jwt_claim_identity_is_refused_with_the_reason() {
        let json = br#"{"version": "j", "identity": {"jwt": {"payload_in_metadata": "jwt_payload", "claim": "tenant"}},
            "plans": {"free": {"limits": [{"rate": 1, "per": "1s"}]}}, "default_plan": "free",
            "anonymous": {"plan": "free"}, "routes": {"api": {"action": "api"}}, "default_route": "api"}"#;
        let policy = tenantgate::policy::Policy::from_json(json).unwrap();
        assert!(super::supported(&policy)
            .unwrap_err()
            .contains("claim_to_headers"));
    }
}
