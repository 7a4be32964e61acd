//! Kubernetes manifests that load the filter with a policy, written by
//! `tenantgate policy apply FILE --manifests DIR`: Envoy Gateway's
//! `EnvoyExtensionPolicy` (the OCI image, and the `.wasm` over HTTP with
//! its sha256) and Istio's `WasmPlugin` and `TrafficExtension` (the OCI
//! image). Each carries the policy as the same JSON document the ECDS
//! resource carries (`policy apply --ecds`), which is what the real-Envoy
//! tests load:
//!
//! * Envoy Gateway hands `wasm[].config` to Envoy as a
//!   `google.protobuf.StringValue` of the JSON (its `wasmConfig`), exactly
//!   as the ECDS resource does.
//! * Istio hands `pluginConfig` to Envoy as JSON of a protobuf `Struct`
//!   (numbers become doubles, which the filter accepts as integers).
//!
//! The manifests are YAML with the policy as one line of JSON (JSON is
//! YAML), so a reviewer's diff of a policy change is the policy's diff.

use std::path::{Path, PathBuf};

/// Where the filter's code comes from.
pub struct Code<'a> {
    /// An OCI image reference without scheme, e.g.
    /// `registry.example.internal/tenantgate/filter:VERSION` (this build's).
    pub image: &'a str,
    /// An `http(s)://` URL of the `.wasm` (Envoy Gateway's HTTP variant).
    pub wasm_url: &'a str,
    /// The `.wasm`'s sha256 (hex).
    pub wasm_sha256: &'a str,
}

/// Which workloads or routes the manifests attach to.
pub struct Target<'a> {
    pub namespace: &'a str,
    /// Envoy Gateway: the `HTTPRoute` the policy applies to.
    pub http_route: &'a str,
    /// Istio: the workload's `app` label.
    pub app: &'a str,
}

/// One manifest: its file name in the directory and its text.
pub struct Manifest {
    pub file: &'static str,
    pub text: String,
}

fn header(what: &str, source: &str) -> String {
    format!(
        "# {what}\n# Written by `tenantgate policy apply {source} --manifests DIR`: regenerate it,\n# do not edit it (the policy is the same JSON as the ECDS resource's).\n"
    )
}

/// The four manifests for `policy_json` (the policy's compiled JSON).
pub fn render(policy_json: &str, source: &str, code: &Code<'_>, target: &Target<'_>) -> Vec<Manifest> {
    let ns = target.namespace;
    let route = target.http_route;
    let app = target.app;
    let image = code.image;
    let eg = |code_block: String, what: &str| {
        format!(
            "{}apiVersion: gateway.envoyproxy.io/v1alpha1\nkind: EnvoyExtensionPolicy\nmetadata:\n  name: tenantgate\n  namespace: {ns}\nspec:\n  targetRefs:\n  - group: gateway.networking.k8s.io\n    kind: HTTPRoute\n    name: {route}\n  wasm:\n  - name: tenantgate\n    rootID: tenantgate\n    failOpen: false\n    code:\n{code_block}    config: {policy_json}\n",
            header(what, source)
        )
    };
    vec![
        Manifest {
            file: "envoy-gateway-image.yaml",
            text: eg(
                format!("      type: Image\n      image:\n        url: {image}\n"),
                "tenantgate on Envoy Gateway: the filter from its OCI image (`make oci`).",
            ),
        },
        Manifest {
            file: "envoy-gateway-http.yaml",
            text: eg(
                format!(
                    "      type: HTTP\n      http:\n        url: {}\n        sha256: {}\n",
                    code.wasm_url, code.wasm_sha256
                ),
                "tenantgate on Envoy Gateway: the filter's .wasm over HTTP, checked by its sha256.",
            ),
        },
        Manifest {
            file: "istio-wasmplugin.yaml",
            text: format!(
                "{}apiVersion: extensions.istio.io/v1alpha1\nkind: WasmPlugin\nmetadata:\n  name: tenantgate\n  namespace: {ns}\nspec:\n  selector:\n    matchLabels:\n      app: {app}\n  phase: AUTHZ\n  url: oci://{image}\n  imagePullPolicy: IfNotPresent\n  type: HTTP\n  failStrategy: FAIL_CLOSE\n  pluginName: tenantgate\n  pluginConfig: {policy_json}\n",
                header("tenantgate on Istio: a WasmPlugin from the OCI image (`make oci`).", source)
            ),
        },
        Manifest {
            file: "istio-trafficextension.yaml",
            text: format!(
                "{}apiVersion: extensions.istio.io/v1alpha1\nkind: TrafficExtension\nmetadata:\n  name: tenantgate\n  namespace: {ns}\nspec:\n  selector:\n    matchLabels:\n      app: {app}\n  phase: AUTHZ\n  wasm:\n    url: oci://{image}\n    imagePullPolicy: IfNotPresent\n    type: HTTP\n    failStrategy: FAIL_CLOSE\n    pluginName: tenantgate\n    pluginConfig: {policy_json}\n",
                header(
                    "tenantgate on Istio: a TrafficExtension (the newer API that supersedes WasmPlugin) from the OCI image.",
                    source
                )
            ),
        },
    ]
}

/// The largest object the Kubernetes API server stores: etcd's default
/// request limit, 1.5 MiB (`--max-request-bytes`, 1,572,864 bytes). A
/// manifest over it is refused here, with the reason, rather than by the
/// API server after the fact.
pub const MAX_OBJECT_BYTES: usize = 1_572_864;

/// The most a client-side `kubectl apply` can store: it copies the object
/// into the `last-applied-configuration` annotation, and annotations are
/// limited to 256 KiB in all. Above it, `kubectl apply --server-side`.
pub const MAX_CLIENT_SIDE_APPLY_BYTES: usize = 262_144;

/// `Err`: the first manifest over [`MAX_OBJECT_BYTES`], and why. `Ok`: the
/// manifests over [`MAX_CLIENT_SIDE_APPLY_BYTES`] (apply them server-side).
pub fn check_sizes(manifests: &[Manifest]) -> Result<Vec<&'static str>, String> {
    if let Some(m) = manifests.iter().find(|m| m.text.len() > MAX_OBJECT_BYTES) {
        return Err(format!(
            "{} would be {} bytes: the Kubernetes API server refuses objects over {MAX_OBJECT_BYTES} \
             (1.5 MiB, etcd's request limit); make the policy smaller",
            m.file,
            m.text.len()
        ));
    }
    Ok(manifests
        .iter()
        .filter(|m| m.text.len() > MAX_CLIENT_SIDE_APPLY_BYTES)
        .map(|m| m.file)
        .collect())
}

/// Writes the manifests into `dir`, each atomically; returns their paths.
pub fn write(dir: &Path, manifests: &[Manifest]) -> std::io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::with_capacity(manifests.len());
    for m in manifests {
        let path = dir.join(m.file);
        crate::ecds::write_atomically(&path, m.text.as_bytes())?;
        written.push(path);
    }
    Ok(written)
}
