//! `tenantgate package` writes an OCI image a third-party tool reads:
//! `skopeo inspect` (Debian's `skopeo`; `make setup` installs it) reports
//! the digest the command printed and one `tar+gzip` layer, and the layer
//! `skopeo copy` extracts holds `plugin.wasm`, byte for byte the module, as
//! Istio's and Envoy Gateway's image fetchers read it (the compat variant).
//! The module is the built filter (`TENANTGATE_WASM`, as `make test` sets
//! it) when present, else a minimal module.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::io::Read;
use std::path::PathBuf;
use std::process::Command;

fn skopeo(args: &[&str]) -> String {
    let out = Command::new("skopeo")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("skopeo: {e} (make setup-skopeo installs it)"));
    assert!(
        out.status.success(),
        "skopeo {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn field<'a>(text: &'a str, prefix: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} in {text}"))
}

#[test]
fn skopeo_reads_the_image_and_its_layer_holds_the_module() {
    let tmp = tempfile::tempdir().unwrap();
    let wasm_path = std::env::var_os("TENANTGATE_WASM")
        .map(PathBuf::from)
        .filter(|p| p.exists())
        .unwrap_or_else(|| {
            let p = tmp.path().join("min.wasm");
            std::fs::write(&p, b"\0asm\x01\0\0\0").unwrap();
            p
        });
    let wasm = std::fs::read(&wasm_path).unwrap();
    let layout = tmp.path().join("image");
    let out = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .arg("package")
        .arg("--wasm")
        .arg(&wasm_path)
        .arg("--out")
        .arg(&layout)
        .args(["--tag", "0.2.0"])
        .output()
        .unwrap();
    let printed = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let digest = field(&printed, "digest: ");
    let sha = field(&printed, "wasm sha256: ");
    assert_eq!(sha, tenantgate_cli::oci::wasm_sha256(&wasm));
    let reference = format!("oci:{}:0.2.0", layout.display());

    let inspected: serde_json::Value = serde_json::from_str(&skopeo(&["inspect", &reference])).unwrap();
    assert_eq!(inspected["Digest"], digest, "{inspected}");
    assert_eq!(inspected["Layers"].as_array().unwrap().len(), 1, "{inspected}");
    assert_eq!(inspected["Architecture"], "wasm");
    let raw: serde_json::Value = serde_json::from_str(&skopeo(&["inspect", "--raw", &reference])).unwrap();
    assert_eq!(raw["mediaType"], "application/vnd.oci.image.manifest.v1+json");
    assert_eq!(
        raw["config"]["mediaType"],
        "application/vnd.oci.image.config.v1+json"
    );
    assert_eq!(
        raw["layers"][0]["mediaType"],
        "application/vnd.oci.image.layer.v1.tar+gzip"
    );

    // Copied out as a registry client would pull it: the layer is a tar.gz
    // whose `plugin.wasm` is the module.
    let pulled = tmp.path().join("pulled");
    skopeo(&[
        "copy",
        "--quiet",
        &reference,
        &format!("dir:{}", pulled.display()),
    ]);
    let layer_hex = raw["layers"][0]["digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:");
    let layer = std::fs::read(pulled.join(layer_hex)).unwrap();
    let mut tar = Vec::new();
    flate2::read::GzDecoder::new(&layer[..])
        .read_to_end(&mut tar)
        .unwrap();
    let name_end = tar.iter().position(|&b| b == 0).unwrap();
    assert_eq!(&tar[..name_end], b"plugin.wasm");
    let size = usize::from_str_radix(std::str::from_utf8(&tar[124..135]).unwrap(), 8).unwrap();
    assert_eq!(size, wasm.len());
    assert_eq!(&tar[512..512 + size], &wasm[..], "plugin.wasm is the module");
}
