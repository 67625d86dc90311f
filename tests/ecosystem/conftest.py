"""One `kvcascade serve` of the bundled SmolLM2-135M for the folder, and the tokenizer folder the
tools load offline (they count prompt tokens on the client, with Hugging Face's AutoTokenizer)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.test_serve import Serve

MODEL = "smollm2-135m"


@pytest.fixture(scope="package")
def _serve_process():
    """Started first, so that the model loads while the tokenizer is exported."""
    serve = Serve()
    yield serve
    assert serve.stop() == 0
    log = Path(serve.log.name).read_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


@pytest.fixture(scope="package")
def tokenizer_dir(_serve_process, tmp_path_factory) -> Path:
    """The served model's own tokenizer (from its GGUF) as a folder AutoTokenizer loads offline."""
    from contracts.models import resolve_model
    from contracts.tokenizers import load_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_model(MODEL)).save_pretrained(path)
    return path


@pytest.fixture(scope="package")
def served(_serve_process, tokenizer_dir) -> Serve:
    """One serve for the folder's tests (one start, not one per module); it stops cleanly at the end."""
    return _serve_process.wait_ready()


def _totals(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """A counter's ``_total`` samples in the server's /metrics, with their labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) if f.name == name
            for s in f.samples if s.name.endswith("_total")]


def request_counts(url: str) -> dict[str, float]:
    """kvcascade_requests_total by final status (one per prompt: a list of 4 prompts counts 4)."""
    return {labels["status"]: value for labels, value in _totals(url, "kvcascade_requests")}


def new_requests(url: str, before: dict[str, float]) -> dict[str, float]:
    """What request_counts gained since ``before``, by status."""
    return {k: v - before.get(k, 0) for k, v in request_counts(url).items() if v != before.get(k, 0)}


def counter(url: str, name: str) -> float:
    return sum(value for _, value in _totals(url, name))


def run_tool(argv: list[str], cwd: Path, scratch: Path, timeout: float = 300) -> str:
    """A tool's CLI as its users run it (``python -m <tool> ...``), offline, its caches under
    ``scratch``; returns its output (stdout and stderr), shown when it fails."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(scratch / "hf-datasets"), TOKENIZERS_PARALLELISM="false", NO_COLOR="1")
    done = subprocess.run([sys.executable, "-m", *argv], cwd=cwd, env=env, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout[-6000:]
    return done.stdout
