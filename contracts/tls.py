"""TLS for the servers clients reach (the router's gRPC and HTTP fronts): a certificate chain and
its private key, PEM files as a Kubernetes TLS Secret mounts them (tls.crt, tls.key)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsFiles:
    cert: str  # PEM: the server's certificate, then any intermediates
    key: str  # PEM: its private key

    def __post_init__(self) -> None:
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key)):
            try:
                text = Path(path).read_bytes()
            except OSError as err:
                raise ValueError(f"{flag} {path}: {err.strerror or err}") from None
            if b"-----BEGIN " not in text:
                raise ValueError(f"{flag} {path}: not a PEM file")

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())])
