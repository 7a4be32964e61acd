#!/usr/bin/env bash
# `make run`'s prerequisites, one line each: what is there, or what is
# missing and the one command that fixes it. Installs nothing and never
# needs root (the fixes that do say so). Exit 1 if anything is missing.
#
# PYTHON: the interpreter `make run` uses (default python3).
set -uo pipefail
PYTHON=${PYTHON:-python3}
missing=0

ok() { printf '  ok       %-10s %s\n' "$1" "$2"; }
miss() { printf '  MISSING  %-10s %s\n           fix: %s\n' "$1" "$2" "$3"; missing=1; }

if command -v cargo >/dev/null 2>&1; then
  ok cargo "$(cargo --version 2>/dev/null)"
else
  miss cargo "Rust's cargo is not on PATH" \
    "curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y && . \"\$HOME/.cargo/env\""
fi
if command -v rustup >/dev/null 2>&1; then
  ok rustup "$(rustup --version 2>/dev/null | head -n1)"
else
  miss rustup "rustup is not on PATH (it adds the wasm32-wasip1 target)" \
    "curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y && . \"\$HOME/.cargo/env\""
fi
if command -v rustc >/dev/null 2>&1; then
  need=1.85
  have=$(rustc --version 2>/dev/null | awk '{print $2}')
  if [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -n1)" = "$need" ]; then
    ok rustc "rustc $have (>= $need)"
  else
    miss rustc "rustc $have is older than $need" "rustup update stable"
  fi
fi
if command -v cc >/dev/null 2>&1; then
  ok cc "$(cc --version 2>/dev/null | head -n1)"
else
  miss cc "no C compiler/linker (cc): Rust links with it, SQLite and ring compile with it" \
    "sudo apt-get install -y build-essential   (Fedora: sudo dnf install gcc; macOS: xcode-select --install)"
fi
if command -v "$PYTHON" >/dev/null 2>&1; then
  if "$PYTHON" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 9))' 2>/dev/null; then
    ok python "$("$PYTHON" --version 2>&1) with venv"
  else
    miss python "$("$PYTHON" --version 2>&1) has no venv/ensurepip module, or is older than 3.9" \
      "sudo apt-get install -y python3-venv   (or any Python >= 3.9 from python.org, then PYTHON=/path/to/python3)"
  fi
else
  miss python "$PYTHON is not on PATH" "sudo apt-get install -y python3 python3-venv   (or PYTHON=/path/to/python3)"
fi
if command -v make >/dev/null 2>&1; then
  ok make "$(make --version 2>/dev/null | head -n1)"
else
  miss make "GNU make is not on PATH" "sudo apt-get install -y make"
fi
exit "$missing"
