"""A newcomer's first hour: starting a server, pointing commands at it, loading files,
reading errors and results, from the shell and from Python.

Servers are real (port 0, or a real ``geonear serve`` process); commands run through
``geonear.clients.cli.main`` in this process or as subprocesses where the exit status
and what a shell sees are the point.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

import geonear
from geonear.clients import cli
from geonear.clients.cli import main
from geonear.clients.client import Client
from geonear.loaders import ColumnError, InvalidPoints
from geonear.loaders.synthetic import uniform_points

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


# -- uploading from Python as geonear load does --------------------------------------------
def test_upload_detects_columns_as_geonear_load_does(client: Client) -> None:
    frame = pd.DataFrame(
        {"Code": ["a", "b"], "Latitude": [10.0, 20.0], "LNG": [30.0, 40.0], "size": [1, 2]}
    )
    info = client.upload("shops", frame)
    assert info.column_names == ["id", "lat", "lon", "size"]
    assert info.id_type == "string"
    found = client.knn("shops", 20.0, 40.0, k=1, columns="size")
    assert found["id"].tolist() == ["b"] and found["size"].tolist() == [2]


def test_upload_without_a_latitude_column_names_the_keyword(client: Client) -> None:
    with pytest.raises(ColumnError) as error:
        client.upload("nowhere", pd.DataFrame({"north": [1.0], "lon": [2.0]}))
    message = str(error.value)
    assert "lat=" in message and "lat_column" not in message
    assert "north" in message  # the columns found
    info = client.upload("somewhere", pd.DataFrame({"north": [1.0], "lon": [2.0]}), lat="north")
    assert info.rows == 1


def test_repeated_detected_ids_point_at_row_ids_not_at_dropping_rows(
    client: Client, server, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "dupnames.csv"
    path.write_text(
        "name,lat,lon\nSpringfield,39.8,-89.6\nSpringfield,42.1,-72.5\nBoston,42.4,-71.1\n"
    )
    code, _, err = run(capsys, "load", str(path), "--target", server.target)
    line = one_line(err)
    assert code == 2
    assert "--row-ids" in line and "--id COLUMN" in line and "'name'" in line
    assert "--skip-invalid" not in line
    code, _, err = run(capsys, "load", str(path), "--row-ids", "--quiet", "--target", server.target)
    assert code == 0, err
    assert client.info("dupnames").rows == 3
    with pytest.raises(InvalidPoints, match=r"id=False"):
        client.upload("dup2", pd.read_csv(path))
    assert client.upload("dup2", pd.read_csv(path), id=False).rows == 3


def test_upload_takes_a_geodataframe_and_a_geoseries(client: Client) -> None:
    geopandas = pytest.importorskip("geopandas")
    shops = geopandas.GeoDataFrame(
        {"id": [7, 8], "kind": ["bakery", "florist"]},
        geometry=geopandas.points_from_xy([2.35, -0.12], [48.85, 51.5]),
        crs="EPSG:4326",
    )
    info = client.upload("geo_shops", shops)
    assert info.rows == 2 and "kind" in info.column_names
    found = client.knn("geo_shops", 51.5, -0.12, k=1, columns=["kind"])
    assert found["id"].tolist() == [8] and found["kind"].tolist() == ["florist"]
    assert client.upload("geo_points", shops.geometry).rows == 2
    projected = shops.to_crs(3857)
    with pytest.raises(ValueError, match=r"to_crs\(4326\)"):
        client.upload("projected", projected)


# -- queries from frames, their index and columns kept -----------------------------------
def test_knn_of_a_dataframe_keeps_its_index_and_asked_for_columns(stores: Client) -> None:
    customers = pd.DataFrame(
        {"latitude": [51.51, 48.86], "longitude": [-0.11, 2.34], "customer": ["ann", "bo"]},
        index=pd.Index([100, 200], name="customer_no"),
    )
    found = stores.knn("stores", customers, k=2, columns="city", query_columns="customer")
    assert found.index.tolist() == [100, 100, 200, 200]
    assert found.index.name == "customer_no"
    assert found["customer"].tolist() == ["ann", "ann", "bo", "bo"]
    assert found["city"].tolist() == ["London", "London", "Paris", "London"]
    assert found["id"].tolist()[:1] == [2]
    everything = stores.knn("stores", customers, k=1, query_columns=True)
    assert {"latitude", "longitude", "customer"} <= set(everything.columns)
    series = stores.knn("stores", customers["latitude"], customers["longitude"], k=1)
    assert series.index.tolist() == [100, 200]
    with pytest.raises(TypeError, match="keyword"):
        stores.knn("stores", customers, 2)


def test_query_columns_whose_names_are_taken_are_prefixed(stores: Client) -> None:
    queries = pd.DataFrame({"lat": [51.51], "lon": [-0.11], "id": ["q1"], "city": ["here"]})
    found = stores.knn("stores", queries, k=1, columns=["city"], query_columns=True)
    assert list(found.columns) == [
        "query_index",
        "rank",
        "id",
        "distance_m",
        "city",
        "query_lat",
        "query_lon",
        "query_id",
        "query_city",
    ]
    assert found["query_id"].tolist() == ["q1"] and found["id"].tolist() == [2]


def test_a_string_of_columns_is_one_column_name(stores: Client) -> None:
    found = stores.knn("stores", 51.51, -0.11, k=1, columns="city")
    assert found["city"].tolist() == ["London"]
    found = stores.radius("stores", 51.51, -0.11, radius_m=5_000, columns="city")
    assert set(found["city"]) == {"London"}


def test_geoseries_queries_and_geodataframe_results(stores: Client) -> None:
    geopandas = pytest.importorskip("geopandas")
    points = geopandas.GeoSeries(
        geopandas.points_from_xy([-0.11, 2.34], [51.51, 48.86]), index=["a", "b"], crs=4326
    )
    found = stores.knn("stores", points, k=1, as_geo=True)
    assert isinstance(found, geopandas.GeoDataFrame)
    assert found.crs.to_epsg() == 4326
    assert found.index.tolist() == ["a", "b"] and found["id"].tolist() == [2, 3]
    assert found.geometry.geom_equals(points).all()  # each row's query point
    near = stores.radius("stores", points.to_frame("where"), radius_m=5_000, as_geo=True)
    assert set(near.index) == {"a", "b"}
    matrix = stores.distance_matrix(points, name="stores")
    assert matrix.shape == (2, 3)
    triangle = geopandas.GeoSeries.from_wkt(["POLYGON ((0 0, 1 0, 1 1, 0 0))"], crs=4326)
    with pytest.raises(ValueError, match="must be points"):
        stores.knn("stores", triangle, k=1)


def test_as_geo_without_geopandas_says_which_extra_to_install(
    stores: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from geonear.clients import query_points

    monkeypatch.setitem(sys.modules, "geopandas", None)  # as if it were not installed
    query_points.geopandas_module.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"pip install 'geonear\[geo\]'"):
            stores.knn("stores", 51.51, -0.11, k=1, as_geo=True)
    finally:
        query_points.geopandas_module.cache_clear()


def test_cli_queries_file_columns_come_along(
    stores: Client, server, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    customers = tmp_path / "customers.parquet"
    pd.DataFrame(
        {"id": [10, 20], "y": [51.51, 48.86], "x": [-0.11, 2.34], "segment": ["a", "b"]}
    ).to_parquet(customers)
    out = tmp_path / "nearest.parquet"
    code, _, err = run(
        capsys,
        "knn",
        "stores",
        "--queries",
        str(customers),
        "-k",
        "2",
        "--out",
        str(out),
        "--target",
        server.target,
    )
    assert code == 0, err
    table = pq.read_table(out).to_pandas()
    assert table["segment"].tolist() == ["a", "a", "b", "b"]
    assert table["query_id"].tolist() == [10, 10, 20, 20]
    assert table["query_lat"].tolist() == [51.51, 51.51, 48.86, 48.86]
    assert table["id"].tolist()[0] == 2


def test_radius_keeps_the_first_n_points_of_each_query_in_either_order(stores: Client) -> None:
    everything = stores.radius("stores", [51.51, 48.86], [-0.11, 2.34], radius_m=500_000)
    assert everything.groupby("query_index").size().tolist() == [3, 3]
    nearest = stores.radius(
        "stores", [51.51, 48.86], [-0.11, 2.34], radius_m=500_000, max_per_query=1
    )
    assert nearest["id"].tolist() == [2, 3]
    farthest = stores.radius(
        "stores", [51.51, 48.86], [-0.11, 2.34], radius_m=500_000, max_per_query=2, sort="desc"
    )
    assert farthest["query_index"].tolist() == [0, 0, 1, 1]
    assert farthest["id"].tolist()[0] == 3
    distances = farthest["distance_m"].to_numpy()
    assert distances[0] > distances[1] and distances[2] > distances[3]


# -- printing results ----------------------------------------------------------------------
@pytest.fixture
def many(client: Client) -> Client:
    lat, lon = uniform_points(500, seed=3)
    kind = np.where(np.arange(500) % 2 == 0, "shop", None)
    client.upload("many", pd.DataFrame({"lat": lat, "lon": lon, "kind": kind}))
    return client


def test_long_results_print_their_first_rows_and_say_how_to_get_the_rest(
    many: Client, server, capsys: pytest.CaptureFixture[str]
) -> None:
    target = ["--target", server.target]
    code, out, err = run(capsys, "knn", "many", "--lat", "0", "--lon", "0", "-k", "50", *target)
    assert code == 0, err
    assert "30 more rows: use --out FILE" in out
    assert out.count("\n│") == 20  # table rows
    code, out, _ = run(
        capsys, "knn", "many", "--lat", "0", "--lon", "0", "-k", "50", "--all", *target
    )
    assert "more rows" not in out and out.count("\n│") == 50
    code, out, _ = run(
        capsys, "knn", "many", "--lat", "0", "--lon", "0", "-k", "50", "--limit", "5", *target
    )
    assert "45 more rows" in out


def test_a_matrix_too_wide_to_print_is_refused_with_the_same_hint(
    many: Client, server, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = ["--target", server.target]
    code, out, err = run(capsys, "matrix", "many", "--lat", "0", "--lon", "0", *target)
    assert code == 2 and out == ""
    line = one_line(err)
    assert "1 x 500" in line and "--out FILE" in line
    npy = tmp_path / "m.npy"
    code, _, err = run(
        capsys, "matrix", "many", "--lat", "0", "--lon", "0", "--out", str(npy), *target
    )
    assert code == 0, err
    assert np.load(npy).shape == (1, 500)


def test_missing_values_print_as_na_not_nan(
    many: Client, server, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(
        capsys,
        "knn",
        "many",
        "--lat",
        "0",
        "--lon",
        "0",
        "-k",
        "10",
        "--columns",
        "kind",
        "--target",
        server.target,
    )
    assert code == 0, err
    assert "<NA>" in out and "shop" in out
    assert "nan" not in out and "None" not in out


# -- what the client returns ---------------------------------------------------------------
def test_results_are_readable_dataclasses_and_the_client_says_what_it_is(
    stores: Client, server
) -> None:
    info = stores.info("stores")
    assert repr(info).startswith("DatasetInfo(name='stores', version=1, rows=3,")
    assert info.column_names == ["id", "lat", "lon", "city"]
    assert info.bounding_box.max_lat == 51.52
    assert stores.datasets() == [info]
    limits = stores.server_info().limits
    assert repr(limits).startswith("ServerLimits(max_k=")
    deleted = stores.delete("stores", [3, 99])
    assert (deleted.rows_deleted, deleted.ids_not_found, deleted.dataset.rows) == (1, 1, 2)
    assert repr(stores) == f"Client({server.target!r}, remote server, open)"
    with geonear.connect() as local:
        assert "in-process server, open" in repr(local)
    assert "closed" in repr(local)


# -- load tests that fail say so -------------------------------------------------------------
def test_a_load_test_whose_requests_fail_exits_non_zero_and_shows_the_errors(
    stores: Client, server, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def loadtest(k: int, *more: str) -> tuple[int, str, str]:
        target = ["--target", server.target, "--dataset", "stores", "--concurrency", "2"]
        window = ["--duration", "0.3", "--warmup", "0"]
        return run(capsys, "loadtest", *target, "-k", str(k), *window, *more)

    html, json_path = tmp_path / "report.html", tmp_path / "run.json"
    code, out, err = loadtest(20_000, "--html", str(html), "--json", str(json_path))  # > max_k
    assert code == 1
    assert "requests failed" in out and "RESOURCE_EXHAUSTED: k=20000 exceeds max_k" in out
    assert "--max-error-rate" in err and "max_k" in err
    page = html.read_text()
    assert "<h2>Errors</h2>" in page and "k=20000 exceeds max_k" in page
    (saved,) = json.loads(json_path.read_text())["runs"]
    (first,) = saved["error_messages"]
    assert first["code"] == "RESOURCE_EXHAUSTED" and first["count"] == saved["requests"]
    code, _, _ = loadtest(20_000, "--max-error-rate", "1")
    assert code == 0
    code, _, err = loadtest(1)
    assert code == 0, err


# -- the rest of the first hour -------------------------------------------------------------
def test_standard_input_is_read_in_the_format_given_or_shown(
    client: Client, server, tmp_path: Path
) -> None:
    feature = {
        "type": "Feature",
        "geometry": {"type": "Point", "coordinates": [2.35, 48.85]},
        "properties": {"name": "Paris"},
    }
    text = json.dumps({"type": "FeatureCollection", "features": [feature]})
    result = geonear_process(
        "load",
        "-",
        "--format",
        "geojson",
        "--name",
        "piped_geojson",
        "--target",
        server.target,
        input=text,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert client.info("piped_geojson").rows == 1
    parquet = tmp_path / "pts.parquet"
    pd.DataFrame({"lat": [1.0, 2.0], "lon": [3.0, 4.0]}).to_parquet(parquet)
    with parquet.open("rb") as stdin:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "geonear",
                "load",
                "-",
                "--name",
                "piped_parquet",
                "--target",
                server.target,
            ],
            stdin=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            env=ENV,
            cwd=tmp_path,
        )
    assert result.returncode == 0, result.stderr
    assert client.info("piped_parquet").rows == 2


@pytest.mark.parametrize(
    ("command", "option", "words"),
    [
        ("knn", "-k K", "neighbours per query (default: 10)"),
        ("knn", "--max-distance-m METRES", "farther than this"),
        ("radius", "--radius-m METRES", "search radius, metres"),
        ("radius", "--max-per-query N", "GEOSEARCH COUNT"),
        ("kmeans", "--seed SEED", "seed of the k-means++ initialisation (default: 0)"),
        ("kmeans", "--n-init N_INIT", "lowest inertia wins (default: 1)"),
        ("kmeans", "--max-iter MAX_ITER", "iterations of each run (default: 100)"),
        ("kmeans", "--tol TOL", "radians (default: 1e-06)"),
    ],
)
def test_options_say_what_they_do_and_their_default(
    capsys: pytest.CaptureFixture[str], monkeypatch, command: str, option: str, words: str
) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # one line per option
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    lines = out.splitlines()
    (at,) = [i for i, x in enumerate(lines) if x.strip().startswith(option)]
    entry = lines[at] + " " + (lines[at + 1].strip() if lines[at + 1].startswith("    ") else "")
    assert words in " ".join(entry.split())


def test_matrix_offers_no_columns_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "matrix", "--help")
    assert code == 0 and "--columns" not in out and "--out FILE" in out


def test_kmeans_out_writes_each_points_cluster(
    many: Client, server, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "labels.csv"
    code, printed, err = run(
        capsys, "kmeans", "many", "-k", "4", "--out", str(out), "--target", server.target
    )
    assert code == 0, err
    assert "4 clusters of many" in printed and "wrote 500 labels" in printed
    labels = pd.read_csv(out)
    assert list(labels.columns) == ["id", "cluster"] and len(labels) == 500
    assert set(labels["cluster"]) == {0, 1, 2, 3}


def test_a_decimal_comma_gets_a_hint(
    client: Client, server, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = ["--target", server.target]
    code, _, err = run(capsys, "knn", "x", "--lat", "40,7", "--lon", "-74", *target)
    assert code == 2
    assert "use a decimal point (40.7); separate several points with commas" in one_line(err)
    code, _, err = run(capsys, "knn", "x", "--lat", "40;7", "--lon", "-74", *target)
    assert code == 2 and "use a decimal point (40.7)" in err
    path = tmp_path / "european.csv"
    path.write_text("name;lat;lon\nA;40,7;-74,0\nB;41,1;-73,2\n")
    code, _, err = run(capsys, "load", str(path), *target)
    line = one_line(err)
    assert code == 2 and "not a number" in line and "40.7, not 40,7" in line
    with pytest.raises(ValueError, match=r"use a decimal point \(40\.7\)"):
        client.knn("x", "40,7", "-74")
