//! The Envoy ECDS resource file that carries the filter and its policy.
//!
//! Envoy watches the file given as `path_config_source.path` and reloads it
//! when a new file is *moved* onto that path. So the file is written whole
//! to a temporary sibling, flushed, and renamed over the old one: Envoy
//! never reads a half-written policy.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::json;

pub const DEFAULT_RESOURCE_NAME: &str = "tenantgate";
pub const DEFAULT_VM_ID: &str = "tenantgate";

/// The metrics namespace of the native module's stats: the wasm filter's,
/// so both hosts report `wasmcustom.tenantgate.*` (`tenantgate_*` in
/// Prometheus) and one dashboard serves both.
pub const MODULE_METRICS_NAMESPACE: &str = "wasmcustom";

pub struct Resource<'a> {
    pub name: &'a str,
    pub vm_id: &'a str,
    pub wasm: &'a Path,
    /// The native module (`libtenantgate_module.so`): set, the resource
    /// loads it (`envoy.filters.http.dynamic_modules`) instead of the
    /// `.wasm`.
    pub module: Option<&'a Path>,
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
                        "vm_config": {
                            "vm_id": self.vm_id,
                            "runtime": "envoy.wasm.runtime.v8",
                            "code": {"local": {"filename": wasm.display().to_string()}}
                        },
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
        };
        let text = r.render(r#"{"version":"1"}"#, Path::new("/abs/x.wasm"));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let config = &v["resources"][0]["typed_config"]["config"];
        assert_eq!(config["configuration"]["value"], r#"{"version":"1"}"#);
        assert_eq!(config["vm_config"]["vm_id"], "tg");
        assert_eq!(config["vm_config"]["code"]["local"]["filename"], "/abs/x.wasm");
    }

    #[test]
    fn the_module_resource_carries_the_same_policy_and_the_library() {
        let r = Resource {
            name: "tenantgate",
            vm_id: "tg",
            wasm: Path::new("x.wasm"),
            module: Some(Path::new("libtenantgate_module.so")),
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
