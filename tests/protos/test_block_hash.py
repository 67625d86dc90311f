import subprocess
import sys

from protos.block_hash import ROOT_HASH, block_hashes, hash_block


def test_hashes_are_stable_across_processes():
    code = "from protos.block_hash import block_hashes; print(block_hashes(list(range(40)), 16, 'm'))"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert len(runs) == 1
    assert runs.pop().strip() == str(block_hashes(list(range(40)), 16, "m"))


def test_only_full_blocks_are_hashed_and_chained():
    hs = block_hashes(list(range(40)), 16, "m")
    assert len(hs) == 2
    assert hs[0] == hash_block(ROOT_HASH, list(range(16)), "m")
    assert hs[1] == hash_block(hs[0], list(range(16, 32)), "m")
    assert all(0 <= h < 2**64 for h in hs)


def test_hash_depends_on_prefix_tokens_and_model():
    a = block_hashes([1] * 16 + [2] * 16, 16, "m")
    b = block_hashes([3] * 16 + [2] * 16, 16, "m")
    assert a[1] != b[1], "same block after a different prefix must hash differently"
    assert block_hashes([1] * 16, 16, "m") != block_hashes([1] * 16, 16, "other-model")
    assert block_hashes([1, 2] * 8, 16, "m") != block_hashes([2, 1] * 8, 16, "m")


def test_module_imports_without_torch():
    code = "import sys, protos.block_hash; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
