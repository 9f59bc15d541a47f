"""Channels to the servers under test: plaintext or TLS / mutual TLS, and a bearer token.

Everything here is plain data (file contents already read), so it pickles into the
worker processes, which build their own channels: gRPC channels cannot cross a fork.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Connection:
    """How to reach a server: TLS material and the token, read once in the parent.

    Attributes
    ----------
    tls : bool
        Use TLS. With no ``root_certificates`` the system's roots verify the server.
    root_certificates : bytes or None
        PEM CA bundle that signed the server's certificate (``--tls-ca``).
    client_certificate, client_key : bytes or None
        PEM client certificate chain and key for mutual TLS (``--tls-cert``, ``--tls-key``).
    server_name : str or None
        Name to verify in the server's certificate instead of the target's host.
    token : str or None
        Sent as ``authorization: Bearer <token>`` metadata on every call.
    """

    tls: bool = False
    root_certificates: bytes | None = None
    client_certificate: bytes | None = None
    client_key: bytes | None = None
    server_name: str | None = None
    token: str | None = None

    @classmethod
    def from_options(
        cls,
        tls: bool = False,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        server_name: str | None = None,
        token: str | None = None,
    ) -> Connection:
        """Read the PEM files named on the command line; mTLS needs both cert and key."""
        if (cert is None) != (key is None):
            raise ValueError("mutual TLS needs both --tls-cert and --tls-key")

        def read(path: str | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return cls(
            tls=bool(tls or ca or cert),
            root_certificates=read(ca),
            client_certificate=read(cert),
            client_key=read(key),
            server_name=server_name,
            token=token or None,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        # Per-call metadata rather than call credentials: gRPC refuses call credentials on
        # a plaintext channel, and a token over plaintext is still useful on a private net.
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def options(self, extra: tuple[tuple[str, object], ...] = ()) -> list[tuple[str, object]]:
        options: list[tuple[str, object]] = [
            ("grpc.max_send_message_length", _MESSAGE_BYTES),
            ("grpc.max_receive_message_length", _MESSAGE_BYTES),
            # Channels of one process otherwise share one subchannel (one TCP connection)
            # when their arguments match, which would make --channels meaningless.
            ("grpc.use_local_subchannel_pool", 1),
            *extra,
        ]
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return options

    def aio_channel(self, target: str, index: int = 0) -> grpc.aio.Channel:
        """A grpc.aio channel to ``target``; ``index`` keeps several channels distinct."""
        options = self.options((("geonear.loadtest.channel", index),))
        if not self.tls:
            return grpc.aio.insecure_channel(target, options=options)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.client_key,
            certificate_chain=self.client_certificate,
        )
        return grpc.aio.secure_channel(target, credentials, options=options)
