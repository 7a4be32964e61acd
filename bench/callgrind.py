#!/usr/bin/env python3
"""Instructions per request, counted by callgrind: a measure that a busy or
noisy machine does not move, beside `make bench`'s times.

    .venv/bin/python bench/callgrind.py            # rows a f l l-headers l-off
    .venv/bin/python bench/callgrind.py a k l      # any rows bench/run.py knows

First `bench/run.py` runs each row once (BENCH_ONLY, one round of 1 s) to
write its bootstrap and ECDS files and check it answers. Then, for each row,
Envoy's own binary (not the `.venv/bin/envoy` wrapper) runs under `valgrind
--tool=callgrind --instr-atstart=no` with `--concurrency 1`; after 3 s of
`wrk` (4 connections) to warm it, instrumentation is switched on for
CALLGRIND_SECONDS (8) of `wrk`, then off, and the count is divided by the
requests Envoy served meanwhile (`http.bench.downstream_rq_total`).

Printed per row: instructions per request; the same without the native
module's tick (`on_http_filter_config_scheduled`: under valgrind a request
takes about 200 times as long, so a tick every 10 ms weighs on each request
far more than at full speed); and, for the module, its hooks' inclusive
instructions per request (its code and the Envoy callbacks it makes).
Instructions are not time (cache misses are not counted; at 10,000 tenants
they matter), so this sizes work and compares builds; `make bench` says
what a row costs.

Needs valgrind (`apt-get install -y valgrind`), wrk and a built filter,
module and CLI (`make wasm module cli`).
"""

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "target/bench/run"
OUT = REPO / "target/bench/callgrind"
SECONDS = int(os.environ.get("CALLGRIND_SECONDS", "8"))
TENANT_ROWS = {"e", "f", "l", "l-headers", "l-off"}
HOOKS = ["request_headers", "response_headers", "response_body", "stream_complete", "destroy", "new"]
TICK = "envoy_dynamic_module_on_http_filter_config_scheduled"


def envoy_binary() -> str:
    found = glob.glob(str(REPO / ".venv/lib/python3*/site-packages/envoy/_bin/envoy"))
    if not found:
        sys.exit("callgrind: Envoy's binary not found under .venv (make setup)")
    return found[0]


def admin_get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.read().decode()


def served(admin: int) -> int:
    for line in admin_get(admin, "/stats").splitlines():
        if line.startswith("http.bench.downstream_rq_total:"):
            return int(line.split(":")[1])
    return 0


def wrk(port: int, seconds: int, tenants: bool) -> None:
    args = ["wrk", "-t1", "-c4", f"-d{seconds}s"]
    if tenants:
        args += ["-s", str(REPO / "bench/wrk/tenants.lua")]
    args.append(f"http://127.0.0.1:{port}/api/bench")
    if tenants:
        args += ["--", "10000"]
    subprocess.run(args, check=True, capture_output=True)


def inclusive(profile: Path) -> dict:
    """Inclusive instructions by function name, and the total."""
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(profile)],
        check=True, capture_output=True, text=True,
    ).stdout
    costs = {}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S.*?)\s*(?:\[.*\])?$", line)
        if not m:
            continue
        n = int(m.group(1).replace(",", ""))
        name = m.group(2)
        if name == "PROGRAM TOTALS":
            costs["total"] = n
        elif ":" in name:
            costs.setdefault(name.split(":", 1)[1], n)
    return costs


def measure(row: str) -> dict:
    boot = RUN / f"{row}-c16-round1/bootstrap.yaml"
    ports = [int(p) for p in re.findall(r"port_value: (\d+)", boot.read_text())]
    admin, port = ports[0], ports[1]
    OUT.mkdir(parents=True, exist_ok=True)
    profile = OUT / f"{row}.out"
    for old in OUT.glob(f"{row}.out*"):
        old.unlink()
    envoy = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={profile}",
         envoy_binary(), "-c", str(boot), "--concurrency", "1", "--disable-hot-restart", "-l", "error"],
        stdout=subprocess.DEVNULL, stderr=open(OUT / f"{row}.log", "w"),
    )
    try:
        deadline = time.time() + 300
        while True:
            try:
                if admin_get(admin, "/ready").strip() == "LIVE":
                    break
            except OSError:
                pass
            if time.time() > deadline or envoy.poll() is not None:
                sys.exit(f"callgrind: Envoy for ({row}) did not start (see {OUT / (row + '.log')})")
            time.sleep(1)
        tenants = row in TENANT_ROWS
        wrk(port, 3, tenants)
        before = served(admin)
        subprocess.run(["callgrind_control", "-i", "on", str(envoy.pid)], check=True, capture_output=True)
        wrk(port, SECONDS, tenants)
        subprocess.run(["callgrind_control", "-i", "off", str(envoy.pid)], check=True, capture_output=True)
        requests = served(admin) - before
        subprocess.run(["callgrind_control", "-d", str(envoy.pid)], check=True, capture_output=True)
        time.sleep(1)
    finally:
        envoy.send_signal(signal.SIGTERM)
        envoy.wait(timeout=60)
    dumps = sorted(OUT.glob(f"{row}.out*"), key=lambda p: p.stat().st_size)
    costs = inclusive(dumps[-1])
    n = max(requests, 1)
    hooks = {h: costs.get(f"envoy_dynamic_module_on_http_filter_{h}", 0) / n for h in HOOKS}
    return {
        "requests": requests,
        "per_request": costs.get("total", 0) / n,
        "without_tick": (costs.get("total", 0) - costs.get(TICK, 0)) / n,
        "hooks": hooks,
    }


def main() -> int:
    rows = sys.argv[1:] or ["a", "f", "l", "l-headers", "l-off"]
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate", "wrk"):
        if shutil.which(tool) is None:
            sys.exit(f"callgrind: `{tool}` not found (apt-get install -y valgrind wrk)")
    env = {**os.environ, "BENCH_ONLY": ",".join(rows), "BENCH_ROUNDS": "1", "BENCH_SECONDS": "1",
           "BENCH_ABLATION": "0", "BENCH_PROBE": "0"}
    subprocess.run([sys.executable, str(REPO / "bench/run.py")], env=env, check=True, stdout=subprocess.DEVNULL)
    results = {row: measure(row) for row in rows}
    base = results.get("a", {}).get("without_tick")
    print(f"instructions per request (callgrind, {SECONDS} s of wrk -c4 per row, Envoy --concurrency 1)")
    for row, r in results.items():
        over = f"  {r['without_tick'] - base:+9,.0f} over (a)" if base is not None else ""
        print(f"  ({row}) {r['per_request']:>9,.0f}  without the module's tick {r['without_tick']:>9,.0f}{over}"
              f"  ({r['requests']:,} requests)")
        module = {h: v for h, v in r["hooks"].items() if v}
        if module:
            print("        module hooks: " + ", ".join(f"{h} {v:,.0f}" for h, v in module.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
