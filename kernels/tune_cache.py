"""Tuned kernel configs kept on disk, so that a restart does not time every tile again.

The quantized engines' warm-up times each listed Gluon tile per projection shape and rows bucket
(kernels/wq_gluon_tune.py): 82-108 s of an 8B's start on an H200, against 19-28 s for bf16
(docs/BENCHMARKS.md). The choice depends only on the GPU, the software and the kernels' code, so
it is written here once and read at the next start.

One JSON file a fingerprint: the GPU's name, compute capability and SM count, torch's and
Triton's versions, a hash of the kernels' sources (a code change or a new tile list starts a new
file) and whatever else the caller says changes the timing (launch flags). Where:
``$KVCASCADE_TUNE_CACHE``, else ``$KVCASCADE_CACHE/tune``, else ``~/.cache/kvcascade/tune``;
``KVCASCADE_TUNE_CACHE=off`` (or 0) turns it off. Workers of one node (and the ranks of a
tensor-parallel one) may share the folder: a write takes an exclusive lock, merges with what is
on disk and replaces the file whole, so concurrent writers lose nothing and a reader never sees
half a file. A file that does not parse is reported and ignored (then replaced by the next write):
the cost of a bad cache is a warm-up that tunes again, never a failure.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT = "kvcascade-tune/1"


def cache_folder() -> Path | None:
    """The folder tuned configs live in, or None when turned off."""
    value = os.environ.get("KVCASCADE_TUNE_CACHE", "")
    if value.lower() in ("off", "0", "false", "no"):
        return None
    if value:
        return Path(value)
    base = os.environ.get("KVCASCADE_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "kvcascade") / "tune"


def source_hash(*paths: str | Path) -> str:
    """A short hash of the files' bytes: the code whose timing is cached."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


class TuneCache:
    """``get(key)`` / ``put(key, config, **facts)`` for one kernel family under one fingerprint
    (a dict of strings and numbers: what must match for a timing to hold)."""

    def __init__(self, name: str, fingerprint: dict, folder: Path | None = None):
        self.name, self.fingerprint = name, dict(fingerprint)
        digest = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        self.folder = folder if folder is not None else cache_folder()
        self.path = None if self.folder is None else self.folder / f"{name}-{digest}.json"
        self._entries: dict[str, dict] | None = None

    @staticmethod
    def key(parts: tuple) -> str:
        return ",".join(str(p) for p in parts)

    def _read(self) -> dict[str, dict]:
        """The file's entries; {} when absent, unreadable or not ours (said once in the log)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            log.warning("tune cache %s: ignored, it cannot be read (%s); tiles will be timed again", self.path, err)
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("fingerprint") != self.fingerprint \
                or not isinstance(data.get("entries"), dict):
            log.warning("tune cache %s: ignored, not a %s file for this fingerprint", self.path, FORMAT)
            return {}
        return {k: v for k, v in data["entries"].items() if isinstance(v, dict) and isinstance(v.get("config"), dict)}

    def get(self, key: str) -> dict | None:
        """The config cached for ``key``, or None."""
        if self.path is None:
            return None
        if self._entries is None:
            self._entries = self._read()
        entry = self._entries.get(key)
        return None if entry is None else dict(entry["config"])

    def put(self, key: str, config: dict, **facts) -> None:
        """Record ``config`` (JSON-able) for ``key`` with ``facts`` (timings, for whoever reads the
        file); merged into the file under a lock. A folder that cannot be written is reported and
        the config kept in memory only."""
        if self.path is None:
            return
        entry = {"config": dict(config), **facts}
        if self._entries is None:
            self._entries = self._read()
        self._entries[key] = entry
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / f".{self.path.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                merged = self._read()
                merged[key] = entry
                fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{self.path.name}.")
                try:
                    with os.fdopen(fd, "w") as out:
                        json.dump({"format": FORMAT, "fingerprint": self.fingerprint, "entries": merged}, out,
                                  indent=1, sort_keys=True)
                    os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep other users' workers from reading it
                    os.replace(tmp, self.path)
                except BaseException:
                    os.unlink(tmp)
                    raise
                self._entries = merged
        except OSError as err:
            log.warning("tune cache %s: not written (%s); this process keeps its timing", self.path, err)
