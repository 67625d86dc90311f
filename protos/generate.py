"""Regenerate the Python code of protos/kvcascade.proto: ``python -m protos.generate [--check]``.

protoc writes ``import kvcascade_pb2`` into the gRPC module, which only works with protos/ on
sys.path; we rewrite it to ``from protos import kvcascade_pb2`` so the package imports cleanly.
``--check`` regenerates into a temporary folder and fails when the committed files differ, so CI
catches a .proto edited without regenerating.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
PROTO_NAME = "kvcascade.proto"
GENERATED = ("kvcascade_pb2.py", "kvcascade_pb2.pyi", "kvcascade_pb2_grpc.py")
_GRPC_IMPORT = re.compile(r"^import kvcascade_pb2 as (\w+)$", re.MULTILINE)


def generate(out_dir: Path) -> None:
    """Run protoc on the .proto into ``out_dir`` and fix the gRPC module's import."""
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_DIR / PROTO_NAME),
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    grpc_module = out_dir / "kvcascade_pb2_grpc.py"
    source = grpc_module.read_text()
    fixed, count = _GRPC_IMPORT.subn(r"from protos import kvcascade_pb2 as \1", source)
    if count != 1:
        raise SystemExit(f"expected one 'import kvcascade_pb2' in {grpc_module.name}, found {count}")
    grpc_module.write_text(fixed)


def stale_files(committed_dir: Path) -> list[str]:
    """The generated files that are missing from ``committed_dir`` or differ from a fresh run."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_dir = Path(tmp)
        generate(fresh_dir)
        return [
            name
            for name in GENERATED
            if not (committed_dir / name).exists()
            or not filecmp.cmp(fresh_dir / name, committed_dir / name, shallow=False)
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed generated files are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(PROTO_DIR)
        if stale:
            print(f"stale generated files: {', '.join(stale)}; run `python -m protos.generate`", file=sys.stderr)
            return 1
        print("generated files are up to date")
        return 0
    generate(PROTO_DIR)
    print(f"generated {', '.join(GENERATED)} in {PROTO_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
