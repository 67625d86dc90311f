"""kernels/tune_cache.py: tuned configs kept on disk across starts, shared by concurrent writers,
and a bad or missing cache never worse than tuning again; the Gluon tuner reading it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import tune_cache, wq_gluon_tune
from kernels.tune_cache import TuneCache
from kernels.wq_gluon import TiledWeight

REPO = Path(__file__).resolve().parents[2]
FP = {"gpu": "NVIDIA H200", "capability": "9.0", "sms": 132, "torch": "2.11", "triton": "3.6.0", "source": "abc"}


def test_a_put_is_read_by_the_next_start_under_the_same_fingerprint_only(tmp_path: Path) -> None:
    cfg = {"BLOCK_N": 64, "num_warps": 4, "BLOCK_M": 8, "STAGES": 4, "SPLIT_K": 1, "WS": True}
    TuneCache("wq_gluon", FP, tmp_path).put("28672,4096,128,4,8,False,64", cfg, us=24.4)
    # a new process: nothing in memory, the file read
    out = subprocess.run([sys.executable, "-c", (
        "import json, sys; from pathlib import Path; from kernels.tune_cache import TuneCache; "
        f"c = TuneCache('wq_gluon', {FP!r}, Path(sys.argv[1])); "
        "print(json.dumps([c.get('28672,4096,128,4,8,False,64'), c.get('28672,4096,128,4,16,False,64')]))"),
        str(tmp_path)], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [cfg, None]
    # another GPU, another Triton: another file, a miss
    assert TuneCache("wq_gluon", {**FP, "gpu": "NVIDIA H100 80GB HBM3"}, tmp_path).get(
        "28672,4096,128,4,8,False,64") is None
    assert TuneCache("wq_gluon", {**FP, "triton": "3.7.0"}, tmp_path).get("28672,4096,128,4,8,False,64") is None
    data = json.loads(next(tmp_path.glob("wq_gluon-*.json")).read_text())
    assert data["fingerprint"] == FP and data["entries"]["28672,4096,128,4,8,False,64"]["us"] == 24.4


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    """Eight processes (the workers of a node, the ranks of a TP one) writing their own keys at
    once into one file: every key is there afterwards, and the file parses."""
    script = (
        "import sys; from pathlib import Path; from kernels.tune_cache import TuneCache; "
        f"c = TuneCache('wq_gluon', {FP!r}, Path(sys.argv[1])); w = int(sys.argv[2]); "
        "[c.put(f'{w},{i}', {'BLOCK_N': 64 * w, 'STAGES': i}) for i in range(25)]")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(w)], cwd=REPO) for w in range(8)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    cache = TuneCache("wq_gluon", FP, tmp_path)
    assert all(cache.get(f"{w},{i}") == {"BLOCK_N": 64 * w, "STAGES": i} for w in range(8) for i in range(25))
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [cache.path.name]  # no temp left


def test_a_bad_file_is_ignored_with_a_warning_and_replaced(tmp_path: Path, caplog) -> None:
    cache = TuneCache("wq_gluon", FP, tmp_path)
    cache.path.write_text('{"format": "kvcascade-tune/1", "entries": {"a": ')  # cut short
    with caplog.at_level(logging.WARNING, logger="kernels.tune_cache"):
        assert cache.get("a") is None
    assert "cannot be read" in caplog.text
    cache.put("b", {"STAGES": 3})
    assert TuneCache("wq_gluon", FP, tmp_path).get("b") == {"STAGES": 3}
    # a file of another fingerprint under this name (copied between machines): not trusted
    other = json.loads(cache.path.read_text())
    other["fingerprint"] = {**FP, "sms": 114}
    cache.path.write_text(json.dumps(other))
    with caplog.at_level(logging.WARNING, logger="kernels.tune_cache"):
        assert TuneCache("wq_gluon", FP, tmp_path).get("b") is None
    assert "not a kvcascade-tune/1 file for this fingerprint" in caplog.text


def test_an_unwritable_folder_keeps_the_config_in_memory(tmp_path: Path, caplog) -> None:
    (tmp_path / "file").write_text("")
    cache = TuneCache("wq_gluon", FP, tmp_path / "file" / "tune")  # a file where a folder should be
    with caplog.at_level(logging.WARNING, logger="kernels.tune_cache"):
        cache.put("a", {"STAGES": 3})
    assert "not written" in caplog.text
    assert cache.get("a") == {"STAGES": 3}


@pytest.mark.parametrize("value, expect", [("off", None), ("0", None), ("", "env"), ("/x/tune", "/x/tune")])
def test_the_folder_follows_the_environment(monkeypatch, tmp_path: Path, value: str, expect: str | None) -> None:
    monkeypatch.setenv("KVCASCADE_TUNE_CACHE", value)
    monkeypatch.setenv("KVCASCADE_CACHE", str(tmp_path))
    folder = tune_cache.cache_folder()
    assert folder == (None if expect is None else tmp_path / "tune" if expect == "env" else Path(expect))
    if expect is None:
        cache = TuneCache("wq_gluon", FP)
        cache.put("a", {"STAGES": 3})
        assert cache.get("a") is None and not any(tmp_path.iterdir())


def test_the_gluon_tuner_takes_a_cached_config_and_never_a_stale_one(monkeypatch, tmp_path: Path) -> None:
    """tuned_config reads the disk first: a config these tile lists make is used as it is, with no
    timing; one they no longer make is not: the tiles are timed (here by a stand-in for the CUDA
    graph timer, which needs a GPU) and the fastest written back."""
    disk = TuneCache("wq_gluon", FP, tmp_path)
    monkeypatch.setattr(wq_gluon_tune, "disk_cache", lambda device: disk)
    monkeypatch.setattr(wq_gluon_tune, "_tuned", {})
    timed = []

    def fake_graph_us(calls: list) -> float:  # the third config listed is the fastest
        timed.append(len(calls))
        return 10.0 if len(timed) == 3 else 20.0 + len(timed)

    monkeypatch.setattr(wq_gluon_tune, "graph_us", fake_graph_us)
    n, k = 256, 1024
    weight = TiledWeight(torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // 128, dtype=torch.int32), 128)
    x, out = torch.zeros(1, k, dtype=torch.bfloat16), torch.empty(1, n, dtype=torch.bfloat16)
    configs = wq_gluon_tune.gluon_configs(1, n, k, 64, wq_gluon_tune.GLUON_TILES + wq_gluon_tune.GLUON_WS_TILES)
    key = TuneCache.key((n, k, 128, 4, 1, False, 64))  # one row of x: its own bucket (the GC tiles)
    disk.put(key, configs[-1])
    assert wq_gluon_tune.tuned_config(x, weight, out, None, None, None, 64) == configs[-1]
    assert timed == []
    stale = dict(configs[-1], BLOCK_N=512)
    assert stale not in configs
    disk.put(key, stale)
    monkeypatch.setattr(wq_gluon_tune, "_tuned", {})
    assert wq_gluon_tune.tuned_config(x, weight, out, None, None, None, 64) == configs[2]
    assert len(timed) == len(configs) > 3
    entry = json.loads(disk.path.read_text())["entries"][key]
    assert entry["config"] == configs[2] and entry["us"] == 10.0 and entry["configs"] == len(configs)
    assert TuneCache("wq_gluon", FP, tmp_path).get(key) == configs[2]
