#!/usr/bin/env python3
"""`make bench`: what tenantgate costs Envoy, measured against baselines.

Ten configurations of Envoy 1.40 serve a direct_response route (no
upstream), interleaved over BENCH_ROUNDS rounds on this machine:

  (a) no filter
  (b) Envoy's native envoy.filters.http.local_ratelimit (never denies)
  (c) an empty Rust proxy-wasm filter (bench/empty-filter)
  (d) tenantgate, 1 tenant (bench/policies/one-tenant.yaml)
  (e) tenantgate, 10,000 tenants at random, two limits per key
      (bench/policies/10k-tenants.yaml + bench/wrk/tenants.lua)
  (f) Envoy's native local_ratelimit with one descriptor per tenant on
      x-tenant-id, the same 10,000 tenants at random (what a user would
      configure for per-tenant limits on one node)
  (g) tenantgate, 1 tenant, its limit global: leased by `tenantgate serve`
      (bench/policies/global.yaml), which runs beside Envoy
  (h) tenantgate, 1 tenant, admission control on: (d) plus an in-flight
      slot of one dependency per request, never at its limit
      (bench/policies/admission.yaml)
  (i) tenantgate, 1 tenant, adaptive concurrency on: (h) with the
      controller on its dependency (stream-end outcomes recorded, windows
      folded on the tick; the limit holds, never reached:
      bench/policies/adaptive.yaml)
  (j) tenantgate, 1 tenant, in its cheapest trusted configuration: (d)'s
      policy with `class: api` (the class from the filter instance, nothing
      looked up) and `ratelimit_headers: false` (headers on denials only)
  (k) the native module (libtenantgate_module.so, Envoy's dynamic modules)
      with (d)'s policy, the route's class in its per-route config
  (l) the native module with (e)'s 10,000 tenants x 2 limits
  (m) tenantgate, 1 tenant, its cost settled after the response from a
      JSON body (bench/policies/settle.yaml): the route answers an
      OpenAI-style body (usage.total_tokens 12, estimate 1), read for the
      figure as it passes, and settled in a second shared-data update;
      printed as a ratio to (d)

Then (a), (c), (d) and (j) again at one connection
(BENCH_LATENCY_CONNECTIONS=1) for their p50 latency, the same number of
rounds. Then the ablation (BENCH_ABLATION=0 skips it): (d) with one part of
its work turned off by configuration at a time, with its own (c) and (d).
Then the hostcall probe (BENCH_PROBE=0 skips it): the empty filter making
BENCH_PROBE_CALLS (4) calls of one kind per request (bench/empty-filter
lists the kinds), with its own (c), so (its CPU per request - (c)'s) / 4 is
the price of one call in this Envoy; and exactly (d)'s and (j)'s hostcalls
with nothing else. Last, the engine's own time per decision inside Envoy's
VM, from the self-time build (`--features self-time`, src/glue/self_time.rs)
loaded with (d)'s, (e)'s and (j)'s policies.

Each run starts a fresh Envoy (`--concurrency 1`, pinned to CPU 0, fresh
ports, `--disable-hot-restart`), warms it up, then measures BENCH_SECONDS of
`wrk --latency` (1 thread, pinned to CPU 1, BENCH_CONNECTIONS keep-alive
connections) and the Envoy process's CPU time (utime+stime from
/proc/<pid>/stat) over the same interval, and stops Envoy. Then one
2-worker run of (d), unpinned, reports CAS retries and shared-data updates
(src/pipeline/lease.rs) per decision from the
filter's stats.

BENCH_ONLY=i (or a comma-separated list of row keys) runs only those rows,
BENCH_ROUNDS times, prints them (with their ratio to (c) and to (d) when
they are among them) and stops: a quick check that a row works, not a
measurement (no baselines, no filter.json). Two rows run only there:
d-all and j-all, (d) and (j) applied with `--all-capabilities` (no
capability allow-list), so `BENCH_ONLY=c,d,d-all,j,j-all` shows what the
allow-list gains in one interleaved run; and l-headers, (l) with
`ratelimit_headers: false` (the headers on denials only, as (f)'s
local_ratelimit sends none by default), and l-off, (l) with `mode: off`
(the module called on every stream, deciding nothing).

BENCH_PAIR=x,y (two row keys) runs those two rows at once instead, every
round: both Envoys pinned to CPU 0, their two wrk on CPU 1, so whatever
else the machine runs slows both alike, and, both saturated, they share CPU
0 evenly: the ratio of their requests/s is the inverse ratio of their CPU
per request; each round's difference of CPU per request is measured under
the same conditions for both, busy or not. A comparison for a busy
machine, where separate runs are not comparable; printed, not written to
filter.json. BENCH_BEFORE=<dir> adds every tenantgate row again as
`<key>@before`, loading the `tenantgate.wasm` and `libtenantgate_module.so`
of another build from that directory: `BENCH_PAIR=d,d@before` measures a
change against the code before it under the same conditions (build the
earlier commit's `make wasm module` in a worktree and copy the two files).

Every tenantgate row is applied as in production, by `tenantgate policy
apply`, with the capability allow-list it writes (Envoy enters the VM only
for the callbacks the policy needs; docs/operations.md);
BENCH_CAPABILITIES=0 applies every row with `--all-capabilities` instead.
(c) and the probe's empty filter run with no allow-list (every callback,
as any filter gets by default). A run whose Envoy logged a refused call
(`Attempted call to restricted`) fails the bench.

Prints a table and writes target/bench/filter.json. Any non-2xx response or
socket error fails the command (a configuration that denies measures the
wrong thing); a missed target does not: benchmarks print, they don't assert.

Python 3 standard library only. Every process it starts (Envoy, wrk) is in
its own process group, and is stopped on exit, error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import copy
import datetime
import http.client
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from string import Template

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
OUT = REPO / "target" / "bench"
RUN_DIR = OUT / "run"


def env_int(name: str, default: int, minimum: int = 1) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        sys.exit(f"bench: {name}={raw!r} is not an integer")
    if value < minimum:
        sys.exit(f"bench: {name} must be at least {minimum}")
    return value


ROUNDS = env_int("BENCH_ROUNDS", 5)
SECONDS = env_int("BENCH_SECONDS", 4)
WARMUP = env_int("BENCH_WARMUP", 1)
# Extra warm-up of (g), in seconds: a few sync intervals.
SYNC_WARMUP = env_int("BENCH_SYNC_WARMUP", 4, minimum=0)
CONNECTIONS = env_int("BENCH_CONNECTIONS", 16)
LATENCY_CONNECTIONS = env_int("BENCH_LATENCY_CONNECTIONS", 1)
# 1: also run the ablation (see main); 0: skip it.
ABLATION = env_int("BENCH_ABLATION", 1, minimum=0)
# Rows to run alone (see the docstring); empty: the whole bench.
# The hostcall probe (bench/empty-filter): BENCH_PROBE_CALLS calls of one
# kind per request, per kind.
PROBE = env_int("BENCH_PROBE", 1, minimum=0)
PROBE_CALLS = env_int("BENCH_PROBE_CALLS", 4)
ONLY = [k.strip() for k in os.environ.get("BENCH_ONLY", "").split(",") if k.strip()]
PAIR = [k.strip() for k in os.environ.get("BENCH_PAIR", "").split(",") if k.strip()]
BEFORE = Path(os.environ["BENCH_BEFORE"]) if os.environ.get("BENCH_BEFORE") else None
# 1: tenantgate rows get the allow-list `policy apply` writes; 0: none.
CAPABILITIES = env_int("BENCH_CAPABILITIES", 1, minimum=0)
CAS_CONNECTIONS = env_int("BENCH_CAS_CONNECTIONS", 64)
# A pinned single worker under 16 connections is busy all the time. A run in
# which Envoy used less than MIN_UTIL of its CPU was disturbed (another
# process took CPU 0 or starved wrk on CPU 1) and is repeated, at most
# RETRIES times. Before each run, wait up to QUIET_WAIT s for the machine to
# be idle (other processes using less than 10% of one CPU).
MIN_UTIL = 0.90
RETRIES = env_int("BENCH_RETRIES", 3, minimum=0)
QUIET_WAIT = env_int("BENCH_QUIET_WAIT", 30, minimum=0)
TENANTS = 10_000
ENVOY_CPU = "0"
WRK_CPU = "1"
HOT_TENANT = "bench-tenant"
# (f): a descriptor with a one-token bucket, to check the descriptors match.
LIMITED_TENANT = "bench-limited"
PATH = "/api/bench"


def tool(env: str, default: Path) -> Path:
    path = Path(os.environ.get(env) or default)
    if not path.exists():
        sys.exit(f"bench: {path} not found ({env}); run `make bench`, which builds it")
    return path


ENVOY = tool("ENVOY_BIN", REPO / ".venv/bin/envoy")
CLI = tool("TENANTGATE_BIN", REPO / "target/debug/tenantgate")
WASM = tool("TENANTGATE_WASM", REPO / "target/wasm32-wasip1/wasm-release/tenantgate.wasm")
# `--features self-time` (src/glue/self_time.rs), built by `make bench`.
SELF_TIME_WASM = REPO / "target/self-time/wasm32-wasip1/wasm-release/tenantgate.wasm"
EMPTY_WASM = tool("EMPTY_WASM", REPO / "target/wasm32-wasip1/wasm-release/empty_filter.wasm")
# The native module (`make module`), for (k) and (l).
MODULE = tool("TENANTGATE_MODULE", REPO / "target/module-release/libtenantgate_module.so")


class BenchError(Exception):
    pass


class Disturbed(BenchError):
    """wrk timed out on a starved machine (no other error): run it again."""


# --------------------------------------------------------------- processes

CHILDREN: list[subprocess.Popen] = []


def spawn(argv: list[str], **kw) -> subprocess.Popen:
    """Starts a process in its own group and remembers it for clean-up."""
    proc = subprocess.Popen(argv, start_new_session=True, **kw)
    CHILDREN.append(proc)
    return proc


def stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stops one process we started (its group: the pid is the pgid)."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    if proc in CHILDREN:
        CHILDREN.remove(proc)


def stop_all() -> None:
    for proc in list(CHILDREN):
        stop(proc, grace=2.0)


def on_signal(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def machine_busy(interval: float = 0.5) -> float:
    """CPUs' worth of time the whole machine was busy during `interval`."""

    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    (t0, i0) = sample()
    time.sleep(interval)
    (t1, i1) = sample()
    total = max(t1 - t0, 1)
    return (total - (i1 - i0)) / total * len(os.sched_getaffinity(0))


def wait_quiet() -> float:
    """Waits (bounded) until other processes leave the CPUs idle; returns the wait."""
    start = time.monotonic()
    while time.monotonic() - start < QUIET_WAIT:
        if machine_busy() < 0.10:
            break
    return round(time.monotonic() - start, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------- Envoy


def http_get(port: int, path: str, headers: dict | None = None, timeout: float = 2.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def counters(admin: int, prefix: str) -> dict[str, int]:
    status, _, body = http_get(admin, "/stats?filter=" + re.escape(prefix))
    if status != 200:
        raise BenchError(f"admin /stats returned {status}")
    out = {}
    for line in body.decode().splitlines():
        name, _, value = line.partition(": ")
        if name.startswith(prefix) and value.strip().isdigit():
            out[name] = int(value)
    return out


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (all threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    # After "pid (comm) ": state is field 3, utime field 14, stime field 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def render_filters(name: str, ecds: Path | None) -> str:
    if name == "none":
        return ""
    if name == "local_ratelimit":
        return (BENCH / "envoy/filters/local-ratelimit.yaml").read_text()
    if name == "local_ratelimit_tenants":
        return tenant_descriptors_filter()
    text = (BENCH / "envoy/filters/ecds.yaml").read_text()
    return Template(text).substitute(FILTER_NAME=name, ECDS_PATH=str(ecds))


def tenant_descriptors_filter() -> str:
    """(f): local_ratelimit with one descriptor (and bucket) per tenant."""
    head = (BENCH / "envoy/filters/local-ratelimit-tenants.yaml").read_text().rstrip("\n")
    bucket = "{ max_tokens: 1000000000, tokens_per_fill: 1000000000, fill_interval: 1s }"
    lines = [head]
    lines.append(f"    - entries: [ {{ key: tenant, value: {LIMITED_TENANT} }} ]")
    lines.append("      token_bucket: { max_tokens: 1, tokens_per_fill: 1, fill_interval: 3600s }")
    for i in range(TENANTS):
        lines.append(f"    - entries: [ {{ key: tenant, value: t{i:05d} }} ]")
        lines.append(f"      token_bucket: {bucket}")
    return "\n".join(lines) + "\n"


def per_route_config(indent: str, cls: str, module: Path) -> list[str]:
    """The native module's per-route config: the route names its class, and
    the module reads it with no lookup (module/src/route.rs)."""
    return [
        f"{indent}typed_per_filter_config:",
        f"{indent}  tenantgate:",
        f'{indent}    "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilterPerRoute',
        f"{indent}    dynamic_module_config: {{ module: {{ local: {{ filename: {module.resolve()} }} }}, do_not_close: true }}",
        f"{indent}    per_route_config_name: tenantgate",
        f'{indent}    filter_config: {{ "@type": type.googleapis.com/google.protobuf.StringValue, value: {cls} }}',
    ]


# (m)'s answer: an OpenAI-style chat completion (its usage settles the cost).
SETTLE_BODY = (
    '{"id":"chatcmpl-bench","object":"chat.completion","model":"bench","choices":[{"index":0,'
    '"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}'
)


def render_bootstrap(
    filters: str, port: int, admin: int, sync_port: int, module: Path | None = None, body: str | None = None
) -> str:
    template = (BENCH / "envoy/bootstrap.yaml").read_text()
    if body is not None:
        plain = 'body: { inline_string: "ok\\n" }'
        if plain not in template:
            raise BenchError("bench/envoy/bootstrap.yaml no longer answers ok\\n")
        template = template.replace(plain, "body: { inline_string: " + json.dumps(body) + " }")
    lines = []
    marker = "metadata: { filter_metadata: { tenantgate: { class: "
    for line in template.splitlines():
        if line.strip() == "${HTTP_FILTERS}":
            indent = line[: len(line) - len(line.lstrip())]
            lines += [indent + l if l.strip() else l for l in filters.splitlines()]
        else:
            lines.append(line)
            if module and marker in line:
                cls = line.split(marker, 1)[1].split(" ", 1)[0].rstrip("}")
                lines += per_route_config(line[: len(line) - len(line.lstrip())], cls, module)
    return Template("\n".join(lines) + "\n").substitute(LISTEN_PORT=port, ADMIN_PORT=admin, SYNC_PORT=sync_port)


def write_empty_ecds(path: Path, configuration: str = "") -> None:
    """The ECDS file for (c) (an empty configuration) or the hostcall probe,
    the same resource shape `tenantgate policy apply` writes."""
    doc = {
        "resources": [
            {
                "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
                "name": "empty",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                    "config": {
                        "name": "empty",
                        "root_id": "empty",
                        "vm_config": {
                            "vm_id": "empty",
                            "runtime": "envoy.wasm.runtime.v8",
                            "code": {"local": {"filename": str(EMPTY_WASM.resolve())}},
                        },
                        "configuration": {
                            "@type": "type.googleapis.com/google.protobuf.StringValue",
                            "value": configuration,
                        },
                    },
                },
            }
        ]
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def apply_policy(
    policy: Path, ecds: Path, wasm: Path = WASM, module: Path | None = None, all_capabilities: bool = False
) -> None:
    """Exactly as in production: the CLI validates and writes the ECDS file
    (the native module's with `module`; the wasm filter's with its
    capability allow-list unless `all_capabilities`)."""
    code = ["--module", str(module)] if module else ["--wasm", str(wasm)]
    argv = [str(CLI), "policy", "apply", str(policy), "--ecds", str(ecds)] + code
    if not module and (all_capabilities or not CAPABILITIES):
        argv.append("--all-capabilities")
    res = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if res.returncode != 0:
        raise BenchError(f"tenantgate policy apply {policy} failed:\n{res.stderr}{res.stdout}")


def ten_thousand_tenants_policy(path: Path) -> Path:
    base = (BENCH / "policies/10k-tenants.yaml").read_text()
    lines = [base.rstrip("\n"), "tenants:"]
    for i in range(TENANTS):
        plan = "gold" if i % 2 == 0 else "silver"
        lines.append(f"  - {{ id: t{i:05d}, plan: {plan} }}")
    path.write_text("\n".join(lines) + "\n")
    return path


class Config:
    def __init__(self, key: str, label: str, filter_name: str, headers_check=None, wrk_args=(), serve=False, admission=False):
        self.key = key
        self.label = label
        # none | local_ratelimit | local_ratelimit_tenants | empty | tenantgate
        # | module (tenantgate as the native module)
        self.filter_name = filter_name
        self.policy: Path | None = None
        self.headers_check = headers_check
        self.wrk_args = list(wrk_args)
        # Runs `tenantgate serve` with the policy beside Envoy (g).
        self.serve = serve
        # Every request must take an admission slot (h).
        self.admission = admission
        # The empty filter's plugin configuration: "" for (c), else the
        # hostcalls the probe makes per request (bench/empty-filter).
        self.probe = ""
        # How many calls of one kind the probe makes (its price is per call).
        self.calls = 1
        # The tenantgate build to load (the self-time build for that step).
        self.wasm = WASM
        # The native module to load (another build's for BENCH_BEFORE).
        self.module = MODULE
        # Applied with `--all-capabilities` (no allow-list).
        self.all_capabilities = False
        # The direct_response body (None: "ok\n"); (m) answers JSON.
        self.body: str | None = None
        # Every request's cost is settled after the response (m).
        self.settles = False


class Envoy:
    """One Envoy on fresh loopback ports; always stopped by `close`."""

    def __init__(self, config: Config, tag: str, concurrency: int, cpu: str | None):
        self.dir = RUN_DIR / tag
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.port, self.admin, self.sync_port = free_port(), free_port(), free_port()
        while len({self.port, self.admin, self.sync_port}) < 3:
            self.admin, self.sync_port = free_port(), free_port()
        self.serve = None
        if config.serve:
            assert config.policy is not None
            self.serve_log = open(self.dir / "serve.log", "wb")
            # On wrk's CPU, off Envoy's: it answers one sync a second.
            self.serve = spawn(
                ["taskset", "-c", WRK_CPU, str(CLI), "serve", "--policy", str(config.policy), "--listen", f"127.0.0.1:{self.sync_port}"],
                stdout=self.serve_log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        ecds = self.dir / "ecds.yaml"
        module = config.filter_name == "module"
        if config.filter_name == "tenantgate" or module:
            assert config.policy is not None
            apply_policy(config.policy, ecds, config.wasm, config.module if module else None, config.all_capabilities)
        elif config.filter_name == "empty":
            write_empty_ecds(ecds, config.probe)
        bootstrap = self.dir / "bootstrap.yaml"
        # The ECDS filter is named `tenantgate` on both hosts.
        filters = render_filters("tenantgate" if module else config.filter_name, ecds)
        bootstrap.write_text(
            render_bootstrap(filters, self.port, self.admin, self.sync_port, config.module if module else None, config.body)
        )
        argv = [str(ENVOY), "-c", str(bootstrap), "--concurrency", str(concurrency)]
        argv += ["--disable-hot-restart", "-l", "warning"]
        if cpu is not None:
            argv = ["taskset", "-c", cpu] + argv
        self.log = open(self.dir / "envoy.log", "wb")
        # taskset and the .venv wrapper both exec: the pid is Envoy's own.
        self.proc = spawn(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.pid = self.proc.pid
        try:
            self._wait_ready(config)
        except BaseException:
            self.close()
            raise

    def _fail(self, why: str) -> BenchError:
        self.log.flush()
        tail = (self.dir / "envoy.log").read_text(errors="replace")[-3000:]
        return BenchError(f"Envoy ({self.dir}): {why}\n--- envoy.log (tail) ---\n{tail}")

    def _wait_ready(self, config: Config) -> None:
        deadline = time.monotonic() + 30
        last = "not started"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode}")
            try:
                status, headers, _ = http_get(self.port, PATH, {"x-tenant-id": HOT_TENANT}, timeout=1.0)
                if status == 200 and (config.headers_check is None or config.headers_check(headers)):
                    break
                last = f"probe got {status} {sorted(headers)}"
            except OSError as e:
                last = f"probe: {e}"
            time.sleep(0.05)
        else:
            raise self._fail(f"not serving within 30 s ({last})")
        if config.filter_name == "module":
            # The module really is in the chain: its ECDS resource was
            # accepted and it decided the probe.
            loaded = counters(self.admin, "extension_config_discovery.http_filter.tenantgate.")
            decided = counters(self.admin, "wasmcustom.tenantgate.config.loads")
            if not loaded.get("extension_config_discovery.http_filter.tenantgate.update_success") or not sum(
                decided.values()
            ):
                raise self._fail(f"the module is not loaded: {loaded} {decided}")
        if config.filter_name in ("empty", "tenantgate"):
            # The wasm filter really is in the chain: its ECDS resource was
            # accepted and a V8 VM runs.
            loaded = counters(self.admin, f"extension_config_discovery.http_filter.{config.filter_name}.")
            vms = counters(self.admin, "wasm.envoy.wasm.runtime.v8.active")
            if not loaded.get(f"extension_config_discovery.http_filter.{config.filter_name}.update_success") or not sum(
                vms.values()
            ):
                raise self._fail(f"the {config.filter_name} filter is not loaded: {loaded} {vms}")
        if config.filter_name == "local_ratelimit_tenants":
            # The descriptors really match: a one-token tenant is refused once.
            statuses = [http_get(self.port, PATH, {"x-tenant-id": LIMITED_TENANT})[0] for _ in range(2)]
            if statuses != [200, 429]:
                raise self._fail(f"per-tenant descriptors do not match x-tenant-id: {statuses}")
        if config.serve:
            # The synced path: wait for the node's first answered sync (a lease).
            deadline = time.monotonic() + 30
            while counters(self.admin, "wasmcustom.tenantgate.sync.ok").get("wasmcustom.tenantgate.sync.ok", 0) < 1:
                if time.monotonic() > deadline:
                    raise self._fail("no sync answered by tenantgate serve within 30 s")
                http_get(self.port, PATH, {"x-tenant-id": HOT_TENANT})
                time.sleep(0.1)
        exe = os.path.basename(os.readlink(f"/proc/{self.pid}/exe"))
        if exe != "envoy":
            raise self._fail(f"pid {self.pid} is {exe}, not envoy: CPU figures would be wrong")

    def cpu(self) -> float:
        return proc_cpu_seconds(self.pid)

    def check_no_refused_call(self) -> None:
        """The module was refused no capability (its allow-list is complete):
        a refused call fails and would measure the wrong thing."""
        if not self.log.closed:
            self.log.flush()
        for line in (self.dir / "envoy.log").read_text(errors="replace").splitlines():
            if "Attempted call to restricted" in line:
                raise BenchError(f"Envoy ({self.dir}) refused the filter a call: {line}")

    def close(self) -> None:
        stop(self.proc)
        self.log.close()
        if self.serve is not None:
            stop(self.serve)
            self.serve_log.close()


# --------------------------------------------------------------------- wrk

UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def parse_duration_ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if not m:
        raise BenchError(f"cannot parse wrk latency {text!r}")
    return round(float(m.group(1)) * UNITS[m.group(2)], 4)


def run_wrk(port: int, seconds: int, connections: int, threads: int, cpu: str | None, extra: list[str]) -> dict:
    argv = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency"]
    argv += ["-H", f"x-tenant-id: {HOT_TENANT}"] if not extra else []
    argv += [f"http://127.0.0.1:{port}{PATH}"] + extra
    if cpu is not None:
        argv = ["taskset", "-c", cpu] + argv
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        out, _ = proc.communicate(timeout=seconds + 30)
    except subprocess.TimeoutExpired:
        raise BenchError(f"wrk did not finish within {seconds + 30} s")
    finally:
        stop(proc)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise BenchError(f"wrk exited with {proc.returncode}:\n{text}")
    m = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", text)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if not m or not rps:
        raise BenchError(f"cannot parse wrk output:\n{text}")
    latency = dict(re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", text, re.M))
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    wrk_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {
        "requests": int(m.group(1)),
        "rps": float(rps.group(1)),
        "p50_ms": parse_duration_ms(latency["50"]),
        "p99_ms": parse_duration_ms(latency["99"]),
        "non_2xx": int(non_2xx.group(1)) if non_2xx else 0,
        "socket_errors": sum(int(x) for x in errors.groups()) if errors else 0,
        "timeouts": int(errors.group(4)) if errors else 0,
        "wrk_cpu_s": wrk_cpu,
        "output": text,
    }


# ------------------------------------------------------------------ runs


def one_run(config: Config, rnd: int, connections: int = CONNECTIONS) -> dict:
    """One measured run, repeated if Envoy was not kept busy (see MIN_UTIL).

    At one connection Envoy waits for wrk between requests, so it is never
    busy: those runs measure latency and are not repeated."""
    discarded = []
    waited = 0.0
    for attempt in range(RETRIES + 1):
        waited += wait_quiet()
        try:
            result = measure(config, rnd, connections)
        except Disturbed as e:
            # Timeouts only, while something else had Envoy's CPU: again.
            if attempt == RETRIES:
                raise
            print(f"  (disturbed: {str(e).splitlines()[0]}; repeating)", flush=True)
            continue
        if result["envoy_cpu_util"] >= MIN_UTIL or connections < CONNECTIONS:
            break
        discarded.append(result)
    else:
        # Keep the least disturbed attempt, flagged.
        result = max(discarded, key=lambda r: r["envoy_cpu_util"])
        discarded.remove(result)
        result["saturated"] = False
    result["quiet_wait_s"] = waited
    if discarded:
        result["discarded"] = [{k: r[k] for k in ("rps", "envoy_cpu_util", "wrk_cpu_util")} for r in discarded]
    return result


def measure(config: Config, rnd: int, connections: int) -> dict:
    envoy = Envoy(config, f"{config.key}-c{connections}-round{rnd}", concurrency=1, cpu=ENVOY_CPU)
    try:
        # The synced path warms up for a few sync intervals, so the leases
        # have followed the demand (the allocator averages it).
        warmup = WARMUP + (SYNC_WARMUP if config.serve else 0)
        run_wrk(envoy.port, warmup, connections, 1, WRK_CPU, config.wrk_args)  # warm-up, discarded
        tenantgate = config.filter_name in ("tenantgate", "module")
        before = counters(envoy.admin, "wasmcustom.tenantgate.") if tenantgate else {}
        cpu0, t0 = envoy.cpu(), time.monotonic()
        w = run_wrk(envoy.port, SECONDS, connections, 1, WRK_CPU, config.wrk_args)
        cpu1, t1 = envoy.cpu(), time.monotonic()
        if tenantgate:
            # Counters reach Envoy on the filter's tick (10 ms): wait two.
            time.sleep(0.03)
            after = counters(envoy.admin, "wasmcustom.tenantgate.")
            stats = {k: v - before.get(k, 0) for k, v in after.items()}
        else:
            stats = {}
    finally:
        envoy.close()
    envoy.check_no_refused_call()
    wall = t1 - t0
    result = {
        "round": rnd,
        "connections": connections,
        "rps": w["rps"],
        "p50_ms": w["p50_ms"],
        "p99_ms": w["p99_ms"],
        "cpu_us_per_req": round((cpu1 - cpu0) * 1e6 / w["requests"], 2) if w["requests"] else None,
        "requests": w["requests"],
        "non_2xx": w["non_2xx"],
        "socket_errors": w["socket_errors"],
        "envoy_cpu_util": round((cpu1 - cpu0) / wall, 3),
        "wrk_cpu_util": round(w["wrk_cpu_s"] / wall, 3),
    }
    if tenantgate:
        # Every request decided and let through: allowed (or, for the
        # `mode: off` ablation, disabled); nothing denied or unclassified.
        passed = ("allowed", "disabled")
        decided = {k.rsplit(".", 1)[1]: v for k, v in stats.items() if ".decisions." in k and v}
        result["decisions_allowed"] = decided.get("allowed", 0)
        if set(decided) - set(passed) or not decided:
            raise BenchError(f"{config.label}: the filter did not let every request through: {stats}")
        if config.settles:
            # Every decision's answer was read and its cost settled.
            settled = stats.get("wasmcustom.tenantgate.cost.settles.api", 0)
            result["settles"] = settled
            if settled < result["decisions_allowed"] * 0.99:
                raise BenchError(f"{config.label}: {settled} settled of {result['decisions_allowed']} allowed: {stats}")
        if config.admission:
            # Every request admitted through its dependency, none refused.
            # (Counters by outcome and level only: gauges are per dependency.)
            levels = ("system", "critical", "normal", "sheddable")
            outcomes = {
                k.split(".admission.", 1)[1]: v
                for k, v in stats.items()
                if ".admission." in k and k.rsplit(".", 1)[1] in levels and v
            }
            result["admission_admitted"] = outcomes.get("admitted.normal", 0)
            if set(outcomes) != {"admitted.normal"}:
                raise BenchError(f"{config.label}: not every request was admitted through its dependency: {outcomes}")
    if w["non_2xx"] or w["socket_errors"]:
        starved = not w["non_2xx"] and w["socket_errors"] == w["timeouts"] and result["envoy_cpu_util"] < MIN_UTIL
        raise (Disturbed if starved else BenchError)(
            f"{config.label}, round {rnd}: {w['non_2xx']} non-2xx responses and "
            f"{w['socket_errors']} socket errors; the configuration must not deny.\n{w['output']}"
        )
    return result


def cas_run(config: Config) -> dict:
    wait_quiet()
    envoy = Envoy(config, "cas-2-workers", concurrency=2, cpu=None)
    try:
        run_wrk(envoy.port, WARMUP, CAS_CONNECTIONS, 2, None, [])
        before = counters(envoy.admin, "wasmcustom.tenantgate.")
        w = run_wrk(envoy.port, SECONDS, CAS_CONNECTIONS, 2, None, [])
        after = counters(envoy.admin, "wasmcustom.tenantgate.")
    finally:
        envoy.close()
    envoy.check_no_refused_call()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    decisions = sum(v for k, v in delta.items() if ".decisions." in k)
    retries = delta.get("wasmcustom.tenantgate.cas.retries", 0)
    # Shared-data updates: every decision a lease or a remembered refusal
    # did not serve made one (its key's entry), and every lease given back
    # on a tick one more (src/pipeline/lease.rs).
    lease = lambda name: delta.get(f"wasmcustom.tenantgate.lease.{name}", 0)  # noqa: E731
    updates = decisions - lease("served") - lease("refusals_remembered") + lease("returned")
    if w["non_2xx"] or w["socket_errors"]:
        raise BenchError(
            f"CAS run: {w['non_2xx']} non-2xx responses, {w['socket_errors']} socket errors "
            f"(decisions: {delta})\n{w['output']}"
        )
    return {
        "workers": 2,
        "connections": CAS_CONNECTIONS,
        "wrk_threads": 2,
        "pinned": False,
        "rps": w["rps"],
        "p50_ms": w["p50_ms"],
        "p99_ms": w["p99_ms"],
        "requests": w["requests"],
        "decisions": decisions,
        "cas_retries": retries,
        "cas_retries_per_request": round(retries / decisions, 5) if decisions else None,
        "shared_updates": updates,
        "shared_updates_per_request": round(updates / decisions, 5) if decisions else None,
        "lease_served": lease("served"),
        "decision_counters": {k.removeprefix("wasmcustom.tenantgate."): v for k, v in delta.items() if v},
    }


SELF_TIME_LINE = re.compile(r"self-time: policy \S+ decision (\d+) ns, its (\d+) host calls alone (\d+) ns, engine (\d+) ns")


def self_time(configs: list[Config]) -> dict:
    """The engine's own time per decision inside Envoy's VM: the self-time
    build decides 20,000 times over an in-memory host on each configuration
    and logs it (src/glue/self_time.rs); medians over the VM's contexts.
    Skipped (empty) when that build is missing."""
    if not SELF_TIME_WASM.exists():
        print(f"  self-time: {SELF_TIME_WASM.relative_to(REPO)} not built (make bench builds it): skipped", flush=True)
        return {}
    out = {}
    for config in configs:
        c = Config(config.key, config.label, "tenantgate")
        c.policy = config.policy
        c.wasm = SELF_TIME_WASM
        envoy = Envoy(c, f"{config.key}-self-time", concurrency=1, cpu=ENVOY_CPU)
        envoy.close()
        envoy.check_no_refused_call()
        found = SELF_TIME_LINE.findall((envoy.dir / "envoy.log").read_text(errors="replace"))
        if not found:
            raise BenchError(f"self-time: no measurement in {envoy.dir / 'envoy.log'}")
        out[config.key] = {
            "label": config.label,
            "samples": len(found),
            "host_calls": int(found[0][1]),
            "decision_ns": median(int(f[0]) for f in found),
            "host_calls_alone_ns": median(int(f[2]) for f in found),
            "engine_ns": median(int(f[3]) for f in found),
        }
    return out


# --------------------------------------------------------------- report


def envoy_version() -> str:
    res = subprocess.run([str(ENVOY), "--version"], capture_output=True, text=True, timeout=60)
    m = re.search(r"version:\s*(\S+)", res.stdout + res.stderr)
    return m.group(1) if m else (res.stdout + res.stderr).strip()


def machine() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "kernel": platform.release(),
        "hostname": platform.node(),
    }


def median(xs, digits: int = 4):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), digits) if xs else None


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def only(by_key: dict) -> int:
    """BENCH_ONLY: the named rows alone (see the docstring)."""
    unknown = [k for k in ONLY if k not in by_key]
    if unknown:
        sys.exit(f"bench: BENCH_ONLY names unknown rows {unknown} (rows: {', '.join(by_key)})")
    chosen = [by_key[k] for k in ONLY]
    print(f"tenantgate bench, BENCH_ONLY={','.join(ONLY)}: {ROUNDS} round(s), {SECONDS} s each (a check, not a measurement)", flush=True)
    raw: dict[str, list[dict]] = {c.key: [] for c in chosen}
    for rnd in range(1, ROUNDS + 1):
        for config in chosen:
            r = one_run(config, rnd)
            raw[config.key].append(r)
            print(
                f"  round {rnd}/{ROUNDS}  {config.label:<40} {r['rps']:>9,.0f} req/s  "
                f"p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  {r['cpu_us_per_req']:.1f} us CPU/req",
                flush=True,
            )
    for base in ("c", "d"):
        if base not in raw:
            continue
        b = median(r["rps"] for r in raw[base])
        for key, rows in raw.items():
            cpu = median(r["cpu_us_per_req"] for r in rows)
            print(f"  ({key}) / ({base}): {median(r['rps'] for r in rows) / b:.2f} x  ({fmt(cpu, '.1f')} us CPU/req)")
    return 0


def wrk_both(envoys: dict, configs: dict, seconds: int) -> dict:
    """wrk on every Envoy at once (each 1 thread, CONNECTIONS connections,
    pinned to WRK_CPU): its results by row key."""
    import threading

    results: dict = {}
    errors: list = []

    def one(key):
        try:
            results[key] = run_wrk(envoys[key].port, seconds, CONNECTIONS, 1, WRK_CPU, configs[key].wrk_args)
        except BaseException as e:  # re-raised below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(k,)) for k in envoys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def before_twins(rows: dict) -> dict:
    """BENCH_BEFORE: every row again as `<key>@before`, loading the filter
    and the module of another build (the directory's `tenantgate.wasm` and
    `libtenantgate_module.so`), so `BENCH_PAIR=d,d@before` measures a
    change against the code before it under the same conditions."""
    if not BEFORE:
        return {}
    wasm, module = BEFORE / "tenantgate.wasm", BEFORE / "libtenantgate_module.so"
    for path in (wasm, module):
        if not path.exists():
            sys.exit(f"bench: BENCH_BEFORE has no {path.name} ({path})")
    twins = {}
    for key, c in rows.items():
        if c.filter_name not in ("tenantgate", "module") or c.wasm != WASM:
            continue
        twin = copy.copy(c)
        twin.key, twin.label = f"{key}@before", f"{c.label} (before: {BEFORE})"
        twin.wasm, twin.module = wasm, module
        twins[twin.key] = twin
    return twins


def paired(by_key: dict) -> int:
    """BENCH_PAIR: two rows at once (see the docstring)."""
    if len(PAIR) != 2 or any(k not in by_key for k in PAIR):
        sys.exit(f"bench: BENCH_PAIR names two of: {', '.join(by_key)}")
    x, y = by_key[PAIR[0]], by_key[PAIR[1]]
    configs = {x.key: x, y.key: y}
    print(
        f"tenantgate bench, BENCH_PAIR={x.key},{y.key}: {ROUNDS} round(s), {SECONDS} s each, "
        f"both Envoys on CPU {ENVOY_CPU}, both wrk on CPU {WRK_CPU}",
        flush=True,
    )
    rounds = []
    for rnd in range(1, ROUNDS + 1):
        wait_quiet()
        order = (x, y) if rnd % 2 else (y, x)
        envoys: dict = {}
        try:
            for c in order:
                envoys[c.key] = Envoy(c, f"pair-{c.key}-round{rnd}", concurrency=1, cpu=ENVOY_CPU)
            wrk_both(envoys, configs, WARMUP)
            cpu0, t0 = {k: e.cpu() for k, e in envoys.items()}, time.monotonic()
            results = wrk_both(envoys, configs, SECONDS)
            cpu1, t1 = {k: e.cpu() for k, e in envoys.items()}, time.monotonic()
        finally:
            for e in envoys.values():
                e.close()
        row = {}
        for key, e in envoys.items():
            e.check_no_refused_call()
            w = results[key]
            if w["non_2xx"] or w["socket_errors"]:
                raise BenchError(f"{configs[key].label}, round {rnd}: {w['non_2xx']} non-2xx, {w['socket_errors']} socket errors")
            row[key] = {
                "rps": w["rps"],
                "cpu_us_per_req": round((cpu1[key] - cpu0[key]) * 1e6 / w["requests"], 2) if w["requests"] else None,
                "envoy_cpu_util": round((cpu1[key] - cpu0[key]) / (t1 - t0), 3),
            }
        row["ratio"] = round(row[x.key]["rps"] / row[y.key]["rps"], 4)
        rounds.append(row)
        print(
            f"  round {rnd}/{ROUNDS}  " + "  ".join(
                f"({k}) {row[k]['rps']:>8,.0f} req/s {fmt(row[k]['cpu_us_per_req'], '.1f')} us CPU/req (CPU {row[k]['envoy_cpu_util']:.0%})"
                for k in (x.key, y.key)
            ) + f"  ({x.key})/({y.key}) {row['ratio']:.3f}",
            flush=True,
        )
    # Each round's difference, then their median: what the two rows cost
    # apart under the same conditions.
    diffs = [
        r[x.key]["cpu_us_per_req"] - r[y.key]["cpu_us_per_req"]
        for r in rounds
        if r[x.key]["cpu_us_per_req"] is not None and r[y.key]["cpu_us_per_req"] is not None
    ]
    print(
        f"  medians: ({x.key})/({y.key}) {median(r['ratio'] for r in rounds):.3f} x by requests/s "
        f"(a cost ratio only if both Envoys were busy); CPU/req "
        f"({x.key}) {fmt(median(r[x.key]['cpu_us_per_req'] for r in rounds), '.1f')} us, "
        f"({y.key}) {fmt(median(r[y.key]['cpu_us_per_req'] for r in rounds), '.1f')} us; "
        f"({x.key}) - ({y.key}) {fmt(median(diffs, 2), '+.2f')} us a request (median of the rounds' "
        f"differences, {sum(d < 0 for d in diffs)} of {len(diffs)} rounds below 0)"
    )
    return 0


def interleaved(name: str, configs: list[Config]) -> dict[str, list[dict]]:
    """ROUNDS rounds of `configs` (none if empty), the start rotating each
    round, as the ablation and the probe run: CPU per request is what they
    compare."""
    runs: dict[str, list[dict]] = {c.key: [] for c in configs}
    for rnd in range(1, ROUNDS + 1 if configs else 1):
        shift = (rnd - 1) % len(configs)
        for config in configs[shift:] + configs[:shift]:
            r = one_run(config, rnd)
            runs[config.key].append(r)
            print(
                f"  {name} {rnd}/{ROUNDS}  {config.label:<40} {r['rps']:>9,.0f} req/s  "
                f"{r['cpu_us_per_req']:.1f} us CPU/req  (Envoy CPU {r['envoy_cpu_util']:.0%})",
                flush=True,
            )
    return runs


def main() -> int:
    for tool_name in ("wrk", "taskset"):
        if shutil.which(tool_name) is None:
            sys.exit(f"bench: `{tool_name}` not found (apt-get install -y {'wrk' if tool_name == 'wrk' else 'util-linux'})")
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("bench: needs at least 2 CPUs (Envoy on CPU 0, wrk on CPU 1)")

    shutil.rmtree(RUN_DIR, ignore_errors=True)
    RUN_DIR.mkdir(parents=True)
    has_ratelimit = lambda h: "ratelimit-policy" in h  # noqa: E731

    tenants_lua = ["-s", str(BENCH / "wrk/tenants.lua"), "--", str(TENANTS)]
    configs = [
        Config("a", "(a) no filter", "none"),
        Config("b", "(b) native local_ratelimit", "local_ratelimit"),
        Config("c", "(c) empty Rust wasm filter", "empty"),
        Config("d", "(d) tenantgate, 1 tenant", "tenantgate", has_ratelimit),
        Config("e", f"(e) tenantgate, {TENANTS:,} tenants x 2 limits", "tenantgate", has_ratelimit, tenants_lua),
        Config("f", f"(f) native local_ratelimit, {TENANTS:,} tenants", "local_ratelimit_tenants", None, tenants_lua),
        Config("g", "(g) tenantgate, 1 tenant, global (serve)", "tenantgate", has_ratelimit, serve=True),
        Config("h", "(h) tenantgate, 1 tenant, admission", "tenantgate", has_ratelimit, admission=True),
        Config("i", "(i) tenantgate, 1 tenant, adaptive", "tenantgate", has_ratelimit, admission=True),
        Config("j", "(j) tenantgate, 1 tenant, lean config", "tenantgate"),
        Config("k", "(k) module, 1 tenant", "module", has_ratelimit),
        Config("l", f"(l) module, {TENANTS:,} tenants x 2 limits", "module", has_ratelimit, tenants_lua),
        Config("m", "(m) tenantgate, 1 tenant, settled (JSON)", "tenantgate", has_ratelimit),
    ]
    by_key = {c.key: c for c in configs}
    by_key["d"].policy = BENCH / "policies/one-tenant.yaml"
    by_key["e"].policy = ten_thousand_tenants_policy(OUT / "10k-tenants.yaml")
    by_key["g"].policy = BENCH / "policies/global.yaml"
    by_key["k"].policy = by_key["d"].policy
    by_key["l"].policy = by_key["e"].policy
    by_key["h"].policy = BENCH / "policies/admission.yaml"
    by_key["i"].policy = BENCH / "policies/adaptive.yaml"
    by_key["m"].policy = BENCH / "policies/settle.yaml"
    by_key["m"].body = SETTLE_BODY
    by_key["m"].settles = True
    # (j): (d) in its cheapest trusted configuration: the class from the
    # filter instance (no lookup), RateLimit headers on denials only.
    by_key["j"].policy = OUT / "lean.yaml"
    one_tenant = (BENCH / "policies/one-tenant.yaml").read_text()
    by_key["j"].policy.write_text(one_tenant.replace("mode: enforce\n", "") + "class: api\nratelimit_headers: false\n")
    latency_configs = [by_key[k] for k in ("a", "c", "d", "j")]
    # The ablation: (d) with one part of the work taken away at a time,
    # each a configuration users can run (nothing is patched out).
    ablation = []
    if ABLATION:
        one = (BENCH / "policies/one-tenant.yaml").read_text()
        for key, label, extra, check in (
            ("d-headers", "(d) ratelimit_headers: false", "ratelimit_headers: false\n", None),
            ("d-route-name", "(d) classify: route_name", "classify: route_name\n", has_ratelimit),
            ("d-instance", "(d) class: api (per-instance class)", "class: api\n", has_ratelimit),
            ("d-lean", "(d) class: api, no headers", "class: api\nratelimit_headers: false\n", None),
            ("d-off", "(d) mode: off (classify nothing)", "mode: off\n", None),
        ):
            c = Config(key, label, "tenantgate", check)
            c.policy = OUT / f"ablation-{key}.yaml"
            c.policy.write_text(one.replace("mode: enforce\n", "") + extra)
            ablation.append(c)

    # The hostcall probe: the empty filter making PROBE_CALLS calls of one
    # kind per request, so (its CPU per request - its own (c)'s) / PROBE_CALLS
    # is one call's price in this Envoy; then exactly the calls (d) makes,
    # and the fewest a per-tenant limit shared by workers can make, with no
    # engine behind them.
    probes = []
    if PROBE:
        for kind in ("clock", "header", "metadata", "route_name", "shared_cas", "response_header"):
            c = Config(f"p-{kind}", f"{PROBE_CALLS} x {kind}", "empty")
            c.probe = ",".join([kind] * PROBE_CALLS)
            c.calls = PROBE_CALLS
            probes.append(c)
        for key, label, calls in (
            ("p-d", "(d)'s hostcalls, nothing else", "clock,metadata,header,shared_cas,response_header,response_header"),
            ("p-j", "(j)'s hostcalls, nothing else", "clock,header,shared_cas"),
        ):
            c = Config(key, label, "empty")
            c.probe = calls
            c.calls = 1
            probes.append(c)

    # Only with BENCH_ONLY: (d) and (j) without the capability allow-list.
    unrestricted = []
    for key in ("d", "j"):
        c = Config(f"{key}-all", f"{by_key[key].label}, no allow-list", "tenantgate", by_key[key].headers_check)
        c.policy = by_key[key].policy
        c.all_capabilities = True
        unrestricted.append(c)

    # Only with BENCH_ONLY or BENCH_PAIR: (l) without its RateLimit headers
    # (on denials only), what (f)'s local_ratelimit sends by default.
    # And (l) with `mode: off`: the module loaded and called on every
    # stream, deciding nothing (what Envoy's dynamic-module machinery costs).
    module_ablation = []
    for key, label, extra_yaml in (
        ("l-headers", f"{by_key['l'].label}, ratelimit_headers: false", "ratelimit_headers: false\n"),
        ("l-off", f"{by_key['l'].label}, mode: off", "mode: off\n"),
    ):
        c = Config(key, label, "module", None, tenants_lua)
        c.policy = OUT / f"ablation-{key}.yaml"
        c.policy.write_text(by_key["e"].policy.read_text().replace("mode: enforce\n", "") + extra_yaml)
        module_ablation.append(c)
    extra = ablation + probes + unrestricted + module_ablation

    if PAIR:
        rows = {**by_key, **{c.key: c for c in extra}}
        return paired({**rows, **before_twins(rows)})
    if ONLY:
        return only({**by_key, **{c.key: c for c in extra}})

    version = envoy_version()
    mach = machine()
    print(
        f"tenantgate bench: Envoy {version}; {mach['nproc']} CPUs ({mach['cpu_model']}); "
        f"{ROUNDS} rounds x {len(configs)} configs, {SECONDS} s each after {WARMUP} s warm-up; "
        f"Envoy --concurrency 1 on CPU {ENVOY_CPU}, wrk 1 thread x {CONNECTIONS} connections on CPU {WRK_CPU}",
        flush=True,
    )

    raw: dict[str, list[dict]] = {c.key: [] for c in configs}
    for rnd in range(1, ROUNDS + 1):
        # Rotate the order each round so no configuration always runs first.
        shift = (rnd - 1) % len(configs)
        for config in configs[shift:] + configs[:shift]:
            r = one_run(config, rnd)
            raw[config.key].append(r)
            note = f"  [{len(r['discarded'])} disturbed run(s) repeated]" if r.get("discarded") else ""
            note += "  [never saturated: noisy]" if r.get("saturated") is False else ""
            print(
                f"  round {rnd}/{ROUNDS}  {config.label:<40} {r['rps']:>9,.0f} req/s  "
                f"p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  "
                f"{r['cpu_us_per_req']:.1f} us CPU/req  (Envoy CPU {r['envoy_cpu_util']:.0%}, wrk {r['wrk_cpu_util']:.0%}){note}",
                flush=True,
            )
        base = raw["a"][-1]["rps"]
        for config in configs:
            raw[config.key][-1]["ratio_to_a"] = round(raw[config.key][-1]["rps"] / base, 4)
        raw["d"][-1]["ratio_to_c"] = round(raw["d"][-1]["rps"] / raw["c"][-1]["rps"], 4)
        raw["j"][-1]["ratio_to_c"] = round(raw["j"][-1]["rps"] / raw["c"][-1]["rps"], 4)
        raw["g"][-1]["ratio_to_d"] = round(raw["g"][-1]["rps"] / raw["d"][-1]["rps"], 4)
        raw["h"][-1]["ratio_to_d"] = round(raw["h"][-1]["rps"] / raw["d"][-1]["rps"], 4)
        raw["i"][-1]["ratio_to_d"] = round(raw["i"][-1]["rps"] / raw["d"][-1]["rps"], 4)
        raw["i"][-1]["ratio_to_h"] = round(raw["i"][-1]["rps"] / raw["h"][-1]["rps"], 4)
        raw["k"][-1]["ratio_to_d"] = round(raw["k"][-1]["rps"] / raw["d"][-1]["rps"], 4)
        raw["m"][-1]["ratio_to_d"] = round(raw["m"][-1]["rps"] / raw["d"][-1]["rps"], 4)
        raw["l"][-1]["ratio_to_f"] = round(raw["l"][-1]["rps"] / raw["f"][-1]["rps"], 4)

    latency: dict[str, list[dict]] = {c.key: [] for c in latency_configs}
    for rnd in range(1, ROUNDS + 1):
        shift = (rnd - 1) % len(latency_configs)
        for config in latency_configs[shift:] + latency_configs[:shift]:
            r = one_run(config, rnd, LATENCY_CONNECTIONS)
            latency[config.key].append(r)
            print(
                f"  round {rnd}/{ROUNDS}  {config.label + f' @{LATENCY_CONNECTIONS} conn':<40} {r['rps']:>9,.0f} req/s  "
                f"p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms",
                flush=True,
            )
        for key in ("d", "j"):
            latency[key][-1]["p50_minus_c_us"] = round((latency[key][-1]["p50_ms"] - latency["c"][-1]["p50_ms"]) * 1000, 1)

    # Ablation rounds, each with (c) and (d) of their own as the reference;
    # probe rounds with a (c) of their own.
    abl_configs = [by_key["c"], by_key["d"]] + ablation if ablation else []
    abl = interleaved("ablation", abl_configs)
    probe_configs = [by_key["c"]] + probes if probes else []
    prb = interleaved("probe", probe_configs)

    print("  2 workers (unpinned), 1 hot tenant: CAS retries ...", flush=True)
    cas = cas_run(by_key["d"])
    cas_module = cas_run(by_key["k"])
    print("  the engine's own time inside the VM (self-time build) ...", flush=True)
    engine_time = self_time([by_key[k] for k in ("d", "e", "j")])

    summary = {}
    for config in configs:
        rows = raw[config.key]
        summary[config.key] = {
            "label": config.label,
            "median": {
                "rps": median(r["rps"] for r in rows),
                "p50_ms": median(r["p50_ms"] for r in rows),
                "p99_ms": median(r["p99_ms"] for r in rows),
                "cpu_us_per_req": median(r["cpu_us_per_req"] for r in rows),
                "ratio_to_a": median(r["ratio_to_a"] for r in rows),
            },
            "rounds": rows,
        }
    summary["d"]["median"]["ratio_to_c"] = median(r["ratio_to_c"] for r in raw["d"])
    summary["j"]["median"]["ratio_to_c"] = median(r["ratio_to_c"] for r in raw["j"])
    summary["g"]["median"]["ratio_to_d"] = median(r["ratio_to_d"] for r in raw["g"])
    summary["h"]["median"]["ratio_to_d"] = median(r["ratio_to_d"] for r in raw["h"])
    summary["i"]["median"]["ratio_to_d"] = median(r["ratio_to_d"] for r in raw["i"])
    summary["i"]["median"]["ratio_to_h"] = median(r["ratio_to_h"] for r in raw["i"])
    summary["k"]["median"]["ratio_to_d"] = median(r["ratio_to_d"] for r in raw["k"])
    summary["m"]["median"]["ratio_to_d"] = median(r["ratio_to_d"] for r in raw["m"])
    summary["l"]["median"]["ratio_to_f"] = median(r["ratio_to_f"] for r in raw["l"])
    for config in latency_configs:
        rows = latency[config.key]
        summary[config.key]["one_connection"] = {
            "connections": LATENCY_CONNECTIONS,
            "median": {"p50_ms": median(r["p50_ms"] for r in rows), "p99_ms": median(r["p99_ms"] for r in rows)},
            "rounds": rows,
        }
    p50_over_c = {}
    for key in ("d", "j"):
        p50_over_c[key] = median(r["p50_minus_c_us"] for r in latency[key])
        summary[key]["one_connection"]["median"]["p50_minus_c_us"] = p50_over_c[key]
    d_minus_c_us = p50_over_c["d"]

    targets = []
    for key, against, field, goal in (
        ("d", "a", "ratio_to_a", 0.60),
        ("d", "c", "ratio_to_c", 0.85),
        ("e", "a", "ratio_to_a", 0.55),
        ("g", "d", "ratio_to_d", 0.90),
        ("j", "a", "ratio_to_a", 0.60),
        ("j", "c", "ratio_to_c", 0.85),
        ("k", "a", "ratio_to_a", 0.85),
        ("l", "f", "ratio_to_f", 1.00),
    ):
        measured = summary[key]["median"][field]
        targets.append(
            {
                "config": key,
                "against": against,
                "target": f">= {goal:.2f} x ({against})",
                "measured": round(measured, 4),
                "result": "PASS" if measured >= goal else "MISS",
            }
        )
    for key in ("d", "j"):
        targets.append(
            {
                "config": key,
                "against": "c",
                "target": f"p50 at {LATENCY_CONNECTIONS} connection within 5 us of (c)",
                "measured": p50_over_c[key],
                "result": "PASS" if p50_over_c[key] is not None and p50_over_c[key] <= 5.0 else "MISS",
            }
        )

    # ------------------------------------------------------------ table
    a_cpu = summary["a"]["median"]["cpu_us_per_req"]
    print()
    print(f"{'configuration':<40} {'req/s':>9} {'x (a)':>6} {'p50 ms':>7} {'p99 ms':>7} {'CPU us/req':>10} {'+us vs (a)':>10}")
    print("-" * 95)
    for config in configs:
        m = summary[config.key]["median"]
        extra = m["cpu_us_per_req"] - a_cpu if m["cpu_us_per_req"] is not None and a_cpu is not None else None
        print(
            f"{config.label:<40} {m['rps']:>9,.0f} {m['ratio_to_a']:>6.2f} {m['p50_ms']:>7.3f} "
            f"{m['p99_ms']:>7.3f} {fmt(m['cpu_us_per_req'], '>10.1f')} {fmt(extra, '>+10.1f')}"
        )
    print()
    print(f"medians of {ROUNDS} interleaved rounds; x (a) is the median of per-round ratios")
    ablation_summary = {}
    if abl_configs:
        c_cpu = median(r["cpu_us_per_req"] for r in abl["c"])
        print()
        print(f"ablation (medians of {ROUNDS} rounds; CPU us/req over its own (c) run: {fmt(c_cpu, '.1f')})")
        for config in abl_configs:
            rows = abl[config.key]
            cpu = median(r["cpu_us_per_req"] for r in rows)
            ablation_summary[config.key] = {
                "label": config.label,
                "median": {"rps": median(r["rps"] for r in rows), "cpu_us_per_req": cpu},
                "rounds": rows,
            }
            over = cpu - c_cpu if cpu is not None and c_cpu is not None else None
            print(f"  {config.label:<40} {ablation_summary[config.key]['median']['rps']:>9,.0f} req/s  {fmt(cpu, '>6.1f')} us CPU/req  {fmt(over, '>+6.1f')} us vs (c)")
        print()
    print(f"p50 at {LATENCY_CONNECTIONS} connection (medians of {ROUNDS} rounds):", end="")
    for config in latency_configs:
        print(f"  {config.key}: {summary[config.key]['one_connection']['median']['p50_ms']:.3f} ms", end="")
    print(f"  (d) - (c): {fmt(p50_over_c['d'], '+.1f')} us  (j) - (c): {fmt(p50_over_c['j'], '+.1f')} us")
    for t in targets:
        print(f"target ({t['config']}) {t['target']}: {fmt(t['measured'], '.2f')}  {t['result']}")
    probe_summary = {}
    if probe_configs:
        c_cpu = median(r["cpu_us_per_req"] for r in prb["c"])
        print()
        print(f"hostcall probe (medians of {ROUNDS} rounds; CPU us/req over its own (c) run: {fmt(c_cpu, '.1f')})")
        for config in probes:
            cpu = median(r["cpu_us_per_req"] for r in prb[config.key])
            over = cpu - c_cpu if cpu is not None and c_cpu is not None else None
            per_call = over / config.calls if over is not None and config.calls > 1 else None
            probe_summary[config.key] = {
                "label": config.label,
                "calls": config.probe,
                "median": {"cpu_us_per_req": cpu, "over_c_us": over, "per_call_us": per_call},
                "rounds": prb[config.key],
            }
            each = f"  {fmt(per_call, '>5.2f')} us a call" if per_call is not None else ""
            print(f"  {config.label:<40} {fmt(cpu, '>6.1f')} us CPU/req  {fmt(over, '>+6.1f')} us vs (c){each}")
        probe_summary["c"] = {"label": by_key["c"].label, "median": {"cpu_us_per_req": c_cpu}, "rounds": prb["c"]}
        print()
    h_cpu, d_cpu = summary["h"]["median"]["cpu_us_per_req"], summary["d"]["median"]["cpu_us_per_req"]
    print(
        f"admission (h) vs (d): {fmt(summary['h']['median']['ratio_to_d'], '.2f')} x by throughput, "
        f"{fmt(h_cpu - d_cpu if h_cpu is not None and d_cpu is not None else None, '+.1f')} us CPU/req"
    )
    i_cpu = summary["i"]["median"]["cpu_us_per_req"]
    print(
        f"adaptive (i) vs (d): {fmt(summary['i']['median']['ratio_to_d'], '.2f')} x by throughput, "
        f"{fmt(i_cpu - d_cpu if i_cpu is not None and d_cpu is not None else None, '+.1f')} us CPU/req; "
        f"vs (h): {fmt(summary['i']['median']['ratio_to_h'], '.2f')} x, "
        f"{fmt(i_cpu - h_cpu if i_cpu is not None and h_cpu is not None else None, '+.1f')} us CPU/req"
    )
    print(
        f"module (k) vs wasm (d): {fmt(summary['k']['median']['ratio_to_d'], '.2f')} x by throughput; "
        f"(l) vs native local_ratelimit with {TENANTS:,} descriptors (f): {fmt(summary['l']['median']['ratio_to_f'], '.2f')} x"
    )
    m_cpu = summary["m"]["median"]["cpu_us_per_req"]
    print(
        f"settled from a JSON body (m) vs (d): {fmt(summary['m']['median']['ratio_to_d'], '.2f')} x by throughput, "
        f"{fmt(m_cpu - d_cpu if m_cpu is not None and d_cpu is not None else None, '+.1f')} us CPU/req "
        f"(the body read as it passes and a second shared-data update per request)"
    )
    for key, t in engine_time.items():
        print(
            f"engine inside the VM, {t['label']}: {t['decision_ns']:,.0f} ns a decision over an in-memory host, "
            f"its {t['host_calls']} host calls alone {t['host_calls_alone_ns']:,.0f} ns: "
            f"engine {t['engine_ns']:,.0f} ns ({t['samples']} contexts)"
        )
    print(
        f"CAS, 2 workers, 1 hot tenant, {CAS_CONNECTIONS} connections: {cas['cas_retries']:,} retries / "
        f"{cas['decisions']:,} decisions = {fmt(cas['cas_retries_per_request'], '.4f')} retries per request, "
        f"{cas['shared_updates']:,} shared-data updates = {fmt(cas['shared_updates_per_request'], '.4f')} per request "
        f"({cas['lease_served']:,} served from worker leases; {cas['rps']:,.0f} req/s)"
    )

    print(
        f"CAS on the module, 2 workers, 1 hot tenant: {cas_module['cas_retries']:,} retries / "
        f"{cas_module['decisions']:,} decisions = {fmt(cas_module['cas_retries_per_request'], '.4f')} per request, "
        f"{fmt(cas_module['shared_updates_per_request'], '.4f')} shared-data updates per request "
        f"({cas_module['lease_served']:,} from worker leases; {cas_module['rps']:,.0f} req/s)"
    )

    report = {
        "schema": 1,
        "generated_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "envoy_version": version,
        "machine": mach,
        "settings": {
            "rounds": ROUNDS,
            "seconds": SECONDS,
            "warmup_seconds": WARMUP,
            "envoy": {"concurrency": 1, "cpu": int(ENVOY_CPU)},
            "wrk": {"threads": 1, "connections": CONNECTIONS, "cpu": int(WRK_CPU), "path": PATH},
            "latency_connections": LATENCY_CONNECTIONS,
            "order": "interleaved; the start rotates each round",
            "valid_run": f"Envoy busy >= {MIN_UTIL:.0%} of its CPU, else repeated (up to {RETRIES} times)",
            "quiet_wait_max_s": QUIET_WAIT,
            "capability_allow_list": bool(CAPABILITIES),
        },
        "configs": summary,
        "targets": targets,
        "ablation": ablation_summary,
        "probe": probe_summary,
        "engine_in_vm": engine_time,
        "cas": cas,
        "cas_module": cas_module,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "filter.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {(OUT / 'filter.json').relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    # SIGINT too: a shell may start the script with SIGINT ignored.
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    try:
        code = main()
    except BenchError as e:
        print(f"bench: FAILED: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        code = 130
    finally:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        stop_all()
    sys.exit(code)
