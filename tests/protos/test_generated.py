"""The committed protobuf code matches the .proto (the CI staleness check)."""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "protos.generate", "--check"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_grpc_module_imports_from_the_package() -> None:
    from protos import kvcascade_pb2_grpc

    assert kvcascade_pb2_grpc.kvcascade__pb2.__name__ == "protos.kvcascade_pb2"
