//! The Envoy ECDS resource file that carries the filter and its policy.
//!
//! Envoy watches the file given as `path_config_source.path` and reloads it
//! when a new file is *moved* onto that path. So the file is written whole
//! to a temporary sibling, flushed, and renamed over the old one: Envoy
//! never reads a half-written policy.
//!
//! # The capability allow-list
//! The resource's `vm_config.capability_restriction_config` lists what the
//! module may use ([`Capabilities`]): every function `tenantgate.wasm`
//! imports ([`PROXY_WASM_IMPORTS`], [`WASI_IMPORTS`]: a real-Envoy test
//! holds them equal to the built module's import section), and of the
//! callbacks it exports only those the policy's requests need
//! ([`tenantgate::pipeline::events()`]). Envoy (proxy-wasm-cpp-host) leaves
//! every other callback unbound and never enters the VM for it: a policy
//! without admission, degraded answers, a body limit or `RateLimit` headers
//! costs Envoy three VM entries per request (the stream's context created,
//! its request headers, its context deleted), where an unrestricted module
//! gets seven or more (also its response headers, each response body chunk,
//! its access log, its done). An import the list left out would be
//! replaced by a stub that logs `Attempted call to restricted …` and
//! fails; none is left out.
//!
//! The allow-list is the VM's, fixed when the VM starts. proxy-wasm-cpp-host
//! keys a VM by its `vm_id`, configuration and code (`makeVmKey`); Envoy
//! 1.40 tells VMs apart by their allow-list too (measured: a reload to
//! another list starts a new VM, a reload to the same list keeps the
//! running one), but an Envoy whose key is only those three (earlier
//! releases, read in their source) would keep the old VM, and its old list,
//! across a reload whose policy needs other callbacks. So the callbacks are
//! also written as the VM's configuration (which the filter ignores): on
//! any Envoy a policy that needs other callbacks gets a VM of its own, and
//! one that needs the same ones keeps the running VM. A new VM starts with
//! empty worker memory (leases, held requests and slots stay with the old
//! VM until its streams end); the node's state is shared data, which
//! survives it.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::json;
pub use tenantgate::pipeline::Events;

pub const DEFAULT_RESOURCE_NAME: &str = "tenantgate";
pub const DEFAULT_VM_ID: &str = "tenantgate";

/// The metrics namespace of the native module's stats: the wasm filter's,
/// so both hosts report `wasmcustom.tenantgate.*` (`tenantgate_*` in
/// Prometheus) and one dashboard serves both.
pub const MODULE_METRICS_NAMESPACE: &str = "wasmcustom";

/// Every proxy-wasm hostcall `tenantgate.wasm` imports (module `env`): the
/// SDK links them all, whether the filter calls them or not.
pub const PROXY_WASM_IMPORTS: &[&str] = &[
    "proxy_add_header_map_value",
    "proxy_call_foreign_function",
    "proxy_close_stream",
    "proxy_continue_stream",
    "proxy_define_metric",
    "proxy_dequeue_shared_queue",
    "proxy_done",
    "proxy_enqueue_shared_queue",
    "proxy_get_buffer_bytes",
    "proxy_get_current_time_nanoseconds",
    "proxy_get_header_map_pairs",
    "proxy_get_header_map_value",
    "proxy_get_metric",
    "proxy_get_property",
    "proxy_get_shared_data",
    "proxy_get_status",
    "proxy_grpc_call",
    "proxy_grpc_cancel",
    "proxy_grpc_close",
    "proxy_grpc_send",
    "proxy_grpc_stream",
    "proxy_http_call",
    "proxy_increment_metric",
    "proxy_log",
    "proxy_record_metric",
    "proxy_register_shared_queue",
    "proxy_remove_header_map_value",
    "proxy_replace_header_map_value",
    "proxy_resolve_shared_queue",
    "proxy_send_local_response",
    "proxy_set_buffer_bytes",
    "proxy_set_effective_context",
    "proxy_set_header_map_pairs",
    "proxy_set_property",
    "proxy_set_shared_data",
    "proxy_set_tick_period_milliseconds",
];

/// Every WASI function `tenantgate.wasm` imports (module
/// `wasi_snapshot_preview1`): what Rust's standard library links for
/// wasm32-wasip1. Envoy names a WASI capability without its module.
pub const WASI_IMPORTS: &[&str] = &[
    "environ_get",
    "environ_sizes_get",
    "fd_write",
    "proc_exit",
    "random_get",
];

/// The callbacks every policy needs: the VM's start and the policy's
/// configuration, a stream's context created and deleted (the SDK frees
/// it on delete), its request headers (the decision).
/// `proxy_on_memory_allocate` (the allocator Envoy copies hostcall results
/// through) and the ABI version marker are not capabilities: Envoy looks
/// them up whatever the list says.
pub const ALWAYS_CALLBACKS: &[&str] = &[
    "proxy_on_vm_start",
    "proxy_on_configure",
    "proxy_on_context_create",
    "proxy_on_request_headers",
    "proxy_on_delete",
];

/// The callbacks that deliver one of the pipeline's events, as the glue
/// (`src/glue/mod.rs`) routes them. A stream's end comes on
/// `proxy_on_done` (Envoy calls it for every stream, before
/// `proxy_on_delete`); the glue's `on_log` is the same call and is never
/// needed beside it. `proxy_on_done` also carries the root's last stats
/// flush when its VM stops: without it (a policy that needs no stream
/// end) the counts of the VM's last tick, at most 10 ms, are lost then.
pub fn callbacks(events: &Events) -> Vec<&'static str> {
    let mut list = ALWAYS_CALLBACKS.to_vec();
    for (needed, names) in [
        (events.tick, &["proxy_on_tick"][..]),
        (events.request_body, &["proxy_on_request_body"][..]),
        (events.response_headers, &["proxy_on_response_headers"][..]),
        (
            events.response_body,
            &["proxy_on_response_body", "proxy_on_response_trailers"][..],
        ),
        (events.stream_end, &["proxy_on_done"][..]),
        (events.callout_answers, &["proxy_on_http_call_response"][..]),
    ] {
        if needed {
            list.extend_from_slice(names);
        }
    }
    list
}

/// A policy's capability allow-list (see the module header).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// The module's callbacks Envoy may call.
    pub callbacks: Vec<&'static str>,
}

impl Capabilities {
    pub fn for_events(events: &Events) -> Capabilities {
        Capabilities {
            callbacks: callbacks(events),
        }
    }

    /// Every allowed name: the imports, then the callbacks.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        PROXY_WASM_IMPORTS
            .iter()
            .chain(WASI_IMPORTS)
            .copied()
            .chain(self.callbacks.iter().copied())
    }

    /// `capability_restriction_config` as Envoy reads it: name → an empty
    /// `SanitizationConfig`.
    fn restriction(&self) -> serde_json::Value {
        let allowed: serde_json::Map<String, serde_json::Value> =
            self.names().map(|n| (n.to_owned(), json!({}))).collect();
        json!({ "allowed_capabilities": allowed })
    }

    /// The VM's configuration: the callbacks, so that another list makes
    /// another VM (see the module header).
    fn vm_configuration(&self) -> String {
        format!("tenantgate callbacks: {}", self.callbacks.join(" "))
    }
}

pub struct Resource<'a> {
    pub name: &'a str,
    pub vm_id: &'a str,
    pub wasm: &'a Path,
    /// The native module (`libtenantgate_module.so`): set, the resource
    /// loads it (`envoy.filters.http.dynamic_modules`) instead of the
    /// `.wasm`.
    pub module: Option<&'a Path>,
    /// The allow-list (`None`: none written, Envoy allows everything).
    pub capabilities: Option<&'a Capabilities>,
}

impl Resource<'_> {
    /// The ECDS discovery file (JSON, which Envoy also reads as YAML);
    /// `code` is the `.wasm`, or with [`Resource::module`] the `.so`.
    pub fn render(&self, policy_json: &str, code: &Path) -> String {
        if self.module.is_some() {
            return self.render_module(policy_json, code);
        }
        let wasm = code;
        let doc = json!({
            "resources": [{
                "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
                "name": self.name,
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                    "config": {
                        "name": "tenantgate",
                        "root_id": "tenantgate",
                        "vm_config": self.vm_config(wasm),
                        // A StringValue: a Struct arrives empty on Envoy 1.40.
                        "configuration": {
                            "@type": "type.googleapis.com/google.protobuf.StringValue",
                            "value": policy_json
                        }
                    }
                }
            }]
        });
        format!("{doc:#}\n")
    }

    /// The native module's resource: the same policy JSON as the filter's
    /// configuration (a `StringValue`), the library by absolute path, kept
    /// loaded (`do_not_close`: its process-memory state and its tick thread
    /// outlive any one config), its stats in the wasm filter's namespace.
    fn render_module(&self, policy_json: &str, module: &Path) -> String {
        let doc = json!({
            "resources": [{
                "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
                "name": self.name,
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
                    "dynamic_module_config": {
                        "module": {"local": {"filename": module.display().to_string()}},
                        "do_not_close": true,
                        "metrics_namespace": MODULE_METRICS_NAMESPACE
                    },
                    "filter_name": "tenantgate",
                    "filter_config": {
                        "@type": "type.googleapis.com/google.protobuf.StringValue",
                        "value": policy_json
                    }
                }
            }]
        });
        format!("{doc:#}\n")
    }

    /// `vm_config`, with the allow-list and its VM configuration if any.
    fn vm_config(&self, wasm: &Path) -> serde_json::Value {
        let mut vm = json!({
            "vm_id": self.vm_id,
            "runtime": "envoy.wasm.runtime.v8",
            "code": {"local": {"filename": wasm.display().to_string()}}
        });
        if let (Some(caps), Some(map)) = (self.capabilities, vm.as_object_mut()) {
            map.insert(
                String::from("configuration"),
                json!({
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": caps.vm_configuration()
                }),
            );
            map.insert(String::from("capability_restriction_config"), caps.restriction());
        }
        vm
    }

    pub fn write(&self, policy_json: &str, target: &Path) -> std::io::Result<()> {
        let (code, what, hint) = match self.module {
            Some(m) => (m, "module", "make module, or pass --module PATH"),
            None => (self.wasm, "wasm file", "make wasm, or pass --wasm"),
        };
        let code = std::fs::canonicalize(code).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("{what} {}: {e} (build it with `{hint}`)", code.display()),
            )
        })?;
        let text = self.render(policy_json, &code);
        write_atomically(target, text.as_bytes())
    }
}

/// One filter instance per route class (`policy apply --instances`): the
/// policy JSON with `class` set, the resource `<name>.<class>` and its file
/// `<stem>.<class>.<ext>` beside `ecds`. Envoy's HCM lists every instance
/// with `disabled: true`; a route enables its class's instance with a
/// `FilterConfig` in `typed_per_filter_config`. Instances that differ only
/// in their configuration share one VM per worker (same `vm_id`), so they
/// share the key table too.
pub struct Instance {
    pub class: String,
    pub resource_name: String,
    pub path: PathBuf,
    pub policy_json: String,
}

/// The instances of a policy (its JSON), or why there are none.
pub fn instances(policy_json: &str, name: &str, ecds: &Path) -> Result<Vec<Instance>, String> {
    let doc: serde_json::Value =
        serde_json::from_str(policy_json).map_err(|e| format!("policy JSON: {e}"))?;
    let Some(map) = doc.as_object() else {
        return Err(String::from("the policy is not a mapping"));
    };
    if map.contains_key("class") || map.contains_key("classify") {
        return Err(String::from(
            "--instances sets each instance's `class`: remove `class` and `classify` from the policy",
        ));
    }
    let classes: Vec<String> = map
        .get("routes")
        .and_then(|r| r.as_object())
        .map(|r| r.keys().cloned().collect())
        .unwrap_or_default();
    let stem = ecds
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = ecds.extension().map(|s| s.to_string_lossy().into_owned());
    let dir = ecds.parent().map(Path::to_path_buf).unwrap_or_default();
    Ok(classes
        .into_iter()
        .map(|class| {
            let mut doc = map.clone();
            doc.insert(String::from("class"), serde_json::Value::String(class.clone()));
            let file = match &ext {
                Some(ext) => format!("{stem}.{class}.{ext}"),
                None => format!("{stem}.{class}"),
            };
            Instance {
                resource_name: format!("{name}.{class}"),
                path: dir.join(file),
                policy_json: serde_json::Value::Object(doc).to_string(),
                class,
            }
        })
        .collect())
}

/// Writes `bytes` to `target` by a rename from a temporary sibling.
pub fn write_atomically(target: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir)?;
    let file_name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{file_name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, target)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resource_carries_the_policy_as_a_string_value() {
        let r = Resource {
            name: "tenantgate",
            vm_id: "tg",
            wasm: Path::new("x.wasm"),
            module: None,
            capabilities: None,
        };
        let text = r.render(r#"{"version":"1"}"#, Path::new("/abs/x.wasm"));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let config = &v["resources"][0]["typed_config"]["config"];
        assert_eq!(config["configuration"]["value"], r#"{"version":"1"}"#);
        assert_eq!(config["vm_config"]["vm_id"], "tg");
        assert_eq!(config["vm_config"]["code"]["local"]["filename"], "/abs/x.wasm");
        // No list: Envoy allows everything.
        assert!(config["vm_config"].get("capability_restriction_config").is_none());
        assert!(config["vm_config"].get("configuration").is_none());
    }

    fn policy(json: &str) -> tenantgate::policy::Policy {
        tenantgate::policy::Policy::from_json(json.as_bytes()).unwrap()
    }

    const LEAN: &str = r#"{"version":"1","identity":{"header":"x-tenant-id"},
        "plans":{"free":{"limits":[{"rate":10,"per":"1s"}]}},"default_plan":"free",
        "anonymous":{"plan":"free"},"ratelimit_headers":false,"routes":{"api":{}}}"#;

    /// The `vm_config` of `policy_json`'s resource with its allow-list.
    fn vm_config(policy_json: &str) -> serde_json::Value {
        let caps = Capabilities::for_events(&tenantgate::pipeline::events(&policy(policy_json)));
        let r = Resource {
            name: "tenantgate",
            vm_id: "tg",
            wasm: Path::new("x.wasm"),
            module: None,
            capabilities: Some(&caps),
        };
        let v: serde_json::Value =
            serde_json::from_str(&r.render(policy_json, Path::new("/x.wasm"))).unwrap();
        v["resources"][0]["typed_config"]["config"]["vm_config"].clone()
    }

    fn allowed(vm: &serde_json::Value) -> Vec<String> {
        vm["capability_restriction_config"]["allowed_capabilities"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| {
                assert_eq!(v, &serde_json::json!({}), "an empty SanitizationConfig");
                k.clone()
            })
            .collect()
    }

    #[test]
    fn a_lean_policy_allows_every_import_and_only_the_callbacks_every_policy_needs() {
        let vm = vm_config(LEAN);
        let names = allowed(&vm);
        for import in PROXY_WASM_IMPORTS.iter().chain(WASI_IMPORTS) {
            assert!(names.iter().any(|n| n == import), "{import} allowed");
        }
        let callbacks: Vec<&str> = names
            .iter()
            .map(String::as_str)
            .filter(|n| n.starts_with("proxy_on_"))
            .collect();
        let mut expected = ALWAYS_CALLBACKS.to_vec();
        expected.push("proxy_on_tick");
        let (mut got, mut want) = (callbacks.clone(), expected);
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want);
        for absent in [
            "proxy_on_response_headers",
            "proxy_on_response_body",
            "proxy_on_log",
            "proxy_on_done",
            "proxy_on_request_body",
            "proxy_on_http_call_response",
        ] {
            assert!(!callbacks.contains(&absent), "{absent} not allowed");
        }
        // The VM's configuration names the callbacks (another list, another VM).
        assert_eq!(
            vm["configuration"]["value"],
            "tenantgate callbacks: proxy_on_vm_start proxy_on_configure proxy_on_context_create \
             proxy_on_request_headers proxy_on_delete proxy_on_tick"
        );
        assert_eq!(
            vm["configuration"]["@type"],
            "type.googleapis.com/google.protobuf.StringValue"
        );
    }

    #[test]
    fn each_event_allows_the_callbacks_the_glue_delivers_it_on() {
        let all = Events {
            request_body: true,
            response_headers: true,
            response_body: true,
            stream_end: true,
            callout_answers: true,
            tick: true,
        };
        let list = callbacks(&all);
        for name in [
            "proxy_on_request_body",
            "proxy_on_response_headers",
            "proxy_on_response_body",
            "proxy_on_response_trailers",
            "proxy_on_done",
            "proxy_on_http_call_response",
            "proxy_on_tick",
        ] {
            assert!(list.contains(&name), "{name}");
        }
        // The stream's end comes on proxy_on_done; on_log is never needed.
        assert!(!list.contains(&"proxy_on_log"));
        let none = Events {
            request_body: false,
            response_headers: false,
            response_body: false,
            stream_end: false,
            callout_answers: false,
            tick: true,
        };
        assert_eq!(callbacks(&none).len(), ALWAYS_CALLBACKS.len() + 1);
    }

    #[test]
    fn policies_that_need_other_callbacks_get_other_vms() {
        let with_headers = LEAN.replace(r#""ratelimit_headers":false,"#, "");
        let a = vm_config(LEAN);
        let b = vm_config(&with_headers);
        assert_ne!(a["configuration"], b["configuration"]);
        // The same callbacks, the same VM configuration: the VM is kept.
        let other_limit = LEAN.replace(r#""rate":10"#, r#""rate":20"#);
        assert_eq!(a["configuration"], vm_config(&other_limit)["configuration"]);
        assert!(allowed(&b).iter().any(|n| n == "proxy_on_response_headers"));
    }

    #[test]
    fn the_module_resource_carries_the_same_policy_and_the_library() {
        let r = Resource {
            name: "tenantgate",
            vm_id: "tg",
            wasm: Path::new("x.wasm"),
            module: Some(Path::new("libtenantgate_module.so")),
            capabilities: None,
        };
        let text = r.render(r#"{"version":"1"}"#, Path::new("/abs/libtenantgate_module.so"));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let config = &v["resources"][0]["typed_config"];
        assert_eq!(
            config["@type"],
            "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
        );
        assert_eq!(config["filter_config"]["value"], r#"{"version":"1"}"#);
        let module = &config["dynamic_module_config"];
        assert_eq!(
            module["module"]["local"]["filename"],
            "/abs/libtenantgate_module.so"
        );
        assert_eq!(module["do_not_close"], true);
        assert_eq!(module["metrics_namespace"], "wasmcustom");
    }

    #[test]
    fn instances_carry_their_class_and_sit_beside_the_ecds_file() {
        let json = r#"{"version":"1","routes":{"api":{},"search":{"cost":5}}}"#;
        let list = instances(json, "tenantgate", Path::new("/run/ecds.yaml")).unwrap();
        let names: Vec<_> = list.iter().map(|i| i.resource_name.as_str()).collect();
        assert_eq!(names, ["tenantgate.api", "tenantgate.search"]);
        assert_eq!(list[1].path, Path::new("/run/ecds.search.yaml"));
        let v: serde_json::Value = serde_json::from_str(&list[1].policy_json).unwrap();
        assert_eq!(v["class"], "search");
        assert_eq!(v["routes"]["search"]["cost"], 5);
        let fixed = r#"{"version":"1","class":"api","routes":{"api":{}}}"#;
        assert!(instances(fixed, "tenantgate", Path::new("e.yaml")).is_err());
    }

    #[test]
    fn writes_replace_the_file_whole() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("ecds.yaml");
        write_atomically(&target, b"one").unwrap();
        write_atomically(&target, b"two").unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "two");
        let leftovers = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(leftovers, 1, "no temporary file left behind");
    }
}
