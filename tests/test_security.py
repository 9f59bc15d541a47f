"""Security: TLS, mutual TLS and bearer tokens with read and admin scopes.

Certificates are made here with the ``cryptography`` package: a CA, a server
certificate for 127.0.0.1/localhost, and client certificates from that CA and from a
stranger's CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pyarrow as pa
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

import geonear
from geonear.clients.errors import PermissionDenied, Unauthenticated, Unavailable
from geonear.service.auth import TokenCheck, TokenFileError, bearer_token, parse_tokens
from geonear.service.server import build_server, exposure_warning
from geonear.service.settings import ServerSettings

ADMIN = "admin-token-0123456789abcdef"
READER = "read-token-0123456789abcdef"
POINTS = pa.table({"lat": [51.5, 48.9, 40.7], "lon": [-0.1, 2.35, -74.0]})


# -- certificates -------------------------------------------------------------------------
@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: str,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    hosts: tuple[str, ...] = (),
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if hosts:
        names: list[x509.GeneralName] = [x509.DNSName("localhost")]
        names += [x509.IPAddress(ipaddress.ip_address(h)) for h in hosts]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(
    path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> tuple[Path, Path]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path.with_suffix(".crt"), path.with_suffix(".key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key, stranger_ca_key = _key(), _key()
    ca = _certificate("geonear test CA", ca_key, "geonear test CA", ca_key, ca=True)
    ca_path, _ = _write(d / "ca", ca, ca_key)
    server_key = _key()
    server = _certificate("127.0.0.1", server_key, "geonear test CA", ca_key, hosts=("127.0.0.1",))
    server_cert, server_key_path = _write(d / "server", server, server_key)
    client_key = _key()
    client = _certificate("analyst", client_key, "geonear test CA", ca_key)
    client_cert, client_key_path = _write(d / "client", client, client_key)
    stranger_key = _key()
    stranger = _certificate("stranger", stranger_key, "other CA", stranger_ca_key)
    stranger_cert, stranger_key_path = _write(d / "stranger", stranger, stranger_key)
    return Pki(
        ca_path,
        server_cert,
        server_key_path,
        client_cert,
        client_key_path,
        stranger_cert,
        stranger_key_path,
    )


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(f"# scope token name\nadmin {ADMIN} ops\n\nread {READER} dashboard\n")
    return path


def _start(tmp_path: Path, **settings):
    parts = build_server(
        ServerSettings(
            host="127.0.0.1", port=0, data_dir=tmp_path / "data", backend="cpu", **settings
        )
    )
    parts.server.start()
    return parts


# -- tokens ---------------------------------------------------------------------------------
def test_token_file_format_and_its_errors() -> None:
    tokens = parse_tokens(f"admin {ADMIN} ops\nread {READER}\n# comment\n")
    check = TokenCheck(tokens)
    assert check.scope_of(ADMIN) == "admin"
    assert check.scope_of(READER) == "read"
    assert check.scope_of(READER[:-1]) is None
    assert check.scope_of("") is None
    for text, words in (
        (f"write {ADMIN}", "scope must be one of read, admin"),
        ("read short", "at least 16"),
        (f"read {READER}\nadmin {READER}", "line 2: this token appears twice"),
        (f"read {READER} name extra", "expected 'scope token [name]'"),
        ("# nothing\n", "no tokens"),
    ):
        with pytest.raises(TokenFileError, match=re.escape(words)):
            parse_tokens(text)


def test_bearer_token_parsing() -> None:
    assert bearer_token([("authorization", f"Bearer {READER}")]) == READER
    assert bearer_token([("authorization", f"bearer   {READER} ")]) == READER
    assert bearer_token([("authorization", f"Basic {READER}")]) is None
    assert bearer_token([("x-other", "1")]) is None
    assert bearer_token(None) is None


def test_tokens_allow_by_scope_and_refuse_with_the_right_codes(tmp_path, token_file) -> None:
    parts = _start(tmp_path, auth_tokens=token_file)
    target = f"127.0.0.1:{parts.port}"
    try:
        with geonear.connect(target, token=ADMIN, timeout_s=30) as admin:
            admin.upload("pts", POINTS)
            assert admin.info("pts").rows == 3
        with geonear.connect(target, token=READER, timeout_s=30) as reader:
            assert reader.knn("pts", 51.5, -0.1, k=1)["id"].tolist() == [0]
            assert [d.name for d in reader.datasets()] == ["pts"]
            for change in (
                lambda: reader.upload("other", POINTS),
                lambda: reader.delete("pts", [0]),
                lambda: reader.drop("pts"),
            ):
                with pytest.raises(PermissionDenied, match="admin token"):
                    change()
        with geonear.connect(target, timeout_s=30) as anonymous:
            with pytest.raises(Unauthenticated, match="authorization: Bearer"):
                anonymous.datasets()
            with pytest.raises(Unauthenticated, match="authorization: Bearer"):
                anonymous.upload("other", POINTS)
        guesser = geonear.connect(target, token=ADMIN[:-1] + "X", timeout_s=30)
        with guesser, pytest.raises(Unauthenticated, match="not one this server knows"):
            guesser.server_info()
        # nothing the refused calls tried was stored
        assert [d.name for d in parts.store.datasets()] == ["pts"]
        assert parts.store.get("pts").rows == 3
        # health checks stay open
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        parts.stop(None)


# -- TLS ------------------------------------------------------------------------------------
def test_tls_serves_clients_that_trust_its_ca(tmp_path, pki) -> None:
    parts = _start(tmp_path, tls_cert=pki.server_cert, tls_key=pki.server_key)
    target = f"127.0.0.1:{parts.port}"
    try:
        with geonear.connect(target, tls_ca=pki.ca, timeout_s=30) as client:
            client.upload("pts", POINTS)
            assert client.info("pts").rows == 3
        with geonear.connect(target, tls_ca=pki.ca.read_bytes(), timeout_s=30) as client:
            assert client.server_info().backend == "cpu"
        # plaintext to a TLS port fails to connect, as does TLS without trusting the CA
        with geonear.connect(target, timeout_s=5) as plaintext, pytest.raises(Unavailable):
            plaintext.datasets()
        wrong = geonear.connect(target, tls_ca=pki.stranger_cert, timeout_s=5)
        with wrong, pytest.raises(Unavailable):
            wrong.datasets()
    finally:
        parts.stop(None)


def test_mutual_tls_needs_a_client_certificate_from_its_ca(tmp_path, pki, token_file) -> None:
    parts = _start(
        tmp_path,
        tls_cert=pki.server_cert,
        tls_key=pki.server_key,
        tls_client_ca=pki.ca,
        auth_tokens=token_file,
    )
    target = f"127.0.0.1:{parts.port}"
    try:
        with geonear.connect(
            target,
            tls_ca=pki.ca,
            tls_cert=pki.client_cert,
            tls_key=pki.client_key,
            token=ADMIN,
            timeout_s=30,
        ) as client:
            client.upload("pts", POINTS)
            assert client.info("pts").rows == 3
        no_cert = geonear.connect(target, tls_ca=pki.ca, token=ADMIN, timeout_s=5)
        with no_cert, pytest.raises(Unavailable):
            no_cert.datasets()
        with (
            geonear.connect(
                target,
                tls_ca=pki.ca,
                tls_cert=pki.stranger_cert,
                tls_key=pki.stranger_key,
                token=ADMIN,
                timeout_s=5,
            ) as stranger,
            pytest.raises(Unavailable),
        ):
            stranger.datasets()
    finally:
        parts.stop(None)


def test_client_needs_both_certificate_and_key(pki) -> None:
    with pytest.raises(ValueError, match="both tls_cert and tls_key"):
        geonear.connect("127.0.0.1:1", tls_ca=pki.ca, tls_cert=pki.client_cert)


def test_settings_need_both_certificate_and_key(pki) -> None:
    with pytest.raises(ValueError, match="both tls_cert and tls_key"):
        ServerSettings(tls_cert=pki.server_cert)
    with pytest.raises(ValueError, match="needs tls_cert"):
        ServerSettings(tls_client_ca=pki.ca)


# -- the exposure warning -------------------------------------------------------------------
def test_binding_beyond_loopback_without_tls_or_tokens_warns(tmp_path, pki, token_file) -> None:
    assert exposure_warning(ServerSettings(host="127.0.0.1")) is None
    assert exposure_warning(ServerSettings(host="::1")) is None
    bare = exposure_warning(ServerSettings(host="0.0.0.0"))
    assert bare is not None and "without TLS or tokens" in bare
    tokens_only = exposure_warning(ServerSettings(host="0.0.0.0", auth_tokens=token_file))
    assert tokens_only is not None and "without TLS:" in tokens_only
    tls_only = exposure_warning(
        ServerSettings(host="0.0.0.0", tls_cert=pki.server_cert, tls_key=pki.server_key)
    )
    assert tls_only is not None and "without tokens:" in tls_only
    both = ServerSettings(
        host="0.0.0.0", tls_cert=pki.server_cert, tls_key=pki.server_key, auth_tokens=token_file
    )
    assert exposure_warning(both) is None


# -- the command line -------------------------------------------------------------------------
def test_cli_client_commands_take_tls_and_token_options(tmp_path, pki, token_file) -> None:
    parts = _start(
        tmp_path, tls_cert=pki.server_cert, tls_key=pki.server_key, auth_tokens=token_file
    )
    target = f"127.0.0.1:{parts.port}"
    try:
        with geonear.connect(target, tls_ca=pki.ca, token=ADMIN, timeout_s=30) as client:
            client.upload("pts", POINTS)
        base = [sys.executable, "-m", "geonear"]
        ok = subprocess.run(
            [*base, "datasets", "--target", target, "--tls-ca", str(pki.ca), "--token", READER],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        assert ok.returncode == 0, ok.stderr
        assert "pts" in ok.stdout
        denied = subprocess.run(
            [*base, "drop", "pts", "--target", target, "--tls-ca", str(pki.ca), "--token", READER],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        assert denied.returncode == 1
        assert "PERMISSION_DENIED" in denied.stderr
        assert parts.store.get("pts").rows == 3
    finally:
        parts.stop(None)


def test_serve_refuses_a_bad_token_file(tmp_path) -> None:
    bad = tmp_path / "tokens"
    bad.write_text("owner abcdefghijklmnopqrstuvwxyz\n")
    result = subprocess.run(
        [sys.executable, "-m", "geonear", "serve", "--port", "0", "--memory-only",
         "--backend", "cpu", "--auth-tokens", str(bad)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "line 1: scope must be one of read, admin" in result.stderr


def test_server_logs_how_it_is_protected(tmp_path, pki, token_file, caplog) -> None:
    caplog.set_level(logging.INFO, logger="geonear.server")
    parts = _start(
        tmp_path, tls_cert=pki.server_cert, tls_key=pki.server_key, auth_tokens=token_file
    )
    parts.stop(None)
    assert "TLS; 2 bearer token(s)" in caplog.text
