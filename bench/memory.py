#!/usr/bin/env python3
"""Envoy's resident memory against the number of distinct tenants.

Starts Envoy 1.40 (one worker) with the tenantgate filter (`--host wasm`)
or the native module (`--host module`) and a policy whose
key table holds `--max-keys` keys (default 1,000,000), then sends one request
per new tenant id with wrk, and reads Envoy's VmRSS after 1, 100,000 and
1,000,000 distinct tenants, then after as many again (the table is full by
then: memory must stop growing). Prints a table and writes
target/bench/memory.json with the bytes per key.

Standard library only. Traffic goes to 127.0.0.1; every wrk run is bounded
by a request count and a time limit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENVOY = Path(os.environ.get("ENVOY_BIN", REPO / ".venv/bin/envoy"))
CLI = Path(os.environ.get("TENANTGATE_BIN", REPO / "target/debug/tenantgate"))
WASM = Path(os.environ.get("TENANTGATE_WASM", REPO / "target/wasm32-wasip1/wasm-release/tenantgate.wasm"))
MODULE = Path(os.environ.get("TENANTGATE_MODULE", REPO / "target/module-release/libtenantgate_module.so"))

POLICY = """
version: "memory-bench"
identity: {{ header: x-tenant-id }}
plans:
  # Generous: every request is admitted, and a bucket is idle (its slot
  # reclaimable) 1 ms after its request.
  free: {{ limits: [ {{ rate: 1000, per: 1s, burst: 10 }} ] }}
default_plan: free
anonymous: {{ plan: free }}
routes: {{ api: {{}} }}
default_route: api
key_table: {{ max_keys: {max_keys} }}
"""

# One new tenant id per request: m-<offset + n>.
WRK_SCRIPT = """
counter = {offset}
request = function()
  counter = counter + 1
  return wrk.format("GET", "/api/orders", {{ ["x-tenant-id"] = "m-" .. counter }})
end
done = function(summary, latency, requests)
  io.write(string.format("requests=%d non2xx=%d\\n", summary.requests, summary.errors.status))
end
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def stat(admin: int, name: str) -> int:
    url = f"http://127.0.0.1:{admin}/stats?filter=^{name.replace('.', chr(92) + '.')}$"
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + ": "):
                return int(line.split(": ")[1])
    return 0


def send(port: int, offset: int, count: int, workdir: Path) -> None:
    """Sends `count` requests, each with a new tenant id (wrk, bounded)."""
    if count <= 0:
        return
    script = workdir / f"wrk-{offset}.lua"
    script.write_text(WRK_SCRIPT.format(offset=offset))
    # wrk stops on time, not count: pace it with a generous duration and a
    # single connection so ids are sequential, then verify with the stats.
    cmd = ["wrk", "-t1", "-c1", "-d", "600s", "-s", str(script), f"http://127.0.0.1:{port}/"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc


def wait_requests(admin: int, target: int, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        total = stat(admin, "wasmcustom.tenantgate.decisions.allowed") + stat(
            admin, "wasmcustom.tenantgate.decisions.rate_limited"
        )
        if total >= target:
            return
        time.sleep(0.2)
    raise RuntimeError(f"only {total} of {target} requests in {timeout:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-keys", type=int, default=1_000_000)
    ap.add_argument("--points", default="1,100000,1000000,2000000", help="distinct tenants at which RSS is read")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds allowed to reach each point")
    ap.add_argument("--out", default="target/bench/memory.json", help="where to write the JSON")
    ap.add_argument("--host", choices=("wasm", "module"), default="wasm", help="the wasm filter or the native module")
    args = ap.parse_args()
    points = [int(p) for p in args.points.split(",")]
    code = ["--module", str(MODULE)] if args.host == "module" else ["--wasm", str(WASM)]
    for tool in (ENVOY, CLI, MODULE if args.host == "module" else WASM):
        if not Path(tool).exists():
            print(f"missing {tool}: run `make wasm module cli setup` first", file=sys.stderr)
            return 2
    if not shutil.which("wrk"):
        print("wrk not found: apt-get install -y wrk", file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="tenantgate-memory-"))
    port, admin = free_port(), free_port()
    policy = work / "policy.yaml"
    policy.write_text(POLICY.format(max_keys=args.max_keys))
    ecds = work / "ecds.yaml"
    subprocess.run([str(CLI), "policy", "apply", str(policy), "--ecds", str(ecds)] + code, check=True,
                   stdout=subprocess.DEVNULL)
    bootstrap = (REPO / "envoy/demo.yaml").read_text()
    for old, new in (("port_value: 10000", f"port_value: {port}"), ("port_value: 10001", f"port_value: {free_port()}"),
                     ("port_value: 9901", f"port_value: {admin}"), ("path: envoy/run/ecds.yaml", f"path: {ecds}")):
        bootstrap = bootstrap.replace(old, new)
    (work / "bootstrap.yaml").write_text(bootstrap)
    envoy = subprocess.Popen([str(ENVOY), "-c", str(work / "bootstrap.yaml"), "--concurrency", "1",
                              "--disable-hot-restart", "-l", "warning"],
                             stdout=open(work / "envoy.log", "w"), stderr=subprocess.STDOUT)
    wrk = None
    rows = []
    try:
        deadline = time.time() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("Envoy did not start; see " + str(work / "envoy.log"))
            time.sleep(0.2)
        baseline = rss_kib(envoy.pid)
        sent = 0
        for point in points:
            wrk = send(port, sent, point - sent, work)
            if wrk is not None:
                wait_requests(admin, point, args.timeout)
                wrk.send_signal(signal.SIGINT)
                wrk.wait(timeout=10)
                wrk = None
            # wrk may overshoot a little; count what Envoy decided.
            sent = stat(admin, "wasmcustom.tenantgate.decisions.allowed") + stat(
                admin, "wasmcustom.tenantgate.decisions.rate_limited")
            time.sleep(1)
            rss = rss_kib(envoy.pid)
            inserts = stat(admin, "wasmcustom.tenantgate.key_table.inserts")
            rows.append({"tenants": sent, "rss_kib": rss, "keys_in_table": inserts,
                         "reclaims": stat(admin, "wasmcustom.tenantgate.key_table.reclaims"),
                         "overflows": stat(admin, "wasmcustom.tenantgate.key_table.overflows")})
            print(f"{sent:>9} tenants  RSS {rss / 1024:8.1f} MiB  keys in table {inserts:>8}", flush=True)
    finally:
        if wrk is not None:
            wrk.kill()
        envoy.terminate()
        try:
            envoy.wait(timeout=10)
        except subprocess.TimeoutExpired:
            envoy.kill()

    # The table is "full" at the first point where it holds 99 % of
    # max_keys (hashing into 8-slot entries leaves a few slots unused).
    first = rows[0]
    full = next((r for r in rows if r["keys_in_table"] >= 0.99 * args.max_keys), rows[-1])
    keys = full["keys_in_table"] - first["keys_in_table"]
    per_key = (full["rss_kib"] - first["rss_kib"]) * 1024 / keys if keys else 0.0
    after_full = [r for r in rows if r["tenants"] > full["tenants"]]
    growth_after_full = (after_full[-1]["rss_kib"] - full["rss_kib"]) if after_full else None
    result = {
        "host": args.host,
        "max_keys": args.max_keys,
        "baseline_rss_kib": baseline,
        "points": rows,
        "bytes_per_key": round(per_key, 1),
        "target_bytes_per_key": 128,
        "rss_growth_after_table_full_kib": growth_after_full,
        "envoy": subprocess.run([str(ENVOY), "--version"], capture_output=True, text=True).stdout.strip(),
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform()},
    }
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    verdict = "PASS" if per_key <= 128 else "MISS"
    print(f"\nbytes per key: {per_key:.1f} (target <= 128: {verdict})")
    if growth_after_full is not None:
        more = after_full[-1]["tenants"] - full["tenants"]
        print(f"RSS growth after the table was full ({more} more tenants): {growth_after_full / 1024:.1f} MiB "
              f"({growth_after_full * 1024 / more:.1f} B per extra tenant)")
    print(f"wrote {out.relative_to(REPO)}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
