"""benchmarks/engine_tiles_gpu.py, the part that runs without a GPU: a variant's spelling, the tile
it makes from the tuned one, and the projection shapes it finds the tuned tiles by."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from worker.models.config import PRESETS, ModelConfig

SPEC = importlib.util.spec_from_file_location("engine_tiles_gpu",
                                              Path(__file__).parents[2] / "benchmarks" / "engine_tiles_gpu.py")
engine_tiles = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(engine_tiles)


def test_a_variant_changes_drops_and_schedules_over_the_tuned_tile():
    tuned = {"BLOCK_M": 8, "BLOCK_N": 64, "NC": 2, "SPLIT_K": 4, "STAGES": 4, "WS": True, "num_warps": 4}
    proj, changes = engine_tiles.parse_variant("o:NC=-,GC=80,STAGES=8")
    assert proj == "o" and changes == {"NC": None, "GC": 80, "STAGES": 8}
    tile = engine_tiles.apply_changes(tuned, changes)
    assert tile == {"BLOCK_M": 8, "BLOCK_N": 64, "SPLIT_K": 4, "STAGES": 8, "WS": True, "num_warps": 4, "GC": 80}
    assert tuned["NC"] == 2  # the tuned tile is left as it was
    assert engine_tiles.parse_variant("gate_up:LATE=0") == ("gate_up", {"LATE": False})
    assert engine_tiles.parse_variant("qkv:LATE=1") == ("qkv", {"LATE": True})
    for bad in ("lm_head:STAGES=3", "o", "o:STAGES", "o:STAGES=x", "o:=3"):
        with pytest.raises(ValueError):
            engine_tiles.parse_variant(bad)
    for spec in engine_tiles.DEFAULT_VARIANTS:  # the list it runs by default parses
        engine_tiles.parse_variant(spec)


def test_projection_shapes_of_the_benchmark_model():
    cfg = ModelConfig(**PRESETS[engine_tiles.PRESET])  # grouped KV heads: 32 query heads, 8 KV heads
    assert engine_tiles.projection_shapes(cfg) == {"qkv": (6144, 4096), "o": (4096, 4096),
                                                   "gate_up": (28672, 4096), "down": (4096, 14336)}
