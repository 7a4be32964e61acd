#!/usr/bin/env python3
"""`make run`: the whole tenantgate system on one machine, supervised.

Starts, on loopback:
  - `tenantgate serve` with the embedded store: sync API on 127.0.0.1:10002
    (mTLS), health/readiness/metrics on 127.0.0.1:9902;
  - Envoy A (region `eu`, node `tenantgate-demo`): the demo contract on
    127.0.0.1:10000 (JWT listener 10001), admin 127.0.0.1:9901;
  - Envoy B (region `us`, node `tenantgate-demo-b`): 127.0.0.1:11000 (JWT
    11001), admin 127.0.0.1:9911.
Both Envoys load the filter through the same ECDS file (`make ecds`
hot-reloads both) and sync the demo policy's global limit (tenant
`demo-global`) with the service over mTLS. TG_RUN_HOST=module (`HOST=module
make run`) runs the native module instead of the wasm filter: the ECDS
resource from `tenantgate policy apply --module`, each demo route's class
also in its per-route config, and each Envoy's node named in its
environment (TENANTGATE_NODE_ID, TENANTGATE_REGION: the module's ABI cannot
read Envoy's node). Certificates are made by
`tenantgate certs` on first run, under the run directory (gitignored).

Ctrl-C (SIGINT) or SIGTERM stops every process it started (SIGTERM, then
SIGKILL after 10 s) and waits for each; if any of them exits on its own,
the others are stopped too. Nothing is left running.

Every port and path can be overridden through the environment (the
integration test `integration-tests/tests/run.rs` does, so it never
collides with a running demo): TG_RUN_DIR, TG_RUN_POLICY, TG_RUN_PORT_A,
TG_RUN_JWT_PORT_A, TG_RUN_ADMIN_A, TG_RUN_PORT_B, TG_RUN_JWT_PORT_B,
TG_RUN_ADMIN_B, TG_RUN_SYNC_PORT, TG_RUN_SERVE_ADMIN; binaries from
ENVOY_BIN, TENANTGATE_BIN, TENANTGATE_WASM, TENANTGATE_MODULE (the
Makefile exports them).
Exit status: 0 after a clean stop, 2 if a port is busy or a step fails.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def env_port(name, default):
    return int(os.environ.get(name, default))


def env_path(name, default):
    return Path(os.environ.get(name, default)).resolve()


PORTS = {
    "Envoy A listener": ("TG_RUN_PORT_A", env_port("TG_RUN_PORT_A", 10000)),
    "Envoy A JWT listener": ("TG_RUN_JWT_PORT_A", env_port("TG_RUN_JWT_PORT_A", 10001)),
    "Envoy A admin": ("TG_RUN_ADMIN_A", env_port("TG_RUN_ADMIN_A", 9901)),
    "Envoy B listener": ("TG_RUN_PORT_B", env_port("TG_RUN_PORT_B", 11000)),
    "Envoy B JWT listener": ("TG_RUN_JWT_PORT_B", env_port("TG_RUN_JWT_PORT_B", 11001)),
    "Envoy B admin": ("TG_RUN_ADMIN_B", env_port("TG_RUN_ADMIN_B", 9911)),
    "tenantgate serve sync API": ("TG_RUN_SYNC_PORT", env_port("TG_RUN_SYNC_PORT", 10002)),
    "tenantgate serve admin": ("TG_RUN_SERVE_ADMIN", env_port("TG_RUN_SERVE_ADMIN", 9902)),
}


def port(what):
    return PORTS[what][1]


RUN_DIR = env_path("TG_RUN_DIR", REPO / "envoy/run")
POLICY = env_path("TG_RUN_POLICY", REPO / "policies/demo.yaml")
ENVOY = env_path("ENVOY_BIN", REPO / ".venv/bin/envoy")
CLI = env_path("TENANTGATE_BIN", REPO / "target/debug/tenantgate")
WASM = env_path("TENANTGATE_WASM", REPO / "target/wasm32-wasip1/wasm-release/tenantgate.wasm")
MODULE = env_path("TENANTGATE_MODULE", REPO / "target/module-release/libtenantgate_module.so")
HOST = os.environ.get("TG_RUN_HOST") or "wasm"
CERTS = RUN_DIR / "certs"
ECDS = RUN_DIR / "ecds.yaml"

# (name, node id, region, listener, JWT listener, admin)
NODES = [
    ("envoy-a", "tenantgate-demo", "eu", "Envoy A listener", "Envoy A JWT listener", "Envoy A admin"),
    ("envoy-b", "tenantgate-demo-b", "us", "Envoy B listener", "Envoy B JWT listener", "Envoy B admin"),
]


class Failure(Exception):
    pass


def say(line=""):
    print(line, flush=True)


def busy_ports():
    busy = []
    for what, (var, p) in PORTS.items():
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            busy.append(f"  127.0.0.1:{p} ({what}; set {var}=PORT to move it)")
        finally:
            s.close()
    return busy


def cli(*args):
    out = subprocess.run([str(CLI), *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise Failure(f"tenantgate {' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


def make_certs():
    made = False
    if not (CERTS / "ca.pem").exists():
        CERTS.mkdir(parents=True, exist_ok=True)
        cli("certs", "init", "--dir", str(CERTS))
        made = True
    for _, node_id, region, *_ in NODES:
        if not (CERTS / f"{node_id}.pem").exists():
            cli("certs", "node", "--dir", str(CERTS), "--node-id", node_id, "--region", region)
            made = True
    if made:
        say(f"made certificates with `tenantgate certs` in {CERTS}")


def replace_once(text, old, new):
    if old not in text:
        raise Failure(f"envoy/demo.yaml no longer contains {old!r}")
    return text.replace(old, new)


def bootstrap(node_id, region, listener, jwt, admin):
    text = (REPO / "envoy/demo.yaml").read_text()
    for old, new in [
        ("port_value: 10000", f"port_value: {port(listener)}"),
        ("port_value: 10001", f"port_value: {port(jwt)}"),
        ("port_value: 9901", f"port_value: {port(admin)}"),
        ("port_value: 10002", f"port_value: {port('tenantgate serve sync API')}"),
        ("path: envoy/run/ecds.yaml", f"path: {ECDS}"),
        ("  id: tenantgate-demo\n", f"  id: {node_id}\n  locality: {{ region: {region} }}\n"),
    ]:
        text = replace_once(text, old, new)
    # The shipped mTLS snippet, exactly as docs/security.md says to paste it.
    snippet = "".join(
        line + "\n"
        for line in (REPO / "envoy/sync-mtls.yaml").read_text().splitlines()
        if not line.lstrip().startswith("#")
    )
    snippet = (
        snippet.replace("envoy/run/certs/tenantgate-demo.", f"{CERTS}/{node_id}.")
        .replace("envoy/run/certs/ca.pem", f"{CERTS}/ca.pem")
    )
    cluster = "  - name: tenantgate\n    type: STATIC\n"
    text = replace_once(text, cluster, cluster + snippet)
    return with_route_classes(text) if HOST == "module" else text


def with_route_classes(text):
    """The module's way: each route whose metadata names a class names it in
    its per-route config too (read with no lookup, module/src/route.rs)."""
    marker = "metadata: { filter_metadata: { tenantgate: { class: "
    out = []
    for line in text.splitlines():
        out.append(line)
        if marker in line:
            indent = line[: len(line) - len(line.lstrip())]
            cls = line.split(marker, 1)[1].split(" ", 1)[0].rstrip("}")
            out += [
                f"{indent}typed_per_filter_config:",
                f"{indent}  tenantgate:",
                f'{indent}    "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilterPerRoute',
                f"{indent}    dynamic_module_config: {{ module: {{ local: {{ filename: {MODULE.resolve()} }} }}, do_not_close: true }}",
                f"{indent}    per_route_config_name: tenantgate",
                f'{indent}    filter_config: {{ "@type": type.googleapis.com/google.protobuf.StringValue, value: {cls} }}',
            ]
    return "\n".join(out) + "\n"


def http_ok(url):
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


class Supervisor:
    def __init__(self):
        self.children = []  # (name, Popen, log path)
        self.stopping = False

    def start(self, name, argv, env=None):
        log = RUN_DIR / f"{name}.log"
        with open(log, "wb") as f:
            # Its own session: a terminal's Ctrl-C reaches only this script,
            # which then stops the children in order.
            child = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True,
                env=None if env is None else {**os.environ, **env},
            )
        self.children.append((name, child, log))
        say(f"started {name} pid {child.pid} (log {log})")
        return child

    def exited(self):
        for name, child, log in self.children:
            if child.poll() is not None:
                return name, child.returncode, log
        return None

    def wait_ready(self, what, url):
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.stopping:
                raise Failure("interrupted")
            gone = self.exited()
            if gone:
                raise Failure(f"{gone[0]} exited with {gone[1]}:\n{tail(gone[2])}")
            if http_ok(url):
                return
            time.sleep(0.1)
        raise Failure(f"{what} not ready in {READY_TIMEOUT_S:.0f} s ({url})")

    def stop(self):
        # The Envoys first, then the service they sync with.
        self.children.reverse()
        for _, child, _ in self.children:
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for name, child, _ in self.children:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            say(f"stopped {name} (pid {child.pid})")


def tail(path, lines=20):
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def banner():
    a, b = port("Envoy A listener"), port("Envoy B listener")
    aa, ba = port("Envoy A admin"), port("Envoy B admin")
    sa = port("tenantgate serve admin")
    say()
    host = "the native module" if HOST == "module" else "the wasm filter"
    say(f"tenantgate ({host}): the whole system is up (Ctrl-C stops everything)")
    say(f"  Envoy A (region eu) http://127.0.0.1:{a}  admin http://127.0.0.1:{aa}")
    say(f"  Envoy B (region us) http://127.0.0.1:{b}  admin http://127.0.0.1:{ba}")
    say(f"  tenantgate serve    sync 127.0.0.1:{port('tenantgate serve sync API')} (mTLS)"
        f"  admin http://127.0.0.1:{sa}/metrics")
    say("try:")
    say(f"  curl -i -H 'x-tenant-id: demo-free' http://127.0.0.1:{a}/api/orders      # 100/min per node")
    say(f"  curl -i -H 'x-tenant-id: demo-paid' http://127.0.0.1:{a}/api/orders      # 10,000/min")
    say(f"  for i in $(seq 150); do for p in {a} {b}; do curl -s -o /dev/null -w '%{{http_code}}\\n' \\")
    say("      -H 'x-tenant-id: demo-global' http://127.0.0.1:$p/api/orders; done; done | sort | uniq -c")
    say("      # demo-global: one budget of 100/min across both Envoys")
    say(f"  curl -s http://127.0.0.1:{sa}/metrics | grep tenantgate_")
    say(f"  change {POLICY.relative_to(REPO) if POLICY.is_relative_to(REPO) else POLICY},"
        " then: make ecds   (both Envoys and the service reload, no restart)")
    say("ready")


def main():
    busy = busy_ports()
    if busy:
        say("make run: these ports are busy (another `make run`, or another program):")
        for line in busy:
            say(line)
        return 2
    if HOST not in ("wasm", "module"):
        say(f"make run: HOST={HOST!r}: wasm or module")
        return 2
    code = (MODULE, "make module") if HOST == "module" else (WASM, "make wasm")
    for path, how in [(ENVOY, "make setup"), (CLI, "make cli"), code]:
        if not path.exists():
            say(f"make run: {path} is missing (run `{how}`)")
            return 2
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    sup = Supervisor()

    def on_signal(_sig, _frame):
        sup.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    status = 0
    try:
        make_certs()
        flag = ["--module", str(MODULE)] if HOST == "module" else ["--wasm", str(WASM)]
        say(cli("policy", "apply", str(POLICY), "--ecds", str(ECDS), *flag).strip())
        sup.start("serve", [
            str(CLI), "serve", "--policy", str(POLICY),
            "--listen", f"127.0.0.1:{port('tenantgate serve sync API')}",
            "--admin", f"127.0.0.1:{port('tenantgate serve admin')}",
            "--tls-cert", str(CERTS / "service.pem"), "--tls-key", str(CERTS / "service.key"),
            "--client-ca", str(CERTS / "ca.pem"),
        ])
        sup.wait_ready("tenantgate serve", f"http://127.0.0.1:{port('tenantgate serve admin')}/readyz")
        for name, node_id, region, listener, jwt, admin in NODES:
            config = RUN_DIR / f"{name}.yaml"
            config.write_text(bootstrap(node_id, region, listener, jwt, admin))
            sup.start(name, [
                str(ENVOY), "-c", str(config), "--concurrency", "2",
                "--disable-hot-restart", "-l", "warning",
            ], env={"TENANTGATE_NODE_ID": node_id, "TENANTGATE_REGION": region})
        for name, _, _, _, _, admin in NODES:
            sup.wait_ready(name, f"http://127.0.0.1:{port(admin)}/ready")
        banner()
        while not sup.stopping:
            gone = sup.exited()
            if gone:
                say(f"{gone[0]} exited with {gone[1]}; stopping the rest. Its log:\n{tail(gone[2])}")
                status = 2
                break
            time.sleep(0.2)
    except Failure as e:
        say(f"make run: {e}")
        status = 2
    finally:
        sup.stop()
    return status


if __name__ == "__main__":
    sys.exit(main())
