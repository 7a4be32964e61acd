//! `tenantgate package`: the filter's `.wasm` as an OCI image layout, the
//! image Istio (`WasmPlugin`, `TrafficExtension`) and Envoy Gateway
//! (`EnvoyExtensionPolicy`, `code.type: Image`) pull.
//!
//! # The format
//! The *compat* variant of the Wasm Image Specification: a standard OCI
//! image (manifest `application/vnd.oci.image.manifest.v1+json`, config
//! `application/vnd.oci.image.config.v1+json`) with **one** layer of type
//! `application/vnd.oci.image.layer.v1.tar+gzip` holding `plugin.wasm`.
//! Istio's and Envoy Gateway's image fetchers (`pkg/wasm/imagefetcher.go`,
//! `internal/wasm/imagefetcher.go`) take a standard image's last layer,
//! ungzip it and read `plugin.wasm`; any registry and any OCI tool
//! (`skopeo`, `crane`, `oras`) handle it as an ordinary image. The *oci*
//! variant (a layer of type `application/vnd.module.wasm.content.layer.v1+wasm`)
//! is not written: both fetchers accept it only with exactly two layers,
//! which its specification does not pin down, and nothing else reads it.
//!
//! The image is reproducible: the tar entry and the gzip header carry no
//! time, owner or host, so the same `.wasm` always gives the same digest.
//!
//! # The layout
//! `DIR/oci-layout`, `DIR/index.json` (one manifest, tagged by the
//! annotation `org.opencontainers.image.ref.name`) and
//! `DIR/blobs/sha256/<hex>` for the manifest, the config and the layer.
//! `skopeo copy oci:DIR:TAG docker://REGISTRY/REPO:TAG` pushes it.

use std::io::Write;
use std::path::Path;

use flate2::write::GzEncoder;
use flate2::Compression;
use serde_json::json;
use sha2::{Digest, Sha256};

pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
pub const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// The file name the compat variant's layer must hold.
pub const WASM_FILE_NAME: &str = "plugin.wasm";

/// What `package` wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packaged {
    /// `sha256:<hex>` of the manifest: the image's digest (`@sha256:…`).
    pub manifest_digest: String,
    /// The packaged file's own sha256 (hex): the `.wasm`'s (Envoy
    /// Gateway's `http.sha256`, Istio's `sha256` for an `http(s)://` URL),
    /// or the service binary's.
    pub content_sha256: String,
    /// `sha256:<hex>` of the gzipped layer.
    pub layer_digest: String,
    pub tag: String,
}

fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// One ustar header block (owner 0, time 0): a regular file of `size`
/// bytes, or a directory when `dir`.
fn tar_header(name: &str, size: usize, mode: u32, dir: bool) -> std::io::Result<[u8; 512]> {
    let mut h = [0u8; 512];
    let name = name.as_bytes();
    if name.len() > 100 {
        return Err(std::io::Error::other("tar entry name longer than 100 bytes"));
    }
    h[..name.len()].copy_from_slice(name);
    let octal = |field: &mut [u8], value: u64| {
        let text = format!("{value:0width$o}\0", width = field.len() - 1);
        field.copy_from_slice(text.as_bytes());
    };
    octal(&mut h[100..108], u64::from(mode));
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], size as u64);
    octal(&mut h[136..148], 0);
    h[156] = if dir { b'5' } else { b'0' };
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    // The checksum is computed with its own field as spaces.
    h[148..156].copy_from_slice(b"        ");
    let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
    let text = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(text.as_bytes());
    Ok(h)
}

/// One entry of an image layer: a directory (`content: None`) or a file.
pub struct Entry<'a> {
    /// The path inside the image, relative (`usr/local/bin/tenantgate`);
    /// a directory's ends in `/`.
    pub path: &'a str,
    pub mode: u32,
    pub content: Option<&'a [u8]>,
}

/// A tar archive of `entries`, in order, padded to whole records.
fn tar_of_entries(entries: &[Entry<'_>]) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    for e in entries {
        let content = e.content.unwrap_or_default();
        out.extend_from_slice(&tar_header(e.path, content.len(), e.mode, e.content.is_none())?);
        out.extend_from_slice(content);
        let pad = (512 - content.len() % 512) % 512;
        out.resize(out.len() + pad, 0);
    }
    out.resize(out.len() + 1024, 0); // the end: two zero blocks
    let record = 10 * 512;
    let len = out.len().div_ceil(record) * record;
    out.resize(len, 0);
    Ok(out)
}

/// A tar archive of one file (mode 0644), padded to whole records.
fn tar_of(name: &str, content: &[u8]) -> std::io::Result<Vec<u8>> {
    tar_of_entries(&[Entry {
        path: name,
        mode: 0o644,
        content: Some(content),
    }])
}

/// Gzip with no time and no file name in the header (reproducible), at
/// `level`.
fn gzip(bytes: &[u8], level: Compression) -> std::io::Result<Vec<u8>> {
    let mut enc = flate2::GzBuilder::new()
        .mtime(0)
        .operating_system(255)
        .write(Vec::new(), level);
    enc.write_all(bytes)?;
    GzEncoder::finish(enc)
}

fn write_blob(dir: &Path, bytes: &[u8]) -> std::io::Result<String> {
    let hex = sha256_hex(bytes);
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs)?;
    std::fs::write(blobs.join(&hex), bytes)?;
    Ok(format!("sha256:{hex}"))
}

/// Writes the image layout of `wasm` (the module's bytes) into `dir`,
/// tagged `tag`. An existing layout in `dir` is replaced.
pub fn package(wasm: &[u8], dir: &Path, tag: &str) -> std::io::Result<Packaged> {
    if !wasm.starts_with(b"\0asm") {
        return Err(std::io::Error::other(
            "not a WebAssembly module (no \\0asm magic)",
        ));
    }
    let tar = tar_of(WASM_FILE_NAME, wasm)?;
    let config = json!({
        "architecture": "wasm",
        "os": "wasip1",
        "config": {},
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{}", sha256_hex(&tar))] },
    });
    let image = write_image(
        dir,
        tag,
        &tar,
        &config,
        json!({ "org.opencontainers.image.title": WASM_FILE_NAME }),
        json!({ "org.opencontainers.image.title": "tenantgate" }),
    )?;
    Ok(Packaged {
        manifest_digest: image.manifest_digest,
        content_sha256: sha256_hex(wasm),
        layer_digest: image.layer_digest,
        tag: tag.to_owned(),
    })
}

/// What [`write_image`] wrote.
struct Written {
    manifest_digest: String,
    layer_digest: String,
}

/// Writes an image layout of one layer (`tar`, gzipped here) and `config`
/// into `dir`, tagged `tag`; an existing layout in `dir` is replaced.
fn write_image(
    dir: &Path,
    tag: &str,
    tar: &[u8],
    config: &serde_json::Value,
    layer_annotations: serde_json::Value,
    annotations: serde_json::Value,
) -> std::io::Result<Written> {
    if dir.join("blobs").exists() {
        std::fs::remove_dir_all(dir.join("blobs"))?;
    }
    std::fs::create_dir_all(dir)?;
    // The best compression for the small .wasm; the default level for a
    // binary of megabytes (a few percent larger, several times faster).
    let level = if tar.len() > (4 << 20) {
        Compression::default()
    } else {
        Compression::best()
    };
    let layer = gzip(tar, level)?;
    let layer_digest = write_blob(dir, &layer)?;
    let config = serde_json::to_vec(config).map_err(std::io::Error::other)?;
    let config_digest = write_blob(dir, &config)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": { "mediaType": CONFIG_MEDIA_TYPE, "digest": config_digest, "size": config.len() },
        "layers": [{
            "mediaType": LAYER_MEDIA_TYPE,
            "digest": layer_digest,
            "size": layer.len(),
            "annotations": layer_annotations,
        }],
        "annotations": annotations,
    });
    let manifest = serde_json::to_vec(&manifest).map_err(std::io::Error::other)?;
    let manifest_digest = write_blob(dir, &manifest)?;
    let index = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": MANIFEST_MEDIA_TYPE,
            "digest": manifest_digest,
            "size": manifest.len(),
            "annotations": { "org.opencontainers.image.ref.name": tag },
        }],
    });
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    std::fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&index).map_err(std::io::Error::other)?,
    )?;
    Ok(Written {
        manifest_digest,
        layer_digest,
    })
}

/// Where the service image keeps the binary (its entrypoint).
pub const SERVICE_BINARY: &str = "usr/local/bin/tenantgate";
/// The user the service image runs as: 65532, no name, no home, no shell
/// (distroless's `nonroot`); Kubernetes' `runAsNonRoot` accepts it.
pub const SERVICE_USER: &str = "65532:65532";

/// The `tenantgate serve` image: what [`package_service`] puts in it.
pub struct ServiceImage<'a> {
    /// The `tenantgate` binary (static: `make release` builds it for
    /// x86_64-unknown-linux-musl).
    pub binary: &'a [u8],
    /// The version and commit, for the image's labels.
    pub version: &'a str,
    pub revision: &'a str,
}

/// Writes the `tenantgate serve` image (linux/amd64) into `dir`, tagged
/// `tag`: one layer of the binary at `/usr/local/bin/tenantgate`, an
/// empty `/tmp`, and `/etc/passwd` and `/etc/group` naming the non-root
/// user it runs as; no shell, no package manager, no other file.
/// Entrypoint `tenantgate`, command `serve --help` (the deployment gives
/// `serve` its flags). Reproducible like [`package`].
pub fn package_service(image: &ServiceImage<'_>, dir: &Path, tag: &str) -> std::io::Result<Packaged> {
    if !image.binary.starts_with(b"\x7fELF") {
        return Err(std::io::Error::other("not an ELF executable"));
    }
    let passwd = b"nonroot:x:65532:65532:nonroot:/nonexistent:/sbin/nologin\n";
    let group = b"nonroot:x:65532:\n";
    let entries = [
        Entry {
            path: "etc/",
            mode: 0o755,
            content: None,
        },
        Entry {
            path: "etc/group",
            mode: 0o644,
            content: Some(group),
        },
        Entry {
            path: "etc/passwd",
            mode: 0o644,
            content: Some(passwd),
        },
        Entry {
            path: "tmp/",
            mode: 0o1777,
            content: None,
        },
        Entry {
            path: "usr/",
            mode: 0o755,
            content: None,
        },
        Entry {
            path: "usr/local/",
            mode: 0o755,
            content: None,
        },
        Entry {
            path: "usr/local/bin/",
            mode: 0o755,
            content: None,
        },
        Entry {
            path: SERVICE_BINARY,
            mode: 0o755,
            content: Some(image.binary),
        },
    ];
    let tar = tar_of_entries(&entries)?;
    let labels = json!({
        "org.opencontainers.image.title": "tenantgate",
        "org.opencontainers.image.description": "tenantgate serve: the central service of tenantgate",
        "org.opencontainers.image.version": image.version,
        "org.opencontainers.image.revision": image.revision,
        "org.opencontainers.image.licenses": "Apache-2.0",
    });
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "User": SERVICE_USER,
            "Entrypoint": [format!("/{SERVICE_BINARY}")],
            "Cmd": ["serve", "--help"],
            "WorkingDir": "/",
            "ExposedPorts": { "10002/tcp": {}, "9902/tcp": {} },
            "Labels": labels,
        },
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{}", sha256_hex(&tar))] },
    });
    let written = write_image(dir, tag, &tar, &config, json!({}), labels)?;
    Ok(Packaged {
        manifest_digest: written.manifest_digest,
        content_sha256: sha256_hex(image.binary),
        layer_digest: written.layer_digest,
        tag: tag.to_owned(),
    })
}

/// The `.wasm`'s sha256 (hex), as Envoy Gateway's and Istio's `sha256`.
pub fn wasm_sha256(wasm: &[u8]) -> String {
    sha256_hex(wasm)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_layer_is_a_tar_gz_holding_plugin_wasm_and_the_digest_is_reproducible() {
        let wasm = b"\0asm\x01\0\0\0 a module".to_vec();
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let first = package(&wasm, a.path(), "t").unwrap();
        let second = package(&wasm, b.path(), "t").unwrap();
        assert_eq!(first, second, "same module, same image");
        let hex = first.layer_digest.trim_start_matches("sha256:");
        let layer = std::fs::read(a.path().join("blobs/sha256").join(hex)).unwrap();
        let mut tar = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&layer[..]), &mut tar).unwrap();
        assert_eq!(&tar[..WASM_FILE_NAME.len()], WASM_FILE_NAME.as_bytes());
        assert_eq!(&tar[512..512 + wasm.len()], &wasm[..]);
        assert_eq!(tar.len() % 512, 0);
        assert!(package(b"not wasm", a.path(), "t").is_err());
    }
}
