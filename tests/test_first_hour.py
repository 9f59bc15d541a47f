"""A newcomer's first hour: starting a server, pointing commands at it, loading files,
reading errors and results, from the shell and from Python.

Servers are real (port 0, or a real ``geonear serve`` process); commands run through
``geonear.clients.cli.main`` in this process or as subprocesses where the exit status
and what a shell sees are the point.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from geonear.clients import cli
from geonear.clients.cli import main
from geonear.clients.client import Client

ENV = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1"}
TOKEN = "admin-token-0123456789abcdef"
STORES = pd.DataFrame(
    {
        "id": [1, 2, 3],
        "lat": [51.50, 51.52, 48.85],
        "lon": [-0.12, -0.10, 2.35],
        "city": ["London", "London", "Paris"],
    }
)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("GEONEAR_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(cli._console, "width", 250)


@pytest.fixture
def stores(client: Client) -> Client:
    client.upload("stores", STORES)
    return client


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's --help and usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def geonear_process(*args: str, env: dict[str, str] | None = None, **kw: Any):
    return subprocess.run(
        [sys.executable, "-m", "geonear", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in (env or ENV).items() if not k.startswith("GEONEAR_")},
        **kw,
    )


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# -- starting a server -------------------------------------------------------------------
@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_serve_on_a_taken_port_says_so_in_one_line_before_loading_anything(
    taken_port: int, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    result = geonear_process(
        "serve", "--demo", "--port", str(taken_port), "--data-dir", str(data), cwd=tmp_path
    )
    assert result.returncode != 0
    line = one_line(result.stderr)
    assert f"port {taken_port}" in line and "in use" in line and "--port" in line
    assert not data.exists()  # nothing loaded, nothing written


def serve_until_it_stops(tmp_path: Path, *args: str, **environment: str):
    """``geonear serve ARGS`` expected to stop at once (a timeout fails the test)."""
    env = {k: v for k, v in ENV.items() if not k.startswith("GEONEAR_")}
    return subprocess.run(
        [sys.executable, "-m", "geonear", "serve", "--data-dir", str(tmp_path / "data"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, **environment},
        cwd=tmp_path,
    )


def test_serve_backend_gpu_without_a_gpu_says_so_in_one_line(tmp_path: Path) -> None:
    from geonear.service.engines import gpu_available

    if gpu_available()[0]:
        pytest.skip("this host has a GPU")
    result = serve_until_it_stops(tmp_path, "--backend", "gpu", "--port", "0", "--demo")
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert "--backend gpu" in line and "GPU" in line and "--backend cpu" in line
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    ("args", "environment", "words"),
    [
        (["--port", "0", "--earth-radius-m", "-1"], {}, "--earth-radius-m"),
        ([], {"GEONEAR_PORT": "99999"}, "GEONEAR_PORT"),
        (["--port", "0", "--engine", "fastest"], {}, "unknown --engine 'fastest'"),
        (["--port", "0", "--tls-cert", "no.crt", "--tls-key", "no.key"], {}, "--tls-cert"),
        (["--port", "0", "--tls-cert", "only.crt"], {}, "tls_key"),
    ],
)
def test_serve_with_a_bad_setting_says_which_in_one_line(
    tmp_path: Path, args: list[str], environment: dict[str, str], words: str
) -> None:
    result = serve_until_it_stops(tmp_path, "--demo", *args, **environment)
    assert result.returncode == 2
    assert words in one_line(result.stderr)
    assert not (tmp_path / "data").exists()


# -- pointing commands at a server ---------------------------------------------------------
@pytest.mark.parametrize("command", ["knn", "load", "datasets"])
def test_help_shows_the_default_target(capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    assert "GEONEAR_TARGET" in out and "localhost:50051" in out


def test_every_command_takes_its_target_from_GEONEAR_TARGET(
    stores: Client, server, capsys: pytest.CaptureFixture[str], monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GEONEAR_TARGET", server.target)
    code, out, err = run(capsys, "datasets")
    assert code == 0, err
    assert "stores" in out
    code, out, err = run(capsys, "knn", "stores", "--lat", "51.51", "--lon=-0.11", "-k", "1")
    assert code == 0, err
    path = tmp_path / "more.csv"
    path.write_text("lat,lon\n1.0,2.0\n")
    code, out, err = run(capsys, "load", str(path), "--quiet")
    assert code == 0, err
    assert stores.info("more").rows == 1


@pytest.fixture
def secured(server_factory, tmp_path: Path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"admin {TOKEN} ops\n")
    return server_factory(auth_tokens=tokens)


def test_load_and_queries_send_the_token_from_the_flag_or_GEONEAR_TOKEN(
    secured, capsys: pytest.CaptureFixture[str], monkeypatch, tmp_path: Path
) -> None:
    path = tmp_path / "pts.csv"
    path.write_text("lat,lon\n1.0,2.0\n3.0,4.0\n")
    target = ["--target", secured.target]
    code, _, err = run(capsys, "load", str(path), "--quiet", *target)
    assert code == 1 and "UNAUTHENTICATED" in one_line(err)
    code, _, err = run(capsys, "load", str(path), "--quiet", "--token", TOKEN, *target)
    assert code == 0, err
    monkeypatch.setenv("GEONEAR_TOKEN", TOKEN)
    code, _, err = run(capsys, "load", str(path), "--name", "again", "--quiet", *target)
    assert code == 0, err
    code, out, err = run(capsys, "knn", "again", "--lat", "1", "--lon", "2", "-k", "1", *target)
    assert code == 0, err
    assert "0.000" in out  # the point itself, at 0 m


def _tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate, server key) for 127.0.0.1, in PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject: str, key: Any, issuer_key: Any, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, server_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    paths = directory / "ca.crt", directory / "server.crt", directory / "server.key"
    paths[0].write_bytes(
        certificate("test CA", ca_key, ca_key, True).public_bytes(serialization.Encoding.PEM)
    )
    paths[1].write_bytes(
        certificate("127.0.0.1", server_key, ca_key, False).public_bytes(serialization.Encoding.PEM)
    )
    paths[2].write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


def test_load_and_queries_take_tls_settings_from_the_environment(
    server_factory, capsys: pytest.CaptureFixture[str], monkeypatch, tmp_path: Path
) -> None:
    ca, cert, key = _tls_files(tmp_path)
    running = server_factory(tls_cert=cert, tls_key=key)
    path = tmp_path / "pts.csv"
    path.write_text("lat,lon\n1.0,2.0\n")
    monkeypatch.setenv("GEONEAR_TARGET", running.target)
    code, _, err = run(capsys, "load", str(path), "--quiet", "--timeout-s", "5")
    assert code == 1 and "UNAVAILABLE" in err  # plaintext to a TLS port
    monkeypatch.setenv("GEONEAR_TLS_CA", str(ca))
    code, _, err = run(capsys, "load", str(path), "--quiet")
    assert code == 0, err
    code, out, err = run(capsys, "info", "pts")
    assert code == 0 and "1 rows" in out, err


# -- errors in the command line's words -----------------------------------------------------
def test_cli_errors_speak_the_command_lines_words(
    stores: Client, server, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = ["--target", server.target]
    path = tmp_path / "stores.csv"
    STORES.to_csv(path, index=False)
    code, _, err = run(capsys, "load", str(path), "--quiet", *target)
    line = one_line(err)
    assert code == 1 and "--mode replace" in line and "use mode" not in line
    code, _, err = run(capsys, "knn", "store", "--lat", "0", "--lon", "0", *target)
    line = one_line(err)
    assert code == 1 and "did you mean 'stores'?" in line and "geonear datasets" in line
    assert "ListDatasets" not in line
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    STORES.to_csv(mixed / "a.csv", index=False)
    STORES.to_parquet(mixed / "b.parquet")
    code, _, err = run(capsys, "load", str(mixed), *target)
    line = one_line(err)
    assert code == 2 and "--format" in line and "format=" not in line


def test_no_server_at_the_target_says_how_to_start_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    code, _, err = run(capsys, "datasets", "--target", f"127.0.0.1:{port}", "--timeout-s", "10")
    line = one_line(err)
    assert code == 1
    assert f"127.0.0.1:{port}" in line and "geonear serve" in line
