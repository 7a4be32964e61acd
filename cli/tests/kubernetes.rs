//! `deploy/kubernetes/tenantgate-serve.yaml` agrees with the CLI: every
//! flag of the Deployment's `tenantgate serve` is one `tenantgate serve
//! --help` lists; the sync and admin ports are the defaults' ports and the
//! container's named ports; readiness and liveness probe the admin port's
//! `/readyz` and `/healthz`; the Service targets the sync port; the policy
//! and TLS paths are under their volumes' mounts; the ConfigMap's policy
//! validates; more than one replica never uses the embedded store; the
//! PodDisruptionBudget selects the Deployment's pods and leaves one up.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test crate

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_norway::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn docs() -> Vec<Value> {
    let text = std::fs::read_to_string(repo().join("deploy/kubernetes/tenantgate-serve.yaml")).unwrap();
    text.split("\n---\n")
        .map(|d| serde_norway::from_str::<Value>(d).unwrap())
        .collect()
}

fn kind<'a>(docs: &'a [Value], k: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(k))
        .unwrap_or_else(|| panic!("no {k}"))
}

fn port_of(addr: &str) -> u64 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn the_manifests_agree_with_tenantgate_serve() {
    let help = Command::new(env!("CARGO_BIN_EXE_tenantgate"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let flags: BTreeSet<&str> = help
        .split_whitespace()
        .filter(|w| w.starts_with("--"))
        .map(|w| w.trim_end_matches([',', '.']))
        .map(|w| w.split('=').next().unwrap())
        .collect();
    let default_of = |flag: &str| -> String {
        let line = help
            .lines()
            .skip_while(|l| !l.trim_start().starts_with(flag))
            .take(4)
            .collect::<String>();
        let start = line
            .find("[default: ")
            .unwrap_or_else(|| panic!("no default for {flag}: {help}"))
            + 10;
        line[start..].split(']').next().unwrap().to_owned()
    };

    let docs = docs();
    let deploy = kind(&docs, "Deployment");
    let pod = &deploy["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(args[0], "serve");
    let mut given = std::collections::BTreeMap::new();
    for a in &args[1..] {
        let (flag, value) = a.split_once('=').unwrap_or((a, ""));
        assert!(
            flags.contains(flag),
            "{flag} is not a flag of `tenantgate serve` ({flags:?})"
        );
        given.insert(flag, value);
    }

    // Ports: the defaults' ports, named on the container.
    let named_port = |name: &str| -> u64 {
        c["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["name"].as_str() == Some(name))
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("no container port {name}"))
    };
    let listen = port_of(given["--listen"]);
    let admin = port_of(given["--admin"]);
    assert_eq!(listen, port_of(&default_of("--listen")));
    assert_eq!(admin, port_of(&default_of("--admin")));
    assert_eq!(named_port("sync"), listen);
    assert_eq!(named_port("admin"), admin);
    assert_eq!(c["readinessProbe"]["httpGet"]["path"].as_str(), Some("/readyz"));
    assert_eq!(c["readinessProbe"]["httpGet"]["port"].as_str(), Some("admin"));
    assert_eq!(c["livenessProbe"]["httpGet"]["path"].as_str(), Some("/healthz"));
    assert_eq!(c["livenessProbe"]["httpGet"]["port"].as_str(), Some("admin"));
    let template = &deploy["spec"]["template"]["metadata"];
    assert_eq!(
        template["annotations"]["prometheus.io/port"]
            .as_str()
            .map(|p| p.parse::<u64>().unwrap()),
        Some(admin)
    );

    // Beyond loopback the sync API needs mTLS (or --insecure): it has mTLS.
    for f in ["--tls-cert", "--tls-key", "--client-ca"] {
        assert!(
            given.contains_key(f),
            "{f} missing: the service refuses to listen beyond loopback without it"
        );
    }
    // More than one replica share a store: never the embedded one.
    if deploy["spec"]["replicas"].as_u64().unwrap() > 1 {
        assert!(
            given["--store"].starts_with("redis://"),
            "replicas need a shared store"
        );
    }

    // Files live under their volumes' mounts; the policy is the ConfigMap's key.
    let mount_of = |volume: &str| -> String {
        c["volumeMounts"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|m| m["name"].as_str() == Some(volume))
            .and_then(|m| m["mountPath"].as_str())
            .unwrap()
            .to_owned()
    };
    let volume = |name: &str| -> &Value {
        pod["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|v| v["name"].as_str() == Some(name))
            .unwrap()
    };
    let cm = kind(&docs, "ConfigMap");
    assert_eq!(volume("policy")["configMap"]["name"], cm["metadata"]["name"]);
    let policy_key = given["--policy"]
        .strip_prefix(&format!("{}/", mount_of("policy")))
        .unwrap();
    let policy_text = cm["data"][policy_key].as_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.yaml");
    std::fs::write(&file, policy_text).unwrap();
    let loaded =
        tenantgate_cli::policy_file::load(&file).unwrap_or_else(|e| panic!("the ConfigMap's policy: {e}"));
    assert!(loaded.policy.has_global_limits());
    let tls = mount_of("tls");
    assert!(volume("tls")["secret"]["secretName"].as_str().is_some());
    for f in ["--tls-cert", "--tls-key", "--client-ca"] {
        assert!(
            given[f].starts_with(&format!("{tls}/")),
            "{f} outside the secret's mount"
        );
    }

    // The Service targets the sync port; the PDB keeps one pod up.
    let svc = kind(&docs, "Service");
    let sp = &svc["spec"]["ports"][0];
    assert_eq!(sp["targetPort"].as_str(), Some("sync"));
    assert_eq!(sp["port"].as_u64(), Some(listen));
    let labels = &template["labels"];
    assert_eq!(&svc["spec"]["selector"], labels);
    let pdb = kind(&docs, "PodDisruptionBudget");
    assert_eq!(&pdb["spec"]["selector"]["matchLabels"], labels);
    let min = pdb["spec"]["minAvailable"].as_u64().unwrap();
    assert!(min >= 1 && min < deploy["spec"]["replicas"].as_u64().unwrap());
}
