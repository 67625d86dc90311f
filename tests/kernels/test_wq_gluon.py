"""The Gluon W4A16 kernel's CPU-checkable parts (kernels/wq_gluon.py): the repacked layout and the
tile the kernel assembles from it, its routing in kernels/wq_matmul.py, and its sm_90 lowering
(an asynchronous wgmma chain that ptxas does not serialize, whose in-flight A registers nothing
rewrites, in the PTX or in ptxas's registers). The kernel itself needs an H100 /
H200: benchmarks/quant_gpu.py --parts decode checks it there (rel_err)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import wq_gluon, wq_gluon_tune, wq_matmul
from kernels.wquant import QuantizedWeight, quantize, unpack_int4

ROOT = Path(__file__).resolve().parents[2]


def _weight(n=32, k=256, group=128, bits=4) -> QuantizedWeight:
    w = quantize(torch.randn(n, k), bits, group)
    w.scales = w.scales.bfloat16()
    w.biases = None if w.biases is None else w.biases.bfloat16()
    return w


def test_repacked_words_hold_the_same_weight():
    w = _weight(k=512, group=256)
    words = wq_gluon.repack_int4(w.qweight)
    assert words.dtype == torch.int32 and words.shape == (32, 64)
    got = wq_gluon.dequantize_repacked(words, wq_gluon.pack_scales(w.scales, w.biases), 256)
    torch.testing.assert_close(got, w.dequantize(), rtol=0, atol=0)
    assert sorted(wq_gluon.INT4_TILE_ORDER.tolist()) == list(range(128))


def test_the_kernels_tile_is_the_weight_in_natural_column_order():
    """What _unpack_tile computes, in torch: per word, (w >> 4s) & 0x000F000F is the nibble pair
    (s, s + 4), then q s + b rounded once to bf16, then the joins, permute and reshape; the
    result is the dequantized weight's tile, columns in their own order, as x is staged."""
    w = _weight(n=16, k=128)
    words = wq_gluon.repack_int4(w.qweight).long() & 0xFFFFFFFF  # [16, 16]
    s, b = w.scales.float()[:, :1], w.biases.float()[:, :1]  # [16, 1]
    halves = []
    for shift in range(4):
        r = (words >> (4 * shift)) & 0x000F000F
        pair = torch.stack((r & 0xF, r >> 16), dim=-1).double()  # [n, u, e]
        halves.append((pair * s[:, :, None].double() + b[:, :, None].double()).to(torch.bfloat16))
    t = torch.stack((torch.stack(halves[:2], -2), torch.stack(halves[2:], -2)), -2)  # [n, u, s0, s1, e]
    t = t.reshape(16, 4, 4, 2, 2, 2).permute(0, 2, 4, 3, 1, 5).reshape(16, 128)
    torch.testing.assert_close(t, w.dequantize(torch.bfloat16), rtol=0, atol=0)


def test_int8_repacked_words_hold_the_same_weight_and_the_unpacking_is_exact():
    """int8's tiles: the words dequantize to the weight exactly, and what _UNPACK8 computes, in
    torch (a byte pair's low 7 bits into bf16 128.0's mantissa, its inverted top bit into the
    exponent's lowest bit: 128.0 or 256.0, the difference, times s, each step in bf16), joined,
    permuted and reshaped as _unpack_tile does, is the dequantized weight's tile in natural column
    order."""
    w = _weight(n=16, k=256, bits=8)
    w.qweight[0, :4] = torch.tensor([-127, 127, 0, -1], dtype=torch.int8)  # the ends of the range
    w.qweight[1, :2] = torch.tensor([-128, 1], dtype=torch.int8)
    tiles = wq_gluon.tile_weight(w)
    assert tiles.bits == 8 and tiles.words.shape == (16, 64) and tiles.shape == w.shape
    # a group's scale is its bf16 bits alone: 2 bytes a group (int4's int32 holds s and b)
    assert tiles.sb.dtype == torch.int16 and tiles.sb.shape == (16, 2)
    assert torch.equal(tiles.sb.view(torch.bfloat16), w.scales)
    assert tiles.nbytes() == 16 * 256 + 16 * 2 * 2
    torch.testing.assert_close(tiles.dequantize(), w.dequantize(), rtol=0, atol=0)
    assert sorted(wq_gluon.INT8_TILE_ORDER.tolist()) == list(range(128))
    words = tiles.words[:, :32].long() & 0xFFFFFFFF  # the first tile
    s = w.scales[:, :1].float().double()

    def bf16(bits):  # 16-bit patterns -> their bf16 values
        return (bits - ((bits & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)

    def pair(v):  # (w >> shift)'s bytes 0 and 2 -> q s as bf16, per _UNPACK8
        a = (v & 0x007F007F) | 0x43004300  # lop3 0xEA: 128 + (u & 127) in each half
        b = (~v & 0x00800080) | 0x43004300  # lop3 0xAE: 256 where u < 128, else 128
        out = []
        for half in (0, 16):
            q = bf16((a >> half) & 0xFFFF) - bf16((b >> half) & 0xFFFF)  # sub.rn.bf16x2: exact
            out.append((q.double() * s).bfloat16())  # mul.rn.bf16x2: rounded once
        return out  # (e = 0, e = 1)

    r0 = pair(words)
    r1 = pair(words >> 8)
    t = torch.stack((torch.stack(r0, -1), torch.stack(r1, -1)), -2)  # [n, u, h, e]
    t = t.reshape(16, 4, 8, 2, 2).permute(0, 2, 3, 1, 4).reshape(16, 128)
    torch.testing.assert_close(t, w.dequantize(torch.bfloat16)[:, :128], rtol=0, atol=0)


def test_pack_scales_puts_s_low_and_b_high():
    s, b = torch.tensor([[1.5, -2.0]]).bfloat16(), torch.tensor([[0.25, 3.0]]).bfloat16()
    sb = wq_gluon.pack_scales(s, b)
    assert torch.equal((sb << 16).view(torch.float32), s.float())
    assert torch.equal((sb & -65536).view(torch.float32), b.float())
    assert all(torch.equal(got, want.float()) for got, want in zip(wq_gluon.unpack_sb(sb), (s, b)))
    # int8's: s alone, negative ones too (the int16's sign must not leak into a bias)
    got_s, got_b = wq_gluon.unpack_sb(wq_gluon.pack_scales8(s))
    assert torch.equal(got_s, s.float()) and not got_b.any()


def test_routing_takes_the_kernel_only_where_it_can_run(monkeypatch):
    w = _weight(k=256)
    assert wq_matmul.decode_path(w, 16, torch.bfloat16) != "gluon"  # CPU weights: never
    monkeypatch.setattr(wq_matmul, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(wq_matmul, "interpreting", lambda: False)
    if not wq_gluon.HAS_GLUON:
        assert wq_matmul.decode_path(w, 16, torch.bfloat16) != "gluon"
        return
    lo, hi = wq_matmul.GLUON_ROWS[4]
    assert wq_matmul.decode_path(w, lo, torch.bfloat16) == "gluon"
    assert wq_matmul.decode_path(w, hi, torch.bfloat16) == "gluon"
    assert wq_matmul.decode_path(w, hi + 1, torch.bfloat16) != "gluon"
    assert wq_matmul.decode_path(w, 1, torch.bfloat16) == "gemv"
    assert wq_matmul.decode_path(w, 16, torch.float16) != "gluon"  # the unpacking is bf16's
    assert wq_matmul.decode_path(w, 16, torch.bfloat16, gluon=False) != "gluon"
    assert wq_matmul.decode_path(_weight(k=256, group=64), 16, torch.bfloat16) != "gluon"  # a tile in one group
    w8 = _weight(k=256, bits=8)  # int8: the same kernel (BITS 8) from 2 rows; 1 row stays the GEMV's
    assert wq_matmul.decode_path(w8, 16, torch.bfloat16) == "gluon"
    assert wq_matmul.decode_path(w8, 1, torch.bfloat16) == "gemv"
    hi8 = wq_matmul.GLUON_ROWS[8][1]  # int8 hands over to dequantize + cuBLAS at 512 rows too
    assert wq_matmul.decode_path(w8, hi8, torch.bfloat16) == "gluon"
    assert wq_matmul.decode_path(w8, hi8 + 1, torch.bfloat16) != "gluon"
    monkeypatch.setattr(wq_matmul, "_capability", lambda device: (10, 0))
    assert wq_matmul.decode_path(w, 16, torch.bfloat16) != "gluon"
    monkeypatch.setattr(wq_matmul, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(wq_matmul, "GLUON", False)
    assert wq_matmul.decode_path(w, 16, torch.bfloat16) != "gluon"


def test_prepare_tiles_the_weight_only_where_the_kernel_runs(monkeypatch):
    """QuantizedLinearWeight.finalize keeps what wq_matmul.prepare returns in place of the natural
    nibbles: the tiled form where the Gluon kernel runs (int4's bytes once), else nothing."""
    w = _weight(k=256)
    assert wq_matmul.prepare(w) is None  # CPU weights: natural
    if not wq_gluon.HAS_GLUON:
        return
    monkeypatch.setattr(wq_matmul, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(wq_matmul, "interpreting", lambda: False)
    monkeypatch.setattr(wq_matmul, "GLUON", False)  # KVCASCADE_GLUON=0: natural
    assert wq_matmul.prepare(w) is None
    monkeypatch.setattr(wq_matmul, "GLUON", True)
    tiles = wq_matmul.prepare(w)
    assert isinstance(tiles, wq_gluon.TiledWeight) and tiles.shape == w.shape and tiles.group_size == 128
    assert tiles.nbytes() == w.qweight.numel() + 2 * w.scales.numel() * 2  # the same bytes, s and b in one int32
    torch.testing.assert_close(tiles.dequantize(), w.dequantize(), rtol=0, atol=0)
    assert wq_matmul.prepare(_weight(k=256, group=64)) is None  # a tile in one group
    tiles8 = wq_matmul.prepare(_weight(k=256, bits=8))
    assert isinstance(tiles8, wq_gluon.TiledWeight) and tiles8.bits == 8
    assert tiles8.nbytes() == 32 * 256 + 32 * 2 * 2  # s alone, bf16: the natural form's bytes
    assert wq_matmul.prepare(_weight(k=128)) is None  # one tile: the loop takes two an iteration
    # a tiled weight's paths: the kernel from 1 row, dequantize + cuBLAS above its rows or for another dtype
    _, hi = wq_matmul.GLUON_ROWS[4]
    for rows in (1, 2, 16, hi):
        assert wq_matmul.decode_path(tiles, rows, torch.bfloat16) == "gluon"
    assert wq_matmul.decode_path(tiles, hi + 1, torch.bfloat16) == "dense"
    assert wq_matmul.decode_path(tiles, 1, torch.float32) == "dense"


@pytest.mark.parametrize("bits,group,k,n", [(4, 128, 256, 32), (4, 256, 512, 40), (4, 512, 512, 7), (8, 128, 256, 32),
                                            (8, 256, 512, 7)])
def test_tiles_dequantize_kernel_matches_the_reference(bits, group, k, n):
    """The dense path's one pass over a tiled weight (above 512 rows): its tiles' permutation and
    (s, b) unpacked, row edges masked; against QuantizedWeight.dequantize of the natural weight."""
    w = _weight(n=n, k=k, group=group, bits=bits)
    tiles = wq_gluon.tile_weight(w)
    torch.testing.assert_close(wq_matmul.dequantize(tiles, torch.float32), w.dequantize(), rtol=0, atol=0)
    # bf16: the float32 value in one bf16 step (the interpreter truncates where a GPU rounds)
    torch.testing.assert_close(wq_matmul.dequantize(tiles, torch.bfloat16).float(), w.dequantize(),
                               rtol=2 ** -7, atol=0)
    x = torch.randn(3, k)
    torch.testing.assert_close(wq_matmul.wq_matmul(x, tiles, path="dense"), x @ w.dequantize().T, atol=1e-4, rtol=1e-5)
    with pytest.raises(AssertionError, match="tiled weight has no swapped path"):
        wq_matmul.wq_matmul(x, tiles, path="swapped")
    ids = torch.tensor([n - 1, 0, 2])  # a tied LM head's embedding rows
    torch.testing.assert_close(tiles.rows(ids, torch.float32), w.dequantize()[ids], rtol=0, atol=0)


def test_embedding_rows_from_tiles_copy_no_tile_order_after_the_first_lookup():
    """A tied LM head in tiles serves the embedding (TiledWeight.rows) inside CUDA-graph capture,
    where a host-to-device copy fails: the tile order goes to a device once (the warm-up's lookup)
    and is reused after. (On an H200 a tied int4 model's decode graphs failed to capture so,
    benchmarks/gpu_check.py's norm handoff check, 2026-11-29.)"""
    w = _weight(n=48, k=256, bits=8)
    tiles = wq_gluon.tile_weight(w)
    ids = torch.tensor([5, 0, 47, 5])
    torch.testing.assert_close(tiles.rows(ids, torch.float32), w.dequantize()[ids])
    first = wq_gluon._on_device(wq_gluon.INT8_TILE_ORDER, torch.device("cpu"))
    assert wq_gluon._on_device(wq_gluon.INT8_TILE_ORDER, torch.device("cpu")) is first


def test_a_finalized_projection_keeps_only_the_tiles(monkeypatch):
    """The model's int4 projection after finalize on sm_90 (faked here; the kernels run on CPU under
    the interpreter): the natural buffers are gone, nbytes counts the tiles once, and its matmul
    above 512 rows (the dense path) equals the natural weight's."""
    if not wq_gluon.HAS_GLUON:
        pytest.skip("no Gluon in this Triton")
    from worker.models.quantization import QuantizedLinearWeight, QuantSpec

    proj = QuantizedLinearWeight(32, 256, QuantSpec(4, 128), dtype=torch.bfloat16)
    w = _weight(n=32, k=256)
    proj.data.copy_(w)
    natural = proj.nbytes()
    monkeypatch.setattr(wq_matmul, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(wq_matmul, "interpreting", lambda: False)
    tiles = wq_matmul.prepare(proj.data)
    monkeypatch.setattr(wq_matmul, "interpreting", lambda: True)
    proj.keep_tiles(tiles)  # what finalize does with it on a CUDA device
    assert proj.data is tiles and proj.nbytes() == natural
    assert proj.qweight.numel() == proj.scales.numel() == proj.biases.numel() == 0
    x = torch.randn(600, 256)
    torch.testing.assert_close(wq_matmul.wq_matmul(x, proj.data), x @ w.dequantize().T, atol=1e-4, rtol=1e-5)


def test_small_kernels_that_feed_a_tiled_projection_are_told_so(monkeypatch):
    """mark_next_quantized (after finalize): the norms, the attention and the SiLU learn whether
    the projection they feed is in the tiled form (sm_90; faked here as above), and so let it start
    two kernels ahead (kernels/_triton.py's early_next). Tiled here: qkv, down and the LM head;
    o_proj and gate_up stay natural (a bf16 or natural weight: its kernel waits before reading)."""
    from worker.models.config import ModelConfig
    from worker.models.llama import LlamaForCausalLM
    from worker.models.quantization import QuantizedLinearWeight, QuantPlan, QuantSpec

    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                      num_kv_heads=2)
    if not wq_gluon.HAS_GLUON:
        pytest.skip("no Gluon in this Triton")
    model = LlamaForCausalLM(cfg, QuantPlan(QuantSpec(4, 128))).to(torch.bfloat16)  # bf16 scales, as the kernel needs
    model.mark_next_quantized()
    flags = lambda layer: (layer.input_layernorm.next_quantized, layer.self_attn.next_quantized,  # noqa: E731
                           layer.post_attention_layernorm.next_quantized, layer.mlp.act.next_quantized)
    assert [flags(layer) for layer in model.model.layers] == [(False,) * 4] * 2 and not model.model.norm.next_quantized
    monkeypatch.setattr(wq_matmul, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(wq_matmul, "interpreting", lambda: False)
    for layer in model.model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
            proj.weight.keep_tiles(wq_matmul.prepare(proj.weight.data))
    model.lm_head.weight.keep_tiles(wq_matmul.prepare(model.lm_head.weight.data))
    assert isinstance(model.lm_head.weight, QuantizedLinearWeight)
    model.mark_next_quantized()
    assert [flags(layer) for layer in model.model.layers] == [(True, False, False, True)] * 2
    assert model.model.norm.next_quantized


def test_the_mlp_takes_the_silu_from_the_gate_up_kernel_where_it_can(monkeypatch):
    """mark_next_quantized sets LlamaMLP.fused_act where gate|up is tiled (faked as above); the MLP
    then takes silu(gate) * up from wq_matmul_silu (the Gluon kernel's epilogue, GPU only: here a
    stand-in computing it in torch) and runs the SiLU kernel itself where that returns None."""
    from kernels.reference import silu_and_mul_ref
    from worker.models.config import ModelConfig
    from worker.models.llama import LlamaForCausalLM
    from worker.models.quantization import QuantPlan, QuantSpec

    if not wq_gluon.HAS_GLUON:
        pytest.skip("no Gluon in this Triton")
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4,
                      num_kv_heads=2)
    model = LlamaForCausalLM(cfg, QuantPlan(QuantSpec(8, 128))).to(torch.bfloat16)
    mlp = model.model.layers[0].mlp
    for proj in (mlp.gate_up_proj, mlp.down_proj):
        proj.weight.data.copy_(_weight(*proj.weight.shape, bits=8))
    model.mark_next_quantized()
    assert not mlp.fused_act  # natural weights: the matmul, then the SiLU kernel
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    expected = mlp(x)
    monkeypatch.setattr(wq_matmul, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(wq_matmul, "interpreting", lambda: False)
    mlp.gate_up_proj.weight.keep_tiles(wq_matmul.prepare(mlp.gate_up_proj.weight.data))
    monkeypatch.setattr(wq_matmul, "interpreting", lambda: True)
    model.mark_next_quantized()
    assert mlp.fused_act
    calls = []

    def fused(x2, weight, rms=None, early_next=False):
        assert early_next  # down_proj scheduled early at one row (kernels/wq_gluon.py's late_launch)
        calls.append(x2.shape)
        return silu_and_mul_ref(x2 @ weight.dequantize(x2.dtype).T) if len(calls) == 1 else None

    monkeypatch.setattr(wq_matmul, "wq_matmul_silu", fused)
    torch.testing.assert_close(mlp(x.view(1, 3, 256)), expected.view(1, 3, 256), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(mlp(x), expected, atol=2e-2, rtol=2e-2)  # None: the two kernels
    assert calls == [(3, 256)] * 2


def test_the_silu_epilogue_is_asked_for_only_where_the_kernel_runs(monkeypatch):
    """wq_matmul_silu returns None (the caller runs the matmul and the SiLU kernel) for a natural
    weight, a CPU tensor, and with KVCASCADE_GLUON_SILU=0 (and past SILU_MAX_ROWS rows: the GPU check)."""
    w = _weight(n=64, k=256, bits=8)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    assert wq_matmul.wq_matmul_silu(x, w) is None
    if not wq_gluon.HAS_GLUON:
        return
    monkeypatch.setattr(wq_matmul, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(wq_matmul, "interpreting", lambda: False)
    tiles = wq_matmul.prepare(w)
    assert tiles is not None and wq_matmul.wq_matmul_silu(x, tiles) is None  # x on the CPU
    monkeypatch.setattr(wq_matmul, "GLUON_SILU", False)
    assert wq_matmul.wq_matmul_silu(x, tiles) is None


# The epilogue's SiLU against the two launches it replaces, on an sm_90 GPU (run without the interpreter)
GPU_SILU_CHECK = r'''
import torch
from kernels import silu_and_mul
from kernels.reference import silu_and_mul_ref
from kernels import wq_matmul
from kernels.wquant import quantize

torch.manual_seed(0)
for bits, cfg, k in (
        (8, dict(BLOCK_N=64, num_warps=4, BLOCK_M=8, STAGES=4, SPLIT_K=1, WS=True), 512),
        (8, dict(BLOCK_N=64, num_warps=4, BLOCK_M=8, STAGES=4, SPLIT_K=2, WS=True, NC=2), 1024),
        (4, dict(BLOCK_N=128, num_warps=4, BLOCK_M=16, STAGES=4, SPLIT_K=2, WS=False), 512),
        (4, dict(BLOCK_N=64, num_warps=4, BLOCK_M=64, STAGES=4, SPLIT_K=1, WS=False), 512),
        (8, dict(BLOCK_N=128, num_warps=8, BLOCK_M=16, STAGES=4, SPLIT_K=1, WS=False), 512),
        # the group-column consumer (one row of x): a partial block of 4 tiles, unsplit and split
        (8, dict(BLOCK_N=64, num_warps=4, BLOCK_M=8, STAGES=4, SPLIT_K=1, WS=True, GC=64), 512),
        (4, dict(BLOCK_N=64, num_warps=4, BLOCK_M=8, STAGES=4, SPLIT_K=2, WS=True, GC=80), 1024)):
    w = quantize(torch.randn(1024, k), bits, 128)  # gate|up of I = 512
    w.scales = w.scales.bfloat16().cuda()
    w.biases = None if w.biases is None else w.biases.bfloat16().cuda()
    w.qweight = w.qweight.cuda()
    tiles = wq_matmul.prepare(w)
    for rows in (1, ) if cfg.get("GC") else (1, 5, 16):
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        two = silu_and_mul(wq_matmul.wq_matmul(x, tiles, config=cfg, path="gluon"))
        for _ in range(2):  # twice: the pair counters are back at zero after a call
            act = wq_matmul.wq_matmul_silu(x, tiles, config=cfg)
            torch.cuda.synchronize()
            # the same sums rounded the same way (a split's atomics may add in another order: 1 ulp)
            torch.testing.assert_close(act, two, atol=0, rtol=1e-2 if cfg["SPLIT_K"] > 1 else 0)
        # and the torch reference (bf16 roundings apart: silu's slope amplifies a rounded gate's error)
        ref = silu_and_mul_ref((x.float() @ w.dequantize().float().T).bfloat16()).float()
        assert (act.float() - ref).norm() <= 1e-2 * ref.norm(), (bits, cfg, rows)
        print("ok", bits, cfg, rows)
    if not cfg.get("GC"):  # (GC takes one row only)
        x = torch.randn(wq_matmul.SILU_MAX_ROWS + 1, k, dtype=torch.bfloat16, device="cuda")
        assert wq_matmul.wq_matmul_silu(x, tiles, config=cfg) is None  # past SILU_MAX_ROWS: the two kernels
print("silu epilogue: all ok")

'''


def run_on_sm90(script: str) -> None:
    """Runs a GPU check script compiled (not under the interpreter); skips without an sm_90 GPU."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and wq_gluon.HAS_GLUON):
        pytest.skip("needs an sm_90 GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_silu_epilogue_matches_the_two_kernels_on_a_gpu():
    run_on_sm90(GPU_SILU_CHECK)


# An add-RMS norm handed from one projection to the next (wq_matmul_norm, then wq_matmul or
# wq_matmul_silu with rms) against the projection, the norm kernel and the next projection, on an
# sm_90 GPU (run without the interpreter)
GPU_NORM_CHECK = r"""
import torch
from kernels import rms_norm, silu_and_mul
from kernels import wq_matmul
from kernels.wquant import quantize

torch.manual_seed(0)
H, I = 1024, 1024  # hidden, and gate|up's halves


def packed(n, k, bits):
    w = quantize(torch.randn(n, k), bits, 128)
    w.scales = w.scales.bfloat16().cuda()
    w.biases = None if w.biases is None else w.biases.bfloat16().cuda()
    w.qweight = w.qweight.cuda()
    return w, wq_matmul.prepare(w)


producers = (dict(BLOCK_N=64, num_warps=4, BLOCK_M=8, STAGES=4, SPLIT_K=4, WS=True, NC=2),  # o_proj's
             dict(BLOCK_N=64, num_warps=4, BLOCK_M=8, STAGES=4, SPLIT_K=4, WS=True, GC=64),  # down's
             dict(BLOCK_N=64, num_warps=4, BLOCK_M=8, STAGES=4, SPLIT_K=1, WS=True),
             dict(BLOCK_N=128, num_warps=4, BLOCK_M=16, STAGES=4, SPLIT_K=2, WS=False))
consumers = (dict(BLOCK_N=64, num_warps=4, BLOCK_M=8, STAGES=4, SPLIT_K=2, WS=True, GC=80),  # qkv's
             dict(BLOCK_N=64, num_warps=4, BLOCK_M=8, STAGES=4, SPLIT_K=1, WS=True, GC=64),  # gate_up's
             dict(BLOCK_N=64, num_warps=4, BLOCK_M=8, STAGES=4, SPLIT_K=2, WS=True, NC=2),
             dict(BLOCK_N=64, num_warps=4, BLOCK_M=16, STAGES=4, SPLIT_K=1, WS=False))
for bits in (4, 8):
    w_o, t_o = packed(H, 2048, bits)
    w_n, t_n = packed(2 * I, H, bits)
    bias = torch.randn(2 * I, dtype=torch.bfloat16, device="cuda")
    nw = (torch.rand(H, device="cuda") + 0.5).bfloat16()
    for pc in producers:
        for rep in range(2):  # twice: the split counters are back at zero after a call
            x = torch.randn(1, 2048, dtype=torch.bfloat16, device="cuda")
            residual = torch.randn(1, H, dtype=torch.bfloat16, device="cuda") * 4
            expected_x, expected_h = rms_norm(wq_matmul.wq_matmul(x, t_o, config=pc, path="gluon"), nw, 1e-5,
                                              residual)
            xn, h, rms = wq_matmul.wq_matmul_norm(x, t_o, residual.clone(), nw, 1e-5, config=pc)
            torch.cuda.synchronize()
            # the same sum, rounded as the norm kernel rounds it (a split's atomics may add in
            # another order: 1 ulp of the projection's output)
            torch.testing.assert_close(h, expected_h, atol=0, rtol=0 if pc["SPLIT_K"] == 1 else 1e-2)
            torch.testing.assert_close(xn, (nw.float() * h.float()).bfloat16(), atol=0, rtol=0)
            tiles = -(-H // pc["BLOCK_N"])
            sums = h.float().pow(2).view(tiles, -1).sum(1)
            torch.testing.assert_close(rms.parts, sums, rtol=1e-5, atol=1e-3)
            for cc in consumers:
                got = wq_matmul.wq_matmul(xn, t_n, bias, config=cc, path="gluon", rms=rms)
                ref = wq_matmul.wq_matmul(expected_x, t_n, bias, config=cc, path="gluon")
                assert (got.float() - ref.float()).norm() <= 1e-2 * ref.float().norm(), (bits, pc, cc)
                act = wq_matmul.wq_matmul_silu(xn, t_n, config=cc, rms=rms)
                ref_act = silu_and_mul(wq_matmul.wq_matmul(expected_x, t_n, config=cc, path="gluon"))
                assert (act.float() - ref_act.float()).norm() <= 2e-2 * ref_act.float().norm(), (bits, pc, cc)
        print("ok", bits, pc)
x2 = torch.randn(2, 2048, dtype=torch.bfloat16, device="cuda")
assert wq_matmul.wq_matmul_norm(x2, t_o, torch.randn(2, H, dtype=torch.bfloat16, device="cuda"), nw, 1e-5) is None
print("norm handoff: all ok")
"""


def test_the_norm_handoff_matches_the_norm_kernel_on_a_gpu():
    run_on_sm90(GPU_NORM_CHECK)


def test_configs_split_only_evenly_and_within_the_workspace():
    assert [wq_gluon_tune.rows_block(m) for m in (1, 8, 9, 16, 17, 300)] == [8, 8, 16, 16, 32, 256]
    # two consumers: each takes every other tile, two an iteration, so a split's tiles are a multiple
    # of 4 (down's 112 tiles: splits 1, 2 and 4, not 8), and their sums go through the split workspace
    two = wq_gluon_tune.gluon_configs(1, 4096, 14336, 64, [(64, 4, 8, 4, True, 2)])
    assert sorted(c["SPLIT_K"] for c in two) == [1, 2, 4] and all(c["NC"] == 2 and c["WS"] for c in two)
    assert not wq_gluon_tune.gluon_configs(128, 4096, 14336, 64, [(64, 4, 128, 4, True, 2)])  # past the workspace
    for m in (1, 3, 16, 64, 128, 256):
        every = wq_gluon_tune.GLUON_TILES + wq_gluon_tune.GLUON_WS_TILES
        configs = wq_gluon_tune.gluon_configs(m, 4096, 14336, 64, every)
        for cfg in configs:
            bucket = wq_gluon_tune.rows_block(m)
            assert cfg["BLOCK_M"] in ((8, ) if bucket == 8 else (bucket, max(16, bucket // 2)))
            if cfg["SPLIT_K"] > 1:
                assert m <= 64 and (14336 // 128) % cfg["SPLIT_K"] == 0
        # two consumers on a 128-row tile of W: from 33 rows, never split (each stores its own rows)
        split_w = [c for c in configs if c.get("NS")]
        assert bool(split_w) == (m > 32), m
        assert all(c["NS"] == 2 and c["BLOCK_N"] == 128 and c["SPLIT_K"] == 1 and c["WS"] for c in split_w)
        # the group-column consumer: one row of x only (its own tune bucket), any split (a split's
        # last block of 8 tiles may be partial: down's 28 tiles at 4), the field its register cap
        gc = [c for c in configs if c.get("GC")]
        assert bool(gc) == (m == 1), m
        assert sorted({c["SPLIT_K"] for c in gc}) == ([1, 2, 4, 8] if m == 1 else [])
        assert all(c["WS"] and c["BLOCK_M"] == 8 and c["GC"] in (64, 80) and "NC" not in c and "NS" not in c
                   for c in gc)


CHECK = r'''
import re, subprocess, os, tempfile


def writes_in_flight(events):
    """The writes among ``events`` (the loop's, run twice) to an A register of a wgmma group still
    in flight: ("mma", registers, commits) adds an instruction's A registers to the pending group
    (``commits``: and commits it), ("commit",) commits it, ("wait", n) retires all but the newest n
    groups, ("write", register, text) writes a register."""
    flying, pending, bad = [], set(), []
    for event in events * 2:
        if event[0] == "mma":
            pending |= event[1]
            if event[2]:
                flying, pending = flying + [pending], set()
        elif event[0] == "commit":
            flying, pending = flying + [pending], set()
        elif event[0] == "wait":
            flying = flying[len(flying) - event[1]:] if event[1] else []
        elif any(event[1] in g for g in flying):
            bad.append(event[2])
    return bad


def inflight_writes(ptx):
    """Writes to the A registers of a wgmma still in flight, over the main loop run twice (its
    back edge): a wgmma reads them until the wait that retires it (the PTX ISA: undefined
    otherwise), and ptxas does not catch a rewrite across the loop's back edge."""
    # the label, then its comments (a nested loop's name its parent on a line of their own)
    head = re.search(r"^(\$L__BB\d+_\d+):[^\n]*(?:\n\s*//[^\n]*)*?Inner Loop Header[^\n]*", ptx, re.M)
    body = ptx[head.end():]
    body = body[:re.search(r"bra(\.uni)?\s+" + re.escape(head.group(1)) + ";", body).start()]
    events = []
    for line in (l.strip() for l in body.splitlines()):
        if not line or line.startswith("//"):
            continue
        if line.startswith("wgmma.mma_async"):
            events.append(("mma", set(re.findall(r"%r\d+", re.findall(r"\{([^}]*)\}", line)[1])), False))
        elif line.startswith("wgmma.commit_group"):
            events.append(("commit",))
        elif line.startswith("wgmma.wait_group"):
            events.append(("wait", int(re.search(r"aligned (\d+)", line).group(1))))
        elif m := re.match(r"^(?:@%p\d+ )?[a-z][\w.:]*\s+(%r\d+)\b", line):
            events.append(("write", m.group(1), line))
    return writes_in_flight(events)


import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from kernels import wq_gluon, wq_gluon_tune

def main_loop(sass):
    """The SASS main loop's instructions: the innermost loop with the most HGMMAs."""
    lines = [l for l in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
    addr = lambda l: int(re.match(r"\s+/\*([0-9a-f]{4})\*/", l).group(1), 16)
    target = lambda l: int(re.search(r"BRA (0x[0-9a-f]+)", l).group(1), 16)
    span = lambda b: [l for l in lines if target(b) <= addr(l) <= addr(b)]
    backs = [l for l in lines if re.search(r"BRA 0x", l) and target(l) < addr(l)]
    back = max(backs, key=lambda b: (sum("HGMMA" in l for l in span(b)), -len(span(b))))
    return [re.sub(r"^\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", l).split(";")[0] for l in span(back)]


def sass_inflight_writes(sass):
    """The same in the SASS, where ptxas allocates the registers: an HGMMA group's A quads stay
    read until the WARPGROUP.DEPBAR that retires the group."""
    events = []
    for op in main_loop(sass):
        if op.startswith("HGMMA"):
            a = re.match(r"HGMMA\S*\s+R\d+,\s+R(\d+),", op)
            events.append(("mma", {f"R{int(a.group(1)) + j}" for j in range(4)} if a else set(), "gsb0" in op))
        elif op.startswith("WARPGROUP.DEPBAR"):
            events.append(("wait", int(re.search(r"0x([0-9a-f]+)", op).group(1), 16)))
        elif m := re.match(r"^[A-Z][\w.]*\s+(R\d+)\b", op):
            events.append(("write", m.group(1), op))
    return writes_in_flight(events)


bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
tmp = tempfile.mkdtemp()
ptx_path, cubin_path = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
from kernels import wq_gluon_ws

for bits, bn, warps, bm, stages, split, ws, *act in (
        (4, 64, 4, 16, 4, 2, False), (4, 64, 4, 128, 3, 1, False), (4, 128, 8, 64, 4, 1, False),
        (4, 128, 4, 16, 4, 2, False), (4, 64, 4, 16, 4, 2, True), (4, 64, 4, 64, 4, 1, True),
        (8, 64, 4, 16, 4, 2, False), (8, 128, 4, 16, 4, 1, False), (8, 64, 4, 16, 4, 2, True),
        (4, 64, 4, 8, 4, 2, True), (4, 64, 4, 8, 4, 2, False), (8, 64, 4, 8, 3, 2, True), (4, 64, 4, 8, 4, 1, 2),
        (8, 64, 4, 8, 4, 2, 2),
        # the SiLU in the epilogue (_silu_pair): unsplit, split, and the two-consumer kernel's
        (8, 64, 4, 8, 4, 1, True, True), (4, 128, 4, 16, 4, 2, False, True), (8, 64, 4, 8, 4, 2, 2, True),
        # two consumers on the halves of a 128-row tile of W (NS 2; ws "ns")
        (8, 128, 4, 128, 3, 1, "ns"), (8, 128, 4, 256, 2, 1, "ns"), (4, 128, 4, 64, 4, 1, "ns"),
        # one row of x, the group-column consumer (GC, at 64 or 80 registers): unsplit, split, the SiLU's
        (4, 64, 4, 8, 4, 1, "gc"), (8, 64, 4, 8, 4, 1, "gc"), (4, 64, 4, 8, 4, 2, "gc80"),
        (8, 64, 4, 8, 4, 4, "gc80"), (8, 64, 4, 8, 4, 1, "gc", True),
        # ... with x through the producer's TMA, not put in place by the consumer (GCX off: the A/B)
        (4, 64, 4, 8, 4, 2, "gc-tma"), (8, 64, 4, 8, 4, 1, "gc-tma"),
        # an add-RMS norm handed from one projection to the next (one row of x; wq_matmul_norm): its
        # elementwise part in o_proj's (two consumers, split) and down's epilogue (GC, split 8), its
        # 1 / rms in qkv's and gate_up's (GC, the SiLU's too), and in the other kernels'
        (8, 64, 4, 8, 4, 2, 2, False, "out"), (4, 64, 4, 8, 4, 8, "gc", False, "out"),
        (4, 64, 4, 8, 4, 4, "gc80", False, "in"), (4, 64, 4, 8, 4, 1, "gc", True, "in"),
        (8, 64, 4, 8, 4, 1, True, False, "out"), (4, 64, 4, 8, 4, 2, True, False, "in"),
        (4, 64, 4, 8, 4, 2, False, False, "in"), (8, 64, 4, 8, 4, 1, False, False, "out")):
    act, norm = bool(act and act[0]), (act[1] if len(act) > 1 else "")
    wpt = 128 * bits // 32
    xl = gl.NVMMASharedLayout.get_default_for([bm, 128], gl.bfloat16)
    wl = gl.NVMMASharedLayout.get_default_for([bn, wpt], gl.int32)
    sig = {"x_desc": f"tensordesc<bf16[{bm}, 128],{xl!r}>", "w_desc": f"tensordesc<i32[{bn}, {wpt}],{wl!r}>",
           "sb_ptr": "*i16" if bits == 8 else "*i32", "bias_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32", "act_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_sb": "i32",
           "stride_om": "i32", "res_ptr": "*bf16", "nw_ptr": "*bf16", "ss_ptr": "*fp32", "n_parts": "i32",
           "eps": "fp32"}
    ns, gc = 2 if ws == "ns" else 1, {"gc": 64, "gc80": 80, "gc-tma": 64}.get(ws, 0)
    gcx = gc > 0 and ws != "gc-tma"  # as launched (kernels/wq_gluon_tune.py's GLUON_GC_X)
    nc, ws = (ws, True) if ws == 2 else (1, bool(ws))  # ws 2: the warp-specialized kernel with two consumers
    cst = dict(GROUP=128, HAS_BIAS=False, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, SPLIT_K=split, num_warps=warps,
               INFLIGHT=1, USE_PDL=True, BITS=bits, LATE_LAUNCH=bits == 8, ACT=act, NORM_OUT=norm == "out",
               NORM_IN=norm == "in", **({"NC": nc} if nc > 1 else {}),
               **({"NS": ns, "GC": int(gc > 0), "GCX": gcx} if ws else {}))  # (a raw compile takes no defaults)
    if ws:
        sig["x_ptr"] = "*bf16"
    sig.update({k: "constexpr" for k in cst})
    fn = wq_gluon_ws._wq_gluon_ws_kernel if ws else wq_gluon._wq_gluon_kernel
    maxnreg = wq_gluon_tune.WS_NS_MAXNREG if ns > 1 else gc or wq_gluon.WS_MAXNREG.get(bm)
    options = {"num_warps": warps, **({"maxnreg": maxnreg} if ws else {})}
    kernel = triton.compile(GluonASTSource(fn, sig, cst), target=GPUTarget("cuda", 90, 32), options=options)
    label = (f"int{bits}, {warps} warps, {bm} rows, {stages} stages, split {split}, warp-specialized {ws}, "
             f"consumers {nc} (K) {ns} (N), group columns {gc}{' (x by TMA)' if gc and not gcx else ''}, SiLU {act}, "
             f"norm {norm or '-'}")
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    # two consumers retire each tile in its own step (the other's overlaps it)
    pending = 1 if nc == ns == 1 else 0
    assert "isAsync = true" in ttgir and f"pendings = {pending}" in ttgir, label + ": no asynchronous wgmma"
    assert ws == ("setmaxnreg" in kernel.asm["ptx"]), label
    assert f"wgmma.wait_group.sync.aligned {pending};" in ptx, label
    # the weights' first stages are asked for before the wait for the kernel before (PDL); the
    # warp-specialized kernel's consumer (its wait before the stores) comes first in the PTX
    assert ws or ptx.index("cp.async.bulk.tensor") < ptx.index("griddepcontrol.wait"), label
    # a late launch: the next kernel scheduled only after the main loop's last wgmma wait (the
    # warp-specialized kernel: by its consumer's wait at the end only, not also its producer's)
    launch, drained = ptx.index("griddepcontrol.launch_dependents"), ptx.index("wgmma.wait_group.sync.aligned 0")
    if ws:
        assert ptx.count("griddepcontrol.launch_dependents") == (1 if bits == 8 else 2) + nc * ns - 1, label
    else:
        assert (launch > drained) == (bits == 8), label
    assert not inflight_writes(ptx), label + ": " + str(inflight_writes(ptx)[:3])
    assert ("ex2.approx" in ptx) == act, label  # the SiLU's exp only where asked for
    # the group-column consumer puts x in place itself (GCX): the producer's TMAs are the weight's only
    # (the first stages, then one a tile), and it never waits for the kernel before
    tmas = ptx.count("cp.async.bulk.tensor")
    assert not gcx or (tmas == stages + 1 and ptx.count("griddepcontrol.wait") == 2), label + f": {tmas} TMAs"
    assert gcx or not gc or tmas == 3 * stages + 3, label + f": {tmas} TMAs"
    with open(ptx_path, "w") as f:
        f.write(ptx)
    log = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx_path, "-o", cubin_path],
                         capture_output=True, text=True).stderr
    assert "serialized" not in log, label + ": " + log
    spill = re.search(r"(\d+) bytes spill stores", log)
    sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin_path], capture_output=True,
                          text=True).stdout
    # no spills; the group-column consumer at 64 registers: none in its main loop (a few bytes around
    # the blocks' scaling and x's stores, once a block of 8 tiles: 56-74 with GCX, 0-32 without)
    assert spill and (spill.group(1) == "0" or gc == 64 and int(spill.group(1)) <= (80 if gcx else 32)
                      or norm == "out" and nc == 2 and int(spill.group(1)) <= 4), label + ": " + log
    # in the main loop none, but one register's store and load in int8's two-consumer kernel with
    # the norm in its epilogue (at 64 registers: 2 of ~690 instructions an iteration)
    spills = [op for op in main_loop(sass) if op.startswith(("LDL", "STL"))]
    assert len(spills) <= (2 if norm == "out" and nc == 2 and bits == 8 else 0), label + ": " + str(spills)
    assert "HGMMA" in sass and not sass_inflight_writes(sass), label + ": " + str(sass_inflight_writes(sass)[:3])
    print("ok", label)
'''


def test_gluon_kernel_lowers_to_an_asynchronous_wgmma_chain():
    pytest.importorskip("triton.experimental.gluon", reason="no Gluon in this Triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_next_kernel_is_scheduled_early_only_where_one_row_asks(monkeypatch):
    """late_launch: late up to PDL_LATE_ROWS rows of x, except where the caller asks for the next
    kernel early at one row (o_proj's and gate_up's calls); EARLY_NEXT off or PDL_LATE set (the A/Bs)
    override that."""
    late = wq_gluon.late_launch
    assert late(1) and late(16) and not late(17)
    assert not late(1, early_next=True)
    assert late(2, early_next=True) and late(16, early_next=True)  # measured at one row only
    assert not late(64, early_next=True)
    monkeypatch.setattr(wq_gluon, "EARLY_NEXT", False)
    assert late(1, early_next=True)
    monkeypatch.setattr(wq_gluon, "EARLY_NEXT", True)
    monkeypatch.setattr(wq_gluon, "PDL_LATE", True)
    assert late(1, early_next=True) and late(64)
    monkeypatch.setattr(wq_gluon, "PDL_LATE", False)
    assert not late(1) and not late(16)
